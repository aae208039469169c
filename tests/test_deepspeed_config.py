"""DeepSpeed's and Accelerate's names for ZeRO, read into miniddp's stage 0, 1 or 2, before any rank starts.

The oracles are Hugging Face's and Accelerate's own readings: ``HfTrainerDeepSpeedConfig.trainer_config_process``
(``"auto"`` filled from the trainer, a concrete value that disagrees refused), Accelerate's ``DeepSpeedPlugin``
(what the ``ACCELERATE_*`` variables mean) and ``prepare_deepspeed_cmd_env`` (the variables a YAML becomes). Every
refusal is a ``DeepSpeedConfigError`` whose ``.key`` is the dotted path it is about, in one line.
"""

import base64
import contextlib
import copy
import json
import types

import pytest

from miniddp import TrainingConfig
from miniddp.launching.launch import main as launch
from miniddp.training.cli import main as train_cli
from miniddp.zero.deepspeed_config import (
    VARIABLES,
    DeepSpeedConfigError,
    accelerate_deepspeed_config,
    accelerate_variables,
    load_deepspeed_config,
)
from miniddp.zero.deepspeed_optim import fill_blocks, read_blocks

HF_ZERO2 = {  # Hugging Face's ds_config_zero2.json (the DeepSpeed page)
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch):
    for name in ["WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED", *VARIABLES.values()]:
        monkeypatch.delenv(name, raising=False)


def _stage(config):
    return TrainingConfig(deepspeed=config).zero_stage


def test_the_stage_is_read_from_a_file_json_text_base64_or_a_dict(tmp_path):
    for stage in (0, 1, 2):
        config = {"zero_optimization": {"stage": stage}}
        (tmp_path / "ds.json").write_text(json.dumps(config))
        forms = [str(tmp_path / "ds.json"), tmp_path / "ds.json", json.dumps(config), config,
                 base64.urlsafe_b64encode(json.dumps(config).encode()).decode()]
        assert [_stage(form) for form in forms] == [stage] * 5
    assert _stage({}) == 0 and _stage({"zero_optimization": {}}) == 0  # DeepSpeed's default stage
    assert TrainingConfig().zero_stage == 0  # no config, no ACCELERATE_USE_DEEPSPEED: DDP


def test_hugging_face_s_zero2_example_fills_auto_from_the_trainer():
    config = TrainingConfig(deepspeed=HF_ZERO2, mixed_precision="bf16", gradient_accumulation_steps=4)
    assert config.zero_stage == 2
    assert config.ddp_bucket_cap_mb == 2e8 * 4 / 2**20  # reduce_bucket_size: fp32 elements, as DDP's MiB
    assert config.deepspeed == HF_ZERO2  # the field keeps what was given (Hugging Face: the same)


