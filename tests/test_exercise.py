"""`miniddp exercise`: the spec checks a learner's file, and can fail.

For every exercise: a correct solution written apart from the reference
(``tests/exercise_independent/<exercise>.py``) passes the whole spec through the swap, the
untouched skeleton fails, and each classic mistake fails the spec item that explains it. A mistake
is the reference with one edit, the way a learner gets it wrong. To keep the suite fast, one pytest
session checks every exercise's implementations: each independent solution on the whole spec,
the reference (whose whole spec the plain suite runs) and the skeleton on the first item, each
mistake on the items it must fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miniddp.teaching.exercise.catalog import BY_NAME, EXERCISES
from miniddp.teaching.exercise.exercise_command import main, run_check, run_checks
from miniddp.teaching.exercise.skeleton import BEGIN, END, make_skeleton, reference_without_markers
from miniddp.teaching.exercise.swap import LearnerFileError

ROOT = Path(__file__).resolve().parents[1]
INDEPENDENT = ROOT / "tests" / "exercise_independent"  # correct solutions unlike the reference: the spec is fair
HANG_TIMEOUT_S = 15  # the wrong-way ring deadlocks on uneven chunks: the check's timeout stops it
S, A, B = "tests/test_sharding.py::", "tests/test_averaging.py::", "tests/test_bucketing.py::"
N, F, H = "tests/test_no_sync.py::", "tests/test_buffers.py::", "tests/test_comm_hooks.py::"
D, U, J = "tests/test_ddp.py::", "tests/test_unused.py::", "tests/test_join.py::"
G = "tests/test_static_graph.py::"
K = "tests/test_bucketed.py::"
Z, R = "tests/test_zero.py::", "tests/test_zero_exercise_spec.py::"
FS = "tests/test_fsdp_exercise_spec.py::"
FS_GRAD = FS + "test_each_shard_holds_its_rows_of_the_mean_gradient_and_trains_as_torch_and_one_process"
FS_PREFETCH = FS + "test_prefetch_posts_the_next_units_gather_before_this_unit_computes"
FS_MEMORY = FS + "test_only_the_computing_unit_is_whole_and_the_blocks_are_freed_after_the_forward"

# exercise -> (what the learner got wrong, the reference text, what they wrote, the items it must fail)
MISTAKES = {
    "sharding": [
        ("no padding: ranks get different numbers of samples",
         """            while len(indices) < self.total_size:
                indices += indices[: self.total_size - len(indices)]
        assert len(indices) == self.total_size, (len(indices), self.total_size)

        shard = indices[self.rank : self.total_size : self.num_replicas]  # stride by rank
        assert len(shard) == self.num_samples, (len(shard), self.num_samples)""",
         """            pass
        shard = indices[self.rank :: self.num_replicas]""",
         [S + "test_every_rank_gets_the_same_number_of_samples"]),
        ("set_epoch ignored: every epoch the same order",
         "        self.epoch = epoch\n", "        pass\n",
         [S + "test_without_set_epoch_every_epoch_has_the_same_order"]),
        ("the permutation seeded with the rank: shards overlap",
         "g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed + self.epoch + self.rank)",
         [S + "test_shards_cover_the_data_and_overlap_only_by_padding"]),
        ("contiguous blocks instead of a stride: the global batch depends on the split",
         "shard = indices[self.rank : self.total_size : self.num_replicas]",
         "shard = indices[self.rank * self.num_samples : (self.rank + 1) * self.num_samples]",
         [S + "test_global_batch_is_the_same_set_whatever_the_split"]),
    ],
    "averaging": [
        ("no division by the world size: the sum, not the mean",
         """    if predivide:  # what DDP does: the sum can then never exceed the largest input
        tensor.div_(world)""", """    if predivide:  # what DDP does: the sum can then never exceed the largest input
        pass""",
         [A + "test_average_gradients_is_the_mean_over_ranks"]),
        ("always divides after the sum: float16 overflows",
         "    if predivide:  # what DDP does", "    if False:  # what DDP does",
         [A + "test_predivision_avoids_fp16_overflow_and_postdivision_avoids_underflow"]),
        ("a parameter listed twice is averaged twice",
         "    for grad in _gradients(params_or_module):",
         "    for grad in [p.grad for p in params_or_module if p.grad is not None]:",
         [A + "test_average_gradients_accepts_params_and_skips_none_and_duplicates"]),
    ],
    "ring": [
        ("sends the wrong way round the ring",
         "_exchange(flat[s0:s1], right, incoming, left, group)", "_exchange(flat[s0:s1], left, incoming, right, group)",
         [A + "test_ring_all_reduce_equals_dist_all_reduce"]),
        ("reduce-scatter one step short",
         """("reduce-scatter", (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)""",
         """("reduce-scatter", (rank - s) % n, (rank - s - 1) % n) for s in range(n - 2)""",
         [A + "test_ring_schedule_sums_every_chunk_everywhere"]),
        ("no all-gather: each rank keeps only its own finished chunk",
         """    all_gather = [("all-gather", (rank + 1 - s) % n, (rank - s) % n) for s in range(n - 1)]""",
         "    all_gather = []",
         [A + "test_ring_schedule_sums_every_chunk_everywhere"]),
        ("the remainder all in the last chunk: chunks of very different sizes",
         "end = start + base + (1 if i < extra else 0)", "end = start + base + (extra if i == world_size - 1 else 0)",
         [A + "test_chunk_bounds_tile_the_tensor_with_sizes_differing_by_at_most_one"]),
    ],
    "bucketed": [
        ("forgets to divide: the sum over ranks, not the mean",
         "torch.div(p.grad, self.world_size, out=bucket.views[k])", "bucket.views[k].copy_(p.grad)",
         [K + "test_matches_torch_ddp"]),
        ("launches a bucket the moment it completes (picotron's rule), not in bucket order",
         "        while self._next < len(self.buckets) and self.buckets[self._next].complete:\n"
         "            first = self.buckets[self._next]\n",
         "        if bucket.complete:\n            first = bucket\n",
         [K + "test_buckets_launch_in_bucket_order_on_every_rank",
          K + "test_ranks_that_complete_buckets_in_different_orders_still_pair_them"]),
        ("never waits for the all-reduces nor copies the mean back into .grad",
         "            bucket.work.wait()  # the buffer now holds the sum over ranks of grad / N: the mean\n"
         "            for p, view in zip(bucket.params, bucket.views):\n                p.grad.copy_(view)\n",
         "            pass\n", [K + "test_equals_one_process_on_the_global_batch"]),
        ("syncs inside no_sync: every micro-batch pays an all-reduce",
         "        if not self._sync:  # inside no_sync: the gradient stays in p.grad, the next ones add to it\n"
         "            return\n", "", [K + "test_no_sync_keeps_gradients_local_then_averages_the_sums"]),
        ("fills the buckets from the first parameter", "    for i in reversed(range(len(params))):",
         "    for i in range(len(params)):", [K + "test_buckets_fill_from_the_last_parameter_one_dtype_each"]),
        ("the wrap broadcasts nothing: each rank keeps its own initial model",
         "            dist.broadcast(tensor.detach(), src=src, group=self.process_group)", "            pass",
         [K + "test_wrap_broadcasts_parameters_and_buffers_from_rank_0"]),
    ],
    "bucketing": [
        ("one bucket mixes dtypes", "key = (t.dtype, t.device)", "key = t.device", [B + "test_pytorch_cases"]),
        ("filled in reverse registration order", "for i, t in enumerate(tensors):",
         "for i, t in reversed(list(enumerate(tensors))):", [B + "test_pytorch_cases"]),
        ("the last limit for every bucket, not the limits in sequence", "k = limit_index.setdefault(key, 0)",
         "k = len(limits) - 1", [B + "test_pytorch_cases"]),
        ("a bucket closes only above its limit", "if size >= limits[k]:", "if size > limits[k]:",
         [B + "test_pytorch_cases"]),
        ("each rank rebuilds the buckets in its own arrival order: buckets differ across ranks",
         "    dist.broadcast(agreed, src=dist.get_global_rank(group, 0), group=group)  # rank 0's order wins\n",
         "", [B + "test_rebuilt_buckets_are_rank_0s_order_when_ranks_see_different_orders"]),
        ("the rebuild ignores the arrival order (and the broadcast): the wrap's buckets again",
         "    arrived = list(dict.fromkeys(ready_order))  # first arrival of each parameter\n",
         "    return list(reversed(compute_bucket_assignment(params, size_limits)))\n",
         [B + "test_rebuild_follows_the_order_gradients_arrived"]),
    ],
    "no_sync": [
        ("syncs one micro-step early (step % k == 0)", "return (step + 1) % gradient_accumulation_steps == 0",
         "return step % gradient_accumulation_steps == 0",
         [N + "test_should_sync_syncs_the_last_micro_batch_of_each_window"]),
        ("a no_sync that does not stop the sync", "    ddp.require_backward_grad_sync = False\n", "    pass\n",
         [N + "test_inside_no_sync_gradients_stay_local_then_sync_averages_the_sums"]),
        ("a short last window counted as a full one", "return [end - start for start, end in zip([-1] + ends, ends)]",
         "return [gradient_accumulation_steps for _ in ends]",
         [N + "test_should_sync_syncs_the_last_micro_batch_of_each_window"]),
    ],
    "buffers": [
        ("buffers broadcast from the last rank", "        broadcast_coalesced(buffers, src, group)",
         "        broadcast_coalesced(buffers, dist.get_world_size(group) - 1, group)",
         [F + "test_each_forward_starts_from_rank_0s_buffers_not_another_ranks"]),
        ("the wrap copies parameters but not buffers", "        tensors += [b for b in module.buffers()]",
         "        pass", [F + "test_wrap_broadcasts_parameters_and_buffers_from_rank_0"]),
        ("the flat message is never copied back", "t.data.copy_(flat[offset : offset + t.numel()].view_as(t))",
         "pass", [F + "test_coalesced_broadcast_equals_one_broadcast_per_tensor"]),
    ],
    "compression": [
        ("compresses without dividing: the sum, not the mean", "compressed = buffer.to(dtype).div_(group.size())",
         "compressed = buffer.to(dtype)", [H + "test_bf16_works_on_gloo_as_torchs_own_hook_would"]),
        ("sends full precision: no bytes saved", "compressed = buffer.to(dtype).div_(group.size())",
         "compressed = buffer.clone().div_(group.size())",
         [H + "test_hooks_give_torchs_parameters_and_count_their_bytes"]),
        ("the bf16 hook sends float16", "return _compress_hook(torch.bfloat16, process_group, bucket)",
         "return _compress_hook(torch.float16, process_group, bucket)",
         [H + "test_bf16_works_on_gloo_as_torchs_own_hook_would"]),
    ],
    "powersgd": [
        ("no error feedback: what compression dropped is lost", "            mat += err\n", "            pass\n",
         [H + "test_powersgd_hooks_equal_the_algorithm_on_the_summed_gradients"]),
        ("no warm start: a fresh random Q every step",
         "q_flat = state.q_memory_dict.get(b) if state.warm_start else None", "q_flat = None",
         [H + "test_powersgd_hooks_equal_the_algorithm_on_the_summed_gradients"]),
        ("P not orthogonalised after its sum", "            orthogonalize(p, state.orthogonalization_epsilon)\n",
         "", [H + "test_powersgd_hooks_equal_the_algorithm_on_the_summed_gradients"]),
        ("Q summed, not averaged: every rank writes back N times the mean", "        q_flat.div_(world)\n", "",
         [H + "test_hooks_give_torchs_parameters_and_count_their_bytes"]),
    ],
    "reducer": [
        ("a bucket launched as soon as it is complete, not in bucket order",
         "self.observers.grad_ready(i, self.names[i])\n        self._launch(state)\n",
         "self.observers.grad_ready(i, self.names[i])\n        if state.pending[b] == 0:\n"
         "            self._communicate(state, bucket)\n",
         [B + "test_buckets_launch_in_order_on_every_rank"]),
        ("the default path forgets to divide by N", "bucket.put(k, grad, state.collective.divisor)",
         "bucket.put(k, grad, 1)", [D + "test_matches_torch_ddp_at_several_world_sizes"]),
        ("divides by N whatever the collective: a comm hook divides a second time",
         "bucket.put(k, grad, state.collective.divisor)", "bucket.put(k, grad, self.world_size)",
         [H + "test_a_registered_hook_trains_as_torch_ddp_with_the_same_hook"]),
        ("the averaged buckets never land in .grad",
         "                state.collective.land(bucket, result, counts, self.as_view)  # the one place that sets .grad",
         "                pass", [D + "test_equals_one_process_on_the_global_batch"]),
    ],
    "unused": [
        ("the walk never goes past the outputs' own nodes",
         "        stack.extend(next_node for next_node, _ in node.next_functions)", "        pass",
         [U + "test_graph_walk_finds_exactly_the_parameters_off_the_path"]),
        ("an unused parameter sends zeros as if used: its .grad overwritten with zeros",
         "        return grad, accumulated", "        return None, True",
         [U + "test_parameter_unused_on_every_rank_keeps_its_gradient"]),
        ("a gradient accumulated under no_sync dropped when the synced step skips the parameter",
         "        return grad, accumulated", "        return None, accumulated", [D + "test_matches_torch_ddp"]),
    ],
    "static_graph": [
        ("the calls are not reset at each forward: a parameter is never complete again",
         "        self.fired = [0] * len(self.names)\n        return [] if", "        return [] if",
         [G + "test_reentrant_checkpointing_with_static_graph_equals_torch"]),
        ("the first backward's counts are not learned: every parameter expected once",
         "            self.expected = list(self.fired)", "            self.expected = [1] * len(self.fired)",
         [G + "test_reentrant_checkpointing_with_static_graph_equals_torch"]),
        ("no rank ever says its graph changed: a new gradient is taken silently",
         "        counts.flags = changed + [int(any(changed) and r == self.rank) for r in range(self.world_size)]",
         "        counts.flags = changed + [0] * self.world_size",
         [G + "test_a_parameter_used_after_the_first_iteration_is_named_on_every_rank"]),
    ],
    "join": [
        ("a joined rank answers one round and leaves: the others hang",
         "        while True:  # this rank is out of data", "        for _ in range(1):  # this rank is out of data",
         [J + "test_join_matches_torch_ddp_join_on_uneven_inputs"]),
        ("an active rank does not say so in the round", "        vector[rank] = 1", "        vector[rank] = 0",
         [J + "test_join_matches_torch_ddp_join_on_uneven_inputs"]),
        ("a joined rank ignores throw_on_early_termination", "            if self.throw:\n                raise "
         "EarlyTerminationError(f\"rank {self.rank}", "            if False:\n                raise "
         "EarlyTerminationError(f\"rank {self.rank}",
         [J + "test_throw_on_early_termination_raises_on_every_rank_at_the_same_iteration"]),
    ],
    "sharded_optimizer": [
        ("every rank steps every parameter: the optimizer state is not sharded",
         '"params": mine} for group, mine in zip(self.param_groups, self.owned[self.rank])]',
         '"params": group["params"]} for group in self.param_groups]',
         [Z + "test_matches_torch_zero_and_one_process"]),
        ("no broadcast after the step: each rank sees only its own shard's update",
         "        self._sync_params()\n        return loss", "        return loss",
         [Z + "test_matches_torch_zero_and_one_process"]),
        ("every parameter broadcast from rank 0, not from its owner", "source = dist.get_global_rank(group, owner)",
         "source = dist.get_global_rank(group, 0)", [Z + "test_matches_torch_zero_and_one_process"]),
        ("parameters dealt round-robin by position, not greedily by size: the state unbalanced",
         "self.owned = partition_by_size(self.param_groups, self.world_size)",
         'self.owned = [[g["params"][r :: self.world_size] for g in self.param_groups] '
         'for r in range(self.world_size)]',
         [Z + "test_matches_torch_zero_and_one_process"]),
    ],
    "reduce_scatter": [
        ("never divides by N (the base class's divisor 1): each shard holds the sum, not the mean",
         "self.shards, self.divisor, self.frees_gradients = shards, divisor, frees_gradients",
         "self.shards, self.frees_gradients = shards, frees_gradients",
         [R + "test_each_rank_holds_its_chunk_of_the_mean_gradient"]),
        ("chunk boundaries off by one: the chunk's last element left out",
         "start, stop = max(lo, offset), min(hi, offset + param.numel())",
         "start, stop = max(lo, offset), min(hi - 1, offset + param.numel())",
         [R + "test_each_rank_holds_its_chunk_of_the_mean_gradient"]),
        ("the last chunk not padded: the reduce-scatter's input is not N whole chunks",
         "reduce_scatter(chunk, self.shards.padded(bucket.index, flat), group)", "reduce_scatter(chunk, flat, group)",
         [R + "test_each_rank_holds_its_chunk_of_the_mean_gradient"]),
        ("a second backward's chunk replaces the first instead of adding to it",
         "        if self.grad[b] is None:\n            self.grad[b] = mean_chunk\n        else:\n"
         "            self.grad[b] += mean_chunk\n", "        self.grad[b] = mean_chunk\n",
         [R + "test_each_rank_holds_its_chunk_of_the_mean_gradient",
          R + "test_stages_1_and_2_train_what_torch_ddp_and_adamw_train"]),
        ("all-reduces the whole bucket and keeps its own chunk: twice the bytes of a reduce-scatter",
         "        future = reduce_scatter(chunk, self.shards.padded(bucket.index, flat), group)\n",
         "        lo, hi = self.shards.rank * chunk.numel(), (self.shards.rank + 1) * chunk.numel()\n"
         "        padded = self.shards.padded(bucket.index, flat)\n"
         "        whole = torch.distributed.all_reduce(padded, group=group, async_op=True)\n"
         "        future = whole.get_future().then(lambda f: f.value()[0][lo:hi].clone())\n",
         [R + "test_a_backward_reduce_scatters_each_bucket_and_all_reduces_no_gradient"]),
    ],
    "fsdp": [
        ("no mean: the sum over ranks lands in the shards' .grad", "        out.div_(self.world_size)\n", "",
         [FS_GRAD]),
        ("reshard frees but keeps the state 'unsharded': the backward's unshard gathers nothing again",
         '            p.register("freed" if mid_step else "shard")\n        self.state = "sharded"\n',
         '            p.register("freed" if mid_step else "shard")\n', [FS_GRAD]),
        ("prefetches the unit about to compute, not the next one: nothing travels ahead",
         "order[at + 1].issue_gather()", "order[at].issue_gather()", [FS_PREFETCH]),
        ("prefetch waits for the next unit's gather (unshard): nothing overlaps, two blocks whole",
         "order[at + 1].issue_gather()", "order[at + 1].unshard()", [FS_PREFETCH, FS_MEMORY]),
        ("reshard registers the placeholder but never frees: every block stays whole after its forward",
         "            p.free()\n", "", [FS_MEMORY]),
        ("mid-step reshard registers the shard: a parent reading the parameter silently gets a shard",
         'p.register("freed" if mid_step else "shard")', 'p.register("shard")', [FS_MEMORY]),
        ("the gradients laid out parameter by parameter, not rank by rank: a rank receives other parameters' rows",
         "p.write_gradient(send[:, start : start + p.shard_numel])",
         "p.write_gradient(send.view(-1)[self.world_size * start : self.world_size * (start + p.shard_numel)]"
         ".view(self.world_size, -1))", [FS_GRAD]),
    ],
}


def _independent(name: str) -> list[Path]:
    """The correct solutions of exercise ``name`` written apart from the reference."""
    return sorted(INDEPENDENT.glob(f"{name}.py")) + sorted(INDEPENDENT.glob(f"{name}_*.py"))


def _reference(name: str) -> str:
    return reference_without_markers((ROOT / BY_NAME[name].source).read_text(encoding="utf-8"))


def _write(tmp_path, name, text) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    return path


def test_every_exercise_has_three_mistakes_and_its_spec_items_exist():
    assert [e.name for e in EXERCISES] == ["sharding", "averaging", "ring", "bucketed", "bucketing", "no_sync",
                                           "buffers", "compression", "powersgd", "reducer", "unused", "static_graph",
                                           "join", "sharded_optimizer", "reduce_scatter", "fsdp"]
    for e in EXERCISES:
        assert len(MISTAKES[e.name]) >= 3, e.name
        assert _independent(e.name), f"no correct solution written apart from the reference: {INDEPENDENT}/{e.name}.py"
        for test in [item.test for item in e.spec]:
            file, _, function = test.partition("::")
            assert f"def {function}(" in (ROOT / file).read_text(encoding="utf-8"), test
        source = (ROOT / e.source).read_text(encoding="utf-8")
        assert source.count(BEGIN) == source.count(END) > 0


def _implementations(name: str, folder: Path) -> tuple[list, dict]:
    """Exercise ``name``'s checks: the reference through the swap on the first item (the plain suite runs its
    whole spec), each independent solution through the whole spec, the skeleton on the first item, each
    mistake on the items it must fail; and where each kind starts in that list."""
    chosen, reference, independent = BY_NAME[name], _reference(name), _independent(name)
    folder.mkdir()
    first = [chosen.spec[0].test]
    skeleton = make_skeleton((ROOT / chosen.source).read_text(encoding="utf-8"), chosen.names, chosen.page, name)
    checks = [(name, _write(folder, "reference", reference), first, 120),
              (name, _write(folder, "skeleton", skeleton), first, 120)]
    # copied out of tests/, as a learner's file sits outside the spec's own modules
    checks += [(name, _write(folder, f"independent{n}", path.read_text(encoding="utf-8")), None, 120)
               for n, path in enumerate(independent)]
    for n, (why, old, new, must_fail) in enumerate(MISTAKES[name]):
        assert reference.count(old) == 1, why  # the mistake still applies to the reference's text
        checks.append((name, _write(folder, f"mistake{n}", reference.replace(old, new)), must_fail, HANG_TIMEOUT_S))
    return checks, {"independent": [p.name for p in independent]}


def _check_every_exercise(folder: Path) -> dict:
    """Every exercise's implementations in ONE pytest session (pytest, torch and the ranks' forkserver start
    once for all of them, not once per exercise): {name: {"reference", "skeleton", "independent", "mistakes"}}."""
    checks, kinds = [], {}
    for e in EXERCISES:
        mine, kind = _implementations(e.name, folder / e.name)
        kinds[e.name] = (len(checks), len(mine), kind)
        checks += mine
    results = run_checks(checks)
    verdicts = {}
    for name, (at, count, kind) in kinds.items():
        passed, [skeleton], *rest = results[at : at + count]
        n = len(kind["independent"])
        verdicts[name] = {"reference": passed, "skeleton": skeleton, "mistakes": rest[n:],
                          "independent": list(zip(kind["independent"], rest[:n]))}
    return verdicts


@pytest.fixture(scope="module")
def verdicts(once, tmp_path_factory):
    """Computed once per session, whichever xdist worker asks first (conftest's ``once``)."""
    return once("exercise_verdicts", lambda: _check_every_exercise(tmp_path_factory.mktemp("exercises")))


@pytest.mark.parametrize("name", [e.name for e in EXERCISES])
def test_the_reference_passes_the_skeleton_fails_and_each_mistake_fails_its_item(verdicts, name):
    assert _independent(name), f"no correct solution written apart from the reference: {INDEPENDENT}/{name}.py"
    got = verdicts[name]
    assert got["reference"] and all(i["passed"] for i in got["reference"]), got["reference"]
    for file, items in got["independent"]:
        failing = [f"{i['test']}: {i['reason']}" for i in items if not i["passed"]]
        assert not failing, f"{file}, correct and written apart from the reference, fails {failing}"
    skeleton = got["skeleton"]
    assert not skeleton["passed"] and "NotImplementedError" in skeleton["reason"], skeleton
    assert len(got["mistakes"]) == len(MISTAKES[name])
    for (why, *_), items in zip(MISTAKES[name], got["mistakes"]):  # a hanging ring: stopped by the timeout, named
        assert items and not any(i["passed"] for i in items), why
        assert all(i["reason"] for i in items), why


@pytest.mark.parametrize("name", [e.name for e in EXERCISES])
def test_the_skeleton_keeps_the_signatures_and_takes_out_every_solution_line(tmp_path, name):
    chosen = BY_NAME[name]
    source = (ROOT / chosen.source).read_text(encoding="utf-8")
    skeleton = make_skeleton(source, chosen.names, chosen.page, name)
    compile(skeleton, "skeleton", "exec")
    solution = [line for block in source.split(BEGIN)[1:] for line in block.split(END)[0].splitlines()[1:]]
    owned = skeleton.count("raise NotImplementedError(")
    assert owned >= 1 and BEGIN not in skeleton and END not in skeleton
    for line in {line for line in solution if len(line.strip()) > 30}:  # the blocks of this exercise's names
        if line in skeleton:
            assert source.count(line) > 1 or owned < source.count(BEGIN), (name, line)
    for required in chosen.required:
        assert f"def {required}(" in skeleton or f"class {required}" in skeleton, required


def test_start_writes_the_skeleton_once_and_check_names_a_missing_function(tmp_path, capsys):
    folder = tmp_path / "mine"
    assert main(["start", "sharding", "--dir", str(folder)]) == 0
    written = (folder / "sharding.py").read_text(encoding="utf-8")
    assert "NotImplementedError" in written and BEGIN not in written
    assert main(["start", "sharding", "--dir", str(folder)]) == 1  # never overwritten
    assert (folder / "sharding.py").read_text(encoding="utf-8") == written
    (folder / "sharding.py").write_text("class Sampler:\n    pass\n", encoding="utf-8")
    assert main(["check", "sharding", "--dir", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "sharding.py defines no ShardSampler" in err and "Traceback" not in err


def test_a_syntax_error_is_one_line_naming_the_file_and_line(tmp_path):
    path = _write(tmp_path, "ring", "def ring_all_reduce(tensor, group=None):\n    return tensor +\n")
    with pytest.raises(LearnerFileError, match=r"ring\.py:2: syntax error"):
        run_check("ring", path)


def test_an_unknown_exercise_lists_the_valid_ones():
    result = subprocess.run([sys.executable, "-m", "miniddp", "exercise", "check", "shardng"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert all(e.name in result.stderr for e in EXERCISES) and "Traceback" not in result.stderr


def test_use_puts_the_learners_names_everywhere_and_the_reference_back(tmp_path):
    import miniddp
    import miniddp.data.sharding as reference
    from miniddp.teaching.exercise import swap

    original = reference.ShardSampler
    path = _write(tmp_path, "sharding", _reference("sharding"))
    try:
        swap.use(f"sharding={path}")
        mine = miniddp.ShardSampler
        assert mine is not original and mine.__module__.startswith("miniddp.data._learner_sharding")
        assert reference.ShardSampler is mine and os.environ[swap.ENV] == f"sharding={path}"
    finally:
        swap.use("")
    assert miniddp.ShardSampler is reference.ShardSampler is original and swap.ENV not in os.environ


FROM_SCRATCH = '''\
import math

import torch


class ShardSampler:
    """Written from scratch: no helper of the reference's kept."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.num_replicas, self.rank = len(dataset), num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        uneven = drop_last and self.n % num_replicas
        self.num_samples = math.ceil(((self.n - num_replicas) if uneven else self.n) / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.n, generator=g).tolist()
        else:
            indices = list(range(self.n))
        while indices and len(indices) < self.total_size:
            indices += indices[: self.total_size - len(indices)]
        return iter(indices[: self.total_size][self.rank :: self.num_replicas])
'''


def test_list_checks_every_started_exercise_in_one_session_and_a_file_from_scratch_passes(tmp_path, capsys):
    folder = tmp_path / "mine"
    for name in ("sharding", "ring"):
        assert main(["start", name, "--dir", str(folder)]) == 0
    # sharding written from scratch (no helper of the reference's kept); ring still the skeleton
    (folder / "sharding.py").write_text(FROM_SCRATCH, encoding="utf-8")
    capsys.readouterr()
    assert main(["list", "--dir", str(folder)]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()}
    ring = len(BY_NAME["ring"].spec)
    assert rows["sharding"].endswith("passing") and rows["ring"].endswith(f"{ring} of {ring} spec items failing")
    assert rows["join"].endswith("not started")
