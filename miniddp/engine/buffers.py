"""Module state: check it matches at wrap, copy it from rank 0, keep buffers in step.

What
    ``verify_same_model`` checks that every rank built the same model (names, shapes, dtypes and
    ``requires_grad`` of parameters, and the buffers to broadcast) and names the first
    difference; ``sync_module_states`` broadcasts parameters (and buffers) from rank 0 at wrap;
    ``broadcast_buffers`` re-broadcasts buffers (BatchNorm's running stats) before every
    forward; all through ``broadcast_coalesced``, few flat messages instead of one per tensor.
    ``Managed`` is the module without the names torch's ignore list gives: DDP reads it in the module's place.

Why
    Identical updates keep replicas identical only if they *start* identical. A shape mismatch
    must fail at wrap: left alone it becomes a bucket of the wrong size and a collective that
    hangs or sums unrelated numbers. Buffers get no gradients, so averaging never touches them.

How torch differs
    torch does the same at construction (``_verify_param_shape_across_processes``: parameter
    shapes only, so a parameter frozen on one rank gets past it; ``_sync_module_states``, in
    ``torch/nn/parallel/distributed.py``) and ``_sync_buffers`` before each forward. We write
    broadcast results through ``.data``, so two forwards before one backward do not fail with
    "modified by an inplace operation". torch leaves the ignored names out of each list it builds
    (``parameters_to_ignore``); its reducer's list spells a root-level parameter ``".weight"``, so such a
    parameter is still averaged there: ``Managed`` leaves out exactly what ``named_parameters()`` names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..process_group.fingerprint import issued_as

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch's _DEFAULT_BROADCAST bucket at wrap


class ParameterMismatchError(ValueError):
    """Ranks hold models with different parameters; raised on every rank alike."""


def _describe(module: torch.nn.Module, include_buffers: bool) -> dict[str, list[str]]:
    """What must agree across ranks, one line per tensor: ``"fc.weight shape (4, 8) float32 requires_grad=True"``."""
    def line(name, t, extra=""):
        return f"{name} shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}{extra}"
    out = {"parameter": [line(n, p, f" requires_grad={p.requires_grad}") for n, p in module.named_parameters()]}
    if include_buffers:
        out["buffer"] = [line(n, b) for n, b in module.named_buffers()]
    return out


# --8<-- [start:verify]
@issued_as("model check at wrap")
def verify_same_model(module: torch.nn.Module, group=None, include_buffers: bool = True) -> None:
    """Raise on every rank if any rank's parameters (name, shape, dtype, requires_grad) or buffers
    differ from rank 0's, naming the first difference and every rank that has it."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, _describe(module, include_buffers), group=group)  # small, once
    for kind, reference in everyone[0].items():
        for k, ref in enumerate(reference):
            odd = [(r, theirs[kind][k]) for r, theirs in enumerate(everyone)
                   if k < len(theirs[kind]) and theirs[kind][k] != ref]
            if odd:
                raise ParameterMismatchError(
                    f"{kind} #{k} differs across ranks: rank 0 has {ref}; "
                    + "; ".join(f"rank {r} has {got}" for r, got in odd)
                    + ". Every rank must build the same model (parameters, buffers, shapes, dtypes, requires_grad) "
                    "before wrapping it in DistributedDataParallel.")
        for rank, theirs in enumerate(everyone):
            if len(theirs[kind]) != len(reference):
                longer, extra = (0, reference) if len(reference) > len(theirs[kind]) else (rank, theirs[kind])
                raise ParameterMismatchError(
                    f"rank 0 has {len(reference)} {kind}s, rank {rank} has {len(theirs[kind])}; the first one only "
                    f"rank {longer} has is {extra[min(len(reference), len(theirs[kind]))].split()[0]}.")
# --8<-- [end:verify]


