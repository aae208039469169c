"""MkDocs hook: real links for plain-text references, "Next" footers, API cross-links.

Registered in mkdocs.yml as ``hooks: [docs/hooks/links.py]``. What it does:

* **References become links** (``on_page_markdown`` on every page, and
  ``on_page_content`` on the API page's rendered docstrings):

  - ``arXiv 2006.15704`` (any ``arXiv NNNN.NNNNN``) -> https://arxiv.org/abs/NNNN.NNNNN;
  - torch source paths (``torch/nn/parallel/distributed.py``, a few bare file names
    such as ``reducer.cpp`` from :data:`BARE_FILES`) -> github.com/pytorch/pytorch at
    :data:`TORCH_TAG`, the torch release the project pins;
  - upstream issues named with their repository (``pytorch/pytorch#149781``,
    ``pytorch#33148, #38174``, ``huggingface/accelerate#1726``, ``Lightning#7129``)
    -> that repository's issue; a bare ``#N`` is linked only in such a list, right
    after a named one (a bare "issue N" in prose is never touched);
  - the PyTorch API names of :data:`TORCH_DOCS`, at their first mention on a page,
    -> docs.pytorch.org.

  Never inside headings, existing links, URLs, HTML tags, fenced code, snippet
  includes (``--8<--``) or mkdocstrings blocks (``::: x``). An inline code span is
  linked only when all of it is the reference (```reducer.cpp```).

* **Next footers**: every page of the newcomer path (:data:`PATH`) ends with
  "Next: [title](page.md) — why"; absent pages are skipped, a page that already
  ends with a "Next" line is left alone.

* **API cross-links**: each concept page of :data:`API_OF` ends with
  "API reference: [miniddp.x](api.md#miniddp.x)"; the API page's module headings
  come from ``show_root_heading`` in docs/api.md, which also links back.

* **Docstring layout**: ``on_config`` registers ``griffe_docstrings.py`` (next to
  this file) with mkdocstrings, which renders the "What / Why / How torch
  differs" labels and Sphinx roles of miniddp's docstrings as Markdown.

Every table below is explicit: a name that is not in one is not linked.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GRIFFE_EXTENSION = HERE / "griffe_docstrings.py"

TORCH_TAG = "v2.13.0"  # pyproject pins torch 2.13.0; pytorch tags releases as vX.Y.Z
TORCH_BLOB = f"https://github.com/pytorch/pytorch/blob/{TORCH_TAG}/"
TORCH_TREE = f"https://github.com/pytorch/pytorch/tree/{TORCH_TAG}/"
ARXIV = "https://arxiv.org/abs/"
DOCS = "https://docs.pytorch.org/docs/stable/"

# Bare file names used in the docs and docstrings without their directory.
BARE_FILES = {
    "reducer.cpp": "torch/csrc/distributed/c10d/reducer.cpp",
    "ProcessGroupNCCL.cpp": "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp",
    "ProcessGroupWrapper.cpp": "torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp",
    "default_hooks.py": "torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py",
    "powerSGD_hook.py": "torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py",
    "distributed_c10d.py": "torch/distributed/distributed_c10d.py",
}

# Repository names as the docs write them before "#N".
REPOS = {
    "pytorch": "pytorch/pytorch",
    "torch": "pytorch/pytorch",
    "accelerate": "huggingface/accelerate",
    "transformers": "huggingface/transformers",
    "lightning": "Lightning-AI/pytorch-lightning",
    "pytorch-lightning": "Lightning-AI/pytorch-lightning",
}

_DDP = DOCS + "generated/torch.nn.parallel.DistributedDataParallel.html"
_DIST = DOCS + "distributed.html#torch.distributed."
# PyTorch API names -> their page. Only names that can mean nothing but torch's
# (miniddp has its own DistributedDataParallel, no_sync, register_comm_hook, ...).
TORCH_DOCS = {
    "torch.nn.parallel.DistributedDataParallel": _DDP,
    "torch.nn.parallel.DistributedDataParallel.register_comm_hook":
        _DDP + "#torch.nn.parallel.DistributedDataParallel.register_comm_hook",
    "torch.nn.parallel.DistributedDataParallel.no_sync": _DDP + "#torch.nn.parallel.DistributedDataParallel.no_sync",
    "torch.nn.parallel.DistributedDataParallel.join": _DDP + "#torch.nn.parallel.DistributedDataParallel.join",
    "torch.utils.data.DistributedSampler": DOCS + "data.html#torch.utils.data.distributed.DistributedSampler",
    "DistributedSampler": DOCS + "data.html#torch.utils.data.distributed.DistributedSampler",
    "torch.distributed": DOCS + "distributed.html",
    "torch.distributed.all_reduce": _DIST + "all_reduce",
    "dist.all_reduce": _DIST + "all_reduce",
    "torch.distributed.broadcast": _DIST + "broadcast",
    "dist.broadcast": _DIST + "broadcast",
    "torch.distributed.barrier": _DIST + "barrier",
    "dist.barrier": _DIST + "barrier",
    "torch.distributed.init_process_group": _DIST + "init_process_group",
    "dist.init_process_group": _DIST + "init_process_group",
    "init_process_group": _DIST + "init_process_group",
    "torch.distributed.monitored_barrier": _DIST + "monitored_barrier",
    "torch.distributed.get_world_size": _DIST + "get_world_size",
    "torch.distributed.GradBucket": DOCS + "ddp_comm_hooks.html#torch.distributed.GradBucket",
    "torch.distributed.algorithms.ddp_comm_hooks": DOCS + "ddp_comm_hooks.html",
    "torch.distributed.algorithms.join.Join":
        DOCS + "distributed.algorithms.join.html#torch.distributed.algorithms.Join",
    "torch.distributed.algorithms.Join": DOCS + "distributed.algorithms.join.html#torch.distributed.algorithms.Join",
    "torch.distributed.run": DOCS + "elastic/run.html",
    "torch.autograd.grad": DOCS + "generated/torch.autograd.grad.html",
    "torch.utils.checkpoint": DOCS + "checkpoint.html",
    "torch.utils.checkpoint.checkpoint": DOCS + "checkpoint.html#torch.utils.checkpoint.checkpoint",
    "torch.no_grad": DOCS + "generated/torch.no_grad.html",
    "torch.manual_seed": DOCS + "generated/torch.manual_seed.html",
    "torch.set_num_threads": DOCS + "generated/torch.set_num_threads.html",
    "torch.cuda.set_device": DOCS + "generated/torch.cuda.set_device.html",
    "torch.save": DOCS + "generated/torch.save.html",
    "torch.load": DOCS + "generated/torch.load.html",
    "torch.futures.Future": DOCS + "futures.html#torch.futures.Future",
}

# The newcomer path: page, and why to read it next (shown on the page before it).
PATH = [
    ("start-here.md", "what DDP is for and how this site is laid out"),
    ("sharding.md", "the first half of data parallelism: which samples each rank reads"),
    ("averaging.md", "the second half: one all-reduce turns per-rank gradients into the global one"),
    ("bucketing.md", "how DDP sends those gradients in buckets, overlapped with backward"),
    ("comm-hooks.md", "what travels in each bucket: full precision, fp16/bf16, or PowerSGD"),
    ("no-sync.md", "gradient accumulation without paying an all-reduce per micro-batch"),
    ("buffers.md", "the other state to keep equal: the initial model and BatchNorm's buffers"),
    ("unused-parameters.md", "why a parameter outside the loss stalls every bucket, and the fix"),
    ("ddp.md", "all of the above composed into one drop-in DistributedDataParallel"),
    ("performance.md", "is a Python reducer as fast as torch's C++ one? measured"),
    ("costmodel.md", "why a step takes as long as it does, and which bucket size to pick"),
    ("zero.md", "when the model fits but its copies do not: sharding the optimizer state and gradients"),
    ("fsdp.md", "when the model itself no longer fits: sharding the parameters, gathered one unit at a time"),
    ("failures.md", "the ways DDP jobs hang or silently drift, one by one"),
    ("join.md", "the first of them in depth: ranks with uneven inputs"),
    ("desync.md", "collectives that pair up wrong, and how to name the line that did it"),
    ("trainer.md", "every module in one training loop, with Hugging Face's conventions"),
    ("your-script.md", "the same lines in your own model, data and script"),
    ("launching.md", "starting N processes: torchrun, several machines, SLURM, notebooks"),
    ("backend-selection.md", "which backend carries the bytes: gloo, NCCL, or another"),
    ("timeouts.md", "how long a rank waits for the others, and who gets named when one stalls"),
    ("testing.md", "how every page's claims are tested with real processes"),
    ("api.md", "every public function and class, with its docstring"),
]

# Concept page -> the modules it explains (their API entries are api.md#<module>).
API_OF = {
    "backend-selection.md": ["miniddp.process_group.backend", "miniddp.process_group.env",
                             "miniddp.process_group.slurm",
                             "miniddp.process_group.elastic_agent"],
    "timeouts.md": ["miniddp.process_group.timeouts", "miniddp.process_group.monitored_barrier",
                    "miniddp.process_group.stalled_ranks", "miniddp.process_group.process_info"],
    "sharding.md": ["miniddp.data.sharding"],
    "averaging.md": ["miniddp.by_hand.averaging", "miniddp.by_hand.bucketed"],
    "bucketing.md": ["miniddp.engine.bucketing", "miniddp.engine.reducer", "miniddp.engine.autograd_hooks",
                     "miniddp.engine.observers", "miniddp.engine.waiting"],
    "comm-hooks.md": ["miniddp.comm_hooks", "miniddp.comm_hooks.grad_bucket", "miniddp.comm_hooks.default_hooks",
                      "miniddp.comm_hooks.call_order", "miniddp.collectives.byte_count", "miniddp.comm_hooks.powersgd"],
    "no-sync.md": ["miniddp.engine.no_sync"],
    "buffers.md": ["miniddp.engine.buffers"],
    "unused-parameters.md": ["miniddp.engine.unused", "miniddp.engine.static_graph"],
    "ddp.md": ["miniddp.engine.ddp", "miniddp.engine.readiness", "miniddp.engine.bucket_collective",
               "miniddp.engine.ownership", "miniddp.engine.inputs", "miniddp.engine.compile_graph_split",
               "miniddp.engine.torch_arguments", "miniddp.engine.torch_surface"],
    "performance.md": ["miniddp.diagnostics.trace", "miniddp.diagnostics.timeline"],
    "costmodel.md": ["miniddp.costmodel.alpha_beta", "miniddp.costmodel.step_profile", "miniddp.costmodel.simulate",
                     "miniddp.diagnostics.trace"],
    "join.md": ["miniddp.engine.join", "miniddp.engine.ddp_join"],
    "desync.md": ["miniddp.process_group.fingerprint", "miniddp.process_group.desync",
                  "miniddp.process_group.debug_backend"],
    "trainer.md": ["miniddp.training.config", "miniddp.training.config_checks", "miniddp.training.trainer",
                   "miniddp.training.prepare", "miniddp.training.deepspeed_args",
                   "miniddp.training.reporting", "miniddp.training.report_to",
                   "miniddp.training.trainer_state", "miniddp.training.checkpointer",
                   "miniddp.training.checkpoint_format",
                   "miniddp.training.checkpoint_timeline", "miniddp.training.every_rank", "miniddp.training.resume",
                   "miniddp.training.output_dir", "miniddp.training.nonfinite", "miniddp.training.cli",
                   "miniddp.training.tasks", "miniddp.training.batches"],
    "your-script.md": ["miniddp.training.trainer", "miniddp.training.batches"],
    "launching.md": ["miniddp.launching.launch", "miniddp.launching.torchrun_args", "miniddp.launching.notebook",
                     "miniddp.launching.launch_checks", "miniddp.launching.config_command",
                     "miniddp.launching.env_command"],
    "your-framework.md": ["miniddp.drop_in"],
    "zero.md": ["miniddp.zero.zero_partition", "miniddp.zero.zero_redundancy_optimizer", "miniddp.zero.gradient_shards",
                "miniddp.zero.reduce_scatter_optimizer", "miniddp.zero.deepspeed_config", "miniddp.zero.deepspeed_keys",
                "miniddp.zero.deepspeed_optim",
                "miniddp.collectives.shard_collectives"],
    "testing.md": ["miniddp.launching.spawn", "miniddp.testing"],
    "fsdp.md": ["miniddp.fsdp.fully_shard", "miniddp.fsdp.mixed_precision", "miniddp.fsdp.fsdp_param",
                "miniddp.fsdp.fsdp_param_group", "miniddp.fsdp.fsdp_state", "miniddp.fsdp.state_dict"],
}

# ---------------------------------------------------------------------------
# Recognising references

_ARXIV_RE = r"(?P<arxiv>\barXiv[ :](?P<arxiv_id>\d{4}\.\d{4,5})(?:v\d+)?)"
_PATH_RE = r"(?P<path>(?<![\w/.-])torch/(?:\w+/)*\w+(?:\.(?:py|pyi|cpp|hpp|h|cu|cuh)\b|/)?)"
_BARE_RE = "(?P<bare>(?<![\\w/.-])(?:" + "|".join(re.escape(n) for n in BARE_FILES) + r")(?![\w/-]))"
_REPO_NAME = r"(?:[A-Za-z0-9][\w.-]*/[\w.-]+|(?i:" + "|".join(re.escape(r) for r in REPOS) + "))"
_ISSUES_RE = (r"(?P<issues>(?<![\w/.#-])(?P<repo>" + _REPO_NAME + r")#\d+(?:,\s*#\d+)*(?![\w-]))")
_TORCH_ISSUE_RE = r"(?P<tissue>\b(?:torch|PyTorch|pytorch) (?:issue|PR|pull request) #?(?P<tissue_n>\d{4,})\b)"
_API_RE = ("(?P<api>(?<![\\w./])(?:" + "|".join(re.escape(k) for k in sorted(TORCH_DOCS, key=len, reverse=True))
           + r")(?![\w]|\.\w))")
TEXT_REFS = re.compile("|".join([_ARXIV_RE, _ISSUES_RE, _TORCH_ISSUE_RE, _PATH_RE, _BARE_RE, _API_RE]))
_REPO_IN_REF = re.compile(r"#(\d+)")


def _path_url(path: str) -> str:
    return (TORCH_TREE if path.endswith("/") or "." not in path.rsplit("/", 1)[-1] else TORCH_BLOB) + path


def _repo_of(name: str) -> str:
    return REPOS.get(name.lower(), name)


def _code_target(body: str) -> tuple[str, str] | None:
    """(kind, url) when the whole code span is a reference, else None."""
    body = body.strip()
    m = re.fullmatch(_PATH_RE, body)
    looks_like_a_path = body.endswith("/") or "." in body.rsplit("/", 1)[-1] or body.count("/") >= 3
    if m and body.startswith("torch/") and looks_like_a_path:
        return "source", _path_url(body)
    if body in BARE_FILES:
        return "source", _path_url(BARE_FILES[body])
    name = re.sub(r"\(.*\)$", "", body, flags=re.S)
    if name in TORCH_DOCS:
        return "api", TORCH_DOCS[name]
    return None


class Linker:
    """Adds links to one page; counts what it added in ``counts``."""

    def __init__(self, counts: Counter | None = None):
        self.counts = counts if counts is not None else Counter()
        self.api_seen: set[str] = set()  # API doc URLs already linked on this page
        self.linked: list[tuple[str, str]] = []  # (kind, url), in order

    def _add(self, kind: str, url: str) -> None:
        self.counts[kind] += 1
        self.linked.append((kind, url))

    def _api_ok(self, url: str) -> bool:
        if url in self.api_seen:
            return False
        self.api_seen.add(url)
        return True

    # -- text -----------------------------------------------------------------
    def text(self, text: str, make_link) -> str:
        """Link the references in plain ``text``; ``make_link(label, url)`` writes one link."""

        def sub(m: re.Match) -> str:
            s = m.group(0)
            if m.group("arxiv"):
                url = ARXIV + m.group("arxiv_id")
                self._add("arxiv", url)
                return make_link(s, url)
            if m.group("issues"):
                repo = _repo_of(m.group("repo"))
                if "/" not in repo:
                    return s
                base = f"https://github.com/{repo}/issues/"
                pieces, last = [], 0
                for n in _REPO_IN_REF.finditer(s):
                    # the first link carries the repository name: [pytorch#33148](...), [#38174](...)
                    pieces.append(s[last:n.start()] if last else "")
                    label = s[: n.end()] if not last else n.group(0)
                    self._add("issue", base + n.group(1))
                    pieces.append(make_link(label, base + n.group(1)))
                    last = n.end()
                pieces.append(s[last:])
                return "".join(pieces)
            if m.group("tissue"):
                url = "https://github.com/pytorch/pytorch/issues/" + m.group("tissue_n")
                self._add("issue", url)
                return make_link(s, url)
            if m.group("path"):
                if not (s.endswith("/") or "." in s.rsplit("/", 1)[-1] or s.count("/") >= 3):
                    return s  # "torch/distributed" in prose: a package, not a file
                self._add("source", _path_url(s))
                return make_link(s, _path_url(s))
            if m.group("bare"):
                url = _path_url(BARE_FILES[s])
                self._add("source", url)
                return make_link(s, url)
            if m.group("api"):
                url = TORCH_DOCS[s]
                if self._api_ok(url):
                    self._add("api", url)
                    return make_link(s, url)
            return s

        return TEXT_REFS.sub(sub, text)

    def code(self, body: str) -> str | None:
        """URL for an inline code span that is wholly a reference (first API mention only)."""
        target = _code_target(body)
        if target is None:
            return None
        kind, url = target
        if kind == "api" and not self._api_ok(url):
            return None
        self._add(kind, url)
        return url

    # -- markdown -------------------------------------------------------------
    _MD_TOKENS = re.compile(
        r"(?P<code>(?<!`)(?P<ticks>`+)(?!`)(?P<body>[\s\S]*?[^`])(?P=ticks)(?!`))"
        r"|(?P<link>!?\[(?:[^\[\]]|\[[^\[\]]*\])*\](?:\([^()\s]*(?:\([^()]*\))?[^()]*\)|\[[^\]]*\]))"
        r"|(?P<url><[a-z]+://[^>]+>|\bhttps?://[^\s)>\]]+)"
        r"|(?P<html></?[A-Za-z][^>]*>|<!--[\s\S]*?-->)"
        r"|(?P<attr>\{[:#.][^}]*\})"
        r"|(?P<math>\$[^$\n]+\$)"
    )

    def markdown_run(self, text: str) -> str:
        out, pos = [], 0
        for m in self._MD_TOKENS.finditer(text):
            out.append(self.text(text[pos:m.start()], _md_link))
            pos = m.end()
            if m.group("code"):
                url = self.code(m.group("body")) if "\n" not in m.group("body") else None
                out.append(f"[{m.group(0)}]({url})" if url else m.group(0))
            else:
                out.append(m.group(0))
        out.append(self.text(text[pos:], _md_link))
        return "".join(out)

    def markdown(self, markdown: str) -> str:
        """Link references in a page's Markdown, leaving protected lines alone."""
        lines = markdown.split("\n")
        out: list[str] = []
        run: list[str] = []
        fence: str | None = None
        snippet_block = False
        in_directive = False

        def flush():
            if run:
                out.append(self.markdown_run("\n".join(run)))
                run.clear()

        for line in lines:
            stripped = line.lstrip()
            if fence is not None:
                flush()
                out.append(line)
                if re.match(re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$", stripped):
                    fence = None
                continue
            m = re.match(r"(`{3,}|~{3,})", stripped)
            if m:
                flush()
                out.append(line)
                fence = m.group(1)
                continue
            if re.match(r"-{1,}8<-{1,}\s*$", stripped):
                flush()
                out.append(line)
                snippet_block = not snippet_block
                continue
            if in_directive and (not line.strip() or line[:1] in (" ", "\t")):
                if not line.strip():
                    in_directive = False
                flush()
                out.append(line)
                continue
            in_directive = False
            if snippet_block or re.match(
                    r"(#{1,6}\s|-{1,}8<-{1,}|:::|!!!|\?\?\?\+?|\[[^\]]+\]:\s|\*\[[^\]]+\]:|=+\s*$|-+\s*$)", stripped):
                flush()
                out.append(line)
                in_directive = stripped.startswith(":::")
                continue
            run.append(line)
        flush()
        return "\n".join(out)

    # -- html -----------------------------------------------------------------
    _HTML_TAG = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9]*)\b[^>]*?(/?)>|<!--[\s\S]*?-->")
    _PROTECTED = {"a", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "script", "style", "code", "kbd", "summary", "svg"}

    def html(self, content: str) -> str:
        """Link references in rendered HTML text nodes, and in ``<code>`` that is wholly one."""
        out, pos, depth = [], 0, Counter()
        for m in self._HTML_TAG.finditer(content):
            if m.start() < pos:
                continue  # inside a <code>...</code> consumed below
            chunk = content[pos:m.start()]
            if chunk:
                out.append(chunk if sum(depth.values()) else self.text(chunk, _html_link))
            pos = m.end()
            tag = (m.group(2) or "").lower()
            closing, selfclosing = m.group(1) == "/", m.group(3) == "/"
            if tag == "code" and not closing and not sum(depth.values()):
                end = content.find("</code>", m.end())
                body = content[m.end():end] if end >= 0 else ""
                if end >= 0 and "<" not in body:
                    url = self.code(html.unescape(body))
                    whole = content[m.start():end + len("</code>")]
                    out.append(f'<a href="{html.escape(url)}">{whole}</a>' if url else whole)
                    pos = end + len("</code>")
                    continue
            out.append(m.group(0))
            if tag in self._PROTECTED and not selfclosing:
                if closing:
                    depth[tag] = max(0, depth[tag] - 1)
                else:
                    depth[tag] += 1
        chunk = content[pos:]
        out.append(chunk if sum(depth.values()) else self.text(chunk, _html_link))
        return "".join(out)


