"""A Lightning script, as a user writes it: ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``, two models.

Run as ``torchrun --nproc-per-node 2 lightning_ddp.py --out DIR`` (torch's DDP: Lightning sees torchrun's
environment and starts no processes of its own) or with ``-m miniddp.drop_in`` before it (miniddp's). It fits a
regressor with BatchNorm (buffers to broadcast) under automatic optimisation with ``accumulate_grad_batches``, then
a second one under manual optimisation (``automatic_optimization = False``, ``self.manual_backward``, accumulating
by hand as Lightning's docs show). Each rank writes what it saw to ``DIR/rankR.json`` and the final parameters and
buffers to ``DIR/rankR.auto.pt`` and ``DIR/rankR.manual.pt``.
"""

import argparse
import gc
import json
import os

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--accumulate_grad_batches", type=int, default=2)
parser.add_argument("--max_steps", type=int, default=3)
args = parser.parse_args()


def regressor():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))


class Automatic(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = regressor()
        self.forwarded = []  # samples per forward
        self.wrapper = ""  # the class the strategy wrapped this module in

    def on_train_start(self):
        wrapper = self.trainer.strategy.model
        self.wrapper = f"{type(wrapper).__module__}.{type(wrapper).__name__}"

    def forward(self, x):
        self.forwarded.append(len(x))
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Manual(Automatic):
    def __init__(self, accumulate):
        super().__init__()
        self.automatic_optimization = False
        self.accumulate = accumulate

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        self.manual_backward(F.mse_loss(self(x), y) / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()


g = torch.Generator().manual_seed(0)  # the same data on every rank; Lightning shards it (DistributedSampler)
x = torch.randn(64, 8, generator=g)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
os.makedirs(args.out, exist_ok=True)
seen = {}
for name, module, accumulate in [("auto", Automatic(), args.accumulate_grad_batches),
                                 ("manual", Manual(args.accumulate_grad_batches), 1)]:
    L.seed_everything(0, verbose=False)
    module.net = regressor()  # seeded: the same on every rank (DDP would broadcast rank 0's anyway)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=args.max_steps,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    rank = dist.get_rank()
    state = {"parameters": {k: p.detach() for k, p in module.net.named_parameters()},
             "buffers": dict(module.net.named_buffers())}
    torch.save(state, os.path.join(args.out, f"rank{rank}.{name}.pt"))
    seen[name] = {"class": module.wrapper, "backend": dist.get_backend(),
                  "environment": type(trainer.strategy.cluster_environment).__name__,
                  "world_size": trainer.world_size, "global_step": trainer.global_step,
                  "forwarded": module.forwarded}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)

# The end of a job, as torch's docs ask: destroy the group, once nothing holds it (Lightning's trainer, through its
# DDP wrapper, does). Left alive, gloo's threads can abort a finished job at interpreter teardown (pytorch#190489).
del trainer, module
gc.collect()  # Lightning's objects refer to each other
dist.destroy_process_group()
