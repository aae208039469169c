"""Rendezvous: one DistEnv from torchrun's variables, SLURM's, or none; init_distributed."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import miniddp
from miniddp.launching.spawn import run_on_ranks
from miniddp.process_group.env import DistEnv
from miniddp.process_group.slurm import parse_slurm_tasks_per_node


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
    ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("a,b,c", ["a", "b", "c"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("x[1]y", ["x1y"]),
    ("login-1.cluster,gpu-[3-4].cluster", ["login-1.cluster", "gpu-3.cluster", "gpu-4.cluster"]),
])
def test_parse_slurm_nodelist(nodelist, hosts):
    assert miniddp.parse_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "   ", "node[01-", "node01]", "node[04-01]", "node[a-b]", "node[1-]",
                                 "node[[1]]", ",node1", "node1,,node2", "node[]"])
def test_malformed_nodelists_are_refused_with_the_variable_name(bad):
    with pytest.raises(ValueError, match="SLURM_NODELIST"):
        miniddp.parse_slurm_nodelist(bad)


def test_tasks_per_node():
    assert parse_slurm_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert parse_slurm_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        parse_slurm_tasks_per_node("4(2)")


def test_no_launcher_means_one_process_on_loopback(clean_env):
    env = DistEnv.from_environ()
    assert (env.rank, env.world_size, env.local_rank, env.source) == (0, 1, 0, "single")
    assert env.master_addr == "127.0.0.1" and env.is_main_process


TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "123456"}


def test_torchrun_variables():
    env = DistEnv.from_environ(TORCHRUN)
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                          master_addr="10.1.2.3", master_port=29400, source="torchrun")


def test_slurm_variables():
    env = DistEnv.from_environ(SLURM)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (6, 2, 8, 4, 1)
    assert env.master_addr == "gpu07"  # the first host of the allocation
    assert env.master_port == 15000 + 123456 % 20000  # the same on every task of the job
    assert env.source == "slurm"
    assert DistEnv.from_environ({**SLURM, "MASTER_PORT": "23456", "MASTER_ADDR": "head"}).master_port == 23456


def test_torchrun_inside_srun_wins():
    # srun starts one torchrun per node; each worker sees both sets: torchrun's is the truth
    env = DistEnv.from_environ({**SLURM, **TORCHRUN})
    assert env.source == "torchrun" and env.rank == 5


@pytest.mark.parametrize("override, field", [
    ({"RANK": "abc"}, "RANK"), ({"RANK": "8"}, "rank=8"), ({"WORLD_SIZE": "0"}, "world_size"),
    ({"LOCAL_RANK": "4"}, "local_rank"), ({"MASTER_PORT": "70000"}, "master_port"),
])
def test_inconsistent_torchrun_variables_are_named(override, field):
    with pytest.raises(ValueError, match=field):
        DistEnv.from_environ({**TORCHRUN, **override})


def _init_from_torchrun_env(rank, world_size):
    env = miniddp.init_distributed(backend="auto", timeout=30)
    t = torch.tensor([rank], dtype=torch.float64)
    dist.all_reduce(t)
    return env.rank, env.world_size, env.source, env.backend, env.master_addr, t.item(), dist.get_world_size()


def test_init_distributed_joins_a_torchrun_style_job():
    results = run_on_ranks(_init_from_torchrun_env, 3, init=False, timeout=60)
    for rank, (r, ws, source, backend, addr, total, pg_size) in enumerate(results):
        assert (r, ws, source, backend, addr) == (rank, 3, "torchrun", "gloo", "127.0.0.1")
        assert total == 0 + 1 + 2 and pg_size == 3


def _init_slowly_on_rank_one(rank, world_size):
    init = dist.init_process_group

    def slow(*args, **kwargs):  # rank 1 comes out of init 2 s after its peers could: gloo's uneven handshake
        init(*args, **kwargs)
        time.sleep(2)
        dist.distributed_c10d._get_default_store().set("test/rank1_initialised", "1")
    if rank == 1:
        dist.init_process_group = slow
    miniddp.init_distributed(backend="gloo", timeout=30)
    return dist.distributed_c10d._get_default_store().check(["test/rank1_initialised"])


def test_init_distributed_returns_once_every_rank_has_initialised():
    # without the barrier, rank 0 returns (and may finish its script and exit, closing its sockets) while
    # rank 1 is still inside init: in CI a peer then failed with "Connection closed by peer"
    assert run_on_ranks(_init_slowly_on_rank_one, 2, init=False, timeout=60) == [True, True]


def _init_alone(rank, world_size):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    env = miniddp.init_distributed(timeout=10)
    t = torch.ones(3)
    dist.all_reduce(t)  # a world of one: the sum is the tensor itself
    again = miniddp.init_distributed(timeout=10)  # calling twice (a notebook cell re-run) is harmless
    return env.source, env.world_size, env.backend, t.tolist(), again.rank


def test_init_distributed_without_a_launcher_is_a_world_of_one():
    [(source, world_size, backend, values, rank)] = run_on_ranks(_init_alone, 1, init=False, timeout=30)
    assert (source, world_size, backend, values, rank) == ("single", 1, "gloo", [1.0, 1.0, 1.0], 0)


def _gloo_device(rank, world_size, device):
    env = miniddp.init_distributed(backend="gloo", timeout=60, device=device)
    t = torch.ones(2, device=env.device)
    dist.all_reduce(t)  # gloo moves CUDA tensors through host memory
    return str(env.device), env.backend, t.tolist()


def test_use_cpu_trains_on_the_cpu_with_gloo():
    assert run_on_ranks(_gloo_device, 2, args=("cpu",), init=False, timeout=60) == [("cpu", "gloo", [2.0, 2.0])] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gloo_on_a_gpu_machine_keeps_cuda_tensors_as_hugging_face_does():
    # two ranks share one GPU if need be: gloo copies through host memory (NCCL could not)
    for device, backend, total in run_on_ranks(_gloo_device, 2, args=(None,), init=False, timeout=120):
        assert device.startswith("cuda") and backend == "gloo" and total == [2.0, 2.0]
