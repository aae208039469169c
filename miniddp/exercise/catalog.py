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
    module: str  # the reference module, e.g. "miniddp.by_hand.sharding"
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

EXERCISES: tuple[Exercise, ...] = (
    Exercise("sharding", "miniddp.by_hand.sharding", ("ShardSampler",), ("ShardSampler",), "sharding.md", (
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
                 "every gradient becomes the mean over ranks, dividing before or after the sum"),
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
)

BY_NAME = {e.name: e for e in EXERCISES}


def exercise(name: str) -> Exercise:
    """The exercise called ``name``; a ValueError listing the valid names otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"no exercise {name!r}; the exercises are: {', '.join(BY_NAME)}")
    return BY_NAME[name]
