"""Batches and losses: any model, data and loss, with Hugging Face's conventions.

What
    How the trainer turns one batch into a loss without knowing the task:

    * a **dict** batch calls ``model(**batch)`` and takes ``outputs["loss"]`` or
      ``outputs.loss`` (Hugging Face models compute it when ``labels`` are in the
      batch). A model whose ``forward`` takes ``**kwargs`` (every Transformers model), or
      that sets ``accepts_loss_kwargs = True``, also gets ``num_items_in_batch=N`` and
      divides its summed loss by it, as ``transformers.Trainer`` arranges. With a
      ``compute_loss_func``, ``labels`` are taken out first and the loss is
      ``compute_loss_func(outputs, labels, num_items_in_batch=N)``;
    * a **tuple or list** batch ``(inputs..., labels)`` calls ``model(*inputs)``
      and ``compute_loss_func(outputs, labels, num_items_in_batch=N)``. A two-parameter
      ``compute_loss_func(outputs, labels)`` is called without ``N``; its loss is taken as a
      per-batch mean, like a model's own (Transformers raises a ``TypeError`` instead).

    ``N`` (:func:`count_items`) is the number of labels not equal to -100 in the
    whole accumulation window on all ranks: a loss that sums over its items and
    divides by ``N`` is the mean over every item of the optimizer step, however
    the window is split into micro-batches and ranks. :func:`evaluate` computes the same loss over a held-out
    set on all ranks, and hands the logits and labels of every sample to
    ``compute_metrics`` as an :class:`EvalPrediction`.

Why
    A training loop that knows its tasks grows an ``if kind == ...`` per task.
    ``transformers.Trainer`` instead asks the model for its loss, or a user
    function; a new task then needs no change to the loop.

How Hugging Face differs
    ``Trainer.compute_loss`` does the same for dict batches (it requires dicts;
    tuple batches are ours, for plain PyTorch datasets). Its ``num_items_in_batch``
    is summed across ranks when ``average_tokens_across_devices`` is on, as here
    always. ``EvalPrediction`` holds numpy arrays there too; predictions are
    concatenated along the first dimension here (Hugging Face pads them).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from ..engine.ddp import move_to

IGNORE_INDEX = -100  # labels equal to this are not counted (Hugging Face's and cross_entropy's default)


class EvalPrediction(NamedTuple):
    """What ``compute_metrics`` receives: every evaluation sample, in dataset order, as numpy arrays."""

    predictions: object  # the model's logits
    label_ids: object  # the labels


def labels_of(batch):
    """The labels of a batch: ``batch["labels"]`` or the last element of a tuple (None if absent)."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    return batch[-1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None


def count_items(batch) -> torch.Tensor:
    """Labels that count in a loss (not -100), or the number of samples when there are no labels."""
    labels = labels_of(batch)
    if isinstance(labels, torch.Tensor):
        return (labels != IGNORE_INDEX).sum()
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return torch.tensor(len(first), device=first.device)


