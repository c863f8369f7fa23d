"""Every relative link in README.md and docs/*.md resolves (file, and heading anchor when given),
and every `docs/...` file the code or docs cite exists."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED_DOC = re.compile(r"\bdocs/[\w.-]+\.md\b")
SOURCE_SUFFIXES = {".py", ".md", ".sh", ".ini", ".txt"}
SKIPPED = {"build", "results", "__pycache__"}


def _without_code(text: str) -> str:
    """Markdown outside fenced code blocks (links in code samples are not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def heading_anchors(markdown: str) -> set:
    """GitHub's anchors for the headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*$", _without_code(markdown), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def relative_links(document: Path):
    for target in LINK.findall(_without_code(document.read_text())):
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
            yield target


def test_docs_folder_has_the_guides():
    assert {path.name for path in DOCUMENTS[1:]} >= {"math.md", "slime.md", "sglang.md", "benchmarks.md"}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_resolve(document):
    broken = []
    for target in relative_links(document):
        path_part, _, anchor = target.partition("#")
        resolved = (document.parent / path_part).resolve() if path_part else document
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


def project_files():
    """The project's text sources: hidden folders (.git, .venv), build outputs and results skipped."""
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name not in SKIPPED]
        yield from (Path(folder, name) for name in files if Path(name).suffix in SOURCE_SUFFIXES)


def test_cited_docs_exist():
    missing = {
        f"{path.relative_to(ROOT)} cites {cited}"
        for path in project_files()
        for cited in CITED_DOC.findall(path.read_text(errors="replace"))
        if not (ROOT / cited).exists()
    }
    assert not missing, sorted(missing)


def test_anchor_rule_matches_github():
    assert heading_anchors("## Score-function centering (SFC)\n### (a) The init hook: `--x`\n") == {
        "score-function-centering-sfc",
        "a-the-init-hook---x",
    }
