"""The witness of what interpreter teardown meets, in every run of ``runs.py`` that asks for it, and
in every run of the drop-in tests' scripts.

On ``PYTHONPATH``, Python's ``site`` imports this module at start-up, before the script's first line.
With ``MINIDDP_EXIT_WITNESS=<file>`` set (``{rank}`` in it becomes the process's ``RANK``), it
registers an atexit function before anything else is imported, so it runs last (atexit is last in,
first out): after miniddp's destroy and torch's own handlers, just before ``Py_FinalizeEx``. It
writes the names of the gloo threads still alive then (``pt_gloo_runloop``...): the abort of
docs/failures.md #22 needs one of them to be. Without the variable it registers nothing. It reads
``/proc`` and imports only ``json``, at exit: importing more there would change what teardown meets.
"""

import atexit
import os

_REPORT = os.environ.get("MINIDDP_EXIT_WITNESS")


def _gloo_threads_at_teardown() -> None:
    # The same /proc walk as miniddp.process_group.clean_exit.gloo_threads, written again on purpose: the
    # witness judges that guard, so it shares none of its code, and imports nothing (no torch, no miniddp)
    # at start-up or at exit, where an import would move the race it watches.
    import json

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name.startswith(("pt_gloo", "gloo_")):
            names.append(name)
    with open(_REPORT.replace("{rank}", os.environ.get("RANK", "")), "w") as f:
        json.dump(names, f)


if _REPORT:
    atexit.register(_gloo_threads_at_teardown)
