"""torch's DDP tutorial's shape: the ranks started with ``mp.spawn``, each in a ``def`` that returns.

Run as ``python spawn_ddp.py --out DIR`` (torch's DDP) or ``python -m miniddp.drop_in spawn_ddp.py --out DIR``
(miniddp's, if each spawned rank installs it: they are fresh interpreters that re-import this file as
``__mp_main__``). The ranks meet through a file store in DIR (no port). Each writes what it built to
``DIR/rankR.json``; the script ends without ``sys.exit``.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank,
                            world_size=world_size)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        loss = ddp(torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    seen = {"class": f"{type(ddp).__module__}.{type(ddp).__name__}", "backend": dist.get_backend(),
            "name": __name__}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(train, args=(2, args.out), nprocs=2)


if __name__ == "__main__":
    main()
