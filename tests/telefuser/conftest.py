"""TeleFuser's real LingBot-World-fast pipeline: skipped where the `telefuser` extra is missing.

These tests build the real pipeline with tiny random weights (cacheseek.integrations.telefuser.tiny)
and run it on the CPU. Torch runs them on one thread: the tensors are tiny, and on a loaded 2-core
machine the OpenMP barriers of a second thread cost more than the work.
"""

from __future__ import annotations

import pytest

telefuser = pytest.importorskip("telefuser.pipelines.lingbot_world_fast",
                                reason="needs the telefuser extra (see README)")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/telefuser/" in str(item.fspath):
            item.add_marker(pytest.mark.telefuser)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
