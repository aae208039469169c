"""The trainer: any model, data and loss, through every module of miniddp.

What
    ``Trainer(model=..., args=TrainingConfig(...), train_dataset=..., eval_dataset=None,
    data_collator=None, compute_loss_func=None, compute_metrics=None)`` takes
    ``transformers.Trainer``'s keywords. It joins the job (``init_distributed``), prepares the
    model, data, optimizer and mixed precision (``prepare.py``), seeds each rank with
    ``seed + rank``, and trains. This file is the loop: accumulation windows with ``no_sync`` on
    every micro-batch but the last (ZeRO stages 2 and 3: none), clipping after the sync (ZeRO and FSDP: from
    the shards), one optimizer and LR-schedule step per window, a stop at the first
    non-finite loss (``nonfinite.py``). Under FSDP (``fsdp``, or DeepSpeed's stage 3) ``self.ddp`` is a
    ``ShardedModel`` (``sharded_model.py``): the same calls, on ``fully_shard``'s units. Batches become losses in
    ``batches.py`` (the loop knows no task). Where the run is lives in one ``TrainerState``
    (``trainer.state``, ``trainer_state.py``); the loop hands it to two collaborators built with
    what they need: a ``ProgressReporter`` logs, evaluates and writes the results (``reporting.py``),
    a ``Checkpointer`` saves checkpoints and resumes exactly (``checkpointer.py``).

Why
    The pieces are only understood once they run together. This loop is also the oracle for
    the claim Hugging Face and TRL make: runs with the same effective batch
    (per_device_train_batch_size x world_size x gradient_accumulation_steps) train the same
    model, for any model whose loss is normalised right.

How Hugging Face differs
    ``transformers.Trainer`` (via Accelerate) does the same with far more options. It seeds
    every rank with the same ``seed``, so ranks draw the same dropout masks; Accelerate's
    ``set_seed(seed, device_specific=True)`` adds the process index, as we do. A model's own
    loss (a micro-batch mean) is divided by the window's *real* length, so a short last window
    is still an average (Hugging Face divides by ``gradient_accumulation_steps``). Tuple batches
    are ours. Its checkpointing and logging are methods of the ``Trainer`` itself, extended through
    callbacks that receive the ``TrainerState``.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

from ..engine.compile_graph_split import DDPOptimizer
from ..engine.ddp import move_to
from ..process_group.env import init_distributed
from ..process_group.stalled_ranks import naming_stalled_ranks
from ..zero.reduce_scatter_optimizer import ZeroOptimizer
from .batches import compute_loss, count_items, counts_items, evaluate
from .checkpointer import Checkpointer
from .config import TrainingConfig
from .deepspeed_args import deepspeed_settings
from .epoch import plan_epoch
from .nonfinite import grad_norm, stop_if_not_finite
from .prepare import prepare_dataloader, prepare_mixed_precision, prepare_model, prepare_optimizer
from .reporting import ProgressReporter
from .resume import epoch_batches, seed_per_rank, setup_of
from .sharded_model import FullModelState, FullOptimizerState
from .trainer_state import TrainerState


class Trainer:
    """Data-parallel training with ``transformers.Trainer``'s keywords; see the module docstring."""

    def __init__(self, *, model, args: TrainingConfig | None = None, train_dataset, eval_dataset=None,
                 data_collator=None, compute_loss_func=None, compute_metrics=None):
        args = TrainingConfig() if args is None else args
        if not isinstance(args, TrainingConfig):
            raise TypeError(f"args= must be a miniddp.TrainingConfig, got {type(args).__name__}")
        self.args = args
        self.data_collator = data_collator  # DataLoader's collate_fn; None: torch's default_collate
        self.compute_loss_func = compute_loss_func  # fn(outputs, labels, num_items_in_batch); None: the model's loss
        self.compute_metrics = compute_metrics  # fn(EvalPrediction) -> dict; None: eval_loss only
        self.eval_dataset = eval_dataset
        self.env = init_distributed(args.ddp_backend, args.ddp_timeout, device="cpu" if args.use_cpu else None)
        self.device, self.rank, self.world_size = self.env.device, self.env.rank, self.env.world_size
        zero = deepspeed_settings(args, self.world_size)  # checked again, with the world size
        self.zero_stage = zero.stage
        self.fsdp = args.fsdp_settings  # .enabled: fully_shard (fsdp, stage 3 or Accelerate's FSDP) where DDP would be
        setup = setup_of(args, self.world_size, len(train_dataset), model)  # a resume must match it (full shapes)
        self.model, self.ddp, self.comm_hook = prepare_model(model, args, self.device)  # self.model: unwrapped
        self.compiler = DDPOptimizer(self.ddp, args.torch_compile_backend or "inductor")  # one piece per bucket
        self.forward = torch.compile(self.ddp, backend=self.compiler) if args.torch_compile else self.ddp  # Accelerate
        seed_per_rank(args.seed, self.rank)  # after the wrap: rank 0's initial weights are everyone's
        self.sampler, self.loader = prepare_dataloader(train_dataset, args, self.rank, self.world_size, self.device,
                                                       data_collator)
        self.plan = plan_epoch(len(self.sampler), args.per_device_train_batch_size, args.gradient_accumulation_steps,
                               self.world_size, drop_last=args.dataloader_drop_last, model=self.model)  # or raise
        if self.plan.notice and self.rank == 0:
            print(f"miniddp: {self.plan.notice}", file=sys.stderr, flush=True)
        self.windows = self.plan.windows  # micro-batches per optimizer step, for one epoch
        per_epoch = len(self.windows)  # optimizer steps per epoch
        self.max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
        self.optimizer, self.scheduler = prepare_optimizer(self.ddp, args, self.max_steps, self.zero_stage,
                                                           zero.schedule)
        self.autocast, self.scaler = prepare_mixed_precision(args.mixed_precision, self.device)
        self.state = TrainerState()  # where the run is: saved whole in each checkpoint, restored whole
        self.pending_loss = torch.zeros((), dtype=torch.float64, device=self.device)  # this rank's, not yet in state
        # FSDP: a checkpoint (and final_model.pt) holds full tensors, gathered by every rank: any world size loads it
        full_model = FullModelState(self.model) if self.fsdp.enabled else self.model
        self.checkpointer = Checkpointer(args=args, rank=self.rank, model=full_model, ddp=self.ddp,
                                         optimizer=FullOptimizerState(self.model, self.optimizer) if self.fsdp.enabled
                                         else self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                                         comm_hook=self.comm_hook, setup=setup, windows_per_epoch=per_epoch,
                                         max_steps=self.max_steps)
        self.reports = ProgressReporter(args=args, rank=self.rank, world_size=self.world_size,
                                        backend=self.env.backend, model=full_model, scheduler=self.scheduler,
                                        fp16=self.scaler is not None, samples_per_step=self.plan.samples_per_step,
                                        max_steps=self.max_steps, evaluate=self.evaluate,
                                        fsdp_units=self.ddp.unit_names if self.fsdp.enabled else None)
        self.lock = None  # rank 0's lock on output_dir while train() runs

    # --8<-- [start:window]
    def _window_step(self, micro_batches) -> torch.Tensor:
        """One optimizer step over one accumulation window; returns this rank's part of its loss."""
        n = len(micro_batches)
        num_items = self._num_items(micro_batches)
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # summed on the device: no host sync
        # ZeRO stages 2 and 3 sync every micro-batch, as DeepSpeed does (it refuses no_sync there): no_sync would keep
        # a full-size .grad between micro-batches, the memory they free; the shards accumulate instead. FSDP's no_sync
        # (fsdp=...) is set_requires_gradient_sync(False), as Accelerate does: fewer collectives, full gradients kept
        every = self.zero_stage >= 2
        for j, batch in enumerate(micro_batches):
            with nullcontext() if j == n - 1 or every else self.ddp.no_sync():  # DDP: sync the last one only
                with self.autocast():
                    loss, _ = compute_loss(self.forward, move_to(batch, self.device), self.compute_loss_func,
                                           num_items)
                # DDP divides the summed gradients by world_size. A loss divided by the window's item
                # count over all ranks is multiplied back: the gradient is the mean over every item.
                # A per-batch mean (a model without **kwargs): divide by the window's real length.
                loss = loss * self.world_size if num_items is not None else loss / n
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = self._clip(self.args.max_grad_norm)
        stop_if_not_finite(total, None if self.scaler else norm,  # fp16: the scaler skips inf gradients
                           step=self.state.global_step + 1, output_dir=self.args.output_dir,
                           learning_rate=self.args.learning_rate)
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.state.skipped_steps += self.scaler.get_scale() < scale  # it skipped the step and backed off
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _clip(self, max_norm: float) -> torch.Tensor:
        """After the sync, every rank clips the same averaged gradient (0: not clipped); returns its total norm.
        Under ZeRO every ``.grad`` is None: the optimizer's shards hold the gradient (one all-reduce for the norm);
        under FSDP each rank's ``.grad`` is its shard's: torch's function would see one rank's part only."""
        if self.fsdp.enabled:
            return self.ddp.clip_grad_norm_(max_norm if max_norm > 0 else math.inf)  # inf: the norm alone
        if isinstance(self.optimizer, ZeroOptimizer):
            return self.optimizer.clip_grad_norm_(max_norm if max_norm > 0 else math.inf)  # inf: the norm alone
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return grad_norm(self.model.parameters())

    def _num_items(self, micro_batches):
        """num_items_in_batch for compute_loss_func or the model: the window's labels on all ranks (one all-reduce)."""
        if not counts_items(self.model, self.compute_loss_func):
            return None  # a per-batch mean (a model without **kwargs, or fn(outputs, labels)): divided by the window
        count = sum(count_items(b) for b in micro_batches).to(self.device)  # counted where the labels are
        with naming_stalled_ranks(f"item count of step {self.state.global_step + 1}"):
            dist.all_reduce(count)
        return count
    # --8<-- [end:window]

    def train(self, resume_from_checkpoint: str | None = None) -> dict:
        """Train for max_steps (or num_train_epochs), resuming first if asked (here or in args)."""
        where = resume_from_checkpoint or self.args.resume_from_checkpoint
        self.lock = self.reports.claim_output_dir(where)
        try:
            resumed = self.checkpointer.resume(where, self.pending_loss) if where else None
            if resumed is not None:  # the saved state, whole; None: 'latest' found no checkpoint
                self.state = resumed
            self._loop()
            return self.reports.finish(self.state)
        finally:
            self.reports.close()
            if self.lock is not None:
                self.lock.release()
                self.lock = None

    def evaluate(self) -> dict:
        """``eval_loss`` and ``compute_metrics``' results (prefixed ``eval_``) over all of eval_dataset."""
        return evaluate(self.model, self.eval_dataset, device=self.device,
                        batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator,
                        compute_loss_func=self.compute_loss_func, compute_metrics=self.compute_metrics,
                        lockstep=self.fsdp.enabled)  # FSDP: every forward is a collective, as many on every rank

    def _loop(self) -> None:
        state = self.state
        progress = self.reports.progress_bar(state)
        while state.global_step < self.max_steps:
            self.sampler.set_epoch(state.epoch)  # a new shuffle each epoch, the same on every rank
            self.loader.generator.manual_seed(hash((self.args.seed, self.rank, state.epoch)))  # workers' base seed
            batches = epoch_batches(self.loader, skip=sum(self.windows[: state.window]))  # resume: skip
            for length in self.windows[state.window:]:
                self.pending_loss += self._window_step([next(batches) for _ in range(length)])
                state.window += 1
                state.global_step += 1
                self._after_step(progress)
                if state.global_step >= self.max_steps:
                    break
            else:
                state.epoch += 1
                state.window = 0
        if progress is not None:
            progress.close()

    def _after_step(self, progress) -> None:
        step = self.state.global_step
        if step % self.args.logging_steps == 0 or step == self.max_steps:
            self.reports.log(self.state, self.pending_loss, progress)
        if progress is not None:
            progress.update(1)
        if self.args.save_steps and step % self.args.save_steps == 0:
            self.checkpointer.save(self.state, self.pending_loss)
