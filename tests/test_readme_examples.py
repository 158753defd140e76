"""Every ```python block of the README runs as written, on the CPU, each in fresh globals (the
```py blocks are excerpts of files, not meant to run on their own)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_readme_has_its_examples():
    # A fence renamed by mistake would drop an example from the test without a word.
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    exec(compile(BLOCKS[index], f"README.md ```python block {index}", "exec"), {"__name__": "readme_example"})
