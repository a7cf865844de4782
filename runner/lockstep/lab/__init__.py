"""lockstep's lab: ``lockstep demo`` and ``lockstep bench``, on the example application.

Not part of the runner: nothing in ``runner/`` outside this package imports it, except the thin
``lockstep demo|bench`` commands in ``runner/lockstep/cli.py``. The tests share its example helpers, its
application client and its runner-process helper (``lockstep.lab.procs``). The storm and the other tools
that do not ship live in ``tests/lab/``.
"""
