"""``FSDPParam``: one parameter, held as this rank's dim-0 shard, gathered into a full tensor when a unit computes.

What
    A parameter of ``rows`` rows (its dim 0; a 0-d one counts as one row) is padded with zero rows to
    ``world_size * shard_rows`` and cut in ``world_size`` equal pieces; rank r keeps piece r as ``shard``, a plain
    ``nn.Parameter`` that the optimizer steps. ``unsharded`` is one full-size leaf tensor, kept for the whole run,
    whose memory is given back when the unit reshards (``free``) and filled again from the gather (``fill``):
    autograd saves a reference to it in the forward and reads it in the backward, so it must stay the same tensor
    (its ``.data`` is swapped, as FSDP's first version swapped it). ``register`` puts the shard, the full tensor or
    a ``FreedParameter`` under the parameter's names in its modules; a ``FreedParameter`` raises on any use, naming
    the parameter: the one-line refusal for a module that reads a
    parameter after its unit freed it (a parent's forward, a weight tied across units).

Why
    Memory: between steps a rank holds 1/N of every parameter (ZeRO-3, Rajbhandari et al., arXiv 1910.02054). Equal,
    padded pieces make one flat all-gather and one flat reduce-scatter per unit possible, as in FSDP2.

How torch differs
    FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``) keeps each shard as a ``DTensor`` with
    ``Shard(0)`` placement, unpadded (``torch.chunk``'s sizes), and pads only inside its all-gather buffers; it
    resizes the full tensor's storage to 0 and back (``free_storage`` / ``alloc_storage``), which saves an allocation
    but turns a missing gather into a read of freed memory. A ``DTensor`` read outside its unit fails on mixing with
    plain tensors; here the placeholder says so itself.
"""

from __future__ import annotations

import torch
from torch import nn


class FreedParameter(torch.Tensor):
    """What a module holds under a parameter's name while its unit is resharded mid-step: any use raises."""

    @staticmethod
    def __new__(cls, name: str):
        freed = torch.Tensor._make_subclass(cls, torch.empty(0))
        freed.freed_name = name
        return freed

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = next((a.freed_name for a in args if isinstance(a, FreedParameter)), "a parameter")
        raise RuntimeError(
            f"fully_shard: {name} was read after its unit resharded it (a parent module's forward, or a weight "
            "tied to another unit): read parameters only inside their own unit's forward, put both users in one "
            "unit (fully_shard their common parent only), or use reshard_after_forward=False for the unit")

    def __repr__(self):
        return f"FreedParameter({self.freed_name})"


class FSDPParam:
    """One parameter: its shard (``shard``), its full tensor (``unsharded``) and where it is registered."""

    def __init__(self, param: nn.Parameter, registrations: list, name: str, group, rank: int, world_size: int,
                 compute_dtype: torch.dtype):
        self.name, self.registrations = name, registrations  # [(module, attribute name)], ties included
        self.shape, self.dtype, self.requires_grad = param.shape, param.dtype, param.requires_grad
        self.rows = param.shape[0] if param.dim() else 1
        self.row_numel = param.numel() // self.rows if self.rows else int(torch.Size(param.shape[1:]).numel())
        self.shard_rows = -(-self.rows // world_size)
        self.group, self.rank, self.world_size = group, rank, world_size
        padded = self.pad(param.detach())
        piece = padded[rank * self.shard_rows : (rank + 1) * self.shard_rows]
        self.shard = nn.Parameter(piece.reshape(self.shard_shape).clone(), requires_grad=param.requires_grad)
        self.unsharded = nn.Parameter(torch.empty(0, dtype=compute_dtype, device=param.device),
                                      requires_grad=param.requires_grad)
        self.free()
        self.accumulated = None  # gradients of backward passes without sync, in the reduce dtype

    @property
    def shard_shape(self) -> tuple:
        return (self.shard_rows, *self.shape[1:]) if len(self.shape) else (self.shard_rows,)

    @property
    def shard_numel(self) -> int:
        return self.shard_rows * self.row_numel

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (the parameter's shape) as ``world_size * shard_rows`` rows of ``row_numel``, zero-padded."""
        rows = full.reshape(self.rows, self.row_numel)
        padded = rows.new_zeros(self.world_size * self.shard_rows, self.row_numel)
        padded[: self.rows] = rows
        return padded

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """The first ``rows`` rows of ``world_size * shard_rows`` padded ones, in the parameter's shape."""
        return padded.reshape(self.world_size * self.shard_rows, self.row_numel)[: self.rows].reshape(self.shape)

    # --8<-- [start:storage]
    def free(self) -> None:
        """Give the full tensor's memory back: the tensor object (which autograd may have saved) stays, empty,
        so a backward that reads it without a gather fails on its shape instead of reading freed memory."""
        self.unsharded.data = self.unsharded.data.new_empty(0)

    def fill(self, pieces: torch.Tensor) -> None:
        """The gathered pieces (``pieces[r]``: rank r's shard, flat) become the full tensor's data, copied once
        (``.data``: no version bump, and autograd's saved reference sees them)."""
        full = torch.empty(self.shape, dtype=self.unsharded.dtype, device=self.unsharded.device)
        for r, (start, stop) in enumerate(self.spans()):
            full.view(-1)[start:stop].copy_(pieces[r, : stop - start])
        self.unsharded.data = full
    # --8<-- [end:storage]

    def register(self, kind: str) -> None:
        """Put ``kind`` (``"shard"``, ``"unsharded"`` or ``"freed"``) under every name the parameter has."""
        tensor = self.shard if kind == "shard" else self.unsharded if kind == "unsharded" else FreedParameter(self.name)
        for module, attribute in self.registrations:
            module._parameters[attribute] = tensor

    def spans(self) -> list[tuple[int, int]]:
        """Rank r's piece as (start, stop) in the flat full tensor; the rest of its shard is padding."""
        per, total = self.shard_numel, self.rows * self.row_numel
        return [(min(r * per, total), min((r + 1) * per, total)) for r in range(self.world_size)]

    def write_gradient(self, pieces: torch.Tensor) -> None:
        """This backward's full gradient (plus what passes without sync kept) into ``pieces`` (``pieces[r]``: rank
        r's piece, in the send buffer's dtype), zeros where padded or where no gradient came; ``.grad`` dropped."""
        grad, self.unsharded.grad = self.unsharded.grad, None
        kept, self.accumulated = self.accumulated, None
        for r, (start, stop) in enumerate(self.spans()):
            row = pieces[r]
            row[stop - start :].zero_()
            if grad is None and kept is None:
                row[: stop - start].zero_()
                continue
            row[: stop - start].copy_((grad if grad is not None else kept).reshape(-1)[start:stop])
            if grad is not None and kept is not None:
                row[: stop - start].add_(kept.reshape(-1)[start:stop])

    def keep_gradient(self, dtype: torch.dtype) -> None:
        """No sync this backward: move ``.grad`` into the accumulator (in the reduce dtype), freeing ``.grad``."""
        grad, self.unsharded.grad = self.unsharded.grad, None
        if grad is not None:
            self.accumulated = grad.to(dtype) if self.accumulated is None else self.accumulated.add_(grad)