@pytest.mark.parametrize("key, given, agreeing, overrides", [
    ("train_micro_batch_size_per_gpu", 4, 8, {"per_device_train_batch_size": 8}),
    ("gradient_accumulation_steps", 1, 4, {"gradient_accumulation_steps": 4}),
    ("gradient_clipping", 0.5, 1, {"max_grad_norm": 1.0}),  # 1 == 1.0
    ("fp16.enabled", True, False, {"mixed_precision": "no"}),
    ("bf16.enabled", False, True, {"mixed_precision": "bf16"}),
    ("train_batch_size", 32, 16, {"per_device_train_batch_size": 8}),  # WORLD_SIZE=2 below
    ("gradient_accumulation_steps", True, 1, {}),  # true is no number of steps, though True == 1
    ("zero_optimization.reduce_bucket_size", 2**20, 2**18, {"ddp_bucket_cap_mb": 1}),  # 2**18 x 4 bytes = 1 MiB
])
def test_a_concrete_value_must_agree_with_the_trainer(key, given, agreeing, overrides, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's: train_batch_size is checked at config time
    def nested(value):
        head, _, leaf = key.rpartition(".")
        return {head: {leaf: value}} if head else {key: value}
    with pytest.raises(DeepSpeedConfigError) as info:
        TrainingConfig(deepspeed=nested(given), **overrides)
    assert info.value.key == key and len(str(info.value).splitlines()) == 1
    TrainingConfig(deepspeed=nested(agreeing), **overrides)  # the control: the agreeing value is accepted
    TrainingConfig(deepspeed=nested("auto"), **overrides)  # and "auto" takes the trainer's


@pytest.mark.parametrize("config, key", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),  # stage 3 runs fully_shard
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
    ({"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 1}},
     "zero_optimization.stage3_module_granularity_threshold"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2.0}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"pin_memory": True, "device": "cpu"}}},
     "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"stage": 1, "reduce_scatter": False}}, "zero_optimization.reduce_scatter"),
    ({"zero_optimization": {"stage": 1, "allgather_partitions": False}}, "zero_optimization.allgather_partitions"),
    ({"zero_optimization": {"stage": 1, "round_robin_gradients": True}}, "zero_optimization.round_robin_gradients"),
    ({"zero_optimization": {"stage": 1, "reduce_bucket_size": "big"}}, "zero_optimization.reduce_bucket_size"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, "optimizer.type"),
    ({"scheduler": {"type": "OneCycle"}}, "scheduler.type"),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, "fp16.loss_scale"),  # mixed_precision="fp16" below
    ({"bf16": {"enabled": "auto", "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ({"communication_data_type": "fp32"}, "communication_data_type"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing.partition_activations"),
    ({"wall_clock_breakdown": True}, "wall_clock_breakdown"),
])
def test_every_key_miniddp_does_not_implement_is_refused_naming_it(config, key):
    precision = "fp16" if config.get("fp16", {}).get("enabled") else "no"
    with pytest.raises(DeepSpeedConfigError) as info:
        TrainingConfig(deepspeed=config, mixed_precision=precision)
    assert info.value.key == key
    assert len(str(info.value).splitlines()) == 1 and key in str(info.value)


def _nested(depth: int) -> dict:
    config = {}
    for _ in range(depth):  # built without recursion, as a file's JSON would be
        config = {"zero_optimization": config}
    return config


def test_a_file_that_is_not_a_deepspeed_config_is_one_line(tmp_path):
    (tmp_path / "twice.json").write_text('{"zero_optimization": {"stage": 1, "stage": 2}}')
    (tmp_path / "broken.json").write_text('{"zero_optimization": ')
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "deep.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)  # past json's recursion
    (tmp_path / "deep40.json").write_text(json.dumps(_nested(40)))  # json reads it; deepcopy and _flat would not
    for value, key in [(tmp_path / "twice.json", "stage"), (tmp_path / "broken.json", None),
                       (tmp_path / "list.json", None), (str(tmp_path / "missing.json"), None), (3, None),
                       (tmp_path / "deep.json", None), (tmp_path / "deep40.json", None), (_nested(100_000), None)]:
        with pytest.raises(DeepSpeedConfigError) as info:
            load_deepspeed_config(value)
        assert info.value.key == key and len(str(info.value).splitlines()) == 1


def test_a_file_that_is_not_utf8_is_named_as_such(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"zero_optimization": {"stage": 1}, "note": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(DeepSpeedConfigError) as info:
        load_deepspeed_config(path)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)  # not "no file, JSON or base64"
    assert str(path) in info.value.source and len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("text, key", [
    ('{"gradient_clipping": NaN}', "gradient_clipping"),
    ('{"gradient_clipping": -1}', "gradient_clipping"),
    ('{"gradient_accumulation_steps": 1.5}', "gradient_accumulation_steps"),
    ('{"train_micro_batch_size_per_gpu": -8}', "train_micro_batch_size_per_gpu"),
    ('{"train_batch_size": Infinity}', "train_batch_size"),  # refused though the world size is not known
    ('{"zero_optimization": {"reduce_bucket_size": NaN}}', "zero_optimization.reduce_bucket_size"),
    ('{"zero_optimization": {"reduce_bucket_size": Infinity}}', "zero_optimization.reduce_bucket_size"),
    ('{"optimizer": {"type": "AdamW", "params": {"lr": NaN}}}', "optimizer.params.lr"),
    ('{"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": -1, "warmup_num_steps": 1}}}',
     "scheduler.params.warmup_min_lr"),
])
def test_nan_infinite_and_negative_values_are_refused_as_such_not_as_disagreements(text, key):
    with pytest.raises(DeepSpeedConfigError) as info:
        TrainingConfig(deepspeed=text)
    assert (info.value.key, info.value.disagrees_with) == (key, None)  # no trainer value to blame
    assert len(str(info.value).splitlines()) == 1


