"""Gradient bucketing: few large all-reduces, launched while backward still runs.

What
    ``compute_bucket_assignment`` groups parameters into buckets of about ``bucket_cap_mb``; a
    ``Bucket`` owns one flat buffer its gradients are copied into, divided by N on the default
    path (``put``: mean = sum / N), or that ``.grad`` is a view of (``gradient_as_bucket_view``);
    ``write_back`` is the one place that sets ``.grad``. ``reducer.py`` sends the buckets in bucket
    order, each once its last gradient is ready and the buckets before it have gone.

Why
    One all-reduce per parameter pays a fixed latency hundreds of times per step; one of
    everything after backward cannot start until the last gradient exists. Buckets are the
    middle: large enough to amortise the latency, small enough that the first ones travel while
    backward computes the rest (the DDP paper, arXiv 2006.15704, §3.2.3 and Fig. 2).

How torch differs
    Same rules as ``compute_bucket_assignment_by_size`` in ``reducer.cpp`` (exposed as
    ``torch.distributed._compute_bucket_assignment_by_size``, our tests' oracle): one open bucket
    per (dtype, device), limits applied in sequence, the last repeating. torch 2.x starts with
    *one* bucket unless ``find_unused_parameters=True`` and relies on the rebuild; we always
    start from reversed registration order, so even the first iteration overlaps. With
    ``backward(create_graph=True)`` torch copies into its bucket with autograd recording, so ``.grad`` is
    the mean with this rank's gradient / N behind it; ``put`` and ``write_back`` give the same ``.grad``
    while the bucket stays out of every graph (torch's keeps the last one, and two parameters make its
    first backward raise).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm_hooks.grad_bucket import GradBucket
from .sparse_gradients import SparseBucket, each_sparse_alone

MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # torch's bucket_cap_mb default
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def bucket_size_limits(bucket_cap_mb: float | str | None) -> list[int]:
    """Byte limits as torch DDP uses them: ``None`` -> 1 MiB first, then 25 MiB. ``"auto"`` starts with the
    same and lets the rebuild choose the cap (``auto_bucket.py``)."""
    if bucket_cap_mb is None or bucket_cap_mb == "auto":
        return [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MiB]
    check_bucket_cap_mb(bucket_cap_mb)
    return [int(bucket_cap_mb * MiB)]


def check_bucket_cap_mb(value, name: str = "bucket_cap_mb") -> None:
    """A cap is a finite number of MiB that holds at least one byte (or None / "auto"); else a ValueError."""
    if value is None or value == "auto":
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            or not math.isfinite(value * MiB) or value * MiB < 1):  # 1e308 MiB overflows to inf bytes
        raise ValueError(f"{name}={value!r} must be a finite number of MiB holding at least one byte "
                         f"(>= {1 / MiB:.2g}), e.g. 25, or \"auto\" (the cost model chooses it after the first step), "
                         "or None (torch's 1 MiB first, then 25 MiB)")


# --8<-- [start:assignment]
def compute_bucket_assignment(tensors, bucket_size_limits, expect_sparse_gradient=()) -> list[list[int]]:
    """Indices of ``tensors`` per bucket; equal to torch's
    ``_compute_bucket_assignment_by_size(tensors, bucket_size_limits, expect_sparse_gradient)[0]``
    (a tensor expected to get a sparse gradient is a bucket of its own: ``sparse_gradients.py``).

    In ``tensors``' order, each joins the one open bucket of its (dtype, device); a bucket closes
    once its bytes (``numel * element_size``) reach its limit (``>=``): a key's k-th bucket gets
    ``limits[k]``, the last limit repeating. The buckets, the partly filled ones too, come back
    sorted by their smallest index."""
    limits = [int(b) for b in bucket_size_limits]
    if not limits or any(b <= 0 for b in limits):
        raise ValueError(f"bucket_size_limits={bucket_size_limits!r} must be a non-empty list of byte counts > 0")
    if any(expect_sparse_gradient):  # each sparse one alone, the dense ones by the rule below
        return each_sparse_alone(compute_bucket_assignment, tensors, limits, expect_sparse_gradient)
    ### BEGIN SOLUTION
    open_buckets: dict = {}  # (dtype, device) -> [indices, bytes so far]
    limit_index: dict = {}  # (dtype, device) -> which limit applies to its next bucket
    closed: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)  # never mix dtypes or devices in one flat buffer
        indices, size = open_buckets.setdefault(key, [[], 0])
        indices.append(i)
        size += t.numel() * t.element_size()
        open_buckets[key][1] = size
        k = limit_index.setdefault(key, 0)
        if size >= limits[k]:  # full: close it, the next bucket of this key gets the next limit
            closed.append(indices)
            del open_buckets[key]
            limit_index[key] = min(k + 1, len(limits) - 1)
    closed.extend(indices for indices, _ in open_buckets.values())  # the partly filled ones
    return sorted(closed, key=min)
    ### END SOLUTION
# --8<-- [end:assignment]


# --8<-- [start:bucket]
class Bucket:
    """One flat buffer for a group of same-dtype, same-device parameters.

    Layout: ``[grad of params[0] | grad of params[1] | ...]``; ``views[k]`` is
    params[k]'s slice, shaped like it. With ``gradient_as_bucket_view`` the
    reducer makes ``.grad`` *be* that view, so backward accumulates straight
    into the buffer and nothing is copied in or out.
    """

    def __init__(self, index: int, params: list[torch.Tensor], names: list[str], indices: list[int]):
        self.index = index  # position in reduction order
        self.params = params  # the parameters whose gradients live here
        self.names = names  # their qualified names, for errors and bucket_assignment
        self.indices = indices  # their positions in the reducer's parameter list
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views = self.split(self.buffer)  # views[k]: params[k]'s slice, shaped like it
        self.graphs: dict[int, torch.Tensor] = {}  # create_graph=True: k -> what autograd sees behind its mean

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (this bucket's layout) cut into one view per parameter."""
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    # --8<-- [start:mean]
    def put(self, k: int, grad, divisor: int = 1) -> None:
        """Write parameter k's gradient (``None``: zeros) into the bucket. The default path passes
        the world size N as ``divisor``: mean = sum / N, divided here, on the way in, in the same
        pass as the copy, so that a plain SUM all-reduce of the bucket is the mean (torch: the same)."""
        view = self.views[k]
        self.graphs.pop(k, None)
        if grad is None:  # no gradient on this rank: contribute zeros
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():  # .grad is this view already (gradient_as_bucket_view)
            if divisor != 1:
                view.div_(divisor)
        elif grad.requires_grad:  # backward(create_graph=True): the values travel, the graph stays here
            self.graphs[k] = grad / divisor  # write_back puts it behind the mean: this rank's part (torch's too)
            view.copy_(self.graphs[k].detach())
        elif divisor != 1:
            torch.div(grad, divisor, out=view)  # copy and divide in one pass
        else:
            view.copy_(grad)
    # --8<-- [end:mean]

    # --8<-- [start:write_back]
    def write_back(self, result: torch.Tensor, counts: list[int], as_view: bool) -> None:
        """The one place that sets ``.grad``: the averaged ``result`` (this bucket's layout) into the
        parameters' gradients. ``counts[i]``: ranks that had parameter i's gradient (0: leave ``.grad``)."""
        if as_view and result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result)  # .grad lives in the bucket: the result goes there
        values = self.views if as_view or result is self.buffer else self.split(result)
        for k, (i, p) in enumerate(zip(self.indices, self.params)):
            if counts[i] == 0:  # unused on every rank: .grad stays as it was (unused.UsedCounts.restore_kept)
                continue
            if k in self.graphs:  # create_graph=True: the mean's values, with this rank's gradient / N behind them
                with torch.enable_grad():
                    local = self.graphs.pop(k)
                    p.grad = local + (values[k] - local).detach()
            elif as_view:
                p.grad = values[k]
            elif p.grad is None:
                p.grad = values[k].to(p.dtype, copy=True)
            else:
                p.grad.copy_(values[k])
    # --8<-- [end:write_back]

    def for_hook(self, is_last: bool, buffer: torch.Tensor | None = None) -> GradBucket:
        """What a comm hook receives: this bucket (or a same-layout ``buffer``, e.g. zeros) as a ``GradBucket``."""
        flat = self.buffer if buffer is None else buffer
        views = self.views if buffer is None else self.split(buffer)
        return GradBucket(self.index, flat, views, self.params, is_last)
