"""torch, without miniddp: a module imported after the group exists can hold it in its defaults.

    python defaults_hold_group.py {plain,miniddp-first} REPORT.json

``torch.distributed.nn.functional`` declares ``def all_reduce(tensor, op=..., group=group.WORLD)``:
the default is evaluated at import, and ``torch._dynamo`` (the first ``torch.optim`` optimizer)
imports the module. Imported after the group exists, those defaults hold it, and
``destroy_process_group()`` cannot join gloo's threads. ``miniddp-first`` imports miniddp before
creating the group. Writes ``{"defaults_hold_group": bool, "gloo_threads_after_destroy": [...]}``.
"""
import json
import sys
import types

import torch
import torch.distributed as dist

mode, report = sys.argv[1:3]
if mode == "miniddp-first":
    import miniddp  # noqa: F401
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
import torch._dynamo  # noqa: E402,F401 - what torch.optim's first optimizer does

group = dist.group.WORLD
functional = sys.modules["torch.distributed.nn.functional"]
holds = any(group is value for f in vars(functional).values() if isinstance(f, types.FunctionType)
            for value in (f.__defaults__ or ()))
del group
dist.destroy_process_group()
from miniddp.process_group.clean_exit import gloo_threads  # noqa: E402 - only reads /proc

with open(report, "w") as f:
    json.dump({"defaults_hold_group": holds, "gloo_threads_after_destroy": gloo_threads()}, f)
