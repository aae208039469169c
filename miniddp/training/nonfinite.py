"""Non-finite training stops: a NaN or inf loss ends the run on every rank, before it costs anything.

What
    ``stop_if_not_finite`` runs after the gradients are averaged and before the
    optimizer step. One all-gather brings every rank's loss (and the averaged
    gradient's norm) to every rank; if any is NaN or inf, every rank raises the
    same ``NonFiniteLossError`` naming the step, the ranks, the values and the last
    checkpoint. The weights stay the last finite ones and nothing more is saved.
    ``finite_or_null`` makes a metrics dict valid JSON (JSON has no NaN).

Why
    Unchecked, a diverged run exits 0: with ``--learning_rate 1e20`` every
    parameter is NaN, ``final_model.pt`` is saved anyway (over a good one), and
    ``metrics.json`` holds ``NaN`` literals that strict JSON parsers reject. A NaN
    on one rank alone (one bad sample) reaches every rank through the all-reduce,
    so each rank must stop at the same step or the others hang in the next
    collective. Checking costs one small all-gather and one host sync per
    optimizer step.

How Hugging Face differs
    ``transformers.Trainer`` has ``logging_nan_inf_filter`` (drop NaN losses from
    the *logged* average, keep training) and no stop; ``torch.nn.utils.
    clip_grad_norm_(error_if_nonfinite=True)`` raises on one rank only. With fp16,
    inf gradients are the ``GradScaler``'s business (it skips the step and lowers
    the scale): only the loss is checked, and skipped steps are counted.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..process_group.stalled_ranks import naming_stalled_ranks
from .checkpoint_timeline import checkpoints


class NonFiniteLossError(RuntimeError):
    """A loss or gradient norm became NaN or inf; raised on every rank before the optimizer step."""


def grad_norm(parameters) -> torch.Tensor:
    """The 2-norm of all gradients (what ``clip_grad_norm_`` returns), without clipping anything."""
    norms = [torch.linalg.vector_norm(p.grad) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


# --8<-- [start:stop]
def stop_if_not_finite(loss: torch.Tensor, norm: torch.Tensor | None, *, step: int, output_dir,
                       learning_rate: float) -> None:
    """Every rank calls this with its loss and the averaged gradient's norm (None: not checked, fp16)."""
    mine = torch.stack([loss.double(), torch.zeros_like(loss, dtype=torch.float64) if norm is None
                        else norm.double().to(loss.device)])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    with naming_stalled_ranks(f"non-finite check of step {step}"):
        dist.all_gather(everyone, mine)  # every rank sees every rank's values: they all decide alike
    table = torch.stack(everyone).tolist()
    bad = [r for r, (value, n) in enumerate(table) if not (math.isfinite(value) and math.isfinite(n))]
    if bad:
        found = checkpoints(output_dir)
        raise NonFiniteLossError(
            f"training diverged at step {step}: loss {table[bad[0]][0]} on rank(s) {bad}, gradient norm "
            f"{table[0][1] if norm is not None else 'not checked (fp16)'}; the step was not taken. Last "
            f"checkpoint: {found[-1] if found else 'none'}. Lower --learning_rate ({learning_rate}), "
            "keep --max_grad_norm > 0, or look for bad samples in that step's batches")
# --8<-- [end:stop]


def finite_or_null(value):
    """JSON has no NaN: non-finite floats become null (json.dumps would write the invalid literal NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value
