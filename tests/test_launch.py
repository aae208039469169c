"""Launching: accelerate-style YAML -> torchrun, SLURM node ranks, two nodes on loopback."""

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from miniddp import TrainingConfig
from miniddp.launch import main, notebook_launcher, read_config, torchrun_args, train_flags

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
TWO = {"num_machines": 2, "num_processes": 16, "machine_rank": 0, "main_process_ip": "10.0.0.1",
       "main_process_port": 29500, "same_network": True}


def test_example_yamls_are_valid():
    one, two = read_config(EXAMPLES / "one_machine.yaml"), read_config(EXAMPLES / "two_machines.yaml")
    assert torchrun_args(one, environ={}) == ["--standalone", "--nproc-per-node=2"]
    assert torchrun_args(two, environ={}) == ["--nnodes=2", "--nproc-per-node=8", "--node-rank=0",
                                              "--master-addr=10.0.0.1", "--master-port=29500"]


def test_num_processes_is_the_total_over_machines():
    assert "--nproc-per-node=8" in torchrun_args(TWO, environ={})


def test_slurm_node_rank_overrides_the_fixed_machine_rank():
    # the pitfall: every node reads machine_rank: 0 from the same YAML
    env = {"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    args = torchrun_args({**TWO, "main_process_ip": None}, environ=env)
    assert "--node-rank=1" in args and "--master-addr=gpu07" in args


def test_machine_rank_flag_wins_over_everything():
    assert "--node-rank=1" in torchrun_args(TWO, environ={"SLURM_NODEID": "0"}, machine_rank=1)


def test_c10d_rendezvous_when_not_on_the_same_network():
    args = torchrun_args({**TWO, "same_network": False}, environ={})
    assert "--rdzv-backend=c10d" in args and "--rdzv-endpoint=10.0.0.1:29500" in args


@pytest.mark.parametrize("cfg, message", [
    ({**TWO, "num_processes": 15}, "multiple of num_machines"),
    ({**TWO, "machine_rank": 2}, "machine_rank=2"),
    ({**TWO, "main_process_ip": None}, "main_process_ip"),
])
def test_bad_configs_are_explained(cfg, message):
    with pytest.raises(ValueError, match=message):
        torchrun_args(cfg, environ={})


def test_unknown_keys_and_other_distributed_types_are_refused(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"num_proceses": 2}))
    with pytest.raises(ValueError, match="num_proceses"):
        read_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED"}))
    with pytest.raises(ValueError, match="DEEPSPEED"):
        read_config(tmp_path / "b.yaml")


def test_yaml_mixed_precision_and_cpu_reach_the_trainer_unless_overridden():
    assert train_flags({"mixed_precision": "bf16", "use_cpu": True}, ["--output_dir", "x"]) == [
        "--output_dir", "x", "--mixed_precision", "bf16", "--ddp_backend", "gloo"]
    assert train_flags({"mixed_precision": "bf16"}, ["--mixed_precision", "no"]) == ["--mixed_precision", "no"]


def test_dry_run_prints_the_torchrun_command(capsys):
    assert main(["launch", "--config_file", str(EXAMPLES / "two_machines.yaml"), "--machine_rank", "1",
                 "--dry_run", "--", "--output_dir", "o"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torchrun --nnodes=2 --nproc-per-node=8 --node-rank=1")
    assert "-m miniddp.train --output_dir o --mixed_precision bf16" in out


def _free_port() -> int:
    """A free port below Linux's ephemeral range (32768+), where the OS places every port-0
    store and gloo connection of the tests running in parallel: none of them can take it
    between our check and torchrun's bind."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


TRAIN = ["--max_steps", "6", "--dataset_size", "256", "--eval_size", "64", "--disable_tqdm", "true",
         "--per_device_train_batch_size", "8", "--logging_steps", "3"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.timeout(300)
def test_two_nodes_on_loopback_equal_one_node_with_four_processes(tmp_path):
    cfg = {"distributed_type": "MULTI_CPU", "num_machines": 2, "num_processes": 4, "machine_rank": 0,
           "main_process_ip": "127.0.0.1", "main_process_port": _free_port(), "use_cpu": True}
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(cfg))
    # output goes to files, not pipes: a pipe nobody reads fills up and blocks its node mid-training
    logs = [open(tmp_path / f"node{r}.log", "w+") for r in range(2)]
    nodes = [subprocess.Popen([sys.executable, "-m", "miniddp.launch", "launch", "--config_file",
                               str(tmp_path / "two.yaml"), "--machine_rank", str(r), "--",
                               "--output_dir", str(tmp_path / "two"), *TRAIN],
                              env=_env(), stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(2)]
    try:
        for n in nodes:
            n.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pass  # reported below, with both nodes' output
    finally:
        for n in nodes:
            n.kill()
            n.wait()
    outputs = [(tmp_path / f"node{r}.log").read_text() for r in range(2)]
    assert all(n.returncode == 0 for n in nodes), f"node 0:\n{outputs[0][-3000:]}\nnode 1:\n{outputs[1][-3000:]}"
    single = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                             "-m", "miniddp.train", "--output_dir", str(tmp_path / "one"), *TRAIN],
                            env=_env(), capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    a = torch.load(tmp_path / "two" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "one" / "final_model.pt", weights_only=True)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    metrics = yaml.safe_load((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["effective_batch_size"] == 32


def _notebook_job(config):
    from miniddp import Trainer
    from miniddp.tasks import make_task

    model, train, evaluation, kind = make_task(config.model, config.dataset_size, config.eval_size, config.seed)
    return Trainer(model, train, config, eval_dataset=evaluation, kind=kind).train()["global_step"]


def test_notebook_launcher_trains_on_two_ranks(tmp_path):
    cfg = TrainingConfig(output_dir=str(tmp_path), max_steps=3, dataset_size=64, eval_size=0, disable_tqdm=True)
    assert notebook_launcher(_notebook_job, (cfg,), num_processes=2, timeout=120) == [3, 3]
