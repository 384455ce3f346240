"""Issue 12 item 6: a Plan client whose staging holds fewer values than a chunk (the public-Fluxon
client: 256 MiB against a 3.57 GiB 480p chunk) gets the chunk in waves of plans that fit; its
staging is sized from the geometry and a staging that cannot hold one value fails at construction.
"""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import ConfigError, StoreError, StoreFullError
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.plan.fluxon_public import FluxonPublicPlanClient
from cacheseek.plan.fluxon_staging import staging_for
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime

MiB = 1 << 20


class StagedClient:
    """The embedded client behind a staging of ``staged`` values: a plan that would hold more
    uncommitted values than that is refused, as the public client's staging refuses it."""

    def __init__(self, inner, staged: int) -> None:
        self._inner, self.staged, self.held, self.peak = inner, staged, 0, 0
        self.plans: list[int] = []
        self.fail_commit_at: int | None = None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def max_plan_values(self, value_len: int) -> int:
        return self.staged

    def local_fast_put_start(self, keys, value_len):
        if self.held + len(keys) > self.staged:
            raise StoreFullError(f"staging full: {self.held} held, {len(keys)} more")
        out = self._inner.local_fast_put_start(keys, value_len)
        self.held += len(keys)
        self.peak = max(self.peak, self.held)
        self.plans.append(len(keys))
        return out

    def local_fast_put_commit(self, plan):
        if self.fail_commit_at is not None and len(self.plans) >= self.fail_commit_at:
            self.held -= len(plan.keys)
            self._inner.put_abort(plan)
            raise StoreError("injected commit failure")
        fut = self._inner.local_fast_put_commit(plan)
        fut.result()
        self.held -= len(plan.keys)
        return fut

    def put_abort(self, plan):
        self.held -= len(plan.keys)
        return self._inner.put_abort(plan)


def as_bytes(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def payload(n_layers=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 4, 2, 4, generator=g).to(torch.bfloat16),
             torch.randn(1, 4, 2, 4, generator=g).to(torch.bfloat16)) for _ in range(n_layers)]


@pytest.fixture
def staged():
    inner = EmbeddedPlanClient(segment_bytes=MiB, prefault_threads=1)
    client = StagedClient(inner, staged=4)
    store = PlanTierStore(plan_client=client, transfer=HostTransferRuntime())
    yield store, client, inner
    store.close()
    inner.close()


def test_a_chunk_larger_than_the_staging_is_written_in_waves(staged):
    store, client, inner = staged
    kv = payload(3)  # 6 values, 4 fit
    h = store.put_async("wv:kv", kv, tier=Tier.FLUXON_DRAM)
    assert h.ready and client.peak <= 4 and sum(client.plans) == 6 and len(client.plans) >= 2
    for i, (k, v) in enumerate(kv):
        assert store.get_layer(h, i) == (as_bytes(k), as_bytes(v))  # the bytes of each value


def test_a_failed_later_wave_removes_the_earlier_waves(staged):
    store, client, inner = staged
    client.fail_commit_at = 2  # the second wave's commit fails
    with pytest.raises(StoreError, match="injected"):
        store.put_async("wf:kv", payload(3), tier=Tier.FLUXON_DRAM)
    keys = [k for i in range(3) for k in layer_keys("wf:kv", i)]
    assert not any(inner.contains([k])[0] if hasattr(inner, "contains") else k in inner.keys() for k in keys)
    assert inner.live_handles() == (0, 0)


class _Attached:
    """Stands in for an attached FluxonClient (construction touches nothing else of it)."""

    cluster_name, share_mem_path, op_timeout_s = "c", "/dev/shm/none", 1.0


def test_public_client_staging_from_the_geometry_and_checked_at_construction():
    value, chunk = 47_923_200, 80 * 47_923_200  # 480p LingBot: one layer's K, one chunk
    assert staging_for(None, None) == 256 * MiB
    assert staging_for(value, chunk) == chunk  # one 480p chunk (3.57 GiB) is one wave
    assert staging_for(value, 2 * chunk) == 4 << 30  # capped: a larger chunk is written in waves
    assert staging_for(1000, 40_000) == 64 * MiB  # small geometries get the floor
    with pytest.raises(ConfigError) as info:
        FluxonPublicPlanClient(staging_bytes=MiB, value_bytes=2 * MiB, client=_Attached())
    assert info.value.field == "store.client_options.staging_bytes" and "one value" in str(info.value)
    c = FluxonPublicPlanClient(value_bytes=value, chunk_bytes=2 * chunk, client=_Attached())
    assert c.staging_bytes == 4 << 30 and c.max_plan_values(value) == (4 << 30) // value
    c.close()
