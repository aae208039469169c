"""miniddp.DistributedDataParallel: the concepts, composed.

What
    A drop-in for ``torch.nn.parallel.DistributedDataParallel``: torch 2.13's constructor, each keyword honoured
    or refused in one line (``torch_arguments.py``), and what frameworks use of torch's class (``torch_surface.py``).
    Wrapping checks that every rank built the same model and copies rank 0's state (``buffers.py``); each
    grad-enabled forward re-broadcasts buffers and arms the reducer (``reducer.py``), unless it ran
    in ``no_sync()``; inside ``join()`` ranks out of data shadow the others (``ddp_join.DDPJoinHook``).

Why
    Each piece alone is a page of this site; this file is where they meet, and where one
    training step can be followed from top to bottom.

How torch differs
    torch's (``torch/nn/parallel/distributed.py`` + ``reducer.cpp``) also supports mixed-device
    modules, optimizer overlap, and join() with a static graph. Ours takes
    ``bucket_cap_mb="auto"`` (``costmodel/auto_bucket.py``), raises a missing gradient at the end of the same
    backward, compares buffers and ``requires_grad`` at wrap (torch: parameter shapes only), and never communicates
    in a no-grad forward (torch broadcasts buffers there: a rank-0-only evaluation can hang). Both leave the
    parameters and buffers ``module._ddp_params_and_buffers_to_ignore`` names out of everything they do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm_hooks.grad_bucket import check_registration
from ..process_group.clean_exit import group_or_default
from ..process_group.process_info import announce_process
from . import ownership
from .bucketing import bucket_size_limits
from .buffers import (
    broadcast_buffers,
    managed,
    refuse_meta_tensors,
    sync_module_states,
    verify_same_model,
)
from .ddp_join import DDPJoinHook
from .inputs import check_device_ids, move_to
from .join import Join, Joinable
from .no_sync import ChangedInWindow, no_sync
from .observers import bucket_cap_chooser
from .reducer import Reducer
from .sparse_gradients import expects_sparse_gradient
from .static_graph import check_flags
from .torch_arguments import buffer_flags, process_group_of, refuse_unimplemented, size_limits, torch_device_ids
from .torch_surface import TorchDDPSurface


class WrappedAgainError(RuntimeError):
    """The model was wrapped by a newer ``DistributedDataParallel``: this older wrapper averages nothing now."""


class DistributedDataParallel(TorchDDPSurface, torch.nn.Module, Joinable):
    """Data-parallel wrapper: same constructor arguments and semantics as torch's DDP."""

    # a named ``bucket_cap_mb`` -> what builds its chooser: none here (the cost model is a layer above);
    # ``miniddp.DistributedDataParallel`` (``miniddp/composed.py``) names "auto"
    bucket_cap_choosers: dict = {}

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                 device_mesh=None, skip_all_reduce_unused_params=False, bucket_cap_mb_list=None,
                 batched_grad_copy=False, forward_sync_buffers=None, *, tracer=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs a process group: call "
                               "miniddp.init_distributed() (or torch.distributed.init_process_group) first")
        ownership.refuse_nested(module, DistributedDataParallel)  # DDP(DDP(m)): one line, not a second reducer
        refuse_unimplemented(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
                             skip_all_reduce_unused_params, check_reduction)  # torch's keywords we lack: one line
        self.input_device = check_device_ids(module, device_ids or None)  # forward moves inputs here (torch too)
        self.device_ids, self.output_device = torch_device_ids(module, self.input_device, output_device)  # torch's
        self.dim = dim  # torch scatters inputs along it only over several devices per process: unused, as there
        self.module = module  # the model; its state_dict is what you save
        self._process_group = process_group_of(process_group, device_mesh)  # None: the default group, looked up
        self.broadcast_buffers, buffers_at_wrap = buffer_flags(broadcast_buffers, forward_sync_buffers)  # forward; wrap
        self.batched_grad_copy = batched_grad_copy  # torch copies a bucket's gradients at once: the same result
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # torch's: did the last forward sync (set by forward)
        self._started = False  # a grad-enabled forward has run: too late for register_comm_hook
        self.auto_cap = bucket_cap_chooser(bucket_cap_mb, self.bucket_cap_choosers)  # "auto": chooses at the rebuild
        self.static_graph = static_graph  # learn the graph in the first backward, then rely on it (static_graph.py)
        self.find_unused_parameters = find_unused_parameters  # walk the graph after each forward (torch's name)
        check_flags(static_graph, find_unused_parameters)
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))  # torch's: local
        refuse_meta_tensors(self._managed)  # shapes without data: nothing to broadcast or average
        limits = size_limits(bucket_cap_mb, bucket_cap_mb_list)  # "auto": torch's defaults until the rebuild chooses
        # --8<-- [start:wrap]
        if init_sync:  # False: the caller vouches that every rank holds the same model (torch: the same)
            verify_same_model(self._managed, self.process_group, include_buffers=buffers_at_wrap)  # or an error
        self._wrapped = ownership.WrappedParameters(self._managed)  # as wrapped: a change is named at next forward
        named = self._wrapped.trained()  # (name, parameter) that require grad; tied weights once
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any parameter that "
                               "requires a gradient. This one has no parameter with requires_grad=True (outside "
                               "those it is told to ignore): there is nothing to average")
        self.device = named[0][1].device  # where small control tensors live (join rounds)
        self._window = ChangedInWindow(named)  # parameters stepped inside a no_sync window: warned
        if init_sync:
            sync_module_states(self._managed, self.process_group, include_buffers=buffers_at_wrap)  # rank 0's state
        announce_process()  # host:pid in the store, so a stall elsewhere can name this rank
        self._reducer_args = dict(size_limits=limits, find_unused_parameters=find_unused_parameters,
                                  gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
        self.reducer = self._build_reducer(tracer)  # hooks on each parameter that requires grad
        # --8<-- [end:wrap]

    def _build_reducer(self, tracer=None) -> Reducer:
        named = self._wrapped.trained()
        observers = [o for o in (tracer, self.auto_cap) if o is not None]  # they watch the reducer's events
        params = [p for _, p in named]
        return self._adopt(Reducer(params, [n for n, _ in named], self._process_group, observers=observers,
                                   expect_sparse_gradient=expects_sparse_gradient(self.module, params),
                                   **self._reducer_args))

    # deepcopy, pickle, torch.save: the copied module with a reducer of its own; copy.copy: an alias (ownership.py)
    def __deepcopy__(self, memo):
        return ownership.deep_copy(self, memo)

    def __copy__(self):
        return ownership.alias(self)

    def __getstate__(self):
        return ownership.pickled_state(self)

    def __setstate__(self, state):
        comm_hook = ownership.restored_state(state)
        super().__setstate__(state)
        self.reducer = self._build_reducer()  # no collective: built where it is loaded, as torch's __setstate__
        self.reducer.set_comm_hook(*comm_hook)  # the original's (state, hook); (None, None): the default path

    # --8<-- [start:forward]
    def forward(self, *args, **kwargs):
        if self.input_device is not None:  # device_ids=[i]: CPU batches go to cuda:i, as torch DDP does
            args, kwargs = move_to((args, kwargs), self.input_device)
        if not torch.is_grad_enabled():  # evaluation: no buffer broadcast, no rebuild, nothing to sync
            self.require_forward_param_sync = False
            return self.module(*args, **kwargs)
        if self.reducer.superseded:
            raise WrappedAgainError(ownership.WRAPPED_AGAIN)
        self._wrapped.check(self._managed)  # the parameters it wrapped, as it wrapped them (ownership.py)
        self._started = True
        collective = expected = None  # the reducer's own, over the whole group, unless some ranks have joined
        if self.join_context is not None:  # uneven inputs: tell the joined ranks what this iteration does
            plan = self.join_context.notify(will_sync=self.require_backward_grad_sync, rebuild=self.reducer.rebuild_due)
            self.sync_before_forward(rebuild=plan.flags["rebuild"], source=plan.source)
            collective, expected = self.join_context.hook_of(self).active_collective(plan), len(plan.active)
        else:
            self.sync_before_forward(rebuild=self.reducer.rebuild_due, source=0)
        (self._window.synced_forward if self.require_backward_grad_sync else self._window.local_forward)()
        outputs = self.module(*args, **kwargs)
        if self.require_backward_grad_sync:
            self.reducer.prepare_for_backward(outputs, collective, expected)  # arm the hooks for this graph
        else:
            self.reducer.accumulated.local_forward = True  # its backward stays local, on purpose
        self.require_forward_param_sync = self.require_backward_grad_sync  # read after the module, as torch does
        return outputs  # a no_sync forward leaves an earlier synced forward armed: its backward syncs (torch too)

    def sync_before_forward(self, rebuild: bool, source: int) -> None:
        """What every rank does before a grad-enabled forward (a joined rank too, in ``DDPJoinHook``)."""
        if rebuild and not self.reducer.rebuilt:
            self.rebuild_buckets()  # once, after the first iteration
        if self.broadcast_buffers:
            broadcast_buffers(self._managed, self.process_group, source)  # BatchNorm stats: one rank's
    # --8<-- [end:forward]

    def rebuild_buckets(self) -> None:
        """The reducer's one-time rebuild; with ``bucket_cap_mb="auto"`` the cost model chooses the cap first
        (collectives: every rank, a joined one too)."""
        auto = self.auto_cap
        self.reducer.rebuild(bucket_size_limits(auto.choose(self.reducer.params, self.process_group)) if auto else None)

    @property
    def _managed(self):
        """The module as this wrapper synchronises it: itself, or without ``parameters_to_ignore`` (buffers.py)."""
        return managed(self.module, self.parameters_to_ignore)

    @property
    def process_group(self):
        """The ranks we average with. The default group is looked up, not held: a wrapper that held it
        would keep gloo's threads alive past ``destroy_process_group()`` (see ``clean_exit``)."""
        return group_or_default(self._process_group)

    def sync_module_states(self, source: int) -> None:
        """Every rank's parameters (and buffers, with ``broadcast_buffers``) become group rank ``source``'s."""
        sync_module_states(self._managed, self.process_group, include_buffers=self.broadcast_buffers, src=source)

    def no_sync(self):
        """Context manager: accumulate gradients locally; see ``miniddp.engine.no_sync``."""
        return no_sync(self)

    # --8<-- [start:register_comm_hook]
    def register_comm_hook(self, state, hook) -> None:
        """torch's contract: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` is called with each
        ready bucket (a ``comm_hooks.GradBucket``, undivided) and returns a future of the averaged
        ``bucket.buffer()``, which is written back to ``.grad``. Once per model, before the first forward."""
        if self.reducer.collective_owner is not None:  # ZeRO-2's reduce-scatter is the bucket's collective
            raise RuntimeError(f"register_comm_hook: {self.reducer.collective_owner} decides each bucket's "
                               "collective (a reduce-scatter); a comm hook cannot replace it")
        try:
            check_registration(state, hook, registered=self.reducer.registered_hook is not None,
                               started=self._started)
        except (TypeError, ValueError, RuntimeError) as refused:  # kept where torch's logger keeps it, too
            self._log_and_raise(refused)
        self.reducer.set_comm_hook(state, hook)
    # --8<-- [end:register_comm_hook]

    # --8<-- [start:join]
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Uneven inputs: ``Join([self])`` (torch's semantics); see ``miniddp.engine.join``."""
        if enable and self.static_graph:
            raise NotImplementedError("join() with static_graph=True: miniddp's static graph expects every rank's "
                                      "gradients in every backward; use find_unused_parameters=True for uneven inputs")
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, divide_by_initial_world_size: bool = True) -> DDPJoinHook:
        return DDPJoinHook(self, divide_by_initial_world_size)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group
    # --8<-- [end:join]

    @property
    def bucket_assignment(self) -> list[list[str]]:
        """Parameter names per bucket, in the order the buckets are reduced."""
        return [list(b.names) for b in self.reducer.buckets]

    @property
    def auto_bucket_cap_mb(self) -> float | None:
        """``bucket_cap_mb="auto"``: the cap the rebuild chose (``None`` before it, or without "auto")."""
        return self.auto_cap.choice.cap_mb if self.auto_cap is not None and self.auto_cap.choice else None

    @property
    def auto_bucket_report(self) -> dict | None:
        """``bucket_cap_mb="auto"``: the cap, the α–β fit, the predicted milliseconds and buckets per candidate
        cap, and what measuring cost (``auto_bucket.AutoChoice.report``)."""
        return self.auto_cap.choice.report() if self.auto_cap is not None and self.auto_cap.choice else None

    def layout_state(self) -> dict:
        """What an exact resume needs: how the buckets were rebuilt (above 2 ranks gloo's ring sums in an order
        set by offsets in the bucket; torch has no such state) and the cap "auto" chose (no re-measuring)."""
        r = self.reducer
        auto = self.auto_cap.layout_state() if self.auto_cap else {"auto_bucket_cap_mb": None, "auto_ready_s": []}
        return {"rebuilt": r.rebuilt, "rebuild_due": r.rebuild_due, "ready_order": list(r.ready_order), **auto}

    def load_layout_state(self, state: dict) -> None:
        """Every rank, before the first forward of a resumed run: the saved layout (or rebuild due)."""
        r = self.reducer
        r.ready_order = list(state["ready_order"])
        if self.auto_cap is not None:
            self.auto_cap.load_layout_state(state)
        if state["rebuilt"] and not r.rebuilt:
            self.rebuild_buckets()  # from the saved arrival order: the layout the interrupted run had (a broadcast)
        r.rebuild_due = state["rebuild_due"] and not r.rebuilt
