"""torch 2.13's constructor keywords that the engine's core never needs: each honoured or refused in one line.

What
    ``refuse_unimplemented`` (``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``, ``mixed_precision``,
    ``skip_all_reduce_unused_params``; ``check_reduction`` accepted with torch's warning), ``torch_device_ids``
    (``output_device``), ``process_group_of`` (``device_mesh``), ``buffer_flags`` (``broadcast_buffers`` and
    ``forward_sync_buffers``), ``size_limits`` (``bucket_cap_mb_list``). A value miniddp cannot honour raises
    ``RefusedArgument``, a ``ValueError`` and a ``NotImplementedError`` whose ``parameter`` names it.

Why
    Frameworks build the wrapper with torch's keywords: Accelerate (``accelerate/accelerator.py``) with
    ``device_ids``, ``output_device`` and its ``DistributedDataParallelKwargs`` (``dim``, ``broadcast_buffers``,
    ``bucket_cap_mb``, ``check_reduction``, ...), Lightning (``lightning/pytorch/strategies/ddp.py``,
    ``lightning/fabric/strategies/ddp.py``) with ``device_ids`` and whatever its user passed. Each must be taken,
    in torch's positional order, and either do what torch's does or say in one line that it cannot.

How torch differs
    ``torch/nn/parallel/distributed.py``: ``output_device`` is ignored for one device per process (refused here
    unless None or the module's device); ``broadcast_buffers`` is deprecated in 2.13 with a ``FutureWarning``
    (none here); ``batched_grad_copy`` copies a bucket's gradients in one kernel (here each as it arrives: the
    same result); ``dim`` only scatters inputs over several devices per process (no effect in either).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .bucketing import MiB, bucket_size_limits, check_bucket_cap_mb


class RefusedArgument(ValueError, NotImplementedError):
    """A constructor argument miniddp cannot honour, in one line; ``parameter`` names it."""

    def __init__(self, parameter: str, message: str):
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter  # the constructor parameter refused


# --8<-- [start:constructor]
def refuse_unimplemented(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
                         skip_all_reduce_unused_params, check_reduction) -> None:
    """torch's keywords for what miniddp does not build: a non-default value is refused in one line.
    ``check_reduction`` is deprecated and does nothing in torch: accepted, with torch's warning."""
    for name, value in (("delay_all_reduce_named_params", delay_all_reduce_named_params),
                        ("param_to_hook_all_reduce", param_to_hook_all_reduce)):
        if value is not None:
            raise RefusedArgument(name, "miniddp puts every parameter in its buckets and has no delayed all-reduce; "
                                        "pass None for delay_all_reduce_named_params and param_to_hook_all_reduce")
    if mixed_precision is not None:
        raise RefusedArgument("mixed_precision", "torch's experimental _MixedPrecision casting is not implemented; "
                                                 "pass None and train under torch.autocast")
    if skip_all_reduce_unused_params:
        raise RefusedArgument("skip_all_reduce_unused_params", "miniddp all-reduces every bucket (an unused "
                              "parameter sends zeros); pass False, with find_unused_parameters=True if some are unused")
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                      "Please avoid using it.", FutureWarning, stacklevel=3)


def torch_device_ids(module, input_device, output_device) -> tuple[list[int] | None, int | None]:
    """torch's ``device_ids`` and ``output_device`` attributes. ``output_device`` must be None or the module's
    device: with one device per process torch leaves outputs where the module puts them."""
    where = next(module.parameters(), torch.empty(0)).device
    if output_device is not None:
        wanted = torch.device(where.type, output_device) if isinstance(output_device, int) else \
            torch.device(output_device)
        if (wanted.type, where.index if wanted.index is None else wanted.index) != (where.type, where.index):
            raise RefusedArgument("output_device", f"{output_device!r} but the module is on {where}: outputs stay "
                                  f"where the module puts them (torch ignores it too); pass None or {str(where)!r}")
    if input_device is None or input_device.index is None:
        return None, None
    return [input_device.index], input_device.index


def process_group_of(process_group, device_mesh):
    """The group to average over: ``device_mesh``'s, for a 1-D mesh (torch's rule), or ``process_group``."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RefusedArgument("device_mesh", "Cannot specify both process_group and device_mesh arguments. Pass "
                                             "one: the mesh's group is the one averaged over")
    if device_mesh.ndim != 1:
        raise RefusedArgument("device_mesh", f"Only 1D device mesh is supported, but got a {device_mesh.ndim}-D "
                                             "mesh; pass a 1-D mesh of the ranks to average")
    if device_mesh._get_root_mesh() != device_mesh:
        raise RefusedArgument("device_mesh", "a mesh sliced from a larger mesh (DDP beside tensor parallelism) is "
                                             "not implemented; pass a 1-D mesh of the ranks to average")
    group = device_mesh.get_group(mesh_dim=0)
    return None if group == dist.group.WORLD else group  # the default group is looked up at each use, never held


def buffer_flags(broadcast_buffers, forward_sync_buffers) -> tuple[bool, bool]:
    """(buffers broadcast before each forward, buffers in the wrap's sync), as torch 2.13 decides them:
    ``forward_sync_buffers`` wins, the wrap's sync stays whole; else ``broadcast_buffers`` (None: True) sets both."""
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    flag = True if broadcast_buffers is None else bool(broadcast_buffers)
    return flag, flag


def size_limits(bucket_cap_mb, bucket_cap_mb_list) -> list[int]:
    """Bucket byte limits. ``bucket_cap_mb_list`` (MiB per bucket in turn, the last repeating, for the first
    buckets and the rebuild alike) wins over ``bucket_cap_mb``, as in torch."""
    if not bucket_cap_mb_list:
        return bucket_size_limits(bucket_cap_mb)
    if bucket_cap_mb == "auto":
        raise RefusedArgument("bucket_cap_mb_list", "bucket_cap_mb='auto' chooses one cap for every bucket; "
                                                    "pass one or the other")
    for i, cap in enumerate(bucket_cap_mb_list):
        if cap is None or isinstance(cap, str):
            raise RefusedArgument("bucket_cap_mb_list", f"item {i} is {cap!r}: each cap is a number of MiB")
        check_bucket_cap_mb(cap, f"bucket_cap_mb_list[{i}]")
    return [int(cap * MiB) for cap in bucket_cap_mb_list]
# --8<-- [end:constructor]
