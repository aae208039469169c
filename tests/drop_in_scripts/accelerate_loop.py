"""An Accelerate training loop, as a user writes it: ``Accelerator().prepare``, ``accumulate``, and
``trigger_sync_in_backward`` (the pattern of its docstring: two forwards under ``no_sync``, the second backward
synced).

Run as ``torchrun --nproc-per-node 2 accelerate_loop.py --out DIR`` (torch's DDP) or with ``-m miniddp.drop_in``
before it (miniddp's); ``--without_ddp`` leaves the model out of ``prepare`` (the negative control: gradients never
averaged). Each rank writes what it saw to ``DIR/rankR.json`` and its final weights to ``DIR/rankR.pt``.
"""

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 - before the group exists: see the script's end
import torch.nn.functional as F
from accelerate import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--without_ddp", action="store_true")
args = parser.parse_args()

ddp_kwargs = DistributedDataParallelKwargs(bucket_cap_mb=1, find_unused_parameters=False, broadcast_buffers=True)
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.gradient_accumulation_steps,
                          kwargs_handlers=[ddp_kwargs, InitProcessGroupKwargs(timeout=timedelta(seconds=300))])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
                            torch.nn.Linear(512, 1))  # about 1.1 MB of float32: two buckets of 1 MB
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))  # the same data on every rank
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4,
                                     shuffle=True)
if args.without_ddp:
    optimizer, loader = accelerator.prepare(optimizer, loader)
else:
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

forwarded = []  # samples per forward
for inputs, targets in loader:
    with accelerator.accumulate(model):
        forwarded.append(len(inputs))
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

# Two forwards, one synced backward each would cost two all-reduces: sync only the second (Accelerate's docstring).
g = torch.Generator().manual_seed(1 + accelerator.process_index)  # each rank its own extra batches
first, second = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
with accelerator.no_sync(model):
    loss_a = model(first).square().mean()
    loss_b = model(second).square().mean()
accelerator.backward(loss_a)  # local only
with accelerator.trigger_sync_in_backward(model):
    accelerator.backward(loss_b)  # averages the sum of both gradients
optimizer.step()

os.makedirs(args.out, exist_ok=True)
rank = dist.get_rank()
torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.out, f"rank{rank}.pt"))
seen = {"class": f"{type(model).__module__}.{type(model).__name__}", "backend": dist.get_backend(),
        "distributed_type": str(accelerator.distributed_type), "world_size": accelerator.num_processes,
        "forwarded": forwarded}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)

# The end of a job, as torch's docs ask: destroy the group, once nothing holds it (the DDP wrapper Accelerate made
# does). Left alive, gloo's threads can abort a finished job at interpreter teardown (pytorch#190489). torch's DDP
# imports torch.distributed.nn on first use, whose functions' defaults (group=group.WORLD) would hold the group for
# good: imported before the group exists, they hold nothing.
del model
accelerator.free_memory()  # Accelerate keeps what it prepared, the wrapper included
accelerator.end_training()  # Accelerate's own end: it destroys the group
