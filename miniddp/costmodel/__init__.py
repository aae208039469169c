"""The cost model: what a DDP step costs, predicted from measurements, beside the diagnostics.

What
    ``alpha_beta.py`` fits a collective's time as α + β·bytes on the live group, and measures its
    overlap cost; ``step_profile.py`` records one backward's ready times; ``simulate.py`` replays that
    backward with any bucket assignment and one communication stream; ``auto_bucket.py`` is
    ``bucket_cap_mb="auto"``: an observer of the engine, like the tracer, that chooses the cap at the
    rebuild.

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``zero``, ``engine``,
    ``by_hand``, ``comm_hooks``, ``collectives``, ``process_group`` and ``data``; the diagnostics share
    its floor and stay independent of it. The engine never imports this room: ``miniddp/composed.py``
    gives ``miniddp.DistributedDataParallel`` the chooser, and nothing here registers itself at import.
"""
