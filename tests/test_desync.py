"""The collective-desync detector (MINIDDP_DEBUG=collectives): every rank names the wrong collective.

Each scenario runs real ranks that call ``miniddp.init_distributed()`` with the
detector on, catch ``CollectiveMismatchError`` and return its message, so a test
can check that *every* rank raised, with the same message, naming each rank's
line exactly (``test_desync.py:LINE``, computed with ``inspect``). Group timeouts
are shorter than the harness's: a detector that failed to fire would make the test fail, not hang.
"""

import copy
import inspect
import os
import re
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.launching.spawn import run_on_ranks
from miniddp.process_group import debug_backend, fingerprint
from miniddp.testing import backend_params

from models import MLP

# seconds: the process group's own timeout in every scenario, below the harness's 30. A mismatch is named as soon as
# every rank has posted, so this bounds only a broken detector, and the group's set-up: 5 s once ran out there,
# under the full suite's load
PG_TIMEOUT = 20


def _init(backend="gloo", debug=True, detector_timeout=None):
    """What a user does: set MINIDDP_DEBUG, then init as usual."""
    if debug:
        os.environ["MINIDDP_DEBUG"] = "collectives"
    else:
        os.environ.pop("MINIDDP_DEBUG", None)
    if detector_timeout is not None:
        os.environ["MINIDDP_DEBUG_TIMEOUT"] = str(detector_timeout)
    return miniddp.init_distributed(backend=backend, timeout=PG_TIMEOUT)


def _site(fn, marker: str) -> str:
    """``test_desync.py:LINE`` of the line of ``fn`` that carries ``marker``: what the message must name."""
    lines, start = inspect.getsourcelines(fn)
    return f"test_desync.py:{start + next(i for i, text in enumerate(lines) if marker in text)}"


def _run(fn, world_size=2, *args):
    return run_on_ranks(fn, world_size, args=args, init=False, timeout=30, grace=1.0)


def _same_on_every_rank(messages) -> str:
    assert all(m is not None for m in messages), f"a rank did not raise: {messages}"
    assert len(set(messages)) == 1, "ranks raised different messages:\n" + "\n---\n".join(messages)
    return messages[0]


# --8<-- [start:mismatched_op]
def _op_differs(rank, world_size):
    _init()
    t = torch.ones(4)
    try:
        if rank == 0:
            dist.all_reduce(t)  # site: rank 0
        else:
            dist.broadcast(t, src=0)  # site: rank 1
    except miniddp.CollectiveMismatchError as exc:
        return str(exc)


def test_mismatched_op_names_each_ranks_line():
    message = _same_on_every_rank(_run(_op_differs))
    assert "as #1 on the process group of ranks [0, 1], differing in op, reduce op/root:" in message
    assert f"rank 0: #1 all_reduce(SUM) float32[4] from user code at {_site(_op_differs, 'site: rank 0')}" in message
    assert f"rank 1: #1 broadcast(root=0) float32[4] from user code at {_site(_op_differs, 'site: rank 1')}" in message
# --8<-- [end:mismatched_op]


def _shape_differs(rank, world_size):
    _init()
    try:
        dist.all_reduce(torch.ones(4 + rank, dtype=torch.float64))  # site: shape
    except miniddp.CollectiveMismatchError as exc:
        return str(exc)


def test_mismatched_shape_is_caught_before_gloo_sees_it():
    message = _same_on_every_rank(_run(_shape_differs))
    site = _site(_shape_differs, "site: shape")
    assert "differing in shapes/dtypes:" in message
    assert f"rank 0: #1 all_reduce(SUM) float64[4] from user code at {site}" in message
    assert f"rank 1: #1 all_reduce(SUM) float64[5] from user code at {site}" in message


# --8<-- [start:extra_collective]
def _extra_all_reduce_the_size_of_a_bucket(rank, world_size):
    _init()
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP())  # one bucket
    bucket = ddp.reducer.buckets[0].buffer
    loss = ddp(torch.randn(6, 8)).square().mean()
    try:
        if rank == 0:
            dist.all_reduce(torch.zeros_like(bucket))  # site: extra
        loss.backward()  # site: backward
    except miniddp.CollectiveMismatchError as exc:
        return str(exc), bucket.numel()