def _md_link(label: str, url: str) -> str:
    return f"[{label}]({url})"


def _html_link(label: str, url: str) -> str:
    return f'<a href="{html.escape(url)}">{label}</a>'


# ---------------------------------------------------------------------------
# Footers

_NEXT_LINE = re.compile(r"^\s*(?:\*\*|_)?Next(?:\*\*|_)?\s*[:→-]", re.I | re.M)


def _title_of(path: Path, fallback: str) -> str:
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("# "):
                return line[2:].strip()
    except OSError:
        pass
    return fallback


def path_in(docs_dir: Path) -> list[tuple[str, str]]:
    """The newcomer path, without the pages that do not exist (yet)."""
    return [(page, why) for page, why in PATH if (docs_dir / page).is_file()]


def next_footer(src_uri: str, docs_dir: Path) -> str | None:
    """ "Next: [title](page.md) — why" for a page of the path, None for others and the last."""
    steps = path_in(docs_dir)
    names = [p for p, _ in steps]
    if src_uri not in names or names.index(src_uri) + 1 >= len(names):
        return None
    nxt, why = steps[names.index(src_uri) + 1]
    title = _title_of(docs_dir / nxt, nxt[:-3])
    return f"**Next:** [{title}]({nxt}) — {why}"


def _tail_has_next(markdown: str) -> bool:
    tail = [line for line in markdown.rstrip().splitlines()[-4:]]
    return any(_NEXT_LINE.match(line) for line in tail)


