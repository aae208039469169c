"""The cost model: the α–β fit, the bucket-launch simulation against hand-computed timelines,
the no-overlap closed form where the two must agree, and the model read from a real trace."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import miniddp
from miniddp.costmodel.alpha_beta import AlphaBeta, fit_alpha_beta, measure_all_reduce, measure_overlap_cost
from miniddp.costmodel.auto_bucket import CANDIDATE_CAPS, choose_bucket_cap_mb, profile_from_ready
from miniddp.costmodel.simulate import (
    assignment_in_ready_order,
    best_bucket_cap_mb,
    naive_step_time,
    predict_step_time,
    simulate,
)
from miniddp.costmodel.step_profile import StepProfile
from miniddp.diagnostics.trace import Tracer, step_summary
from miniddp.engine.bucketing import MiB, bucket_size_limits
from miniddp.launching.spawn import run_on_ranks


def profile(ready, nbytes, forward=0.0, optimizer=0.0, tail=0.0, compute_end=0.0) -> StepProfile:
    """A synthetic step: float32 parameters of the given sizes, gradients ready at the given times."""
    return StepProfile(forward, list(ready), [b // 4 for b in nbytes], [torch.float32] * len(nbytes), tail,
                       optimizer, compute_end)


# --8<-- [start:fit]
def test_fit_recovers_alpha_and_beta_from_exact_timings():
    sizes = [4096, 65536, 2**20, 2**22, 2**24]
    ab = fit_alpha_beta(sizes, [80e-6 + s / 2.5e9 for s in sizes], world_size=4)
    assert ab.alpha_us == pytest.approx(80, rel=1e-9)
    assert ab.algbw_GBps == pytest.approx(2.5, rel=1e-9)
    assert ab.busbw_GBps == pytest.approx(2.5 * 2 * 3 / 4, rel=1e-9)  # nccl-tests: algbw x 2(n-1)/n
    assert ab.seconds(1e6) == pytest.approx(80e-6 + 1e6 / 2.5e9)


def test_fit_weighs_relative_errors_and_never_returns_a_negative_latency():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7, 1e8]
    seconds = [100e-6 + s * 1e-9 for s in sizes]
    seconds[-2], seconds[-1] = seconds[-2] * 0.98, seconds[-1] * 1.02  # 2% noise on the two largest
    ab = fit_alpha_beta(sizes, seconds)
    assert ab.alpha_us == pytest.approx(100, rel=0.05)  # plain least squares: 20 us, decided by the 100 MB point
    noisy = fit_alpha_beta([1e3, 1e6], [1e-9, 1e-3])  # the line through these crosses zero below 0
    assert noisy.alpha_s == 0 and noisy.beta_s_per_byte > 0


def _measure(rank, world_size):
    sizes = [4096, 2**18, 2**20, 2**22]
    points = measure_all_reduce(sizes, reps=5)
    return points, fit_alpha_beta(*zip(*points), world_size=world_size), measure_overlap_cost(2**20, reps=3)


def test_fit_on_a_real_two_rank_gloo_group_is_numpys_weighted_least_squares():
    (points, ab, cost), (points1, ab1, cost1) = run_on_ranks(_measure, 2, timeout=60)
    assert points == points1 and ab == ab1  # the slowest rank's times: one answer on every rank
    assert 0 <= cost == cost1 <= 1
    assert all(seconds > 0 for _, seconds in points) and ab.alpha_s >= 0  # beta's sign is the machine's: a
    # loaded machine can time a large message faster than a small one, and the fit must follow what it measured.
    # the oracle: numpy's least squares on the same measured points, each residual relative to its time.
    # Whatever the machine's noise, the fit is the best line through what was measured, never a bound on speed.
    sizes, seconds = (np.array(v, dtype=float) for v in zip(*points))
    beta, alpha = np.polyfit(sizes, seconds, 1, w=1 / seconds)
    if alpha < 0:  # the best line crosses zero below 0: the fit's refit through the origin
        beta, alpha = np.sum(sizes / seconds) / np.sum((sizes / seconds) ** 2), 0.0
    assert ab.alpha_s == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert ab.beta_s_per_byte == pytest.approx(beta, rel=1e-6)
# --8<-- [end:fit]


# --8<-- [start:simulate]
def test_three_buckets_match_a_hand_computed_timeline():
    # three 100-byte gradients ready at 1, 2, 10 s; each all-reduce takes 1 + 0.01 * 100 = 2 s
    p = profile(ready=[1, 2, 10], nbytes=[100, 100, 100], forward=5, optimizer=1)
    ab = AlphaBeta(alpha_s=1.0, beta_s_per_byte=0.01)
    got = simulate(p, [[0], [1], [2]], ab)
    assert got.launch_s == [1, 3, 10]  # bucket 1 is full at 2 but waits for bucket 0 (one stream, in order)
    assert got.finish_s == [3, 5, 12]
    assert got.exposed_comm_s == 2  # bucket 2 runs after backward's last gradient
    assert got.step_s == 5 + 12 + 1  # forward + last finish + optimizer
    assert got.comm_s == 6 and got.bucket_bytes == [100, 100, 100]


def test_a_bucket_waits_for_its_last_gradient_not_its_first():
    p = profile(ready=[1, 4, 6], nbytes=[100, 100, 100])
    got = simulate(p, [[0, 1], [2]], AlphaBeta(1.0, 0.01))  # bucket 0: 200 bytes, 3 s; bucket 1: 2 s
    assert got.launch_s == [4, 7] and got.finish_s == [7, 9] and got.exposed_comm_s == 3


def test_no_exposed_communication_when_it_fits_inside_backward():
    # backward keeps computing until 20 s (an input's gradient, say) after the last parameter's at 10 s
    p = profile(ready=[1, 5, 10], nbytes=[100, 100, 100], forward=3, compute_end=20)
    got = simulate(p, [[0], [1], [2]], AlphaBeta(1.0, 0.01))
    assert got.finish_s == [3, 7, 12]
    assert got.exposed_comm_s == 0 and got.step_s == 3 + 20


def test_naive_and_simulated_agree_with_one_bucket():
    p = profile(ready=[0.3, 0.1, 0.7, 0.2], nbytes=[400, 800, 1200, 40], forward=0.5, optimizer=0.25, tail=0.125)
    ab = AlphaBeta(0.01, 1e-4)
    one = [[1, 3, 0, 2]]
    assert simulate(p, one, ab).step_s == pytest.approx(naive_step_time(p, one, ab))
    assert predict_step_time(p, ab, bucket_cap_mb=100).step_s == pytest.approx(naive_step_time(p, one, ab))


def test_naive_and_simulated_agree_when_compute_is_free():
    p = profile(ready=[0, 0, 0, 0], nbytes=[400, 800, 1200, 40], forward=0.5, optimizer=0.25)
    ab = AlphaBeta(0.01, 1e-4)
    for assignment in ([[0], [1], [2], [3]], [[3, 2], [1, 0]], [[0, 1, 2, 3]]):
        assert simulate(p, assignment, ab).step_s == pytest.approx(naive_step_time(p, assignment, ab))


def test_overlap_that_costs_compute_stretches_the_backward():
    # the hand-computed case again, when an all-reduce takes half (then all) of the cores from backward
    p = profile(ready=[1, 2, 10], nbytes=[100, 100, 100], forward=5, optimizer=1)
    ab, buckets = AlphaBeta(1.0, 0.01), [[0], [1], [2]]
    half = simulate(p, buckets, ab, overlap_cost=0.5)
    assert half.launch_s == [1, 3, 12]  # gradient 1 is ready at 3, not 2: backward ran at half speed in 1-3
    assert half.finish_s == [3, 5, 14] and half.exposed_comm_s == 2 and half.step_s == 5 + 14 + 1
    serial = simulate(p, buckets, ab, overlap_cost=1)  # backward pauses while an all-reduce runs
    assert serial.launch_s == [1, 4, 14] and serial.step_s == naive_step_time(p, buckets, ab) == 22
    with pytest.raises(ValueError, match="overlap_cost"):
        simulate(p, buckets, ab, overlap_cost=1.5)


def test_full_overlap_cost_is_the_closed_form():
    p = profile(ready=[0.004, 0.001, 0.003, 0.002, 0.0045], nbytes=[MiB, 2 * MiB, MiB, 3 * MiB, 64],
                forward=0.002, tail=0.001)
    ab = AlphaBeta(2e-4, 1e-9)
    for cap in (0.5, 1, 2, 4, 25):
        assignment = assignment_in_ready_order(p, cap)
        got = predict_step_time(p, ab, cap, overlap_cost=1).step_s
        assert got == pytest.approx(naive_step_time(p, assignment, ab))


def test_naive_is_never_faster_than_the_simulation():
    p = profile(ready=[0.004, 0.001, 0.003, 0.002], nbytes=[MiB] * 4, forward=0.002)
    ab = AlphaBeta(2e-4, 1e-9)
    for cap in (0.5, 1, 2, 4, 25):
        assignment = assignment_in_ready_order(p, cap)
        assert simulate(p, assignment, ab).step_s <= naive_step_time(p, assignment, ab) + 1e-12
# --8<-- [end:simulate]


# --8<-- [start:best]
def test_best_bucket_cap_is_the_hand_computed_one():
    # eight 1 MiB gradients, one every ms; an all-reduce costs 0.5 ms + 1 ms per MiB. By hand:
    #   1 MiB buckets (1.5 ms each) queue up behind each other:   last finish 13 ms
    #   2 MiB buckets (2.5 ms), full at 2, 4, 6, 8 ms:            4.5, 7, 9.5, 12 ms
    #   4 MiB buckets (4.5 ms), full at 4 and 8 ms:               8.5, 13 ms
    #   one 8 MiB bucket (8.5 ms) after backward:                 16.5 ms
    p = profile(ready=[1e-3 * (k + 1) for k in range(8)], nbytes=[MiB] * 8)
    ab = AlphaBeta(alpha_s=0.5e-3, beta_s_per_byte=1e-3 / MiB)
    best, predictions = best_bucket_cap_mb(p, ab, caps=(0.5, 1, 2, 4, 8))
    assert best == 2
    got = {cap: round(pred.step_s * 1e3, 9) for cap, pred in predictions.items()}
    assert got == {0.5: 13, 1: 13, 2: 12, 4: 13, 8: 16.5}
    assert [len(pred.launch_s) for pred in predictions.values()] == [8, 8, 4, 2, 1]


def test_buckets_are_filled_in_arrival_order_as_after_the_rebuild():
    p = profile(ready=[3, 1, 2, 0], nbytes=[MiB] * 4)  # parameter 3 arrives first, then 1, 2, 0
    assert assignment_in_ready_order(p, 2) == [[3, 1], [2, 0]]
    assert assignment_in_ready_order(p, None) == [[3], [1, 2, 0]]  # torch's 1 MiB first bucket, then 25 MiB
# --8<-- [end:best]


def test_slowest_profile_takes_the_latest_rank_at_each_point():
    fast = profile(ready=[1, 2], nbytes=[4, 4], forward=1, optimizer=1, tail=0.5)
    slow = profile(ready=[0.5, 3], nbytes=[4, 4], forward=2, optimizer=2, tail=0.25)
    merged = StepProfile.slowest([fast, slow])
    assert merged.forward_s == 2 and merged.ready_s == [0.5, 3] and merged.optimizer_s == 2 and merged.tail_s == 0.5
    late = profile(ready=[4, 2], nbytes=[4, 4], forward=0)  # gradient 0 at 4 s, but forward ended 2 s earlier
    assert StepProfile.slowest([late, slow]).ready_s == [2, 3]


def _traced(rank, world_size, cap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 4))
    tracer = Tracer(rank)
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=cap, tracer=tracer)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):  # the second step runs on the rebuilt buckets
        tracer.clear()
        dist.barrier()
        with tracer.span("forward"):
            loss = F.cross_entropy(ddp(torch.randn(8, 32)), torch.randint(0, 4, (8,)))
        loss.backward()
        with tracer.span("optimizer"):
            opt.step()
        opt.zero_grad()
    return tracer.events, ddp.bucket_assignment, [n for n, _ in model.named_parameters()]


def test_a_profile_read_from_a_real_trace_adds_up_and_predicts_ddps_own_buckets():
    cap = 0.01  # about 10 KiB: two buckets here
    results = run_on_ranks(_traced, 2, args=(cap,), timeout=60)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 4))
    profiles = []
    for events, assignment, names in results:
        p = StepProfile.from_events(events, model.named_parameters())
        profiles.append(p)
        s = step_summary(events)
        assert p.forward_s == pytest.approx(s["forward_s"]) and p.optimizer_s == pytest.approx(s["optimizer_s"])
        measured_backward = s["step_s"] - s["forward_s"] - s["optimizer_s"]
        finish = max(e["t"] for e in events if e["name"] == "bucket finished") - min(
            e["t"] for e in events if e["name"] == "backward start")
        assert max(p.backward_s, finish) + p.tail_s == pytest.approx(measured_backward)  # nothing left out
        assert p.ready_s.index(min(p.ready_s)) == len(names) - 1  # the head's bias is ready first
        predicted = [[names[i] for i in bucket] for bucket in assignment_in_ready_order(p, cap)]
        assert predicted == assignment  # the model simulates the buckets DDP really built
    merged = StepProfile.slowest(profiles)
    assert merged.backward_s >= min(p.backward_s for p in profiles)
    prediction = predict_step_time(merged, AlphaBeta(1e-4, 1e-9), cap)
    assert len(prediction.launch_s) == len(results[0][1]) and prediction.step_s > merged.forward_s


# --8<-- [start:auto]
# bucket_cap_mb="auto": the cost model picks the cap at the rebuild (miniddp/costmodel/auto_bucket.py)

def test_auto_picks_the_hand_computed_cap_for_each_overlap_cost():
    # the hand-computed timeline of test_best_bucket_cap_is_the_hand_computed_one, as ready-time dicts
    params = [torch.empty(MiB // 4) for _ in range(8)]
    p = profile_from_ready([{k: 1e-3 * (k + 1) for k in range(8)}], params)
    ab = AlphaBeta(alpha_s=0.5e-3, beta_s_per_byte=1e-3 / MiB)
    free = choose_bucket_cap_mb(p, ab, overlap_cost=0.0, caps=(0.5, 1, 2, 4, 8))
    assert free.cap_mb == 2 and free.predicted_ms[2] == pytest.approx(12) and free.buckets == {0.5: 8, 1: 8, 2: 4,
                                                                                               4: 2, 8: 1}
    # no overlap (shared CPU cores): 8 ms of compute + n x 0.5 ms + 8 ms; the fewest buckets win
    shared = choose_bucket_cap_mb(p, ab, overlap_cost=1.0, caps=(0.5, 1, 2, 4, 8))
    assert shared.cap_mb == 8 and shared.predicted_ms == pytest.approx({0.5: 20, 1: 20, 2: 18, 4: 17, 8: 16.5})


def test_auto_profile_takes_the_latest_rank_and_puts_missing_gradients_last():
    params = [torch.empty(3), torch.empty(5, dtype=torch.float64), torch.empty(2)]
    p = profile_from_ready([{0: 0.1, 1: 0.5, 2: 0.2}, None, {0: 0.3, 1: 0.4}], params)  # rank 1 joined early
    assert p.ready_s == [0.3, 0.5, 0.5] and p.numels == [3, 5, 2] and p.nbytes == [12, 40, 8]
    assert profile_from_ready([None, None], params).ready_s == [0.0] * 3  # nothing recorded: all at once


@pytest.mark.parametrize("bad", ["fast", "Auto", "25", ""])
def test_auto_other_strings_are_refused_naming_bucket_cap_mb(bad):
    with pytest.raises(ValueError, match=r"bucket_cap_mb=.*or \"auto\""):
        bucket_size_limits(bad)
    assert bucket_size_limits("auto") == bucket_size_limits(None)  # until the rebuild: torch's defaults


def test_auto_is_a_config_value_and_a_cli_word():
    from miniddp.training.cli import parse_config
    from miniddp.training.config import TrainingConfig, field_help
    assert TrainingConfig(ddp_bucket_cap_mb="auto").ddp_bucket_cap_mb == "auto"
    assert parse_config(["--ddp_bucket_cap_mb", "auto"]).ddp_bucket_cap_mb == "auto"
    assert parse_config(["--ddp_bucket_cap_mb", "4"]).ddp_bucket_cap_mb == 4.0
    assert "auto" in field_help()["ddp_bucket_cap_mb"]
    with pytest.raises(ValueError, match="ddp_bucket_cap_mb='fast'.*auto"):
        TrainingConfig(ddp_bucket_cap_mb="fast")
    with pytest.raises(SystemExit):
        parse_config(["--ddp_bucket_cap_mb", "fast"])


def _mib_mlp() -> torch.nn.Module:  # three 1 MiB weights: the caps give 5, 4, 3, 2 or 1 buckets
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(),
                               torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                               torch.nn.GELU(), torch.nn.Linear(512, 4))


def _train(ddp, steps, rank, start=0):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own batches
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]


def _auto_against_fixed_and_torch(rank, world_size, steps):
    import copy
    import io
    torch.manual_seed(rank)  # ranks start different: the wrap broadcast must copy rank 0's
    model = _mib_mlp()
    auto = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb="auto")
    after_auto = _train(auto, steps, rank)
    cap = auto.auto_bucket_cap_mb
    fixed = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap)
    after_fixed = _train(fixed, steps, rank)
    oracle = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    after_torch = _train(oracle, steps, rank)
    # resume: the layout state round trip (through torch.save, as a checkpoint) keeps the cap, no measuring
    buffer = io.BytesIO()
    torch.save(auto.layout_state(), buffer)
    resumed = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb="auto")
    resumed.load_layout_state(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    # saved after step 1, before the rebuild: the ready times travel, the resumed run measures and chooses
    early = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb="auto")
    _train(early, 1, rank)
    state = early.layout_state()
    late = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb="auto")
    late.load_layout_state(state)
    _train(late, 1, rank, start=1)
    return {"cap": cap, "report": auto.auto_bucket_report, "buckets": auto.bucket_assignment,
            "fixed_buckets": fixed.bucket_assignment, "auto": after_auto, "fixed": after_fixed, "torch": after_torch,
            "resumed": (resumed.auto_bucket_cap_mb, resumed.bucket_assignment, resumed.auto_bucket_report),
            "early_state": (state["auto_bucket_cap_mb"], len(state["auto_ready_s"])),
            "late": (late.auto_bucket_cap_mb, late.bucket_assignment, late.auto_bucket_report["measure_s"])}


def test_auto_chooses_one_cap_everywhere_and_trains_like_that_cap_and_like_torch():
    r0, r1 = run_on_ranks(_auto_against_fixed_and_torch, 2, args=(3,), timeout=60)
    assert r0["cap"] == r1["cap"] and r0["buckets"] == r1["buckets"]  # agreed: the same buckets on every rank
    assert r0["cap"] in CANDIDATE_CAPS and r0["report"]["bucket_cap_mb"] == r0["cap"]
    assert r0["buckets"] == r0["fixed_buckets"]  # rebuilt in arrival order with the chosen cap
    assert r0["report"]["buckets"][r0["cap"]] == len(r0["buckets"])  # the model predicted DDP's own buckets
    assert r0["report"]["measure_s"] > 0  # what measuring cost is reported (its speed: benchmarks/auto_bucket.py)
    for r in (r0, r1):
        assert all(torch.equal(a, b) for a, b in zip(r["auto"], r["fixed"]))  # 2 ranks: bitwise, any layout
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(r["auto"], r["torch"]))
        assert not torch.allclose(r["auto"][-1], r["fixed"][-1] + 1e-4)  # the check sees a step's difference
        cap, buckets, report = r["resumed"]
        assert cap == r0["cap"] and buckets == r0["buckets"] and report["alpha_us"] is None  # not re-measured
        assert r["early_state"][0] is None and r["early_state"][1] > 0
        assert r["late"][0] in CANDIDATE_CAPS and r["late"][2] > 0  # measured and chose after resuming
    assert r0["late"][:2] == r1["late"][:2]


def _auto_under_join(rank, world_size, batches):
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(_mib_mlp(), bucket_cap_mb="auto")
    with ddp.join():  # a joined rank shadows the rebuild, the measurement included
        after = _train(ddp, batches[rank], rank)
    return ddp.auto_bucket_cap_mb, ddp.bucket_assignment, [p.detach() for p in ddp.parameters()], after


@pytest.mark.parametrize("batches", [(3, 1), (3, 0)], ids=["joins_after_step_1", "joins_before_any_backward"])
def test_auto_under_join_agrees_without_hanging(batches):
    r0, r1 = run_on_ranks(_auto_under_join, 2, args=(batches,), timeout=60)
    assert r0[0] == r1[0] and r0[0] in CANDIDATE_CAPS and r0[1] == r1[1]
    assert all(torch.equal(a, b) for a, b in zip(r0[2], r1[2]))  # the final model is the same everywhere
# --8<-- [end:auto]
