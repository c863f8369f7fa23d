"""The README's benchmark figures have one source: docs/results.md's CPU benchmark section, the
whole output of `python -m bench` at a stated commit. The README quotes that run's closing lines
(`bench/summary.py`) verbatim and names the same commit, so a re-measured table that is not
carried into the README (or a README edited by hand) fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLOSING_LINE = re.compile(r"^(token_stats|segment_sum|linear_token_stats) fwd\+bwd, \d+ cases: .*$", re.M)
COMMIT = re.compile(r"commit\s+([0-9a-f]{7,40})")


def _section(markdown: str, heading: str) -> str:
    start = markdown.index(heading)
    end = markdown.find("\n## ", start + len(heading))
    return markdown[start : end if end != -1 else None]


def test_readme_quotes_the_results_tables_closing_lines_and_commit():
    readme = _section((ROOT / "README.md").read_text(), "## Benchmarks")
    results = _section((ROOT / "docs" / "results.md").read_text(), "## CPU benchmark")
    quoted = [match.group(0) for match in CLOSING_LINE.finditer(readme)]
    measured = [match.group(0) for match in CLOSING_LINE.finditer(results)]
    assert quoted, "the README's Benchmarks section quotes no closing line of python -m bench"
    assert quoted == measured, "the README's figures differ from docs/results.md's CPU benchmark run"
    assert set(COMMIT.findall(readme)) == set(COMMIT.findall(results)) != set(), "the two name different commits"
