"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh namespace.

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
as a reader's CPU run does with the variable set; examples that need a GPU, a server or slime are
written to run without one (the client example parses a canned answer) or are not Python blocks.
"""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```\s*$", flags=re.M | re.S)


def python_blocks(markdown: str):
    """(line number of the opening fence, code) for each ```python block."""
    for match in FENCE.finditer(markdown):
        if match.group(1) == "python":
            yield markdown.count("\n", 0, match.start()) + 1, match.group(2)


EXAMPLES = [
    pytest.param(f"{document.relative_to(ROOT).as_posix()}:{line}", code, id=f"{document.relative_to(ROOT).as_posix()}:{line}")
    for document in DOCUMENTS
    for line, code in python_blocks(document.read_text())
]


def test_the_readme_has_an_example_per_entry_point():
    readme = "\n".join(code for _, code in python_blocks((ROOT / "README.md").read_text()))
    for entry_point in ("token_stats(", "linear_token_stats(", "segment_sum(", "add_fusedrl_arguments(", "parse_token_samples("):
        assert entry_point in readme, entry_point


def test_python_blocks_are_found():
    blocks = list(python_blocks("text\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n```\n"))
    assert blocks == [(2, "x = 1\n"), (8, "y = 2\n")]


@pytest.mark.parametrize("where, code", EXAMPLES)
def test_example_runs(where, code):
    torch.manual_seed(0)
    exec(compile(code, where, "exec"), {"__name__": "__doc_example__"})
