"""Build it yourself: each concept an exercise, checked by the same spec the project runs on itself.

What
    ``miniddp exercise list | start NAME [--dir D] | check NAME [--dir D] | solution NAME``
    (``exercise_command.py``). ``start`` writes the learner's file: the concept's module with each
    solution block (``### BEGIN SOLUTION`` / ``### END SOLUTION``, nbgrader's markers) replaced by a
    ``NotImplementedError`` naming the docs section (``skeleton.py``). ``check`` runs the concept's
    spec tests, the project's own, with the learner's names in place of miniddp's in every
    process, ranks included (``swap.py``); the rest of miniddp stays the reference. The spec runs
    in a pytest session bounded in time and memory (``bounds.py``, under ``keeper.py``, which ends all
    it started), which alone imports the learner's file, through a pytest plugin (``report.py``);
    ``catalog.py`` lists the exercises and their spec items, ``reasons.py`` says why an item failed,
    and ``integrity.py`` holds still what the spec compares with while the learner's code runs.

Why
    Reading a solution and watching its tests pass is not the same as writing it. The spec that
    holds miniddp to torch's oracles holds the learner to them too, with no second copy to drift.

How others differ
    Stanford CS336 and CMU 11-868 ship skeletons and graders without a public reference;
    picotron's tutorial is a reference without tests; ARENA checks collectives against a fake
    ``torch.distributed``. Here skeleton, spec, reference and explanation are one source.

May import
    what its room, ``teaching``, may: every room below it in import-linter's layers contract
    (``pyproject.toml``), ``launching`` for the harness its ranks run in.
"""
