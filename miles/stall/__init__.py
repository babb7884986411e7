"""A run that stops making progress, found and named, in three files:

- ``heartbeat``: each process of a run touches its beat file as it makes progress (cheap: at most once per 0.5 s);
- ``watchdog``: the driver's watchdog reads the beats and, past the run's limit, stops the run naming the phase;
- ``stacks``: every process's Python stacks, written to ``run_dir/stall-<UTC>/`` when it does.

This file imports nothing: ``miles/__init__.py`` registers a process's heartbeat without the rest.
"""
