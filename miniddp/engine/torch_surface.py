"""torch's DDP surface: what frameworks call on a DistributedDataParallel and on its reducer.

What
    ``TorchDDPSurface``, mixed into ``DistributedDataParallel``: torch's attributes and methods beyond the core
    (``forward_sync_buffers``, ``_set_static_graph()``, ``_get_ddp_logging_data()``, ...). ``TorchReducerSurface``,
    mixed into the ``Reducer``: the C++ reducer's methods Lightning calls (``_rebuild_buckets()``,
    ``_delay_all_reduce()``; ``prepare_for_backward(outputs)`` is the reducer's own). Any other name torch's
    classes have raises ``UnimplementedTorchAttribute`` (an ``AttributeError``) naming it, at the access; the
    names are read from torch's own class (``torch_ddp_class``), also under ``miniddp.drop_in.install()``. The
    constructor's keywords are ``torch_arguments.py``'s. Also torch's ``_register_builtin_comm_hook`` and its
    ignore list (``_set_params_and_buffers_to_ignore_for_model``, ``_get_data_parallel_params``).

Why
    Frameworks were written against torch's class. Lightning's manual optimisation
    (``lightning/pytorch/overrides/distributed.py``, ``prepare_for_backward``) sets ``require_forward_param_sync``,
    reads ``find_unused_parameters`` and ``static_graph``, calls ``reducer._rebuild_buckets()`` and
    ``reducer.prepare_for_backward(args)``; its strategy (``lightning/pytorch/strategies/ddp.py``) calls
    ``reducer._delay_all_reduce()`` after a first static-graph backward and reads
    ``_get_ddp_logging_data().get("can_set_static_graph")`` at teardown. Accelerate's ``trigger_sync_in_backward``
    (``accelerate/accelerator.py``) sets both ``require_*_sync`` flags and calls ``reducer.prepare_for_backward([])``.
    Transformers and TRL reach the wrapper through Accelerate (and ``.module``). Kept here, the reducer's core
    stays one idea.

How torch differs
    ``torch/nn/parallel/distributed.py`` and the C++ ``Logger`` (``torch/csrc/distributed/c10d/logger.cpp``).
    The logging data here holds what miniddp knows, under torch's names, without timings (the tracer has them)
    and without ``can_set_static_graph``, which torch writes only when its logger is destroyed or when
    ``find_unused_parameters`` sees the unused set change (a live torch DDP whose graph stayed static has none
    either). ``require_forward_param_sync`` is kept as torch keeps it, but buffers are broadcast at every
    grad-enabled forward (torch skips the forward after one that did not sync). After a backward,
    ``_delay_all_reduce()`` has nothing left to send: the end-of-backward callback, queued at the first
    gradient, sent every bucket (torch's first static-graph backward waits for this call).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import warnings
import weakref

import torch
import torch.distributed as dist

from ..comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
from .static_graph import check_flags


class UnimplementedTorchAttribute(AttributeError):
    """An attribute torch's DistributedDataParallel (or its reducer) has and miniddp's does not; ``name`` is it.
    An ``AttributeError``: ``hasattr`` and ``getattr(ddp, name, default)`` answer as they would for any missing one."""

    def __init__(self, owner: str, name: str, obj, hint: str = ""):
        super().__init__(f"{name!r} is an attribute of torch's {owner} that miniddp's does not implement: "
                         f"{hint or 'use what docs/ddp.md lists (ddp.module is your model), or run this on torch DDP'}",
                         name=name, obj=obj)


JOIN_HINT = "for uneven inputs use `with ddp.join():` or miniddp's Join([ddp, ...]) (miniddp.engine.join)"
HINTS = {  # what to use instead, for the names a user is likeliest to reach for
    "logger": "its fields are in ddp._get_ddp_logging_data()",
    "bucket_bytes_cap": "ddp._get_ddp_logging_data()['bucket_cap_bytes'] has it",
    "_has_rebuilt_buckets": "ddp._get_ddp_logging_data()['has_rebuilt_buckets'] has it",
    "_module_parameters": "ddp.reducer.params are the parameters it averages",
}


def torch_ddp_class() -> type:
    """torch's own DistributedDataParallel, also after ``miniddp.drop_in.install()`` put miniddp's class under
    each of its names (``torch.nn.parallel.distributed`` too): the nn.Module subclass that module defines."""
    where = torch.nn.parallel.distributed.__name__
    return next(c for c in torch.nn.Module.__subclasses__()
                if c.__module__ == where and c.__name__ == "DistributedDataParallel")


@functools.cache
def torch_ddp_names() -> frozenset[str]:
    """What a torch DistributedDataParallel has beyond nn.Module: its class's attributes, and those
    ``torch/nn/parallel/distributed.py`` assigns to an instance (``self.x = ...``, ``ddp.x = ...``)."""
    cls = torch_ddp_class()
    assigned = set(re.findall(r"\b(?:ddp|ddp_weakref)\.(\w+)\s*=(?!=)", inspect.getsource(inspect.getmodule(cls))))
    for klass in cls.__mro__:  # DDP's own code and its torch bases' (Joinable's _join_config), not nn.Module's
        if klass.__module__.startswith("torch.distributed") or klass is cls:
            assigned |= set(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]*)?=(?!=)", inspect.getsource(klass)))
    return frozenset(n for n in (set(dir(cls)) | assigned) - set(dir(torch.nn.Module)) if not n.startswith("__"))


@functools.cache
def torch_reducer_names() -> frozenset[str]:
    """The methods of torch's C++ reducer (``torch._C._distributed_c10d.Reducer``)."""
    return frozenset(n for n in dir(dist.Reducer) if not n.startswith("__"))


