"""The same, ending with dist.destroy_process_group() while the model is still alive."""
import torch
import torch.distributed as dist

import miniddp

env = miniddp.init_distributed(timeout=60)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                          torch.nn.Linear(64, 4))
model = miniddp.DistributedDataParallel(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()  # model, optimizer and their tensors still referenced
