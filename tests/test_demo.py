"""The README's main job: torchrun on 2 ranks equals 1 process on the whole batch."""

import contextlib
import io
import re
import subprocess
import sys

import pytest

from miniddp.launching.spawn import run_on_ranks


def _run(nproc: int, batch: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "miniddp.teaching.demo", "--epochs", "2", "--per_device_train_batch_size", str(batch)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _one_process(rank, world_size, argv):
    """The oracle, one process on the whole batch: the same main() in a harness rank (torchrun's variables
    set, torch already imported), not a second torchrun with two fresh interpreters."""
    from miniddp.teaching.demo import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return printed.getvalue()


@pytest.mark.timeout(300)
def test_torchrun_demo_matches_one_process_on_the_global_batch():
    two = _run(2, 32)
    [one] = run_on_ranks(_one_process, 1, args=(["--epochs", "2", "--per_device_train_batch_size", "64"],),
                         init=False, timeout=120)
    assert "parameters identical on all 2 ranks: True" in two
    def losses(out):
        return [float(x) for x in re.findall(r"train loss ([0-9.]+)", out)]

    assert len(losses(two)) == 2 and losses(two)[1] < losses(two)[0]  # it learns
    assert losses(two) == pytest.approx(losses(one), rel=1e-4)  # 2 x 32 == 1 x 64
