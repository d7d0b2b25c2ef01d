"""``python -m course_utils.measure.benchmarks [NAME ...]``: re-measure records on a GPU machine."""

import sys

from ..bench import save_record
from . import MULTI_GPU_RECORDS, RECORDS

names = sys.argv[1:] or [name for name in RECORDS if name not in MULTI_GPU_RECORDS]
unknown = [n for n in names if n not in RECORDS]
if unknown:
    sys.exit(f"unknown record(s) {unknown}; known: {sorted(RECORDS)}")
for name in names:
    print(f"== {name}", flush=True)
    save_record(name, RECORDS[name]())
