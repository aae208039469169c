"""Teaching: what a learner runs to build DDP themselves.

What
    ``exercise/``: ``miniddp exercise``, a concept's skeleton checked against the concept's own spec in
    every rank process (its door, ``exercise/__init__.py``, lists its files); ``demo.py``: DDP by hand on
    any number of processes, the project's first runnable job (``python -m miniddp.teaching.demo``).

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``launching``,
    ``drop_in``, ``training``, ``composed``, ``costmodel``, ``diagnostics``, ``zero``, ``engine``,
    ``by_hand``, ``comm_hooks``, ``collectives``, ``process_group`` and ``data``; never the test harness.
"""
