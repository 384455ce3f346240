"""Helpers of the production-behaviour tests (issue 5): sessions on the synthetic runtime, Plan
tier stores over the embedded client, and the store/trie invariants every test checks.

Invariants (`check_invariants`):
- no orphan value: every value in the store is the latent of some node's skeleton, a KV value
  of a node whose blob is ready or still in flight, or a value of a chunk whose record the store
  holds (a record and its chunk's values: the store's own index);
- no half-published node: every node whose blob is ready has all ``2 * n_layers`` KV values and
  its latent in the store;
- nothing is referenced (``ref_count == 0``), being freed or invalidated (``state``) once idle.
"""

from __future__ import annotations

import errno
from typing import Any, Callable, Optional

from cacheseek.errors import StoreFullError
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.kv.records import RECORD_SUFFIX
from cacheseek.reuse.exact_prefix.telefuser_lingbot import (
    LingBotWorldKVBinding,
    make_full_kv_config,
    make_rolling_config,
)
from cacheseek.reuse.exact_prefix.types import NodeState
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
from cacheseek.stores.memory import InMemoryTierStore
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime

from fakes.plan_faults import FaultyEmbeddedPlanClient, PlanFaults

N = 5
FULL = (-1, 0)
ROLLING = (7, 3)
MODES = {"full": FULL, "L7S3": ROLLING}
WAIT_S = 10.0


def acts(n: int = N, *, variant: int = 0) -> list[list[float]]:
    return [[0.1 * i + variant, -0.05 * i, 0.02 * variant, 0.3 * (i % 2)] for i in range(n)]


ACTS = acts()


def factory(mode=FULL) -> SyntheticRuntimeFactory:
    return SyntheticRuntimeFactory(geometry="tiny", local_attn_size=mode[0], sink_size=mode[1])


def manager_cfg(mode=FULL, break_even_k: int = 1):
    if mode[0] == -1:
        return make_full_kv_config(break_even_k=break_even_k)
    return make_rolling_config(local_attn_size=mode[0], sink_size=mode[1], chunk_size=3,
                               break_even_k=break_even_k)


def new_manager(store, mode=FULL, forest=None, **kw) -> WorldKVManager:
    return WorldKVManager(forest if forest is not None else NamespaceForest(), store, manager_cfg(mode), **kw)


def run_session(manager: WorldKVManager, mode=FULL, actions=ACTS, *, ingest: bool = True):
    """One full session through the real binding; returns (binding, runtime, frame hashes)."""
    b = LingBotWorldKVBinding(manager, manager.forest, ingest_enabled=ingest)
    rt = factory(mode).make(actions, hooks=b)
    hashes = rt.generate()
    flush = getattr(manager.store, "flush", None)
    if flush is not None:
        flush()
    return b, rt, hashes


_COLD: dict = {}


def cold_hashes(mode=FULL, actions=ACTS) -> list[bytes]:
    key = (mode, tuple(map(tuple, actions)))
    if key not in _COLD:
        _COLD[key] = factory(mode).make(actions, hooks=None).generate()
    return _COLD[key]


def nodes(forest: NamespaceForest) -> list:
    return [n for ns in forest.namespaces() for n in ns.iter_nodes()]


def chain(forest: NamespaceForest) -> dict[int, Any]:
    """depth -> node of a forest holding a single chain."""
    out = {}
    for n in nodes(forest):
        assert n.depth not in out, "one chain expected"
        out[n.depth] = n
    return out


def store_keys(store: Any) -> list[str]:
    if isinstance(store, PlanTierStore):
        inner = store.plan_client
        return list((inner.inner if isinstance(inner, PlanProxy) else inner).keys())
    return list(store.keys())


def check_invariants(forest: NamespaceForest, keys: list[str]) -> list[str]:
    """Violations of the invariants of the module docstring (empty when all hold)."""
    present = set(keys)
    allowed: set[str] = set()
    problems: list[str] = []
    for n in nodes(forest):
        if n.ref_count != 0 or n.state in (NodeState.FREEING, NodeState.INVALID):
            problems.append(f"{n!r}: ref_count {n.ref_count}, state {n.state.value}")
        if n.skeleton is not None:
            allowed.add(n.skeleton.latent_locator)
        blob = n.blob
        if blob is None or blob.error is not None:
            continue
        kv = [k for layer in range(blob.n_layers) for k in layer_keys(blob.locator, layer)]
        allowed.update(kv)
        if blob.ready:
            missing = [k for k in kv if k not in present]
            if n.skeleton is None or n.skeleton.latent_locator not in present:
                missing.append("latent")
            if missing:
                problems.append(f"half-published {n!r}: missing {missing}")
    committed = {k.partition(":")[0] for k in present if k.endswith(RECORD_SUFFIX)}
    for hex_ in committed:  # a chunk record names its chunk's values (the store's own index)
        if f"{hex_}:lat" not in present or f"{hex_}:kv:L0:k" not in present:
            problems.append(f"record {hex_[:16]} without its values")
    orphans = sorted(k for k in present - allowed if k.partition(":")[0] not in committed)
    if orphans:
        problems.append(f"orphan values: {orphans}")
    return problems


