"""The docs hook (docs/hooks/links.py) links references, adds "Next" footers, and fixes the API page.

The Markdown side runs the hook's functions on every page's source (fast, no MkDocs);
the API page is built once, alone, through MkDocs with the hook and mkdocstrings,
so this works whether or not mkdocs.yml registers the hook yet.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HOOK = DOCS / "hooks" / "links.py"

_spec = importlib.util.spec_from_file_location("miniddp_docs_links_hook", HOOK)
links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(links)

PAGES = sorted(p.name for p in DOCS.glob("*.md"))
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def transformed(page: str) -> str:
    return links.transform_markdown((DOCS / page).read_text(encoding="utf-8"), page, DOCS, Counter())


def protected_lines(markdown: str) -> list[str]:
    """Lines the hook must never change: fenced code, headings, snippet includes."""
    kept, fence = [], None
    for line in markdown.split("\n"):
        m = FENCE.match(line)
        if fence:
            kept.append(line)
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
        elif m:
            kept.append(line)
            fence = m.group(1)
        elif re.match(r"\s*(#{1,6} |-{1,}8<-{1,})", line):
            kept.append(line)
    return kept


def test_references_in_prose_become_links_and_code_headings_links_stay_alone():
    md = "\n".join([
        "# Heading about torch/nn/parallel/distributed.py and arXiv 2006.15704",
        "",
        "The DDP paper (arXiv 2006.15704) and `torch/nn/parallel/distributed.py`, also `reducer.cpp`;",
        "see pytorch/pytorch#149781 (pytorch#33148, #38174) and [a link about arXiv 1905.13727](https://x.org).",
        "This project's issue 11 and step #12 are not upstream; `torch.distributed.all_reduce` then",
        "torch.distributed.all_reduce again; https://example.org/torch/nn/parallel/distributed.py stays.",
        "",
        "```python",
        "# arXiv 2006.15704 torch/nn/parallel/distributed.py pytorch#33148 torch.distributed.all_reduce",
        "```",
        "",
        '--8<-- "torch/nn/parallel/distributed.py"',
    ])
    out = links.transform_markdown(md, "nowhere.md", DOCS, Counter())
    assert "[arXiv 2006.15704](https://arxiv.org/abs/2006.15704)" in out
    assert ("[`torch/nn/parallel/distributed.py`](https://github.com/pytorch/pytorch/blob/v2.13.0/"
            "torch/nn/parallel/distributed.py)") in out
    reducer = "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/reducer.cpp"
    assert f"[`reducer.cpp`]({reducer})" in out
    assert "[pytorch/pytorch#149781](https://github.com/pytorch/pytorch/issues/149781)" in out
    assert ("[pytorch#33148](https://github.com/pytorch/pytorch/issues/33148), "
            "[#38174](https://github.com/pytorch/pytorch/issues/38174)") in out
    # first mention of an API name only
    assert out.count("distributed.html#torch.distributed.all_reduce") == 1
    assert "[`torch.distributed.all_reduce`](" in out
    # untouched: the heading, an existing link, this project's issue numbers, a URL, fenced code, a snippet
    assert protected_lines(out) == protected_lines(md)
    assert "[a link about arXiv 1905.13727](https://x.org)" in out
    assert "issue 11 and step #12 are not upstream" in out
    assert "https://example.org/torch/nn/parallel/distributed.py stays" in out


@pytest.mark.parametrize("page", PAGES)
def test_no_link_is_added_inside_fenced_code_headings_or_snippets(page):
    src = (DOCS / page).read_text(encoding="utf-8")
    assert protected_lines(transformed(page))[: len(protected_lines(src))] == protected_lines(src)


@pytest.mark.parametrize("page", PAGES)
def test_every_arxiv_id_in_prose_is_an_arxiv_link(page):
    out = transformed(page)
    prose = "\n".join(line for line in out.split("\n") if line not in set(protected_lines(out)))
    for m in re.finditer(r"arXiv (\d{4}\.\d{4,5})", prose):
        assert prose[m.end():].startswith(f"](https://arxiv.org/abs/{m.group(1)})"), prose[m.start() - 40:m.end() + 40]


def test_the_ddp_paper_and_torch_sources_are_linked_on_their_pages():
    for page in ["ddp.md", "bucketing.md", "averaging.md", "costmodel.md"]:
        if "arXiv 2006.15704" in (DOCS / page).read_text(encoding="utf-8"):
            assert "[arXiv 2006.15704](https://arxiv.org/abs/2006.15704)" in transformed(page), page
    assert ("(https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/reducer.cpp)"
            in transformed("bucketing.md"))
    sampler = "(https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/distributed.py)"
    assert sampler in transformed("sharding.md")


def test_linked_torch_python_sources_exist_in_the_pinned_torch():
    torch = pytest.importorskip("torch")
    site = Path(torch.__file__).resolve().parents[1]
    linked = set()
    for page in PAGES:
        source = r"https://github\.com/pytorch/pytorch/(?:blob|tree)/v2\.13\.0/([^)\s\"]+)"
        linked |= set(re.findall(source, transformed(page)))
    linked |= set(links.BARE_FILES.values())
    assert linked
    for path in sorted(p for p in linked if not p.startswith("torch/csrc/")):
        assert (site / path).exists(), f"{path} is not in torch {torch.__version__}"


def test_upstream_issues_are_linked_only_with_their_repository():
    out = transformed("failures.md")
    assert "[pytorch#33148](https://github.com/pytorch/pytorch/issues/33148)" in out
    assert "[Lightning#7129](https://github.com/Lightning-AI/pytorch-lightning/issues/7129)" in out
    assert "[transformers#11620](https://github.com/huggingface/transformers/issues/11620)" in out
    assert "(#1-uneven-inputs)" in out  # a table of contents anchor, not an issue
    for url in re.findall(r"https://github\.com/[\w.-]+/[\w.-]+/issues/(\d+)", out):
        assert int(url) >= 1000 or url == "30"  # karpathy/build-nanogpt#30 is named with its repository


def test_each_page_of_the_path_ends_with_exactly_one_next_footer_to_the_next_page():
    steps = [page for page, _ in links.path_in(DOCS)]
    assert steps[0] in ("start-here.md", "sharding.md") and steps[-1] == "api.md"
    for page, nxt in zip(steps, steps[1:]):
        out = transformed(page)
        footers = re.findall(r"^\*\*Next:\*\* \[[^\]]+\]\(([^)]+)\) — \S", out, re.M)
        assert footers == [nxt], (page, footers)
        # running the hook on its own output does not add a second one
        again = links.transform_markdown(out, page, DOCS, Counter())
        assert len(re.findall(r"^\*\*Next:\*\*", again, re.M)) == 1, page
    assert "**Next:**" not in transformed("api.md")


def test_concept_pages_link_to_their_api_entries():
    for page, modules in links.API_OF.items():
        out = transformed(page)
        for module in modules:
            assert f"(api.md#{module})" in out, (page, module)


@pytest.fixture(scope="module")
def api_html(tmp_path_factory) -> str:
    """docs/api.md built alone by MkDocs with mkdocs.yml's settings and the hook (about 7 s)."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    tmp = tmp_path_factory.mktemp("api-site")
    (tmp / "docs").mkdir()
    shutil.copy(DOCS / "api.md", tmp / "docs" / "api.md")
    config = load_config(str(ROOT / "mkdocs.yml"), docs_dir=str(tmp / "docs"), site_dir=str(tmp / "site"),
                         nav=[{"API": "api.md"}], hooks=[str(HOOK)], strict=False)
    build(config)
    text = (tmp / "site" / "api" / "index.html").read_text(encoding="utf-8")
    return text[text.index('<article'):text.index('</article>')]


