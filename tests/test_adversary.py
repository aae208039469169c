"""The adversary's list: a hang, lost or wrong files, silent divergences, a metric that was not what
trained, silent waits, dropped settings and tracebacks where one line is promised.

Each test reproduces one finding as a careless or malicious user met it, and holds miniddp to a
clear error naming the field and the fix, a warning, or the right result. Numbered as the list."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import TensorDataset

import miniddp
from miniddp import Trainer, TrainingConfig
from miniddp.launching.accelerate_config import LaunchError, ignored_settings, read_config
from miniddp.launching.launch import main as launch_main
from miniddp.launching.spawn import run_on_ranks
from miniddp.launching.torchrun_args import script_env, torchrun_args
from miniddp.training.checkpoint_timeline import MANIFEST, checkpoints
from miniddp.training.cli import main as train_main
from miniddp.training.output_dir import LOCK, OutputDirError, claim_output_dir
from miniddp.training.tasks import make_task

from models import MODELS

BIN = Path(sys.executable).parent
SMALL = dict(dataset_size=64, eval_size=0, per_device_train_batch_size=8, disable_tqdm=True, logging_steps=1)


def _built_in(rank, world_size, out, overrides, outcome=False):
    """Train the built-in task; with ``outcome``, the error's type name and text instead of raising."""
    cfg = TrainingConfig(**{**SMALL, **overrides}, output_dir=str(out))
    try:
        return Trainer(args=cfg, **make_task(cfg)).train()
    except Exception as err:  # noqa: BLE001 - the test inspects what was raised
        if not outcome:
            raise
        return type(err).__name__, str(err)


def _regression(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _mse(outputs, labels, num_items_in_batch):
    return ((outputs - labels) ** 2).sum() / num_items_in_batch


# --- 1. a hang: an empty dataset --------------------------------------------------------------------

def _empty(rank, world_size, out, max_steps):
    data = TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1))
    try:
        Trainer(model=torch.nn.Linear(4, 1), args=TrainingConfig(output_dir=str(out), max_steps=max_steps,
                                                                 disable_tqdm=True),
                train_dataset=data, compute_loss_func=_mse)
    except ValueError as err:
        return str(err)


@pytest.mark.parametrize("max_steps", [5, -1])
def test_1_an_empty_dataset_is_refused_at_once_not_spun_on(max_steps, tmp_path):
    # before: max_steps=5 spun at 100% CPU for ever (no collective, no timeout); -1: ZeroDivisionError
    [message] = run_on_ranks(_empty, 1, args=(tmp_path / "out", max_steps), init=False, timeout=60)
    assert message is not None and "train_dataset is empty" in message


# --- 2. resuming an earlier checkpoint: the later ones are another timeline -------------------------

def _two_timelines(rank, world_size, out):
    a = dict(max_steps=10, save_steps=2)
    _built_in(rank, world_size, out, a)
    b = dict(max_steps=7, save_steps=2, save_total_limit=2, learning_rate=5e-4, resume_allow_changes=True)
    first = _built_in(rank, world_size, out, {**b, "resume_from_checkpoint": str(out / "checkpoint-4")})
    after_b = [p.name for p in checkpoints(out)]
    again = _built_in(rank, world_size, out, {**b, "resume_from_checkpoint": "latest"})  # rerun after a crash
    nan = _built_in(rank, world_size, out, {"max_steps": 10, "save_steps": 2, "learning_rate": 1e20,
                                            "resume_allow_changes": True,
                                            "resume_from_checkpoint": str(out / "checkpoint-4")}, outcome=True)
    resumed = next(e for e in first["log_history"] if e["step"] == 5)  # B's first step after checkpoint-4
    return first["global_step"], resumed, again["global_step"], after_b, nan


