"""The overlapped write checks its whole D2H batch before the first copy goes out, although the
batch is submitted later in pieces from the completion thread (DESIGN section 2)."""

import ctypes
import struct

import pytest

from cacheseek.errors import StoreError
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores.plan_tier import PlanTierStore
from plan_testkit import STREAM, RecordingTransfer, fake_cuda_runtime
from test_plan_tier_write import ring_tail_payload


class BadTableClient:
    """Delegates to a real client but points the last value of each put table outside the segment."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def local_fast_put_start(self, keys, value_len):
        plan, table = self._inner.local_fast_put_start(keys, value_len)
        n = struct.unpack("<Q", ctypes.string_at(table + 8, 8))[0]
        ctypes.memmove(table + 8 * (2 + n - 1), struct.pack("<Q", 0x7F0000000000), 8)
        return plan, table


def test_bad_destination_fails_before_any_copy():
    log: list = []
    client = EmbeddedPlanClient(segment_bytes=1 << 20, prefault_threads=2)
    runtime, fake = fake_cuda_runtime(log=log, batch_api="13", stream=STREAM)
    store = PlanTierStore(plan_client=BadTableClient(client), transfer=RecordingTransfer(runtime, log),
                          overlap=True, write_piece_bytes=64)
    try:
        payload, _ = ring_tail_payload(n_layers=3, tokens=4)
        before = len(fake.calls_named("cudaMemcpyBatchAsync")) + len(fake.calls_named("cudaMemcpyAsync"))
        with pytest.raises(StoreError, match="not inside a writable registered host mapping"):
            store.put_async("x:kv", payload, tier=Tier.FLUXON_DRAM)
        store.flush()
        after = len(fake.calls_named("cudaMemcpyBatchAsync")) + len(fake.calls_named("cudaMemcpyAsync"))
        assert after == before, "a copy went out before the batch was validated"
        assert client.keys() == []
    finally:
        store.close()
        client.close()
