"""DeepSpeed's ``optimizer`` and ``scheduler`` blocks, read as the trainer's AdamW and DeepSpeed's warmup schedules.

What
    ``read_blocks(config, source, args)`` reads the two blocks of a DeepSpeed config. ``optimizer`` of type
    ``AdamW`` or ``Adam`` (DeepSpeed's ``Adam`` is AdamW unless ``adam_w_mode`` is false) runs as the trainer's
    ``torch.optim.AdamW``; ``scheduler`` of type ``WarmupLR`` or ``WarmupDecayLR`` runs as a ``LambdaLR`` whose
    factor is DeepSpeed's schedule (``Schedule.lr_lambda``). Each ``"auto"`` is filled from the trainer as
    Hugging Face's ``HfTrainerDeepSpeedConfig`` fills it (``trainer_config_process``, ``trainer_config_finalize``);
    a value that disagrees with the trainer's is a ``DeepSpeedConfigError`` naming its dotted key, and so is any
    other optimizer or schedule. Without ``args`` only what can be checked alone is (the launcher, ``miniddp
    config``).

Why
    Hugging Face's DeepSpeed templates carry both blocks, every value ``"auto"``: a real user's file has them, and
    it runs unchanged under Transformers. The values must agree, so the file says what runs: miniddp keeps one
    optimizer, the trainer's, and reproduces the two schedules Transformers maps its own onto.

How DeepSpeed and Hugging Face differ
    DeepSpeed steps its own fused Adam (torch's AdamW with ``torch_adam``: the same update up to rounding) and its
    own schedule objects; here the schedule is a ``LambdaLR`` of ``learning_rate``, so checkpoints keep torch's
    format. DeepSpeed steps the schedule after each optimizer step, never at construction: the first step runs
    at ``warmup_min_lr``, and the warmup lasts ``max(2, warmup_num_steps)`` steps, so with no warmup the first two
    steps run at ``warmup_min_lr`` (0 by default), as they do under Transformers. Transformers leaves a key that
    is not written to DeepSpeed's default, whatever the trainer says; here that default must agree too.
    miniddp's trainer has no ``adam_beta1``/``adam_beta2``/``adam_epsilon``/``warmup_steps``: its values are
    torch's AdamW defaults (Transformers' defaults too) and no warmup (Transformers fills ``max(1, 0)``).
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass

import torch

from .deepspeed_keys import DeepSpeedConfigError, number_problem

ADAM_TYPES = ("adamw", "adam")  # DeepSpeed compares its own optimizers' names in lower case
SCHEDULES = ("WarmupLR", "WarmupDecayLR")
TORCH_ADAMW = inspect.signature(torch.optim.AdamW).parameters  # the trainer leaves betas and eps at these
# Each key DeepSpeed reads in the two blocks: (DeepSpeed's default when it is not written, what it may be);
# a number (low, whole) is checked by number_problem, "matched" values must then agree with the trainer's.
OPTIMIZER = {"lr": (1e-3, (0, False)), "betas": ([0.9, 0.999], "betas"), "eps": (1e-8, (0, False)),
             "weight_decay": (0.0, (0, False)),  # DeepSpeed's FusedAdam defaults
             "adam_w_mode": (True, "flag"), "torch_adam": (False, "flag"), "bias_correction": (True, (True,)),
             "amsgrad": (False, (False,))}
SCHEDULER = {"warmup_min_lr": (0.0, (0, False)), "warmup_max_lr": (None, (0, False)),
             "warmup_num_steps": (1000, (0, True)), "warmup_type": ("log", ("log", "linear")),
             "total_num_steps": (None, (1, True)), "last_batch_iteration": (-1, (-1,))}


@dataclass(frozen=True)
class Schedule:
    """DeepSpeed's WarmupLR (warm up, then stay) or WarmupDecayLR (warm up, then decay linearly to 0)."""

    decay: bool  # WarmupDecayLR
    min_lr: float  # warmup_min_lr; the peak is the trainer's learning_rate
    warmup_num_steps: int  # as filled; DeepSpeed warms up for at least 2 steps
    linear: bool  # warmup_type "linear"; else "log"
    total_num_steps: int | None  # None: "auto", the trainer's number of steps
    source: str

    # --8<-- [start:lambda]
    def lr_lambda(self, learning_rate: float, max_steps: int):
        """The factor of ``learning_rate`` for LambdaLR's step ``s`` (0: the first optimizer step)."""
        if self.total_num_steps not in (None, max_steps):  # max_steps known only now, for a run by epochs
            raise DeepSpeedConfigError(self.source, "scheduler.params.total_num_steps", _disagree(
                self.total_num_steps, max_steps, "the run's number of optimizer steps"), disagrees_with="max_steps")
        warm = max(2, self.warmup_num_steps)
        inverse_log, low = 1.0 / math.log(warm), self.min_lr / learning_rate

        def gamma(iteration: int) -> float:  # DeepSpeed's, at its last_batch_iteration
            if iteration < 0:  # not stepped yet: DeepSpeed's first optimizer step runs at warmup_min_lr
                return 0.0
            if iteration < warm:
                return iteration / warm if self.linear else inverse_log * math.log(iteration + 1)
            return max(0.0, (max_steps - iteration) / max(1.0, max_steps - warm)) if self.decay else 1.0
        # DeepSpeed steps its schedule after the optimizer: LambdaLR's step s runs at DeepSpeed's iteration s - 1
        return lambda step: low + (1 - low) * gamma(step - 1)
    # --8<-- [end:lambda]


