"""Diagnostics: what one DDP step looked like, communication against compute, per rank.

What
    ``trace.py``: ``Tracer``, an observer of the reducer's named events (``engine/observers.py``) that
    records when each gradient became ready and each bucket's collective ran, written as a Chrome trace
    for Perfetto; ``timeline.py``: those events drawn as one picture per step, to see communication
    overlap the backward instead of taking it on faith.

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``zero``, ``engine``,
    ``by_hand``, ``comm_hooks``, ``collectives``, ``process_group`` and ``data``; the cost model shares its
    floor and stays independent of it. The engine never imports this room: a tracer is handed to DDP.
"""
