"""A script as most are written: a ``def main()`` that trains and returns, no ``sys.exit``.

``python def_main.py --store FILE`` trains one rank on a file store (no port, no launcher) for 3 steps,
on torch's DDP; ``-m miniddp.drop_in`` before it, on miniddp's. The wrapper is a local of ``main()``: gone
when it returns. It prints what it was run as, one JSON line: its argv, ``__name__`` and ``sys.path[0]``.
"""

import argparse
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=0, world_size=1)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    for _ in range(3):
        ddp(torch.ones(2, 4)).sum().backward()
    print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0]}))


if __name__ == "__main__":
    main()
