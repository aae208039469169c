"""The trainer: every module of miniddp in one training loop.

What
    ``Trainer(model, train_dataset, config, eval_dataset=None, kind=...)`` joins
    the job (``init_distributed``: backend, device, ``ddp_timeout``), shards the
    data (``ShardSampler`` + ``set_epoch``), wraps the model
    (``miniddp.DistributedDataParallel`` with the ``ddp_*`` settings), and
    trains: accumulation windows with ``no_sync`` on every micro-batch but the
    last, clipping after the sync, one optimizer and LR-schedule step per
    window, autocast for bf16/fp16, the loss averaged over ranks for the log, a
    progress bar on rank 0, evaluation on a held-out split, checkpoints and an
    exact resume. ``train()`` returns the metrics it writes to
    ``output_dir/metrics.json``.

Why
    The pieces are only understood once they run together. This loop is also the
    oracle for the claim Hugging Face and TRL make: runs with the same effective
    batch (per_device_train_batch_size x world_size x gradient_accumulation_steps)
    train the same model.

How Hugging Face differs
    ``transformers.Trainer`` (via Accelerate) does the same things with far more
    options. One detail differs on purpose: each micro-batch's loss is divided
    by its window's *real* length, so a short last window of an epoch is still
    an average; and ``loss_normalization="global_tokens"`` implements the fix for
    the 2024 gradient-accumulation bug (normalise by the window's token count
    over all ranks, not by per-micro-batch means).
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from .checkpoint import checkpoints, load_checkpoint, save_checkpoint, set_rng_state
from .config import TrainingConfig
from .ddp import DistributedDataParallel
from .env import init_distributed
from .no_sync import accumulation_windows
from .sharding import ShardSampler
from .tasks import lm_token_losses


class Trainer:
    def __init__(self, model, train_dataset, config: TrainingConfig, eval_dataset=None, kind="classification"):
        self.config = config
        self.kind = kind  # "classification" (x, label) or "lm" (tokens, mask)
        self.env = init_distributed(config.ddp_backend, config.ddp_timeout)
        self.device, self.rank, self.world_size = self.env.device, self.env.rank, self.env.world_size
        if config.gradient_checkpointing and config.ddp_broadcast_buffers and any(True for _ in model.buffers()):
            raise ValueError("ddp_broadcast_buffers=True with gradient_checkpointing on a model with buffers: "
                             "set ddp_broadcast_buffers=False")
        self.model = model.to(self.device)  # the unwrapped model: what we save
        # --8<-- [start:wrap]
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[self.device] if self.device.type == "cuda" else None,
            bucket_cap_mb=config.ddp_bucket_cap_mb, broadcast_buffers=config.ddp_broadcast_buffers,
            find_unused_parameters=config.ddp_find_unused_parameters)
        self.sampler = ShardSampler(train_dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True,
                                    seed=config.seed)
        self.loader = DataLoader(train_dataset, batch_size=config.per_device_train_batch_size, sampler=self.sampler)
        # --8<-- [end:wrap]
        self.eval_dataset = eval_dataset
        self.windows = accumulation_windows(len(self.loader), config.gradient_accumulation_steps)
        per_epoch = len(self.windows)  # optimizer steps per epoch
        self.max_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * per_epoch)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: max(0.0, 1 - s / self.max_steps))
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision)
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=amp)) if amp else nullcontext
        self.scaler = torch.amp.GradScaler(self.device.type) if config.mixed_precision == "fp16" else None
        self.state = {"global_step": 0, "epoch": 0, "window": 0, "loss_sum": 0.0}  # where we are; saved
        self.log_history: list[dict] = []

    # --8<-- [start:window]
    def _window_step(self, micro_batches) -> float:
        """One optimizer step over one accumulation window; returns this rank's loss."""
        n = len(micro_batches)
        global_tokens = None
        if self.kind == "lm" and self.config.loss_normalization == "global_tokens":
            count = sum(mask[:, 1:].sum() for _, mask in micro_batches).to(self.device, torch.float64)
            dist.all_reduce(count)  # tokens in this window on every rank: the one true denominator
            global_tokens = count.item()
        total = 0.0
        for j, batch in enumerate(micro_batches):
            batch = [t.to(self.device) for t in batch]
            with nullcontext() if j == n - 1 else self.ddp.no_sync():  # sync only the last micro-batch
                with self.autocast():
                    loss, logged = self._loss(batch, n, global_tokens)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += logged
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.config.max_grad_norm > 0:  # after the sync: every rank clips the same averaged gradient
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _loss(self, batch, n, global_tokens):
        """(what to backward, what to log). DDP will divide the gradient by world_size."""
        if self.kind == "classification":
            x, y = batch
            loss = F.cross_entropy(self.ddp(x).float(), y)
            return loss / n, loss.item() / n  # mean over the window's real length
        losses, mask = lm_token_losses(self.ddp, batch)
        token_sum = (losses.float() * mask).sum()
        if global_tokens is None:  # per_batch: mean of this micro-batch's tokens (biased when lengths vary)
            loss = token_sum / mask.sum()
            return loss / n, loss.item() / n
        scaled = token_sum * self.world_size / global_tokens  # x world_size undoes DDP's averaging
        return scaled, scaled.item()
    # --8<-- [end:window]

    def train(self) -> dict:
        cfg = self.config
        if cfg.resume_from_checkpoint:
            self._resume(cfg.resume_from_checkpoint)
        progress = self._progress_bar()
        while self.state["global_step"] < self.max_steps:
            self.sampler.set_epoch(self.state["epoch"])  # a new shuffle each epoch, the same on every rank
            batches = iter(self.loader)
            for length in self.windows[: self.state["window"]]:  # resume: skip windows already trained
                for _ in range(length):
                    next(batches)
            for length in self.windows[self.state["window"]:]:
                loss = self._window_step([next(batches) for _ in range(length)])
                self.state["window"] += 1
                self.state["global_step"] += 1
                self.state["loss_sum"] += loss
                self._after_step(loss, progress)
                if self.state["global_step"] >= self.max_steps:
                    break
            else:
                self.state["epoch"] += 1
                self.state["window"] = 0
        if progress is not None:
            progress.close()
        return self._finish()

    def _after_step(self, loss, progress) -> None:
        step, cfg = self.state["global_step"], self.config
        if step % cfg.logging_steps == 0 or step == self.max_steps:
            mean = torch.tensor([loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(mean)  # every rank's loss, averaged: the number to print
            entry = {"step": step, "loss": mean.item() / self.world_size, "lr": self.scheduler.get_last_lr()[0]}
            self.log_history.append(entry)
            if progress is not None:
                progress.set_postfix(loss=f"{entry['loss']:.4f}")
        if progress is not None:
            progress.update(1)
        if cfg.save_steps and step % cfg.save_steps == 0:
            self.save(step)

    def save(self, step: int) -> Path:
        states = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                  "scheduler": self.scheduler.state_dict(), "trainer_state": dict(self.state)}
        if self.scaler:
            states["scaler"] = self.scaler.state_dict()
        return save_checkpoint(self.config.output_dir, step, states, self.rank, self.config.save_total_limit)

    def _resume(self, where) -> None:
        path = Path(where)
        if where == "latest":
            found = checkpoints(self.config.output_dir)
            if not found:
                raise FileNotFoundError(f"resume_from_checkpoint='latest' but {self.config.output_dir} has no "
                                        "complete checkpoint-<step> directory")
            path = found[-1]
        state = load_checkpoint(path, self.rank)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.state.update(state["trainer_state"])
        if "rng_state" in state:
            set_rng_state(state["rng_state"])

    def _progress_bar(self):
        if self.rank != 0 or self.config.disable_tqdm:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.max_steps, initial=self.state["global_step"], desc="train", unit="step")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out metrics over all ranks; each rank takes every world_size-th sample (no padding)."""
        if not self.eval_dataset:
            return {}
        self.model.eval()
        mine = Subset(self.eval_dataset, range(self.rank, len(self.eval_dataset), self.world_size))
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, count
        for batch in DataLoader(mine, batch_size=256):
            batch = [t.to(self.device) for t in batch]
            if self.kind == "classification":
                logits = self.model(batch[0]).float()
                sums += torch.stack([F.cross_entropy(logits, batch[1], reduction="sum"),
                                     (logits.argmax(-1) == batch[1]).sum(), torch.tensor(len(batch[1]))]).to(sums)
            else:
                losses, mask = lm_token_losses(self.model, batch)
                logits_correct = (self.model(batch[0][:, :-1]).argmax(-1) == batch[0][:, 1:]).float() * mask
                sums += torch.stack([(losses * mask).sum(), logits_correct.sum(), mask.sum()]).to(sums)
        dist.all_reduce(sums)  # totals over ranks, so every sample counts exactly once
        self.model.train()
        return {"eval_loss": (sums[0] / sums[2]).item(), "eval_accuracy": (sums[1] / sums[2]).item()}

    def _finish(self) -> dict:
        cfg = self.config
        loss = torch.tensor([self.state["loss_sum"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss)
        metrics = {"world_size": self.world_size, "backend": self.env.backend,
                   "effective_batch_size": cfg.effective_batch_size(self.world_size),
                   "global_step": self.state["global_step"],
                   "train_loss": loss.item() / self.world_size / max(1, self.state["global_step"]),
                   **self.evaluate(), "log_history": self.log_history}
        if self.rank == 0:
            out = Path(cfg.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(self.model.state_dict(), out / "final_model.pt")
            (out / "metrics.json").write_text(json.dumps({**metrics, "config": cfg.to_dict()}, indent=2) + "\n")
        dist.barrier()
        return metrics