# --8<-- [start:ignored]
class Managed:
    """The module as DDP sees it when ``module._ddp_params_and_buffers_to_ignore`` names some of its parameters
    and buffers (torch's way to keep them local; ``ddp._set_params_and_buffers_to_ignore_for_model`` sets it):
    the module's ``parameters()`` / ``buffers()`` (and named), those names left out. The wrap's check and
    broadcast, each forward's buffer broadcast and the reducer read it in place of the module."""

    def __init__(self, module: torch.nn.Module, ignore):
        self.module, self.ignore = module, frozenset(ignore)  # read live: a module's tensors can be reassigned

    def named_parameters(self):
        return ((n, p) for n, p in self.module.named_parameters() if n not in self.ignore)

    def named_buffers(self):
        return ((n, b) for n, b in self.module.named_buffers() if n not in self.ignore)

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def buffers(self):
        return (b for _, b in self.named_buffers())


def managed(module: torch.nn.Module, ignore) -> torch.nn.Module | Managed:
    """``module`` itself, or with names to ignore, the ``Managed`` view that leaves them out."""
    return Managed(module, ignore) if ignore else module
# --8<-- [end:ignored]


def refuse_meta_tensors(module: torch.nn.Module) -> None:
    """A parameter or buffer on the meta device has a shape and no data: say so at wrap, not in a hook."""
    name = next((n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta), None)
    if name is not None:
        raise ValueError(f"{name} is on the meta device (a shape, no data): materialise the model before wrapping, "
                         "e.g. model.to_empty(device='cpu'), then initialise or load its weights")


# --8<-- [start:coalesced]
def broadcast_coalesced(tensors, src_rank: int = 0, group=None, bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Broadcast ``tensors`` from group rank ``src_rank`` (``dist.broadcast`` wants its global rank:
    ``dist.get_global_rank``), in place: few flat messages instead of one per tensor. Tensors of one
    (dtype, device) are packed together, a message going out once it holds ``bucket_bytes``;
    ``_broadcast_flat`` sends one and copies it back through ``.data`` (no version bump, so a
    broadcast between two forwards and their backward does not fail autograd's in-place check)."""
    ### BEGIN SOLUTION
    src = dist.get_global_rank(group or dist.group.WORLD, src_rank)
    pending: dict = {}  # (dtype, device) -> tensors waiting to be packed
    for t in tensors:
        key = (t.dtype, t.device)
        pending.setdefault(key, []).append(t)
        if sum(x.numel() * x.element_size() for x in pending[key]) >= bucket_bytes:
            _broadcast_flat(pending.pop(key), src, group)
    for chunk in pending.values():
        _broadcast_flat(chunk, src, group)
    ### END SOLUTION


def _broadcast_flat(chunk, src, group) -> None:
    flat = torch.cat([t.detach().reshape(-1) for t in chunk])
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    for t in chunk:
        t.data.copy_(flat[offset : offset + t.numel()].view_as(t))  # .data: no version bump
        offset += t.numel()
# --8<-- [end:coalesced]


@issued_as("state broadcast")
def sync_module_states(module: torch.nn.Module, group=None, include_buffers: bool = True, src: int = 0) -> None:
    """Make every rank's parameters (all of them, frozen ones too) and, with ``include_buffers``, buffers equal to
    group rank ``src``'s (rank 0 at wrap), through ``broadcast_coalesced``."""
    ### BEGIN SOLUTION
    tensors = [p for p in module.parameters()]
    if include_buffers:
        tensors += [b for b in module.buffers()]
    if tensors:
        broadcast_coalesced(tensors, src, group)
    ### END SOLUTION


# --8<-- [start:broadcast_buffers]
@issued_as("buffer broadcast")
def broadcast_buffers(module: torch.nn.Module, group=None, src: int = 0) -> None:
    """Before each forward: every rank's buffers become rank ``src``'s (``broadcast_buffers=True``;
    ``src`` is rank 0, or under ``join()`` the highest rank still training)."""
    ### BEGIN SOLUTION
    buffers = [b for b in module.buffers()]
    if buffers and dist.get_world_size(group) > 1:
        broadcast_coalesced(buffers, src, group)
    ### END SOLUTION
# --8<-- [end:broadcast_buffers]
