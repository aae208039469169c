"""``python -m miniddp.drop_in``: an unchanged torch DDP script trains on miniddp's engine, as if run directly.

The oracle is the same script on torch's DDP, under the same torchrun: the weights must be bitwise equal. The
negative control is the script without any DDP (gradients never averaged), which the same comparison rejects.
The frameworks' own scripts (Transformers, TRL, Accelerate, Lightning) are in tests/test_drop_in_frameworks.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import types
import zipfile
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


DEF_MAIN = HERE / "drop_in_scripts" / "def_main.py"


@pytest.fixture
def in_process(monkeypatch):
    """``drop_in.main`` run in this process: what it changes (argv, sys.path[0]) is put back afterwards."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("MINIDDP_DROP_IN_QUIET", "1")
    for name in ("MINIDDP_TRACE", "MINIDDP_TRACE_STEPS", "MINIDDP_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    assert not torch.distributed.is_initialized()  # the runner destroyed the script's group
    assert torch.nn.parallel.DistributedDataParallel is drop_in.TORCH_DDP  # and put torch's class back


def test_a_script_that_just_returns_gets_its_traces(in_process, tmp_path, capsys):
    in_process.setenv("MINIDDP_TRACE", str(tmp_path / "trace"))
    assert drop_in.main([str(DEF_MAIN), "--store", str(tmp_path / "store")]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "__main__"  # it ran, and returned
    summary = json.loads((tmp_path / "trace" / "rank0.buckets.json").read_text())
    assert len(summary["steps"]) == 3  # def_main.py's 3 backwards, its wrapper long gone
    assert {p.name for p in (tmp_path / "trace").iterdir()} == {"rank0.buckets.json", "rank0.events.json",
                                                                "rank0.trace.json"}


@pytest.mark.parametrize("form", ["folder", "zip"])
def test_a_folder_or_a_zip_file_with_a_main_runs_as_python_runs_it(in_process, tmp_path, capsys, form):
    if form == "folder":
        target = tmp_path / "app"
        target.mkdir()
        shutil.copy(DEF_MAIN, target / "__main__.py")
    else:
        target = tmp_path / "app.zip"
        with zipfile.ZipFile(target, "w") as archive:
            archive.write(DEF_MAIN, "__main__.py")
    assert drop_in.main([str(target), "--store", str(tmp_path / "store")]) == 0
    seen = json.loads(capsys.readouterr().out)
    # python DIR: argv[0] and sys.path[0] are DIR, the name is __main__
    assert seen == {"argv": [str(target), "--store", str(tmp_path / "store")], "name": "__main__",
                    "path0": str(target)}
    (tmp_path / "empty").mkdir()
    assert drop_in.main([str(tmp_path / "empty")]) == 1  # python's status for a folder without __main__.py
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("variable, value", [
    ("MINIDDP_TRACE", "{file}"), ("MINIDDP_TRACE", "{file}/trace"),
    pytest.param("MINIDDP_TRACE", "/proc/miniddp_trace", marks=pytest.mark.skipif(  # unwritable, even for root
        not sys.platform.startswith("linux"), reason="/proc is Linux's")),
    ("MINIDDP_TRACE_STEPS", "abc"), ("MINIDDP_TRACE_STEPS", "0"), ("MINIDDP_TRACE_STEPS", "-1"),
    ("MINIDDP_TRACE_STEPS", "2.5")])
def test_a_bad_trace_variable_is_one_line_and_exit_2_before_the_script_runs(in_process, tmp_path, capsys,
                                                                            variable, value):
    (tmp_path / "a_file").write_text("")
    in_process.setenv("MINIDDP_TRACE", str(tmp_path / "trace"))
    in_process.setenv(variable, value.format(file=tmp_path / "a_file"))
    assert drop_in.main([str(DEF_MAIN), "--store", str(tmp_path / "store")]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # the script never ran
    assert len(err.strip().splitlines()) == 1 and variable in err


def test_trace_steps_reads_a_whole_number_with_a_default():
    from miniddp.launching.drop_in_checks import trace_steps

    assert [trace_steps(env) for env in ({}, {"MINIDDP_TRACE_STEPS": ""}, {"MINIDDP_TRACE_STEPS": "3"})] == [20, 20, 3]


def test_a_module_python_cannot_run_is_its_one_line_and_its_exit_status(in_process, tmp_path, capsys):
    (tmp_path / "no_main_pkg").mkdir()
    (tmp_path / "no_main_pkg" / "__init__.py").write_text("")
    (tmp_path / "broken_dependency.py").write_text("import no_such_dependency_of_this_module\n")
    in_process.syspath_prepend(str(tmp_path))
    for name in ("no_such_module_anywhere", "no_main_pkg", "no_such_package_anywhere.sub"):
        python = subprocess.run([sys.executable, "-m", name], capture_output=True, text=True, cwd=tmp_path)
        status = drop_in.main(["-m", name])
        err = capsys.readouterr().err.strip().splitlines()
        assert (status, len(err)) == (python.returncode, 1) == (1, 1), name
        assert err[0].endswith(python.stderr.strip().split(": ", 1)[1])  # python's own words, after its name
    with pytest.raises(ModuleNotFoundError):  # an error inside the module is the module's: python's traceback
        drop_in.main(["-m", "broken_dependency"])


def test_mp_spawn_ranks_build_miniddps_class_and_write_their_traces(tmp_path):
    env = {**os.environ, "MINIDDP_TRACE": str(tmp_path / "trace"), "MINIDDP_DEBUG": "collectives"}
    for name in ("RANK", "WORLD_SIZE", "MINIDDP_DROP_IN_QUIET", "MINIDDP_TRACE_STEPS"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-m", "miniddp.drop_in", str(HERE / "drop_in_scripts" / "spawn_ddp.py"),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):  # each a fresh interpreter, which re-ran the script as __mp_main__
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"class": "miniddp.drop_in.DistributedDataParallel", "backend": "miniddp_debug_gloo",
                        "name": "__mp_main__"}
        summary = json.loads((tmp_path / "trace" / f"rank{rank}.buckets.json").read_text())
        assert len(summary["steps"]) == 2  # spawn_ddp.py's 2 backwards, written as the rank exited
    assert run.stderr.count(BANNER) == 1


NAMES_TORCH_TAKES = ["gloo", "GLOO", "Gloo", "cpu:gloo", "CPU:GLOO", "cuda:gloo", "nccl", "cuda:nccl",
                     "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"]


@pytest.mark.parametrize("name", NAMES_TORCH_TAKES)
def test_the_desync_switch_reads_a_backend_name_as_torch_does(name):
    from torch.distributed.distributed_c10d import BackendConfig

    from miniddp.process_group import debug_backend

    theirs = BackendConfig(torch.distributed.Backend(name)).get_device_backend_map()
    assert debug_backend.device_backends(name) == {device: str(backend) for device, backend in theirs.items()}


def _checked_world_of_one(backend: str, store: Path) -> tuple[str, str, list]:
    """``init_process_group(backend)`` as the drop-in patches it under MINIDDP_DEBUG=collectives, on one rank."""
    dist = torch.distributed
    drop_in._checked_init(dist.init_process_group)(backend, init_method=f"file://{store}", rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        return type(dist.group.WORLD).__name__, dist.get_backend(), t.tolist()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["GLOO", "cpu:gloo", "Cpu:Gloo"])
def test_the_desync_switch_checks_a_group_torch_would_create(monkeypatch, tmp_path, name):
    monkeypatch.setenv("MINIDDP_DEBUG", "collectives")
    assert _checked_world_of_one(name, tmp_path / "store") == ("CheckedGroup", "miniddp_debug_gloo", [1.0, 1.0])


def test_a_device_map_is_one_checked_group_that_runs_each_collective_on_its_devices_backend(monkeypatch, tmp_path):
    from miniddp.process_group import debug_backend

    dist, built = torch.distributed, {}
    # no NCCL here: a second gloo backend stands in for cuda's; the CPU collective and the routing show the wiring
    gloo = debug_backend._backend
    monkeypatch.setattr(debug_backend, "_backend", lambda name, *args: built.setdefault(name, gloo("gloo", *args)))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("MINIDDP_DEBUG", "collectives")
    drop_in._checked_init(dist.init_process_group)("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path / 's'}",
                                                    rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        group = dist.group.WORLD
        assert (type(group).__name__, t.tolist()) == ("CheckedGroup", [1.0, 1.0])
        assert group.inner._get_backend(torch.device("cpu")) is built["gloo"]
        assert group.inner._get_backend(torch.device("cuda")) is built["nccl"]
    finally:
        dist.destroy_process_group()


def test_miniddp_launch_refuses_a_package_without_main_before_starting_workers(monkeypatch, tmp_path, capsys):
    from miniddp.launching.launch import main as launch

    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no default Accelerate config file
    monkeypatch.chdir(tmp_path)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    assert launch(["launch", "--dry_run", "--drop_in", "-m", "app"]) == 2  # the launcher's bad-input status
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    (tmp_path / "app" / "__main__.py").write_text("")
    assert launch(["launch", "--dry_run", "--drop_in", "-m", "app"]) == 0
