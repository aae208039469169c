"""The frameworks' own scripts on miniddp's engine: Transformers, TRL, Lightning and Accelerate, unchanged.

Each script in ``tests/drop_in_scripts/`` is written as a user writes it (nothing of miniddp imported) and runs on 2
gloo ranks twice: under ``torchrun`` as it is (torch's DDP, built by the framework) and with ``-m miniddp.drop_in``
before it (miniddp's, under torch's name). The oracle is torch's run: the final weights must be bitwise equal,
rank by rank. The negative control is a run whose gradients are never averaged, which the same comparison rejects.
Then what miniddp adds to the real job: the desync detector, the trace, and an unused parameter named in the
backward that missed it (torch's DDP, one step long, exits 0 with replicas that differ).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent / "drop_in_scripts"
BIN = Path(sys.executable).parent  # torchrun and accelerate are installed beside this python
DROP_IN = ("-m", "miniddp.drop_in")
WITNESS = Path(__file__).resolve().parent / "exit_scripts" / "witness"


def _launch(command, env=None) -> subprocess.CompletedProcess:
    """Run ``command``; each rank's witness (``exit_scripts/witness``) records the gloo threads alive at its
    teardown, into ``run.witnessed`` (``rank.json``: the launcher's own, which has no RANK)."""
    witnessed = Path(tempfile.mkdtemp(prefix="witness-"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false", **(env or {}),
           "MINIDDP_EXIT_WITNESS": str(witnessed / "rank{rank}.json"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(WITNESS), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300, env=env)
    run.witnessed = witnessed
    return run


def _torchrun(*argv, env=None) -> subprocess.CompletedProcess:
    return _launch([BIN / "torchrun", "--standalone", "--nproc-per-node", "2", *argv], env)


def _ok(run: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """The run exited 0, and ended as a job must: no gloo thread left on any rank when teardown began. One alive
    then can abort the finished job (docs/failures.md, the clean exit; 1 run in about 100 here, torch's run
    included): so every script ends by destroying its group, once nothing holds it."""
    assert run.returncode == 0, run.stderr[-4000:]
    alive = {path.stem: json.loads(path.read_text()) for path in sorted(run.witnessed.glob("rank[0-9]*.json"))}
    assert alive == {"rank0": [], "rank1": []}, alive
    return run


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _weights(folder: Path, rank: int, name: str = "") -> dict:
    return torch.load(folder / f"rank{rank}{name}.pt", weights_only=True)


def _seen(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


def _rank_lines(stderr: str, rank: int) -> str:
    """What torchrun printed for one rank's uncaught exception (its lines start with ``[rankR]:``)."""
    prefix = f"[rank{rank}]: "
    return "\n".join(line[len(prefix):] for line in stderr.splitlines() if line.startswith(prefix))


def _line_of(script: Path, text: str) -> int:
    return next(n for n, line in enumerate(script.read_text().splitlines(), 1) if text in line)


# --- the Transformers Trainer ----------------------------------------------------------------------------------

HF = SCRIPTS / "hf_trainer.py"
HF_COMMON = ["--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
             "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "4",
             "--ddp_timeout", "300"]
# Checkpointing, no unused-parameter search, 1 MB buckets, no buffer broadcast (GPT-2 has only LayerNorms): the
# oracle's knobs. A static graph on top is what torch's reducer asserts on, with accumulation.
KNOBS = ["--gradient_checkpointing", "true", "--ddp_find_unused_parameters", "false", "--ddp_bucket_cap_mb", "1",
         "--ddp_broadcast_buffers", "false"]
STATIC = ["--ddp_static_graph", "true"]
# The other side of each knob: none of them changes what the gradients add up to on 2 ranks, only how and when
# they travel, so torch's run with KNOBS is the oracle for this one too.
OTHER_KNOBS = ["--gradient_checkpointing", "false", "--ddp_find_unused_parameters", "true",
               "--ddp_broadcast_buffers", "true"]

UNUSED = ["--unused_layer", "true", "--ddp_find_unused_parameters", "false", "--max_steps", "1",
          "--gradient_accumulation_steps", "1"]  # one step: torch's DDP would only raise at the next forward
DIAGNOSTICS = {"MINIDDP_DEBUG": "collectives"}  # and MINIDDP_TRACE, into the run's folder
RUNS = {  # name: (arguments, through miniddp.drop_in, diagnostics)
    "torch": (KNOBS, False, False), "torch_static": (KNOBS + STATIC, False, False),
    "static": (KNOBS + STATIC, True, True), "other": (OTHER_KNOBS, True, False),
    "desync": (["--extra_all_reduce_on_rank", "1"], True, True),
    "torch_unused": (UNUSED, False, False), "unused": (UNUSED, True, False),
}
_done: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}


def _hf(name: str, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One of RUNS, once per session (tests share them): the finished torchrun and the run's folder."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[frameworks]'")
    if name not in _done:
        argv, drop_in, diagnostics = RUNS[name]
        out = tmp_path_factory.mktemp(f"hf_{name}")
        env = {**DIAGNOSTICS, "MINIDDP_TRACE": str(out / "trace")} if diagnostics else None
        _done[name] = _torchrun(*(DROP_IN if drop_in else ()), HF, "--output_dir", out, *HF_COMMON, *argv,
                                env=env), out
    return _done[name]


@pytest.fixture(scope="module")
def transformers_oracle(tmp_path_factory):
    run, out = _hf("torch", tmp_path_factory)
    _ok(run)
    assert _seen(out, 0)["class"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    return out


def test_the_transformers_trainer_across_the_ddp_knobs_trains_bitwise_as_on_torch(transformers_oracle,
                                                                                  tmp_path_factory):
    static, static_out = _hf("static", tmp_path_factory)
    other, other_out = _hf("other", tmp_path_factory)
    _ok(static)
    _ok(other)
    for rank in (0, 1):
        oracle = _weights(transformers_oracle, rank)
        assert _equal(_weights(static_out, rank), oracle) and _equal(_weights(other_out, rank), oracle)
        torch_seen, seen, other_seen = (_seen(f, rank) for f in (transformers_oracle, static_out, other_out))
        assert seen["class"] == other_seen["class"] == "miniddp.drop_in.DistributedDataParallel"
        # every knob reached the wrapper the Trainer built
        assert (seen["static_graph"], seen["find_unused_parameters"], seen["broadcast_buffers"]) == (True, False, False)
        assert (other_seen["static_graph"], other_seen["find_unused_parameters"]) == (False, True)
        assert other_seen["broadcast_buffers"] is True
        assert seen["timeout_s"] == torch_seen["timeout_s"] == other_seen["timeout_s"]
        # the effective batch: per device 2 x accumulation 2 on each of 2 ranks, 4 optimizer steps
        assert seen["world_size"] == 2 and seen["global_step"] == 4 and seen["samples_per_step"] == [4, 4, 4, 4]
        assert seen["train_loss"] == torch_seen["train_loss"]
    # the diagnostics the environment asked for reached the Trainer's job
    assert _seen(static_out, 0)["backend"] == "miniddp_debug_gloo"  # the desync detector around Accelerate's group
    for rank in (0, 1):
        summary = json.loads((static_out / "trace" / f"rank{rank}.buckets.json").read_text())
        assert len(summary["buckets"]) >= 2  # ddp_bucket_cap_mb=1 on 2 MiB of gradients
        assert len(summary["steps"]) == 4  # one synced backward per optimizer step: accumulation's others are local
        assert all(s["comm_s"] > 0 and 0 <= s["exposed_comm_s"] <= s["comm_s"] for s in summary["steps"])
        trace = json.loads((static_out / "trace" / f"rank{rank}.trace.json").read_text())
        assert {"backward", "all-reduce bucket 0", "all-reduce bucket 1"} <= {e["name"] for e in trace["traceEvents"]}


def test_static_graph_with_accumulation_torch_asserts_miniddp_trains_as_torch_without_it(transformers_oracle,
                                                                                        tmp_path_factory):
    theirs, _ = _hf("torch_static", tmp_path_factory)
    assert theirs.returncode != 0
    for rank in (0, 1):
        assert "expect_autograd_hooks_ INTERNAL ASSERT FAILED" in _rank_lines(theirs.stderr, rank)
    ours, out = _hf("static", tmp_path_factory)
    _ok(ours)
    for rank in (0, 1):
        assert _seen(out, rank)["static_graph"] is True
        assert _equal(_weights(out, rank), _weights(transformers_oracle, rank))


def test_a_collective_issued_on_one_rank_only_is_named_on_every_rank(tmp_path_factory):
    run, _ = _hf("desync", tmp_path_factory)
    assert run.returncode != 0
    extra = f"hf_trainer.py:{_line_of(HF, 'dist.all_reduce(torch.ones(3))')}"
    for rank in (0, 1):
        text = _rank_lines(run.stderr, rank)
        assert "miniddp.process_group.desync.CollectiveMismatchError" in text
        rows = dict(re.findall(r"^  rank (\d): (#\d+ .*)$", text, re.M))  # one row per rank, the same number
        assert rows.keys() == {"0", "1"} and rows["0"].split()[0] == rows["1"].split()[0]
        assert " float32[3] " in rows["1"] and rows["1"].endswith(f"at {extra}: dist.all_reduce(torch.ones(3))")
        assert extra not in rows["0"]  # rank 0 was in the Trainer's own work


def test_an_unused_parameter_is_named_in_the_backward_that_missed_it_where_torch_exits_0_diverged(tmp_path_factory):
    theirs, out = _hf("torch_unused", tmp_path_factory)
    _ok(theirs)  # torch raises only at the next forward: one step long, the job succeeds...
    assert not _equal(_weights(out, 0), _weights(out, 1))  # ...with replicas that differ: nothing was averaged
    ours, _ = _hf("unused", tmp_path_factory)
    assert ours.returncode != 0
    for rank in (0, 1):
        text = _rank_lines(ours.stderr, rank)
        error = re.search(r"^miniddp\.engine\.unused\.UnusedParameterError: .*", text, re.M | re.S).group(0)
        assert re.findall(r"^  (\S+): gradient on 0 of 2 rank", error, re.M) == ["unused_head.weight",
                                                                                  "unused_head.bias"]
        frames = re.findall(r'^  File "([^"]+)", line \d+, in (\w+)', text, re.M)
        step = max(i for i, (_, fn) in enumerate(frames) if fn == "training_step")
        assert any(fn == "backward" for _, fn in frames[step:])  # raised inside the backward, not a later forward
        assert not any(fn in ("forward", "_pre_forward") for _, fn in frames[step:])


# --- TRL's SFTTrainer ------------------------------------------------------------------------------------------

def test_trl_sft_trainer_trains_bitwise_as_on_torch(tmp_path):
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[frameworks]'")
    common = ["--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
              "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "3",
              "--max_length", "16"]
    _ok(_torchrun(SCRIPTS / "trl_sft.py", "--output_dir", tmp_path / "torch", *common))
    _ok(_torchrun(*DROP_IN, SCRIPTS / "trl_sft.py", "--output_dir", tmp_path / "ours", *common))
    for rank in (0, 1):
        assert _equal(_weights(tmp_path / "ours", rank), _weights(tmp_path / "torch", rank))
        seen, theirs = _seen(tmp_path / "ours", rank), _seen(tmp_path / "torch", rank)
        assert seen["class"] == "miniddp.drop_in.DistributedDataParallel"
        assert theirs["class"] == "torch.nn.parallel.distributed.DistributedDataParallel"
        # TRL's effective batch: per_device_train_batch_size x gradient_accumulation_steps x processes = 4 x 2 x 2
        assert seen["world_size"] * seen["samples_per_step"][0] == 16 and seen["samples_per_step"] == [8, 8, 8]
        assert seen["train_loss"] == theirs["train_loss"]


# --- Lightning -------------------------------------------------------------------------------------------------

def test_lightning_ddp_strategy_with_accumulation_and_manual_optimisation_trains_as_on_torch(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed: pip install -e '.[frameworks]'")
    _ok(_torchrun(SCRIPTS / "lightning_ddp.py", "--out", tmp_path / "torch"))
    _ok(_torchrun(*DROP_IN, SCRIPTS / "lightning_ddp.py", "--out", tmp_path / "ours"))
    for rank in (0, 1):
        seen, theirs = _seen(tmp_path / "ours", rank), _seen(tmp_path / "torch", rank)
        for name in ("auto", "manual"):
            assert seen[name]["class"] == "miniddp.drop_in.DistributedDataParallel"
            assert theirs[name]["class"] == "torch.nn.parallel.distributed.DistributedDataParallel"
            assert seen[name]["environment"] == "TorchElasticEnvironment"  # Lightning found torchrun's processes
            assert seen[name]["forwarded"] == theirs[name]["forwarded"] == [4] * 6  # 3 steps x 2 batches of 4
            ours, torchs = _weights(tmp_path / "ours", rank, f".{name}"), _weights(tmp_path / "torch", rank, f".{name}")
            assert _equal(ours["parameters"], torchs["parameters"])
            # BatchNorm's running statistics: rank 0's (the ones broadcast, and saved) are torch's. Rank 1's are
            # rank 0's at the last broadcast plus its own batches since, and the broadcasts differ: miniddp's at
            # every grad-enabled forward, torch's only at a forward that follows a synced one (under Lightning's
            # manual optimisation, whose forward redirection clears require_backward_grad_sync, after the first)
            if rank == 0:
                assert _equal(ours["buffers"], torchs["buffers"])


# --- Accelerate ------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_accelerate_loop_under_accelerate_launch_trains_bitwise_as_on_torch_and_the_check_can_fail(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -e '.[frameworks]'")
    script = SCRIPTS / "accelerate_loop.py"
    _ok(_torchrun(script, "--out", tmp_path / "torch"))
    # Accelerate's launcher, as the page documents it on CPU: --multi_gpu starts torchrun's processes
    _ok(_launch([BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port",
                 _free_port(), *DROP_IN, script, "--out", tmp_path / "ours"]))
    _ok(_torchrun(*DROP_IN, script, "--out", tmp_path / "local", "--without_ddp"))
    for rank in (0, 1):
        seen = _seen(tmp_path / "ours", rank)
        assert (seen["class"], seen["distributed_type"]) == ("miniddp.drop_in.DistributedDataParallel",
                                                            "DistributedType.MULTI_CPU")
        assert seen["forwarded"] == [4] * 8  # 64 samples, 2 ranks, batches of 4
        assert _equal(_weights(tmp_path / "ours", rank), _weights(tmp_path / "torch", rank))
        # the negative control: never averaged, the same comparison fails
        assert not _equal(_weights(tmp_path / "local", rank), _weights(tmp_path / "torch", rank))
