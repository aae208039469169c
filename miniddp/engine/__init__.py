"""The DDP engine: ``DistributedDataParallel`` and the reducer under it, one idea per file.

One gradient's path, from autograd to ``.grad``
    1. hook: ``autograd_hooks.hook_once`` (``autograd_hooks.py``) puts one post-accumulate-grad hook on
       each parameter; it calls ``reducer.Reducer._hook`` (``reducer.py``) once the gradient is accumulated.
    2. readiness: the policy chosen at wrap says whether that firing makes the gradient ready:
       ``readiness.Readiness.fire`` (``readiness.py``: ``Strict``, ``FindUnused``) or
       ``static_graph.StaticGraph.fire`` (``static_graph.py``: ready at its last firing).
    3. bucket: ``reducer.Reducer._mark_ready`` puts it in its bucket, divided by N on the default path:
       ``bucketing.Bucket.put`` (``bucketing.py``).
    4. collective: ``reducer.Reducer._launch`` hands each complete bucket over, in bucket order, to
       ``bucket_collective.BucketCollective.issue`` (``bucket_collective.py``: ``AllReduceMean``, or
       ``CommHook`` for a registered comm hook); ``reducer.Reducer._finalize``, at the end of backward,
       waits for each and calls ``bucket_collective.BucketCollective.land``.
    5. ``.grad``: ``bucketing.Bucket.write_back`` (``bucketing.py``) copies the bucket's mean into each
       parameter's ``.grad``.

What else it holds
    ``ddp.py``, the wrapper (one training step from top to bottom), with ``torch_arguments.py`` (torch's
    constructor keywords, each honoured or refused) and ``torch_surface.py`` (what frameworks call on
    torch's class and its reducer); ``inputs.py`` (``device_ids`` checked, inputs moved); ``buffers.py``
    (state checked and copied at wrap, buffers kept in step); ``no_sync.py`` (accumulation without
    communication); ``unused.py`` (a parameter without a gradient); ``sparse_gradients.py`` (sparse
    embeddings' gradients, a bucket of their own); ``ownership.py`` (who averages a parameter: copies,
    re-wraps, parameters changed after wrap); ``join.py`` and ``ddp_join.py`` (uneven inputs);
    ``observers.py`` (the reducer's named events, which tracing and the cost model watch);
    ``waiting.py`` (waiting on a collective so that a stalled rank is named); ``compile_graph_split.py``
    (a ``torch.compile`` backend that splits the graph where the buckets change).

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``process_group``,
    ``data``, ``collectives``, ``by_hand`` and ``comm_hooks``. The cost model and the diagnostics sit
    above it and attach as observers (``observers.py``); ``miniddp/composed.py`` hands it the cost model's
    ``bucket_cap_mb="auto"``.
"""