def _disagree(value, want, name: str) -> str:
    return (f"={json.dumps(value)} disagrees with {name} ({json.dumps(want)}): set it to \"auto\" (filled from "
            f"the trainer, as Hugging Face does) or to {json.dumps(want)}")


def _allowed(value, rule) -> str | None:
    """Why ``value`` cannot be written for a key with ``rule`` (OPTIMIZER's and SCHEDULER's); None: it can."""
    if rule == "flag":
        return None if isinstance(value, bool) else "=" + json.dumps(value, default=str) + " must be true or false"
    if rule == "betas":
        if isinstance(value, list) and len(value) == 2 and not any(number_problem(b, 0, False) for b in value) \
                and max(value) < 1:
            return None
        return "=" + json.dumps(value, default=str) + " must be two numbers in [0, 1), e.g. [0.9, 0.999]"
    if len(rule) == 2 and isinstance(rule[1], bool):  # a number: (low, whole)
        return number_problem(value, *rule)
    if value in rule and type(value) is type(rule[0]):
        return None
    return f"={json.dumps(value, default=str)}: miniddp runs {' or '.join(json.dumps(v) for v in rule)} only"


def _trainer_values(args: dict) -> dict:
    """The trainer's value each matched key must agree with, and its name (Hugging Face's fill_match)."""
    return {
        "optimizer.params.lr": (args["learning_rate"], "learning_rate"),
        "optimizer.params.betas": (list(TORCH_ADAMW["betas"].default),
                                   "the betas of torch's AdamW, which the trainer steps"),
        "optimizer.params.eps": (TORCH_ADAMW["eps"].default, "the eps of torch's AdamW, which the trainer steps"),
        "optimizer.params.weight_decay": (args["weight_decay"], "weight_decay"),
        "scheduler.params.warmup_max_lr": (args["learning_rate"], "learning_rate"),
        "scheduler.params.warmup_num_steps": (1, "Hugging Face's fill for no warmup"),
        "scheduler.params.total_num_steps": (args["max_steps"] if args["max_steps"] > 0 else None, "max_steps"),
    }


AUTO = ("optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps")  # the keys Hugging Face fills; warmup_min_lr with 0 (fill_only)


def fill_blocks(config: dict, source: str, args: dict | None = None) -> dict[str, dict | None]:
    """Each block's params: checked; with ``args`` "auto" filled and the rest matched (None: no such block)."""
    return {name: _block(config, name, source, args) for name in ("optimizer", "scheduler")}


