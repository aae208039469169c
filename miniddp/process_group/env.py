"""Rendezvous: who am I, how many are we, and where do we meet?

What
    ``DistEnv`` holds one process's place in the job (rank, local_rank,
    world_size, local_world_size, node_rank) and the meeting point of the
    rendezvous (master_addr, master_port). ``DistEnv.from_environ`` reads it from
    torchrun's variables, from SLURM's, or defaults to a single process;
    ``init_distributed`` selects the backend and device, and initialises the
    process group with ``ddp_timeout``; the group it creates is destroyed at exit
    (``clean_exit.py``) if the script does not destroy it. SLURM's host lists are
    parsed in ``slurm.py``; what a worker under torchrun needs, in ``elastic_agent.py``.

Why
    Every launcher says the same thing in its own words: torchrun sets ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``...; SLURM sets ``SLURM_PROCID``,
    ``SLURM_LOCALID``, ``SLURM_NTASKS`` and a compressed host list such as
    ``node[01-04,07]``. Reading them in one place means the training code never
    has to know which launcher ran it.

How torch differs
    ``init_process_group(init_method="env://")`` reads only torchrun's variables
    (``torch/distributed/rendezvous.py``); SLURM users usually run torchrun inside
    ``srun``, or translate by hand (Lightning's ``SLURMEnvironment`` does it as we
    do). torchrun takes precedence here: under ``srun ... torchrun`` the SLURM
    variables describe the *node* task, torchrun's the process. ``init_process_group``
    returns without a barrier unless ``TORCH_DIST_INIT_BARRIER=1``, and gloo's mesh
    handshake ends unevenly: a rank can return, finish its script and exit while a peer
    is still connecting, and the peer fails with "Connection closed by peer". So
    ``init_distributed`` returns only once every rank's init has (a store barrier that
    names the ranks that never arrive, ``monitored_barrier.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from . import debug_backend  # MINIDDP_DEBUG=collectives: the collective-desync detector
from .backend import default_device_kind, device_for_local_rank, select_backend
from .clean_exit import destroy_at_exit
from .elastic_agent import die_with_launcher, restart_scoped_store
from .monitored_barrier import monitored_barrier
from .slurm import parse_slurm_nodelist, parse_slurm_tasks_per_node
from .timeouts import DEFAULT_TIMEOUT_S, as_timedelta

LOOPBACK = "127.0.0.1"  # single-node jobs meet on loopback: nothing is exposed to the network


@dataclass(frozen=True)
class DistEnv:
    """One process's place in a distributed job."""

    rank: int = 0  # global rank, 0 .. world_size-1
    local_rank: int = 0  # rank on this node: picks the device (cuda:local_rank)
    world_size: int = 1  # processes in the job
    local_world_size: int = 1  # processes on this node
    node_rank: int = 0  # which node (torchrun's GROUP_RANK, SLURM_NODEID)
    master_addr: str = LOOPBACK  # host of the rendezvous store (rank 0's node)
    master_port: int = 29500  # its port
    source: str = "single"  # "torchrun", "slurm", "explicit" or "single"
    backend: str | None = None  # set by init_distributed
    device: torch.device | None = None  # set by init_distributed

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank={self.local_rank} must be in [0, local_world_size={self.local_world_size})"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port} must be a TCP port (1-65535)")

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ=None) -> "DistEnv":
        """torchrun's variables if set, else SLURM's, else a single process."""
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return _from_torchrun(env)
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return _from_slurm(env)
        return cls()


def _int(env, name: str, default=None) -> int:
    value = env.get(name, default)
    if value is None:
        raise ValueError(f"environment variable {name} is not set")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


# --8<-- [start:torchrun]
def _from_torchrun(env) -> DistEnv:
    world_size = _int(env, "WORLD_SIZE")
    return DistEnv(
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", world_size),
        node_rank=_int(env, "GROUP_RANK", 0),
        master_addr=env.get("MASTER_ADDR", LOOPBACK),
        master_port=_int(env, "MASTER_PORT", 29500),
        source="torchrun",
    )
# --8<-- [end:torchrun]


# --8<-- [start:slurm]
def _from_slurm(env) -> DistEnv:
    node_id = _int(env, "SLURM_NODEID", 0)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
    hosts = parse_slurm_nodelist(nodelist)
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    else:  # every task derives the same port from the job id; jobs on one node differ
        port = 15000 + _int(env, "SLURM_JOB_ID", 0) % 20000
    tasks_per_node = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    world_size = _int(env, "SLURM_NTASKS")
    local_world_size = (
        parse_slurm_tasks_per_node(tasks_per_node)[node_id] if tasks_per_node else world_size
    )
    return DistEnv(
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_id,
        master_addr=env.get("MASTER_ADDR", hosts[0]),
        master_port=port,
        source="slurm",
    )
# --8<-- [end:slurm]


# --8<-- [start:init_distributed]
def init_distributed(backend: str = "auto", timeout=DEFAULT_TIMEOUT_S, env: DistEnv | None = None,
                     device: str | None = None) -> DistEnv:
    """Join the job: read the environment, pick device and backend, init the process group.

    Returns the ``DistEnv`` with ``backend`` and ``device`` filled in. A single
    process (no launcher) gets a world of one on an in-memory store, so the same
    training script runs with and without torchrun. ``device`` is a device kind
    ("cpu", "cuda"...); by default the machine's accelerator, whatever the
    backend: ``backend="gloo"`` on a GPU machine keeps CUDA tensors (gloo moves
    them through host memory), as Hugging Face does. ``device="cpu"`` (Hugging
    Face's ``use_cpu``) trains on the CPU.
    """
    env = env or DistEnv.from_environ()
    kind = device or default_device_kind()
    name = select_backend(kind, backend)
    device = device_for_local_rank(env.local_rank, kind, share=name == "gloo")
    if dist.is_initialized():  # already joined (e.g. a notebook cell run twice)
        return replace(env, backend=debug_backend.backend_name(), device=device)
    kwargs = dict(backend=name, rank=env.rank, world_size=env.world_size, timeout=as_timedelta(timeout))
    if env.source == "torchrun":
        die_with_launcher()  # a killed torchrun must not leave its workers training on, unseen
    if env.world_size == 1:
        kwargs["store"] = dist.HashStore()  # nothing to meet: no port, no network
    elif env.source == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs["store"] = restart_scoped_store(env, kwargs["timeout"])  # torchrun's store, fresh per restart
    elif env.source == "torchrun":
        kwargs["init_method"] = "env://"  # rank 0 hosts a new store
    else:
        kwargs["init_method"] = f"tcp://{env.master_addr}:{env.master_port}"
    if name == "nccl":
        kwargs["device_id"] = device  # binds the communicator to our GPU eagerly
    if debug_backend.enabled():  # MINIDDP_DEBUG=collectives: every collective is compared across ranks first
        kwargs["backend"] = debug_backend.register(name)
        kwargs.pop("device_id", None)  # a Python group binds no device: NCCL connects at its first collective
    dist.init_process_group(**kwargs)
    if env.world_size > 1:  # torch's own end-of-init barrier is off by default (TORCH_DIST_INIT_BARRIER=0)
        monitored_barrier(kwargs["timeout"])  # gloo's mesh handshake ends unevenly: see the module docstring
    destroy_at_exit()  # gone before interpreter teardown, even if the script never destroys it
    return replace(env, backend=name, device=device)
# --8<-- [end:init_distributed]
