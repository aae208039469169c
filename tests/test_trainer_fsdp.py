"""The trainer with Transformers', DeepSpeed's and Accelerate's FSDP names: ``--fsdp "full_shard auto_wrap"``,
``shard_grad_op``, ``zero_optimization.stage: 3`` and ``distributed_type: FSDP`` train what DDP trains, checkpoints
hold the full model and resume exactly (and load at another world size), and what cannot run is refused in one line
before any process starts.

Oracles: DDP on the same batches (the gradient is the same mean; only the clipping norm is summed in another order),
a run that never stopped, the saved state itself, and Accelerate's own launcher for the variables. Negative controls:
a run without clipping ends more than 1e-3 away (the comparison sees clipping: torch's clip_grad_norm_ on the shards
would clip by one rank's norm); the units, the resharding after forward and the loop's no_sync are observed, not
assumed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from miniddp import Trainer, TrainingConfig
from miniddp.engine.ddp import move_to
from miniddp.launching.accelerate_config import LaunchError, read_config
from miniddp.launching.launch import launch_command
from miniddp.launching.spawn import run_on_ranks
from miniddp.training.cli import parse_config
from miniddp.training.fsdp_args import accelerate_fsdp_settings
from miniddp.training.fsdp_keys import FSDPConfigError, FSDPSettings
from miniddp.training.sharded_model import units_to_wrap
from miniddp.training.tasks import TinyLM, make_task
from miniddp.zero.deepspeed_keys import DeepSpeedConfigError

from models import same_state

TOLERANCE = 1e-6  # float32: FSDP differs from DDP only by the clipping norm's rounding
BASE = {"max_steps": 6, "dataset_size": 256, "eval_size": 41, "per_device_eval_batch_size": 20,  # ranks: 2 and 1
        "disable_tqdm": True, "logging_steps": 3, "learning_rate": 0.01, "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 2, "max_grad_norm": 0.1}  # 0.1: every step clips (the norms are ~1)
LINEAR = {"transformer_layer_cls_to_wrap": ["Linear"]}
MINIDDP = Path(sys.executable).parent / "miniddp"


def _freed_after_forward(trainer) -> bool:
    """Whether the ``head`` unit's weight is freed between a forward and its backward (reshard_after_forward)."""
    out = trainer.forward(**move_to(next(iter(trainer.loader)), trainer.device))
    try:
        trainer.model.head.weight.sum()
        freed = False
    except RuntimeError:  # fully_shard's FreedParameter refuses a read
        freed = True
    out["loss"].backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return freed