def test_an_integral_float_equals_the_trainer_s_integer(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = TrainingConfig(deepspeed={"gradient_accumulation_steps": 4.0, "train_micro_batch_size_per_gpu": 8.0,
                                       "train_batch_size": 64.0}, gradient_accumulation_steps=4)
    assert config.gradient_accumulation_steps == 4
    with pytest.raises(DeepSpeedConfigError) as info:  # the control: a real disagreement is still one
        TrainingConfig(deepspeed={"gradient_accumulation_steps": 2.0}, gradient_accumulation_steps=4)
    assert info.value.disagrees_with == "gradient_accumulation_steps"


@pytest.mark.parametrize("overrides", [{"mixed_precision": "fp16"}, {"ddp_comm_hook": "bf16"},
                                       {"ddp_bucket_cap_mb": "auto"}])
def test_what_zero_cannot_run_with_is_refused_and_stage_0_still_runs_it(overrides):
    for stage in (1, 2):
        with pytest.raises(ValueError, match=next(iter(overrides))):
            TrainingConfig(deepspeed={"zero_optimization": {"stage": stage}}, **overrides)
    assert TrainingConfig(deepspeed={"zero_optimization": {"stage": 0}}, **overrides).zero_stage == 0


# --- Accelerate's variables: what accelerate launch hands the processes, and back --------------------------

def test_the_trainer_reads_accelerate_s_variables_as_accelerate_s_deepspeed_plugin_does(monkeypatch, tmp_path):
    plugin = pytest.importorskip("accelerate.utils").DeepSpeedPlugin
    env = {"ACCELERATE_USE_DEEPSPEED": "true", VARIABLES["zero_stage"]: "1",
           VARIABLES["gradient_accumulation_steps"]: "2", VARIABLES["gradient_clipping"]: "0.5"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ours, accelerate = accelerate_deepspeed_config()[0], plugin()
    assert (ours["zero_optimization"]["stage"], ours["gradient_accumulation_steps"], ours["gradient_clipping"]) == \
        (accelerate.zero_stage, accelerate.gradient_accumulation_steps, accelerate.gradient_clipping) == (1, 2, 0.5)
    config = TrainingConfig(gradient_accumulation_steps=2, max_grad_norm=0.5)
    assert config.zero_stage == 1
    with pytest.raises(DeepSpeedConfigError) as info:  # the trainer's own accumulation disagrees: refused
        TrainingConfig(gradient_accumulation_steps=4, max_grad_norm=0.5)
    assert info.value.key == "gradient_accumulation_steps"
    assert TrainingConfig(deepspeed={"zero_optimization": {"stage": 0}}).zero_stage == 0  # the field wins
    monkeypatch.delenv(VARIABLES["zero_stage"])
    assert TrainingConfig(gradient_accumulation_steps=2, max_grad_norm=0.5).zero_stage == plugin().zero_stage == 2


@pytest.mark.parametrize("name, value, key", [
    ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "4", "zero_optimization.stage"),
    ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu", "zero_optimization.offload_optimizer.device"),
    ("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true", "zero3_init_flag"),
    ("ACCELERATE_GRADIENT_CLIPPING", "lots", "gradient_clipping"),
])
def test_accelerate_s_variables_for_what_miniddp_lacks_are_refused(name, value, key):
    env = {"ACCELERATE_USE_DEEPSPEED": "true", name: value}
    with pytest.raises(DeepSpeedConfigError) as info:
        config, source = accelerate_deepspeed_config(env)
        TrainingConfig(deepspeed=config)
    assert info.value.key == key


BLOCK = {"zero_stage": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
         "offload_optimizer_device": "none", "offload_param_device": "none", "zero3_init_flag": False}


def test_a_yaml_block_becomes_accelerate_launch_s_variables_and_reads_back(tmp_path, monkeypatch):
    commands = pytest.importorskip("accelerate.commands.launch")
    import yaml
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    for block in (BLOCK, {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero3_init_flag": False}):
        (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "num_processes": 2,
                                                         "deepspeed_config": block}))
        args, defaults, _ = commands._validate_launch_command(
            commands.launch_command_parser().parse_args(["--config_file", str(tmp_path / "c.yaml"), "x.py"]))
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        theirs = {k: v for k, v in prepare_deepspeed_cmd_env(args)[1].items()
                  if k in VARIABLES.values() or k == "ACCELERATE_USE_DEEPSPEED"}
        ours = accelerate_variables(block, "c.yaml")
        assert ours == theirs  # Accelerate's launcher sets exactly these
        config, _ = accelerate_deepspeed_config(ours)
        assert config["zero_optimization"]["stage"] == block.get("zero_stage", 2)


# --- the command lines: one line, exit status 2, before anything starts ----------------------------------

@pytest.mark.parametrize("block, key", [
    ({"zero_stage": 4}, "deepspeed_config.zero_stage"),
    ({"zero_stage": 2, "offload_optimizer_device": "cpu"}, "deepspeed_config.offload_optimizer_device"),
    ({"zero_stage": 2, "offload_param_device": "nvme"}, "deepspeed_config.offload_param_device"),
    ({"zero_stage": 2, "zero3_init_flag": True}, "deepspeed_config.zero3_init_flag"),
    ({"zero_stage": 2, "deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock"},
     "deepspeed_config.deepspeed_moe_layer_cls_names"),
    ({"zero_stage": 2, "deepspeed_multinode_launcher": "pdsh"}, "deepspeed_config.deepspeed_multinode_launcher"),
    ({"deepspeed_config_file": "{ds}", "zero_stage": 2}, "deepspeed_config.zero_stage"),
    ({"deepspeed_config_file": "{ds}"}, "zero_optimization.offload_param.device"),  # the JSON's own key
    ({"gradient_accumulation_steps": 0}, "deepspeed_config.gradient_accumulation_steps"),
])
def test_the_launcher_refuses_what_miniddp_lacks_naming_the_key(block, key, tmp_path, capsys):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}')
    block = {k: str(tmp_path / "ds.json") if v == "{ds}" else v for k, v in block.items()}
    with pytest.raises(DeepSpeedConfigError) as info:
        accelerate_variables(block, "c.yaml")
    assert info.value.key == key
    (tmp_path / "c.yaml").write_text(json.dumps({"distributed_type": "DEEPSPEED", "deepspeed_config": block}))
    (tmp_path / "x.py").write_text("")
    assert launch(["launch", "--config_file", str(tmp_path / "c.yaml"), "--dry_run", str(tmp_path / "x.py")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and key.split(".")[-1] in err


def test_the_launcher_passes_the_block_on_and_refuses_it_elsewhere(tmp_path, capsys):
    (tmp_path / "x.py").write_text("")
    (tmp_path / "ds.yaml").write_text(json.dumps({"distributed_type": "DEEPSPEED", "num_processes": 2,
                                                  "use_cpu": True, "deepspeed_config": BLOCK}))
    assert launch(["launch", "--config_file", str(tmp_path / "ds.yaml"), "--dry_run", "-m", "miniddp.train",
                   "--output_dir", "o", "--max_grad_norm", "0.5"]) == 0
    line = capsys.readouterr().out
    assert "ACCELERATE_USE_DEEPSPEED=true" in line and f"{VARIABLES['zero_stage']}=1" in line
    assert line.split(" -m miniddp.train ")[1].split() == [  # the block's accumulation carried as the trainer's flag
        "--output_dir", "o", "--max_grad_norm", "0.5", "--use_cpu", "true", "--gradient_accumulation_steps", "2"]
    for case, argv in [({"distributed_type": "DEEPSPEED"}, ["--drop_in"]),  # the script would start DeepSpeed
                       ({"distributed_type": "MULTI_CPU", "deepspeed_config": BLOCK}, [])]:  # a block not read
        (tmp_path / "bad.yaml").write_text(json.dumps(case))
        assert launch(["launch", "--config_file", str(tmp_path / "bad.yaml"), *argv, "--dry_run",
                       str(tmp_path / "x.py")]) == 2
        assert len(capsys.readouterr().err.splitlines()) == 1


@pytest.mark.parametrize("text, key", [
    ('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}',
     "zero_optimization.offload_optimizer.device"),
    ('{"optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}', "optimizer.params.lr"),  # --learning_rate's 1e-3
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "ds.json"),  # nested past Python's recursion limit: the file named
])
def test_the_training_cli_refuses_a_bad_key_with_status_2_before_anything_starts(text, key, tmp_path, capsys,
                                                                                 monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # rank 0 speaks
    (tmp_path / "ds.json").write_text(text)
    with pytest.raises(SystemExit) as info:
        train_cli(["--output_dir", str(tmp_path / "out"), "--deepspeed", str(tmp_path / "ds.json")])
    assert info.value.code == 2 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and key in err


# --- the optimizer and scheduler blocks: Hugging Face's fill, DeepSpeed's schedules -----------------------------

ADAMW_AUTO = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
WARMUP_AUTO = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                              "warmup_num_steps": "auto"}}
DECAY_AUTO = {"type": "WarmupDecayLR", "params": {**WARMUP_AUTO["params"], "total_num_steps": "auto"}}
TRAINER = {"learning_rate": 3e-4, "weight_decay": 0.01, "max_steps": 6}


