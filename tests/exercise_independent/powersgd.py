"""An independent correct solution of ``powersgd``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: ``_compress`` walks the matrices grouped by shape (torch's own order,
so its seeding is drawn directly, without ``_random_qs``); it keeps the error feedback as one flat tensor
per bucket; it orthonormalises with ``torch.linalg.qr`` instead of Gram-Schmidt (P Q^T only depends on
the span of P's columns, so any orthonormal basis gives the same average); it sends the uncompressed
tensors in their own all-reduce beside P's, as torch does (three all-reduces, the same bytes), and it
chains the stages with ``torch.futures.collect_all`` and ``add_done_callback`` completing a future of its
own, issuing Q's all-reduce from the callback without blocking on it. ``powerSGD_hook`` sorts the
gradients in one pass of its own. The seeding (one numpy draw per bucket, torch's order) and what
crosses the wire (vectors, P, Q) are dictated by torch's hook, which the spec compares against.
"""

from __future__ import annotations

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
            raise ValueError("start_powerSGD_iter must be > 1 with use_error_feedback or warm_start (torch's rule): "
                             "DDP rebuilds its buckets after iteration 1, and the memories are kept per bucket")
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
    averaged as they are. Three all-reduces: the vectors and P at once, then Q once P is summed."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world, b = group.size(), bucket.index()
    like = dict(dtype=bucket.buffer().dtype, device=bucket.buffer().device)
    first_of_shape: dict[tuple, int] = {}  # torch's hook visits the matrices grouped by shape
    mats = sorted(matrices, key=lambda mat: first_of_shape.setdefault(tuple(mat.shape), len(first_of_shape)))
    dims = [(mat.shape[0], mat.shape[1], min(mat.shape[0], mat.shape[1], state.matrix_approximation_rank))
            for mat in mats]

    if state.use_error_feedback:  # add back what last step's compression dropped, then remember the input
        error = state.error_dict.get(b)
        if error is None:
            error = torch.zeros(sum(n * m for n, m, _ in dims), **like)
        for mat, dropped in zip(mats, _split(error, [(n, m) for n, m, _ in dims])):
            mat += dropped
        inputs = [mat.clone() for mat in mats]

    q_flat = state.q_memory_dict.get(b) if state.warm_start else None
    if q_flat is None:  # first compressed step of this bucket (or no warm start): a fresh random Q
        q_flat = torch.empty(sum(m * r for _, m, r in dims), **like)
        qs = _split(q_flat, [(m, r) for _, m, r in dims])
        with torch.random.fork_rng(devices=[]):  # torch's seeding: one numpy draw per bucket, even without matrices
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, dtype=q.dtype))
    else:  # warm start: last step's averaged Q, made orthonormal again
        qs = _split(q_flat, [(m, r) for _, m, r in dims])
        for q in qs:
            q.copy_(torch.linalg.qr(q).Q)
    p_flat = torch.empty(sum(n * r for n, _, r in dims), **like)
    ps = _split(p_flat, [(n, r) for n, _, r in dims])
    for mat, q, p in zip(mats, qs, ps):
        torch.matmul(mat, q, out=p)  # this rank's P; summed over ranks below

    averaged = torch.futures.Future()
    flat_vectors = torch.cat([v.reshape(-1) for v in vectors]) if vectors else None

    def guarded(step):
        def run(fut):
            try:
                step(fut)
            except Exception as err:  # the hook's future fails instead of never completing
                averaged.set_exception(err)
        return run

    def after_q(fut) -> None:  # every rank holds sum_i Q_i
        fut.wait()
        q_flat.div_(world)
        for mat, p, q in zip(mats, ps, qs):
            mat.copy_(p @ q.t())  # the rank-r approximation of the mean, written into the bucket
        if state.use_error_feedback:
            parts = _split(error, [(n, m) for n, m, _ in dims])
            for part, before, mat in zip(parts, inputs, mats):
                torch.sub(before, mat, out=part)
            state.error_dict[b] = error
        if state.warm_start:
            state.q_memory_dict[b] = q_flat
        state.maybe_increase_iter(bucket)
        averaged.set_result(bucket.buffer())

    def after_p(fut) -> None:  # every rank holds the summed vectors and sum_i P_i
        for done in fut.wait():
            done.wait()  # raises here if that all-reduce failed
        if flat_vectors is not None:
            flat_vectors.div_(world)
            offset = 0
            for v in vectors:
                v.copy_(flat_vectors[offset : offset + v.numel()].view_as(v))
                offset += v.numel()
        if not mats:
            after_q(_done())
            return
        for mat, p, q in zip(mats, ps, qs):
            p.copy_(torch.linalg.qr(p).Q)
            torch.matmul(mat.t(), p, out=q)  # Q = M^T P with the shared, orthonormal P
        all_reduce(q_flat, group).add_done_callback(guarded(after_q))

    sent = []
    if flat_vectors is not None:
        sent.append(all_reduce(flat_vectors, group))
    if mats:
        sent.append(all_reduce(p_flat, group))
    torch.futures.collect_all(sent).add_done_callback(guarded(after_p))
    return averaged


def _done() -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(None)
    return fut


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
        rows = grad.shape[0] if grad.dim() > 0 else 1
        cols = grad.numel() // max(rows, 1)  # torch views a gradient as (shape[0], everything else)
        r = min(rows, cols, state.matrix_approximation_rank)
        worth_it = rows * cols > state.min_compression_rate * (rows + cols) * r
        state.total_numel_before_compression += rows * cols
        if worth_it:
            matrices.append(grad.view(rows, cols))
            state.total_numel_after_compression += (rows + cols) * r
        else:
            vectors.append(grad)
            state.total_numel_after_compression += rows * cols
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