def accepts_loss_kwargs(model) -> bool:
    """Transformers' rule: ``model.accepts_loss_kwargs`` if set, else whether ``forward`` takes ``**kwargs``."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def counts_items(model, compute_loss_func) -> bool:
    """Is the loss divided by ``num_items_in_batch`` (so the Trainer must count the window's items)?"""
    return takes_num_items(compute_loss_func) if compute_loss_func is not None else accepts_loss_kwargs(model)


def takes_num_items(compute_loss_func) -> bool:
    """Whether ``compute_loss_func`` takes ``num_items_in_batch`` (Hugging Face's form). A two-parameter
    ``fn(outputs, labels)`` does not: its loss is a per-batch mean, like a model's own."""
    try:
        signature = inspect.signature(compute_loss_func)
    except (TypeError, ValueError):  # no signature to read (a builtin): Hugging Face's form
        return True
    try:
        signature.bind(None, None, num_items_in_batch=None)
        return True
    except TypeError:
        pass
    try:
        signature.bind(None, None)
        return False
    except TypeError:
        return True  # neither form binds: the call will raise the TypeError that says so


def _call_loss(compute_loss_func, outputs, labels, num_items_in_batch):
    if takes_num_items(compute_loss_func):
        return compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    return compute_loss_func(outputs, labels)


# --8<-- [start:compute_loss]
def compute_loss(model, batch, compute_loss_func=None, num_items_in_batch=None):
    """``(loss, outputs)`` of one batch: the model's own loss, or ``compute_loss_func``'s. ``num_items_in_batch``
    is passed only when it is not None (a model's own loss: when the caller found ``counts_items``)."""
    if isinstance(batch, Mapping):
        if compute_loss_func is None:
            extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            outputs = model(**batch, **extra)
            return scalar_loss(_loss_in(outputs, batch), "the model"), outputs
        if "labels" not in batch:
            raise ValueError(f"compute_loss_func needs labels, but the dict batch has no 'labels' key "
                             f"(keys: {', '.join(batch)})")
        outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
        loss = _call_loss(compute_loss_func, outputs, batch["labels"], num_items_in_batch)
        return scalar_loss(loss, "compute_loss_func"), outputs
    if not isinstance(batch, (list, tuple)):
        raise TypeError(f"a batch must be a dict (model(**batch)) or a tuple (inputs..., labels), got "
                        f"{type(batch).__name__}: pass data_collator= to build one")
    if compute_loss_func is None:
        raise ValueError(f"the batch is a {type(batch).__name__} (inputs..., labels): pass compute_loss_func=fn("
                         "outputs, labels, num_items_in_batch) to the Trainer, or give the model dict batches "
                         "with 'labels' and return a loss from it (as Hugging Face models do)")
    if len(batch) < 2:
        raise ValueError(f"a {type(batch).__name__} batch is (inputs..., labels), but it has one element")
    outputs = model(*batch[:-1])
    loss = _call_loss(compute_loss_func, outputs, batch[-1], num_items_in_batch)
    return scalar_loss(loss, "compute_loss_func"), outputs
# --8<-- [end:compute_loss]


def _loss_in(outputs, batch):
    """``outputs["loss"]``, ``outputs.loss``, or ``outputs[0]`` of a tuple (``return_dict=False``), as
    Hugging Face's Trainer reads it."""
    if isinstance(outputs, Mapping):
        loss, where = outputs.get("loss"), "outputs['loss']"
    elif isinstance(outputs, (tuple, list)) and not hasattr(outputs, "loss"):  # (loss, logits, ...), if first
        first = outputs[0] if outputs else None
        loss, where = (first if isinstance(first, torch.Tensor) and first.numel() == 1 else None), "outputs[0]"
    else:
        loss, where = getattr(outputs, "loss", None), "outputs.loss"
    if loss is not None and not isinstance(loss, torch.Tensor):
        raise ValueError(f"the model's loss ({where}) is a {type(loss).__name__} ({loss!r}), not a tensor: "
                         "return the loss tensor the model computed, so that backward can reach the parameters")
    if not isinstance(loss, torch.Tensor):
        hint = "" if "labels" in batch else " (the batch has no 'labels' key: Hugging Face models need it)"
        raise ValueError(f"the model returned {type(outputs).__name__} without a 'loss' for a dict batch{hint}: "
                         "return {'loss': ...} from the model, or pass compute_loss_func=fn(outputs, labels, "
                         "num_items_in_batch) to the Trainer")
    return loss


def scalar_loss(loss, where: str):
    """The loss, if it is one number; else a ValueError naming its shape and the fix."""
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"{where} returned a {type(loss).__name__} ({loss!r}), not a loss tensor")
    if loss.numel() != 1:
        raise ValueError(f"{where} returned a loss of shape {list(loss.shape)}, not one number: reduce it "
                         "(loss.mean(), or a sum divided by num_items_in_batch) so that backward has a scalar")
    return loss.reshape(())


