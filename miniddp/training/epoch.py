"""An epoch's plan: the micro-batches each rank gets, the accumulation windows, and what a step trains on.

What
    ``plan_epoch(samples_per_rank, batch_size, gradient_accumulation_steps, world_size, ...)``
    returns an ``EpochPlan``: each rank's micro-batch sizes, the windows the epoch splits into
    (``no_sync.accumulation_windows``), and ``samples_per_step``, the samples the largest optimizer
    step consumes over all ranks: the trainer reports it as ``effective_batch_size``. It refuses an
    epoch that cannot train (no micro-batch at all; a BatchNorm1d model whose micro-batch would hold
    one sample) and notes a window longer than the epoch.

Why
    per_device_train_batch_size x world_size x gradient_accumulation_steps is what a step *would*
    consume. With 16 samples on 2 ranks and 4 accumulation steps, every rank has one micro-batch
    per epoch: the window is cut at the epoch's end and a step trains on 16, not 64. Reporting 64
    misleads every comparison of runs. Unchecked, an empty dataset makes the loop move from epoch
    to epoch for ever (no collective runs, so no timeout fires), and BatchNorm fails hundreds of
    steps in, on an epoch's last micro-batch of one sample.

How Hugging Face differs
    ``TrainingArguments`` reports ``train_batch_size`` x accumulation x world size, the nominal
    product, and a window also ends at the epoch's end. ``dataloader_drop_last`` is its name for
    dropping each rank's last incomplete micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.no_sync import accumulation_windows


@dataclass(frozen=True)
class EpochPlan:
    batch_sizes: list[int]  # each rank's micro-batch sizes in one epoch, in order
    windows: list[int]  # micro-batches per optimizer step (the last may be shorter)
    samples_per_step: int  # samples the largest step consumes, over all ranks: the effective batch
    nominal: int  # per_device_train_batch_size x world_size x gradient_accumulation_steps
    notice: str  # a window longer than the epoch, said once by rank 0; "" otherwise


# --8<-- [start:plan]
def plan_epoch(samples_per_rank: int, batch_size: int, gradient_accumulation_steps: int, world_size: int, *,
               drop_last: bool = False, model: torch.nn.Module | None = None) -> EpochPlan:
    """The plan of one epoch of ``samples_per_rank`` samples per rank; a ValueError if it cannot train."""
    full, rest = divmod(samples_per_rank, batch_size)
    sizes = [batch_size] * full + ([rest] if rest and not drop_last else [])
    if not sizes:
        raise ValueError(
            f"each rank gets no micro-batch per epoch: {samples_per_rank} sample(s) per rank"
            + (f" and dataloader_drop_last drops an incomplete one (per_device_train_batch_size={batch_size})"
               if samples_per_rank else " (train_dataset is empty)")
            + ": give the Trainer a train_dataset with samples" + (", or set dataloader_drop_last=False"
                                                                    if samples_per_rank else ""))
    norm = next((name for name, m in (model.named_modules() if model is not None else [])
                 if isinstance(m, torch.nn.BatchNorm1d)), None)
    if norm is not None and 1 in sizes:
        which = "every micro-batch" if sizes == [1] * len(sizes) else "each rank's last micro-batch of an epoch"
        raise ValueError(f"{which} holds 1 sample, and {norm or 'the model'} (BatchNorm1d) cannot train on one "
                         "(\"Expected more than 1 value per channel\"): set dataloader_drop_last=True, or change "
                         "per_device_train_batch_size or the dataset size")
    windows = accumulation_windows(len(sizes), gradient_accumulation_steps)
    starts = [sum(windows[:i]) for i in range(len(windows))]
    per_step = max(sum(sizes[s:s + n]) for s, n in zip(starts, windows)) * world_size
    nominal = batch_size * world_size * gradient_accumulation_steps
    notice = ""
    if gradient_accumulation_steps > len(sizes):
        notice = (f"gradient_accumulation_steps={gradient_accumulation_steps} is longer than an epoch ({len(sizes)} "
                  f"micro-batch(es) per rank): every optimizer step ends with the epoch, so a step trains on "
                  f"{per_step} samples, not {nominal}")
    return EpochPlan(sizes, windows, per_step, nominal, notice)
# --8<-- [end:plan]
