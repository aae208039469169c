"""miniddp.DistributedDataParallel: the concepts, composed.

What
    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` for the arguments
    ``device_ids, process_group, bucket_cap_mb, broadcast_buffers,
    find_unused_parameters, gradient_as_bucket_view``. Wrapping checks that every
    rank built the same model and copies rank 0's state (``buffers.py``); each
    grad-enabled forward re-broadcasts buffers and arms the reducer; each
    backward averages gradients in buckets that overlap with the computation
    (``bucketing.py``, ``reducer.py``), unless the forward ran in ``no_sync()``
    (``no_sync.py``); parameters without gradients are handled or reported
    (``unused.py``); ranks with fewer batches shadow the others inside
    ``join()`` (``join.py``). ``bucket_cap_mb="auto"`` lets the cost model
    choose the cap at the rebuild (``auto_bucket.py``; torch has no such
    option). Forwards under ``torch.no_grad()`` or
    ``inference_mode()`` never communicate, so rank 0 can evaluate alone.

Why
    Each piece alone is a page of this site; this file is where they meet, and
    where one training step can be followed from top to bottom.

How torch differs
    torch's ``DistributedDataParallel`` (``torch/nn/parallel/distributed.py`` +
    ``reducer.cpp``) also supports static graphs, mixed-device modules, sparse
    gradients and Python-side optimizer overlap; we leave those out (sparse
    gradients are refused at wrap). Communication hooks take torch's contract
    and run torch's own hooks (``comm_hooks.py``); they must be registered
    before the first forward, and never hang on gloo (``reducer.py``). We raise
    a missing gradient at the end of the same backward instead of the next
    iteration, compare buffers and ``requires_grad`` across ranks at wrap
    (torch: parameter shapes only), and never communicate in a no-grad forward
    (torch broadcasts buffers there, so a rank-0-only evaluation of a BatchNorm
    model can hang).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .auto_bucket import AutoBucketCap
from .bucketing import bucket_size_limits
from .buffers import (broadcast_buffers, refuse_meta_tensors, refuse_sparse_gradients, sync_module_states,
                      verify_same_model)
from ..process_group.clean_exit import group_or_default
from .join import Join
from .no_sync import ChangedInWindow, no_sync
from .reducer import Reducer
from ..process_group.timeouts import announce_process


class WrappedAgainError(RuntimeError):
    """The model was wrapped by a newer ``DistributedDataParallel``: this older wrapper averages nothing now."""


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper: same constructor arguments and semantics as torch's DDP."""

    def __init__(self, module: torch.nn.Module, device_ids=None, *, process_group=None, bucket_cap_mb=None,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, tracer=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs a process group: call "
                               "miniddp.init_distributed() (or torch.distributed.init_process_group) first")
        self.input_device = _check_device_ids(module, device_ids)  # forward moves inputs here (torch: the same)
        self.module = module  # the model; its state_dict is what you save
        self._process_group = process_group  # None: the default group, looked up at each use (clean_exit.py)
        self.broadcast_buffers = broadcast_buffers  # copy rank 0's buffers before every forward
        self.require_backward_grad_sync = True  # False inside no_sync()
        self._join = None  # the open join() context, if any (join.py)
        self._started = False  # a grad-enabled forward has run: too late for register_comm_hook
        refuse_meta_tensors(module)  # shapes without data: nothing to broadcast or average
        limits = bucket_size_limits(bucket_cap_mb)  # "auto": torch's defaults until the rebuild chooses
        # --8<-- [start:wrap]
        verify_same_model(module, self.process_group, include_buffers=broadcast_buffers)  # or a clear error
        refuse_sparse_gradients(module)  # our buckets are dense
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # tied weights once
        if not named:
            raise ValueError("the module has no parameter with requires_grad=True: there is nothing to average")
        self.device = named[0][1].device  # where small control tensors live (join rounds)
        self._trained = tuple(p.requires_grad for p in module.parameters())  # requires_grad at wrap
        self._window = ChangedInWindow(named)  # parameters stepped inside a no_sync window: warned
        sync_module_states(module, self.process_group, include_buffers=broadcast_buffers)  # rank 0's state
        announce_process()  # host:pid in the store, so a stall elsewhere can name this rank
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named], process_group, limits,
                               find_unused_parameters=find_unused_parameters,
                               gradient_as_bucket_view=gradient_as_bucket_view, tracer=tracer,
                               auto_cap=AutoBucketCap() if bucket_cap_mb == "auto" else None)
        # --8<-- [end:wrap]

    # --8<-- [start:forward]
    def forward(self, *args, **kwargs):
        if self.input_device is not None:  # device_ids=[i]: CPU batches go to cuda:i, as torch DDP does
            args, kwargs = move_to((args, kwargs), self.input_device)
        if not torch.is_grad_enabled():  # evaluation: no buffer broadcast, no rebuild, nothing to sync
            return self.module(*args, **kwargs)
        if self.reducer.superseded:
            raise WrappedAgainError(
                "this DistributedDataParallel no longer averages gradients: its model was wrapped again by a newer "
                "DistributedDataParallel (a notebook cell run twice, or two Trainers on one model), which took its "
                "gradient hooks. Use the newest wrapper; for two independent ones, wrap a copy (copy.deepcopy(model)).")
        self._check_requires_grad_unchanged()
        self._started = True
        divisor = expected = None  # the world size, unless some ranks have joined
        if self._join is not None:  # uneven inputs: tell the joined ranks what this iteration does
            plan = self._join.notify(self.require_backward_grad_sync, self.reducer.rebuild_due)
            self._sync_before_forward(rebuild=plan.rebuild, source=plan.source)
            divisor, expected = self._join.divisor(plan), len(plan.active)
        else:
            self._sync_before_forward(rebuild=self.reducer.rebuild_due, source=0)
        (self._window.synced_forward if self.require_backward_grad_sync else self._window.local_forward)()
        outputs = self.module(*args, **kwargs)
        if self.require_backward_grad_sync:
            self.reducer.prepare_for_backward(outputs, divisor, expected)  # arm the hooks for this graph
        else:
            self.reducer.local_forward = True  # its backward stays local, on purpose
        # a no_sync or no-grad forward leaves the reducer as it was: an earlier synced
        # forward whose backward has not run yet still syncs (as in torch)
        return outputs

    @property
    def process_group(self):
        """The ranks we average with. The default group is looked up, not held: a wrapper that held it
        would keep gloo's threads alive past ``destroy_process_group()`` (see ``clean_exit``)."""
        return group_or_default(self._process_group)

    def _sync_before_forward(self, rebuild: bool, source: int) -> None:
        """What every rank does before a grad-enabled forward (a joined rank too, in join.py)."""
        if rebuild and not self.reducer.rebuilt:
            self.reducer.rebuild()  # once, after the first iteration
        if self.broadcast_buffers:
            broadcast_buffers(self.module, self.process_group, source)  # BatchNorm stats: one rank's
    # --8<-- [end:forward]

    def _sync_module_states(self, source: int) -> None:
        sync_module_states(self.module, self.process_group, include_buffers=self.broadcast_buffers, src=source)

    def _check_requires_grad_unchanged(self) -> None:
        now = tuple(p.requires_grad for p in self.module.parameters())
        if now != self._trained:
            name, was = next((n, w) for (n, p), w in zip(self.module.named_parameters(), self._trained)
                             if p.requires_grad != w)
            raise RuntimeError(
                f"{name}.requires_grad changed from {was} to {not was} after wrapping: DistributedDataParallel "
                "chose the parameters it averages when it wrapped the model. Set requires_grad before wrapping "
                "(to change it mid-training, wrap the model again).")

    def no_sync(self):
        """Context manager: accumulate gradients locally; see ``miniddp.engine.no_sync``."""
        return no_sync(self)

    # --8<-- [start:register_comm_hook]
    def register_comm_hook(self, state, hook) -> None:
        """torch's contract: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` is called with each
        ready bucket (a ``comm_hooks.GradBucket``) and returns a future of the averaged ``bucket.buffer()``,
        which is written back to ``.grad``. Once per model, before the first forward (see ``comm_hooks``)."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError as err:
            raise TypeError(f"register_comm_hook: hook must take (state, bucket): {err}") from None
        except ValueError:  # a callable without an inspectable signature: find out when it is called
            pass
        if self.reducer.custom_hook:
            raise RuntimeError("register_comm_hook can only be called once per model (torch: the same); "
                               "to change the hook, wrap the model again")
        if self._started:
            raise RuntimeError("register_comm_hook must be called before the first forward: a hook with state "
                               "(PowerSGD's error feedback, its step count) has to see every step")
        self.reducer.set_comm_hook(state, hook)
    # --8<-- [end:register_comm_hook]

    # --8<-- [start:join]
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs (torch's semantics): ranks that run out of batches shadow
        the collectives of those still training; see ``miniddp.engine.join``."""
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)
    # --8<-- [end:join]

    @property
    def bucket_assignment(self) -> list[list[str]]:
        """Parameter names per bucket, in the order the buckets are reduced."""
        return self.reducer.bucket_names

    @property
    def auto_bucket_cap_mb(self) -> float | None:
        """``bucket_cap_mb="auto"``: the cap the rebuild chose (``None`` before it, or without "auto")."""
        auto = self.reducer.auto_cap
        return auto.choice.cap_mb if auto is not None and auto.choice is not None else None

    @property
    def auto_bucket_report(self) -> dict | None:
        """``bucket_cap_mb="auto"``: the cap, the α–β fit, the predicted milliseconds and buckets per candidate
        cap, and what measuring cost (``auto_bucket.AutoChoice.report``)."""
        auto = self.reducer.auto_cap
        return auto.choice.report() if auto is not None and auto.choice is not None else None

    def layout_state(self) -> dict:
        """What an exact resume needs from the reducer: whether and how the buckets were rebuilt.
        With more than 2 ranks gloo's ring sums each element in an order set by its offset in its bucket,
        so a resumed run must all-reduce with the same layout (torch DDP has no such state); with
        ``bucket_cap_mb="auto"``, the cap it chose (a resumed run rebuilds with it, without measuring)."""
        r = self.reducer
        return {"rebuilt": r.rebuilt, "rebuild_due": r.rebuild_due, "ready_order": list(r.ready_order),
                "auto_bucket_cap_mb": self.auto_bucket_cap_mb,  # then the ready times, if not chosen yet:
                "auto_ready_s": sorted(r.auto_cap.ready_s.items()) if r.auto_cap is not None else []}

    def load_layout_state(self, state: dict) -> None:
        """Every rank, before the first forward of a resumed run: the saved layout (or rebuild due)."""
        r = self.reducer
        r.ready_order = list(state["ready_order"])
        if r.auto_cap is not None and state.get("auto_bucket_cap_mb") is not None:
            r.auto_cap.restore(state["auto_bucket_cap_mb"])  # the interrupted run's choice: no re-measuring
        elif r.auto_cap is not None and state.get("auto_ready_s"):
            r.auto_cap.ready_s = {int(i): float(t) for i, t in state["auto_ready_s"]}  # saved before the rebuild
            r.auto_cap.recording = False
        if state["rebuilt"] and not r.rebuilt:
            r.rebuild()  # from the saved arrival order: the layout the interrupted run had (a broadcast)
        r.rebuild_due = state["rebuild_due"] and not r.rebuilt


def move_to(obj, device):
    """``obj`` with every tensor inside (tuples, lists, mappings, dataclasses, nested) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=torch.device(device).type != "cpu")  # async from pinned memory
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(move_to(x, device) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to(x, device) for x in obj)
    if isinstance(obj, Mapping):  # dicts, Hugging Face's BatchEncoding and ModelOutput
        moved = {k: move_to(v, device) for k, v in obj.items()}
        try:
            return type(obj)(moved)
        except TypeError:  # a mapping type that cannot be rebuilt from a dict
            return moved
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: move_to(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _check_device_ids(module, device_ids) -> torch.device | None:
    if device_ids is None:
        return None
    if len(device_ids) != 1:
        raise ValueError(f"device_ids={device_ids!r}: one process drives one device; pass [local_rank]")
    expected = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else torch.device("cuda", device_ids[0])
    for name, p in module.named_parameters():
        if p.device != expected:
            raise ValueError(f"device_ids={device_ids!r} but parameter {name} is on {p.device}; "
                             f"move the model first: model.to({str(expected)!r})")
    return expected
