"""ZeRO-2's bucket collective (``zero/gradient_shards.py``) held to its oracles, small enough to be a spec.

On 3 ranks, with buckets that 3 does not always divide (the last chunk padded) and chunk boundaries inside
parameters: after each synced backward, rank r's pieces hold chunk r of the bucket's mean gradient, which the
ranks' gradients summed with ``dist.all_reduce``, divided by N and sliced also give (and, with no ``zero_grad``
between two backwards, the mean of their sum, as ``.grad`` accumulates); ``ZeroOptimizer`` at stages 1 and 2
trains what torch's DDP with plain AdamW trains; a backward issues one reduce-scatter per bucket and no
all-reduce of gradients, as the dispatcher sees them (whatever primitive the code called). One 3-rank call
computes the three (starting processes is most of the cost), once per implementation: ``miniddp exercise
check`` runs several in one pytest session, so the cache is keyed on ``swap.current()``. The negative control:
a collective that never divides fails the gradient comparison.
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.launching.spawn import run_on_ranks
from miniddp.teaching.exercise.swap import current

from issued import Issued

WORLD, STEPS, MICRO = 3, 2, 2
CAP_MB = 0.00005  # about 13 float32s: buckets of 4, 15 and 15 elements
TOL = 1e-6  # divided before the sum (ZeRO) or after it (the oracle): float32 rounding apart
TIMEOUT = 60


class Net(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c = nn.Linear(5, 3), nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).square().mean()


def _batch(step, micro, rank):
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _zero(ddp, stage):
    return miniddp.ZeroOptimizer(ddp, torch.optim.AdamW, stage=stage, lr=0.01, weight_decay=0.1)


def _chunks(rank, world, broken=False):
    """What is wrong with this rank's pieces after each of two synced backwards (no zero_grad between them), and
    whether the layout makes the check bite: a padded chunk, a chunk boundary inside a parameter."""
    model, plain = Net(rank), Net(0)  # the wrap makes every rank's model rank 0's
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    zero = _zero(ddp, stage=2)
    if broken:  # the negative control: the shard is the sum, not the mean
        ddp.reducer.collective.divisor = 1
    wrong, padded, cut = [], False, False
    for backward in range(2):
        x = _batch(0, backward, rank)
        ddp(x).backward()
        plain(x).backward()  # .grad accumulates: the shard must too
        mean = {}
        for name, p in plain.named_parameters():
            summed = p.grad.clone()
            dist.all_reduce(summed)
            mean[name] = summed / world
        for b, bucket in enumerate(ddp.reducer.buckets):
            numel = bucket.buffer.numel()
            size = -(-numel // world)  # ceil: every rank's chunk, the last one padded with zeros
            lo, hi = rank * size, min((rank + 1) * size, numel)
            padded |= size * world > numel
            starts = {sum(p.numel() for p in bucket.params[:k]) for k in range(len(bucket.params))}
            cut |= any(r * size not in starts for r in range(1, world) if r * size < numel)  # inside a parameter
            expected_grad = torch.cat([mean[n].flatten() for n in bucket.names])[lo:hi]
            expected_param = torch.cat([p.detach().flatten() for p in bucket.params])[lo:hi]
            got_grad, got_param = torch.zeros(size), torch.zeros(size)
            covered = torch.zeros(size, dtype=torch.long)
            where = f"rank {rank}, bucket {b} ({numel} elements, chunk {lo}:{hi}), backward {backward + 1}"
            for piece in zero.shards.pieces[b]:
                n = piece.tensor.numel()
                if not 0 <= piece.offset <= piece.offset + n <= size:
                    wrong.append(f"{where}: a piece at {piece.offset}:{piece.offset + n} lies outside the chunk")
                    continue
                covered[piece.offset : piece.offset + n] += 1
                got_param[piece.offset : piece.offset + n] = piece.tensor.detach().flatten()
                if piece.tensor.grad is None:
                    wrong.append(f"{where}: the piece at {piece.offset}:{piece.offset + n} has no .grad")
                else:
                    got_grad[piece.offset : piece.offset + n] = piece.tensor.grad.flatten()
            real = hi - lo
            if not (torch.all(covered[:real] == 1) and torch.all(covered[real:] == 0)):
                wrong.append(f"{where}: elements covered by pieces (1 = once, for each element of the chunk, then 0 "
                             f"for the padding): {covered.tolist()}")
            elif not torch.allclose(got_param[:real], expected_param, rtol=0, atol=0):
                wrong.append(f"{where}: the pieces are not this chunk's parameter elements: {got_param[:real]} "
                             f"instead of {expected_param}")
            elif not torch.allclose(got_grad[:real], expected_grad, rtol=1e-5, atol=TOL):
                ratio = (got_grad[:real].norm() / expected_grad.norm()).item()
                wrong.append(f"{where}: the pieces' .grad is not chunk {rank} of the mean gradient: "
                             f"{got_grad[:real]} instead of {expected_grad} (norm ratio {ratio:.3f})")
    return {"wrong": wrong, "padded": padded, "cut": cut}


def _parity(rank, world):
    """max |ZeRO - torch DDP + AdamW| over the parameters, per stage, and the spread of ZeRO's across ranks."""
    out = {}
    for stage in (1, 2):
        theirs_model, ours_model = Net(rank), Net(rank)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            theirs = TorchDDP(theirs_model, bucket_cap_mb=CAP_MB)
        ours = miniddp.DistributedDataParallel(ours_model, bucket_cap_mb=CAP_MB)
        plain, zero = _adamw(theirs_model.parameters()), _zero(ours, stage)
        for step in range(STEPS):
            for micro in range(MICRO):  # two synced backwards per step: the shards accumulate
                x = _batch(step, micro, rank)
                for model in (theirs, ours):
                    (model(x) / MICRO).backward()
            for opt in (plain, zero):
                opt.step()
                opt.zero_grad()
        flat = torch.cat([p.detach().flatten() for p in ours_model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        out[stage] = {"vs_torch": (flat - torch.cat([p.detach().flatten() for p in theirs_model.parameters()]))
                      .abs().max().item(), "spread": max((e - flat).abs().max().item() for e in everyone)}
    return out


def _issued(rank, world):
    """The collectives one backward issues, as the dispatcher sees them (whatever primitive the code called):
    DDP's, and ZeRO stage 2's; and the buckets' sizes."""
    seen = {}
    for name in ("ddp", "zero"):
        ddp = miniddp.DistributedDataParallel(Net(0), bucket_cap_mb=CAP_MB)
        if name == "zero":
            _zero(ddp, stage=2)
        with Issued() as issued:
            ddp(_batch(0, 0, rank)).backward()
        seen[name] = issued.ops
    return {**seen, "buckets": [b.buffer.numel() for b in ddp.reducer.buckets]}


def _session(rank, world):
    torch.set_num_threads(1)
    return {"chunks": _chunks(rank, world), "parity": _parity(rank, world), "issued": _issued(rank, world)}


_SESSIONS: dict[str, list | Exception] = {}  # one 3-rank call per implementation: its results, or what it raised


def _results() -> list:
    key = current()
    if key not in _SESSIONS:
        try:
            _SESSIONS[key] = run_on_ranks(_session, WORLD, timeout=TIMEOUT)
        except Exception as err:  # noqa: BLE001 - said by every item, without running the ranks again
            _SESSIONS[key] = err
    if isinstance(_SESSIONS[key], Exception):
        raise _SESSIONS[key]
    return _SESSIONS[key]


def test_each_rank_holds_its_chunk_of_the_mean_gradient():
    results = _results()
    assert results[0]["chunks"]["padded"] and results[0]["chunks"]["cut"]  # the layout makes the check bite
    wrong = [line for r in results for line in r["chunks"]["wrong"]]
    assert not wrong, "\n".join(wrong)


def test_stages_1_and_2_train_what_torch_ddp_and_adamw_train():
    for rank, r in enumerate(_results()):
        for stage, got in r["parity"].items():
            assert got["vs_torch"] <= TOL, f"rank {rank}, stage {stage}: {got['vs_torch']:.2e} from torch DDP + AdamW"
            assert got["spread"] == 0.0, f"rank {rank}, stage {stage}: the ranks' parameters differ"


def test_a_backward_reduce_scatters_each_bucket_and_all_reduces_no_gradient():
    issued = _results()[0]["issued"]
    buckets = issued["buckets"]

    def elements(who, kind):
        return [n for op, n in issued[who] if kind in op]

    assert elements("ddp", "allreduce")[: len(buckets)] == buckets  # DDP: each bucket whole, in bucket order
    counts = sum(elements("ddp", "allreduce")) - sum(buckets)  # then DDP's used-counts, which ZeRO keeps
    chunks = [-(-n // WORLD) for n in buckets]
    said = f"buckets of {buckets} elements on {WORLD} ranks; one backward issued {issued['zero']}"
    direct = sum(elements("zero", "send")) == sum((WORLD - 1) * c for c in chunks)  # gloo: each chunk to its rank
    assert elements("zero", "reduce_scatter") == chunks or direct, \
        f"{said}: one reduce-scatter per bucket into {chunks}, or every chunk sent to its rank (gloo)"
    assert sum(elements("zero", "allreduce")) == counts, f"{said}: no all-reduce but DDP's used-counts ({counts})"


def _never_divides(rank, world):
    torch.set_num_threads(1)
    return _chunks(rank, world, broken=True)["wrong"]


def test_negative_a_collective_that_never_divides_fails_the_chunk_check():
    assert all(run_on_ranks(_never_divides, WORLD, timeout=TIMEOUT))
