"""Rank 1 raises after training; the script destroys the group in `finally`, as careful scripts do."""
import torch
import torch.distributed as dist

import miniddp

env = miniddp.init_distributed(timeout=60)
try:
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = miniddp.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
    if env.rank == 1:
        raise RuntimeError("a bug on rank 1")
    dist.barrier()  # rank 0 waits for rank 1, which raised: the barrier fails when rank 1's group goes
finally:
    dist.destroy_process_group()