def _hugging_face(config: dict, args: dict):
    """Transformers' own fill (trainer_config_process, then _finalize) of ``config``: (the filled config, the dotted
    keys it finds mismatched). Its class needs deepspeed only to be built; Accelerate's base class reads the dict."""
    base = pytest.importorskip("accelerate.utils.deepspeed").HfDeepSpeedConfig
    hf = pytest.importorskip("transformers.integrations.deepspeed").HfTrainerDeepSpeedConfig
    names = ("is_auto", "fill_match", "fill_only", "trainer_config_process", "trainer_config_finalize")
    oracle = type("Oracle", (base,), {name: hf.__dict__[name] for name in names})(copy.deepcopy(config))
    oracle.mismatches = []
    hf_args = types.SimpleNamespace(  # TrainingArguments' defaults, where miniddp has no flag
        world_size=1, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, save_on_each_node=False, fp16=False,
        fp16_full_eval=False, bf16=False, bf16_full_eval=False, get_warmup_steps=lambda steps: 0,
        learning_rate=args["learning_rate"], weight_decay=args["weight_decay"])
    oracle.trainer_config_process(hf_args)
    with contextlib.suppress(ValueError):  # its refusal of the mismatches: they are listed
        oracle.trainer_config_finalize(hf_args, None, args["max_steps"])
    return oracle.config, [line.split()[2].split("=")[0] for line in oracle.mismatches]


