"""``python -m miniddp.drop_in``: an unchanged torch DDP script trains on miniddp's engine, as if run directly.

The oracle is the same script on torch's DDP, under the same torchrun: the weights must be bitwise equal. The
negative control is the script without any DDP (gradients never averaged), which the same comparison rejects.
The frameworks' own scripts (Transformers, TRL, Accelerate, Lightning) are in tests/test_drop_in_frameworks.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.parallel

import miniddp
import miniddp.drop_in as drop_in

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "drop_in_scripts" / "plain_ddp.py"
BIN = Path(sys.executable).parent
BANNER = "torch.nn.parallel.DistributedDataParallel is miniddp's"


def _torchrun(*argv, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", *map(str, argv)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})


def _weights(folder: Path, rank: int = 0) -> dict:
    return torch.load(folder / f"rank{rank}.pt", weights_only=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_torch_script_under_torchrun_trains_on_miniddp_bitwise_as_on_torch_and_sees_no_difference(tmp_path):
    diagnostics = {"MINIDDP_TRACE": str(tmp_path / "trace"), "MINIDDP_DEBUG": "collectives"}
    ours = _torchrun("-m", "miniddp.drop_in", SCRIPT, "--out", tmp_path / "ours", env=diagnostics)
    assert ours.returncode == 0, ours.stderr[-3000:]
    theirs = _torchrun(SCRIPT, "--out", tmp_path / "torch")
    local = _torchrun("-m", "miniddp.drop_in", SCRIPT, "--out", tmp_path / "local", "--without_ddp")
    assert theirs.returncode == 0 and local.returncode == 0, theirs.stderr[-2000:] + local.stderr[-2000:]
    for rank in (0, 1):
        assert _equal(_weights(tmp_path / "ours", rank), _weights(tmp_path / "torch", rank))
        seen = json.loads((tmp_path / "ours" / f"rank{rank}.json").read_text())
        assert seen["class"] == "miniddp.drop_in.DistributedDataParallel"
        assert seen["isinstance_torch_name"] and seen["late_import_is_same"]
        assert seen["argv"] == [str(SCRIPT), "--out", str(tmp_path / "ours")]
        assert (seen["name"], seen["path0"]) == ("__main__", str(SCRIPT.parent))
        assert seen["backend"] == "miniddp_debug_gloo"  # the desync detector, around the script's own group
    mine = json.loads((tmp_path / "torch" / "rank0.json").read_text())
    assert mine["class"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert not _equal(_weights(tmp_path / "local"), _weights(tmp_path / "torch"))  # the check can fail
    assert ours.stderr.count(BANNER) == 1  # rank 0 only
    for rank in (0, 1):  # the first backwards traced: Perfetto's JSON, the events, the buckets and each step
        trace = json.loads((tmp_path / "trace" / f"rank{rank}.trace.json").read_text())
        assert {e["name"] for e in trace["traceEvents"]} >= {"backward", "all-reduce bucket 0"}
        summary = json.loads((tmp_path / "trace" / f"rank{rank}.buckets.json").read_text())
        assert summary["buckets"] and len(summary["steps"]) == 4  # plain_ddp.py's 4 steps
        assert all(step["comm_s"] > 0 for step in summary["steps"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_process_the_module_form_its_exit_status_and_a_quiet_banner(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "MINIDDP_DROP_IN_QUIET": "1", "PYTHONPATH": str(HERE)}
    run = subprocess.run([sys.executable, "-m", "miniddp.drop_in", "-m", "drop_in_scripts.plain_ddp", "--out",
                          str(tmp_path), "--exit", "3", "--steps", "1"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 3, run.stderr[-3000:]  # the script's own sys.exit(3)
    assert BANNER not in run.stderr
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["argv"] == [str(SCRIPT), "--out", str(tmp_path), "--exit", "3", "--steps", "1"]  # python -m's argv
    assert seen["name"] == "__main__" and seen["class"] == "miniddp.drop_in.DistributedDataParallel"


def test_a_missing_script_and_no_arguments_are_one_line_and_exit_2(capsys):
    assert drop_in.main(["no_such_script.py"]) == 2
    assert drop_in.main([]) == 2
    assert drop_in.main(["-m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "no_such_script.py" in err[0]


def test_install_reaches_names_bound_before_it_and_undo_puts_torchs_back():
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    early = types.ModuleType("a_framework_imported_first")
    early.DistributedDataParallel = torch_ddp  # `from torch.nn.parallel import DistributedDataParallel`, earlier
    sys.modules[early.__name__] = early
    try:
        undo = drop_in.install()
        try:
            for holder in (torch.nn.parallel, torch.nn.parallel.distributed, early):
                assert holder.DistributedDataParallel is drop_in.DistributedDataParallel
            assert issubclass(drop_in.DistributedDataParallel, miniddp.DistributedDataParallel)
            assert drop_in.TORCH_DDP is torch_ddp  # miniddp's own name for torch's class stays torch's
        finally:
            undo()
        for holder in (torch.nn.parallel, torch.nn.parallel.distributed, early):
            assert holder.DistributedDataParallel is torch_ddp
    finally:
        del sys.modules[early.__name__]


@pytest.mark.parametrize("events, steps", [([], 0), ([{"name": "backward start", "t": 0.0}], 0)])
def test_per_step_skips_what_is_not_a_whole_backward(events, steps):
    assert len(drop_in.per_step(events)) == steps


def test_miniddp_launch_drop_in_puts_the_runner_before_the_script_or_the_module(monkeypatch, tmp_path):
    from miniddp.launching.launch import launch_command

    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no default Accelerate config file
    monkeypatch.chdir(SCRIPT.parent)
    command, _, _ = launch_command(["--drop_in", "--num_processes", "2", "--dry_run", SCRIPT.name, "--out", "x"])
    assert command[-5:] == ["-m", "miniddp.drop_in", SCRIPT.name, "--out", "x"]
    command, _, _ = launch_command(["--num_processes", "2", "--drop_in", "-m", "plain_ddp", "--out", "x"])
    assert command[-6:] == ["-m", "miniddp.drop_in", "-m", "plain_ddp", "--out", "x"]
    command, _, _ = launch_command(["--num_processes", "2", SCRIPT.name, "--drop_in"])  # the script's own flag
    assert "miniddp.drop_in" not in command and command[-1] == "--drop_in"


def test_a_cpu_config_reaches_accelerate_and_transformers_scripts_as_accelerate_launch_says_it():
    from miniddp.launching.torchrun_args import script_env

    assert script_env({"use_cpu": True})["ACCELERATE_USE_CPU"] == "true"
    assert "ACCELERATE_USE_CPU" not in script_env({})  # GPUs, or Accelerate's own choice