_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16"}  # as torch's logger names them (c10's type names)


def bucket_sizes(buckets) -> str:
    """Bytes per bucket in reduction order, as torch's logger writes them: ``"64, 1024"``."""
    return ", ".join(str(sum(p.numel() * p.element_size() for p in b.params)) for b in buckets)


def logging_data(ddp) -> dict:
    """torch's ``_get_ddp_logging_data()`` fields that miniddp knows (ints for flags, as torch's ``ints_map``)."""
    r, group = ddp.reducer, ddp.process_group
    rebuilt = r.readiness.rebuilds and r.rebuilt  # by arrival order (torch never rebuilds for a changing graph)
    data = {
        "module_name": type(ddp.module).__name__, "world_size": dist.get_world_size(group),
        "rank": dist.get_rank(group), "backend_name": dist.get_backend(group),
        "device_ids": ", ".join(map(str, ddp.device_ids or [])),
        "output_device": -1 if ddp.output_device is None else ddp.output_device,
        "broadcast_buffers": int(ddp.broadcast_buffers), "bucket_cap_bytes": max(r.size_limits),
        "find_unused_parameters": int(ddp.find_unused_parameters), "gradient_as_bucket_view": int(r.as_view),
        "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules())),
        "is_multi_device_module": int(len({p.device for p in ddp.module.parameters()}) > 1),
        "num_parameter_tensors": len(r.params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in r.params),
        "dtypes": ", ".join(sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype).removeprefix("torch.")) for p in r.params})),
        "bucket_sizes": ddp._wrap_bucket_sizes, "has_rebuilt_buckets": int(rebuilt),
        **{key: os.environ.get(var, "N/A") for key, var in (
            ("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT"),
            ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"), ("torch_distributed_debug", "TORCH_DISTRIBUTED_DEBUG"))},
    }
    if rebuilt:
        data["rebuilt_bucket_sizes"] = bucket_sizes(r.buckets)
    if ddp.static_graph:
        data["static_graph"] = 1  # torch writes it only once static_graph is set
    return data


class TorchDDPSurface:
    """torch's DistributedDataParallel attributes and methods beyond miniddp's core (mixed into it, before
    nn.Module, so that its ``__getattr__`` runs nn.Module's first)."""

    mixed_precision = None  # torch's _MixedPrecision: refused at wrap unless None
    skip_all_reduce_unused_params = False  # refused at wrap unless False

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules (.module)
        except AttributeError:
            if name not in torch_ddp_names():
                raise
        raise UnimplementedTorchAttribute("DistributedDataParallel", name, self, HINTS.get(name, ""))

    # torch's Join (torch.distributed.algorithms.join; Accelerate's join_uneven_inputs) sets this on each joinable
    # and relies on the joinable's forward to notify it: miniddp's forward notifies miniddp's Join only, so torch's
    # joined ranks would wait for collectives no active rank issues. Refused when torch's Join sets it: no hang.
    @property
    def _join_config(self):
        raise UnimplementedTorchAttribute("DistributedDataParallel", "_join_config", self, JOIN_HINT)

    @_join_config.setter
    def _join_config(self, value) -> None:
        raise TypeError(f"torch's Join (torch.distributed.algorithms.join, e.g. Accelerate's join_uneven_inputs) "
                        f"cannot drive miniddp's DistributedDataParallel: {JOIN_HINT}")

    @property
    def forward_sync_buffers(self) -> bool:
        """torch 2.13's name for ``broadcast_buffers``: rank 0's buffers are copied before each forward."""
        return self.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self.broadcast_buffers = value

    @property
    def gradient_as_bucket_view(self) -> bool:
        return self.reducer.as_view

    @property
    def device_type(self) -> str:
        return self.device.type

    def _adopt(self, reducer):
        """A new reducer of this wrapper's: told whose it is (its ``_rebuild_buckets()`` rebuilds as this
        wrapper's forward does) and its first buckets remembered (``bucket_sizes`` in the logging data)."""
        reducer.owner = weakref.ref(self)
        self._wrap_bucket_sizes = bucket_sizes(reducer.buckets)
        return reducer

    def _set_static_graph(self) -> None:
        """torch's older way to ask for ``static_graph=True``: after construction, before the first forward."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self._started:
            self._log_and_raise(RuntimeError(
                "set_static_graph() should be called before training loop starts and after DistributedDataParallel "
                "is constructed: the static graph is learned in the first backward; pass static_graph=True to "
                "DistributedDataParallel instead"))
        old = self.reducer  # before any forward: a reducer built with static_graph=True is what the constructor makes
        self.static_graph = self._reducer_args["static_graph"] = True
        self.reducer = self._build_reducer(next((o for o in old.observers.observers if o is not self.auto_cap), None))
        self.reducer.set_comm_hook(*(old.registered_hook or (None, None)))
        check_flags(True, self.find_unused_parameters)

    def _get_ddp_logging_data(self) -> dict:
        """torch's fields that miniddp knows, under torch's names (``logging_data``), and the last error this
        wrapper refused with (torch's ``iteration``, ``has_error``, ``error``)."""
        return {**logging_data(self), **getattr(self, "_logged_error", {})}

    def _log_and_raise(self, error: Exception):
        """Raise ``error``, first recording it where torch's logger keeps a refusal (torch: ``_log_and_throw``),
        with the number of backwards so far as torch's ``iteration``."""
        self._logged_error = {"iteration": self.reducer.backwards, "has_error": 1, "error": str(error)}
        raise error

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's C++ hooks by ``dist.BuiltinCommHookType``: ``ALLREDUCE`` and ``FP16_COMPRESS`` are miniddp's
        ``allreduce_hook`` and ``fp16_compress_hook`` on this wrapper's group (the same arithmetic, in Python)."""
        hook = {dist.BuiltinCommHookType.ALLREDUCE: allreduce_hook,
                dist.BuiltinCommHookType.FP16_COMPRESS: fp16_compress_hook}.get(comm_hook_type)
        if hook is None:
            raise ValueError(f"{comm_hook_type!r} is not a torch.distributed.BuiltinCommHookType (ALLREDUCE, "
                             "FP16_COMPRESS); pass one, or register_comm_hook(state, hook)")
        if self.reducer.registered_hook is not None:
            raise RuntimeError("register_builtin_comm_hook or register_comm_hook can only be called once. "
                               "A model has one comm hook; to change it, wrap the model again")
        self.register_comm_hook(self._process_group, hook)

    # --8<-- [start:ignore]
    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore) -> None:
        """torch's way to keep parameters and buffers local: their names (``"fc2.weight"``, as ``named_parameters``
        and ``named_buffers`` give them) in ``module._ddp_params_and_buffers_to_ignore``, read when it is wrapped;
        each such tensor is marked ``_ddp_ignored``. Ignored, a parameter is not averaged, checked or broadcast at
        wrap, and a buffer is not broadcast."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

    @staticmethod
    def _get_data_parallel_params(module, named_params: bool = False):
        """torch's: the module's parameters (``named_params``: with their names) that no ignore list marked."""
        for param in module.named_parameters() if named_params else module.parameters():
            if not hasattr(param[1] if named_params else param, "_ddp_ignored"):
                yield param
    # --8<-- [end:ignore]


class TorchReducerSurface:
    """The methods of torch's C++ reducer that frameworks call on ``ddp.reducer`` (mixed into the ``Reducer``)."""

    owner = None  # a weak reference to the DistributedDataParallel whose reducer this is (set by its _adopt)

    def __getattr__(self, name: str):
        if name in torch_reducer_names():
            raise UnimplementedTorchAttribute("reducer (torch._C._distributed_c10d.Reducer)", name, self,
                                              "it has torch's prepare_for_backward, _rebuild_buckets and "
                                              "_delay_all_reduce; for the rest, run this on torch's DDP")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def _rebuild_buckets(self) -> bool:
        """torch's: rebuild the buckets in the order gradients arrived, once, if that is due (every rank calls it:
        it broadcasts); True if it did. The forward does this before the module runs, so a call after a forward
        (Lightning's, before ``prepare_for_backward``) finds nothing due, as torch's does."""
        if not self.rebuild_due or self.rebuilt:
            return False
        owner = self.owner() if self.owner is not None else None
        if owner is not None:
            owner.rebuild_buckets()  # the wrapper's: bucket_cap_mb="auto" chooses the cap first
        else:
            self.rebuild()
        return True

    def _delay_all_reduce(self) -> None:
        """torch's: in the first backward with ``static_graph=True`` its reducer only counts hooks, and this (queued
        by DDP's output sink, or called by Lightning after a manual backward) sends every bucket. Here every
        backward's end-of-backward callback sends them: after ``loss.backward()`` nothing is left to send."""
        if self.waiting_for_backward:
            raise RuntimeError("reducer._delay_all_reduce() before the armed backward reached this rank's "
                               "parameters: miniddp sends every bucket when that backward ends; call it after it")
