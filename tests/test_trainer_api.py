"""The Trainer's contract with a user's model, data and loss: Hugging Face's conventions, DDP's settings."""

from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from miniddp import Trainer, TrainingConfig
from miniddp.engine.ddp import move_to
from miniddp.engine.static_graph import StaticGraph
from miniddp.launching.spawn import RankError, run_on_ranks

VOCAB, LENGTH, CLASSES = 12, 10, 5


class Tagger(nn.Module):
    """A user's model in Hugging Face's style: tags every token; adds a mean "loss" when given labels."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, tokens, labels=None):
        logits = self.head(torch.tanh(self.embed(tokens)))
        if labels is None:
            return {"logits": logits}
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)}


def plain_tagger():
    """The same, in plain PyTorch: returns the logits tensor."""
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, CLASSES))


class Tagged(Dataset):
    """Sequences of 1..LENGTH tokens; labels -100 past each one's end, so micro-batches hold
    different numbers of labels and the mean of their means is not the mean over labels."""

    def __init__(self, size=128, style="dict"):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (size, LENGTH), generator=g)
        lengths = torch.randint(1, LENGTH + 1, (size,), generator=g)
        self.labels = torch.where(torch.arange(LENGTH) < lengths[:, None], (3 * self.tokens + 1) % CLASSES, -100)
        self.style = style  # "dict", "tuple", or "unlabelled" (a dict without labels)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        if self.style == "tuple":
            return self.tokens[i], self.labels[i]
        if self.style == "unlabelled":
            return {"tokens": self.tokens[i]}
        return {"tokens": self.tokens[i], "labels": self.labels[i]}


# --8<-- [start:user_loss]
def token_loss(outputs, labels, num_items_in_batch):
    """A user's compute_loss_func: summed over this micro-batch's labels, divided by the window's count."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs
    summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return summed / num_items_in_batch
# --8<-- [end:user_loss]


def _config(out, per_device=32, accumulation=1, **overrides):
    return TrainingConfig(**{"output_dir": out, "per_device_train_batch_size": per_device,
                             "gradient_accumulation_steps": accumulation, "max_steps": 5, "learning_rate": 0.05,
                             "logging_steps": 100, "disable_tqdm": True, **overrides})


