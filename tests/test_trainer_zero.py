"""The trainer with DeepSpeed's names: ZeRO stages 1 and 2 train what stage 0 (DDP + AdamW) trains, resume bit for
bit, resume on another number of ranks, keep final_model.pt a plain state dict, and run from Accelerate's YAML.

Oracles: stage 0 on the same batches (the averaged gradient is the same; only the clipping norm is summed in
another order, so float32 agrees to far below 1e-6), a run that never stopped, and the saved state itself.
Negative controls: a run without clipping ends more than 1e-3 away, so the comparison sees clipping (torch's
clip_grad_norm_ on the model sees no .grad under ZeRO and would clip nothing); the loop's no_sync is counted.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miniddp import Trainer, TrainingConfig
from miniddp.launching.spawn import run_on_ranks
from miniddp.training.tasks import make_task

from models import same_state

TOLERANCE = 1e-6  # float32: stages 1 and 2 differ from stage 0 only by the clipping norm's rounding
BASE = {"max_steps": 6, "dataset_size": 256, "eval_size": 0, "disable_tqdm": True, "logging_steps": 3,
        "learning_rate": 0.01, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.1}  # 0.1: every step clips (the norms are ~1)
MINIDDP = Path(sys.executable).parent / "miniddp"


def _zero(stage):
    return {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def _train(rank, world_size, overrides):
    """Train on this rank; rank 0 returns the weights, the metrics and how often the loop entered no_sync."""
    cfg = TrainingConfig(**{**BASE, **overrides})
    trainer = Trainer(args=cfg, **make_task(cfg))
    entered, no_sync = [], trainer.ddp.no_sync
    trainer.ddp.no_sync = lambda: entered.append(1) or no_sync()
    metrics = trainer.train()
    if rank == 0:
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}, metrics, len(entered)
    return None


def _run(tmp_path, name, processes=2, **overrides):
    overrides = {"output_dir": str(tmp_path / name), **overrides}
    return run_on_ranks(_train, processes, args=(overrides,), init=False, timeout=120)[0]


def _max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# --8<-- [start:stages]
def test_stages_1_and_2_train_the_weights_stage_0_trains(tmp_path):
    reference, metrics, entered = _run(tmp_path, "stage0", deepspeed=_zero(0))
    assert metrics["zero_stage"] == 0 and entered == 6  # DDP: no_sync on the first micro-batch of each window
    for stage in (1, 2):
        params, metrics, entered = _run(tmp_path, f"stage{stage}", deepspeed=_zero(stage))
        assert metrics["zero_stage"] == stage and _max_diff(params, reference) < TOLERANCE
        assert entered == (6 if stage == 1 else 0)  # stage 2 syncs every micro-batch, as DeepSpeed does
    unclipped, _, _ = _run(tmp_path, "unclipped", deepspeed=_zero(2), max_grad_norm=0.0)
    assert _max_diff(unclipped, reference) > 1e-3  # the control: a ZeRO that did not clip would be caught
# --8<-- [end:stages]


HF_ZERO2 = {  # Hugging Face's ds_config_zero2.json (its DeepSpeed page), optimizer and scheduler blocks included
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
DECAY = {"type": "WarmupDecayLR", "params": {**HF_ZERO2["scheduler"]["params"], "total_num_steps": "auto"}}


def _train_each(rank, world_size, runs):
    """Train each run in turn, ``(overrides, learning-rate factors by hand or None)``; rank 0 returns each run's
    weights and the learning rate each optimizer step ran at."""
    out = []
    for overrides, factors in runs:
        cfg = TrainingConfig(**{**BASE, **overrides})
        trainer = Trainer(args=cfg, **make_task(cfg))
        if factors is not None:  # the plain run, its learning rates set by hand
            trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, (factors + [0]).__getitem__)
        lrs = []
        trainer.optimizer.register_step_pre_hook(lambda optimizer, *_: lrs.append(optimizer.param_groups[0]["lr"]))
        trainer.train()
        out.append(({k: v.clone() for k, v in trainer.model.state_dict().items()}, lrs))
    return out if rank == 0 else None


def test_hugging_face_s_zero2_template_trains_what_the_plain_flags_train(tmp_path):
    """The template, optimizer and scheduler blocks all "auto", against the same run given by plain flags with
    DeepSpeed's learning rates written out by hand: bitwise, step by step."""
    (tmp_path / "ds_config_zero2.json").write_text(json.dumps(HF_ZERO2))
    (tmp_path / "decay.json").write_text(json.dumps({**HF_ZERO2, "scheduler": DECAY}))
    flags = {"weight_decay": 0.01, "deepspeed": _zero(2), "ddp_bucket_cap_mb": 2e8 * 4 / 2**20}  # the same buckets
    lr = BASE["learning_rate"]
    warmup, decay = [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 3 / 4, 2 / 4]  # DeepSpeed's: first steps at warmup_min_lr 0
    runs = [({"weight_decay": 0.01, "deepspeed": str(tmp_path / "ds_config_zero2.json")}, None),
            (flags, warmup),
            ({"weight_decay": 0.01, "deepspeed": str(tmp_path / "decay.json")}, None),
            (flags, decay),
            (flags, None)]  # the control: the trainer's own linear decay
    runs = [({**overrides, "output_dir": str(tmp_path / f"run{i}")}, factors)
            for i, (overrides, factors) in enumerate(runs)]
    (template, template_lrs), (plain, plain_lrs), (decayed, decayed_lrs), (plain_decayed, _), (linear, _) = \
        run_on_ranks(_train_each, 2, args=(runs,), init=False, timeout=120)[0]
    assert template_lrs == plain_lrs == [lr * f for f in warmup] and decayed_lrs == [lr * f for f in decay]
    assert all(torch.equal(template[k], plain[k]) and torch.equal(decayed[k], plain_decayed[k]) for k in template)
    assert _max_diff(template, linear) > 1e-3 and _max_diff(decayed, linear) > 1e-3  # the schedule is seen


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_is_bitwise_and_the_final_model_is_a_plain_state_dict(stage, tmp_path):
    common = {"deepspeed": _zero(stage), "max_steps": 8}  # a save at step 4 falls between two logs (every 3)
    straight, done, _ = _run(tmp_path, "a", save_steps=4, **common)
    resumed, metrics, _ = _run(tmp_path, "b", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"), **common)
    assert metrics["global_step"] == 8 and metrics["train_loss"] == done["train_loss"]
    finals = [torch.load(tmp_path / run / "final_model.pt", weights_only=True) for run in ("a", "b")]
    assert finals[0].keys() == straight.keys() and all(torch.equal(finals[0][k], straight[k]) for k in straight)
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in straight) and all(
        torch.equal(resumed[k], straight[k]) for k in straight)
    saved = torch.load(tmp_path / "a" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    model = make_task(TrainingConfig(**BASE))["model"]  # torch.optim's own format: a plain AdamW loads it
    torch.optim.AdamW(model.parameters()).load_state_dict(saved)
    assert sorted(saved["state"]) == list(range(len(list(model.parameters()))))


def _loaded_state(rank, world_size, overrides, path):
    """A fresh ZeRO trainer on ``world_size`` ranks: its optimizer's whole state before and after loading ``path``."""
    cfg = TrainingConfig(**{**BASE, **overrides})
    trainer = Trainer(args=cfg, **make_task(cfg))
    before = trainer.optimizer.state_dict()  # a collective, as the checkpoint's was
    trainer.checkpointer.resume(path, trainer.pending_loss)
    return before, trainer.optimizer.state_dict(), {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path):
    common = {"deepspeed": _zero(2), "max_steps": 8, "resume_allow_changes": True}
    straight, _, _ = _run(tmp_path, "two", save_steps=4, **common)
    checkpoint = tmp_path / "two" / "checkpoint-4"
    # 1 rank x 16 samples: the same global batch, in the same order, so the rest of the run is the same run
    alone, metrics, _ = _run(tmp_path, "one", processes=1, per_device_train_batch_size=16,
                             resume_from_checkpoint=str(checkpoint), **common)
    assert metrics["world_size"] == 1 and _max_diff(alone, straight) < TOLERANCE
    halfway = torch.load(checkpoint / "model.pt", weights_only=True)
    assert _max_diff(halfway, straight) > 1e-3  # the control: the resumed steps did train
    # 3 ranks cut the state three ways: gathered again, it is the saved state, every element
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    model = torch.load(checkpoint / "model.pt", weights_only=True)
    for before, after, weights in run_on_ranks(_loaded_state, 3, args=(common, str(checkpoint)), init=False,
                                               timeout=120):
        assert same_state(after, saved) and same_state(weights, model)
        assert not same_state(before, saved)  # the control: a fresh optimizer's state is not the saved one


@pytest.mark.timeout(180)
def test_accelerate_s_deepspeed_yaml_runs_miniddp_s_stage(tmp_path):
    (tmp_path / "ds.yaml").write_text(
        "distributed_type: DEEPSPEED\nnum_processes: 2\nuse_cpu: true\n"
        "deepspeed_config:\n  zero_stage: 2\n  gradient_accumulation_steps: 2\n  gradient_clipping: 0.5\n"
        "  offload_optimizer_device: none\n  offload_param_device: none\n  zero3_init_flag: false\n")
    out = tmp_path / "out"
    done = subprocess.run([str(MINIDDP), "launch", "--config_file", "ds.yaml", "-m", "miniddp.train",
                           "--output_dir", str(out), "--max_steps", "2", "--dataset_size", "64", "--eval_size", "0",
                           "--disable_tqdm", "true"], cwd=tmp_path, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["zero_stage"], metrics["world_size"], metrics["global_step"]) == (2, 2, 2)
    assert (metrics["config"]["gradient_accumulation_steps"], metrics["config"]["max_grad_norm"]) == (2, 0.5)
    assert set(torch.load(out / "final_model.pt", weights_only=True)) == set(
        make_task(TrainingConfig(**BASE))["model"].state_dict())
