"""TrainingConfig: Hugging Face's names, validation that names the field, the effective batch."""

import contextlib
import dataclasses
import importlib.util
import inspect
import io
import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch.utils.checkpoint

from miniddp import TrainingConfig
from miniddp.launching.spawn import run_on_ranks
from miniddp.training import config_checks
from miniddp.training.cli import build_parser, parse_config
from miniddp.training.config import choices, field_help


def test_defaults_match_hugging_face_where_it_matters():
    c = TrainingConfig()
    assert c.ddp_timeout == 1800 and c.gradient_accumulation_steps == 1 and c.mixed_precision == "no"
    assert c.ddp_bucket_cap_mb is None and c.ddp_broadcast_buffers is True and c.max_steps == -1


@pytest.mark.parametrize("per_device, world, accumulation, effective", [
    (32, 1, 1, 32), (4, 1, 8, 32), (16, 2, 1, 32), (4, 2, 4, 32), (8, 4, 1, 32), (4, 4, 2, 32), (4, 8, 1, 32),
])
def test_effective_batch_is_the_product(per_device, world, accumulation, effective):
    c = TrainingConfig(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation)
    assert c.effective_batch_size(world) == effective


@pytest.mark.parametrize("field, value", [
    ("per_device_train_batch_size", 0), ("per_device_train_batch_size", 2.5), ("gradient_accumulation_steps", 0),
    ("learning_rate", 0), ("learning_rate", math.nan), ("max_steps", 0), ("ddp_timeout", 0),
    ("ddp_timeout", -5), ("ddp_bucket_cap_mb", 0), ("ddp_bucket_cap_mb", 1e308), ("ddp_backend", "ncl"),
    ("mixed_precision", "fp8"),
    ("loss_normalization", "tokens"), ("model", "resnet"), ("save_total_limit", 0), ("dropout", 1.0),
    ("logging_steps", 0), ("max_grad_norm", -1), ("ddp_comm_hook", "powersgd"), ("ddp_comm_powersgd_rank", 0),
    ("ddp_comm_powersgd_start_iter", 1), ("gradient_checkpointing_kwargs", "{use_reentrant: true}"),
    ("gradient_checkpointing_kwargs", "[true]"), ("report_to", "wandb"),
    # accepted once, then a traceback at the first step, the first save, or metrics.json; or silently wrong
    ("torch_compile_backend", "nonexistent"), ("torch_compile_backend", ""), ("torch_compile_backend", 3),
    ("gradient_checkpointing_kwargs", '{"nope": 1}'), ("gradient_checkpointing_kwargs", '{"determinism_check": "x"}'),
    ("gradient_checkpointing_kwargs", '{"use_reentrant": "yes"}'), ("gradient_checkpointing_kwargs", '{"debug": 1}'),
    ("gradient_checkpointing_kwargs", '{"use_reentrant": null}'), ("gradient_checkpointing_kwargs", {"early_stop": 0}),
    ("gradient_checkpointing_kwargs", '{"context_fn": "noop_context_fn"}'),
    ("gradient_checkpointing_kwargs", '{"use_reentrant": true, "debug": true}'),
    ("ddp_timeout", 1e308), ("save_total_limit", 1.5), ("save_total_limit", True), ("max_steps", True),
    ("learning_rate", "1e-3"), ("num_train_epochs", "3"), ("dropout", "0.1"), ("use_cpu", "false"),
    ("gradient_checkpointing", "false"), ("ddp_broadcast_buffers", 0), ("output_dir", None), ("output_dir", 3),
    ("resume_from_checkpoint", True),
])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainingConfig(**{field: value})


def test_a_key_written_twice_is_refused_by_name_not_resolved_to_the_last():
    with pytest.raises(ValueError, match="'use_reentrant' twice"):
        TrainingConfig(gradient_checkpointing_kwargs='{"use_reentrant": true, "use_reentrant": false}')


