"""The learner's starting file, generated from the reference source, so it never drifts.

Every ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block inside one of the exercise's names
(a top-level function or class) becomes ``raise NotImplementedError("<name>: see docs/<page>")``
at the block's indentation; signatures, docstrings, imports and every other line stay.
"""

from __future__ import annotations

import ast

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def _owner(tree: ast.Module, line: int) -> tuple[str | None, str]:
    """(the top-level def or class whose lines hold ``line``, the qualified name of the innermost def)."""
    top, path, body = None, [], tree.body
    while True:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if first <= line <= node.end_lineno:
                    top = top or node.name
                    path.append(node.name)
                    body = node.body
                    break
        else:
            return top, ".".join(path)


def make_skeleton(source: str, names, page: str, exercise: str) -> str:
    """``source`` with the solution blocks of ``names`` blanked; a ValueError on unbalanced markers."""
    tree = ast.parse(source)
    out, skipping = [], False
    for number, line in enumerate(source.splitlines(), 1):
        marker = line.strip()
        if marker == BEGIN:
            if skipping:
                raise ValueError(f"line {number}: {BEGIN} inside another solution block")
            owner, where = _owner(tree, number)
            if owner in names:
                skipping = True
                indent = line[: len(line) - len(line.lstrip())]
                out.append(f'{indent}raise NotImplementedError("{exercise}: write {where} here; '
                           f'see docs/{page}")')
            continue
        if marker == END:
            skipping = False
            continue
        if not skipping:
            out.append(line)
    if skipping:
        raise ValueError(f"{BEGIN} without {END}")
    return "\n".join(out) + "\n"


def reference_without_markers(source: str) -> str:
    """The reference as a learner file: the solution kept, the marker lines dropped."""
    return "".join(line for line in source.splitlines(keepends=True) if line.strip() not in (BEGIN, END))
