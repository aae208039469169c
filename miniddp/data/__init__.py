"""Data: which samples each rank reads (``sharding.py``: ``ShardSampler``, torch's ``DistributedSampler`` rebuilt).

What
    The production data code every room above may use: the trainer's sampler (``training/prepare.py``), the one
    the by-hand steps and the examples shard with, and the ``sharding`` exercise's reference. This room imports
    torch only (it reads ``torch.distributed``'s default group and store, none of miniddp's process group code);
    import-linter's layers contract in ``pyproject.toml`` keeps it so.

Why
    A sampler is no by-hand step and no part of the engine: it is data, which the trainer needs as much as a
    learner does, so it sits on the ground floor, beside the process group, where every room above can reach it.

How torch differs
    The same place: ``torch.utils.data.distributed`` holds ``DistributedSampler`` beside the ``DataLoader``, apart
    from ``torch.distributed`` and from DDP.
"""
