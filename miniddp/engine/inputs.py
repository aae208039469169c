"""Inputs on the model's device: ``device_ids`` checked at wrap, each batch moved in ``forward``.

What
    ``check_device_ids(module, device_ids)`` accepts ``None`` or ``[one device]`` holding every
    parameter and returns that device; ``move_to(obj, device)`` returns ``obj`` with every tensor
    inside (tuples, named tuples, lists, mappings, dataclasses, nested) on ``device``.

Why
    One process drives one device: a batch loaded on the CPU must reach ``cuda:local_rank``
    before the module sees it, whatever container the data loader yields (Hugging Face's
    ``BatchEncoding`` and ``ModelOutput`` are mappings).

How torch differs
    torch's DDP moves inputs with ``_to_kwargs`` / ``_recursive_to`` (``torch/distributed/utils.py``)
    and also accepts multi-device modules (``device_ids=None`` with parameters on several GPUs);
    we refuse more than one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch


def move_to(obj, device):
    """``obj`` with every tensor inside (tuples, lists, mappings, dataclasses, nested) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=torch.device(device).type != "cpu")  # async from pinned memory
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(move_to(x, device) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to(x, device) for x in obj)
    if isinstance(obj, Mapping):  # dicts, Hugging Face's BatchEncoding and ModelOutput
        moved = {k: move_to(v, device) for k, v in obj.items()}
        try:
            return type(obj)(moved)
        except TypeError:  # a mapping type that cannot be rebuilt from a dict
            return moved
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: move_to(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def check_device_ids(module, device_ids) -> torch.device | None:
    """The device forward moves inputs to (``None``: leave them where they are), or a ValueError."""
    if device_ids is None:
        return None
    if len(device_ids) != 1:
        raise ValueError(f"device_ids={device_ids!r}: one process drives one device; pass [local_rank]")
    first = device_ids[0]
    expected = torch.device("cuda", first) if isinstance(first, int) else torch.device(first)
    for name, p in module.named_parameters():
        if p.device != expected:
            raise ValueError(f"device_ids={device_ids!r} but parameter {name} is on {p.device}; "
                             f"move the model first: model.to({str(expected)!r})")
    return expected
