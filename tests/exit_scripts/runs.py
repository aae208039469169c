"""Run user scripts many times under one torchrun: each run a fresh interpreter on every rank.

    torchrun --standalone --nproc-per-node 2 tests/exit_scripts/runs.py PLAN.json OUT_DIR

Each torchrun worker starts ``python SCRIPT ARGS`` once per run and waits for it, so run k of
every rank is a fresh process with torchrun's environment, ending through the interpreter's own
teardown (atexit, then ``Py_FinalizeEx``: where the gloo abort happens). Run k of rank 0 meets
run k of rank 1 in torchrun's store under a prefix of its own (``TORCHELASTIC_RESTART_COUNT``,
which ``miniddp.init_distributed`` scopes the store by). Forking the runs from a process that
has imported torch would be faster, but it hides the abort: its timing changes (0 aborts in 20
forked runs against 4 in 10 fresh ones, same script; 1 in 40 ranks with a fork that does end
through ``Py_FinalizeEx``). The plan is a list of
``{"name", "script", "runs", "env", "args", "stop_at_first", "witness"}``: ``stop_at_first`` ends a
negative control on every rank at the first run that did not exit 0 on some rank (the ranks
agree through torchrun's store); ``witness`` puts ``witness/sitecustomize.py`` on the run's path, which
records the gloo threads still alive when teardown begins. Each worker writes
``OUT_DIR/<name>.rank<R>.json``: every run's exit status (negative: the signal), its stderr's tail, and
with ``witness`` those threads (``None``: the process ended before its atexit functions ran).
"""

import json
import os
import subprocess
import sys

RUN_TIMEOUT_S = 120  # a run that takes longer is killed and reported as "timeout"
WITNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "witness")


def run(item: dict, k: int, out: str, rank: str) -> dict:
    env = {**os.environ, **item.get("env", {}), "TORCHELASTIC_RESTART_COUNT": f"{item['name']}-{k}"}
    args = [a.format(run=k, rank=rank, out=out) for a in item.get("args", [])]
    witness = os.path.join(out, f"{item['name']}.{k}.rank{rank}.witness.json")
    if item.get("witness"):
        env.update(MINIDDP_EXIT_WITNESS=witness, PYTHONPATH=os.pathsep.join(filter(None, [WITNESS, env.get(
            "PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, item["script"], *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, errors="replace", timeout=RUN_TIMEOUT_S)
        result = {"status": done.returncode, "stderr": done.stderr[-1500:]}
    except subprocess.TimeoutExpired as stuck:
        result = {"status": "timeout", "stderr": (stuck.stderr or "")[-1500:]}
    if item.get("witness"):
        result["alive"] = json.load(open(witness)) if os.path.exists(witness) else None
    return result


def everyone_exited_0(store, key: str, status, world_size: int) -> bool:
    store.set(f"{key}/{os.environ['RANK']}", str(status))
    keys = [f"{key}/{r}" for r in range(world_size)]
    store.wait(keys)
    return all(store.get(k) == b"0" for k in keys)


def main(plan: list, out: str, rank: str) -> None:
    store = None
    for item in plan:
        results = []
        for k in range(item["runs"]):
            results.append(run(item, k, out, rank))
            if item.get("stop_at_first"):
                if store is None:
                    import torch.distributed as dist  # only controls need the ranks to agree

                    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
                if not everyone_exited_0(store, f"exit-runs/{item['name']}/{k}", results[-1]["status"],
                                         int(os.environ["WORLD_SIZE"])):
                    break
        with open(os.path.join(out, f"{item['name']}.rank{rank}.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(json.load(open(sys.argv[1])), sys.argv[2], os.environ["RANK"])
