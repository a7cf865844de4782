"""Lab tools that do not ship: the storm, the history cost, groups of runner processes.

Run from the checkout with ``tests`` on the path: ``make storm STORM_ARGS="--seconds 300"``, or
``PYTHONPATH=tests python -m lab.storm --help`` and ``PYTHONPATH=tests python -m lab.history_cost``.
"""
