"""Sparse gradients: an ``nn.Embedding(sparse=True)``'s gradient averaged as a sparse tensor, in a bucket of its own.

What
    ``expects_sparse_gradient`` says which parameters will get a sparse ``.grad`` (the weight of an
    ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True``, as torch decides). Each of them gets a
    ``SparseBucket``: no flat buffer, the sparse gradient itself is what the collective sends (``put`` divides it
    by N on the default path: mean = sum / N, as a dense bucket does), and the averaged sparse tensor becomes
    ``.grad`` (``write_back``). ``each_sparse_alone`` is the bucket assignment with those parameters alone and the
    dense ones bucketed as if they were not there; ``rebuilt_with_sparse`` the one-time rebuild likewise.

Why
    A recommendation model's embedding table may hold millions of rows of which a batch touches a few hundred:
    its gradient as a sparse tensor (row indices + those rows) is what makes the step affordable, and averaging
    it densely would send the whole table. Sparse tensors cannot be laid end to end in one flat buffer, so each
    travels alone; gloo's sparse all-reduce sums them (the ranks' rows together, rows two ranks touched added).

How torch differs
    The same rules (``reducer.cpp``: ``expect_sparse_gradient``, ``mark_variable_ready_sparse``; the assignment
    ``_compute_bucket_assignment_by_size(tensors, limits, expect_sparse_gradient)``), but torch divides ``.grad``
    in place and all-reduces that very tensor, then copies the result into it; here the mean is a new tensor set
    as ``.grad``. A comm hook's ``bucket.buffer()`` is the sparse gradient and ``gradients()`` is empty, as
    torch's. With ``find_unused_parameters=True`` a sparse parameter unused on one rank sends an empty sparse
    gradient here; torch raises "Expected sparse gradient to be defined." there. After the rebuild torch sends a
    sparse bucket before a dense one still filling; here buckets go by the first arrival of their gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives.byte_count import payload
from ..comm_hooks.grad_bucket import GradBucket


def expects_sparse_gradient(module: torch.nn.Module, params: list[torch.Tensor]) -> list[bool]:
    """Per parameter of ``params``: is it the weight of an ``nn.Embedding`` / ``nn.EmbeddingBag`` with
    ``sparse=True`` (the first module that holds it decides, as in torch's ``_build_params_for_reducer``)."""
    sparse: dict[int, bool] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            sparse.setdefault(id(p), isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse)
    return [sparse.get(id(p), False) for p in params]


def check_layout(grad, name: str, expect_sparse: bool):
    """``grad``, if its layout is the one its bucket holds: sparse for a ``SparseBucket``, dense (strided) for the
    others; else a one-line error naming the parameter (torch: ``Expected variable to have sparse gradient``)."""
    if grad is not None and (grad.layout == torch.sparse_coo) != expect_sparse:
        raise RuntimeError(
            f"parameter {name} got a {grad.layout} gradient, but DistributedDataParallel gave it a "
            + ("sparse bucket: a weight of nn.Embedding(sparse=True) tied to a dense layer gets a dense gradient; "
               "untie it or use sparse=False" if expect_sparse else
               "dense bucket: only the weight of an nn.Embedding or nn.EmbeddingBag with sparse=True may get a "
               "sparse gradient (torch decides the same way); use one of them, or sparse=False"))
    return grad


def _empty_like(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``param``'s shape with no rows: what a rank without the gradient sends."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=param.device),
                                   param.new_empty((0, *param.shape[1:])), param.shape)


# --8<-- [start:bucket]
class SparseBucket:
    """One parameter whose gradient is sparse: its bucket is that gradient, sent as it is (a ``Bucket``'s interface)."""

    def __init__(self, index: int, params: list[torch.Tensor], names: list[str], indices: list[int]):
        self.index = index  # position in reduction order
        self.params, self.names, self.indices = params, names, indices  # exactly one parameter
        self.buffer = _empty_like(params[0])  # the sparse gradient put last: what the collective sends
        self.views = [None]  # no flat layout, so no slice for .grad to be (gradient_as_bucket_view skips it)

    @property
    def nbytes(self) -> int:  # what crosses the wire: the row indices and the rows
        return payload(self.buffer)

    def put(self, k: int, grad, divisor: int = 1) -> None:
        """The gradient (``None``: no rows) is the bucket; divided by ``divisor`` (the default path's N), so that a
        SUM all-reduce gives the mean. A new tensor: ``.grad`` keeps this rank's own until the mean replaces it."""
        grad = _empty_like(self.params[0]) if grad is None else grad
        self.buffer = grad / divisor if divisor != 1 else grad

    def write_back(self, result: torch.Tensor, counts: list[int], as_view: bool) -> None:
        """The averaged sparse tensor becomes ``.grad`` (unless no rank had the gradient: ``.grad`` stays)."""
        if counts[self.indices[0]] > 0:
            self.params[0].grad = result

    def for_hook(self, is_last: bool, buffer: torch.Tensor | None = None) -> GradBucket:
        """What a comm hook receives: ``buffer()`` the sparse gradient, no per-parameter views (torch: the same)."""
        return GradBucket(self.index, self.buffer if buffer is None else buffer, [], self.params, is_last)
# --8<-- [end:bucket]


# --8<-- [start:assignment]
def each_sparse_alone(assign, tensors, bucket_size_limits, expect_sparse_gradient) -> list[list[int]]:
    """torch's ``_compute_bucket_assignment_by_size(tensors, limits, expect_sparse_gradient)[0]``: each tensor
    expected to have a sparse gradient in a bucket of its own, the dense ones bucketed by ``assign`` (the dense
    rule, ``compute_bucket_assignment``) as if the sparse ones were not there; sorted by smallest index."""
    dense = [i for i, sparse in enumerate(expect_sparse_gradient) if not sparse]
    buckets = [[dense[j] for j in b] for b in assign([tensors[i] for i in dense], bucket_size_limits)]
    return sorted(buckets + [[i] for i, sparse in enumerate(expect_sparse_gradient) if sparse], key=min)
# --8<-- [end:assignment]


def rebuilt_with_sparse(rebuild, ready_order: list[int], params, expect_sparse_gradient, size_limits, group):
    """The one-time rebuild (``rebuild``: ``rebuilt_assignment``) of the dense parameters, each sparse one alone,
    placed before the first bucket whose gradients began arriving after it in rank 0's order (broadcast: every
    rank places it alike). Without sparse parameters, ``rebuild`` itself, exactly."""
    if not any(expect_sparse_gradient):
        return rebuild(ready_order, params, size_limits, group)
    arrived = list(dict.fromkeys(ready_order))
    seen = set(arrived)
    order = torch.tensor(arrived + [i for i in range(len(params)) if i not in seen], device=params[0].device)
    dist.broadcast(order, src=dist.get_global_rank(group, 0), group=group)  # rank 0's order, as the rebuild's
    position = {i: k for k, i in enumerate(order.tolist())}
    dense = [i for i, sparse in enumerate(expect_sparse_gradient) if not sparse]
    local = {i: j for j, i in enumerate(dense)}  # a dense parameter's index among the dense ones
    dense_order = [local[i] for i in sorted(dense, key=position.get)]
    buckets = [[dense[j] for j in b] for b in rebuild(dense_order, [params[i] for i in dense], size_limits, group)
               ] if dense else []
    for s in sorted((i for i in range(len(params)) if expect_sparse_gradient[i]), key=position.get):
        at = next((b for b, bucket in enumerate(buckets) if min(position[i] for i in bucket) > position[s]),
                  len(buckets))
        buckets.insert(at, [s])
    return buckets
