"""``miniddp.DistributedDataParallel``: the engine's class, given what the layers above it provide.

What
    The engine's ``DistributedDataParallel`` (``engine/ddp.py``) resolves a named ``bucket_cap_mb`` through its
    class attribute ``bucket_cap_choosers`` (name -> a factory of the observer that chooses at the rebuild),
    which is empty there. This subclass names one: ``"auto"``, the cost model's ``AutoBucketCap``
    (``costmodel/auto_bucket.py``), imported when a wrapper asks for it, not before. Nothing else differs:
    the same constructor, the same name; ``miniddp.DistributedDataParallel``, the drop-in's class and the
    trainer's wrapper are this one.

Why
    The engine may not import the cost model (a layer above it). The cost model used to register itself in
    a table of the engine when ``import miniddp`` imported it: an import with a side effect, and an engine
    whose "auto" worked only if someone had imported the right module first. Here the composition is one
    class attribute a reader can see, and ``import miniddp`` loads no cost model.

How torch differs
    torch has no named cap: ``bucket_cap_mb`` is a number (``None``: 25 MiB).
"""

from __future__ import annotations

from .engine.ddp import DistributedDataParallel as _EngineDDP


def auto_bucket_cap():
    """``bucket_cap_mb="auto"``: the cost model's chooser (``AutoBucketCap``), its module imported now."""
    from .costmodel.auto_bucket import AutoBucketCap

    return AutoBucketCap()


class DistributedDataParallel(_EngineDDP):
    """Data-parallel wrapper: torch's constructor and semantics; ``bucket_cap_mb`` may be ``"auto"``."""

    bucket_cap_choosers = {"auto": auto_bucket_cap}