def predictions_of(outputs) -> torch.Tensor:
    """The logits: the output itself if it is a tensor, else its ``logits`` (key or attribute)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, (tuple, list)) and not hasattr(outputs, "logits") and len(outputs) > 1:
        return outputs[1]  # Hugging Face's (loss, logits, ...) tuples
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"compute_metrics needs predictions, but the model returned {type(outputs).__name__} "
                         "without 'logits': return a tensor, or a dict or object with 'logits'")
    return logits


def numpy_of(t: torch.Tensor):
    """A CPU numpy copy (bfloat16 and float16 widened to float32: numpy has no bfloat16)."""
    t = t.detach()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).cpu().numpy()


# --8<-- [start:evaluate]
@torch.no_grad()
def evaluate(model, dataset, *, device, batch_size, collate_fn=None, compute_loss_func=None,
             compute_metrics=None, lockstep: bool = False) -> dict:
    """``eval_loss`` over ``dataset`` on all ranks (each takes every world_size-th sample, no padding),
    plus ``compute_metrics``' results prefixed ``eval_``. Every rank gets the same numbers; {} without data.
    ``lockstep`` (FSDP: each forward gathers from every rank): a rank with fewer batches than rank 0 runs as many
    more forwards on one sample, their results unused."""
    if dataset is None or len(dataset) == 0:
        return {}
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model.eval()
    mine = Subset(dataset, range(rank, len(dataset), world_size))
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # sum of loss x items, items
    kept = []  # (logits, labels) of each batch, for compute_metrics
    for batch in DataLoader(mine, batch_size=batch_size, collate_fn=collate_fn):
        batch = move_to(batch, device)
        items = count_items(batch)
        loss, outputs = compute_loss(model, batch, compute_loss_func,
                                     num_items_in_batch=items if counts_items(model, compute_loss_func) else None)
        totals += torch.stack([loss.double() * items, items.double()])  # a mean over items, back to a sum
        if compute_metrics is not None:
            if labels_of(batch) is None:
                raise ValueError("compute_metrics needs labels: a 'labels' key, or tuples (inputs..., labels)")
            kept.append((predictions_of(outputs), labels_of(batch)))
    if lockstep:
        spare = next(iter(DataLoader(Subset(dataset, [0]), batch_size=1, collate_fn=collate_fn)))
        for _ in range(_batches(len(range(0, len(dataset), world_size)), batch_size) - _batches(len(mine), batch_size)):
            compute_loss(model, move_to(spare, device), compute_loss_func,  # a forward only: not counted
                         count_items(spare) if counts_items(model, compute_loss_func) else None)
    dist.all_reduce(totals)  # every sample counted exactly once
    model.train()
    metrics = {"eval_loss": (totals[0] / totals[1]).item()}
    if compute_metrics is not None:
        predictions, labels = _gather_in_order(kept, world_size)
        for name, value in compute_metrics(EvalPrediction(numpy_of(predictions), numpy_of(labels))).items():
            metrics[name if name.startswith("eval_") else f"eval_{name}"] = value
    return metrics
# --8<-- [end:evaluate]


def _batches(samples: int, batch_size: int) -> int:
    return -(-samples // batch_size)


def _gather_in_order(kept, world_size: int):
    """Every rank's (logits, labels), in dataset order: rank r held samples r, r + W, r + 2W, ..."""
    mine = tuple(torch.cat(parts).cpu() for parts in zip(*kept)) if kept else None
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    parts = [p for p in everyone if p is not None]  # ranks past the end of a tiny dataset hold none
    return tuple(_interleave([p[i] for p in parts]) for i in (0, 1))


def _interleave(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0].new_empty((sum(len(p) for p in parts), *parts[0].shape[1:]))
    for r, p in enumerate(parts):
        out[r::len(parts)] = p
    return out
