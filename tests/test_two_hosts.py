"""Two real hosts: a 2-node job across two network namespaces, then a cable pulled out mid-run.

Hosts A (10.77.0.1) and B (10.77.0.2) are network namespaces joined by a veth pair
(``miniddp/testing/netlab.py``): each has its own interface and address, and they share the
filesystem, as hosts with a shared filesystem do. On them, with 2 processes per host:

* ``torchrun --rdzv-backend c10d`` trains the same model, bit for bit, as one host
  with 4 processes;
* under ``miniddp launch`` with a two-machine YAML, the link goes down while a
  checkpoint is being written: every process on both hosts ends within ``ddp_timeout``
  + 30 s, the errors name the host that cannot be reached, and every checkpoint in
  ``output_dir`` still verifies; with the link back up, ``miniddp launch`` again with
  ``--resume_from_checkpoint latest`` ends bit for bit where one host ends. So
  ``miniddp launch`` across two hosts trains like one host too: before the cut and
  after it, end to end, with exit status 0.

The job that loses its link runs under ``miniddp launch``, whose static rendezvous
leaves the store alone while the workers train. Under c10d, torchrun's agent on the
cut-off host keeps reading the store on the other one, and such a read blocks until
the kernel gives up on the connection: 15 minutes (see docs/launching.md).

Every process imports torch (~3 s of CPU here, and ~1.5 s more to exit), so this is
one test that runs its jobs side by side: the two jobs without a fault start once
the cut-off job has its first checkpoint, and use the CPU while it waits out its
timeout; its processes have priority, so that the end that is measured is theirs.
Needs root and iproute2's ``ip``; skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

import miniddp.process_group.stalled_ranks as stalled_ranks
from miniddp.launching.spawn import run_on_ranks
from miniddp.testing.netlab import Host, two_hosts, unavailable
from miniddp.training.checkpoint_format import MANIFEST, load_checkpoint

BIN = Path(sys.executable).parent  # torchrun and the miniddp console script, beside this python
DDP_TIMEOUT = 20  # seconds; the cut-off job's collectives give up after this
SURVIVE_S = DDP_TIMEOUT + 30  # every process on both hosts must have ended this long after the cut
# 30 steps of 4 x 8 samples, a checkpoint every 10: the link goes down while checkpoint-20 is being written
TRAIN = ["--dataset_size", "256", "--eval_size", "0", "--per_device_train_batch_size", "8", "--max_steps", "30",
         "--logging_steps", "10", "--save_steps", "10", "--disable_tqdm", "true"]
CUT_TRAIN = [*TRAIN, "--ddp_timeout", str(DDP_TIMEOUT)]
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _pair():
    why = unavailable(shaping=False)
    if why:
        pytest.skip(f"two hosts are two network namespaces: {why}")
    with two_hosts() as pair:
        yield pair


@pytest.fixture(scope="module")
def hosts():
    """Hosts A and B for the jobs that run undisturbed."""
    yield from _pair()


@pytest.fixture(scope="module")
def hosts_to_cut():
    """Another pair, for the job whose link goes down (the others keep theirs)."""
    yield from _pair()


# --- running jobs: one launcher per host, output to files, every process killable -----------------

def _env(host: Host | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")  # gloo on the CPU: exact
    if host is not None:  # gloo's connections go out of this interface, not the one the host name resolves to
        env["GLOO_SOCKET_IFNAME"] = host.interface
    return env


class Job:
    """One launcher per host (or one on this machine): their logs, their exit statuses, their end."""

    def __init__(self, name: str, logs: Path, commands: list[tuple[Host | None, list[str]]], since: float):
        self.name, self.procs, self.logs, self.copiers = name, [], [], []
        for host, argv in commands:
            where = host.namespace[-1].upper() if host else "local"
            log = logs / f"{name}-{where}.log"
            proc = subprocess.Popen(host.cmd(argv) if host else argv, env=_env(host), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            copier = threading.Thread(target=_copy_with_times, args=(proc.stdout, log, since), daemon=True)
            copier.start()  # the pipe is always read: a pipe nobody reads blocks its writer
            self.procs.append(proc)
            self.copiers.append(copier)
            self.logs.append((where, log))

    def wait(self, until: float) -> bool:
        """Wait until every launcher has exited, or the monotonic time ``until``; True if they all did."""
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def returncodes(self) -> list:
        for copier in self.copiers:  # the logs are complete once every launcher has exited
            if all(p.poll() is not None for p in self.procs):
                copier.join(timeout=5)
        return [p.poll() for p in self.procs]

    def output(self, where: str | None = None) -> str:
        return "".join(log.read_text(errors="replace") for w, log in self.logs if where in (None, w))

    def tails(self, chars: int = 2500) -> str:
        return "".join(f"\n--- {self.name} on host {w} (exit {p.poll()}), last {chars} characters:\n"
                       f"{_no_frames(log.read_text(errors='replace'))[-chars:]}"
                       for (w, log), p in zip(self.logs, self.procs))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the launcher's session: it and its workers
                except ProcessLookupError:
                    pass
                p.wait()


class HarnessJob:
    """The one-host reference, 4 ranks of the test harness running ``python -m miniddp.train``'s own main in
    a thread, beside the launchers' jobs: the same training as torchrun with 4 processes, without five
    fresh interpreters importing torch (the harness's forkserver has). Job's interface, one "process"."""

    def __init__(self, name: str, argv: list[str]):
        self.name, self.procs, self.code, self.error = name, [self], None, ""
        self.thread = threading.Thread(target=self._run, args=(argv,), daemon=True)
        self.thread.start()

    def _run(self, argv):
        try:
            run_on_ranks(_train_rank, 4, args=(argv,), init=False, timeout=240)
            self.code = 0
        except Exception as err:  # noqa: BLE001 - reported by tails(), as a launcher's log would be
            self.code, self.error = 1, str(err)

    def poll(self):
        return self.code

    def wait(self, until: float) -> bool:
        self.thread.join(max(0.0, until - time.monotonic()))
        return not self.thread.is_alive()

    def returncodes(self) -> list:
        return [self.code]

    def tails(self, chars: int = 2500) -> str:
        return f"\n--- {self.name} (exit {self.code}):\n{self.error[-chars:]}"

    def kill(self) -> None:  # the harness kills its ranks at its own timeout
        pass


def _train_rank(rank, world_size, argv):
    from miniddp.training.cli import main

    main(argv)


def _copy_with_times(pipe, log: Path, since: float) -> None:
    """Each line of a launcher's output into its log, after the seconds since the test began."""
    with open(log, "w") as out:
        for line in pipe:
            out.write(f"[{time.monotonic() - since:6.1f} s] {line.decode(errors='replace')}")
            out.flush()


def _first_in_line(host: Host) -> None:
    """Give every process on ``host`` priority over the other jobs' (nice -10): a measured end must not
    wait for CPU that the other jobs hold. Each torchrun worker leads its own session, and with the
    kernel's autogroup scheduling a session shares the CPU by its autogroup's nice, so both are set."""
    for pid in host.pids():
        try:
            os.setpriority(os.PRIO_PROCESS, pid, -10)
            Path(f"/proc/{pid}/autogroup").write_text("-10")
        except OSError:  # gone already, or no autogroup here: the process's own nice is what counts
            pass


def _no_frames(text: str) -> str:
    """c10d's C++ stack traces ("frame #3: ...") would fill a tail; the lines around them are the message."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("frame #"))


# --8<-- [start:c10d]
def _torchrun_c10d(a: Host, host: Host, port: int, out: Path, flags: list[str]) -> tuple[Host, list[str]]:
    """torchrun on ``host``, meeting the others at A's c10d store. The host name here resolves to
    127.0.0.1, as on many real hosts (Debian maps it to 127.0.1.1): so torchrun is told which
    address is this node's (``--local-addr``, what the other node's workers connect to) and that A
    hosts the store (``is_host``), instead of guessing both from the host name."""
    return host, [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"{a.address}:{port}", "--rdzv-conf", f"is_host={str(host is a).lower()}",
                  "--local-addr", host.address, "-m", "miniddp.train", "--output_dir", str(out), *flags]
# --8<-- [end:c10d]


def _miniddp_launch(config: Path, rank: int, host: Host, out: Path, flags: list[str]) -> tuple[Host, list[str]]:
    return host, [str(BIN / "miniddp"), "launch", "--config_file", str(config), "--machine_rank", str(rank),
                  "-m", "miniddp.train", "--output_dir", str(out), *flags]


# --8<-- [start:yaml]
def _two_machines_yaml(path: Path, a: Host, port: int) -> Path:
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU",
                                    "num_machines": 2, "num_processes": 4, "machine_rank": 0,
                                    "main_process_ip": a.address, "main_process_port": port,
                                    "mixed_precision": "no", "same_network": True}))
    return path
# --8<-- [end:yaml]


def _model(out: Path) -> dict:
    return torch.load(out / "final_model.pt", weights_only=True)


def _differences(model: dict, reference: dict) -> list[str]:
    if model.keys() != reference.keys():
        return [f"keys {sorted(model)} != {sorted(reference)}"]
    return [f"{k}: max |diff| {(model[k] - reference[k]).abs().max().item():.3g}" for k in reference
            if not torch.equal(model[k], reference[k])]


# --- the test ------------------------------------------------------------------------------------

@pytest.mark.timeout(280)
def test_two_hosts_train_like_one_and_survive_a_link_down(hosts, hosts_to_cut, tmp_path):
    a, b = hosts
    ca, cb = hosts_to_cut
    jobs: list[Job] = []
    begin = time.monotonic()
    timeline = []  # what happened when: printed at the end (pytest -s), the logs carry the same clock

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - begin:6.1f} s  {what}")

    def start(name: str, commands) -> Job:
        jobs.append(Job(name, tmp_path, commands, since=begin))
        return jobs[-1]

    try:
        # 1. The job that will lose its link: miniddp launch on hosts A and B of the second pair.
        cut_dir = tmp_path / "cut"
        config = _two_machines_yaml(tmp_path / "two_machines_cut.yaml", ca, 29500)
        cut_job = start("cut", [_miniddp_launch(config, r, h, cut_dir, CUT_TRAIN) for r, h in enumerate((ca, cb))])
        cut = cb.ready_to_cut()  # host B's cable, about to be pulled out

        # 2. Once checkpoint-10 is out, the jobs without a fault start: one host with 4 processes, and
        #    the same 2-host job with torchrun's c10d rendezvous. They take the CPU that the cut-off job
        #    leaves while it waits out its timeout; it has priority over them.
        deadline = time.monotonic() + 150
        while not (cut_dir / "checkpoint-10" / MANIFEST).exists() and time.monotonic() < deadline:
            assert None in cut_job.returncodes(), f"the job ended before its first checkpoint{cut_job.tails()}"
            time.sleep(0.05)
        mark("checkpoint-10 written")
        reference, two_torchrun = tmp_path / "one_host", tmp_path / "two_torchrun"
        jobs.append(HarnessJob("one host, 4 processes", ["--output_dir", str(reference), *TRAIN]))
        start("torchrun c10d", [_torchrun_c10d(a, h, 29400, two_torchrun, TRAIN) for h in (a, b)])

        # 3. The cable is pulled in the middle of the next save: the ranks wait in the save's barriers,
        #    and a half-written .checkpoint-20.tmp is on disk.
        tmp, done = cut_dir / ".checkpoint-20.tmp", cut_dir / "checkpoint-20" / MANIFEST
        while not (tmp.exists() or done.exists()) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert time.monotonic() < deadline, f"no checkpoint-20 save began within 150 s{cut_job.tails()}"
        cut()
        cut_at, mid_save = time.monotonic(), not done.exists()
        mark(f"link down, {'during' if mid_save else 'after'} the save of checkpoint-20")
        for host in (ca, cb):
            _first_in_line(host)

        # 4. Every process on both cut hosts (launchers, workers) ends within ddp_timeout + 30 s ...
        ended = {}
        while len(ended) < 2 and time.monotonic() < cut_at + SURVIVE_S:
            for name, host in (("A", ca), ("B", cb)):
                if name not in ended and not host.pids():
                    ended[name] = time.monotonic() - cut_at
                    mark(f"every process on cut host {name} has ended")
            time.sleep(0.2)
        survivors = {host.namespace: _describe(host.pids()) for host in (ca, cb) if host.pids()}
        for host in (ca, cb):  # what is left is killed, so that the report below is the last word
            for pid in host.pids():
                _kill(pid)
        cut_job.wait(time.monotonic() + 30)
        assert not survivors, (f"{sum(map(len, survivors.values()))} process(es) still running {SURVIVE_S} s after "
                               f"the link went down (ddp_timeout={DDP_TIMEOUT}):\n{survivors}{cut_job.tails()}")
        assert all(code not in (0, None) for code in cut_job.returncodes()), (
            f"the cut-off job should have failed on both hosts{cut_job.tails()}")

        # ... and says which host it lost: A's ranks name B's (10.77.0.2), whose check-in never came;
        # B's name the store on A (10.77.0.1) as unreachable.
        said = _stalled_rank_errors(cut_job)
        print(f"\nlink down {'during' if mid_save else 'after'} the save of checkpoint-20; every process had ended "
              f"{max(ended.values()):.1f} s later (host A {ended['A']:.1f} s, host B {ended['B']:.1f} s). "
              "What they said:\n" + "\n".join(said))
        assert any(cb.address in line or f"store at {ca.address}:" in line for line in said), (
            f"no error named the host across the cut link ({cb.address} seen from A, {ca.address} from B)"
            f"{cut_job.tails()}")

        # 5. Nothing on disk is corrupt: every checkpoint with a manifest verifies and loads.
        complete = sorted(p for p in cut_dir.glob("checkpoint-*") if (p / MANIFEST).exists())
        assert cut_dir / "checkpoint-10" in complete, sorted(os.listdir(cut_dir))
        for path in complete:
            load_checkpoint(path, rank=0)  # checks every file's size and sha256 against the manifest
        assert not (cut_dir / "final_model.pt").exists(), "the job finished before the link went down"

        # 6. The link is back: the same job resumes from its newest checkpoint, under miniddp launch again
        #    (a port of its own: the cut-off store's may still be held by the kernel).
        cb.link_up()
        newest = complete[-1] / MANIFEST
        before = (newest.stat().st_ino, newest.stat().st_mtime_ns)  # a run started afresh would write it anew
        config = _two_machines_yaml(tmp_path / "two_machines_resume.yaml", ca, 29501)
        resumed = start("resume", [_miniddp_launch(config, r, h, cut_dir, [*CUT_TRAIN, "--resume_from_checkpoint",
                                                                           "latest"]) for r, h in enumerate((ca, cb))])
        mark("link up, resume started")

        # 7. Every job ends well, and every model is the one host's, bit for bit. The resume, the last
        #    link of the chain, goes first in line too, its workers as they appear.
        until = time.monotonic() + 150
        while None in resumed.returncodes() and time.monotonic() < until:
            for host in (ca, cb):
                _first_in_line(host)
            time.sleep(1)
        for job in jobs[1:]:
            assert job.wait(until), f"{job.name}: still running after 150 s{job.tails()}"
            assert job.returncodes() == [0] * len(job.procs), f"{job.name} failed{job.tails()}"
            mark(f"{job.name}: done")
        want = _model(reference)
        assert not _differences(_model(two_torchrun), want), (
            f"torchrun c10d: the model differs from one host's with 4 processes: "
            f"{_differences(_model(two_torchrun), want)}{jobs[2].tails()}")
        metrics = json.loads((two_torchrun / "metrics.json").read_text())
        assert metrics["world_size"] == 4 and metrics["global_step"] == 30
        assert (newest.stat().st_ino, newest.stat().st_mtime_ns) == before, (
            f"the resume did not resume from {newest.parent.name}: it wrote it again{resumed.tails()}")
        got = _model(cut_dir)
        assert not _differences(got, want), (
            f"resume: the model differs from the uninterrupted run's: {_differences(got, want)}{resumed.tails()}")
    finally:
        print("\n" + "\n".join(timeline))
        for job in jobs:
            job.kill()
        for host in (ca, cb, a, b):
            for pid in host.pids():
                _kill(pid)


def _describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160])
        except OSError:
            pass
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stalled_rank_errors(job: Job) -> list[str]:
    """The one-line summaries the ranks raised, host by host: "[host A] rank 1: StalledRankError: ..."."""
    lines = []
    for where, _ in job.logs:
        # miniddp-train's own line (exit status 5), or a traceback's last line from another script
        pattern = (r"^(?:\[ *[\d.]+ s\] )?(?:(?:\[rank(\d+)\]: )?(?:miniddp\.timeouts\.)?StalledRankError: "
                   r"|miniddp-train: error: rank (\d+): )(.*)$")
        for m in re.finditer(pattern, job.output(where), re.M):
            lines.append(f"[host {where}] rank {m.group(1) or m.group(2)}: {m.group(3)}")
    return lines


# --- what the ranks say: the store's host cut off, ranks caught in different collectives ------------

def _store_stops_answering(rank, world_size):
    """Join a store served by another process, freeze that process (a host that stopped answering),
    and fail a collective: the check-in must give up on the store and say where it was."""
    import multiprocessing as mp
    from datetime import timedelta

    def serve(conn):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        conn.send(store.port)
        time.sleep(120)

    parent, child = mp.get_context("fork").Pipe()
    server = mp.get_context("fork").Process(target=serve, args=(child,), daemon=True)
    server.start()
    try:
        port = parent.recv()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        os.kill(server.pid, signal.SIGSTOP)  # it keeps its socket open, and answers nothing
        stalled_ranks.STORE_ANSWER_S = 1.0
        start = time.monotonic()
        try:
            with stalled_ranks.naming_stalled_ranks("all-reduce of test #1", grace=0.5):
                raise RuntimeError("[gloo] Timed out waiting 20000ms for recv operation to complete")
        except stalled_ranks.StalledRankError as err:
            return time.monotonic() - start, str(err), port
    finally:
        os.kill(server.pid, signal.SIGKILL)


def test_a_store_that_stops_answering_is_named_not_waited_for():
    (waited, message, port), = run_on_ranks(_store_stops_answering, 1, init=False, timeout=60)
    # it waited the grace and STORE_ANSWER_S, then gave up; the store's own reads would wait 60 s (its timeout)
    assert 0.5 + 1.0 <= waited < 60, f"gave up on the store after {waited:.1f} s, not grace 0.5 + 1 s"
    assert f"the store at 127.0.0.1:{port}" in message and re.search(r"did not answer within \d+ s", message), message
    assert "Timed out waiting 20000ms" in message  # gloo's own error, kept below ours


def _fail_in_different_collectives(rank, world_size):
    dist.barrier()
    what = "all-reduce of bucket 0 in backward #3" if rank == 0 else "non-finite check of step 3"
    try:  # a cut link: each rank fails in whatever collective it was in, at about the same time
        with stalled_ranks.naming_stalled_ranks(what, grace=0.5):
            raise RuntimeError("[gloo] Timed out waiting 20000ms for recv operation to complete")
    except stalled_ranks.StalledRankError as err:
        return err.missing, str(err)


def test_a_rank_that_failed_in_another_collective_is_not_called_stalled():
    (missing, message), (other_missing, other) = run_on_ranks(_fail_in_different_collectives, 2, timeout=60)
    assert missing == other_missing == [], (message, other)
    assert "rank 1 was waiting in the non-finite check of step 3" in message, message
    assert "rank 0 was waiting in the all-reduce of bucket 0 in backward #3" in other, other
    assert "never reached" not in message + other
