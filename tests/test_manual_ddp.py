"""Data parallelism by hand equals one process on the global batch.

The oracle of the whole project, first met here with the two naive pieces:
N ranks each train on their ``ShardSampler`` shard with a per-rank DataLoader and
a mean loss, average their gradients with ``average_gradients``, and step. One
process trains the same model on the *global* batch: at each step, the union of
the ranks' batches (per-rank striding makes it a contiguous slice of the
shuffled, padded index list, whatever N is). Their parameters must agree after
every step, and all ranks must hold the very same parameters. Without the
averaging (or without the division) they must not.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from miniddp.by_hand.averaging import average_gradients
from miniddp.data.sharding import ShardSampler
from miniddp.launching.spawn import run_on_ranks
from miniddp.testing import backend_params

N_SAMPLES = 22  # not a multiple of 3 or 4: the samplers pad, and the oracle must agree
BATCH_PER_RANK = 2
EPOCHS = 2
SEED = 3  # the samplers' shuffle seed, the same on every rank


def make_data(n=N_SAMPLES):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = x @ torch.randn(5, 1, generator=g, dtype=torch.float64) + 0.1 * torch.randn(n, 1, generator=g,
                                                                                     dtype=torch.float64)
    return x, y


def make_model():
    torch.manual_seed(0)  # the same initial weights everywhere (DDP would broadcast rank 0's)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()


class SGD:
    """``torch.optim.SGD(lr, momentum)``'s update, written out (a test below holds it to torch's).

    Constructing a ``torch.optim`` optimizer imports ``torch._dynamo`` (~1 s of CPU in every
    fresh rank process); the ranks here only need these four lines.
    """

    def __init__(self, params, lr=0.1, momentum=0.9):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers = [None] * len(self.params)  # momentum buffers, created at the first step

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            buf = self.buffers[i]
            self.buffers[i] = buf = p.grad.clone() if buf is None else buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def make_optimizer(model):
    return SGD(model.parameters(), lr=0.1, momentum=0.9)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).tolist()


# --8<-- [start:rank]
def _train_on_shard(rank, world_size, device_kind, sync, n_samples=N_SAMPLES, batch_per_rank=BATCH_PER_RANK):
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    dataset = TensorDataset(*make_data(n_samples))
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    sampler = ShardSampler(dataset, seed=SEED)  # num_replicas and rank from the process group
    loader = DataLoader(dataset, batch_size=batch_per_rank, sampler=sampler)
    history = []  # the parameters after every step
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb.to(device)), yb.to(device))  # mean over this rank's batch
            loss.backward()
            if sync == "average":
                average_gradients(model)
            elif sync == "sum":  # the classic bug: all-reduce without dividing by the world size
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad()
            history.append(flat_params(model))
    return history
# --8<-- [end:rank]


# --8<-- [start:oracle]
def train_on_global_batches(world_size):
    """One process, the same model, each step on the union of what the ranks saw at that step."""
    x, y = make_data()
    model = make_model()
    optimizer = make_optimizer(model)
    samplers = [ShardSampler(range(N_SAMPLES), world_size, r, seed=SEED) for r in range(world_size)]
    history = []
    for epoch in range(EPOCHS):
        shards = []
        for s in samplers:
            s.set_epoch(epoch)
            shards.append(list(s))
        steps = -(-len(shards[0]) // BATCH_PER_RANK)  # the DataLoader keeps a short last batch
        for k in range(steps):
            idx = [i for shard in shards for i in shard[k * BATCH_PER_RANK:(k + 1) * BATCH_PER_RANK]]
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])  # mean over the global batch
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            history.append(flat_params(model))
    return history
# --8<-- [end:oracle]


def run(world_size, backend, sync, **kwargs):
    kind = "cuda" if backend == "nccl" else "cpu"
    return run_on_ranks(_train_on_shard, world_size, args=(kind, sync), kwargs=kwargs, backend=backend, timeout=60)


# --8<-- [start:test]
def world_and_backend(world_sizes):
    """(world_size, backend) pairs; each nccl case skips unless there is a GPU per rank."""
    return [pytest.param(ws, bp.values[0], marks=bp.marks, id=f"{ws}-{bp.id}")
            for ws in world_sizes for bp in backend_params(ws)]


@pytest.mark.parametrize("world_size,backend", world_and_backend([1, 2, 3, 4]))
def test_sharding_plus_averaging_equals_one_process_on_the_global_batch(world_size, backend):
    histories = run(world_size, backend, "average")
    oracle = train_on_global_batches(world_size)
    assert len(oracle) == len(histories[0]) > EPOCHS  # several steps, the same count everywhere
    for rank_history in histories[1:]:  # all ranks hold identical parameters after every step
        assert rank_history == histories[0]
    for step, (ours, theirs) in enumerate(zip(histories[0], oracle)):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-10, atol=1e-12,
                                   msg=lambda m, step=step: f"step {step}: {m}")
# --8<-- [end:test]


@pytest.mark.parametrize("world_size", [2, 3])
def test_without_averaging_ranks_diverge_and_miss_the_oracle(world_size):
    histories = run(world_size, "gloo", "none")
    oracle = train_on_global_batches(world_size)
    assert histories[0][0] != histories[1][0]  # different shards, different steps: from step one
    assert not torch.allclose(torch.tensor(histories[0][-1]), torch.tensor(oracle[-1]), rtol=1e-3)


@pytest.mark.parametrize("world_size", [2, 3])
def test_summing_without_dividing_agrees_across_ranks_but_misses_the_oracle(world_size):
    histories = run(world_size, "gloo", "sum")
    oracle = train_on_global_batches(world_size)
    assert all(h == histories[0] for h in histories)  # in sync...
    assert not torch.allclose(torch.tensor(histories[0][0]), torch.tensor(oracle[0]), rtol=1e-3)  # ...but wrong


# --8<-- [start:split]
@pytest.mark.parametrize("world_size,backend", world_and_backend([3, 4]))
def test_for_a_fixed_global_batch_the_split_does_not_matter(world_size, backend):
    """12 samples a step as 3 ranks x 4 or 4 ranks x 3 = one process with a plain shuffled loader of 12."""
    n_samples, global_batch = 24, 12
    histories = run(world_size, backend, "average", n_samples=n_samples, batch_per_rank=global_batch // world_size)
    dataset = TensorDataset(*make_data(n_samples))
    model, sampler = make_model(), ShardSampler(dataset, num_replicas=1, rank=0, seed=SEED)  # = randperm(seed+epoch)
    optimizer, single = make_optimizer(model), []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in DataLoader(dataset, batch_size=global_batch, sampler=sampler):
            nn.functional.mse_loss(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
            single.append(flat_params(model))
    torch.testing.assert_close(torch.tensor(histories[0]), torch.tensor(single), rtol=1e-10, atol=1e-12)
# --8<-- [end:split]


def test_the_hand_written_sgd_is_torch_sgd():
    a, b = make_model(), make_model()
    ours, theirs = make_optimizer(a), torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data()
    for step in range(4):
        for model, opt in ((a, ours), (b, theirs)):
            nn.functional.mse_loss(model(x[step::4]), y[step::4]).backward()
            opt.step()
            opt.zero_grad()
    assert flat_params(a) == flat_params(b)
