"""Workloads the orchestrator can run (the correctness gate, stress, live interactive sessions),
each named in `cacheseek.registry.WORKLOADS`."""
