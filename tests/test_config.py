"""TrainingConfig: Hugging Face's names, validation that names the field, the effective batch."""

import dataclasses
import math

import pytest

from miniddp import TrainingConfig
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
    ("ddp_timeout", -5), ("ddp_bucket_cap_mb", 0), ("ddp_backend", "ncl"), ("mixed_precision", "fp8"),
    ("loss_normalization", "tokens"), ("model", "resnet"), ("save_total_limit", 0), ("dropout", 1.0),
    ("logging_steps", 0), ("max_grad_norm", -1), ("ddp_comm_hook", "powersgd"), ("ddp_comm_powersgd_rank", 0),
    ("ddp_comm_powersgd_start_iter", 1), ("gradient_checkpointing_kwargs", "{use_reentrant: true}"),
    ("gradient_checkpointing_kwargs", "[true]"), ("report_to", "wandb"),
])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainingConfig(**{field: value})


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
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1
