"""An independent correct solution of ``buffers``, kept to prove the spec accepts code unlike the reference.

What differs from the reference: ``broadcast_coalesced`` sorts the tensors into (dtype, device) families
and packs each message into a pre-allocated buffer with slice copies (no ``torch.cat``), addresses the
source by its group rank (``group_src``) and writes the result back under
``torch.autograd._unsafe_preserve_version_counter`` instead of through ``.data`` -- both leave the
version counter alone, so two forwards before one backward still work. ``sync_module_states`` and
``broadcast_buffers`` share one ``_state`` helper listing what to send.
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


def refuse_sparse_gradients(module: torch.nn.Module) -> None:
    """``nn.Embedding(sparse=True)`` makes sparse gradients; our buckets are dense: say so at wrap."""
    for name, m in module.named_modules():
        if getattr(m, "sparse", False) is True:
            raise NotImplementedError(
                f"{name or 'the model'} ({type(m).__name__}) has sparse=True: its gradients are sparse tensors and "
                "miniddp's buckets hold dense gradients only. Use sparse=False, or torch's DistributedDataParallel.")


def refuse_meta_tensors(module: torch.nn.Module) -> None:
    """A parameter or buffer on the meta device has a shape and no data: say so at wrap, not in a hook."""
    name = next((n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta), None)
    if name is not None:
        raise ValueError(f"{name} is on the meta device (a shape, no data): materialise the model before wrapping, "
                         "e.g. model.to_empty(device='cpu'), then initialise or load its weights")


# --8<-- [start:coalesced]
def broadcast_coalesced(tensors, src_rank: int = 0, group=None, bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Broadcast ``tensors`` from group rank ``src_rank``: few flat messages instead of one per tensor."""
    families: dict[tuple, list[torch.Tensor]] = {}  # one flat message holds one dtype on one device
    for t in tensors:
        families.setdefault((t.dtype, t.device), []).append(t)
    for family in families.values():
        message: list[torch.Tensor] = []
        size = 0
        for t in family:
            nbytes = t.numel() * t.element_size()
            if message and size + nbytes > bucket_bytes:  # full: send what we have, start the next message
                _send_packed(message, src_rank, group)
                message, size = [], 0
            message.append(t)
            size += nbytes
        if message:
            _send_packed(message, src_rank, group)


def _send_packed(message: list[torch.Tensor], src_rank: int, group) -> None:
    packed = torch.empty(sum(t.numel() for t in message), dtype=message[0].dtype, device=message[0].device)
    start = 0
    for t in message:
        packed[start : start + t.numel()] = t.detach().reshape(-1)
        start += t.numel()
    dist.broadcast(packed, group=group, group_src=src_rank)
    start = 0
    for t in message:
        # a plain in-place copy would bump the version: a graph that saved t in an earlier forward would refuse
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
            t.copy_(packed[start : start + t.numel()].view(t.shape))
        start += t.numel()


# --8<-- [end:coalesced]


@issued_as("state broadcast")
def sync_module_states(module: torch.nn.Module, group=None, include_buffers: bool = True, src: int = 0) -> None:
    """Make every rank's parameters (and buffers) equal to group rank ``src``'s (rank 0 at wrap)."""
    broadcast_coalesced(_state(module, parameters=True, buffers=include_buffers), src, group)


def _state(module: torch.nn.Module, parameters: bool, buffers: bool) -> list[torch.Tensor]:
    """The module's distinct parameters and/or buffers (a tied tensor once), in registration order."""
    chosen = (list(module.parameters()) if parameters else []) + (list(module.buffers()) if buffers else [])
    return list({id(t): t for t in chosen}.values())


# --8<-- [start:broadcast_buffers]
@issued_as("buffer broadcast")
def broadcast_buffers(module: torch.nn.Module, group=None, src: int = 0) -> None:
    """Before each forward: every rank's buffers become rank ``src``'s (``broadcast_buffers=True``;
    ``src`` is rank 0, or under ``join()`` the highest rank still training)."""
    broadcast_coalesced(_state(module, parameters=False, buffers=True), src, group)
# --8<-- [end:broadcast_buffers]
