"""Only miniddp.Trainer(...).train(): the script never sees the process group the Trainer creates."""
import sys

import torch
from torch.utils.data import TensorDataset

import miniddp

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
data = TensorDataset(x, x.sum(1, keepdim=True))
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
args = miniddp.TrainingConfig(output_dir=sys.argv[1], max_steps=5, per_device_train_batch_size=8, logging_steps=5,
                              ddp_timeout=60, disable_tqdm=True)


def squared_error(out, labels, num_items_in_batch):
    return ((out - labels) ** 2).sum() / num_items_in_batch


trainer = miniddp.Trainer(model=model, args=args, train_dataset=data, compute_loss_func=squared_error)
trainer.train()
