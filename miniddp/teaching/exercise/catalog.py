"""The exercises, in learning order: which module, which names, which spec items.

Each spec item is one of the project's own tests (a node id under ``tests/``, all its
parametrisations together) with the one line it demands; ``check`` reports item by item.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecItem:
    test: str  # "tests/test_x.py::test_name": every parametrisation of it
    demands: str  # one line: what the item holds the implementation to


@dataclass(frozen=True)
class Exercise:
    name: str
    module: str  # the reference module, e.g. "miniddp.data.sharding"
    names: tuple[str, ...]  # what the learner writes (their solution blocks are blanked)
    required: tuple[str, ...]  # the public API the learner's file must define
    page: str  # the docs page that teaches it (docs/<page>)
    spec: tuple[SpecItem, ...]

    @property
    def source(self) -> str:
        """The reference file, relative to the repository root."""
        return self.module.replace(".", "/") + ".py"


_SHARDING = "tests/test_sharding.py::"
_AVERAGING = "tests/test_averaging.py::"
_BUCKETED = "tests/test_bucketed.py::"
_BUCKETING = "tests/test_bucketing.py::"
_NO_SYNC = "tests/test_no_sync.py::"
_BUFFERS = "tests/test_buffers.py::"
_HOOKS = "tests/test_comm_hooks.py::"
_DDP = "tests/test_ddp.py::"
_UNUSED = "tests/test_unused.py::"
_JOIN = "tests/test_join.py::"
_STATIC = "tests/test_static_graph.py::"
_ZERO = "tests/test_zero.py::"
_ZERO_SPEC = "tests/test_zero_exercise_spec.py::"
_FSDP_SPEC = "tests/test_fsdp_exercise_spec.py::"

EXERCISES: tuple[Exercise, ...] = (
    Exercise("sharding", "miniddp.data.sharding", ("ShardSampler",), ("ShardSampler",), "sharding.md", (
        SpecItem(_SHARDING + "test_same_indices_as_torch_distributed_sampler",
                 "yields index for index what torch's DistributedSampler yields"),
        SpecItem(_SHARDING + "test_edge_cases_match_torch",
                 "equals torch's on empty and tiny datasets, more ranks than samples, with drop_last"),
        SpecItem(_SHARDING + "test_every_rank_gets_the_same_number_of_samples",
                 "every rank gets the same number of samples (pad, or trim with drop_last)"),
        SpecItem(_SHARDING + "test_shards_cover_the_data_and_overlap_only_by_padding",
                 "the shards cover the dataset and overlap only by the padding"),
        SpecItem(_SHARDING + "test_global_batch_is_the_same_set_whatever_the_split",
                 "step k's global batch is the same samples whatever the number of ranks"),
        SpecItem(_SHARDING + "test_without_set_epoch_every_epoch_has_the_same_order",
                 "set_epoch(e) reshuffles; the same epoch gives the same order"),
    )),
    Exercise("averaging", "miniddp.by_hand.averaging", ("average_gradients", "all_reduce_mean"),
             ("average_gradients",), "averaging.md", (
        SpecItem(_AVERAGING + "test_average_gradients_is_the_mean_over_ranks",
                 "every gradient becomes the mean over ranks: one all-reduce per gradient (the naive baseline), "
                 "in registration order, dividing before or after the sum"),
        SpecItem(_AVERAGING + "test_average_gradients_accepts_params_and_skips_none_and_duplicates",
                 "takes a module or parameters; skips missing gradients; averages a repeated parameter once"),
        SpecItem(_AVERAGING + "test_average_gradients_on_a_subgroup_leaves_non_members_alone",
                 "averages over the group's ranks only; a non-member issues nothing"),
        SpecItem(_AVERAGING + "test_predivision_avoids_fp16_overflow_and_postdivision_avoids_underflow",
                 "divides before the sum by default: no float16 overflow"),
    )),
    Exercise("ring", "miniddp.by_hand.averaging", ("ring_all_reduce", "ring_schedule", "chunk_bounds"),
             ("ring_all_reduce",), "averaging.md", (
        SpecItem(_AVERAGING + "test_chunk_bounds_tile_the_tensor_with_sizes_differing_by_at_most_one",
                 "chunk_bounds tiles the tensor in world_size chunks differing by at most one element"),
        SpecItem(_AVERAGING + "test_ring_schedule_sums_every_chunk_everywhere",
                 "ring_schedule: after 2(n-1) steps every rank holds every chunk's full sum"),
        SpecItem(_AVERAGING + "test_ring_all_reduce_equals_dist_all_reduce",
                 "ring_all_reduce equals dist.all_reduce on 1 to 5 ranks, any shape and dtype"),
        SpecItem(_AVERAGING + "test_ring_all_reduce_on_subgroups_uses_group_ranks",
                 "on a subgroup it uses the group's ranks; a non-member's tensor is untouched"),
        SpecItem(_AVERAGING + "test_each_rank_sends_2_n_minus_1_over_n_of_the_tensor",
                 "each rank sends 2(n-1)/n of the tensor in 2(n-1) exchanges"),
    )),
    Exercise("bucketed", "miniddp.by_hand.bucketed", ("assign_buckets", "BucketedDataParallel"),
             ("BucketedDataParallel",), "averaging.md", (
        SpecItem(_BUCKETED + "test_matches_torch_ddp",
                 "gradients and parameters equal torch DDP's with the same bucket cap: several models, a bucket "
                 "per parameter, accumulation under no_sync"),
        SpecItem(_BUCKETED + "test_equals_one_process_on_the_global_batch",
                 "1 to 3 ranks, with and without accumulation, train as one process on the whole global batch"),
        SpecItem(_BUCKETED + "test_buckets_fill_from_the_last_parameter_one_dtype_each",
                 "buckets filled from the last parameter, each closing at the cap, one dtype each, in launch order"),
        SpecItem(_BUCKETED + "test_buckets_launch_in_bucket_order_on_every_rank",
                 "buckets are launched in bucket order, even when they complete in another"),
        SpecItem(_BUCKETED + "test_ranks_that_complete_buckets_in_different_orders_still_pair_them",
                 "ranks that complete their buckets in different orders still average each with its counterpart"),
        SpecItem(_BUCKETED + "test_no_sync_keeps_gradients_local_then_averages_the_sums",
                 "inside no_sync nothing is sent and .grad stays local; the next synced backward averages the sums"),
        SpecItem(_BUCKETED + "test_wrap_broadcasts_parameters_and_buffers_from_rank_0",
                 "the wrap makes every rank's parameters and buffers rank 0's"),
    )),
    Exercise("bucketing", "miniddp.engine.bucketing", ("compute_bucket_assignment", "rebuilt_assignment"),
             ("compute_bucket_assignment",), "bucketing.md", (
        SpecItem(_BUCKETING + "test_pytorch_cases",
                 "equals torch's own test cases: limits in sequence, one open bucket per dtype, oversized tensors"),
        SpecItem(_BUCKETING + "test_equals_torch_on_generated_cases",
                 "equals torch's _compute_bucket_assignment_by_size on generated tensors, dtypes and limits"),
        SpecItem(_BUCKETING + "test_buckets_reduce_in_reverse_registration_order",
                 "inside DDP: buckets filled in registration order, reduced last layers first"),
        SpecItem(_BUCKETING + "test_rebuild_follows_the_order_gradients_arrived",
                 "rebuilt_assignment: after the first step the buckets fill in the order gradients arrived"),
        SpecItem(_BUCKETING + "test_rebuilt_buckets_are_rank_0s_order_when_ranks_see_different_orders",
                 "rebuilt_assignment: one agreed order (rank 0's arrival order), even when ranks see different ones"),
    )),
    Exercise("no_sync", "miniddp.engine.no_sync", ("no_sync", "should_sync", "accumulation_windows"),
             ("no_sync", "should_sync"), "no-sync.md", (
        SpecItem(_NO_SYNC + "test_inside_no_sync_gradients_stay_local_then_sync_averages_the_sums",
                 "inside no_sync gradients stay local; the next synced backward averages their sums"),
        SpecItem(_NO_SYNC + "test_what_counts_is_where_the_forward_ran_as_in_torch",
                 "what decides is where the forward ran, as in torch"),
        SpecItem(_NO_SYNC + "test_should_sync_syncs_the_last_micro_batch_of_each_window",
                 "should_sync: the last micro-batch of each window and of the epoch; windows' real lengths"),
        SpecItem(_NO_SYNC + "test_the_schedule_matches_one_process_and_the_off_by_one_does_not",
                 "k micro-batches, no_sync on all but the last, train as one process on the whole window"),
    )),
    Exercise("buffers", "miniddp.engine.buffers", ("broadcast_coalesced", "sync_module_states", "broadcast_buffers"),
             ("sync_module_states", "broadcast_buffers"), "buffers.md", (
        SpecItem(_BUFFERS + "test_wrap_broadcasts_parameters_and_buffers_from_rank_0",
                 "wrapping makes every rank's parameters and buffers rank 0's"),
        SpecItem(_BUFFERS + "test_buffers_equal_rank_0s_at_every_forward_only_when_broadcast",
                 "with broadcast_buffers, every rank's buffers equal rank 0's at each forward; without, their own"),
        SpecItem(_BUFFERS + "test_each_forward_starts_from_rank_0s_buffers_not_another_ranks",
                 "each forward starts from rank 0's buffers, not another rank's"),
        SpecItem(_BUFFERS + "test_two_forwards_before_one_backward",
                 "two forwards before one backward still train as torch's DDP does"),
        SpecItem(_BUFFERS + "test_coalesced_broadcast_equals_one_broadcast_per_tensor",
                 "a few flat messages give what one broadcast per tensor gives"),
    )),
    Exercise("compression", "miniddp.comm_hooks.default_hooks",
             ("_compress_hook", "fp16_compress_hook", "bf16_compress_hook"),
             ("fp16_compress_hook", "bf16_compress_hook"), "comm-hooks.md", (
        SpecItem(_HOOKS + "test_hooks_give_torchs_parameters_and_count_their_bytes",
                 "inside DDP the fp16 hook trains to torch's parameters and sends half the bytes"),
        SpecItem(_HOOKS + "test_bf16_works_on_gloo_as_torchs_own_hook_would",
                 "the bf16 hook does torch's bf16_compress_hook's arithmetic, on gloo"),
    )),
    Exercise("powersgd", "miniddp.comm_hooks.powersgd", ("_compress", "powerSGD_hook"), ("powerSGD_hook",),
             "comm-hooks.md", (
        SpecItem(_HOOKS + "test_powersgd_hooks_equal_the_algorithm_on_the_summed_gradients",
                 "equals PowerSGD on one process: P = MQ summed and orthogonalised, Q = M^T P averaged, "
                 "warm start, error feedback"),
        SpecItem(_HOOKS + "test_hooks_give_torchs_parameters_and_count_their_bytes",
                 "inside DDP it trains to torch's powerSGD_hook's parameters, sending only P and Q for matrices"),
        SpecItem(_HOOKS + "test_powersgd_with_many_buckets_completes_on_gloo",
                 "many buckets, each compressed, complete on gloo"),
    )),
    Exercise("reducer", "miniddp.engine.reducer", ("Reducer",), ("Reducer",), "ddp.md", (
        SpecItem(_DDP + "test_matches_torch_ddp",
                 "gradients and parameters equal torch DDP's, step after step, for 16 models and options"),
        SpecItem(_DDP + "test_matches_torch_ddp_at_several_world_sizes",
                 "equal to torch DDP on 2 and 4 ranks"),
        SpecItem(_DDP + "test_equals_one_process_on_the_global_batch",
                 "N ranks train exactly like one process on the global batch"),
        SpecItem(_BUCKETING + "test_buckets_launch_in_order_on_every_rank",
                 "buckets are launched in bucket order on every rank, even when they complete out of it"),
        SpecItem(_BUCKETING + "test_rebuild_follows_the_order_gradients_arrived",
                 "after the first step the buckets follow the order gradients arrived"),
        SpecItem(_HOOKS + "test_a_registered_hook_trains_as_torch_ddp_with_the_same_hook",
                 "with a comm hook: torch DDP's parameters with the same hook (it gets the bucket undivided)"),
    )),
    Exercise("unused", "miniddp.engine.unused", ("unused_parameters", "unused_contribution"),
             ("unused_parameters", "unused_contribution"), "unused-parameters.md", (
        SpecItem(_UNUSED + "test_graph_walk_finds_exactly_the_parameters_off_the_path",
                 "the graph walk finds exactly the parameters no path from the outputs reaches"),
        SpecItem(_UNUSED + "test_parameter_unused_on_every_rank_keeps_its_gradient",
                 "a parameter unused on every rank keeps its .grad untouched"),
        SpecItem(_DDP + "test_matches_torch_ddp",
                 "with parameters unused on some ranks (and under no_sync), equal to torch DDP"),
    )),
    Exercise("static_graph", "miniddp.engine.static_graph", ("StaticGraph", "StaticGraphChangedError"),
             ("StaticGraph", "StaticGraphChangedError"), "unused-parameters.md", (
        SpecItem(_STATIC + "test_reentrant_checkpointing_with_static_graph_equals_torch",
                 "a layer checkpointed twice (use_reentrant=True): the gradients of torch's static_graph=True"),
        SpecItem(_STATIC + "test_buckets_are_rebuilt_from_the_second_backward",
                 "the buckets are rebuilt from the order of the second backward"),
        SpecItem(_STATIC + "test_a_parameter_used_after_the_first_iteration_is_named_on_every_rank",
                 "a parameter that starts getting gradients later: StaticGraphChangedError on every rank"),
        SpecItem(_STATIC + "test_fewer_hook_calls_than_in_the_first_iteration_are_named_on_every_rank",
                 "fewer hook calls than in the first backward: the parameters and the rank named everywhere"),
    )),
    Exercise("join", "miniddp.engine.join", ("Join", "exchange_round"), ("Join", "exchange_round"), "join.md", (
        SpecItem(_JOIN + "test_join_matches_torch_ddp_join_on_uneven_inputs",
                 "with uneven inputs, the same parameters and buffers as torch DDP's join()"),
        SpecItem(_JOIN + "test_negative_the_divisor_flag_changes_the_result",
                 "divide_by_initial_world_size: by the world size, or by the ranks still active"),
        SpecItem(_JOIN + "test_throw_on_early_termination_raises_on_every_rank_at_the_same_iteration",
                 "throw_on_early_termination raises on every rank at the same iteration"),
    )),
    Exercise("sharded_optimizer", "miniddp.zero.zero_redundancy_optimizer", ("ZeroRedundancyOptimizer",),
             ("ZeroRedundancyOptimizer",), "zero.md", (
        SpecItem(_ZERO + "test_matches_torch_zero_and_one_process",
                 "bitwise torch's ZeroRedundancyOptimizer, one process's AdamW to 1e-5; each rank keeps state only for "
                 "the parameters it owns (torch's owners), the whole state once over the ranks"),
        SpecItem(_ZERO + "test_add_param_group_and_state_dict_round_trip",
                 "add_param_group trains as torch's; the consolidated state dict reloads and trains on identically"),
        SpecItem(_ZERO + "test_uneven_inputs_under_join_match_torch",
                 "uneven inputs under Join: a joined rank answers the broadcasts, as torch's does"),
        SpecItem(_ZERO + "test_cs336_adapter_steps_like_the_plain_optimizer",
                 "given the same gradients on every rank, it steps as the plain optimizer does"),
    )),
    Exercise("reduce_scatter", "miniddp.zero.gradient_shards", ("Shards", "ReduceScatterMean"),
             ("Shards", "ReduceScatterMean"), "zero.md", (
        SpecItem(_ZERO_SPEC + "test_each_rank_holds_its_chunk_of_the_mean_gradient",
                 "rank r's pieces are chunk r of each bucket (the last padded) and hold that chunk of the mean "
                 "gradient, accumulated over backwards"),
        SpecItem(_ZERO_SPEC + "test_stages_1_and_2_train_what_torch_ddp_and_adamw_train",
                 "ZeroOptimizer at stages 1 and 2 trains what torch's DDP with plain AdamW trains"),
        SpecItem(_ZERO_SPEC + "test_a_backward_reduce_scatters_each_bucket_and_all_reduces_no_gradient",
                 "a backward sends one reduce-scatter per bucket, in bucket order, and all-reduces no gradient"),
    )),
    Exercise("fsdp", "miniddp.fsdp.fsdp_param_group", ("FSDPParamGroup", "prefetch"),
             ("FSDPParamGroup", "prefetch"), "fsdp.md", (
        SpecItem(_FSDP_SPEC + "test_each_shard_holds_its_rows_of_the_mean_gradient_and_trains_as_torch_and_one_process",
                 "on 3 and 2 ranks, shards padded: rank r's shard .grad is its rows of the mean gradient, summed over "
                 "micro-batches; SGD with momentum trains what torch's fully_shard and one process on the whole batch "
                 "train"),
        SpecItem(_FSDP_SPEC + "test_prefetch_posts_the_next_units_gather_before_this_unit_computes",
                 "from the second pass on, while a unit computes, the next unit of the recorded order (forward and "
                 "backward) is gathering, posted and not waited for, and no other unit is"),
        SpecItem(_FSDP_SPEC + "test_only_the_computing_unit_is_whole_and_the_blocks_are_freed_after_the_forward",
                 "only the root and the unit computing hold full parameters; after the forward a block's are freed "
                 "and reading one raises; after the backward the modules hold the shards the optimizer steps"),
    )),
)

BY_NAME = {e.name: e for e in EXERCISES}


def exercise(name: str) -> Exercise:
    """The exercise called ``name``; a ValueError listing the valid names otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"no exercise {name!r}; the exercises are: {', '.join(BY_NAME)}")
    return BY_NAME[name]
