"""A plain torch DDP script, as a user writes it: torch's class imported by name at the top, nothing of miniddp.

Run as ``torchrun --nproc-per-node 2 plain_ddp.py --out DIR`` (torch's DDP) or with ``-m miniddp.drop_in``
before it (miniddp's); ``--without_ddp`` trains without any DDP (the negative control: gradients never averaged).
Each rank writes what it saw to ``DIR/rankR.json`` and its final weights to ``DIR/rankR.pt``.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 - before the group exists: see the script's end
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--without_ddp", action="store_true")
parser.add_argument("--exit", type=int, default=0)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
ddp = model if args.without_ddp else DistributedDataParallel(model, bucket_cap_mb=0.0005)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(args.steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    loss = ddp(torch.randn(6, 8, generator=g)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
os.makedirs(args.out, exist_ok=True)
torch.save(model.state_dict(), os.path.join(args.out, f"rank{rank}.pt"))
seen = {"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "backend": dist.get_backend(),
        "class": f"{type(ddp).__module__}.{type(ddp).__name__}",
        "isinstance_torch_name": isinstance(ddp, DistributedDataParallel),
        "late_import_is_same": __import__("torch.nn.parallel", fromlist=["x"]).DistributedDataParallel
        is DistributedDataParallel}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
# The end of a job, as torch's docs ask: destroy the group, once nothing holds it (torch's DDP wrapper does). Left
# alive, gloo's threads can abort a finished job at interpreter teardown (pytorch#190489). torch's DDP imports
# torch.distributed.nn on first use, whose functions' defaults (group=group.WORLD) would hold the group for good:
# imported before the group exists, they hold nothing.
del ddp
dist.destroy_process_group()
sys.exit(args.exit)
