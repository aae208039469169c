"""An independent correct solution of ``unused``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: the walk is breadth-first (a ``deque``) and collects the graph's nodes
only; it then asks each parameter for its own ``AccumulateGrad`` node (``p.expand_as(p).grad_fn``'s
first input, the accumulator autograd keeps for a leaf while a graph holds it) and calls it unused when
that node was not reached, instead of reading ``node.variable`` during the walk. ``unused_contribution``
admits one rule only (with the flag, whatever ``.grad`` holds and whether it was accumulated; without,
zeros and "not used"): it is written as a lookup on the flag rather than an ``if``. (The reference's
solution of this module was seen before this file was written: the walk was made different on purpose.)
"""


from __future__ import annotations

import dataclasses
import warnings
from collections import deque

import torch
import torch.distributed as dist

from ..collectives.byte_count import record
from ..process_group.fingerprint import issued_as


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
    roots = find_tensors(outputs)
    reached = set()  # every backward node some output's graph contains
    queue = deque(t.grad_fn for t in roots if t.grad_fn is not None)
    while queue:  # breadth-first over the backward graph
        node = queue.popleft()
        if node in reached:
            continue
        reached.add(node)
        queue.extend(child for child, _ in node.next_functions if child is not None and child not in reached)
    direct = {id(t) for t in roots if t.grad_fn is None and t.requires_grad}  # a parameter returned as is
    unused = []
    with torch.enable_grad():
        for i, p in enumerate(params):
            if id(p) in direct:
                continue
            if not p.requires_grad:  # frozen after wrapping: no graph can reach it
                unused.append(i)
                continue
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]  # the leaf's AccumulateGrad node
            if accumulator not in reached:
                unused.append(i)
    return unused
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


# --8<-- [start:counts]
def unused_contribution(grad, find_unused: bool, accumulated: bool):
    """What a parameter without a gradient in this backward puts in its bucket: ``(tensor or None for
    zeros, counts as used?)``. With the flag, whatever ``.grad`` holds (torch copies any defined
    ``.grad``; one accumulated under ``no_sync`` counts as used); without it, zeros."""
    return {True: (grad, accumulated), False: (None, False)}[bool(find_unused)]


class UsedCounts:
    """How many ranks produced each parameter's gradient in one backward: a 1 or 0 per parameter on
    each rank, summed by one small all-reduce after the last bucket (int32: exact for any world size)."""

    def __init__(self, num_params: int, used: int = 1):
        self.local = [used] * num_params  # 1: this rank sends a real gradient for parameter i
        self.kept: dict[int, torch.Tensor] = {}  # parameter -> its bucket-view .grad, to restore if no rank used it
        self.summed: torch.Tensor | None = None

    def mark_unused(self, i: int, grad=None, view=None) -> None:
        """Parameter i sends no gradient of its own. If its ``.grad`` is its bucket's ``view``
        (``gradient_as_bucket_view``), the bucket will overwrite it: keep a copy."""
        self.local[i] = 0
        if grad is not None and grad.data_ptr() == view.data_ptr():
            self.kept[i] = grad.clone()

    @issued_as("used-counts all-reduce")
    def all_reduce(self, group, device) -> torch.futures.Future:
        self.summed = torch.tensor(self.local, dtype=torch.int32).to(device, non_blocking=True)  # no stream sync
        record("all_reduce (used counts)", self.summed)
        return dist.all_reduce(self.summed, group=group, async_op=True).get_future()

    def counts(self) -> list[int]:
        return self.summed.tolist()  # one host copy per backward (a sync point on a GPU)

    def restore_kept(self, params, counts: list[int]) -> None:
        """After the write-back: a bucket-view ``.grad`` that no rank used is put back as it was."""
        for i, grad in self.kept.items():
            if counts[i] == 0:
                params[i].grad = grad


def check_counts(counts: list[int], expected: int, names: list[str], *, find_unused: bool, local: list[int],
                 params: list[torch.Tensor], warn_if_nothing_unused: bool = False) -> bool:
    """Raise ``UnusedParameterError`` for gradients some rank lacked, unless ``find_unused``; ``local``:
    this rank's parameters without a gradient. With ``find_unused`` and nothing unused on any rank, warn
    if asked (the graph walk is then wasted time). Returns whether it warned."""
    short = [(names[i], c) for i, c in enumerate(counts) if c < expected]
    if short and not find_unused:
        frozen = [names[i] for i in local if not params[i].requires_grad]
        message = missing_gradients_message([n for n, _ in short], [c for _, c in short], expected,
                                            [names[i] for i in local], frozen)
        raise UnusedParameterError(message, [n for n, _ in short])
    if find_unused and not short and warn_if_nothing_unused:  # judged from the counts: nothing unused on ANY rank
        warnings.warn(NOTHING_UNUSED, stacklevel=3)
        return True
    return False
# --8<-- [end:counts]


NOTHING_UNUSED = ("find_unused_parameters=True but no parameter was unused in this backward on any rank: the graph "
                  "walk after every forward costs time for nothing; consider False.")


def gradient_twice_message(name: str, walk_missed_it: bool) -> str:
    if walk_missed_it:  # the walk said "unused", yet a gradient came
        return (f"parameter {name} received a gradient, but find_unused_parameters' graph walk from the forward's "
                "outputs did not reach it. Usual causes: reentrant activation checkpointing "
                "(torch.utils.checkpoint(..., use_reentrant=True) hides the segment's parameters until backward: "
                "use use_reentrant=False), or an output object that hides its tensors from the walk.")
    return (f"parameter {name} got its gradient twice in one backward (reentrant gradient checkpointing, or a "
            "module used in two separate backward passes); use torch.utils.checkpoint(..., use_reentrant=False)")
