"""Issue 5 item 3: a blob whose first size group committed and whose second failed leaves nothing
in the store. Proved with the real embedded client's ``keys()`` after the failure, through the
manager's ingest path, with K and V of different sizes (two Plans), on the synchronous host path
and on the overlapped (side stream, completion thread) path over the fake CUDA runtime."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import StoreError
from cacheseek.reuse.exact_prefix.keys import kv_locator, layer_keys, node_key
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime

from prodkit import FULL, PlanProxy, check_invariants, fake_cuda, new_manager

from fakes.plan_faults import FaultyEmbeddedPlanClient, PlanFaults

ROOT = b"R" * 32
N_LAYERS = 2


def mixed_payload(seed):
    """Per layer K of 4 tokens and V of 2 tokens (fp32): two size groups, K's first."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 4, 2, 4, generator=g), torch.randn(1, 2, 2, 4, generator=g))
            for _ in range(N_LAYERS)]


def latent(seed):
    return torch.full((1, 4, 3, 2, 4), float(seed))


@pytest.fixture(params=["host", "fake_cuda_overlap"])
def plan(request):
    faults = PlanFaults()
    client = FaultyEmbeddedPlanClient(segment_bytes=1 << 20, prefault_threads=1, faults=faults)
    proxy = PlanProxy(client)
    if request.param == "host":
        store = PlanTierStore(plan_client=proxy, transfer=HostTransferRuntime())
    else:
        runtime, _ = fake_cuda()
        store = PlanTierStore(plan_client=proxy, transfer=runtime, overlap=True)
    assert store.overlap == (request.param != "host")
    yield store, client, proxy, faults
    store.close()
    client.close()


@pytest.mark.parametrize("fault", ["commit_status", "commit_raise", "key_code"])
def test_failed_second_size_group_leaves_nothing_of_the_blob(plan, fault):
    store, client, proxy, faults = plan
    mgr = new_manager(store, FULL)
    ns = mgr.forest.get_or_create_namespace(ROOT, b"C")
    # an unrelated good chunk first: it must survive untouched
    good_key = node_key(ROOT, b"good")
    good = mgr.ingest(ns, ns.root, b"good", good_key, 0, mixed_payload(1), latent(1))
    store.flush()
    assert good.has_kv

    key = node_key(ROOT, b"bad")
    loc = kv_locator(key)
    k_keys = tuple(layer_keys(loc, i)[0] for i in range(N_LAYERS))
    v_keys = tuple(layer_keys(loc, i)[1] for i in range(N_LAYERS))

    def arm(keys):
        if keys == v_keys:  # the second size group of the failing blob, and only it
            if fault == "key_code":
                faults.key_codes[v_keys[1]] = 7
            else:
                faults.arm(fault)

    proxy.before_commit = arm
    try:
        mgr.ingest(ns, ns.root, b"bad", key, 0, mixed_payload(2), latent(2))
    except StoreError:
        pass  # the synchronous path raises; the overlapped one reports on the handle
    store.flush()
    proxy.before_commit = None
    faults.key_codes.clear()

    commits = [(keys, status) for op, keys, status in (e for e in proxy.log if e[0] == "commit")]
    assert (k_keys, 0) in commits  # the first group did commit ...
    assert any(keys == v_keys and status != 0 for keys, status in commits)  # ... the second failed
    removed = {e[1] for e in proxy.log if e[0] == "remove"}
    assert set(k_keys) <= removed  # ... and the committed values were removed again
    left = client.keys()
    assert not [k for k in left if k.startswith(loc)], left
    node = ns.root.children[b"bad"]
    assert not node.has_kv
    m = mgr.metrics.as_dict()
    assert m["dropped_writes"] + m["failed_writes"] >= 1
    assert check_invariants(mgr.forest, left) == []
    assert set(left) == {f"{good_key.hex()}:lat", f"{key.hex()}:lat",
                         *(k for i in range(N_LAYERS) for k in layer_keys(kv_locator(good_key), i))}
    assert client.live_handles() == (0, 0)

    # the chunk is cacheable again: a later ingest writes it whole
    again = mgr.ingest(ns, ns.root, b"bad", key, 0, mixed_payload(2), latent(2))
    store.flush()
    assert again is node and node.has_kv
    for i, (k, v) in enumerate(mixed_payload(2)):
        got_k, got_v = store.get_layer(node.blob, i, like=(k, v))
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert check_invariants(mgr.forest, client.keys()) == []