def test_api_page_labels_do_not_run_into_their_text(api_html):
    assert not re.search(r"<p>(What|Why|How[\w' ]{0,40})\s*\n", api_html)
    assert not re.search(r"\b(What|Why|differs|here) [A-Z]", re.sub(r"<strong>[^<]*</strong>", "", api_html))
    assert api_html.count("<strong>What.</strong>") >= 20
    assert "<strong>How torch differs.</strong>" in api_html


def test_api_page_has_no_raw_sphinx_roles(api_html):
    assert not re.search(r":(data|class|func|meth|attr|mod|exc|obj):", api_html)


def test_api_page_has_a_root_heading_and_a_concept_page_per_module(api_html):
    api_md = (DOCS / "api.md").read_text(encoding="utf-8")
    modules = re.findall(r"^::: (\S+)", api_md, re.M)
    assert len(modules) >= 20
    for module in modules:
        assert re.search(rf'<h3 id="{re.escape(module)}" class="doc doc-heading', api_html), module
    sections = re.split(r"^## ", api_md, flags=re.M)[1:]
    for section in sections:
        assert re.search(r"^Concept pages?: \[", section, re.M), section.splitlines()[0]
    for page_modules in links.API_OF.values():
        for module in page_modules:
            assert f'id="{module}"' in api_html, module


def test_api_page_docstring_references_are_links(api_html):
    assert '<a href="https://arxiv.org/abs/2006.15704">' in api_html
    assert ('<a href="https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/reducer.cpp">'
            '<code>') in api_html
    # no link inside a code block or a heading
    for block in re.findall(r"<pre.*?</pre>|<h[1-6].*?</h[1-6]>", api_html, re.S):
        assert "arxiv.org" not in block and "github.com/pytorch" not in block