def test_every_keyword_of_torch_s_checkpoint_is_accepted_with_its_type():
    taken = {p.name for p in inspect.signature(torch.utils.checkpoint.checkpoint).parameters.values()
             if p.kind == p.KEYWORD_ONLY}
    assert set(config_checks.checkpoint_keywords()) == taken | {"preserve_rng_state"}  # read from **kwargs
    assert config_checks.DETERMINISM_CHECKS == tuple(torch.utils.checkpoint._allowed_determinism_checks_to_fns)
    given = {"use_reentrant": False, "preserve_rng_state": False, "determinism_check": "none", "debug": True,
             "early_stop": False}
    assert TrainingConfig(gradient_checkpointing_kwargs=json.dumps(given)).gradient_checkpointing_kwargs == given
    context = {"use_reentrant": False, "context_fn": torch.utils.checkpoint.noop_context_fn}  # in Python only
    assert TrainingConfig(gradient_checkpointing_kwargs=context).gradient_checkpointing_kwargs == context


def test_common_compile_backends_are_accepted_without_asking_dynamo(monkeypatch):
    import torch._dynamo  # noqa: PLC0415 - the oracle; the config itself imports it only for other names

    assert set(config_checks.COMMON_BACKENDS) <= set(torch._dynamo.list_backends(exclude_tags=()))
    monkeypatch.setattr(config_checks, "torch_compile_backends", lambda **_: pytest.fail("imported dynamo"))
    for name in config_checks.COMMON_BACKENDS:
        assert TrainingConfig(torch_compile_backend=name).torch_compile  # the backend implies torch_compile


def test_an_unknown_compile_backend_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="torch_compile_backend") as info:
        TrainingConfig(torch_compile_backend="inductr")
    assert "inductor" in str(info.value) and "aot_eager" in str(info.value)


def _cli(rank, world_size, argv):
    """miniddp-train's exit status and what it printed."""
    from miniddp.training.cli import main  # noqa: PLC0415

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        try:
            main(argv)
        except SystemExit as exit_:
            return exit_.code, said.getvalue()
    return 0, said.getvalue()


@pytest.mark.skipif(importlib.util.find_spec("tvm") is not None, reason="tvm is installed: its backend runs")
def test_a_registered_backend_without_its_package_is_one_line_at_the_first_forward(tmp_path):
    # torch registers tvm whether or not it is installed, and says so only when the first forward compiles
    argv = ["--output_dir", str(tmp_path), "--torch_compile_backend", "tvm", "--max_steps", "1",
            "--dataset_size", "16", "--eval_size", "0", "--disable_tqdm", "true"]
    code, said = run_on_ranks(_cli, 1, args=(argv,), init=False, timeout=180)[0]
    assert code == 3 and len(said.strip().splitlines()) == 1  # the job cannot start
    assert "--torch_compile_backend tvm" in said and "Traceback" not in said


def test_a_path_and_a_timedelta_become_what_metrics_json_records(tmp_path):
    c = TrainingConfig(output_dir=tmp_path, resume_from_checkpoint=tmp_path / "checkpoint-2",
                       ddp_timeout=timedelta(minutes=1))
    assert (c.output_dir, c.resume_from_checkpoint, c.ddp_timeout) == (str(tmp_path), str(tmp_path / "checkpoint-2"),
                                                                        60)
    json.dumps(c.to_dict())  # the trainer writes it into metrics.json after the last step
    assert isinstance(TrainingConfig(output_dir=Path("out")).output_dir, str)


@pytest.mark.parametrize("flag", ["ddp_find_unused_parameters", "ddp_broadcast_buffers"])
def test_gradient_checkpointing_conflicts_are_refused(flag):
    with pytest.raises(ValueError, match=flag):
        TrainingConfig(gradient_checkpointing=True, model="bn", **{flag: True})


