"""PowerSGD: send two thin matrices instead of each gradient matrix.

What
    ``powerSGD_hook`` compresses each gradient matrix M (n x m) of a bucket to rank r: with a
    shared Q (m x r), P = M Q is summed over ranks and orthogonalised, Q = M^T P is averaged, and
    M becomes P Q^T: (n + m) r numbers on the wire instead of n m. Vectors and matrices too small
    to gain ``min_compression_rate`` travel uncompressed, in P's all-reduce.
    ``batched_powerSGD_hook`` compresses the whole bucket as one square matrix;
    ``powersgd_reference`` is the algorithm on one process, the tests' oracle.

Why
    One power-iteration step from last step's Q (*warm start*) tracks the top r singular
    directions, which change slowly; *error feedback* adds what compression dropped to the next
    step's gradient. Both make rank 1-4 train as well as full all-reduce (Vogels, Karimireddy,
    Jaggi, NeurIPS 2019, arXiv 1905.13727, Algorithms 1 and 2).

How torch differs
    Same state, seeding and arithmetic as ``powerSGD_hook.py``, in a fraction of the code; ours
    sends the uncompressed tensors with P in *one* all-reduce (torch: two), keeps error feedback
    for compressed matrices only (the same averages) and always orthogonalises by Gram-Schmidt.
    Both issue Q's all-reduce from a future callback: torch's reducer can then pair collectives
    of different buckets on gloo and hang; ours waits its turn (``call_order.py``).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.distributed as dist

from ..collectives.byte_count import all_reduce
from .default_hooks import allreduce_hook


class PowerSGDState:
    """Hyper-parameters and per-bucket memories of PowerSGD; the arguments of torch's ``PowerSGDState``."""

    def __init__(self, process_group, matrix_approximation_rank=1, start_powerSGD_iter=1_000, min_compression_rate=2,
                 use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0, random_seed=0,
                 compression_stats_logging_frequency=10_000, batch_tensors_with_same_shape=False):
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                             "because PowerSGD can only be applied after the first two iterations in DDP. DDP "
                             "rebuilds its buckets after iteration 1, and the memories are kept per bucket")
        self.process_group = process_group  # None: the default group
        self.matrix_approximation_rank = matrix_approximation_rank  # r
        self.start_powerSGD_iter = start_powerSGD_iter  # plain all-reduce before this step
        self.min_compression_rate = min_compression_rate  # compress M only if n*m > rate * (n+m)*r
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start  # start each power iteration from last step's Q
        self.orthogonalization_epsilon = orthogonalization_epsilon  # added to norms: all-zero columns stay finite
        self.compression_stats_logging_frequency = compression_stats_logging_frequency  # accepted, as torch's
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape  # accepted: speed only in torch
        self.rng = np.random.RandomState(random_seed)  # torch's seeding, so equal seeds draw equal Qs
        self.error_dict: dict[int, list[torch.Tensor]] = {}  # bucket -> what compression dropped, per matrix
        self.q_memory_dict: dict[int, torch.Tensor] = {}  # bucket -> last step's Qs, end to end (warm start)
        self.iter = 0  # steps seen (counted on the last bucket)
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def __getstate__(self) -> dict:  # pickle, torch.save: no group travels; the default one where it is loaded
        if self.process_group is not None and self.process_group != dist.group.WORLD:  # torch: warned, then lost
            raise TypeError("PowerSGDState.process_group is not the default group, and a process group cannot be "
                            "pickled: set state.process_group again after loading a state saved with None")
        return {**self.__dict__, "process_group": None}

    def __deepcopy__(self, memo) -> PowerSGDState:  # a copy in this process shares the group (the wrapper's too)
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update({k: v if k == "process_group" else copy.deepcopy(v, memo) for k, v in vars(self).items()})
        return clone

    def maybe_increase_iter(self, bucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def state_dict(self) -> dict:
        """This rank's memories (error feedback, warm-start Qs), step count and generator: an exact resume
        needs them, and they differ between ranks (``rank_<r>.pt`` in a checkpoint)."""
        name, keys, pos, has_gauss, cached = self.rng.get_state()  # as tensors: torch.load(weights_only=True)
        return {"iter": self.iter, "error_dict": self.error_dict, "q_memory_dict": self.q_memory_dict,
                "rng": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
                "numel": (self.total_numel_before_compression, self.total_numel_after_compression)}

    def load_state_dict(self, state: dict) -> None:
        self.iter, self.error_dict, self.q_memory_dict = state["iter"], state["error_dict"], state["q_memory_dict"]
        name, keys, pos, has_gauss, cached = state["rng"]
        self.rng.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        self.total_numel_before_compression, self.total_numel_after_compression = state["numel"]

    def compression_stats(self) -> tuple[float, int, int]:
        """(rate, elements before, elements after), summed over every compressed step, as torch reports."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after else 0, before, after)


# --8<-- [start:orthogonalize]
def orthogonalize(matrix: torch.Tensor, epsilon: float = 0) -> torch.Tensor:
    """Gram-Schmidt, in place: the columns of ``matrix`` (n x r) become orthonormal."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col /= col.norm() + epsilon
        rest = matrix[:, i + 1 :]
        rest -= col @ (col.t() @ rest)  # remove every later column's component along this one
    return matrix
# --8<-- [end:orthogonalize]


# --8<-- [start:reference]
def powersgd_reference(grad_sum: torch.Tensor, error_sum: torch.Tensor, q: torch.Tensor, world_size: int):
    """PowerSGD of one matrix on one process, from the sums over ranks of gradients and errors.

    Everything the ranks exchange is a sum of something linear in their own
    (gradient + error), so the sums are all it takes. Returns the average the
    ranks end with, the new sum of errors, and the Q for the next step.
    """
    m = grad_sum + error_sum  # each rank adds its error feedback before compressing
    p = torch.linalg.qr(m @ torch.linalg.qr(q).Q).Q  # all-reduce(M_i Q), orthogonalised (QR: any basis will do)
    q = m.t() @ p / world_size  # all-reduce(M_i^T P) / n
    approx = p @ q.t()  # what every rank writes back: the mean, projected on P's columns
    return approx, m - world_size * approx, q
# --8<-- [end:reference]


def _shape_rank(tensor: torch.Tensor, state: PowerSGDState) -> tuple[int, int, int, bool]:
    n = tensor.shape[0] if tensor.dim() else 1
    m = tensor.numel() // max(n, 1)  # torch views each gradient as (shape[0], -1)
    r = min(n, m, state.matrix_approximation_rank)
    return n, m, r, (n + m) * r * state.min_compression_rate < n * m


def _random_qs(state: PowerSGDState, qs: list[torch.Tensor], shapes: list) -> None:
    """Fill each Q with N(0, 1), drawn as torch's hook draws them: one seed per bucket from the numpy
    generator, then matrices of equal shape one after the other (torch groups them by shape)."""
    first = {}
    order = sorted(range(len(qs)), key=lambda j: first.setdefault(shapes[j], j))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(state.rng.randint(1_000_000_000))
        for j in order:
            qs[j].copy_(torch.randn(*qs[j].shape, dtype=qs[j].dtype))


# --8<-- [start:compress]
def _compress(state: PowerSGDState, bucket, matrices: list[torch.Tensor], vectors: list[torch.Tensor]):
    """Rank-r compression of ``matrices`` (views into the bucket, overwritten with P Q^T); ``vectors`` are
    averaged as they are. Two all-reduces: [vectors | P], then Q. For bucket ``b``, with
    ``use_error_feedback``: ``errors = state.error_dict[b]`` (zeros at first), each M += its error before
    compressing, and after it error = that M - P Q^T. ``q_flat``: last step's Qs, ``state.q_memory_dict[b]``,
    with ``warm_start`` (stored back at the end), else None for fresh random ones. Each P = M Q from Q
    orthogonalised in place first (``orthogonalize(q, state.orthogonalization_epsilon)``); the summed P
    orthogonalised the same way, then Q = M^T P; the summed Q divided by the group size, M = P Q^T."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world, b = group.size(), bucket.index()
    shapes = [_shape_rank(mat, state)[:3] for mat in matrices]  # (n, m, r) of each
    ### BEGIN SOLUTION
    if state.use_error_feedback:  # e_i: what last step's compression left out, added back now
        if b not in state.error_dict:
            state.error_dict[b] = [torch.zeros_like(mat) for mat in matrices]
        errors = state.error_dict[b]
        for mat, err in zip(matrices, errors):
            mat += err
    q_flat = state.q_memory_dict.get(b) if state.warm_start else None
    ### END SOLUTION
    fresh = q_flat is None
    if fresh:
        q_flat = torch.empty(sum(m * r for _, m, r in shapes), dtype=bucket.buffer().dtype,
                             device=bucket.buffer().device)
    qs = _split(q_flat, [(m, r) for _, m, r in shapes])
    if fresh:
        _random_qs(state, qs, [(n, m) for n, m, _ in shapes])
    first = torch.empty(sum(v.numel() for v in vectors) + sum(n * r for n, _, r in shapes),
                        dtype=bucket.buffer().dtype, device=bucket.buffer().device)
    heads = _split(first, [v.shape for v in vectors] + [(n, r) for n, _, r in shapes])
    sums, ps = heads[: len(vectors)], heads[len(vectors) :]
    for v, s in zip(vectors, sums):
        s.copy_(v)
    for mat, q, p in zip(matrices, qs, ps):
        ### BEGIN SOLUTION
        torch.matmul(mat, orthogonalize(q, state.orthogonalization_epsilon), out=p)  # P_i = M_i Q
        ### END SOLUTION

    def second(fut):  # every rank has sum_i P_i and the summed vectors
        for v, s in zip(vectors, sums):
            torch.div(s, world, out=v)
        for mat, p, q in zip(matrices, ps, qs):
            ### BEGIN SOLUTION
            orthogonalize(p, state.orthogonalization_epsilon)
            q.copy_(torch.matmul(p.t(), mat).t())  # Q_i = M_i^T P, as (P^T M_i)^T: 15x faster than M^T P here
            ### END SOLUTION
        return all_reduce(q_flat, group).wait()[0]  # blocks this comm thread: see the module docstring

    def third(fut):  # every rank has sum_i Q_i
        ### BEGIN SOLUTION
        q_flat.div_(world)
        for j, (mat, p, q) in enumerate(zip(matrices, ps, qs)):
            if state.use_error_feedback:  # next step's e_i: what this rank meant to send (M_i + e_i) minus
                torch.addmm(mat, p, q.t(), alpha=-1, out=errors[j])  # what it gets, in one pass over M
            torch.matmul(p, q.t(), out=mat)  # M ~ P Q^T, written into the bucket
        if state.warm_start:
            state.q_memory_dict[b] = q_flat
        ### END SOLUTION
        state.maybe_increase_iter(bucket)
        return bucket.buffer()

    return all_reduce(first, group).then(second).then(third)
# --8<-- [end:compress]


def _split(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    views, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        views.append(flat[offset : offset + numel].view(shape))
        offset += numel
    return views


# --8<-- [start:hook]
def powerSGD_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Per-matrix PowerSGD (torch's ``powerSGD_hook``): each gradient worth it is sent as P and Q."""
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(state.process_group, bucket)
    matrices, vectors = [], []
    for grad in bucket.gradients():
        n, m, r, worth_it = _shape_rank(grad, state)
        (matrices if worth_it else vectors).append(grad.view(n, m) if worth_it else grad)
        state.total_numel_before_compression += n * m
        state.total_numel_after_compression += (n + m) * r if worth_it else n * m
    return _compress(state, bucket, matrices, vectors)


def batched_powerSGD_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The whole bucket as one zero-padded square matrix (torch's ``batched_powerSGD_hook``): fewer,
    larger products, but the rows mix unrelated tensors, so a rank above 1 buys little accuracy."""
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(state.process_group, bucket)
    buffer = bucket.buffer()
    side = math.ceil(math.sqrt(buffer.numel()))
    square = torch.zeros(side * side, dtype=buffer.dtype, device=buffer.device)
    square[: buffer.numel()] = buffer
    state.total_numel_before_compression += buffer.numel()
    state.total_numel_after_compression += 2 * side * state.matrix_approximation_rank
    fut = _compress(state, bucket, [square.view(side, side)], [])
    return fut.then(lambda f: buffer.copy_(square[: buffer.numel()]))
# --8<-- [end:hook]