def test_extra_collective_of_exactly_a_buckets_size_names_the_user_line_and_the_bucket():
    results = _run(_extra_all_reduce_the_size_of_a_bucket)
    message = _same_on_every_rank([m for m, _ in results])
    n = results[0][1]
    extra, backward = (_site(_extra_all_reduce_the_size_of_a_bucket, m) for m in ("site: extra", "site: backward"))
    assert "differing in issuer (user code or miniddp):" in message  # same op and shape: only the issuer differs
    assert re.search(rf"rank 0: #\d+ all_reduce\(SUM\) float32\[{n}\] from user code at {extra}:", message)
    assert re.search(rf"rank 1: #\d+ all_reduce\(SUM\) float32\[{n}\] from bucket 0 all-reduce "
                     rf"during loss.backward\(\) at {backward}", message)
# --8<-- [end:extra_collective]


def _rank_1_skips_the_logging_all_reduce(rank, world_size):
    _init()
    loss, grads = torch.tensor([0.5]), torch.ones(8)
    try:
        if rank != 1:  # e.g. `if loss < best:` judged on each rank's own data
            dist.all_reduce(loss)  # site: logging
        dist.all_reduce(grads)  # site: grads
    except miniddp.CollectiveMismatchError as exc:
        return str(exc)


def test_skipped_collective_names_the_odd_rank_out():
    message = _same_on_every_rank(_run(_rank_1_skips_the_logging_all_reduce, 3))
    logging, grads = (_site(_rank_1_skips_the_logging_all_reduce, m) for m in ("site: logging", "site: grads"))
    assert "differing in shapes/dtypes; rank 1 is the odd one out:" in message
    assert f"rank 0: #1 all_reduce(SUM) float32[1] from user code at {logging}" in message
    assert f"rank 1: #1 all_reduce(SUM) float32[8] from user code at {grads}" in message
    assert f"rank 2: #1 all_reduce(SUM) float32[1] from user code at {logging}" in message


# --8<-- [start:stall]
def _rank_1_stalls(rank, world_size, detector_timeout):
    _init(detector_timeout=detector_timeout)
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(4)
    dist.all_reduce(t)  # site: last op
    if rank == 1:  # a slow checkpoint, a stuck data loader... until rank 0's detector has given up
        store.wait(["test: rank 0 raised"], timedelta(seconds=PG_TIMEOUT))
    start = time.monotonic()
    try:
        dist.all_reduce(t)  # site: waiting
    except miniddp.CollectiveMismatchError as exc:
        if rank == 0:
            store.set("test: rank 0 raised", "1")
        return str(exc), time.monotonic() - start


def test_stalled_rank_is_named_with_its_last_op_before_the_group_timeout():
    detector_timeout = 1.0
    results = _run(_rank_1_stalls, 2, detector_timeout)
    message = _same_on_every_rank([m for m, _ in results])  # the late rank raises it too, on arrival
    last, waiting = (_site(_rank_1_stalls, m) for m in ("site: last op", "site: waiting"))
    assert f"rank 1 issued nothing after #1 all_reduce(SUM) float32[4] from user code at {last}" in message
    assert f"rank 0: #2 all_reduce(SUM) float32[4] from user code at {waiting}" in message
    waited = results[0][1]
    assert detector_timeout <= waited < PG_TIMEOUT, (f"rank 0 waited {waited:.1f} s; "
                                                     f"the group times out after {PG_TIMEOUT} s")
    assert results[1][1] < detector_timeout, "the late rank must raise at once, not wait for the others again"
# --8<-- [end:stall]


def _bucket_cap_differs(rank, world_size):
    _init()
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP(), bucket_cap_mb=25 if rank == 0 else 0.0005)
    loss = ddp(torch.randn(6, 8)).square().mean()
    try:
        loss.backward()  # site: backward
    except miniddp.CollectiveMismatchError as exc:
        return str(exc), ddp.reducer.buckets[0].buffer.numel()


def test_different_bucket_cap_mb_per_rank_names_bucket_0_on_both():
    results = _run(_bucket_cap_differs)
    message = _same_on_every_rank([m for m, _ in results])
    backward = _site(_bucket_cap_differs, "site: backward")
    assert "differing in shapes/dtypes:" in message
    for rank, (_, numel) in enumerate(results):  # gloo alone would abort the process here (size mismatch)
        assert re.search(rf"rank {rank}: #\d+ all_reduce\(SUM\) float32\[{numel}\] from bucket 0 all-reduce "
                         rf"during loss.backward\(\) at {backward}", message)


