"""Launching: everything that starts processes, on one machine or many.

``miniddp launch`` (``launch.py``: Accelerate's YAML in ``accelerate_config.py``, torchrun's arguments
in ``torchrun_args.py``, the checks of both in ``launch_checks.py``), ``miniddp config`` and ``miniddp env``
(``config_command.py``, ``env_command.py``), ``notebook_launcher`` (``notebook.py``), and under all of
the one-machine ones ``run_on_ranks`` (``spawn.py``: the parent; ``rank_process.py``: one rank), which
the test suite and the notebooks use too. It may import every layer but the test harness.
"""
