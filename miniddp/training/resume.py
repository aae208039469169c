"""Resuming: what a checkpoint must restore for a bit-exact continuation, and what it refuses.

What
    ``rng_state`` / ``set_rng_state`` capture every random stream a rank draws
    from (Python, NumPy, torch CPU, CUDA). ``epoch_batches`` starts an epoch's
    batches at a given batch *without drawing them*: the sampler's indices are
    sliced, so neither the data nor any RNG is touched by the skipped part.
    ``setup_of`` records what defines a run (world size, batch geometry, schedule,
    task, the model's parameter layout) and ``compare_setups`` names every
    difference when a checkpoint is resumed under another setup.

Why
    "Resume" is only trustworthy if the resumed run *is* the run that was
    interrupted. Three things break that silently: ``iter(DataLoader)`` draws a
    seed from the global torch RNG, so restoring the RNG and then building the
    iterator shifts every later dropout mask; skipping batches by loading them
    draws from the RNG of any random transform; and under a different world
    size or batch size the saved position (optimizer steps into the epoch)
    means other samples. Here the loader has its own generator, skipping slices
    indices, and a changed setup is an error that lists what changed, unless
    ``resume_allow_changes`` is set.

How Hugging Face differs
    ``Trainer`` saves ``rng_state_<rank>.pth`` (python, numpy, cpu, cuda) and
    skips the first batches with Accelerate's ``skip_first_batches`` (a
    sampler that drops the first indices, as here). It does not compare the
    setup: resuming on a different number of GPUs is accepted and the skipped
    batches are counted in the new units (``ignore_data_skip`` turns skipping off).
"""

from __future__ import annotations

import hashlib
import random

import torch
from torch.utils.data import DataLoader

try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None

# what a resumed run must share with the checkpoint's, beyond the model's layout:
GEOMETRY = ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps", "train_samples",
            "dataloader_drop_last")
SCHEDULE = ("seed", "learning_rate", "weight_decay", "max_grad_norm", "max_steps", "num_train_epochs",
            "mixed_precision", "model", "dataset_size", "dropout", "loss_normalization", "ddp_comm_hook",
            "ddp_comm_powersgd_rank", "ddp_comm_powersgd_start_iter", "zero_stage", "fully_sharded")


class SetupChangedError(ValueError):
    """A checkpoint is resumed under another setup (world size, batch, schedule, task or model)."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)  # weights_only-loadable
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and np is not None:
        kind, keys, *rest = state["numpy"]
        np.random.set_state((kind, keys.numpy(), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_per_rank(seed: int, rank: int) -> None:
    """Seed Python's and torch's generators (CUDA's too) with ``seed + rank``: each rank its own
    dropout masks, reproducibly (Accelerate's ``set_seed(seed, device_specific=True)``)."""
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)


# --8<-- [start:epoch_batches]
def epoch_batches(loader: DataLoader, skip: int):
    """The epoch's batches from batch ``skip`` on. Skipped batches are never loaded, and the loader
    draws no global random number (it must have its own ``generator``)."""
    assert loader.generator is not None, "give the DataLoader its own generator: iter() would draw from torch's"
    if skip == 0:
        return iter(loader)
    indices = list(loader.sampler)[skip * loader.batch_size:]  # the order the sampler gives, minus a prefix
    rest = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=indices, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory, drop_last=loader.drop_last, generator=loader.generator)
    return iter(rest)
# --8<-- [end:epoch_batches]


def setup_of(config, world_size: int, train_samples: int, model: torch.nn.Module) -> dict:
    """What defines a run: a resumed run must have the same (see ``compare_setups``)."""
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]
    return {"world_size": world_size, "train_samples": train_samples,
            **{name: getattr(config, name) for name in GEOMETRY + SCHEDULE if hasattr(config, name)},
            "model_layout": hashlib.sha256(repr(layout).encode()).hexdigest()[:16]}


# --8<-- [start:compare]
def compare_setups(saved: dict, now: dict, allow_changes: bool, path) -> str:
    """Raise if the setup changed since ``saved`` (unless ``allow_changes``); return a notice saying what changed."""
    if saved.get("model_layout") != now["model_layout"]:
        raise SetupChangedError(f"resume_from_checkpoint: {path} holds a different model (other parameter names, "
                                "shapes or dtypes): it cannot be loaded into this one. Resume with the model it "
                                "was saved from.")
    changed = [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in GEOMETRY + SCHEDULE if k in saved and saved[k] != now.get(k)]
    if not changed:
        return ""
    what = "; ".join(changed)
    if not allow_changes:
        raise SetupChangedError(f"resume_from_checkpoint: {path} was saved by a different setup ({what}). Resume "
                                "with the same flags and number of processes, or set resume_allow_changes=True "
                                "to continue anyway: the effective batch, the learning-rate schedule and the order "
                                "of the remaining data change")
    return (f"resuming {path} with changes ({what}): the weights, optimizer and schedule position are loaded; the "
            "rest of the epoch is a different slice of the data order, so the result differs from either run")
# --8<-- [end:compare]


def apply_new_schedule(optimizer, scheduler, learning_rate: float, weight_decay: float) -> None:
    """A resume that allows changes: the loaded optimizer and scheduler hold the *saved* run's learning
    rate and weight decay; this run's apply from its first step (else a changed --learning_rate is
    accepted, said, and silently not used)."""
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = learning_rate, weight_decay
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)  # LambdaLR's rule, at the step resumed
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def check_position(step: int, max_steps: int, path) -> None:
    """A checkpoint past ``max_steps`` would train nothing and report its own final model as this run's."""
    if step > max_steps:
        raise SetupChangedError(f"resume_from_checkpoint: {path} is at step {step}, past max_steps={max_steps}: "
                                "nothing would be trained. Raise --max_steps, or resume an earlier checkpoint")


def position_in_new_units(saved: dict, now: dict, window: int) -> int:
    """The window to continue the epoch from when the batch geometry changed: the same share of samples seen."""
    def per_window(s):
        return s["world_size"] * s["per_device_train_batch_size"] * s["gradient_accumulation_steps"]
    return window * per_window(saved) // per_window(now)  # rounded down: a few samples may be seen twice
