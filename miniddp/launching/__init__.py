"""Launching: everything that starts processes, on one machine or many.

What
    ``launch.py``: ``miniddp launch``, like ``accelerate launch``, reading Accelerate's YAML
    (``accelerate_config.py``) and giving torchrun its arguments and the workers their environment
    (``torchrun_args.py``); ``config_command.py`` and ``env_command.py``: ``miniddp config`` and
    ``miniddp env``; ``launch_checks.py``: what ``config`` and ``launch`` both check (numbers and their
    bounds, host names, where a config file goes); ``drop_in_checks.py``: the checks the drop-in
    (``miniddp/drop_in.py``, on this floor) makes before the script runs; ``notebook.py``:
    ``notebook_launcher``, a function on N ranks from a Jupyter cell. Under all of the one-machine
    ones, ``spawn.py`` (``run_on_ranks``: the parent's side) and ``rank_process.py`` (one rank's
    process, and how it ends with all it started), which the test suite and the notebooks use too.

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``training``,
    ``composed``, ``costmodel``, ``diagnostics``, ``zero``, ``engine``, ``by_hand``, ``comm_hooks``,
    ``collectives``, ``process_group`` and ``data``, and ``drop_in``, its neighbour on this floor; never
    the test harness, which a forbidden contract of its own keeps out of the library.
"""