def api_footer(src_uri: str) -> str | None:
    modules = API_OF.get(src_uri)
    if not modules:
        return None
    return "API reference: " + ", ".join(f"[`{m}`](api.md#{m})" for m in modules)


def transform_markdown(markdown: str, src_uri: str, docs_dir: Path, counts: Counter | None = None) -> str:
    """Everything ``on_page_markdown`` does, callable without MkDocs (the tests use it)."""
    counts = counts if counts is not None else Counter()
    linker = Linker(counts)
    markdown = linker.markdown(markdown)
    _PAGE_LINKERS[src_uri] = linker
    extra = []
    api = api_footer(src_uri)
    if api and "](api.md#" not in markdown:
        extra.append(api)
        counts["api-reference"] += 1
    nxt = next_footer(src_uri, docs_dir)
    if nxt and not _tail_has_next(markdown):
        extra.append(nxt)
        counts["next"] += 1
    if extra:
        markdown = markdown.rstrip("\n") + "\n\n---\n\n" + "\n\n".join(extra) + "\n"
    return markdown


API_PAGE = "api.md"
_PAGE_LINKERS: dict[str, Linker] = {}
COUNTS: Counter = Counter()


def transform_api_html(content: str, linker: Linker | None = None, counts: Counter | None = None) -> str:
    """Everything ``on_page_content`` does to the API page's HTML."""
    linker = linker or Linker(counts)
    return linker.html(content)


# ---------------------------------------------------------------------------
# MkDocs events


def on_config(config: Any, **kwargs: Any) -> Any:
    """Register the griffe extension with mkdocstrings' python handler (once)."""
    COUNTS.clear()
    plugin = config.plugins.get("mkdocstrings")
    if plugin is not None:
        handlers = plugin.config.handlers
        options = handlers.setdefault("python", {}).setdefault("options", {})
        extensions = options.setdefault("extensions", [])
        names = [next(iter(e)) if isinstance(e, dict) else e for e in extensions]
        if not any(str(n).endswith(GRIFFE_EXTENSION.name) for n in names):
            extensions.append(str(GRIFFE_EXTENSION))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    return transform_markdown(markdown, page.file.src_uri, Path(config["docs_dir"]), COUNTS)


def on_page_content(html_text: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    if page.file.src_uri != API_PAGE:
        return html_text
    return transform_api_html(html_text, _PAGE_LINKERS.get(API_PAGE), COUNTS)


def on_post_build(config: Any, **kwargs: Any) -> None:
    from mkdocs.utils import log  # noqa: PLC0415 - mkdocs is only there at build time

    if COUNTS:
        log.info("links hook: " + ", ".join(f"{n} {k}" for k, n in sorted(COUNTS.items())))