def _fit(rank, world_size, out, per_device, accumulation, style, loss_func):
    torch.manual_seed(0)  # the same initial weights in every run
    model = (plain_tagger() if style == "tuple" else Tagger()).double()
    trainer = Trainer(model=model, args=_config(out, per_device, accumulation), train_dataset=Tagged(style=style),
                      compute_loss_func=token_loss if loss_func else None)
    trainer.train()
    return {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None


def _params(tmp_path, split, style, loss_func=True):
    processes, per_device, accumulation = split
    out = str(tmp_path / f"{style}-{processes}-{per_device}-{accumulation}")
    return run_on_ranks(_fit, processes, args=(out, per_device, accumulation, style, loss_func), init=False,
                        timeout=120)[0]


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --8<-- [start:user_splits]
@pytest.mark.parametrize("style", ["dict", "tuple"])
def test_a_user_model_trains_the_same_with_every_split_of_the_effective_batch(style, tmp_path):
    reference = _params(tmp_path, (1, 32, 1), style)
    for split in [(1, 4, 8), (2, 4, 4), (4, 8, 1)]:
        assert _max_diff(_params(tmp_path, split, style), reference) < 1e-10, split


def test_per_micro_batch_means_do_not(tmp_path):
    # the negative control: the model's own loss, a mean over each micro-batch's labels
    reference = _params(tmp_path, (1, 32, 1), "dict", loss_func=False)
    assert _max_diff(_params(tmp_path, (2, 4, 4), "dict", loss_func=False), reference) > 1e-4
# --8<-- [end:user_splits]


def _fail_on_first_batch(rank, world_size, out, style, loss_func):
    torch.manual_seed(0)
    model = plain_tagger() if style in ("tuple", "tensor") else Tagger()
    data = Tagged(style="tuple" if style == "tensor" else style)
    collate = (lambda samples: torch.stack([s[0] for s in samples])) if style == "tensor" else None
    Trainer(model=model, args=_config(out), train_dataset=data, data_collator=collate,
            compute_loss_func=token_loss if loss_func else None).train()


@pytest.mark.parametrize("style, loss_func, says", [
    ("unlabelled", False, "without a 'loss' for a dict batch (the batch has no 'labels' key"),
    ("unlabelled", True, "compute_loss_func needs labels, but the dict batch has no 'labels' key"),
    ("tuple", False, "pass compute_loss_func=fn(outputs, labels, num_items_in_batch)"),
    ("tensor", True, "pass data_collator= to build one"),
])
def test_a_batch_the_trainer_cannot_use_is_one_clear_error(style, loss_func, says, tmp_path):
    with pytest.raises(RankError) as info:
        run_on_ranks(_fail_on_first_batch, 1, args=(str(tmp_path), style, loss_func), init=False, timeout=60)
    assert says in str(info.value.__cause__)


def test_move_to_moves_every_tensor_of_any_nesting():
    pair = namedtuple("pair", "a b")
    batch = {"x": torch.ones(2), "nested": [torch.zeros(1), (torch.ones(3), pair(torch.ones(1), "text"))]}
    moved = move_to(batch, torch.device("meta"))
    assert moved["x"].is_meta and moved["nested"][0].is_meta and moved["nested"][1][0].is_meta
    assert isinstance(moved["nested"][1][1], pair) and moved["nested"][1][1].a.is_meta
    assert moved["nested"][1][1].b == "text"


# --8<-- [start:count_all_reduces]
def _collectives_per_window(rank, world_size, out):
    torch.manual_seed(0)
    cfg = _config(out, per_device=4, accumulation=4, max_steps=3, ddp_bucket_cap_mb=0.0001)  # 3 buckets
    trainer = Trainer(model=Tagger(), args=cfg, train_dataset=Tagged(), compute_loss_func=token_loss)
    calls, real_all_reduce = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):  # the reducer launches buckets with async_op=True
        calls.append(("bucket" if tensor.is_floating_point() else "used counts") if kwargs.get("async_op")
                     else "all_reduce")
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting  # this rank's process only
    trainer.optimizer.register_step_post_hook(lambda *_: calls.append(len(trainer.ddp.bucket_assignment)))
    trainer.train()
    windows, window = [], []
    for call in calls:
        if isinstance(call, int):  # an optimizer step ends the window; the buckets it used
            windows.append((window, call))
            window = []
        else:
            window.append(call)
    return windows, trainer.ddp.reducer.backwards


def test_one_synced_backward_and_one_item_count_per_accumulation_window(tmp_path):
    for windows, synced_backwards in run_on_ranks(_collectives_per_window, 2, args=(str(tmp_path),), init=False):
        assert synced_backwards == 3  # 3 windows of 4 micro-batches: 3 synced backwards, not 12
        assert len(windows) == 3
        for calls, buckets in windows:
            assert buckets >= 2 and calls == ["all_reduce"] + ["bucket"] * buckets + ["used counts"]
# --8<-- [end:count_all_reduces]


def _ddp_settings(rank, world_size, out, overrides):
    torch.manual_seed(0)
    trainer = Trainer(model=Tagger(), args=_config(out, **overrides), train_dataset=Tagged(),
                      compute_loss_func=token_loss)
    world = dist.group.WORLD._get_backend(torch.device("cpu"))  # the process group init_distributed made
    return {"backend": (trainer.env.backend, dist.get_backend()), "timeout": world.options._timeout.total_seconds(),
            "buckets": len(trainer.ddp.bucket_assignment), "find_unused": trainer.ddp.find_unused_parameters,
            "broadcast_buffers": trainer.ddp.broadcast_buffers, "device": str(trainer.env.device),
            "static_graph": isinstance(trainer.ddp.reducer.readiness, StaticGraph)}


