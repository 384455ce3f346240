"""Workloads the orchestrator can run (the correctness gate, stress)."""

from cacheseek.workloads import abcd, stress  # noqa: F401
