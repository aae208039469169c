"""Collectives: the exchanges the engine, the comm hooks and ZeRO issue, and the bytes they hand over, counted.

What
    ``shard_collectives.py``: ZeRO's reduce-scatter and all-gather (and a counted broadcast); on gloo, direct
    point-to-point exchanges cut into segments. ``byte_count.py``: ``all_reduce`` as a future, and
    ``count_bytes()``, which every collective here adds its payload to. This room may import torch and the process
    group only (``shard_collectives`` asks ``process_group.debug_backend`` which backend runs under the desync
    detector); import-linter's layers contract in ``pyproject.toml`` keeps it so.

Why
    They are neither comm hooks nor the engine: the reducer's bucket collective, the default hooks, PowerSGD and
    ZeRO's gradient shards all call them, so they sit below all of those, one floor above the process group.

How torch differs
    torch's collectives are ``torch.distributed``'s own (c10d's process groups); its hooks and its ZeRO call them
    directly, and nothing counts the bytes.
"""

from __future__ import annotations

from .byte_count import ByteCount, count_bytes

__all__ = ["ByteCount", "count_bytes"]
