"""Fakes for CPU tests, outside the product: a CUDA runtime over host memory (`cudart`: its
memory, streams, call log and faults; `range_kernel`: the copy kernel on its stream queues) and
the embedded Plan clients with injected faults (`plan_faults`). Each keeps the contract of what it
stands for; a test imports them as ``fakes.<module>`` (tests/ is on sys.path under pytest)."""
