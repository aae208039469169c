"""Shared test set-up. Every multi-rank test starts its ranks with ``run_on_ranks``, the launching layer's
``miniddp.launching.spawn.run_on_ranks``, which ``miniddp.testing`` re-exports beside ``backend_params``."""

import atexit
import fcntl
import os
import shutil
import tempfile

import pytest
import torch

# The parent process (a pytest-xdist worker) never needs more than one thread:
# the ranks it starts do the work, and 2 cores are shared by everything.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Accelerate's default config file (`miniddp launch` reads it when given no --config_file) lives under
# HF_HOME: one of the user's own must not change what the suite runs
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="miniddp-tests-hf-home-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], True)


# The slowest files first, the longest of them first: under `--dist loadfile` (pyproject.toml) each file
# runs on one pytest-xdist worker, handed out in collection order, so a long file collected last
# (two_hosts, transformers) ran alone at the end while the other worker sat idle.
SLOW_FIRST = ("tests/test_exercise.py", "tests/test_notebooks.py", "tests/test_drop_in_frameworks.py",
              "tests/test_clean_exit.py", "tests/test_browser.py", "tests/test_two_hosts.py", "tests/test_examples.py",
              "tests/test_transformers.py", "tests/test_resume.py", "tests/test_launch.py", "tests/test_compile.py",
              "tests/test_adversary.py", "tests/test_exercise_runner.py", "tests/test_demo.py")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than there are cores. Many tests wait without computing (a timeout run out,
    a stalled rank named, a process killed and restarted), and a third worker on two cores fills those waits:
    measured, the suite's machine-wide CPU use went from 91% to 99% of its middle minutes."""
    return (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: file order kept


@pytest.fixture(scope="session")
def once(tmp_path_factory):
    """``once(name, compute)``: ``compute()`` run once for the whole session, whichever pytest-xdist worker
    asks first, another waiting on its lock and reading its result (under ``--dist loadfile`` a module's
    tests share a worker; a spec test run by ``miniddp exercise check`` shares it with other modules)."""
    base = tmp_path_factory.getbasetemp()  # under xdist, each worker's is a folder of the session's
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def run(name: str, compute):
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            result = shared / f"{name}.pt"
            if not result.exists():
                torch.save(compute(), result)  # tensors and plain containers
        return torch.load(result, weights_only=False)
    return run


@pytest.fixture
def clean_env(monkeypatch):
    """An environment with no launcher variables, for DistEnv tests."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")) or name in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        ):
            monkeypatch.delenv(name)
    return monkeypatch
