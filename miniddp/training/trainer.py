"""The trainer: any model, data and loss, through every module of miniddp.

What
    ``Trainer(model=..., args=TrainingConfig(...), train_dataset=..., eval_dataset=None,
    data_collator=None, compute_loss_func=None, compute_metrics=None)`` takes
    ``transformers.Trainer``'s keywords. It joins the job (``init_distributed``:
    backend, device, ``ddp_timeout``), wraps the model
    (``miniddp.DistributedDataParallel`` with the ``ddp_*`` settings), seeds each
    rank's random stream with ``seed + rank``, shards the data (``ShardSampler``),
    and trains: accumulation windows with ``no_sync`` on every micro-batch but the
    last, clipping after the sync, one optimizer and LR-schedule step per window,
    autocast for bf16/fp16, evaluation, checkpoints and an exact resume
    (``resume.py``). ``train()`` owns ``output_dir`` while it runs (``output_dir.py``),
    stops every rank at the first non-finite loss or gradient norm
    (``NonFiniteLossError``, before the optimizer step), and returns the metrics it
    writes to ``output_dir/metrics.json`` (strict JSON). Batches become losses in
    ``batches.py``: the loop knows no task.

Why
    The pieces are only understood once they run together. This loop is also the
    oracle for the claim Hugging Face and TRL make: runs with the same effective
    batch (per_device_train_batch_size x world_size x gradient_accumulation_steps)
    train the same model, for any model whose loss is normalised right.

How Hugging Face differs
    ``transformers.Trainer`` (via Accelerate) does the same with far more options.
    It seeds every rank with the same ``seed``, so ranks draw the same dropout
    masks; Accelerate's ``set_seed(seed, device_specific=True)`` adds the process
    index, as we do. A model's own loss (a micro-batch mean) is divided by the
    window's *real* length, so a short last window is still an average (Hugging
    Face divides by ``gradient_accumulation_steps``). Tuple batches are ours.
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .batches import compute_loss, count_items, evaluate
from .checkpoint import (checkpoints, load_checkpoint_on_every_rank, load_states, on_every_rank, save_checkpoint,
                         set_aside_later_results)
from .config import TrainingConfig
from ..comm_hooks import hook_by_name
from ..engine.ddp import DistributedDataParallel, move_to
from ..process_group.env import init_distributed
from .epoch import plan_epoch
from .nonfinite import finite_or_null, grad_norm, stop_if_not_finite
from .output_dir import atomic_save, atomic_write_text, bytes_to_save, claim_output_dir
from .resume import (apply_new_schedule, check_position, compare_setups, epoch_batches, position_in_new_units,
                     seed_per_rank, set_rng_state, setup_of)
from ..by_hand.sharding import ShardSampler
from ..process_group.timeouts import naming_stalled_ranks


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
        if args.gradient_checkpointing:
            _enable_gradient_checkpointing(model, args.ddp_broadcast_buffers)
        self.model = model.to(self.device)  # the unwrapped model: what we save
        # --8<-- [start:wrap]
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[self.device] if self.device.type == "cuda" else None,
            bucket_cap_mb=args.ddp_bucket_cap_mb, broadcast_buffers=args.ddp_broadcast_buffers,
            find_unused_parameters=args.ddp_find_unused_parameters)
        self.comm_hook = hook_by_name(args.ddp_comm_hook, None, args.ddp_comm_powersgd_rank,
                                      args.ddp_comm_powersgd_start_iter)  # (state, hook), or None: plain all-reduce
        if self.comm_hook is not None:
            self.ddp.register_comm_hook(*self.comm_hook)
        seed_per_rank(args.seed, self.rank)  # after the wrap: rank 0's initial weights are everyone's
        self.sampler = ShardSampler(train_dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True,
                                    seed=args.seed)
        self.loader = DataLoader(train_dataset, batch_size=args.per_device_train_batch_size, sampler=self.sampler,
                                 collate_fn=data_collator, pin_memory=self.device.type == "cuda",
                                 drop_last=args.dataloader_drop_last,
                                 generator=torch.Generator())  # its own: iter() must not draw from torch's RNG
        # --8<-- [end:wrap]
        self.plan = plan_epoch(len(self.sampler), args.per_device_train_batch_size, args.gradient_accumulation_steps,
                               self.world_size, drop_last=args.dataloader_drop_last, model=self.model)  # or raise
        if self.plan.notice and self.rank == 0:
            print(f"miniddp: {self.plan.notice}", file=sys.stderr, flush=True)
        self.windows = self.plan.windows
        per_epoch = len(self.windows)  # optimizer steps per epoch
        self.max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.learning_rate,
                                           weight_decay=args.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: max(0.0, 1 - s / self.max_steps))
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=amp)) if amp else nullcontext
        self.scaler = torch.amp.GradScaler(self.device.type) if args.mixed_precision == "fp16" else None
        # where we are, saved in checkpoints; loss_sum: the loss of every step so far, averaged over ranks
        self.state = {"global_step": 0, "epoch": 0, "window": 0, "loss_sum": 0.0, "logged_step": 0,
                      "logged_loss": 0.0, "skipped_steps": 0}  # skipped: fp16 steps the GradScaler skipped
        self.pending_loss = torch.zeros((), dtype=torch.float64, device=self.device)  # this rank's, not yet in state
        self.log_history: list[dict] = []
        self.setup = setup_of(args, self.world_size, len(train_dataset), self.model)  # a resume must match it
        self.lock = None  # rank 0's lock on output_dir while train() runs

    # --8<-- [start:window]
    def _window_step(self, micro_batches) -> torch.Tensor:
        """One optimizer step over one accumulation window; returns this rank's part of its loss."""
        n = len(micro_batches)
        num_items = self._num_items(micro_batches)
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # summed on the device: no host sync
        for j, batch in enumerate(micro_batches):
            with nullcontext() if j == n - 1 else self.ddp.no_sync():  # sync only the last micro-batch
                with self.autocast():
                    loss, _ = compute_loss(self.ddp, move_to(batch, self.device), self.compute_loss_func,
                                           num_items)
                # DDP divides the summed gradients by world_size. A loss divided by the window's item
                # count over all ranks is multiplied back: the gradient is the mean over every item.
                # A model's own loss is a micro-batch mean: divide by the window's real length.
                loss = loss * self.world_size if num_items is not None else loss / n
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.args.max_grad_norm > 0:  # after the sync: every rank clips the same averaged gradient
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        else:
            norm = grad_norm(self.model.parameters())
        stop_if_not_finite(total, None if self.scaler else norm,  # fp16: the scaler skips inf gradients
                           step=self.state["global_step"] + 1, output_dir=self.args.output_dir,
                           learning_rate=self.args.learning_rate)
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.state["skipped_steps"] += self.scaler.get_scale() < scale  # it skipped the step and backed off
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _num_items(self, micro_batches):
        """compute_loss_func's num_items_in_batch: the window's labels on all ranks (one all-reduce)."""
        if self.compute_loss_func is None:
            return None
        count = sum(count_items(b) for b in micro_batches).to(self.device)  # counted where the labels are
        with naming_stalled_ranks(f"item count of step {self.state['global_step'] + 1}"):
            dist.all_reduce(count)
        return count
    # --8<-- [end:window]

    def train(self, resume_from_checkpoint: str | None = None) -> dict:
        """Train for max_steps (or num_train_epochs), resuming first if asked (here or in args)."""
        where = resume_from_checkpoint or self.args.resume_from_checkpoint
        self._claim_output_dir(where)
        try:
            if where:
                self._resume(where)
            self._loop()
            return self._finish()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None

    def _loop(self) -> None:
        progress = self._progress_bar()
        while self.state["global_step"] < self.max_steps:
            epoch = self.state["epoch"]
            self.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            self.loader.generator.manual_seed(hash((self.args.seed, self.rank, epoch)))  # workers' base seed
            batches = epoch_batches(self.loader, skip=sum(self.windows[: self.state["window"]]))  # resume: skip
            for length in self.windows[self.state["window"]:]:
                self.pending_loss += self._window_step([next(batches) for _ in range(length)])
                self.state["window"] += 1
                self.state["global_step"] += 1
                self._after_step(progress)
                if self.state["global_step"] >= self.max_steps:
                    break
            else:
                self.state["epoch"] += 1
                self.state["window"] = 0
        if progress is not None:
            progress.close()

    def _claim_output_dir(self, where) -> None:
        """Rank 0 locks output_dir and checks it (see output_dir.py); its error is every rank's."""
        out = Path(self.args.output_dir).resolve()
        resuming = where == "latest" or (where is not None and out in Path(where).resolve().parents)
        need = bytes_to_save(self.model, optimizer_copies=2, checkpoints=self.args.save_steps > 0)

        def claim():
            return claim_output_dir(out, resuming=resuming, overwrite=self.args.overwrite_output_dir, need_bytes=need)
        self.lock = on_every_rank(claim if self.rank == 0 else None, "claiming output_dir")

    def _after_step(self, progress) -> None:
        step, args = self.state["global_step"], self.args
        if step % args.logging_steps == 0 or step == self.max_steps:
            self._flush_loss()
            state = self.state
            loss = (state["loss_sum"] - state["logged_loss"]) / (step - state["logged_step"])  # mean since last log
            state.update(logged_step=step, logged_loss=state["loss_sum"])
            self.log_history.append({"step": step, "loss": loss, "lr": self.scheduler.get_last_lr()[0]})
            if progress is not None:
                progress.set_postfix(loss=f"{loss:.4f}")
        if progress is not None:
            progress.update(1)
        if args.save_steps and step % args.save_steps == 0:
            self.save(step)

    def _flush_loss(self) -> None:
        """Move the pending window losses, averaged over ranks, into state (one all-reduce, one host sync)."""
        with naming_stalled_ranks(f"loss all-reduce after step {self.state['global_step']}"):
            dist.all_reduce(self.pending_loss)
        self.state["loss_sum"] += self.pending_loss.item() / self.world_size
        self.pending_loss.zero_()

    def save(self, step: int) -> Path:
        trainer_state = {**self.state, "log_history": list(self.log_history), "setup": self.setup,
                         "layout": self.ddp.layout_state()}  # the bucket layout: sums in the same order
        states = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                  "scheduler": self.scheduler.state_dict(), "trainer_state": trainer_state}
        if self.scaler:
            states["scaler"] = self.scaler.state_dict()
        # each rank's unreported loss travels in its own file: no all-reduce here, so a save does not
        # change how the losses are summed, and train_loss is the same with or without interruptions
        return save_checkpoint(self.args.output_dir, step, states, self.rank, self.args.save_total_limit,
                               rank_state={"pending_loss": self.pending_loss.cpu(), "comm_hook": self._hook_state()})

    def _hook_state(self):
        """PowerSGD's memories differ per rank: they go to ``rank_<r>.pt``. Other hooks keep nothing."""
        state = self.comm_hook[0] if self.comm_hook else None
        return state.state_dict() if hasattr(state, "state_dict") else None

    def _resume(self, where) -> None:
        path = where
        if where == "latest":
            found = checkpoints(self.args.output_dir)
            if not found:
                if self.rank == 0:
                    print(f"resume_from_checkpoint='latest': {self.args.output_dir} has no complete checkpoint; "
                          "starting from scratch", file=sys.stderr, flush=True)
                return
            path = found[-1]
        state = load_checkpoint_on_every_rank(path, self.rank, latest=where == "latest")
        trainer_state = dict(state["trainer_state"])
        saved_setup = trainer_state.pop("setup")
        notice = compare_setups(saved_setup, self.setup, self.args.resume_allow_changes, path)  # or raise
        check_position(trainer_state["global_step"], self.max_steps, path)
        load_states(path, (self.model, state["model"]), (self.optimizer, state["optimizer"]),
                    (self.scheduler, state["scheduler"]))
        aside = on_every_rank((lambda: set_aside_later_results(self.args.output_dir, path)) if self.rank == 0
                              else None, "setting aside the results after the resumed checkpoint")
        if aside is not None:  # resumed an earlier checkpoint: what came after it is another timeline
            print(f"miniddp: resuming {path}: the checkpoints and results saved after it are another timeline; "
                  f"moved to {aside} (nothing was deleted)", file=sys.stderr, flush=True)
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.log_history = trainer_state.pop("log_history")
        self.ddp.load_layout_state(trainer_state.pop("layout"))
        self.state.update(trainer_state)
        if "rank_state" in state:  # absent for a rank beyond the saved world size (resume_allow_changes)
            set_rng_state(state["rank_state"]["rng"])
            self.pending_loss.copy_(state["rank_state"]["pending_loss"])
            hook_state = state["rank_state"].get("comm_hook")
            target = self.comm_hook[0] if self.comm_hook else None  # the hook's state, if it has one to load
            if hook_state is not None and hasattr(target, "load_state_dict"):
                target.load_state_dict(hook_state)
        if notice:
            if self.rank == 0:
                print(f"miniddp: {notice}", file=sys.stderr, flush=True)
            apply_new_schedule(self.optimizer, self.scheduler, self.args.learning_rate, self.args.weight_decay)
            self.state["window"] = position_in_new_units(saved_setup, self.setup, self.state["window"])
            if self.state["window"] >= len(self.windows):
                self.state.update(epoch=self.state["epoch"] + 1, window=0)

    def _progress_bar(self):
        if self.rank != 0 or self.args.disable_tqdm:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.max_steps, initial=self.state["global_step"], desc="train", unit="step")

    def evaluate(self) -> dict:
        """``eval_loss`` and ``compute_metrics``' results (prefixed ``eval_``) over all of eval_dataset."""
        return evaluate(self.model, self.eval_dataset, device=self.device,
                        batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator,
                        compute_loss_func=self.compute_loss_func, compute_metrics=self.compute_metrics)

    def _finish(self) -> dict:
        args = self.args
        metrics = {"world_size": self.world_size, "backend": self.env.backend,
                   "effective_batch_size": self.plan.samples_per_step,  # what a step trained on
                   "global_step": self.state["global_step"],
                   "train_loss": self.state["loss_sum"] / max(1, self.state["global_step"]),
                   **({"fp16_skipped_steps": self.state["skipped_steps"]} if self.scaler else {}),
                   **self.evaluate(), "log_history": self.log_history}

        def write():  # each atomically: a crash or a full disk leaves the previous version whole
            out = Path(args.output_dir)
            atomic_save(self.model.state_dict(), out / "final_model.pt")
            strict = json.dumps(finite_or_null({**metrics, "config": args.to_dict()}), indent=2, allow_nan=False)
            atomic_write_text(out / "metrics.json", strict + "\n")
        on_every_rank(write if self.rank == 0 else None, "writing final_model.pt and metrics.json")
        return metrics


def _enable_gradient_checkpointing(model, broadcast_buffers: bool) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"gradient_checkpointing=True but {type(model).__name__} has no "
                         "gradient_checkpointing_enable() method (Hugging Face models have one): add it, or "
                         "checkpoint inside your forward with torch.utils.checkpoint")
    if broadcast_buffers and any(True for _ in model.buffers()):
        raise ValueError("ddp_broadcast_buffers=True with gradient_checkpointing on a model with buffers: "
                         "set ddp_broadcast_buffers=False")
    enable()