def _train_each(rank, world_size, runs):
    """Train each run in turn; rank 0 returns each one's final_model.pt, metrics, no_sync entries and resharding."""
    out = []
    for overrides in runs:
        cfg = TrainingConfig(**{**BASE, **overrides})
        trainer = Trainer(args=cfg, **make_task(cfg))
        entered, no_sync = [], trainer.ddp.no_sync
        trainer.ddp.no_sync = lambda: entered.append(1) or no_sync()
        metrics = trainer.train()
        freed = _freed_after_forward(trainer)
        final = torch.load(Path(cfg.output_dir) / "final_model.pt", weights_only=True) if rank == 0 else None
        out.append((final, metrics, len(entered), freed))
    return out if rank == 0 else None


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _zero(stage):
    return {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


# --8<-- [start:equal]
def test_fsdp_shard_grad_op_and_stage_3_train_the_weights_ddp_trains(tmp_path):
    runs = [{}, {"fsdp": "full_shard auto_wrap", "fsdp_config": LINEAR},
            {"fsdp": "shard_grad_op auto_wrap", "fsdp_config": {"fsdp_min_num_params": 2000}},
            {"deepspeed": _zero(3)}, {"fsdp": "full_shard auto_wrap", "fsdp_config": LINEAR, "max_grad_norm": 0.0},
            *[{"fsdp": "full_shard auto_wrap", "fsdp_config": LINEAR, "gradient_checkpointing": True,
               "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}} for reentrant in (False, True)],
            *[{"model": "bn", "max_grad_norm": 0.0, **extra} for extra in  # AdamW magnifies a clip's rounding in
              ({}, {"fsdp": "full_shard auto_wrap", "fsdp_config": LINEAR},  # the bias BatchNorm cancels: unclipped
               {"fsdp": "full_shard auto_wrap", "fsdp_config": LINEAR, "ddp_broadcast_buffers": False})]]
    runs = [{**run, "output_dir": str(tmp_path / f"run{i}")} for i, run in enumerate(runs)]
    (ddp, m0, n0, f0), (full, m1, n1, f1), (grad_op, m2, n2, f2), (stage3, m3, n3, f3), (unclipped, _, _, _), \
        (recomputed, _, _, _), (reentrant, _, _, _), (bn_ddp, b0, _, _), (bn_fsdp, b1, _, _), (_, b2, _, _) = \
        run_on_ranks(_train_each, 2, args=(runs,), init=False, timeout=120)[0]
    # BatchNorm's running statistics: rank 0's before each forward, as DDP's ddp_broadcast_buffers makes them (each
    # rank evaluates with its own: without the broadcast, rank 1's drifted statistics show in eval_loss)
    assert any("running_mean" in k for k in bn_ddp) and _max_diff(bn_fsdp, bn_ddp) < TOLERANCE
    assert abs(b1["eval_loss"] - b0["eval_loss"]) < TOLERANCE < 100 * TOLERANCE < abs(b2["eval_loss"] - b0["eval_loss"])
    assert ddp.keys() == make_task(TrainingConfig(**BASE))["model"].state_dict().keys()  # plain, full names
    for weights in (full, grad_op, stage3, recomputed, reentrant):  # gradient checkpointing recomputes a unit
        assert _max_diff(weights, ddp) < TOLERANCE
    assert _max_diff(unclipped, ddp) > 1e-3  # the control: an FSDP that did not clip would be caught
    assert all(abs(m["eval_loss"] - m0["eval_loss"]) < TOLERANCE for m in (m1, m2, m3))  # ranks ran 2 and 1 batches
    assert "fsdp_units" not in m0 and (m0["zero_stage"], m3["zero_stage"]) == (0, 3)
    assert m1["fsdp_units"] == ["head", "body.4", "body.0", "(root)"] == m3["fsdp_units"]  # by class; each Linear
    assert m2["fsdp_units"] == ["body.4", "body.0", "body", "(root)"]  # by size: more than 2000 parameters
    assert (m1["reshard_after_forward"], m2["reshard_after_forward"]) == (True, False)
    assert (f0, f1, f2, f3) == (False, True, False, True)  # shard_grad_op keeps the gathered weight until backward
    assert (n0, n1, n2, n3) == (6, 6, 6, 0)  # no_sync on each window's first micro-batch; stage 3 syncs every one
# --8<-- [end:equal]


def _straight_then_resumed(rank, world_size, common, root):
    out = []
    for name, extra in (("a", {"save_steps": 4}), ("b", {"resume_from_checkpoint": f"{root}/a/checkpoint-4"})):
        cfg = TrainingConfig(**{**BASE, **common, **extra, "output_dir": f"{root}/{name}"})
        out.append(Trainer(args=cfg, **make_task(cfg)).train())
    return out


def _loaded_state(rank, world_size, common, path):
    """A fresh FSDP trainer on ``world_size`` ranks, the checkpoint loaded: its full model and optimizer state."""
    cfg = TrainingConfig(**{**BASE, **common, "resume_allow_changes": True,
                            "output_dir": str(Path(path).parent.parent / f"ranks{world_size}")})
    trainer = Trainer(args=cfg, **make_task(cfg))
    before = trainer.checkpointer.optimizer.state_dict()  # collectives, as the checkpoint's were
    trainer.checkpointer.resume(path, trainer.pending_loss)
    return before, trainer.checkpointer.optimizer.state_dict(), trainer.checkpointer.model.state_dict()


def test_a_checkpoint_holds_the_full_model_resumes_exactly_and_loads_at_three_ranks(tmp_path):
    common = {"fsdp": "full_shard auto_wrap", "fsdp_config": LINEAR, "max_steps": 8, "eval_size": 0}
    done, resumed = run_on_ranks(_straight_then_resumed, 2, args=(common, str(tmp_path)), init=False, timeout=120)[0]
    assert resumed["global_step"] == 8 and resumed["train_loss"] == done["train_loss"]
    finals = [torch.load(tmp_path / run / "final_model.pt", weights_only=True) for run in ("a", "b")]
    assert same_state(finals[0], finals[1])  # bit for bit
    checkpoint = tmp_path / "a" / "checkpoint-4"
    model = make_task(TrainingConfig(**BASE))["model"]
    model.load_state_dict(torch.load(checkpoint / "model.pt", weights_only=True))  # strict: the plain model's
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert sorted(saved["state"]) == sorted(name for name, _ in model.named_parameters())  # keyed by name, full
    assert all(saved["state"][n]["exp_avg"].shape == p.shape for n, p in model.named_parameters())
    for before, after, weights in run_on_ranks(_loaded_state, 3, args=(common, str(checkpoint)), init=False,
                                               timeout=120):
        assert same_state(after, saved) and same_state(weights, torch.load(checkpoint / "model.pt", weights_only=True))
        assert not same_state(before, saved)  # the control: a fresh optimizer's state is not the saved one


@pytest.mark.parametrize("overrides, key", [
    ({"fsdp": "full_shard offload"}, None),
    ({"fsdp": "full_shard", "fsdp_config": {"offload_params": True}}, "offload_params"),
    ({"fsdp": "full_shard", "fsdp_config": {"fsdp_cpu_offload": "true"}}, "fsdp_cpu_offload"),
    ({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 3}}, "fsdp_version"),
    ({"fsdp": "full_shard", "fsdp_config": {"activation_checkpointing": True}}, "activation_checkpointing"),
    ({"fsdp": "full_shard", "fsdp_config": {"reshard_after_forward": False}}, "reshard_after_forward"),
    ({"fsdp": "full_shard", "fsdp_config": LINEAR}, "transformer_layer_cls_to_wrap"),  # no auto_wrap
    ({"fsdp": "full_shard", "fsdp_config": {"sharding_strategy": "HYBRID_SHARD"}}, "sharding_strategy"),
    ({"fsdp": "full_shard", "fsdp_config": {"no_such_key": 1}}, "no_such_key"),
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {**LINEAR, "min_num_params": 10}}, None),
    ({"fsdp": "hybrid_shard"}, None), ({"fsdp": "full_shard shard_grad_op"}, None), ({"fsdp": "full"}, None),
    ({"fsdp_config": LINEAR}, None),  # without fsdp
    ({"fsdp": "full_shard", "deepspeed": _zero(2)}, None), ({"fsdp": "full_shard", "ddp_comm_hook": "fp16"}, None),
    ({"fsdp": "full_shard", "mixed_precision": "fp16"}, None), ({"fsdp": "full_shard", "torch_compile": True}, None),
    ({"fsdp": "full_shard", "ddp_bucket_cap_mb": 25}, None),
    ({"deepspeed": _zero(3), "ddp_bucket_cap_mb": 25}, None),
])
def test_what_cannot_run_is_one_line_when_the_config_is_built(overrides, key):
    with pytest.raises(FSDPConfigError) as info:
        TrainingConfig(**overrides)
    assert info.value.key == key and len(str(info.value).splitlines()) == 1
    assert key is None or f"{key}=" in str(info.value) or f"{key} " in str(info.value)


