"""Training configuration with Hugging Face's names, validated before any rank starts.

What
    ``TrainingConfig`` holds the knobs of a data-parallel training run under the
    names ``transformers.TrainingArguments`` and TRL use
    (``per_device_train_batch_size``, ``gradient_accumulation_steps``,
    ``ddp_bucket_cap_mb``, ``ddp_find_unused_parameters``, ...). Validation runs
    at construction and names the field and the fix; it checks types too (the
    string ``"false"`` is true), and the values torch reads only at the first
    step: ``torch_compile_backend`` and ``gradient_checkpointing_kwargs``
    (``config_checks.py``). A ``Path`` or ``timedelta`` becomes the ``str`` or
    seconds that ``metrics.json`` records. ``effective_batch_size``
    is the nominal samples per optimizer step (the Trainer reports what a step
    really consumed: ``epoch.py``), the number comparisons of runs hold constant.

Why
    A wrong value should fail in the first second on one line, not after model
    loading on every rank with N interleaved tracebacks. And the effective batch,
    per_device_train_batch_size x world_size x gradient_accumulation_steps, is
    what makes runs comparable: TRL's table of equivalent splits is the claim
    that runs with the same effective batch train the same model (tested in
    ``tests/test_trainer.py``).

How Hugging Face differs
    ``TrainingArguments`` has ~100 fields; these are the ones DDP touches, plus a
    few a training loop needs. ``ddp_find_unused_parameters`` and
    ``ddp_broadcast_buffers`` default to ``None`` there (decided from the model);
    here they default to DDP's own defaults. Transformers' docs warn against
    combining either with ``gradient_checkpointing``; we refuse the combination.
    ``mixed_precision`` is Accelerate's name (``no``/``bf16``/``fp16``); ``deepspeed`` takes
    DeepSpeed's config, for miniddp's ZeRO stage 0-3 (``deepspeed_args.py``); ``fsdp`` and ``fsdp_config`` take
    Transformers' FSDP words and keys (``fsdp_args.py``).
    ``per_device_eval_batch_size`` defaults to 256 (8 there): the built-in
    evaluation sets are tiny. ``loss_normalization``, ``model``, ``dataset_size``,
    ``eval_size`` and ``dropout`` choose the built-in task (``tasks.py``); the
    Trainer itself never reads them. Each field's ``metadata["help"]`` is its ``--help`` line.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta

from ..comm_hooks import COMM_HOOKS
from ..engine.bucketing import check_bucket_cap_mb
from ..process_group.backend import valid_backend_names
from ..process_group.timeouts import DEFAULT_TIMEOUT_S, as_timedelta
from .config_checks import check_compile_backend, checkpoint_kwargs
from .deepspeed_args import deepspeed_settings, world_size_from_env
from .fsdp_args import fsdp_settings
from .fsdp_keys import FSDPSettings
from .report_to import REPORT_TO, check_report_to

MIXED_PRECISION = ("no", "bf16", "fp16")
LOSS_NORMALIZATION = ("per_batch", "global_tokens")
MODELS = ("mlp", "bn", "lm")
MAX_SEED = 2**32 - 1  # numpy's largest seed; seed + rank stays far inside torch's 64 bits


def choices() -> dict[str, list[str]]:
    """The fields that take one of a few names, and those names (validation and ``--help`` share them)."""
    return {"ddp_backend": valid_backend_names(), "ddp_comm_hook": list(COMM_HOOKS),
            "mixed_precision": list(MIXED_PRECISION), "loss_normalization": list(LOSS_NORMALIZATION),
            "model": list(MODELS), "report_to": list(REPORT_TO)}


@dataclass
class TrainingConfig:
    # Each field's metadata["help"] is its line in `miniddp-train --help` (as in TrainingArguments).
    output_dir: str = field(default="miniddp-output", metadata={
        "help": "where metrics.json, final_model.pt and checkpoint-<step>/ go"})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "samples per rank per micro-batch"})
    per_device_eval_batch_size: int = field(default=256, metadata={"help": "samples per rank per evaluation batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "micro-batches per optimizer step (only the last one all-reduces)"})
    dataloader_drop_last: bool = field(default=False, metadata={
        "help": "drop each rank's last incomplete micro-batch of an epoch (BatchNorm needs 2+)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW's, decayed linearly to 0 over the run"})
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps to train; -1: train for num_train_epochs"})
    num_train_epochs: float = field(default=3.0, metadata={
        "help": "passes over the training set, when max_steps is -1"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the gradient norm after averaging; 0 disables"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW's weight decay"})
    seed: int = field(default=42, metadata={
        "help": "shuffling, the built-in tasks, and each rank's random stream (seed + rank)"})
    logging_steps: int = field(default=10, metadata={
        "help": "log the loss averaged over ranks every this many optimizer steps"})
    save_steps: int = field(default=0, metadata={"help": "save a checkpoint every this many optimizer steps; 0: never"})
    save_total_limit: int | None = field(default=None, metadata={
        "help": "keep at most this many checkpoints (oldest deleted); none: all"})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "a checkpoint-<step> directory, or latest (newest in output_dir)"})
    resume_allow_changes: bool = field(default=False, metadata={
        "help": "resume under another world size, batch, schedule or task (data order changes)"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "delete another run's results in output_dir instead of refusing to start"})
    ddp_backend: str = field(default="auto", metadata={
        "help": "process-group backend; auto: from the device (gloo on CPU, nccl on CUDA)"})
    ddp_find_unused_parameters: bool = field(default=False, metadata={
        "help": "DDP's find_unused_parameters: allow parameters without gradient"})
    ddp_static_graph: bool = field(default=False, metadata={
        "help": "DDP's static_graph: learn the graph in the first step (reentrant checkpointing works)"})
    ddp_bucket_cap_mb: float | str | None = field(default=None, metadata={
        "help": "DDP's bucket_cap_mb in MiB, or auto (the cost model picks it); none: 1 MiB, then 25 MiB"})
    ddp_broadcast_buffers: bool = field(default=True, metadata={
        "help": "DDP's broadcast_buffers: copy rank 0's buffers before each forward"})
    ddp_timeout: float = field(default=DEFAULT_TIMEOUT_S, metadata={
        "help": "seconds a collective may wait for the other ranks"})
    ddp_comm_hook: str = field(default="no", metadata={
        "help": "DDP communication hook (Accelerate's names): compress what crosses the wire"})
    ddp_comm_powersgd_rank: int = field(default=1, metadata={
        "help": "PowerSGD's matrix_approximation_rank (power_sgd, batched_power_sgd)"})
    ddp_comm_powersgd_start_iter: int = field(default=1000, metadata={
        "help": "PowerSGD's start_powerSGD_iter: plain all-reduce before this step"})
    use_cpu: bool = field(default=False, metadata={
        "help": "train on the CPU even where there is a GPU (the backend does not choose the device)"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute activations in backward (model.gradient_checkpointing_enable)"})
    gradient_checkpointing_kwargs: dict | str | None = field(default=None, metadata={
        "help": "torch.utils.checkpoint's keywords, JSON: {\"use_reentrant\": true} (then see ddp_static_graph)"})
    torch_compile: bool = field(default=False, metadata={
        "help": "torch.compile the DDP-wrapped model for training, as Accelerate does (docs/ddp.md#torchcompile)"})
    torch_compile_backend: str | None = field(default=None, metadata={
        "help": "torch.compile's backend; setting it sets torch_compile (none: inductor; aot_eager needs no "
                "compiler)"})
    mixed_precision: str = field(default="no", metadata={
        "help": "autocast to bf16, or fp16 with a GradScaler; no: fp32"})
    loss_normalization: str = field(default="per_batch", metadata={
        "help": "built-in tasks: per_batch mean, or global_tokens (num_items_in_batch)"})
    model: str = field(default="mlp", metadata={
        "help": "built-in task: mlp, bn (with BatchNorm), lm (tiny causal LM, variable lengths)"})
    dataset_size: int = field(default=2048, metadata={"help": "training samples of the built-in task"})
    eval_size: int = field(default=512, metadata={"help": "held-out samples of the built-in task; 0: no evaluation"})
    dropout: float = field(default=0.0, metadata={"help": "the built-in models' dropout probability"})
    disable_tqdm: bool = field(default=False, metadata={"help": "no progress bar"})
    deepspeed: str | dict | None = field(default=None, metadata={
        "help": "a DeepSpeed config (JSON file, JSON text or dict): zero_optimization.stage 0, 1 or 2 runs miniddp's "
                "ZeRO, 3 its fully_shard; none: ACCELERATE_USE_DEEPSPEED's variables, else stage 0"})
    fsdp: str | list | None = field(default=None, metadata={
        "help": "fully_shard the model (Transformers' words): \"full_shard auto_wrap\" (ZeRO-3), shard_grad_op "
                "(keep the gathered parameters until backward); auto_wrap: units from fsdp_config; none: off"})
    fsdp_config: str | dict | None = field(default=None, metadata={
        "help": "with fsdp: a JSON file, JSON text or dict: transformer_layer_cls_to_wrap, min_num_params, "
                "reshard_after_forward, version"})
    report_to: str = field(default="none", metadata={
        "help": "also log to tensorboard (rank 0; output_dir/runs/ or $TENSORBOARD_LOGGING_DIR); none: metrics.json"})

    def __post_init__(self):
        self.validate()

    # --8<-- [start:validate]
    def validate(self) -> None:
        # a Path and a timedelta become what metrics.json can hold (it records the config)
        for name in ("output_dir", "resume_from_checkpoint", "deepspeed", "fsdp_config"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if isinstance(self.ddp_timeout, timedelta):
            self.ddp_timeout = self.ddp_timeout.total_seconds()
        for f in fields(self):  # then the types: "false" is truthy, and "1e-3" (YAML's string) has no "<"
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{f.name}={value!r} must be True or False")
            if f.type in ("float", float) and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise ValueError(f"{f.name}={value!r} must be a number")

        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")

        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "logging_steps", "dataset_size", "ddp_comm_powersgd_rank"):
            positive_int(name)
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or \
                (self.max_steps < 1 and self.max_steps != -1):
            raise ValueError(f"max_steps={self.max_steps!r} must be >= 1, or -1 to train for num_train_epochs")
        if self.max_steps == -1 and not (self.num_train_epochs > 0 and math.isfinite(self.num_train_epochs)):
            raise ValueError(f"num_train_epochs={self.num_train_epochs!r} must be > 0 (or set max_steps)")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate={self.learning_rate!r} must be a finite number > 0, e.g. 1e-3")
        for name in ("max_grad_norm", "weight_decay", "dropout"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a finite number >= 0")
        if self.dropout >= 1:
            raise ValueError(f"dropout={self.dropout!r} must be < 1")
        for name in ("save_steps", "eval_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0 (0 disables it)")
        limit = self.save_total_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"save_total_limit={limit!r} must be an integer >= 1, or None to keep all")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed={self.seed!r} must be an integer in 0..{MAX_SEED} (2**32 - 1: numpy's range, "
                             "which Hugging Face's set_seed needs too)")
        for name in ("output_dir", "resume_from_checkpoint"):
            value = getattr(self, name)
            fix = "" if name == "output_dir" else " (or 'latest'; leave it unset to start fresh)"
            if value is None and name != "output_dir":
                continue
            if not isinstance(value, str):
                raise ValueError(f"{name}={value!r} must be a directory's path{fix}")
            if not value.strip():
                raise ValueError(f"{name}={value!r} is empty: name a directory{fix}")
        check_bucket_cap_mb(self.ddp_bucket_cap_mb, "ddp_bucket_cap_mb")
        try:
            as_timedelta(self.ddp_timeout, name="ddp_timeout")
        except OverflowError:  # past timedelta's ~2.7 million years
            raise ValueError(f"ddp_timeout={self.ddp_timeout!r} is more seconds than a timedelta holds "
                             f"({timedelta.max.total_seconds():.3g}): use e.g. ddp_timeout=1800") from None
        if not isinstance(self.ddp_comm_powersgd_start_iter, int) or self.ddp_comm_powersgd_start_iter < 2:
            raise ValueError(f"ddp_comm_powersgd_start_iter={self.ddp_comm_powersgd_start_iter!r} must be an integer "
                             ">= 2: PowerSGD keeps its memories per bucket, and DDP rebuilds the buckets after step 1")
        for name, allowed in choices().items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {', '.join(allowed)}")
        check_report_to(self.report_to)  # the package too: before any rank starts
        self.gradient_checkpointing_kwargs = checkpoint_kwargs(self.gradient_checkpointing_kwargs)
        check_compile_backend(self.torch_compile_backend)  # config_checks.py: torch's own names, cheaply
        if self.torch_compile_backend is not None:  # Transformers: the backend implies torch_compile
            self.torch_compile = True
        if self.gradient_checkpointing and self.ddp_find_unused_parameters:
            raise ValueError("ddp_find_unused_parameters=True cannot be combined with gradient_checkpointing: "
                             "checkpointing recomputes the graph in backward, so the graph walked after the forward "
                             "is wrong. Set ddp_find_unused_parameters=False.")
        if self.gradient_checkpointing and self.ddp_broadcast_buffers and self.model == "bn":
            raise ValueError("ddp_broadcast_buffers=True cannot be combined with gradient_checkpointing on a model "
                             "with buffers: the recomputed forward sees buffers the broadcast changed. "
                             "Set ddp_broadcast_buffers=False.")
        self._zero = deepspeed_settings(self, world_size_from_env())  # deepspeed_args.py: stage 0, 1 or 2
        if self._zero.bucket_cap_mb is not None:  # zero_optimization.reduce_bucket_size, in MiB
            self.ddp_bucket_cap_mb = self._zero.bucket_cap_mb
        self._fsdp = fsdp_settings(self, self._zero.stage)  # fsdp_args.py: fsdp, stage 3 or ACCELERATE_USE_FSDP
    # --8<-- [end:validate]

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage ``deepspeed`` asks for: 0 (DDP), 1 or 2 (``miniddp.ZeroOptimizer``), 3 (``fully_shard``)."""
        return self._zero.stage

    @property
    def fsdp_settings(self) -> FSDPSettings:
        """How ``fully_shard`` runs (``.enabled`` False: DDP): from ``fsdp``, DeepSpeed's stage 3 or Accelerate's."""
        return self._fsdp

    @property
    def fully_sharded(self) -> bool:
        """Whether the parameters are sharded (``fsdp``, stage 3, ``ACCELERATE_USE_FSDP``): a resume compares it."""
        return self._fsdp.enabled

    def effective_batch_size(self, world_size: int) -> int:
        """Samples per optimizer step over all ranks: what equivalent runs share."""
        return self.per_device_train_batch_size * world_size * self.gradient_accumulation_steps

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def field_help() -> dict[str, str]:
    """Each field's ``metadata["help"]``, by name: the one text of ``--help`` and of this file."""
    return {f.name: f.metadata["help"] for f in fields(TrainingConfig) if f.metadata.get("help")}