# --8<-- [end:bucket]


# --8<-- [start:rebuild]
def rebuilt_assignment(ready_order: list[int], params, size_limits, group) -> list[list[int]]:
    """Buckets filled in the order gradients arrived in the first backward (rank 0's order, broadcast, so
    that every rank builds the same), never-arrived parameters last.

    ``ready_order``: indices into ``params`` as their gradients arrived (a repeat counts at its first
    arrival). Every rank of ``group`` calls it; the order of the group's rank 0 wins (``dist.broadcast``
    wants its global rank: ``dist.get_global_rank(group, 0)``). Returns ``compute_bucket_assignment`` of
    the parameters in that order, as lists of indices into ``params``."""
    ### BEGIN SOLUTION
    arrived = list(dict.fromkeys(ready_order))  # first arrival of each parameter
    seen = set(arrived)
    order = arrived + [i for i in range(len(params)) if i not in seen]
    agreed = torch.tensor(order, dtype=torch.int64, device=params[0].device)
    dist.broadcast(agreed, src=dist.get_global_rank(group, 0), group=group)  # rank 0's order wins
    order = agreed.tolist()
    assignment = compute_bucket_assignment([params[i] for i in order], size_limits)
    return [[order[j] for j in bucket] for bucket in assignment]
    ### END SOLUTION
# --8<-- [end:rebuild]


def build_buckets(params, names, assignment, expect_sparse_gradient=()) -> list[Bucket | SparseBucket]:
    """``Bucket`` objects for an assignment given as lists of parameter indices; a ``SparseBucket`` for a
    parameter ``expect_sparse_gradient`` flags (alone in its bucket)."""
    sparse = {i for i, flag in enumerate(expect_sparse_gradient) if flag}
    return [(SparseBucket if idx[0] in sparse else Bucket)(b, [params[i] for i in idx], [names[i] for i in idx],
                                                          list(idx)) for b, idx in enumerate(assignment)]
