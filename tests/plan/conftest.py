"""Fixtures of the Plan data path tests: a Plan tier store wired to recording proxies over the
embedded client and a transfer runtime (host, or CUDA over the fake cudart)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime
from plan_testkit import STREAM, RecordingClient, RecordingTransfer, fake_cuda_runtime

from fakes.plan_faults import FaultyEmbeddedPlanClient, PlanFaults


@pytest.fixture
def event_log() -> list:
    return []


@pytest.fixture(params=["host", "fake_cuda"])
def transfer_kind(request) -> str:
    return request.param


@pytest.fixture
def make_store(event_log) -> Callable[..., tuple[PlanTierStore, dict]]:
    """make_store(kind="host"|"fake_cuda", segment_bytes=..., batch_api=..., overlap=False,
    **store options) -> (store, parts): parts holds the embedded client, its faults, the fake
    cudart (or None) and the recorders."""
    made: list[tuple[PlanTierStore, Any]] = []

    def _make(kind: str = "host", *, segment_bytes: int = 1 << 20, batch_api: str | None = "13", stream: int = STREAM,
              overlap: bool = False, **store_kw):
        faults = PlanFaults()
        client = FaultyEmbeddedPlanClient(segment_bytes=segment_bytes, prefault_threads=2, faults=faults)
        fake = None
        if kind == "host":
            runtime: Any = HostTransferRuntime()
        else:
            runtime, fake = fake_cuda_runtime(log=event_log, batch_api=batch_api, stream=stream)
        transfer = RecordingTransfer(runtime, event_log)
        recording = RecordingClient(client, event_log)
        store = PlanTierStore(plan_client=recording, transfer=transfer, overlap=overlap, **store_kw)
        made.append((store, client))
        parts = dict(client=client, faults=faults, fake=fake, transfer=transfer, runtime=runtime, log=event_log)
        return store, parts

    yield _make
    for store, client in made:
        store.close()
        client.close()
