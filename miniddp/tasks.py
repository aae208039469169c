"""Built-in tasks for the trainer: generated from a seed, nothing downloaded.

What
    ``make_task(name, size, eval_size, seed)`` returns ``(model, train_dataset,
    eval_dataset, kind)`` for one of three tasks:

    * ``mlp``: 4-class classification of points drawn around 4 random centres in
      32 dimensions (a ``Teacher`` of Gaussian clusters); an MLP reaches >90%
      held-out accuracy in a few hundred steps.
    * ``bn``: the same data, and an MLP with ``BatchNorm1d`` — its buffers make
      ``ddp_broadcast_buffers`` matter, and make split equivalence fail
      (batch statistics depend on the per-device batch).
    * ``lm``: a tiny causal language model on sequences of *variable length*
      (4..32 tokens) from a simple synthetic grammar; per-token loss with
      padding masked out — where averaging micro-batch means is *not* the mean
      over all tokens (see ``loss_normalization``).

Why
    Tests, notebooks and the README's command must run on a machine with no
    network. Each task is small enough to train in seconds on 2 CPU cores and
    still shows the phenomenon it is there for.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

VOCAB, MAX_LEN, PAD = 16, 32, 0  # lm task: vocabulary, longest sequence, padding id


def _clusters(size: int, seed: int, dim: int = 32, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234)) * 0.5  # clusters overlap a little
    labels = torch.randint(0, classes, (size,), generator=g)
    x = centres[labels] + torch.randn(size, dim, generator=g)
    return TensorDataset(x, labels)


class Classifier(nn.Module):
    """MLP with optional BatchNorm, dropout and gradient checkpointing."""

    def __init__(self, batchnorm=False, dropout=0.0, checkpointing=False, dim=32, hidden=64, classes=4):
        super().__init__()
        norm = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        self.body = nn.Sequential(nn.Linear(dim, hidden), norm, nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)
        self.checkpointing = checkpointing  # recompute self.body in backward

    def forward(self, x):
        h = checkpoint(self.body, x, use_reentrant=False) if self.checkpointing and self.training else self.body(x)
        return self.head(h)


def _sequences(size: int, seed: int):
    """Each sequence counts up by a random stride mod VOCAB-1 (ids 1..15), random length 4..32."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, MAX_LEN + 1, (size,), generator=g)
    start = torch.randint(1, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    tokens = (start - 1 + stride * torch.arange(MAX_LEN)) % (VOCAB - 1) + 1
    mask = torch.arange(MAX_LEN) < lengths[:, None]
    return TensorDataset(torch.where(mask, tokens, PAD), mask)


class TinyLM(nn.Module):
    """Embedding + positions -> mix each token with the previous one (causal) -> logits."""

    def __init__(self, dim=32, dropout=0.0, checkpointing=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(MAX_LEN, dim))
        self.mix = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dim, VOCAB)
        self.checkpointing = checkpointing

    def _body(self, h):
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)  # the previous token: causal
        return torch.tanh(self.mix(torch.cat([h, prev], dim=-1)))

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = checkpoint(self._body, h, use_reentrant=False) if self.checkpointing and self.training else self._body(h)
        return self.out(self.drop(h))


def lm_token_losses(model, batch):
    """Per-token losses (next-token prediction) and their mask, for either normalisation."""
    tokens, mask = batch
    logits = model(tokens[:, :-1])
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none")
    return losses.view(tokens.shape[0], -1), mask[:, 1:].float()


def make_task(name: str, size: int, eval_size: int, seed: int, dropout: float = 0.0, checkpointing: bool = False):
    """``(model, train, eval, kind)``; ``kind`` is "classification" or "lm"."""
    torch.manual_seed(seed)  # model init: the same on every rank (DDP would broadcast it anyway)
    if name in ("mlp", "bn"):
        model = Classifier(batchnorm=name == "bn", dropout=dropout, checkpointing=checkpointing)
        return model, _clusters(size, seed + 1), _clusters(eval_size, seed + 2), "classification"
    if name == "lm":
        model = TinyLM(dropout=dropout, checkpointing=checkpointing)
        return model, _sequences(size, seed + 1), _sequences(eval_size, seed + 2), "lm"
    raise ValueError(f"model={name!r} must be one of mlp, bn, lm")