def test_transformers_spellings_and_deepspeed_s_zero3_template_are_read():
    """The fsdp_ prefix, strings for booleans and numbers, FSDP1's words, a JSON string from the command line."""
    config = parse_config(["--fsdp", "shard_grad_op auto_wrap", "--fsdp_config",
                           '{"fsdp_min_num_params": "100", "fsdp_version": "2", "use_orig_params": "true"}'])
    assert config.fsdp_settings == FSDPSettings(True, False, "size", (), 100, "fsdp='shard_grad_op auto_wrap'")
    assert TrainingConfig(fsdp="auto_wrap", fsdp_config={"reshard_after_forward": "SHARD_GRAD_OP"}).fsdp_settings \
        .reshard_after_forward is False
    assert not TrainingConfig().fully_sharded and TrainingConfig(fsdp=["full_shard"]).fully_sharded
    zero3 = {"zero_optimization": {  # Hugging Face's ds_config_zero3.json, offloading to none
        "stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True}, "gradient_accumulation_steps": "auto"}
    config = TrainingConfig(deepspeed=zero3)
    assert (config.zero_stage, config.fsdp_settings.wrap, config.ddp_bucket_cap_mb) == (3, "deepspeed", None)
    zero3["zero_optimization"]["offload_param"]["device"] = "cpu"
    with pytest.raises(DeepSpeedConfigError) as info:
        TrainingConfig(deepspeed=zero3)
    assert info.value.key == "zero_optimization.offload_param.device"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)


class Tied(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.embed, self.out = nn.Embedding(8, 4), nn.Linear(4, 8)
        self.out.weight = self.embed.weight  # tied: both must stay in one unit


def test_the_wrap_policies_pick_units_bottom_up_without_processes():
    model = Tied()
    names = {id(m): n for n, m in model.named_modules()}

    def picked(**settings):
        return [names[id(m)] for m in units_to_wrap(model, FSDPSettings(True, **settings))]
    assert picked(wrap="transformer") == ["blocks.1", "blocks.0"]  # _no_split_modules
    assert picked(wrap="deepspeed") == ["blocks.1", "blocks.0"]
    assert picked(wrap="size", min_num_params=35) == ["out", "blocks"]  # 40 each (out: the tied 32 + 8); embed 32
    assert picked(wrap="transformer", layer_classes=("Linear",)) == ["out", "blocks.1.inner", "blocks.0.inner"]
    del Tied._no_split_modules  # Deepspeed's fallback: each module holding parameters itself, a tied one left out
    try:
        assert picked(wrap="deepspeed") == ["blocks.1.inner", "blocks.0.inner"]
        with pytest.raises(ValueError, match="transformer_layer_cls_to_wrap"):
            picked(wrap="transformer")
    finally:
        Tied._no_split_modules = ["Block"]
    with pytest.raises(ValueError, match="no module of class GPT2Block"):
        picked(wrap="transformer", layer_classes=("GPT2Block",))
    lm = TinyLM()
    assert [n for n, m in lm.named_modules() if m in units_to_wrap(lm, FSDPSettings(True, wrap="deepspeed"))] == [
        "embed", "mix", "out"]  # the root keeps pos, read in its own forward


FSDP_YAML = ("distributed_type: FSDP\nnum_processes: 2\nuse_cpu: true\nfsdp_config:\n  fsdp_version: 2\n"
             "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: Linear\n"
             "  fsdp_reshard_after_forward: false\n  fsdp_offload_params: false\n"
             "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_cpu_ram_efficient_loading: true\n")


def test_accelerate_s_fsdp_yaml_becomes_accelerate_s_variables_which_the_trainer_reads(tmp_path, monkeypatch):
    (tmp_path / "fsdp.yaml").write_text(FSDP_YAML)
    monkeypatch.chdir(tmp_path)
    _, env, _ = launch_command(["--config_file", "fsdp.yaml", "--dry_run", "-m", "miniddp.train"])
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Linear"
    assert accelerate_fsdp_settings(env) == FSDPSettings(True, False, "transformer", ("Linear",), 0,
                                                         "accelerate's fsdp_config (FSDP_* variables)")
    for old, new, key in (("fsdp_offload_params: false", "fsdp_offload_params: true", "fsdp_offload_params"),
                          ("fsdp_version: 2", "fsdp_version: 2\n  fsdp_min_num_params: 10", "fsdp_min_num_params"),
                          ("SHARDED_STATE_DICT", "LOCAL_STATE_DICT", "fsdp_state_dict_type"),
                          ("fsdp_version: 2", "fsdp_version: 2\n  bogus: 1", "bogus")):
        (tmp_path / "bad.yaml").write_text(FSDP_YAML.replace(old, new))
        with pytest.raises(LaunchError) as info:  # before any process starts
            read_config(tmp_path / "bad.yaml")
        assert len(str(info.value).splitlines()) == 1 and key in str(info.value)
    (tmp_path / "fp16.yaml").write_text(FSDP_YAML + "mixed_precision: fp16\n")
    with pytest.raises(LaunchError, match="fp16"):
        read_config(tmp_path / "fp16.yaml")
    commands = pytest.importorskip("accelerate.commands.launch", reason="accelerate is not installed")
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = commands._validate_launch_command(  # Accelerate's own launcher, on the same file (as on GPUs)
        commands.launch_command_parser().parse_args(["--config_file", str(tmp_path / "fsdp.yaml"), "x.py"]))
    args.cpu = False  # accelerate launch drops FSDP on the CPU; miniddp runs it there on gloo
    theirs = prepare_multi_gpu_env(args)
    ours = {k: v for k, v in env.items() if "FSDP" in k}  # (theirs copies this process's environment too)
    assert ours == {k: theirs.get(k) for k in ours}
    assert accelerate_fsdp_settings(theirs) == accelerate_fsdp_settings(env)  # all of theirs, read alike


@pytest.mark.timeout(180)
def test_miniddp_launch_runs_an_accelerate_fsdp_yaml(tmp_path):
    (tmp_path / "fsdp.yaml").write_text(FSDP_YAML)
    out = tmp_path / "out"
    done = subprocess.run([str(MINIDDP), "launch", "--config_file", "fsdp.yaml", "-m", "miniddp.train",
                           "--output_dir", str(out), "--max_steps", "2", "--dataset_size", "64", "--eval_size", "0",
                           "--disable_tqdm", "true"], cwd=tmp_path, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["global_step"], metrics["reshard_after_forward"]) == (2, 2, False)
    assert metrics["fsdp_units"] == ["head", "body.4", "body.0", "(root)"]
    assert set(torch.load(out / "final_model.pt", weights_only=True)) == set(
        make_task(TrainingConfig(**BASE))["model"].state_dict())
