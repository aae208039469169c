"""MkDocs hook: the exercises' solutions are folded on the site, never shown open.

What
    The concept pages include the reference source (``--8<-- "miniddp/...py:section"``), and the
    reference holds each exercise's answer between ``### BEGIN SOLUTION`` and ``### END SOLUTION``
    (``miniddp/teaching/exercise/skeleton.py`` blanks those blocks for ``miniddp exercise start``). After the
    snippets are expanded and before the code fences are read, every such block inside a fence is
    cut out of it and put, as a code block of its own, in a collapsed ``??? success`` box (Material's
    details) right where it was; the marker lines are dropped. The code around it stays as it was.

Why
    ``miniddp exercise check`` sends a learner to the page that teaches the concept. Open code
    there would be the answer, one scroll above the page's "Exercise" section. Folded, the page
    still shows the whole reference to a reader who asks for it.

How others differ
    nbgrader strips the same markers from the student's copy and keeps the solution elsewhere;
    the course sites built from it (CS336, ARENA) do not publish the reference at all.

Registered in mkdocs.yml (``hooks:``) as a Python-Markdown preprocessor between
pymdownx.snippets (priority 32) and superfences' raw-block reader (31.05).
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension
from markdown.preprocessors import Preprocessor

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
TITLE = 'Solution (folded: try `miniddp exercise start` first)'
PRIORITY = 31.5  # after "snippet" (32), before "fenced_raw_block" (31.05) and "fenced_code_block" (25)
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def _fold_fence(indent: str, opener: str, ticks: str, inner: list[str]) -> list[str]:
    """One fence's lines (``inner``, without its opener and closer) as code boxes and folded solutions.

    A snippet section may start or end inside a solution block: an END with no BEGIN before it
    means the fence opened inside one, a BEGIN with no END that it closes inside one."""
    markers = [line.strip() for line in inner if line.strip() in (BEGIN, END)]
    inside = bool(markers) and markers[0] == END
    segments: list[tuple[bool, list[str]]] = [(inside, [])]
    for line in inner:
        if line.strip() in (BEGIN, END):
            inside = line.strip() == BEGIN
            segments.append((inside, []))
        else:
            segments[-1][1].append(line)
    out: list[str] = []
    for solution, code in segments:
        if not any(line.strip() for line in code):
            continue  # no empty boxes
        if solution:
            out += ["", f'{indent}??? success "{TITLE}"', "", f"{indent}    {opener}"]
            out += [f"{indent}    {line[len(indent):]}" if line.strip() else "" for line in code]
            out += [f"{indent}    {ticks}", ""]
        else:
            out += [f"{indent}{opener}", *code, f"{indent}{ticks}"]
    return out


def fold_solutions(lines: list[str]) -> list[str]:
    """``lines`` with each solution block inside a fence moved into a collapsed box (markers dropped)."""
    out: list[str] = []
    fence = None  # (indent, opener line without the indent, ticks, the fence's lines so far)
    for line in lines:
        if fence is None:
            match = FENCE.match(line)
            if match:
                fence = (match["indent"], line[len(match["indent"]):], match["fence"], [])
            else:
                out.append(line)
            continue
        indent, opener, ticks, inner = fence
        if line.strip() == ticks and line.startswith(indent):  # the fence closes
            if any(x.strip() in (BEGIN, END) for x in inner):
                out += _fold_fence(indent, opener, ticks, inner)
            else:
                out += [f"{indent}{opener}", *inner, line]
            fence = None
        else:
            inner.append(line)
    if fence is not None:  # an unclosed fence: leave it to the fence reader, as it was
        out += [f"{fence[0]}{fence[1]}", *fence[3]]
    return out


class _Fold(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        return fold_solutions(lines)


class SolutionsExtension(Extension):
    def extendMarkdown(self, md) -> None:  # noqa: N802 - Python-Markdown's name
        md.preprocessors.register(_Fold(md), "fold_solutions", PRIORITY)


def on_config(config: Any, **kwargs: Any) -> Any:
    extensions = config["markdown_extensions"]
    if not any(isinstance(e, SolutionsExtension) for e in extensions):
        extensions.append(SolutionsExtension())
    return config
