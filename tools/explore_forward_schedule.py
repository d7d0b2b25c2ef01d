"""Exploration run (H100): does the overlapped softmax schedule beat the default pipeline?

Prints a table and writes the rows to $OUT/explore_forward_schedule.json. Not a course record.
"""
import json
import os

from course_utils.attention import ForwardConfig
from course_utils.experiments import forward_config_sweep

configs = [ForwardConfig(128, 128, s, 256, True) for s in (1, 2, 3)]
configs += [ForwardConfig(128, 64, 2, 256, True), ForwardConfig(128, 128, 2, 256, False)]
rows = forward_config_sweep(configs=configs)
for r in rows:
    print(r["block_M"], r["block_N"], r["num_stages"], r["threads"], r["overlap_softmax"], r["causal"],
          round(r.get("tflops") or 0), r["error"])
with open(os.path.join(os.environ.get("OUT", "/tmp"), "explore_forward_schedule.json"), "w") as f:
    json.dump(rows, f, indent=1)