def test_gradient_checkpointing_alone_is_fine():
    assert TrainingConfig(gradient_checkpointing=True).gradient_checkpointing


def test_checkpointing_keywords_come_as_json_or_a_dict():
    assert TrainingConfig(gradient_checkpointing_kwargs='{"use_reentrant": true}').gradient_checkpointing_kwargs \
        == {"use_reentrant": True}
    assert TrainingConfig(gradient_checkpointing_kwargs={"use_reentrant": False}).gradient_checkpointing_kwargs \
        == {"use_reentrant": False}


def test_every_field_is_a_cli_flag():
    flags = {a.dest for a in build_parser()._actions}
    assert set(TrainingConfig.field_names()) <= flags


def test_every_field_has_its_help_in_its_metadata():
    # as TrainingArguments: field(default=..., metadata={"help": ...}); --help reads it, not the source
    for f in dataclasses.fields(TrainingConfig):
        text = f.metadata.get("help")
        assert isinstance(text, str) and text.strip(), f"{f.name} has no metadata['help']"
        assert field_help()[f.name] == text


def test_help_describes_every_flag_with_its_choices_and_shows_torchrun():
    parser = build_parser()
    assert set(field_help()) == set(TrainingConfig.field_names())  # every field has its comment
    for action in parser._actions[1:]:  # after --help
        assert action.help.startswith(field_help()[action.dest]), action.dest
    text = parser.format_help()
    assert "_BOOL" not in text and "--ddp_broadcast_buffers {true,false}" in text
    for name, allowed in choices().items():
        assert f"--{name} {{{','.join(allowed)}}}" in text
    assert "torchrun --standalone --nproc-per-node 2 -m miniddp.train --output_dir out" in text
    assert "exit status: 0 done, 2 bad flag or value, 3 the job could not start" in text


@pytest.mark.parametrize("typo, meant", [
    ("--learning_rat", "--learning_rate"), ("--ddp_bucket_cap", "--ddp_bucket_cap_mb"),
    ("--gradient-accumulation-steps", "--gradient_accumulation_steps"),
])
def test_a_misspelt_flag_suggests_the_right_one(typo, meant, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config([typo, "1"])  # not accepted as an abbreviation either
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"(did you mean {meant}?)")


def test_cli_parses_types_and_none():
    c = parse_config(["--per_device_train_batch_size", "4", "--ddp_bucket_cap_mb", "none",
                      "--ddp_broadcast_buffers", "false", "--learning_rate", "3e-4", "--save_total_limit", "2"])
    assert (c.per_device_train_batch_size, c.ddp_bucket_cap_mb, c.ddp_broadcast_buffers) == (4, None, False)
    assert c.learning_rate == 3e-4 and c.save_total_limit == 2


@pytest.mark.parametrize("argv, named", [
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
    (["--per_device_train_batch_size", "two"], "--per_device_train_batch_size"),
    (["--ddp_broadcast_buffers", "maybe"], "--ddp_broadcast_buffers"),
    (["--ddp_timeout", "-1"], "--ddp_timeout"),
    (["--no_such_flag", "1"], "--no_such_flag"),
    (["--model", "resnet"], "--model"),
    (["--torch_compile_backend", "nonexistent"], "--torch_compile_backend"),
    (["--torch_compile_backend", ""], "--torch_compile_backend"),
    (["--gradient_checkpointing_kwargs", '{"nope": 1}'], "--gradient_checkpointing_kwargs"),
    (["--gradient_checkpointing_kwargs", '{"determinism_check": "bogus"}'], "--gradient_checkpointing_kwargs"),
    (["--gradient_checkpointing_kwargs", '{"use_reentrant": "yes"}'], "--gradient_checkpointing_kwargs"),
    (["--gradient_checkpointing_kwargs", '{"use_reentrant": true, "use_reentrant": false}'], "'use_reentrant'"),
    (["--ddp_timeout", "1e308"], "--ddp_timeout"),
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1
