"""DDP by hand, on any number of processes: the project's first runnable job.

    torchrun --standalone --nproc-per-node 2 -m miniddp.teaching.demo      # 2 ranks on this machine
    python -m miniddp.teaching.demo                                        # 1 process, same result

Each rank joins the job (``init_distributed``: backend, device, ``ddp_timeout``),
reads its own shard of a synthetic regression task (``ShardSampler``), and after
every backward averages the gradients with one all-reduce per parameter
(``average_gradients``). Because every rank starts from the same weights and
applies the same averaged gradient, the copies stay identical: the demo checks
that at the end, and prints the loss on rank 0. This is DDP with nothing hidden
and nothing optimised; ``miniddp.DistributedDataParallel`` does the same with
buckets that overlap the backward (``examples/ddp_by_hand.py`` uses it), and
``miniddp.train`` adds everything a training run needs.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import miniddp


def make_task(n: int = 1024, features: int = 16, seed: int = 0) -> TensorDataset:
    """y = x @ w + noise, generated from a seed: every rank builds the same data."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description="DDP by hand: shards + gradient averaging")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--per_device_train_batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--ddp_backend", default="auto")
    parser.add_argument("--ddp_timeout", type=float, default=1800)
    args = parser.parse_args(argv)

    # --8<-- [start:setup]
    env = miniddp.init_distributed(backend=args.ddp_backend, timeout=args.ddp_timeout)
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    dataset = make_task()
    sampler = miniddp.ShardSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=sampler)
    # --8<-- [end:setup]
    if env.is_main_process:
        print(f"world_size={env.world_size} backend={env.backend} device={env.device} "
              f"global batch={args.per_device_train_batch_size * env.world_size}")

    # --8<-- [start:loop]
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = torch.zeros(2, device=env.device)  # (sum of losses, number of batches)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x.to(env.device)), y.to(env.device))
            optimizer.zero_grad()
            loss.backward()
            miniddp.average_gradients(model)  # the one line that makes it data-parallel
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=env.device)])
        dist.all_reduce(total)  # mean loss over all ranks' batches, for the log
        mean_loss = (total[0] / total[1]).item()
        if env.is_main_process:
            print(f"epoch {epoch}: train loss {mean_loss:.4f}")
    # --8<-- [end:loop]

    # --8<-- [start:check]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(env.world_size)]
    dist.all_gather(copies, flat)  # every rank's parameters, to compare
    identical = all(torch.equal(copies[0], c) for c in copies)
    if env.is_main_process:
        print(f"parameters identical on all {env.world_size} ranks: {identical}")
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("ranks diverged: gradients were not averaged the same way everywhere")
    # --8<-- [end:check]
    return mean_loss


if __name__ == "__main__":
    main()
