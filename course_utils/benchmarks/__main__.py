"""``python -m course_utils.benchmarks [NAME ...]``: re-measure records on a GPU machine."""

import sys

from ..bench import save_record
from . import RECORDS

names = sys.argv[1:] or list(RECORDS)
unknown = [n for n in names if n not in RECORDS]
if unknown:
    sys.exit(f"unknown record(s) {unknown}; known: {sorted(RECORDS)}")
for name in names:
    print(f"== {name}", flush=True)
    save_record(name, RECORDS[name]())
