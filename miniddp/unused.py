"""Unused parameters: what a parameter without a gradient does to a bucket.

What
    ``unused_parameters(outputs, params)`` walks the autograd graph back from the
    forward's outputs and returns the parameters it never reaches: those will get
    no gradient in this backward. ``UnusedParameterError`` is what you get when
    that happens and nobody said it could.

Why
    A bucket is launched when *all* its gradients are ready. A parameter that
    takes no part in the loss (a branch not taken, a frozen head that still has
    ``requires_grad=True``, a mixture-of-experts expert no token chose) never
    fires its hook, so its bucket never launches, every later bucket waits behind
    it (they launch in order), and the ranks that did launch wait forever. With
    ``find_unused_parameters=True`` DDP walks the graph after each forward and
    marks such parameters ready up front, contributing zeros.

How torch differs
    torch walks the graph the same way (``Reducer::prepare_for_backward`` in
    ``reducer.cpp``), reduces a bitmap of locally used parameters so that a
    parameter unused on *every* rank keeps its ``.grad`` untouched, and warns if
    the flag was set but nothing was unused. With ``find_unused_parameters=False``
    torch notices the missing gradient only at the *next* iteration ("Expected to
    have finished reduction in the prior iteration..."), after a silent desync. We
    count the ranks that produced each gradient inside the bucket itself
    (``bucketing.Bucket.used``), so every rank raises at the end of the *same*
    backward, naming the parameters.
"""

from __future__ import annotations

import dataclasses

import torch


class UnusedParameterError(RuntimeError):
    """Some parameters got no gradient on some rank and ``find_unused_parameters=False``."""

    def __init__(self, message: str, names: list[str]):
        super().__init__(message)
        self.names = names  # the parameters concerned, by qualified name


def find_tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a forward's output: a tensor, or lists/tuples/dicts/dataclasses/objects of them."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple, set, frozenset)):  # named tuples too
        return [t for item in obj for t in find_tensors(item)]
    if isinstance(obj, dict):  # Hugging Face's ModelOutput is an OrderedDict
        return [t for item in obj.values() for t in find_tensors(item)]
    if isinstance(obj, torch.nn.Module):
        return []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # also @dataclass(slots=True)
        return [t for f in dataclasses.fields(obj) for t in find_tensors(getattr(obj, f.name, None))]
    fields = dict(getattr(obj, "__dict__", {}))  # any other object: its attributes and its slots
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            fields.setdefault(name, getattr(obj, name, None))
    return [t for item in fields.values() for t in find_tensors(item)]


# --8<-- [start:walk]
def unused_parameters(outputs, params: list[torch.Tensor]) -> list[int]:
    """Indices of ``params`` that no path leads to from ``outputs`` in the autograd graph."""
    stack = [t.grad_fn for t in find_tensors(outputs) if t.grad_fn is not None]
    seen, reached = set(), set()
    while stack:  # depth-first over backward nodes
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    # a parameter used directly as an output (no grad_fn) is reached too
    reached.update(id(t) for t in find_tensors(outputs) if t.grad_fn is None and t.requires_grad)
    return [i for i, p in enumerate(params) if id(p) not in reached]
# --8<-- [end:walk]


def missing_gradients_message(names: list[str], counts: list[int], world_size: int, local: list[str],
                              frozen: list[str] = ()) -> str:
    """The error raised on every rank when a gradient is missing with find_unused_parameters=False."""
    if frozen:  # requires_grad switched off after wrapping: the buckets still wait for these
        return (f"requires_grad was set to False after wrapping for: {', '.join(frozen)}. DistributedDataParallel "
                "fixes its buckets when it wraps the model; freeze parameters before wrapping (or wrap again).")
    lines = [f"  {n}: gradient on {c} of {world_size} rank(s)" for n, c in zip(names, counts)]
    here = f"On this rank, no gradient for: {', '.join(local)}.\n" if local else ""
    return (
        "These parameters received no gradient in this backward on some ranks:\n"
        + "\n".join(lines)
        + f"\n{here}"
        "Either make every parameter contribute to the loss on every rank, set requires_grad=False on "
        "the ones you do not train, or pass find_unused_parameters=True "
        "(Hugging Face: ddp_find_unused_parameters=True) so DDP marks them ready with a zero gradient."
    )
