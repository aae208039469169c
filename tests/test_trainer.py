"""The trainer: same effective batch => same model (TRL's table), its limits, exact resume, the CLI."""

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from miniddp import Trainer, TrainingConfig
from miniddp.launching.spawn import RankError, run_on_ranks
from miniddp.training.checkpoint_format import CHECKPOINT_ERRORS, CorruptCheckpointError
from miniddp.training.checkpoint_timeline import checkpoints
from miniddp.training.tasks import make_task


def _train(rank, world_size, overrides, double=True):
    """Train the built-in task on this rank; rank 0 returns the final parameters and metrics."""
    cfg = TrainingConfig(**{"max_steps": 6, "dataset_size": 256, "eval_size": 0, "disable_tqdm": True,
                            "logging_steps": 2, "learning_rate": 0.01, **overrides})
    task = make_task(cfg)
    if double and cfg.model != "lm":  # float64: equalities below hold to 1e-10, not by luck
        features, labels = task["train_dataset"].tensors
        task.update(model=task["model"].double(), train_dataset=TensorDataset(features.double(), labels))
    trainer = Trainer(args=cfg, **task)
    metrics = trainer.train()
    if rank == 0:
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}, metrics
    return None


def _run(processes, per_device, accumulation, tmp_path, double=True, **overrides):
    out = str(tmp_path / f"run-{processes}-{per_device}-{accumulation}-{len(overrides)}")
    cfg = {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation,
           "output_dir": out, **overrides}
    return run_on_ranks(_train, processes, args=(cfg, double), init=False, timeout=120)[0]


def _max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# --8<-- [start:trl_table]
SPLITS = [(1, 4, 8), (2, 16, 1), (2, 4, 4), (4, 8, 1), (4, 4, 2), (8, 4, 1)]  # (processes, per-device, accum)


