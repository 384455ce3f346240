"""The Plan tier's chunk records: taken from its client (`PlanSharedRecords`), published by the
manager, retracted by `free` before any value goes; and what a restore does when the records
cannot be read (a stopped etcd): a miss that invalidates nothing. An embedded client that offers
a dict of records stands in for a Fluxon cluster's client; the generic tier is run beside it."""

from __future__ import annotations

import pytest

from cacheseek.errors import StoreError
from cacheseek.kv.locators import blob_keys
from cacheseek.kv.records import NO_RECORDS, DictRecords
from cacheseek.orchestrator import build_stack
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.reuse.exact_prefix import NamespaceForest
from cacheseek.stores.kv_tier import KeyValueTier
from cacheseek.stores.memory import DictBackend
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime
from plan_testkit import RecordingClient

MiB = 1 << 20


class SwitchedRecords(DictRecords):
    """Records in a dict whose medium can be made unreachable (``down``)."""

    down = False

    def _get_many(self, names):
        if self.down:
            raise StoreError("records unreachable")
        return super()._get_many(names)


class SharedEmbedded(EmbeddedPlanClient):
    """An embedded client offering chunk records, as a Fluxon cluster's client does."""

    def __init__(self) -> None:
        super().__init__(segment_bytes=16 * MiB, prefault_threads=1)
        self.records = SwitchedRecords()


def plan_store(client) -> PlanTierStore:
    return PlanTierStore(plan_client=client, transfer=HostTransferRuntime(), overlap=False)


def test_records_come_from_the_client():
    embedded = PlanTierStore(segment_bytes=16 * MiB, transfer=HostTransferRuntime(), overlap=False)
    assert embedded.records is NO_RECORDS  # one process: nothing to share
    embedded.close()
    client = SharedEmbedded()
    store = plan_store(RecordingClient(client, []))  # found through a delegating proxy too
    assert store.records is client.records
    store.close()
    client.close()


def ready(forest) -> list:
    return sorted((n for ns in forest.namespaces() for n in ns.iter_nodes() if n.has_kv), key=lambda n: n.depth)


def session(stack, manager=None, **kw):
    gate = stack.workload
    binding, hashes, _ = stack.run_session(gate.P + gate.X, manager=manager, **kw)
    return binding.last_fast_forward, hashes


@pytest.mark.parametrize("kind", ["plan", "generic"])
def test_found_by_key_retracted_on_free_and_an_unreadable_recheck_invalidates_nothing(compose_cfg, tmp_path, kind):
    if kind == "plan":
        client = SharedEmbedded()
        store, records = plan_store(client), client.records
    else:
        records = SwitchedRecords()
        store = KeyValueTier(DictBackend(), name="shared-dict", records=records)
    # the eager restore (what a session materializes at divergence): its re-check of the records;
    # a full hit served from frames restores no KV, and its frames check themselves (key, digest)
    stack = build_stack(compose_cfg("runtime.handout=false"), store=store, run_dir=tmp_path)
    n = stack.workload.n
    try:
        k, a = session(stack)
        assert k == 0 and stack.metrics.as_dict()["index_published"] == n
        # another worker's empty trie finds every chunk by key
        k, b = session(stack, stack.new_manager(forest=NamespaceForest()))
        assert k == n and b == a and stack.metrics.as_dict()["index_adopted"] == n
        # the records unreachable: the local trie's restore cannot be re-checked: a miss, nothing lost
        records.down = True
        k, c = session(stack)
        assert k == 0 and c == a
        metrics = stack.metrics.as_dict()
        assert metrics["invalidations"] == 0 and metrics["index_recheck_misses"] == 0
        assert len(ready(stack.forest)) == n and records.stats.probe_errors >= 1
        records.down = False
        assert session(stack) == (n, a)
        # free: the record goes, then the values
        victim = ready(stack.forest)[1]
        store.free(victim.blob)
        assert records.find([victim.node_key]) == [None]
        assert not any(store.contains(list(blob_keys(victim.blob.locator, victim.blob.n_layers))))
    finally:
        stack.close()
        if kind == "plan":
            client.close()
