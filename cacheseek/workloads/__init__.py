"""Workloads the orchestrator can run (the correctness gate, stress, live interactive sessions)."""

from cacheseek.workloads import abcd, interactive, stress  # noqa: F401  (registers the workloads)
