"""DDP by hand through miniddp.init_distributed, ending without destroy_process_group()."""
import torch

import miniddp

env = miniddp.init_distributed(timeout=60)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                          torch.nn.Linear(64, 4))
model = miniddp.DistributedDataParallel(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo, after the group exists
for _ in range(5):
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
# the end of the script: no destroy_process_group(), as most scripts end
