"""Griffe extension: make miniddp's docstring layout render as Markdown.

miniddp's module docstrings use labelled blocks rather than Google sections::

    What
        text...

    Why
        text...

    How torch differs
        text...

Read as Markdown, the label runs into its text ("What A drop-in for ...") and a
block of several paragraphs turns into an indented code block. This extension
rewrites each such block, before mkdocstrings parses it, into
``**What.** text...`` with the text dedented; it also turns Sphinx roles
(``:data:`X```, ``:class:`X```, ``:func:`X```, ...) into plain code.

Registered by ``docs/hooks/links.py`` (its ``on_config`` adds this file to the
mkdocstrings python handler's ``extensions``), so mkdocs.yml only names the hook.
The docstrings in ``miniddp/`` are not changed: only what the site shows.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

# A label: a short capitalised line without final punctuation, e.g. "What", "Why",
# "How torch differs", "How it runs here", "How Hugging Face differs".
_LABEL = re.compile(r"^(?:What|Why|How(?: [A-Za-z][A-Za-z' ]{0,40})?)$")
_ROLE = re.compile(r":(?:py:)?(?:data|class|func|meth|attr|mod|exc|obj|const|type):`~?([^`]+)`")
_LIST_ITEM = re.compile(r"^(?:[*+-]|\d+[.)])\s")


def fix_roles(text: str) -> str:
    """``:func:`evaluate``` -> ```evaluate```; a leading ``~`` is dropped as Sphinx would."""
    return _ROLE.sub(lambda m: f"`{m.group(1)}`", text)


def fix_labels(text: str) -> str:
    """Rewrite ``Label\\n    indented block`` into ``**Label.** dedented block``.

    A label is recognised only when it stands alone on an unindented line, after a
    blank line (or first), and the next line is indented: ordinary paragraphs
    never look like that in a cleaned docstring.
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        prev_blank = not out or not out[-1].strip()
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if prev_blank and _LABEL.match(line.rstrip()) and nxt.strip() and nxt[:1] in (" ", "\t"):
            j = i + 1
            body: list[str] = []
            while j < len(lines) and (not lines[j].strip() or lines[j][:1] in (" ", "\t")):
                body.append(lines[j])
                j += 1
            while body and not body[-1].strip():
                body.pop()
            body = textwrap.dedent("\n".join(body)).split("\n")
            label = f"**{line.strip()}.**"
            if _LIST_ITEM.match(body[0]) or body[0].startswith(("```", "|", ">")):
                out.extend([label, ""] + body)
            else:
                out.append(f"{label} {body[0]}")
                out.extend(body[1:])
            if j < len(lines):
                out.append("")
            i = j
            while i < len(lines) and not lines[i].strip() and out and not out[-1].strip():
                i += 1  # one blank line between blocks is enough
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def fix_docstring(text: str) -> str:
    return fix_labels(fix_roles(text))


class MiniddpDocstrings(griffe.Extension):
    """Apply :func:`fix_docstring` to every docstring of the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if obj.docstring is not None:
            fixed = fix_docstring(obj.docstring.value)
            if fixed != obj.docstring.value:
                obj.docstring.value = fixed
                obj.docstring.__dict__.pop("parsed", None)  # drop a parse cached before us
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)
