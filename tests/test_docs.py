"""The docs pages keep their promises: every concept page shows its tests, and its diagrams parse."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
CONCEPT_PAGES = ["backend-selection", "timeouts", "sharding", "averaging", "bucketing", "no-sync", "buffers",
                 "unused-parameters", "ddp", "trainer", "launching", "testing", "join", "desync", "failures",
                 "your-script", "your-framework",
                 "comm-hooks", "costmodel", "start-here", "beyond-ddp", "zero", "fsdp"]


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



def _renderer(fold: bool):
    """A Markdown converter with the site's own extensions (mkdocs.yml), with or without the fold hook."""
    import sys

    import markdown
    from mkdocs.config import load_config

    config = load_config(str(DOCS.parent / "mkdocs.yml"))
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        from solutions import on_config
    finally:
        sys.path.pop(0)
    config["markdown_extensions"] = [e for e in config["markdown_extensions"]
                                     if type(e).__name__ != "SolutionsExtension"]
    if fold:
        on_config(config)
    md = markdown.Markdown(extensions=config["markdown_extensions"], extension_configs=config["mdx_configs"])
    return lambda page: md.reset().convert((DOCS / page).read_text(encoding="utf-8"))


def _lines(rendered_html: str) -> set[str]:
    import html

    return {line.strip() for line in html.unescape(re.sub(r"<[^>]+>", "", rendered_html)).splitlines()}


def _solution_lines(source: Path) -> set[str]:
    """The lines of the source's solution blocks that appear nowhere else in it."""
    from miniddp.teaching.exercise.skeleton import BEGIN, END

    text = source.read_text(encoding="utf-8")
    parts = [block.split(END) for block in text.split(BEGIN)[1:]]
    inside = {line.strip() for block, *_ in parts for line in block.splitlines()}
    outside = {line.strip() for chunk in [text.split(BEGIN)[0]] + [rest for _, *tail in parts for rest in tail]
               for line in chunk.splitlines()}
    return {line for line in inside - outside if len(line) > 25}


def test_the_pages_the_checker_links_to_fold_every_solution():
    """``miniddp exercise check`` names docs/<page>: no line of an exercise's solution is shown open there."""
    from miniddp.teaching.exercise.catalog import EXERCISES

    pages: dict[str, set[str]] = {}
    for e in EXERCISES:
        pages.setdefault(e.page, set()).update(_solution_lines(DOCS.parent / e.source))
    render = _renderer(fold=True)
    for page, solution in sorted(pages.items()):
        rendered = render(page)
        everything, opened = _lines(rendered), _lines(re.sub(r"<details.*?</details>", "", rendered, flags=re.S))
        shown = solution & everything
        assert shown, f"{page}: no solution on the page at all (the check below would be vacuous)"
        assert not {"### BEGIN SOLUTION", "### END SOLUTION"} & everything, page
        assert not shown & opened, f"{page}: solution lines outside a fold"
    # the negative control: without the hook, the same page shows a solution open
    assert "### BEGIN SOLUTION" in _lines(_renderer(fold=False)("averaging.md"))