@pytest.fixture(scope="module")
def one_process_32(tmp_path_factory):
    return _run(1, 32, 1, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("processes, per_device, accumulation", SPLITS)
def test_same_effective_batch_trains_the_same_model(processes, per_device, accumulation, one_process_32, tmp_path):
    reference, metrics = one_process_32
    assert metrics["effective_batch_size"] == 32 and metrics["global_step"] == 6
    params, m = _run(processes, per_device, accumulation, tmp_path)
    assert m["world_size"] == processes and m["effective_batch_size"] == 32
    assert _max_diff(params, reference) < 1e-10
# --8<-- [end:trl_table]


def test_a_different_effective_batch_trains_a_different_model(one_process_32, tmp_path):
    reference, _ = one_process_32
    params, _ = _run(2, 8, 1, tmp_path)  # effective 16: the test can tell
    assert _max_diff(params, reference) > 1e-4


@pytest.mark.parametrize("what, overrides", [
    ("batchnorm", {"model": "bn"}),  # batch statistics depend on the per-device batch
    ("dropout", {"dropout": 0.2}),  # each rank draws its own dropout masks
    ("unequal_micro_batches", {"dataset_size": 250, "max_steps": 8}),  # a short last micro-batch, per_batch loss
])
def test_when_equivalence_breaks(what, overrides, tmp_path):
    split = (1, 4, 8) if what == "unequal_micro_batches" else (2, 16, 1)
    reference, _ = _run(1, 32, 1, tmp_path, **overrides)
    params, _ = _run(*split, tmp_path, **overrides)
    assert _max_diff(params, reference) > 1e-6, f"{what} was expected to break equivalence"


def test_num_items_in_batch_weights_a_short_micro_batch_by_its_size(tmp_path):
    # the last window of (1, 4, 8) on 250 samples has 6 micro-batches of 4 and one of 2: as a mean of
    # micro-batch means the 2 samples weigh twice as much (the case above); summed and divided by the
    # window's 26 items, every sample weighs the same, as in one batch of 26
    overrides = {"dataset_size": 250, "max_steps": 8, "loss_normalization": "global_tokens"}
    reference, _ = _run(1, 32, 1, tmp_path, **overrides)
    params, _ = _run(1, 4, 8, tmp_path, **overrides)
    assert _max_diff(params, reference) < 1e-10


LM_SPLITS = [(1, 16, 1), (1, 4, 4), (2, 8, 1), (2, 2, 4)]


@pytest.mark.parametrize("normalization, equal", [("global_tokens", True), ("per_batch", False)])
def test_only_global_token_normalisation_keeps_splits_equal_on_variable_lengths(normalization, equal, tmp_path):
    runs = [_run(*s, tmp_path, model="lm", loss_normalization=normalization, max_steps=4, dataset_size=128)[0]
            for s in LM_SPLITS]
    worst = max(_max_diff(r, runs[0]) for r in runs[1:])
    if equal:
        assert worst < 1e-5  # float32 model: sums in different orders
    else:
        assert worst > 1e-4  # per-micro-batch means weight short sequences' tokens more


# --8<-- [start:resume]
def test_resume_is_bitwise_exact(tmp_path):
    common = dict(max_steps=8, logging_steps=3, double=False)  # a save at step 4 falls between two logs
    straight, done = _run(2, 8, 2, tmp_path, save_steps=4, output_dir=str(tmp_path / "a"), **common)
    half = tmp_path / "a" / "checkpoint-4"
    assert half.is_dir()
    resumed, metrics = _run(2, 8, 2, tmp_path, resume_from_checkpoint=str(half), output_dir=str(tmp_path / "b"),
                            **common)
    assert metrics["global_step"] == 8 and metrics["train_loss"] == done["train_loss"]
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
# --8<-- [end:resume]


def test_checkpoints_rotate_and_the_final_model_loads_with_weights_only(tmp_path):
    out = tmp_path / "rot"
    _run(2, 8, 1, tmp_path, max_steps=8, save_steps=2, save_total_limit=2, output_dir=str(out))
    assert [p.name for p in checkpoints(out)] == ["checkpoint-6", "checkpoint-8"]
    state = torch.load(out / "final_model.pt", weights_only=True)
    assert "head.weight" in state
    assert not list(out.glob(".checkpoint-*"))  # no temporary directories left behind


@pytest.mark.parametrize("damage", ["truncate", "no_manifest"])
def test_a_corrupt_checkpoint_is_refused(damage, tmp_path):
    out = tmp_path / "src"
    _run(1, 8, 1, tmp_path, max_steps=4, save_steps=2, output_dir=str(out))
    ckpt = out / "checkpoint-2"
    if damage == "truncate":
        data = (ckpt / "optimizer.pt").read_bytes()
        (ckpt / "optimizer.pt").write_bytes(data[: len(data) // 2])
    else:
        (ckpt / "manifest.json").unlink()
    with pytest.raises(RankError) as info:
        _run(1, 8, 1, tmp_path, max_steps=4, resume_from_checkpoint=str(ckpt), output_dir=str(tmp_path / "x"))
    assert isinstance(info.value.__cause__, CorruptCheckpointError)
    assert ("optimizer.pt" in str(info.value)) if damage == "truncate" else ("incomplete" in str(info.value))


def _crash_mid_save(rank, world_size, out):
    import miniddp.training.checkpoint_format as ck

    cfg = {"max_steps": 4, "save_steps": 2, "output_dir": out, "per_device_train_batch_size": 8}
    real_save = ck.atomic_save

    def flaky(obj, path):
        if "checkpoint-4" in str(path) and str(path).endswith("optimizer.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, path)

    ck.atomic_save = flaky  # the checkpoint module's writer, in this rank's process only
    try:
        _train(rank, world_size, cfg)
    except OSError:
        return "crashed"


def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    out = tmp_path / "crash"
    assert run_on_ranks(_crash_mid_save, 1, args=(str(out),), init=False, timeout=60) == ["crashed"]
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2"]
    assert not (out / "checkpoint-4").exists()
    params, metrics = _run(1, 8, 1, tmp_path, max_steps=4, resume_from_checkpoint="latest", output_dir=str(out))
    assert metrics["global_step"] == 4


def test_default_settings_reach_the_stated_accuracy(tmp_path):
    # the README's command: 2 processes, every other setting at its default
    _, metrics = run_on_ranks(_train, 2, args=({"output_dir": str(tmp_path), "max_steps": -1, "dataset_size": 2048,
                                                "eval_size": 512, "learning_rate": 1e-3, "logging_steps": 10},
                                               False), init=False, timeout=180)[0]
    assert metrics["global_step"] == 384 and metrics["eval_accuracy"] >= 0.90, metrics


def test_gradient_checkpointing_changes_memory_not_results(tmp_path):
    plain, _ = _run(2, 16, 1, tmp_path)
    checkpointed, _ = _run(2, 16, 1, tmp_path, gradient_checkpointing=True)
    assert _max_diff(plain, checkpointed) < 1e-10
    reentrant, _ = _run(2, 16, 1, tmp_path, gradient_checkpointing=True, ddp_static_graph=True,
                        gradient_checkpointing_kwargs={"use_reentrant": True})
    assert _max_diff(plain, reentrant) < 1e-10


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision, tmp_path):
    params, metrics = _run(2, 16, 1, tmp_path, double=False, mixed_precision=precision, max_steps=40,
                           eval_size=256, learning_rate=3e-3)
    assert metrics["eval_accuracy"] > 0.6  # 4 classes: chance is 0.25
    full, _ = _run(2, 16, 1, tmp_path, double=False, max_steps=40, eval_size=256, learning_rate=3e-3)
    assert 0 < _max_diff(params, full) < 0.1  # lower precision: close to, not equal to, fp32


def test_a_short_last_window_is_still_an_average(tmp_path):
    # 80 samples in micro-batches of 8 with accumulation 4: windows of 4, 4 and 2 micro-batches.
    # Dividing the last window by its real length (2), not by 4, makes it the mean of its 16 samples,
    # exactly what one process with batches of 32, 32 and 16 computes.
    reference, _ = _run(1, 32, 1, tmp_path, dataset_size=80, max_steps=3)
    params, _ = _run(1, 8, 4, tmp_path, dataset_size=80, max_steps=3)
    assert _max_diff(params, reference) < 1e-10


def _resume_from(rank, world_size, out, paths):
    cfg = TrainingConfig(output_dir=out, max_steps=4, dataset_size=64, eval_size=0, disable_tqdm=True)
    trainer = Trainer(args=cfg, **make_task(cfg))
    try:
        trainer.train(resume_from_checkpoint=paths[rank])
    except CHECKPOINT_ERRORS as err:
        return str(err)
    return "trained"


def test_a_checkpoint_one_rank_cannot_load_stops_every_rank_with_its_message(tmp_path):
    _run(2, 8, 1, tmp_path, max_steps=2, save_steps=2, output_dir=str(tmp_path / "src"))
    paths = [str(tmp_path / "src" / "checkpoint-2"), str(tmp_path / "nowhere")]  # rank 0 could load its own
    said = run_on_ranks(_resume_from, 2, args=(str(tmp_path / "x"), paths), init=False, timeout=60)
    assert said[0] == f"rank 1: {said[1]}" and said[1].endswith("nowhere does not exist")


def _cli(rank, world_size, argv):
    """``miniddp-train argv`` in this rank's process: (exit status, stdout, stderr)."""
    from miniddp.training.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            status = 0
        except SystemExit as stop:
            status = stop.code
    return status, out.getvalue(), err.getvalue()


def _cli_on_one_rank(argv):
    return run_on_ranks(_cli, 1, args=(argv,), init=False, timeout=60)[0]


def test_the_cli_says_where_the_results_went(tmp_path):
    out = str(tmp_path / "out")
    status, stdout, _ = _cli_on_one_rank(["--output_dir", out, "--max_steps", "2", "--dataset_size", "64",
                                          "--eval_size", "0", "--disable_tqdm", "true"])
    assert status == 0
    assert stdout.splitlines()[-1] == f"results: {out}/metrics.json, {out}/final_model.pt"


@pytest.mark.parametrize("problem", ["nccl_on_cpu", "missing", "empty", "output_dir"])
def test_a_job_that_cannot_start_says_why_in_one_line_and_exits_3(problem, tmp_path):
    if problem == "nccl_on_cpu" and torch.cuda.is_available():
        pytest.skip("nccl runs on this machine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-2" / "manifest.json").write_text("{}")  # counted as complete
    flags, says = {
        "nccl_on_cpu": (["--ddp_backend", "nccl"], "ddp_backend='nccl' needs CUDA tensors"),
        "missing": (["--resume_from_checkpoint", str(tmp_path / "nowhere")], "nowhere does not exist"),
        "empty": (["--resume_from_checkpoint", str(tmp_path / "empty")], "empty holds no checkpoint"),
        "output_dir": (["--resume_from_checkpoint", str(tmp_path / "out")],
                       f"holds checkpoints, not one: pass {tmp_path}/out/checkpoint-2"),
    }[problem]
    status, _, stderr = _cli_on_one_rank(["--output_dir", str(tmp_path / "o"), "--disable_tqdm", "true", *flags])
    assert status == 3
    assert stderr.startswith("miniddp-train: error: ") and says in stderr and len(stderr.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl runs on this machine")
def test_under_torchrun_the_error_is_said_once_and_is_torchrun_s_root_cause(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "miniddp.train", "--output_dir", str(tmp_path), "--ddp_backend", "nccl"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1  # torchrun's own status when a worker fails
    assert run.stderr.count("miniddp-train: error: ddp_backend='nccl' needs CUDA tensors") == 1
    root_cause = run.stderr.split("Root Cause")[1]
    assert "exitcode  : 3" in root_cause and "traceback : miniddp-train: ddp_backend='nccl'" in root_cause