def _log_metrics_with_different_keys(rank, world_size):
    _init()
    metrics = {"loss": 0.5, "accuracy": 0.9} if rank == 0 else {"loss": 0.7}  # rank 1 has no accuracy
    try:
        for name in sorted(metrics):
            dist.all_reduce(torch.tensor(metrics[name]))  # site: per key
        everyone = [None] * world_size
        dist.all_gather_object(everyone, metrics)  # site: gather
    except miniddp.CollectiveMismatchError as exc:
        return str(exc)


def test_dict_with_different_keys_per_rank_is_named_instead_of_deadlocking():
    message = _same_on_every_rank(_run(_log_metrics_with_different_keys))
    per_key, gather = (_site(_log_metrics_with_different_keys, m) for m in ("site: per key", "site: gather"))
    # #1 paired rank 0's accuracy with rank 1's loss (same shape: indistinguishable); #2 is caught
    assert f"rank 0: #2 all_reduce(SUM) float32[] from user code at {per_key}" in message
    assert f"rank 1: #2 all_gather() int64[1] from user code at {gather}" in message


def _plain_or_checked(rank, world_size, debug):
    env = _init(debug=debug)
    registered = "miniddp_debug_gloo" in dist.Backend.backend_list
    return type(dist.group.WORLD).__name__, dist.get_backend(), env.backend, registered


@pytest.mark.parametrize("debug, expected", [
    (False, ("ProcessGroup", "gloo", "gloo", False)),  # off: torch's own group, nothing registered
    (True, ("CheckedGroup", "miniddp_debug_gloo", "gloo", True)),  # on: DistEnv still says gloo
])
def test_off_means_no_wrapper_and_on_keeps_the_real_backend_name(debug, expected):
    assert _run(_plain_or_checked, 2, debug) == [expected, expected]


def _train(rank, world_size, debug):
    _init(debug=debug)
    torch.manual_seed(rank)  # different on every rank: the wrap broadcast runs checked too
    model = MLP()
    ours = miniddp.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.001)  # its C++ reducer calls our Python group
    for ddp in (ours, theirs):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            torch.manual_seed(100 * step + rank)
            torch.nn.functional.mse_loss(ddp(torch.randn(6, 8)), torch.randn(6, 4)).backward()
            opt.step()
            opt.zero_grad()
    checked = getattr(dist.group.WORLD, "seq", 0)  # collectives the detector compared
    return [p.detach() for p in ours.parameters()], [p.detach() for p in theirs.parameters()], checked


def test_detector_does_not_change_the_numbers_of_miniddp_or_torch_ddp():
    on, off = _run(_train, 2, True), _run(_train, 2, False)
    for rank in range(2):
        assert on[rank][2] > 10 and off[rank][2] == 0
        for a, b in zip(on[rank][0] + on[rank][1], off[rank][0] + off[rank][1], strict=True):
            assert torch.equal(a, b)  # bitwise: the detector only reads shapes