def test_2_resuming_an_earlier_checkpoint_sets_the_later_timeline_aside(tmp_path):
    out = tmp_path / "out"
    (b, logged, again, after_b, nan), _ = run_on_ranks(_two_timelines, 2, args=(out,), init=False, timeout=180)
    assert b == 7 and again == 7  # before: `latest` resumed A's checkpoint-10 and reported step 10 of 7
    # and B's own learning rate applies (before: the checkpoint's optimizer state kept A's 1e-3, said nothing)
    assert logged["step"] == 5 and logged["lr"] == pytest.approx(5e-4 * (1 - 5 / 7))
    assert after_b == ["checkpoint-4", "checkpoint-6"]  # B's own checkpoint-6 kept (rotation deleted it)
    aside = {folder.name: sorted(p.name for p in folder.iterdir()) for folder in (out / "superseded").iterdir()}
    a_timeline = ["checkpoint-10", "checkpoint-6", "checkpoint-8", "final_model.pt", "metrics.json"]
    assert any(name.startswith("after-checkpoint-4-") and files == a_timeline for name, files in aside.items()), aside
    # (A's, moved when B resumed checkpoint-4: not lost; the later resumes set B's results aside too)
    kind, message = nan  # resumed checkpoint-4 again; lr 1e30 diverges at the step after it
    assert kind == "NonFiniteLossError" and f"Last checkpoint: {out / 'checkpoint-4'}." in message, message


def _past_max_steps(rank, world_size, out):
    _built_in(rank, world_size, out, {"max_steps": 4, "save_steps": 4})
    return _built_in(rank, world_size, out, {"max_steps": 3, "resume_allow_changes": True,
                                             "resume_from_checkpoint": "latest"}, outcome=True)


def test_2_a_checkpoint_past_max_steps_is_refused(tmp_path):
    [(kind, message)] = run_on_ranks(_past_max_steps, 1, args=(tmp_path / "out",), init=False, timeout=90)
    assert kind == "SetupChangedError" and "past max_steps=3" in message


# --- 3 and 4. the lock file, and what overwrite_output_dir may delete --------------------------------

def test_3_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("do not truncate me")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).symlink_to(precious)
    with pytest.raises(OutputDirError, match="symbolic link"):
        claim_output_dir(out, resuming=False, overwrite=False, need_bytes=0)
    assert precious.read_text() == "do not truncate me"
    (out / LOCK).unlink()
    os.link(precious, out / LOCK)  # a hard link would be truncated just the same
    with pytest.raises(OutputDirError, match="hard link"):
        claim_output_dir(out, resuming=False, overwrite=False, need_bytes=0)
    assert precious.read_text() == "do not truncate me"


@pytest.mark.parametrize("content, holder_pid", [("[1]", None), ("\x00\xff garbage", None), ('{"pid": 1}', 1)])
def test_3_a_lock_file_holding_anything_is_taken_over(tmp_path, content, holder_pid):
    (tmp_path / LOCK).write_text(content)  # a dead run's lock, or a file that only has the lock's name
    lock = claim_output_dir(tmp_path, resuming=False, overwrite=False, need_bytes=0)
    # the previous holder is named when the file says who it was, "unknown" otherwise; never "" (a fresh lock)
    assert lock.previous == ("unknown" if holder_pid is None else f"pid {holder_pid} on ?, started ?")
    held = json.loads((tmp_path / LOCK).read_text())  # the file now says this run holds it
    assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())
    with pytest.raises(OutputDirError, match="in use by another run"):  # and the flock is really held
        claim_output_dir(tmp_path, resuming=False, overwrite=False, need_bytes=0)
    lock.release()
    assert (tmp_path / LOCK).read_bytes() == b""  # a clean end: nobody for the next run to take over from


def test_4_overwrite_deletes_only_miniddp_s_own_results(tmp_path):
    for name in ("checkpoint-3", "checkpoint-best", "checkpoint-3-notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "final_model.pt").write_bytes(b"x")
    claim_output_dir(tmp_path, resuming=False, overwrite=True, need_bytes=0).release()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK) == ["checkpoint-3-notes", "checkpoint-best"]
    claim_output_dir(tmp_path, resuming=False, overwrite=False, need_bytes=0).release()  # not another run's


