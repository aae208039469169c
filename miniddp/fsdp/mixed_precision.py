"""``MixedPrecisionPolicy``: which dtype a unit computes in and which its gradients are averaged in.

What
    ``MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)``, FSDP2's names. ``param_dtype``: the dtype the
    shards are cast to before the all-gather, so the full parameters (and the forward, the backward, the unsharded
    gradients) are in it; None keeps the parameters' own dtype. ``reduce_dtype``: the dtype the gradients are
    reduce-scattered in; None means ``param_dtype``. The shards themselves (the optimizer's "master weights") and
    their ``.grad`` stay in the parameters' dtype, fp32 as a rule. Floating-point forward inputs are cast to
    ``param_dtype`` (FSDP2's ``cast_forward_inputs=True``).

Why
    bf16 halves the all-gather's bytes and the activations' memory; summing many ranks' gradients in bf16 loses
    bits, so ``reduce_dtype=torch.float32`` is the usual pair (the Ultra-Scale Playbook, "Mixed precision training").

How torch differs
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` (``_fully_shard/_fsdp_api.py``) also has ``output_dtype`` and
    ``cast_forward_inputs``; here inputs are always cast and outputs are what the module returns. DeepSpeed keeps
    fp32 master weights in the optimizer and bf16 parameters in the model (``bf16: {enabled: true}``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# --8<-- [start:policy]
@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The compute dtype (``param_dtype``) and the gradient-averaging dtype (``reduce_dtype``); None: unchanged."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in FLOATS:
                raise ValueError(f"MixedPrecisionPolicy({name}={value!r}): give a floating dtype "
                                 "(torch.bfloat16, torch.float16, torch.float32) or None")

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The full parameter's dtype for a shard of ``dtype``."""
        return self.param_dtype or dtype

    def gradient_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The reduce-scatter's dtype for a parameter of ``dtype``: ``reduce_dtype``, else ``param_dtype``."""
        return self.reduce_dtype or self.param_dtype or dtype
# --8<-- [end:policy]
