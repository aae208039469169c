"""By hand: DDP's ideas written out plainly, the steps a learner takes before the engine.

What
    ``averaging.py``: ``average_gradients`` (one all-reduce per gradient, the naive baseline) and
    ``ring_all_reduce`` (the ring algorithm, in send and recv); ``bucketed.py``: ``BucketedDataParallel``,
    a bucketed DDP in picotron's size, the middle step between per-gradient averaging and the engine.

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``process_group``,
    ``data`` and ``collectives``. The comm hooks share its floor and stay independent of it.
"""
