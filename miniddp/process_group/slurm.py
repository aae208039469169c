"""SLURM's compressed strings: the host list and the tasks per node.

What
    ``parse_slurm_nodelist("node[01-03,07],gpu5")`` expands SLURM's host list to
    ``["node01", "node02", "node03", "node07", "gpu5"]`` (zero padding kept, several bracket
    groups in one name multiply); ``parse_slurm_tasks_per_node("4(x2),3")`` gives ``[4, 4, 3]``.

Why
    Under ``srun`` without torchrun, the rendezvous host is the first host of the allocation
    and a task's local world size is its node's task count: both are only in these strings.
    A malformed one is refused with the variable's name, not read as a wrong host.

How torch differs
    torch reads no SLURM variable (``torch/distributed/rendezvous.py`` knows torchrun's
    ``env://`` only). SLURM's own ``scontrol show hostnames`` does the expansion; Lightning's
    ``SLURMEnvironment`` parses the same strings in Python, as here.
"""

from __future__ import annotations

import re

_HOST = re.compile(r"([^,\[\]]*)(\[[^\[\]]*\])?")  # a prefix, then an optional [ranges]


# --8<-- [start:nodelist]
def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: ``"node[01-03,07],gpu5"`` ->
    ``["node01", "node02", "node03", "node07", "gpu5"]``. Zero padding is kept;
    several bracket groups in one name multiply (``r[1-2]n[1-2]`` -> 4 hosts)."""
    if not isinstance(nodelist, str) or not nodelist.strip():
        raise ValueError(f"SLURM_NODELIST={nodelist!r} is empty; expected e.g. 'node[01-04],gpu5'")
    text = nodelist.strip()
    if text.count("[") != text.count("]"):
        raise ValueError(f"SLURM_NODELIST={nodelist!r} has unbalanced brackets")
    hosts: list[str] = []
    for name in _split_top_level(text, nodelist):
        expansions = [""]
        for prefix, bracket in _HOST.findall(name):
            if not prefix and not bracket:
                continue
            parts = [prefix]
            if bracket:
                parts = [prefix + n for n in _expand_ranges(bracket[1:-1], nodelist)]
            expansions = [e + p for e in expansions for p in parts]
        hosts.extend(expansions)
    return hosts
# --8<-- [end:nodelist]


def _split_top_level(text: str, original: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth not in (0, 1):
            raise ValueError(f"SLURM_NODELIST={original!r} has nested or stray brackets")
        if ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    names.append(text[start:])
    if any(not n or n.startswith("[") for n in names):
        raise ValueError(f"SLURM_NODELIST={original!r} has an empty host name")
    return names


def _expand_ranges(spec: str, original: str) -> list[str]:
    out = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"SLURM_NODELIST={original!r}: {item!r} is not a number or a range like 01-04")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"SLURM_NODELIST={original!r}: range {item!r} runs backwards")
        width = len(lo)  # "01-04" keeps two digits
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def parse_slurm_tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE="4(x2),3"`` -> ``[4, 4, 3]`` (tasks on each node)."""
    counts = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE={spec!r}: cannot read {item!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
