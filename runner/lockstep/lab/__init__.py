"""lockstep's lab: the demo, the benchmark and the storm, on the example application.

Not part of the runner: nothing in ``runner/`` outside this package imports it, except the thin
``lockstep demo|bench|storm`` commands in ``runner/lockstep/cli.py``. It shares one application client and one
runner-process helper (``lockstep.lab.procs``) with the tests.
"""