def test_every_ddp_flag_reaches_ddp_and_the_process_group(tmp_path):
    flags = {"ddp_backend": "gloo", "ddp_timeout": 123, "ddp_bucket_cap_mb": 0.0001,
             "ddp_find_unused_parameters": True, "ddp_broadcast_buffers": False, "use_cpu": True,
             "ddp_static_graph": True}
    default = run_on_ranks(_ddp_settings, 2, args=(str(tmp_path), {"ddp_backend": "gloo"}), init=False)[0]
    assert default == {"backend": ("gloo", "gloo"), "timeout": 1800, "buckets": 1, "find_unused": False,
                       "broadcast_buffers": True, "device": "cuda:0" if torch.cuda.is_available() else "cpu",
                       "static_graph": False}
    chosen = run_on_ranks(_ddp_settings, 2, args=(str(tmp_path), flags), init=False)[0]
    assert chosen == {"backend": ("gloo", "gloo"), "timeout": 123, "buckets": 3, "find_unused": True,
                      "broadcast_buffers": False, "device": "cpu", "static_graph": True}


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl would start on this machine")
def test_ddp_backend_reaches_init_distributed(tmp_path):
    with pytest.raises(RankError, match="ddp_backend='nccl' needs CUDA tensors"):
        run_on_ranks(_ddp_settings, 1, args=(str(tmp_path), {"ddp_backend": "nccl"}), init=False)


class MaskRecorder(nn.Module):
    """Applies dropout and remembers every mask it drew."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.drop = nn.Dropout(0.5)
        self.masks = []

    def forward(self, tokens, labels):
        h = self.drop(self.embed(tokens))
        self.masks.append(h != 0)
        return {"loss": F.cross_entropy(h[..., :CLASSES].flatten(0, 1), labels.flatten(), ignore_index=-100)}


def _dropout_masks(rank, world_size, out, seed):
    torch.manual_seed(0)  # every rank starts from the same state, as in most scripts
    model = MaskRecorder()
    Trainer(model=model, args=_config(out, per_device=8, max_steps=3, seed=seed), train_dataset=Tagged()).train()
    return torch.stack(model.masks)


def test_each_rank_draws_its_own_dropout_masks_reproducibly(tmp_path):
    first = run_on_ranks(_dropout_masks, 2, args=(str(tmp_path / "a"), 42), init=False)
    assert not torch.equal(first[0], first[1])  # same shapes, different masks: seed + rank
    again = run_on_ranks(_dropout_masks, 2, args=(str(tmp_path / "b"), 42), init=False)
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # a function of seed and rank
    other_seed = run_on_ranks(_dropout_masks, 2, args=(str(tmp_path / "c"), 43), init=False)
    assert torch.equal(other_seed[0], first[1])  # rank 0 of seed 43 is rank 1 of seed 42, as in Accelerate


def mean_loss(outputs, labels):
    """A two-parameter compute_loss_func (no num_items_in_batch): a mean over this micro-batch's labels."""
    return F.cross_entropy(outputs["logits"].flatten(0, 1), labels.flatten(), ignore_index=-100)


def _fit_with(rank, world_size, out, loss_func):
    torch.manual_seed(0)
    model = Tagger().double()
    Trainer(model=model, args=_config(out, 4, 4), train_dataset=Tagged(), compute_loss_func=loss_func).train()
    return {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None


def test_a_two_parameter_loss_is_a_per_batch_mean_like_the_models_own(tmp_path):
    # Transformers calls fn(outputs, labels, num_items_in_batch=...) and so raises a TypeError here; we
    # call it without, and divide it by the accumulation steps as we do the model's own mean loss
    two, own, weighted = (run_on_ranks(_fit_with, 2, args=(str(tmp_path / name), fn), init=False, timeout=120)[0]
                          for name, fn in (("two", mean_loss), ("own", None), ("weighted", token_loss)))
    assert _max_diff(two, own) < 1e-10
    assert _max_diff(two, weighted) > 1e-4  # not the token-weighted mean that num_items_in_batch gives
