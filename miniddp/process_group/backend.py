"""Backend selection: which communication library moves the gradients.

What
    ``select_backend(device, requested)`` turns a device kind (``cuda``, ``cpu``,
    ``xpu``, ...) and a user's request (``"auto"`` or a name such as ``"gloo"``)
    into the name of a c10d backend, after checking that this torch build really
    has it. ``device_for_local_rank(local_rank)`` picks the device a process uses
    (``cuda:LOCAL_RANK``) and makes it current.

Why
    A collective is only as good as the library behind it: NCCL moves CUDA
    tensors over NVLink/InfiniBand, gloo moves CPU tensors over TCP, and the other
    vendors ship their own (Intel ``xccl``, Habana ``hccl``, Cambricon ``cncl``).
    Asking for the wrong one fails late and cryptically (NCCL refuses CPU
    tensors only at the first collective), so we fail early with a message that
    names the fix.

How torch differs
    ``torch.distributed.init_process_group()`` with no backend registers
    ``"cpu:gloo,cuda:nccl"`` and picks per tensor at each collective
    (``Backend.default_device_backend_map`` in
    ``torch/distributed/distributed_c10d.py``). Hugging Face's
    ``TrainingArguments.ddp_backend`` passes a single name through. miniddp picks
    one name up front, as ``ddp_backend`` does, so the reader can see which one
    runs.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

# --8<-- [start:map]
#: Device kind -> the backend its vendor ships (what ``ddp_backend="auto"`` picks).
DEVICE_BACKENDS: dict[str, str] = {
    "cuda": "nccl",  # NVIDIA GPUs (and ROCm builds, where "nccl" means RCCL)
    "cpu": "gloo",  # any CPU, over TCP; also the debugging backend
    "xpu": "xccl",  # Intel GPUs (oneCCL), torch >= 2.7
    "hpu": "hccl",  # Habana Gaudi, registered by habana_frameworks
    "mlu": "cncl",  # Cambricon MLU, registered by torch_mlu
}

#: Where the out-of-tree backends come from, for the error message.
VENDOR_PLUGINS: dict[str, str] = {
    "hccl": "import habana_frameworks.torch.distributed.hccl",
    "cncl": "import torch_mlu",
    "xccl": "a torch >= 2.7 build with XPU support",
}
# --8<-- [end:map]

#: Names a user may ask for, besides whatever a plugin registered at run time.
KNOWN_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "xccl", "hccl", "cncl", "mpi", "ucc")


def valid_backend_names() -> list[str]:
    """Every name ``requested`` accepts: ``auto``, the known ones, and plugins'."""
    registered = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    return ["auto"] + sorted(set(KNOWN_BACKENDS) | set(registered))


def default_device_kind() -> str:
    """The accelerator this process would use, or ``"cpu"`` when there is none."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and accelerator.is_available():
        return accelerator.current_accelerator().type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_kind(device) -> str:
    if device is None:
        return default_device_kind()
    if isinstance(device, int):  # a bare ordinal means a CUDA device, as in torch
        return "cuda"
    try:
        return torch.device(device).type
    except RuntimeError:  # "mlu" is only a torch device once its plugin is imported
        kind = str(device).split(":")[0]
        if kind in DEVICE_BACKENDS:
            return kind
        raise ValueError(f"{device!r} is not a device; expected e.g. 'cpu', 'cuda', 'cuda:1'") from None


def _is_available(name: str) -> bool:
    if name == "nccl":
        return dist.is_nccl_available()
    if name == "gloo":
        return dist.is_gloo_available()
    if name == "mpi":
        return dist.is_mpi_available()
    checker = getattr(dist, "is_backend_available", None)  # torch >= 2.3
    if checker is not None:
        return checker(name)
    return name in dist.Backend.backend_list


# --8<-- [start:select_backend]
def select_backend(device=None, requested: str = "auto") -> str:
    """Return the c10d backend name for ``device`` (default: this process's accelerator).

    ``requested="auto"`` maps the device kind through :data:`DEVICE_BACKENDS`;
    a name is validated: an unknown one raises ``ValueError`` listing the valid
    names, and one this build or this device cannot run raises ``RuntimeError``
    that says what to use instead.
    """
    if not isinstance(requested, str):
        raise TypeError(f"ddp_backend must be a string such as 'auto' or 'gloo', got {requested!r}")
    name = requested.strip().lower()
    valid = valid_backend_names()
    if name not in valid:
        raise ValueError(f"ddp_backend={requested!r} is not a backend; valid names: {', '.join(valid)}")
    kind = _device_kind(device)

    if name == "auto":
        if kind not in DEVICE_BACKENDS:
            raise ValueError(
                f"no default backend for device kind {kind!r}; pass ddp_backend explicitly "
                f"(one of {', '.join(valid[1:])})"
            )
        name = DEVICE_BACKENDS[kind]

    if name == "nccl":  # NCCL only ever moves CUDA memory
        if kind != "cuda":
            raise RuntimeError(
                f"ddp_backend='nccl' needs CUDA tensors, but the device is {kind!r}. "
                "Use ddp_backend='gloo' to train on CPU (or 'auto')."
            )
        if not torch.cuda.is_available():
            raise RuntimeError("ddp_backend='nccl' but no CUDA device is visible; use 'gloo' on CPU.")
    if not _is_available(name):
        hint = VENDOR_PLUGINS.get(name, "a torch build that includes it")
        fallback = " or 'gloo' (works everywhere, slower)" if name != "gloo" else ""
        raise RuntimeError(
            f"backend {name!r} is not available in this torch build (torch {torch.__version__}); "
            f"it needs {hint}{fallback}."
        )
    return name
# --8<-- [end:select_backend]


# --8<-- [start:device_for_local_rank]
def device_for_local_rank(local_rank: int, kind: str | None = None, share: bool = False) -> torch.device:
    """The device process ``local_rank`` owns on its node, made current.

    One process per accelerator is the DDP layout: local rank ``i`` drives
    ``cuda:i``. Forgetting ``torch.cuda.set_device`` is a classic bug: every
    process then allocates on ``cuda:0`` and NCCL reports "Duplicate GPU
    detected" (or the node runs out of memory on GPU 0). ``share=True`` (gloo,
    which copies through host memory) lets more processes than devices take
    turns: local rank ``i`` gets device ``i % count``, with a warning.
    """
    kind = kind or default_device_kind()
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)  # torch.cuda, torch.xpu, torch.hpu, ...
    if module is None or not module.is_available():
        raise RuntimeError(f"device kind {kind!r} is not available in this process")
    count = module.device_count()
    if share and count and local_rank >= count:
        warnings.warn(f"LOCAL_RANK={local_rank} shares {kind}:{local_rank % count} with another process "
                      f"(only {count} visible): fine for gloo, slower than one device each", stacklevel=2)
        local_rank %= count
    if not 0 <= local_rank < count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but only {count} {kind} device(s) are visible; launch at most "
            f"{count} processes per node (torchrun --nproc-per-node {count}) or check "
            f"{'CUDA_VISIBLE_DEVICES' if kind == 'cuda' else 'the visible devices'}."
        )
    module.set_device(local_rank)
    return torch.device(kind, local_rank)
# --8<-- [end:device_for_local_rank]