@pytest.mark.parametrize("optimizer, scheduler", [
    (ADAMW_AUTO, WARMUP_AUTO),  # Hugging Face's ZeRO-2 and ZeRO-3 templates
    (ADAMW_AUTO, DECAY_AUTO),
    ({"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
     {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 1,
                                          "total_num_steps": 6}}),  # concrete, agreeing
    ({"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto", "eps": "auto", "weight_decay": "auto"}}, None),
    ({"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95], "eps": "auto", "weight_decay": "auto"}}, None),
    ({"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": 1e-6, "weight_decay": 0.0}}, None),
    (None, {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1}}),
    (None, {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": 100}}),
    (None, {"type": "WarmupDecayLR", "params": {**DECAY_AUTO["params"], "total_num_steps": 1000}}),
])
def test_auto_is_filled_and_a_disagreeing_value_refused_as_transformers_does(optimizer, scheduler):
    config = {"zero_optimization": {"stage": 2}, **({"optimizer": optimizer} if optimizer else {}),
              **({"scheduler": scheduler} if scheduler else {})}
    theirs, mismatched = _hugging_face(config, TRAINER)
    if mismatched:
        with pytest.raises(DeepSpeedConfigError) as info:
            TrainingConfig(deepspeed=config, **TRAINER)
        assert info.value.key in mismatched and info.value.disagrees_with is not None
        assert len(str(info.value).splitlines()) == 1
        return
    TrainingConfig(deepspeed=config, **TRAINER)
    ours = fill_blocks(config, "deepspeed", {**TRAINER})
    for block in ("optimizer", "scheduler"):
        if block in config:
            assert {k: ours[block][k] for k in theirs[block]["params"]} == theirs[block]["params"]


@pytest.mark.parametrize("block, key", [
    ({"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, "optimizer.type"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": "auto"}}}, "optimizer.type"),
    ({"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}, "optimizer.type"),  # DeepSpeed's torch.optim name
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "optimizer.params.adam_w_mode"),  # L2 Adam
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}}, "optimizer.params.momentum"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, "scheduler.type"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1, "warmup_type": "cosine"}}},
     "scheduler.params.warmup_type"),
    ({"scheduler": {"type": "WarmupLR", "params": {}}}, "scheduler.params.warmup_num_steps"),  # DeepSpeed's 1000
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1}}}, "scheduler.params.total_num_steps"),
])
def test_what_miniddp_cannot_reproduce_is_refused_naming_the_key(block, key, tmp_path, capsys):
    with pytest.raises(DeepSpeedConfigError) as info:
        TrainingConfig(deepspeed=block, max_steps=6)
    assert info.value.key == key and len(str(info.value).splitlines()) == 1
    if key == "scheduler.params.warmup_num_steps":
        return  # DeepSpeed's default disagrees with the trainer's value: the launcher does not know it
    (tmp_path / "ds.json").write_text(json.dumps(block))  # the rest, before any process starts
    with pytest.raises(DeepSpeedConfigError) as info:
        accelerate_variables({"deepspeed_config_file": str(tmp_path / "ds.json")}, "c.yaml")
    assert info.value.key == key


