"""The README's numbers are the stored records' numbers."""

import re
from pathlib import Path

from course_utils.tooling.summary import headline_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_summary_is_generated_from_records():
    text = README.read_text()
    block = re.search(r"<!-- summary:start.*?-->\n(.*?)\n<!-- summary:end -->", text, re.S)
    assert block, "README lost its summary markers"
    assert block.group(1).strip() == headline_table().strip(), \
        "README summary is stale: paste the output of `python -m course_utils.tooling.summary`"


def test_readme_links_every_notebook():
    text = README.read_text()
    for notebook in sorted((README.parent / "notebooks").glob("[0-9][0-9]_*.py")):
        assert f"notebooks/{notebook.stem}.ipynb" in text
