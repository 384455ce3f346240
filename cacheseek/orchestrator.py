"""The generic orchestrator: turns a composed config into a running stack.

``build_stack(cfg)`` instantiates, from the registries, the runtime factory, the transfer runtime
(``auto`` follows the runtime's device), the layout adapter (``auto`` follows the runtime), the
namespace fingerprint fields and the store (``store: null`` resolves to the registry's default
backend, logged). Objects that OmegaConf cannot hold (a transfer runtime, a fake client) are
passed at the call site to the classes whose constructors name them: that is also how tests
inject fakes.

A stack starts with an empty forest: what the store holds (a previous run's chunks, or a live
neighbour's on a shared store) is found by key in the store's chunk records as sessions look it
up (`cacheseek.reuse.exact_prefix.shared_index`), so no snapshot is loaded or saved and any
number of processes may share one store. A store that can list and remove its values (LocalDisk)
is reconciled when the stack is built (`WorldKVManager.reconcile`): values of chunks never
committed (no record names them) and older than any write in flight (a killed writer's) are
removed instead of counting against the capacity; committed ones stay.

Sizes: the store's size fields (``size_fields``, `cacheseek.sizing`) are resolved before it is
built: ``auto`` is fitted to the workload (``workload``, else ``cfg.workload``) and the runtime's
geometry, units are read, and a size that cannot hold one chunk is a `ConfigError` with the
numbers; after it is built, a capacity the store reports (a Fluxon service's segment) is checked
the same way. Each choice made for the user (the default store, ``transfer: auto``, each ``auto``
size) and each size given is one line in ``Stack.notes``, logged and passed to ``note`` (the CLI
prints them).

Bad input is refused before anything starts: a key that ``+section.key=...`` added to a typed
section (`cacheseek.hydra_errors.appended_key`), a layout the runtime does not have, and a manager
section that the runtime's ring or the eviction rules refuse are each a `ConfigError` before the
transfer runtime and the store are built.

A store or transfer runtime that cannot start (no service to attach to, a missing package) is a
`ConfigError` naming ``store`` or ``transfer``, with the component's own message as the problem.

A `Stack` hands out managers and bindings that share one forest, one store and one
`CacheMetrics`, which is what a serving process does with many sessions. Managers get the
``manager.eviction`` section (policy and watermarks).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import attrs
import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from cacheseek import namespace, sizing
from cacheseek.errors import CacheSeekError, ConfigError
from cacheseek.eviction import EvictionConfig, make_policy, store_usage
from cacheseek.hydra_errors import appended_key, choose_a_store
from cacheseek.layout.ring_layout import RingLayout
from cacheseek.metrics import CacheMetrics
from cacheseek.registry import LAYOUTS, STORES, TRANSFERS, instantiate
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.manager import in_flight
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config, make_rolling_config
from cacheseek.reuse.exact_prefix.config import SharedIndexConfig
from cacheseek.sizes import format_size
from cacheseek.stores.base import TierStore, as_store
from cacheseek.transfer.protocol import TransferRuntime

log = logging.getLogger(__name__)

__all__ = ["Stack", "build_layout", "build_stack", "instantiate"]


@attrs.define
class Stack:
    cfg: DictConfig
    runtime_factory: Any  # a RUNTIMES entry: ``make(actions, hooks=...)``, ``geometry``, ``device``
    store: TierStore
    store_name: str
    transfer: TransferRuntime
    layout: RingLayout
    fields: list[type]  # FINGERPRINT_FIELDS entries
    forest: NamespaceForest
    run_dir: Path
    workload: Any = None  # a WORKLOADS entry: ``run(stack) -> results``
    notes: list[str] = attrs.field(factory=list)
    metrics: CacheMetrics = attrs.field(factory=CacheMetrics)

    def manager_config(self):
        return _manager_config(self.cfg, self.runtime_factory)

    def new_manager(self, forest: Any = None, *, shared_index: bool = True):
        """A manager on this stack's store (its forest, or ``forest``). ``shared_index`` False:
        it finds only what its own trie holds (a cold reference run on a fresh forest)."""
        index = SharedIndexConfig.from_conf(self.cfg.manager.get("shared_index"))
        if not shared_index:
            index = dataclasses.replace(index, enabled=False)
        return WorldKVManager(forest if forest is not None else self.forest, self.store,
                              self.manager_config(), eviction=_eviction_config(self.cfg),
                              metrics=self.metrics, shared_index=index,
                              frames_in_flight=self.cfg.manager.get("frames_in_flight", 8),
                              decoder_states_in_flight=self.cfg.manager.get("decoder_states_in_flight", 1))

    def new_binding(self, manager: Any = None, *, ingest_enabled: bool = True):
        manager = manager if manager is not None else self.new_manager()
        model = str(self.cfg.namespace.model_fingerprint).encode()
        weights = getattr(self.runtime_factory, "weights_fingerprint", None)  # a runtime that knows its weights
        return LingBotWorldKVBinding(manager, manager.forest,
                                     model_fingerprint=model + b":" + weights.hex().encode() if weights else model,
                                     ingest_enabled=ingest_enabled, layout=self.layout, fingerprint_fields=self.fields,
                                     decoder_state_every=int(self.cfg.manager.get("decoder_state_every", 0)))

    def run_session(self, actions: Any, *, manager: Any = None, ingest: bool = True,
                    frames: Optional[list] = None) -> tuple[Any, list, float]:
        """One session of ``actions`` through a new binding, the store flushed after it: the
        binding, the frame hashes and the seconds from the first chunk to the flushed store.
        ``frames``: a list that receives each chunk's frames (CPU float32; a lossy codec's verdict)."""
        binding = self.new_binding(manager, ingest_enabled=ingest)
        rt = self.runtime_factory.make(actions, hooks=binding)
        rt.keep_frames = frames is not None
        t0 = time.perf_counter()
        hashes = rt.generate()
        if frames is not None:
            frames.extend(rt.frames)
        self.store.flush()
        return binding, hashes, time.perf_counter() - t0

    def close(self) -> None:
        """Close the store (it flushes what is pending, bounded)."""
        self.store.close()


def build_stack(cfg: Any, *, run_dir: Optional[Path] = None, workload: Any = None,
                note: Optional[Callable[[str], None]] = None, **objects: Any) -> Stack:
    """Instantiate the configured stack. ``objects`` (e.g. ``store=``, ``transfer=``,
    ``plan_client=``, ``cudart=``) override or are injected into the configured components.
    ``workload``: the built workload (else ``cfg.workload`` is built when present); ``note``
    receives each choice made for the user, one line each (they are logged too)."""
    notes: list[str] = []

    def tell(line: str) -> None:
        notes.append(line)
        log.info("%s", line)
        if note is not None:
            note(line)

    appended = appended_key(cfg)
    if appended is not None:
        raise appended
    run_dir = Path(run_dir) if run_dir is not None else Path.cwd()
    runtime_factory = objects.pop("runtime_factory", None) or instantiate(cfg.runtime)
    if workload is None and cfg.get("workload") is not None:
        workload = instantiate(cfg.workload)
    every = cfg.manager.get("decoder_state_every", 0)  # validated below (`_manager_config`)
    need = sizing.need_for(runtime_factory, workload, every if isinstance(every, int) and not isinstance(every, bool) else 0)
    for line in getattr(runtime_factory, "start_notes", list)():  # what the user will see, and why
        tell(line)
    layout = build_layout(cfg.layout, runtime_factory)
    _manager_config(cfg, runtime_factory)  # the manager section against the runtime, before any store
    _eviction_config(cfg)
    SharedIndexConfig.from_conf(cfg.manager.get("shared_index"))
    fields = namespace.resolve_fields(None if cfg.namespace.fields is None else list(cfg.namespace.fields))

    transfer = objects.pop("transfer", None)
    if transfer is None:
        transfer = _starting("transfer", lambda: _build_transfer(cfg.transfer, runtime_factory.device, objects, tell))

    store = objects.pop("store", None)
    store_name, ask_capacity = "injected", False
    if store is None:
        store_cfg = cfg.get("store")
        if store_cfg is None:
            store_name = STORES.default
            tell(f"store: {store_name} (store: null is the embedded default; pick another with +store=NAME)")
            target = _target_of(STORES.get(store_name))
            store_cfg = OmegaConf.structured(STORES.schema(store_name)(_target_=target)) \
                if _has_schema(store_name) else OmegaConf.create({"_target_": target})
        elif "_target_" not in store_cfg:
            given = OmegaConf.to_container(store_cfg, resolve=False)
            raise choose_a_store("store", given, ", ".join(f"store.{k}" for k in given))
        else:
            store_name = _name_of(STORES, store_cfg["_target_"])
        store_cfg = OmegaConf.to_container(store_cfg, resolve=True)
        if "root" in store_cfg and store_cfg["root"] is None:
            store_cfg["root"] = str(_run_folder(run_dir) / "kvstore")
        for name, node in store_cfg.items():  # the levels of a tiered store
            if isinstance(node, dict) and "root" in node and node["root"] is None:
                node["root"] = str(_run_folder(run_dir / "kvstore") / name)
        size_fields = getattr(_class_of(store_cfg["_target_"]), "size_fields", None)
        sized = size_fields(store_cfg) if size_fields is not None else []
        if any(f.device_room for f in sized):
            room, label = sizing.runtime_device_room(runtime_factory, need)
            sized = [attrs.evolve(f, room=room, room_label=label) if f.device_room else f for f in sized]
        for line in sizing.resolve_sizes(store_cfg, sized, need, high_watermark=_high_watermark(cfg)):
            tell(line)
        store = _starting("store", lambda: instantiate(store_cfg, transfer=transfer,
                                                        geometry_bytes=_geometry_bytes(runtime_factory), **objects), store_name)
        ask_capacity = not sized  # its capacity is not in its config (a Fluxon service's segment)
    store = as_store(store)
    if ask_capacity:
        capacity = _check_reported_capacity(store, need)
        if capacity is not None:
            tell(f"store capacity: {format_size(capacity)} (as the {store_name} store reports it)")
    forest = NamespaceForest()
    stack = Stack(cfg=cfg, runtime_factory=runtime_factory, store=store, store_name=store_name,
                  transfer=transfer, layout=layout, fields=fields, forest=forest,
                  run_dir=run_dir, workload=workload, notes=notes)
    try:
        stack.metrics.bind_store(store)
        if store.lists_values:
            # A killed writer's uncommitted values (no record names them) are unreachable.
            done = stack.new_manager().reconcile()
            if done["orphans_removed"] or done["invalidated"]:
                log.info("store %s: removed %d values no node names, invalidated %d nodes whose values are gone",
                         store_name, done["orphans_removed"], done["invalidated"])
    except BaseException:
        stack.close()  # never a failed build holding the store (a LocalDisk root's lock)
        raise
    return stack


def _manager_config(cfg: Any, runtime_factory: Any) -> Any:
    """The manager's window config from ``manager`` and the runtime's ring (a ConfigError when
    they disagree). `build_stack` calls it before the store is built, so a bad manager section
    never leaves a started store (or its files) behind."""
    rt = runtime_factory
    be = int(cfg.manager.break_even_k)
    if be < 1:
        raise ConfigError("manager.break_even_k", f"must be >= 1, got {be}",
                          "manager.break_even_k=1 (restore any cached prefix of 1 chunk or more)")
    every = cfg.manager.get("decoder_state_every", 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError("manager.decoder_state_every", f"must be an integer >= 0, got {every!r}",
                          "manager.decoder_state_every=0 (rebuild the decoder's state by replay at divergence)")
    in_flight("manager.frames_in_flight", cfg.manager.get("frames_in_flight", 8))
    in_flight("manager.decoder_states_in_flight", cfg.manager.get("decoder_states_in_flight", 1))
    if rt.local_attn_size == -1:
        return make_full_kv_config(break_even_k=be)
    return make_rolling_config(local_attn_size=rt.local_attn_size, sink_size=rt.sink_size,
                               chunk_size=rt.geometry.chunk_size, break_even_k=be)


def _eviction_config(cfg: Any) -> EvictionConfig:
    eviction = EvictionConfig.from_conf(cfg.manager.get("eviction"))
    make_policy(eviction.policy)  # an unknown name is a ConfigError now, not at the first session
    return eviction


def _geometry_bytes(runtime_factory: Any) -> Optional[tuple[int, int]]:
    """``(one layer's K or V of a chunk, one chunk's KV)`` in bytes, for stores whose clients size
    their staging from it (None when the runtime does not say)."""
    try:
        g = runtime_factory.geometry
        itemsize = torch.empty((), dtype=getattr(torch, str(getattr(runtime_factory, "dtype", "bfloat16")))).element_size()
        value = int(g.chunk_tokens * g.n_heads * g.head_dim * itemsize)
        return value, 2 * int(g.n_layers) * value
    except Exception:  # noqa: BLE001 - a runtime without a geometry: clients keep their defaults
        return None


def _starting(component: str, build: Callable[[], Any], name: str = "") -> Any:
    """``build()``; a CacheSeek error other than a ConfigError (a service that is not there, a
    package that is missing) becomes a ConfigError naming ``component``: the run cannot start."""
    try:
        return build()
    except ConfigError:
        raise
    except CacheSeekError as exc:
        what = f"{name} cannot start" if name else "cannot start"
        raise ConfigError(component, f"{what}: {exc}",
                          f"what the message says, or run without it: {_NEEDS_NOTHING[component]}") from exc


# The choice of each component that needs no service, package or device: the fix's way out.
_NEEDS_NOTHING = {"store": "+store=memory", "transfer": "transfer=host"}


def _check_reported_capacity(store: TierStore, need: Any) -> Optional[int]:
    """The capacity ``store`` reports (None: unbounded or unknown), checked against one chunk."""
    usage = store_usage(store)
    capacity = None if usage is None else usage.capacity_bytes
    try:
        sizing.check_capacity(capacity, need, "store", store.capacity_fix)
    except BaseException:
        store.close()
        raise
    return capacity


def _high_watermark(cfg: Any) -> float:
    try:
        return float(cfg.manager.eviction.high_watermark)
    except (AttributeError, TypeError, ValueError):
        return 0.9


def _run_folder(folder: Path) -> Path:
    """A folder of the run's own (a store root's parent under it): made here, since a store
    creates its root but never the folders above it."""
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _has_schema(name: str) -> bool:
    try:
        STORES.schema(name)
    except KeyError:
        return False
    return True


def _class_of(target: str) -> Any:
    try:
        return get_class(target)
    except Exception:  # noqa: BLE001 - instantiate reports a bad target with its own message
        return None


def build_layout(node: Any, runtime_factory: Any) -> Any:
    """The configured layout adapter; ``auto`` follows the runtime. A runtime that names its layout
    (``layout_name``) refuses another one here, before any session."""
    layout = instantiate(node, runtime_factory=runtime_factory)
    expected = getattr(runtime_factory, "layout_name", None)
    if expected and not isinstance(layout, LAYOUTS.get(expected)):
        raise ConfigError("layout", f"the runtime's sessions have the {expected!r} layout, not "
                          f"{type(layout).__name__}'s", f"use layout={expected} or layout=auto")
    return layout


def _build_transfer(node: Any, device: str, objects: dict[str, Any], tell: Callable[[str], None]) -> Any:
    name = _name_of(TRANSFERS, node["_target_"])
    if name == "auto":
        name = "cuda" if str(device).startswith("cuda") else "host"
        node = OmegaConf.create({"_target_": _target_of(TRANSFERS.get(name))})
        tell(f"transfer: {name} (auto, for runtime.device={device})")
    # a runtime that takes a device (CUDA) creates its streams, events and threads on this one
    return instantiate(node, device=str(device), **objects)


def _target_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _name_of(registry: Any, target: str) -> str:
    for name in registry.names():
        if _target_of(registry.get(name)) == target:
            return name
    return target
