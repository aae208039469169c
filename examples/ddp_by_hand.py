"""DDP by hand: the lines a training script needs to run on N processes, and why.

    python examples/ddp_by_hand.py                                        # 1 process, no launcher
    torchrun --standalone --nproc-per-node 2 examples/ddp_by_hand.py      # 2 processes, this machine
    miniddp launch --num_processes 2 examples/ddp_by_hand.py --epochs 3   # the same, as `accelerate launch`
    # two machines, 8 processes each: run on both, --node-rank 1 on the second
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 \
        examples/ddp_by_hand.py

A small MLP learns a synthetic 4-class task (nothing downloaded). Each rank
reads its shard of the data, accumulates gradients locally for all but the last
micro-batch of each window (``no_sync``), and DDP averages them once per
optimizer step. 2 processes x ``--batch_size 16`` train the same model as 1
process x 32: tests/test_examples.py checks it.
"""

import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import miniddp


def make_dataset(n=1024, features=16, classes=4, seed=0) -> TensorDataset:
    """Labels from a random linear teacher, generated from a seed: every rank builds the same data."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x @ torch.randn(features, classes, generator=g)).argmax(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=16, help="per process: the global batch is x world size")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--out", default="ddp_by_hand.pt")
    args = parser.parse_args()

    # Reads RANK / WORLD_SIZE / MASTER_ADDR from torchrun (or SLURM), picks gloo on CPU, NCCL on GPUs,
    # and joins the process group. Without a launcher: a world of one, so this script runs alone too.
    env = miniddp.init_distributed()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(env.device)
    # Wrapping copies rank 0's parameters and buffers to every rank (so all replicas start equal) and
    # hooks the backward: each gradient is averaged over the ranks, in buckets, while backward runs.
    model = miniddp.DistributedDataParallel(net, device_ids=[env.device] if env.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # after wrapping: same tensors, same values

    dataset = make_dataset()
    # Each rank reads a different 1/world_size of the data; together they read it once per epoch.
    sampler = miniddp.ShardSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)  # the sampler shuffles, not the loader
    k = args.gradient_accumulation_steps

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order (the seed is seed + epoch)
        total = torch.zeros(2, device=env.device)  # (sum of micro-batch losses, micro-batches) on this rank
        for step, (x, y) in enumerate(loader):
            x, y = x.to(env.device), y.to(env.device)
            sync = (step + 1) % k == 0 or step + 1 == len(loader)  # last micro-batch of a window, or of the epoch
            window = min(k, len(loader) - step // k * k)  # this window's real length: the epoch's last may be short
            # DDP decides at the FORWARD whether the backward all-reduces, so the forward goes inside
            # no_sync too. Those backwards only add into .grad locally; the last one averages the sum
            # over ranks: the same gradient as syncing every micro-batch, for 1/k of the traffic.
            with nullcontext() if sync else model.no_sync():
                loss = F.cross_entropy(model(x), y)
                (loss / window).backward()  # / window: the optimizer steps on the window's mean
            if sync:
                optimizer.step()  # every rank applies the same averaged gradient: replicas stay equal
                optimizer.zero_grad(set_to_none=True)
            total += torch.stack([loss.detach(), torch.ones((), device=env.device)])
        dist.all_reduce(total)  # each rank saw only its shard: sum over ranks for the log
        if env.rank == 0:  # one rank prints, or every line comes world_size times
            print(f"epoch {epoch}: loss {(total[0] / total[1]).item():.4f} (world_size={env.world_size})")

    if env.rank == 0:  # the replicas are identical: one copy is enough
        tmp = f"{args.out}.tmp"
        torch.save(model.module.state_dict(), tmp)  # .module: the plain model's names, no "module." prefix
        os.replace(tmp, args.out)  # atomic: a reader finds the old file or the whole new one, never half
    # The others wait here until the file exists: a rank that went on to load it, or a job script that
    # copies it as soon as the first process exits, must not find it missing.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