# --- 5. wrapping one module twice -------------------------------------------------------------------

def _wrapped_twice(rank, world_size):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    first = miniddp.DistributedDataParallel(model)
    second = miniddp.DistributedDataParallel(model)  # a notebook cell run again, or a second Trainer
    x, y = torch.randn(4, 8) + rank, torch.randn(4, 4)
    try:
        first(x)
        refused = None
    except miniddp.WrappedAgainError:
        refused = "WrappedAgainError"
    F.mse_loss(second(x), y).backward()  # the newer wrapper works: gradients are averaged
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    total = g.clone()
    dist.all_reduce(total)
    return refused, torch.allclose(g * world_size, total, atol=1e-6)


def test_5_the_older_of_two_wrappers_refuses_instead_of_diverging():
    assert run_on_ranks(_wrapped_twice, 2, timeout=60) == [("WrappedAgainError", True)] * 2


# --- 6. optimizer.step() inside no_sync --------------------------------------------------------------

def _step_inside_no_sync(rank, world_size, ours, wrong):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    ddp = miniddp.DistributedDataParallel(model) if ours else TorchDDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = torch.randn(4, 8) + rank, torch.randn(4, 4)
            if step % 2 == 0:
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
                if wrong:
                    opt.step()  # the bug: a step on this rank's local gradients
            else:
                F.mse_loss(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(copies, flat)
    said = [str(w.message) for w in caught if "no_sync() accumulation window" in str(w.message)]
    return len(said), torch.equal(copies[0], copies[1])


def test_6_a_step_inside_no_sync_is_warned_once_torch_stays_silent():
    assert run_on_ranks(_step_inside_no_sync, 2, args=(True, True), timeout=60) == [(1, False)] * 2
    assert run_on_ranks(_step_inside_no_sync, 2, args=(True, False), timeout=60) == [(0, True)] * 2
    assert run_on_ranks(_step_inside_no_sync, 2, args=(False, True), timeout=60) == [(0, False)] * 2  # torch


# --- 7. ShardSampler with a seed per rank -------------------------------------------------------------

def _sampler_seeds(rank, world_size, seeds, alone):
    from miniddp.data import sharding

    sharding.AGREE_TIMEOUT_S = 1.0
    sampler = miniddp.ShardSampler(range(20), seed=seeds[rank])
    if alone and rank != 0:
        return "did not iterate"
    try:
        return sorted(sampler)
    except ValueError as err:
        return str(err)


def test_7_samplers_that_disagree_across_ranks_are_refused_on_every_rank():
    said = run_on_ranks(_sampler_seeds, 2, args=((0, 1), False), timeout=60)
    assert all("seed differs across ranks" in s and "rank 0 0, rank 1 1" in s for s in said), said
    mine, theirs = run_on_ranks(_sampler_seeds, 2, args=((7, 7), False), timeout=60)
    assert sorted(mine + theirs) == list(range(20))  # the same seed: a partition
    alone, _ = run_on_ranks(_sampler_seeds, 2, args=((0, 1), True), timeout=60)  # nobody to compare with
    assert len(alone) == 10  # it went on after the agreement wait, unchecked: no hang


# --- 8. effective_batch_size: what a step consumed --------------------------------------------------

def _effective(rank, world_size, out):
    return [_built_in(rank, world_size, out / str(k), dict(dataset_size=n, gradient_accumulation_steps=acc,
                                                           max_steps=2))["effective_batch_size"]
            for k, (n, acc) in enumerate([(16, 4), (16, 1_000_000_000), (256, 4)])]


def test_8_effective_batch_size_is_what_a_step_trained_on(tmp_path):
    got, _ = run_on_ranks(_effective, 2, args=(tmp_path,), init=False, timeout=120)
    assert got == [16, 16, 64]  # before: 64 and 8,000,000,000 for the first two


# --- 11. BatchNorm and a last micro-batch of one sample ------------------------------------------------

def test_11_a_batchnorm_model_with_a_one_sample_micro_batch_is_refused_at_start(tmp_path):
    # 2 ranks x 17 samples, micro-batches of 8: every epoch ends with a micro-batch of 1 on each rank
    flags = dict(model="bn", dataset_size=34, max_steps=3)
    said = run_on_ranks(_built_in, 2, args=(tmp_path / "a", flags, True), init=False, timeout=90)
    assert all(kind == "ValueError" and "dataloader_drop_last=True" in m for kind, m in said), said
    done = run_on_ranks(_built_in, 2, args=(tmp_path / "b", {**flags, "dataloader_drop_last": True}), init=False,
                        timeout=90)
    assert done[0]["global_step"] == 3 and done[0]["effective_batch_size"] == 16


# --- 12. a damaged manifest, or a wrong model.pt behind a regenerated one -----------------------------

def _damage(path: Path, how: str) -> None:
    manifest = path / MANIFEST
    files = json.loads(manifest.read_text())["files"]
    if how == "invalid json":
        manifest.write_text("{not json")
    elif how == "empty":
        manifest.write_text("")
    elif how == "a directory":
        manifest.unlink()
        manifest.mkdir()
    elif how == "a list":
        manifest.write_text("[1, 2]")
    elif how == "no files":
        manifest.write_text(json.dumps({"step": 4}))
    elif how == "no trainer_state":
        (path / "trainer_state.pt").unlink()
        files.pop("trainer_state.pt")
        manifest.write_text(json.dumps({"step": 4, "files": files}))
    elif how == "wrong model.pt":  # a model of another shape, and a manifest regenerated to match it
        torch.save({"weight": torch.zeros(3, 3)}, path / "model.pt")
        data = (path / "model.pt").read_bytes()
        files["model.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest.write_text(json.dumps({"step": 4, "files": files}))


DAMAGE = ["invalid json", "empty", "a directory", "a list", "no files", "no trainer_state", "wrong model.pt"]


def _resume_damaged(rank, world_size, out):
    _built_in(rank, world_size, out, {"max_steps": 4, "save_steps": 4})
    said = []
    for how in DAMAGE:
        damaged = out.parent / how.replace(" ", "_") / "checkpoint-4"
        shutil.copytree(out / "checkpoint-4", damaged)
        _damage(damaged, how)
        said.append(_built_in(rank, world_size, damaged.parent, {"max_steps": 5, "resume_allow_changes": True,
                                                                  "resume_from_checkpoint": str(damaged)}, True))
    return said


def test_12_a_damaged_checkpoint_is_one_clear_error_however_it_was_damaged(tmp_path):
    [said] = run_on_ranks(_resume_damaged, 1, args=(tmp_path / "out",), init=False, timeout=120)
    for how, (kind, message) in zip(DAMAGE, said):
        assert kind == "CorruptCheckpointError", (how, kind, message)


def _latest_with_a_damaged_newest(rank, world_size, out):
    _built_in(rank, world_size, out, {"max_steps": 4, "save_steps": 2})
    (out / "checkpoint-4" / "model.pt").write_bytes(b"damaged")
    return _built_in(rank, world_size, out, {"max_steps": 6, "resume_from_checkpoint": "latest",
                                             "resume_allow_changes": True}, outcome=True)


def test_15_latest_with_a_damaged_newest_checkpoint_names_the_intact_older_one(tmp_path):
    [(kind, message)] = run_on_ranks(_latest_with_a_damaged_newest, 1, args=(tmp_path / "out",), init=False,
                                     timeout=90)
    intact = tmp_path / "out" / "checkpoint-2"
    assert kind == "CorruptCheckpointError" and f"--resume_from_checkpoint {intact}" in message


# --- 13 and 15. flags: one line naming the flag ------------------------------------------------------

BAD_FLAGS = [
    (["--ddp_bucket_cap_mb", "inf"], "--ddp_bucket_cap_mb"),
    (["--ddp_bucket_cap_mb", "1e-9"], "--ddp_bucket_cap_mb"),
    (["--seed", str(2**64 - 1)], "--seed"),
    (["--ddp_timeout", "1e-9"], "--ddp_timeout"),
    (["--weight_decay", "inf"], "--weight_decay"),
    (["--eval_size", "-1"], "--eval_size"),
    (["--output_dir", ""], "--output_dir"),
    (["--resume_from_checkpoint", ""], "--resume_from_checkpoint"),
]


@pytest.mark.parametrize("flags, named", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_13_a_bad_flag_is_one_line_naming_it_with_exit_status_2(flags, named, tmp_path, capsys):
    argv = ["--output_dir", str(tmp_path / "out"), *flags]
    if flags == BAD_FLAGS[0][0]:  # through `python -m miniddp.train`, so that "no traceback" is checked for real
        done = subprocess.run([sys.executable, "-m", "miniddp.train", *argv], capture_output=True, text=True,
                              timeout=120)
        status, err = done.returncode, done.stderr
    else:  # the same main() in this process: a new interpreter importing torch per case costs seconds each
        with pytest.raises(SystemExit) as exited:
            train_main(argv)
        status, err = exited.value.code, capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith(f"miniddp-train: error: {named}:"), (
        status, err[-1500:])
    assert not (tmp_path / "out").exists()


def test_13_a_dataset_this_machine_cannot_hold_is_one_line_with_exit_status_3(tmp_path):
    done = subprocess.run([sys.executable, "-m", "miniddp.train", "--output_dir", str(tmp_path / "out"),
                           "--dataset_size", str(10**12)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and "Traceback" not in done.stderr and "--dataset_size" in done.stderr, done.stderr


# --- 14. the library: meta tensors, losses of every wrong kind --------------------------------------

def _wrap_meta(rank, world_size):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    try:
        miniddp.DistributedDataParallel(model)
    except ValueError as err:
        return str(err)


def test_14_a_model_on_the_meta_device_is_refused_at_wrap():
    [said] = run_on_ranks(_wrap_meta, 1, timeout=30)
    assert said is not None and "weight is on the meta device" in said


class _Returns(torch.nn.Module):
    """Given ``kind``, returns a loss the way a user's model might get it wrong (or right, HF-style)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.net = kind, torch.nn.Linear(4, 1)

    def forward(self, features, labels=None):
        out = self.net(features)
        per_sample = ((out - labels) ** 2).squeeze(1)
        return {"int": {"loss": 3}, "tuple": (per_sample.mean(), out), "vector": {"loss": per_sample}}[self.kind]


def _loss_kinds(rank, world_size, out, kind):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = [{"features": f, "labels": f.sum(0, keepdim=True)} for f in x]
    cfg = TrainingConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=8, disable_tqdm=True)
    try:
        return Trainer(model=_Returns(kind), args=cfg, train_dataset=data).train()["global_step"]
    except ValueError as err:
        return str(err)


@pytest.mark.parametrize("kind, expected", [("int", "is a int (3), not a tensor"), ("tuple", 2),
                                            ("vector", "a loss of shape [8], not one number")])
def test_14_losses_of_every_kind_are_trained_or_named(kind, expected, tmp_path):
    [got] = run_on_ranks(_loss_kinds, 1, args=(tmp_path / "out", kind), init=False, timeout=60)
    assert got == expected if isinstance(expected, int) else expected in got, got


# --- 15. failed runs leave nothing behind ------------------------------------------------------------

def _diverge(rank, world_size, out):
    return _built_in(rank, world_size, out, {"max_steps": 4, "learning_rate": 1e20}, outcome=True)


def test_15_a_run_that_wrote_nothing_leaves_no_directory(tmp_path):
    [(kind, _)] = run_on_ranks(_diverge, 1, args=(tmp_path / "out",), init=False, timeout=60)
    assert kind == "NonFiniteLossError" and not (tmp_path / "out").exists()  # before: out/.miniddp.lock alone


# --- 9, 10, 13, 14, 15. the launcher -----------------------------------------------------------------

def _yaml(tmp_path, text: str, name="config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_10_accelerate_keys_are_honoured_or_said_to_be_ignored(tmp_path):
    cfg = read_config(_yaml(tmp_path, "num_processes: 2\ngpu_ids: 2,3\nnum_cpu_threads_per_process: 4\ndebug: true\n"
                                      "dynamo_config:\n  dynamo_backend: INDUCTOR\n"))
    env = script_env(cfg)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["OMP_NUM_THREADS"] == "4"
    assert env["MINIDDP_DEBUG"] == "collectives"
    assert [line.split(" ")[0] for line in ignored_settings(cfg)] == ["dynamo_config"]
    c10d = read_config(_yaml(tmp_path, "num_machines: 2\nnum_processes: 2\nmain_process_ip: 10.0.0.1\n"
                                       "rdzv_backend: c10d\n", "c10d.yaml"))
    assert "--rdzv-backend=c10d" in torchrun_args(c10d)  # before: static, whatever the file said
    assert "CUDA_VISIBLE_DEVICES" not in script_env(read_config(_yaml(tmp_path, "gpu_ids: all\n", "all.yaml")))


def test_10_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    with pytest.raises(LaunchError, match=r"'num_processes' is given twice \(lines 1 and 3\)"):
        read_config(_yaml(tmp_path, "num_processes: 2\nuse_cpu: true\nnum_processes: 4\n"))


def test_14_a_binary_config_file_is_named(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(LaunchError, match=f"{path}: not a text file"):
        read_config(path)


def _two_machine_config(tmp_path, port: int) -> Path:
    return _yaml(tmp_path, f"num_machines: 2\nnum_processes: 2\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\n"
                           f"main_process_port: {port}\n", "two.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_9_machine_0_says_it_waits_for_the_others_and_for_how_long(tmp_path):
    script = _yaml(tmp_path, "print('never reached')\n", "script.py")
    job = subprocess.Popen([str(BIN / "miniddp"), "launch", "--config_file", str(_two_machine_config(
        tmp_path, _free_port())), str(script)], stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = job.stderr.readline()  # before: nothing, for up to 600 s
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert "machine 0 of 2: waiting at 127.0.0.1:" in first and "for the other 1 machine(s)" in first
    assert "600 s" in first


def test_13_a_main_process_port_in_use_is_one_line(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        code = launch_main(["launch", "--config_file", str(_two_machine_config(tmp_path, taken.getsockname()[1])),
                            str(_yaml(tmp_path, "pass\n", "script.py"))])
    said = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(said) == 1 and "main_process_port" in said[0] and "already in use" in said[0]


def test_15_ctrl_c_on_miniddp_launch_is_one_line_and_stops_the_workers(tmp_path):
    script = _yaml(tmp_path, "import os, time\nopen(f'started-{os.environ[\"RANK\"]}', 'w').close()\ntime.sleep(600)\n",
                   "script.py")
    job = subprocess.Popen([str(BIN / "miniddp"), "launch", "--num_processes", "2", str(script)], cwd=tmp_path,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"started-{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)
    job.send_signal(signal.SIGINT)
    _, said = job.communicate(timeout=60)
    ours = [line for line in said.splitlines() if line.startswith("miniddp launch:")]
    # the script's own KeyboardInterrupt is the script's to print; the launcher's was 47 lines of torchrun
    assert job.returncode == 128 + signal.SIGINT and "launch.py" not in said and "SignalException" not in said, said
    assert ours[-1] == "miniddp launch: stopped by SIGINT; the workers were stopped too"
