"""Built-in tasks for the trainer: generated from a seed, nothing downloaded.

What
    ``make_task(config)`` returns the ``Trainer``'s keyword arguments (``model``,
    ``train_dataset``, ``eval_dataset``, ``data_collator``, ``compute_loss_func``,
    ``compute_metrics``) for one task, through the Trainer's public API like any user's:
    ``mlp`` (4 Gaussian classes in 32 dimensions), ``bn`` (the same with ``BatchNorm1d``: its
    buffers make ``ddp_broadcast_buffers`` matter and split equivalence fail) and ``lm`` (a tiny
    causal LM on variable-length sequences, padding labelled -100: where averaging micro-batch
    means is not the mean over tokens). ``loss_normalization`` picks the loss: ``per_batch``
    (dict batches, the model's own mean loss) or ``global_tokens`` (tuple batches, summed and
    divided by ``num_items_in_batch``).

Why
    Tests, notebooks and the README's command run with no network, and each task still shows
    the phenomenon it is there for.

How Hugging Face differs
    Its examples download a dataset and a pretrained model. The built-in models follow its
    conventions instead: ``{"logits", "loss"}`` outputs, a loss when ``labels`` are given, -100
    for labels that do not count, and ``gradient_checkpointing_enable()``.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset, default_collate

from .batches import IGNORE_INDEX

VOCAB, MAX_LEN, PAD = 16, 32, 0  # lm task: vocabulary, longest sequence, padding id


def _clusters(size: int, seed: int, dim: int = 32, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234)) * 0.5  # overlap a little
    labels = torch.randint(0, classes, (size,), generator=g)
    x = centres[labels] + torch.randn(size, dim, generator=g)
    return TensorDataset(x, labels)


def _mean_loss(logits, labels):
    """Cross-entropy averaged over this batch's labels (not -100): what a model's own loss is."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)


class Classifier(nn.Module):
    """MLP with optional BatchNorm and dropout; ``{"logits", "loss"}`` like a Hugging Face model."""

    def __init__(self, batchnorm=False, dropout=0.0, dim=32, hidden=64, classes=4):
        super().__init__()
        norm = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        self.body = nn.Sequential(nn.Linear(dim, hidden), norm, nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)
        self.checkpointing = None  # checkpoint()'s keywords: recompute self.body in backward

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.checkpointing = checkpoint_keywords(gradient_checkpointing_kwargs)

    def forward(self, features, labels=None):
        h = checkpointed(self.body, features, self.checkpointing) if self.checkpointing and self.training \
            else self.body(features)
        logits = self.head(h)
        return {"logits": logits} if labels is None else {"logits": logits, "loss": _mean_loss(logits, labels)}


def checkpoint_keywords(given) -> dict:
    """``torch.utils.checkpoint``'s keywords: non-reentrant unless asked (Transformers 5's default too)."""
    return {"use_reentrant": False, **(given or {})}


def checkpointed(body, h, keywords: dict):
    """``body(h)``, recomputed in backward. Reentrant checkpointing only differentiates through inputs that
    require grad, so data going in is made to (Transformers: ``enable_input_require_grads``)."""
    if keywords["use_reentrant"] and not h.requires_grad:
        h = h.detach().requires_grad_()
    return checkpoint(body, h, **keywords)


def _sequences(size: int, seed: int):
    """(input_ids, labels): each sequence counts up by a random stride mod VOCAB-1 (ids 1..15), random
    length 4..32; labels are the next tokens, -100 past the end."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, MAX_LEN + 1, (size,), generator=g)
    start = torch.randint(1, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    tokens = (start - 1 + stride * torch.arange(MAX_LEN)) % (VOCAB - 1) + 1
    mask = torch.arange(MAX_LEN) < lengths[:, None]
    tokens = torch.where(mask, tokens, PAD)
    return TensorDataset(tokens[:, :-1], torch.where(mask[:, 1:], tokens[:, 1:], IGNORE_INDEX))


class TinyLM(nn.Module):
    """Embedding + positions -> mix each token with the previous one (causal) -> logits."""

    def __init__(self, dim=32, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(MAX_LEN, dim))
        self.mix = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dim, VOCAB)
        self.checkpointing = None  # checkpoint()'s keywords: recompute self._body in backward

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.checkpointing = checkpoint_keywords(gradient_checkpointing_kwargs)

    def _body(self, h):
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)  # the previous token: causal
        return torch.tanh(self.mix(torch.cat([h, prev], dim=-1)))

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        h = checkpointed(self._body, h, self.checkpointing) if self.checkpointing and self.training else self._body(h)
        logits = self.out(self.drop(h))
        return {"logits": logits} if labels is None else {"logits": logits, "loss": _mean_loss(logits, labels)}


# --8<-- [start:losses]
def sum_over_num_items(outputs, labels, num_items_in_batch):
    """compute_loss_func: the summed loss of this micro-batch's labels / the window's label count
    on all ranks. Summed over the window and averaged by DDP, that is the mean over every label."""
    logits = outputs["logits"].float()
    summed = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / num_items_in_batch


def accuracy(prediction) -> dict:
    """compute_metrics: the fraction of labels (not -100) whose logit is the largest."""
    counted = prediction.label_ids != IGNORE_INDEX
    correct = (prediction.predictions.argmax(-1) == prediction.label_ids) & counted
    return {"accuracy": correct.sum().item() / counted.sum().item()}
# --8<-- [end:losses]


def named_columns(*names):
    """A data_collator that batches tuples (torch's default) and names the columns: dict batches."""
    def collate(samples):
        return dict(zip(names, default_collate(samples)))
    return collate


# bytes one sample of each built-in task takes while it is generated (tensors and temporaries), measured
BYTES_PER_SAMPLE = {"mlp": 400, "bn": 400, "lm": 1200}


def _check_it_fits(config) -> None:
    """A dataset_size this machine cannot hold is one line now, not an allocator's error later."""
    need = (config.dataset_size + config.eval_size) * BYTES_PER_SAMPLE.get(config.model, 1200)
    need *= int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # every process on this machine builds its own copy
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return
    if need > have:  # name the larger of the two sets: --eval_size 1e12 is not a --dataset_size problem
        name = "dataset_size" if config.dataset_size >= config.eval_size else "eval_size"
        raise ValueError(f"{name}={getattr(config, name)}: the built-in {config.model} task needs about "
                         f"{need / 2**30:.1f} GiB on this machine (every process builds its own), and "
                         f"{have / 2**30:.1f} GiB are free: use a smaller --{name}")


def make_task(config) -> dict:
    """The Trainer's keyword arguments for ``config.model`` (``mlp``, ``bn`` or ``lm``)."""
    _check_it_fits(config)
    size, eval_size, seed = config.dataset_size, config.eval_size, config.seed
    torch.manual_seed(seed)  # model init: the same on every rank (DDP would broadcast it anyway)
    if config.model in ("mlp", "bn"):
        model = Classifier(batchnorm=config.model == "bn", dropout=config.dropout)
        data, columns = _clusters, ("features", "labels")
    elif config.model == "lm":
        model = TinyLM(dropout=config.dropout)
        data, columns = _sequences, ("input_ids", "labels")
    else:
        raise ValueError(f"model={config.model!r} must be one of mlp, bn, lm")
    task = {"model": model, "train_dataset": data(size, seed + 1),
            "eval_dataset": data(eval_size, seed + 2) if eval_size else None, "compute_metrics": accuracy}
    if config.loss_normalization == "global_tokens":
        return {**task, "compute_loss_func": sum_over_num_items}
    return {**task, "data_collator": named_columns(*columns)}