def plan_store(
    *,
    segment_bytes: int = 1 << 20,
    faults: Optional[PlanFaults] = None,
    transfer: Any = None,
    **kw: Any,
) -> tuple[PlanTierStore, EmbeddedPlanClient]:
    """A Plan tier over a fresh embedded client (the caller closes both: `close_plan`)."""
    client = FaultyEmbeddedPlanClient(segment_bytes=segment_bytes, prefault_threads=1, faults=faults or PlanFaults())
    store = PlanTierStore(plan_client=client, transfer=transfer or HostTransferRuntime(), **kw)
    return store, client


def close_plan(store: PlanTierStore, client: EmbeddedPlanClient) -> None:
    try:
        store.close()
    finally:
        client.close()


class FaultyBackend:
    """Wraps a `ValueBackend`: ``write_fault(n, key)`` / ``read_fault(n, key)`` return an
    exception to raise (or, for reads, the string ``"missing"`` to answer None) on the n-th call."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.writes = 0
        self.reads = 0
        self.write_fault: Optional[Callable[[int, str], Any]] = None
        self.read_fault: Optional[Callable[[int, str], Any]] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, key: str, value: Any) -> None:
        self.writes += 1
        fault = self.write_fault(self.writes, key) if self.write_fault else None
        if fault is not None:
            raise fault
        self._inner.write(key, value)

    def read(self, key: str) -> Any:
        self.reads += 1
        fault = self.read_fault(self.reads, key) if self.read_fault else None
        if fault == "missing":
            return None
        if fault is not None:
            raise fault
        return self._inner.read(key)


def fake_cuda(**kw: Any) -> tuple[Any, Any]:
    """A CUDA transfer runtime over the fake cudart, CPU tensors standing in for device ones."""
    from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
    from fakes.cudart import FakeCudart

    fake = FakeCudart(unknown_is_device=True, **kw)
    return CudaTransferRuntime(cudart=fake, current_stream=lambda: 7, tensor_device_type="cpu"), fake


class PlanProxy:
    """Delegates to a Plan client; logs ``("commit", keys, 0 | status | key code | "raised")`` and
    ``("remove", key)``;
    ``before_commit(keys)`` runs right before a commit is handed to the client (to arm a fault
    for exactly that plan)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.log: list[tuple] = []
        self.before_commit: Optional[Callable[[tuple], None]] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def local_fast_put_commit(self, plan: Any) -> Any:
        if self.before_commit is not None:
            self.before_commit(tuple(plan.keys))
        try:
            future = self.inner.local_fast_put_commit(plan)
        except Exception:
            self.log.append(("commit", tuple(plan.keys), "raised"))
            raise
        result = future.result()
        ok = result.status == 0 and not any(result.key_codes)
        self.log.append(("commit", tuple(plan.keys), 0 if ok else (result.status or max(result.key_codes))))
        return future

    def remove(self, key: str) -> None:
        self.log.append(("remove", key))
        self.inner.remove(key)


class OffByOneStore(InMemoryTierStore):
    """A store that hands back one wrong K value in every layer it reads: a workload's verdict
    must see it."""

    def get_layer(self, handle, layer):
        got = super().get_layer(handle, layer)
        if got is None:
            return None
        k, v = got
        k = k.clone()
        k.view(-1)[0] += 1
        return k, v


class BudgetDisk:
    """A LocalDisk backend (`DiskBackend`) whose disk holds ``budget`` bytes: a write that would
    take the files above it fails as the disk does (the real backend's ENOSPC path:
    `StoreFullError`), and ``free_bytes`` says what the budget leaves (the real backend asks
    ``statvfs``)."""

    def __init__(self, inner, budget: int) -> None:
        self.inner, self.budget = inner, budget

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def free_bytes(self):
        return max(0, self.budget - self.inner.disk_usage_bytes())

    def write(self, key, value):
        size = self.inner.stored_nbytes(key, value)
        old = self.inner.path_of(key).stat().st_size if self.inner.exists(key) else 0
        if self.inner.disk_usage_bytes() - old + size > self.budget:
            raise StoreFullError(f"localdisk: disk full writing {key}: [Errno {errno.ENOSPC}] (simulated)")
        return self.inner.write(key, value)
