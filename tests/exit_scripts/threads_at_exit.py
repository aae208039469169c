"""Which gloo threads are alive when the interpreter starts its teardown? One process, a world of one.

    python threads_at_exit.py {miniddp,torch} {nothing,destroy} REPORT.json

Wraps a small model in miniddp's or torch's DDP (after ``miniddp.init_distributed()``), trains a
step with ``torch.optim.SGD`` (whose first use imports ``torch._dynamo`` once the group exists),
then ends with nothing or with ``dist.destroy_process_group()``. An atexit function registered
before anything else, so it runs after miniddp's, writes the gloo threads still alive.
"""
import atexit
import json
import sys

wrapper, end, report = sys.argv[1:4]


@atexit.register  # first registered, last run: after miniddp's atexit destroy, before Py_FinalizeEx
def write_report():
    from miniddp.process_group.clean_exit import gloo_threads

    with open(report, "w") as f:
        json.dump(gloo_threads(), f)


import torch  # noqa: E402 - after the report is registered
import torch.distributed as dist  # noqa: E402

import miniddp  # noqa: E402

miniddp.init_distributed(backend="gloo", device="cpu")
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
DDP = miniddp.DistributedDataParallel if wrapper == "miniddp" else torch.nn.parallel.DistributedDataParallel
model = DDP(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
optimizer.step()
if end == "destroy":
    dist.destroy_process_group()  # the model is still alive: does it keep the group, and gloo's threads?