def test_adamw_and_adam_run_as_torch_s_adamw():
    for kind in ("AdamW", "adamw", "Adam"):
        TrainingConfig(deepspeed={"optimizer": {**ADAMW_AUTO, "type": kind}})
    TrainingConfig(deepspeed={"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})  # AdamW is AdamW


@pytest.mark.parametrize("scheduler, factors", [  # DeepSpeed's learning rates, step by step, from its formulas
    (WARMUP_AUTO, [0, 0, 1, 1, 1, 1]),  # warmup max(2, 1) steps, log(it + 1) / log(2); stepped after the step
    (DECAY_AUTO, [0, 0, 1, 1, 3 / 4, 2 / 4]),  # then (6 - it) / (6 - 2)
    ({"type": "WarmupLR", "params": {**WARMUP_AUTO["params"], "warmup_type": "linear"}}, [0, 0, 1 / 2, 1, 1, 1]),
    ({"type": "WarmupLR", "params": {**WARMUP_AUTO["params"], "warmup_min_lr": 1e-3}},
     [1e-3 / 3e-4 * x + (1 - x) for x in (1, 1, 0, 0, 0, 0)]),  # warmup_min_lr is honoured, as a factor of lr
])
def test_the_schedule_runs_deepspeed_s_learning_rates(scheduler, factors):
    schedule = read_blocks({"scheduler": scheduler}, "deepspeed", {**TRAINER, "world_size": None})
    assert [schedule.lr_lambda(3e-4, 6)(step) for step in range(6)] == pytest.approx(factors, abs=1e-12)
    with pytest.raises(DeepSpeedConfigError) as info:  # a run by epochs learns its number of steps in the Trainer
        read_blocks({"scheduler": {**DECAY_AUTO, "params": {**DECAY_AUTO["params"], "total_num_steps": 6}}},
                    "deepspeed", {**TRAINER, "max_steps": -1}).lr_lambda(3e-4, 7)
    assert info.value.key == "scheduler.params.total_num_steps"