def _block(config: dict, name: str, source: str, args: dict | None) -> dict | None:
    block = config.get(name)
    if block is None:
        return None
    extra = sorted(set(block) - {"type", "params"}) if isinstance(block, dict) else [None]
    if extra:
        raise DeepSpeedConfigError(source, f"{name}.{extra[0]}" if extra[0] else name, "is not DeepSpeed's: a "
                                   'block is {"type": ..., "params": {...}}')
    kind, params = block.get("type"), block.get("params", {})
    lower = kind.lower() if name == "optimizer" and isinstance(kind, str) else kind
    if lower not in (ADAM_TYPES if name == "optimizer" else SCHEDULES):
        runs = "AdamW or Adam (torch's AdamW)" if name == "optimizer" else "WarmupLR or WarmupDecayLR"
        raise DeepSpeedConfigError(source, f"{name}.type", f"={json.dumps(kind, default=str)}: miniddp runs {runs}, "
                                   f"as Hugging Face's templates do: set one, or delete the {name} block (then the "
                                   "trainer's own runs)")
    if not isinstance(params, dict):
        raise DeepSpeedConfigError(source, f"{name}.params", "must be an object of the block's parameters")
    table, trainer = (OPTIMIZER if name == "optimizer" else SCHEDULER), _trainer_values(args) if args else {}
    filled = {}
    for key in [*params, *(k for k in table if k not in params)]:  # the written ones first, then the defaults
        dotted, written = f"{name}.params.{key}", key in params
        if key not in table or (written and key == "total_num_steps" and kind == "WarmupLR"):  # WarmupLR stays
            raise DeepSpeedConfigError(source, dotted, f"is not a parameter of {kind} miniddp reproduces: delete it")
        default = 1e-3 if dotted == "scheduler.params.warmup_max_lr" and kind == "WarmupDecayLR" else table[key][0]
        value, (want, what) = params.get(key, default), trainer.get(dotted, (None, ""))
        if value == "auto" and dotted in AUTO:
            filled[key] = 0.0 if key == "warmup_min_lr" else want  # None: not known yet (args, max_steps)
        elif written and _allowed(value, table[key][1]):
            raise DeepSpeedConfigError(source, dotted, _allowed(value, table[key][1]))
        elif value is None or want is None or value == want:
            filled[key] = want if value is None else value  # warmup_max_lr's None: the optimizer's lr
        elif written:
            raise DeepSpeedConfigError(source, dotted, _disagree(value, want, what), disagrees_with=what)
        else:  # Hugging Face lets DeepSpeed's default run, whatever the trainer says
            raise DeepSpeedConfigError(source, dotted, f"is not written: DeepSpeed's default {json.dumps(value)} "
                                       f'disagrees with {what} ({json.dumps(want)}): write "{key}": "auto"',
                                       disagrees_with=what)
    if lower == "adam" and filled["adam_w_mode"] is False:
        raise DeepSpeedConfigError(source, "optimizer.params.adam_w_mode", "=false is Adam with L2 weight decay; "
                                   "miniddp steps torch's AdamW: delete it (true is DeepSpeed's default)")
    if kind == "WarmupDecayLR" and "total_num_steps" not in params:
        raise DeepSpeedConfigError(source, "scheduler.params.total_num_steps", 'is required by WarmupDecayLR: write '
                                   '"total_num_steps": "auto" (the trainer\'s number of optimizer steps)')
    return filled


def read_blocks(config: dict, source: str, args: dict | None = None) -> Schedule | None:
    """Check ``config``'s optimizer and scheduler blocks (with ``args``, TrainingArguments' names and ``max_steps``:
    filled and matched); return DeepSpeed's schedule, or None: the trainer's own (no scheduler block)."""
    params = fill_blocks(config, source, args)["scheduler"]
    if params is None or args is None:
        return None
    decay = config["scheduler"]["type"] == "WarmupDecayLR"
    return Schedule(decay=decay, min_lr=params["warmup_min_lr"],
                    warmup_num_steps=int(params["warmup_num_steps"]), linear=params["warmup_type"] == "linear",
                    total_num_steps=int(params["total_num_steps"]) if decay and params["total_num_steps"] else None,
                    source=source)
