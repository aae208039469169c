"""Teaching: what a learner runs to build DDP themselves.

``miniddp exercise`` (``exercise/``: a concept's skeleton, checked against the concept's own spec in every
rank process) and the hand-written training demo (``demo.py``, ``python -m miniddp.teaching.demo``).
It may import every layer but the test harness.
"""
