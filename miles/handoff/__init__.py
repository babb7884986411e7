"""The handoff between training and rollout on shared GPUs, one feature in five files:

- ``plan``: HandoffPlan, the ordered offload / onload steps, decided once from the config;
- ``planner``: the plan replayed against estimated sizes (device and host peaks before launch);
- ``executor``: PlanExecutor, the plan's steps as engine / trainer calls (a Ray cluster or one process);
- ``hardware``: the memory and link facts of a node the planner checks a plan against;
- ``view``: the planner as tables and a memory-timeline chart (``miles plan``, the dashboard, the notebooks).

This file imports nothing, so the config can read ``hardware`` without the rest.
"""
