"""Fixtures of the HBM tier and tiered store tests: levels over one shared transfer runtime (host,
or CUDA over the fake cudart), with the Plan test kit's rings and restore targets."""

from __future__ import annotations

import os
import sys

import pytest

_PLAN_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plan")
if _PLAN_TESTS not in sys.path:
    sys.path.insert(0, _PLAN_TESTS)

from cacheseek.stores.hbm import HbmTierStore  # noqa: E402
from cacheseek.stores.memory import InMemoryTierStore  # noqa: E402
from cacheseek.stores.plan_tier import PlanTierStore  # noqa: E402
from cacheseek.stores.tiered import TieredStore  # noqa: E402
from cacheseek.transfer.host_transfer import HostTransferRuntime  # noqa: E402
from plan_testkit import RecordingTransfer, fake_cuda_runtime  # noqa: E402

from fakes.plan_faults import FaultyDevicePlanClient, FaultyEmbeddedPlanClient, PlanFaults  # noqa: E402


@pytest.fixture(params=["host", "fake_cuda"])
def transfer_kind(request) -> str:
    return request.param


@pytest.fixture
def levels():
    """levels(kind, names=("hbm", "fluxon_plan"), hbm_bytes=..., plan_bytes=..., tiered=True, **kw)
    -> (tiered store or the list of levels, parts): the levels share one recording transfer
    runtime; parts holds it, the Plan client's faults and the HBM client's faults."""
    made = []

    def _make(kind: str = "host", names=("hbm", "fluxon_plan"), *, hbm_bytes: int = 1 << 20,
              plan_bytes: int = 1 << 20, memory_bytes=None, tiered: bool = True, **kw):
        runtime = HostTransferRuntime() if kind == "host" else fake_cuda_runtime()[0]
        transfer = RecordingTransfer(runtime)
        parts = dict(transfer=transfer, plan_faults=PlanFaults(), hbm_faults=PlanFaults())
        built = []
        for name in names:
            if name == "hbm":
                pool = FaultyDevicePlanClient(hbm_bytes, device="cpu", faults=parts["hbm_faults"])
                store = HbmTierStore(transfer=transfer, plan_client=pool)
            elif name == "fluxon_plan":
                client = FaultyEmbeddedPlanClient(segment_bytes=plan_bytes, prefault_threads=1, faults=parts["plan_faults"])
                store = PlanTierStore(plan_client=client, transfer=transfer, overlap=False)
                parts["plan_client"] = client
            elif name == "memory":
                store = InMemoryTierStore(capacity_bytes=memory_bytes)
            else:
                raise ValueError(name)
            built.append((name, store))
            parts[name] = store
            made.append(store)
        if not tiered:
            return [s for _, s in built], parts
        return TieredStore(stores=built, transfer=transfer, **kw), parts

    yield _make
    for store in reversed(made):
        store.close()
        client = getattr(store, "plan_client", None)
        if client is not None and not getattr(store, "owns_client", True):
            client.close()