def _uneven_inputs_under_join(rank, world_size):
    _init()
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():  # rank 1 runs out first: its join shadows rank 0's bucket all-reduces with zeros
        for step in range(3 - rank):
            torch.manual_seed(10 * step + rank)
            ddp(torch.randn(6, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in ddp.parameters()], dist.group.WORLD.seq


def test_join_shadowing_the_reducer_is_not_a_mismatch():
    (ours, checked), (theirs, _) = _run(_uneven_inputs_under_join)
    assert checked > 5 and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _ring(rank, world_size):
    _init()
    t = torch.arange(7.0) * (rank + 1)
    miniddp.ring_all_reduce(t)  # batch_isend_irecv around the ring: every send posted before its recv
    return t, len(dist.group.WORLD.channels)


def test_ring_all_reduce_runs_under_the_detector():
    for total, channels in _run(_ring, 3):
        assert torch.equal(total, torch.arange(7.0) * 6)
        assert channels == 2  # sends to the right and receives from the left were checked


def _send_recv_sizes_differ(rank, world_size, second):
    _init()
    if rank == second:
        time.sleep(0.3)  # the end that arrives second compares, before its own send or recv is posted
    try:
        if rank == 0:
            dist.send(torch.ones(4), dst=1)  # site: send
        else:
            dist.recv(torch.empty(5), src=0)  # site: recv
        dist.barrier()  # the first end learns of it at its next operation
    except miniddp.CollectiveMismatchError as exc:
        return str(exc)


@pytest.mark.parametrize("second", [0, 1], ids=["sender-compares", "receiver-compares"])
def test_send_and_recv_of_different_sizes_are_named_on_both_ranks(second):
    message = _same_on_every_rank(_run(_send_recv_sizes_differ, 2, second))
    send, recv = (_site(_send_recv_sizes_differ, m) for m in ("site: send", "site: recv"))
    assert "a send and its recv disagree" in message
    assert f"rank 0: #1 send(0->1, tag 0) float32[4] from user code at {send}" in message
    assert f"rank 1: #1 recv(0->1, tag 0) float32[5] from user code at {recv}" in message


def _subgroup(rank, world_size):
    _init()
    sub = dist.new_group([1, 2], timeout=timedelta(seconds=PG_TIMEOUT))  # made after init: wrapped too
    if rank == 0:
        return None
    t = torch.ones(2)
    dist.all_reduce(t, group=sub)
    try:
        if rank == 1:
            dist.all_reduce(t, group=sub)  # site: sub rank 1
        else:
            dist.broadcast(t, src=1, group=sub)  # site: sub rank 2
    except miniddp.CollectiveMismatchError as exc:
        return type(sub).__name__, t.tolist(), str(exc)


def test_subgroup_is_checked_and_its_messages_use_global_ranks():
    _, one, two = _run(_subgroup, 3)
    assert one[:2] == two[:2] == ("CheckedGroup", [2.0, 2.0])
    message = _same_on_every_rank([one[2], two[2]])
    first, second = (_site(_subgroup, m) for m in ("site: sub rank 1", "site: sub rank 2"))
    assert "as #2 on the process group of ranks [1, 2]" in message
    assert f"rank 1: #2 all_reduce(SUM) float32[2] from user code at {first}" in message
    assert f"rank 2: #2 broadcast(root=0) float32[2] from user code at {second}" in message  # root: a group rank


def _every_op(rank, world_size):
    _init()
    n, out = world_size, {}
    t = torch.full((2,), rank + 1.0)
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    dist.all_reduce(t, async_op=True).get_future().wait()
    out["async"] = t.tolist()
    gathered = [torch.empty(1) for _ in range(n)]
    dist.all_gather(gathered, torch.full((1,), float(rank)))
    out["all_gather"] = [g.item() for g in gathered]
    flat, part = torch.empty(n), torch.empty(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames them *_single
        dist.all_gather_into_tensor(flat, torch.full((1,), float(rank)))
        dist.reduce_scatter_tensor(part, torch.arange(float(n)))
    out["all_gather_into_tensor"] = flat.tolist()
    out["reduce_scatter_tensor"] = part.item()
    dist.reduce_scatter(part, [torch.full((1,), float(i)) for i in range(n)])
    out["reduce_scatter"] = part.item()
    one = torch.full((1,), float(rank))
    dist.reduce(one, dst=0)
    out["reduce"] = one.item() if rank == 0 else None
    one.fill_(7.0 if rank == 1 else 0.0)
    dist.broadcast(one, src=1)
    out["broadcast"] = one.item()
    lists = [torch.empty(1) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((1,), float(rank)), lists, dst=0)
    out["gather"] = [g.item() for g in lists] if rank == 0 else None
    dist.scatter(part, [torch.full((1,), 10.0 + i) for i in range(n)] if rank == 0 else None, src=0)
    out["scatter"] = part.item()
    spread = torch.empty(n)
    dist.all_to_all_single(spread, torch.full((n,), float(rank)))
    out["all_to_all_single"] = spread.tolist()
    pieces = [torch.empty(1) for _ in range(n)]
    dist.all_to_all(pieces, [torch.full((1,), float(rank))] * n)
    out["all_to_all"] = [p.item() for p in pieces]
    dist.barrier()
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"] = objects
    if rank == 0:  # a receive from any source is not wrapped: it reaches the real backend, unchecked
        dist.send(torch.full((1,), 5.0), dst=2)
    elif rank == 2:
        out["recv_anysource"] = dist.recv(part), part.item()
    keys_before = dist.group.WORLD.store.num_keys()
    for _ in range(50):
        dist.all_reduce(torch.ones(1))
    out["store_growth"] = dist.group.WORLD.store.num_keys() - keys_before
    return out


def test_every_collective_runs_checked_with_unchanged_results():
    n = 3
    results = _run(_every_op, n)
    for rank, out in enumerate(results):
        assert out["all_reduce"] == [6.0, 6.0] and out["async"] == [18.0, 18.0]
        assert out["all_gather"] == out["all_gather_into_tensor"] == out["all_to_all_single"] == [0.0, 1.0, 2.0]
        assert out["all_to_all"] == [0.0, 1.0, 2.0]
        assert out["reduce_scatter_tensor"] == n * rank and out["reduce_scatter"] == n * rank
        assert out["broadcast"] == 7.0  # rank 1's value
        assert out["scatter"] == 10.0 + rank
        assert out["all_gather_object"] == [{"rank": r} for r in range(n)]
        assert out["store_growth"] <= 3, "the detector must delete old fingerprints"
    assert results[0]["reduce"] == 3.0 and results[0]["gather"] == [0.0, 1.0, 2.0]
    assert results[2]["recv_anysource"] == (0, 5.0)


def _one_rank(rank, world_size, backend):
    env = _init(backend=backend)
    t = torch.ones(3, device=env.device)
    dist.all_reduce(t)
    objects = [None]
    dist.all_gather_object(objects, "hello")
    return type(dist.group.WORLD).__name__, env.backend, t.cpu().tolist(), objects


@pytest.mark.parametrize("backend", backend_params(1))
def test_one_rank_runs_checked(backend):
    assert _run(_one_rank, 1, backend) == [("CheckedGroup", backend, [1.0, 1.0, 1.0], ["hello"])]


def test_switch_and_timeout_come_from_the_environment():
    assert debug_backend.enabled({"MINIDDP_DEBUG": "collectives"})
    assert debug_backend.enabled({"MINIDDP_DEBUG": "trace,collectives"})
    assert not debug_backend.enabled({}) and not debug_backend.enabled({"MINIDDP_DEBUG": "1"})
    assert debug_backend.detector_timeout(timedelta(seconds=10), {}) == timedelta(seconds=9)
    assert (debug_backend.detector_timeout(timedelta(seconds=10), {"MINIDDP_DEBUG_TIMEOUT": "2.5"})
            == timedelta(seconds=2.5))
    with pytest.raises(ValueError, match="MINIDDP_DEBUG_TIMEOUT"):
        debug_backend.detector_timeout(timedelta(seconds=10), {"MINIDDP_DEBUG_TIMEOUT": "0"})
    with pytest.raises(ValueError, match="gloo or nccl"):
        debug_backend.register("mpi")


def _wrap_against_a_user_gather(rank, world_size):
    _init()
    torch.manual_seed(0)
    try:
        if rank == 0:
            miniddp.DistributedDataParallel(MLP())  # site: wrap
        else:
            dist.all_gather_object([None] * world_size, "not a model")  # site: user gather
    except miniddp.CollectiveMismatchError as exc:
        return str(exc)


def test_a_collective_under_an_issued_as_decorator_is_reported_at_the_users_line():
    message = _same_on_every_rank(_run(_wrap_against_a_user_gather))
    wrap, gather = (_site(_wrap_against_a_user_gather, m) for m in ("site: wrap", "site: user gather"))
    assert "differing in issuer (user code or miniddp)" in message
    assert ("rank 0: #1 all_gather() int64[1] from model check at wrap during "
            f"miniddp.DistributedDataParallel(MLP()) at {wrap}") in message  # not at the decorator's frame
    assert f"rank 1: #1 all_gather() int64[1] from user code at {gather}" in message


def _issued_from(path: str):
    """A function whose code lives at ``path``: as if a module there called ``call_site()``."""
    scope = {"call_site": fingerprint.call_site}
    exec(compile("def issue():\n    return call_site()\n", path, "exec"), scope)
    return scope["issue"]


def test_call_site_labels_and_the_package_at_any_depth():
    package = os.path.dirname(miniddp.__file__)
    line = inspect.currentframe().f_lineno
    issuer, site, code = fingerprint.call_site()
    assert (issuer, site) == ("user code", f"test_desync.py:{line + 1}") and code.startswith("issuer, site")
    with fingerprint.issued_as("outer"), fingerprint.issued_as("inner"):
        assert fingerprint.call_site()[0] == "inner"  # the innermost label wins
    deep = _issued_from(os.path.join(package, "engine", "deeper", "fake.py"))
    assert deep()[0] == fingerprint.UNLABELLED and deep()[1].startswith("test_desync.py:")  # miniddp's, unlabelled
    with fingerprint.issued_as("bucket 0 all-reduce"):
        assert deep()[0] == "bucket 0 all-reduce"
    own = _issued_from(os.path.join(package, "process_group", "fake.py"))  # the checking group's own frames
    assert own()[0] == "user code" and own()[1].startswith("test_desync.py:")
    outside = _issued_from(os.path.join(os.path.dirname(package), "not_miniddp", "fake.py"))
    assert outside()[1] == "fake.py:2"  # outside the package: the user's own module
