"""The docs pages keep their promises: every concept page shows its tests, and its diagrams parse."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
CONCEPT_PAGES = ["backend-selection", "timeouts", "sharding", "averaging", "bucketing", "no-sync", "buffers",
                 "unused-parameters", "ddp", "trainer", "launching", "testing", "join", "desync", "failures",
                 "your-script",
                 "comm-hooks", "costmodel", "start-here", "beyond-ddp"]


@pytest.mark.parametrize("page", CONCEPT_PAGES)
def test_concept_pages_include_real_code_and_their_tests(page):
    text = (DOCS / f"{page}.md").read_text()
    assert "## The tests that define it" in text
    assert re.search(r'--8<-- "tests/test_[a-z_]+\.py"', text), "the page must include its test file"
    real_source = r'--8<-- "(miniddp|docs/examples|examples|benchmarks)/[a-z_./]+(:[a-z_]+)?"'
    assert re.search(real_source, text), "and real source"


@pytest.mark.parametrize("page", sorted(p.stem for p in DOCS.glob("*.md")))
def test_mermaid_diagrams_have_no_statement_separators_in_labels(page):
    # mermaid reads ';' as the end of a statement: a label containing one breaks every diagram on the page
    for block in re.findall(r"```mermaid\n(.*?)```", (DOCS / f"{page}.md").read_text(), re.S):
        assert ";" not in block, block
