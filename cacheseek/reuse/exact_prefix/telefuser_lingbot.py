"""The runtime binding for LingBot-World on TeleFuser (and runtimes with the same cache semantics).

One `LingBotWorldKVBinding` per session. The runtime calls:

- ``on_runtime_created(runtime, session_config)`` once: the binding derives the namespace root,
  restores the longest cached prefix K of the chunks whose controls the session *planned*
  (``runtime.control_chunks``, TeleFuser main's `plan_controls`) into the runtime, and sets
  ``last_fast_forward = K`` (0 = cold). A live session that streams its controls one chunk at a
  time plans none: nothing is looked up here. Action keys (`LazyActionKeys`) are computed only as
  the trie walk needs them (none at a fresh namespace, at most key 0 on a cold miss, keys 0..K on
  a hit); the others on one background thread started after the lookup. A store that cannot
  serve yet (``ready`` False: a background warm-up) is bypassed: no namespace, no keys, no
  lookup, nothing ingested for the session (``sessions_bypassed_warming``), so the session costs
  what it costs with no cache;
- ``on_chunk_control(runtime, idx, control)`` as chunk ``idx`` starts, from the integration's
  per-chunk seam (`cacheseek.integrations.telefuser`): the control the model gets for that
  chunk, an override or the planned one (None for none). That control keys the chunk. For a chunk
  restored at creation it must be the planned control (same key), else `ControlMismatchError`:
  the restored frames belong to the planned control;
- ``on_chunk_finalized(runtime, idx, denoised)`` after each denoised chunk: the binding ingests
  the chunk's KV from the ring tail ``[local_end - c*ft, local_end)`` and its latent (a call for
  a restored chunk, which TeleFuser main makes for its decode-only chunks, is ignored). Chunk
  ``idx`` is keyed by the control it ran with: the one `on_chunk_control` named, else the
  planned one. A chunk with neither is not cached, nor is any later chunk of the session
  (``chunks_unkeyed``, logged once): never keyed by a placeholder. A control without a key fails
  that chunk's ingest (``action_key_errors``) and the session ingests no further;
- ``close()`` (optional): the keys' thread stopped and joined; it also ends by itself once every
  key is computed, and is joined when the last chunk is ingested.

A live session's hooks (``on_control_arrived``, ``withdraw_control``, ``restore_chunk``, and the
restore of a chunk on a cached path in ``on_chunk_control``) are `live_chunks.LiveChunks`'; the
creation-time restore target is `prefix_window.PrefixWindow`, a chunk's mid-session one
`chunk_window.ChunkWindow`.

Start-up: from its creation until ``on_runtime_created`` returns the binding holds the store's
``session_starting()`` token, where the store offers one, so a background warm-up registers no
segment piece while the runtime makes its allocations (`cacheseek.stores.startup`).

The binding touches the runtime only through its layout adapter (`cacheseek.layout`): the ring
and cursors, geometry, controls, timesteps, RNG, latent spec and cached latents. The default,
``bshd``, reads ``runtime.self_kv_cache``, ``noise_chunks``, ``control_chunks``, ``generator``
and the other attributes of TeleFuser 0.1.0.post3 and the hooked commit; ``telefuser_main``
finds them behind TeleFuser main's denoise-stage cache handle.

Restore publication is the window's ``set_resume_depth``, called by the manager only after every
input was fetched and copied (`PrefixWindow`, `ChunkWindow`): a failure before it leaves the
runtime's state (cursors, ``ring[:local_end]``, latents, RNG) exactly as before.

Metrics: the bindings of one manager count into its `CacheMetrics`; ``serve_metrics(manager,
port=0)`` (re-exported here from `cacheseek.metrics_server`) serves them on
``http://127.0.0.1:PORT/metrics`` for Prometheus, one port per worker process of a service
(``port=base + rank``, or 0 and the port it got, ``server.url``). Off unless called.

What goes to the store on write depends on its capability: a `PathReadStore` gets detached views
of the ring tail (it copies before the hook returns); a generic tier gets owned CPU snapshots.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import xxhash

from cacheseek import namespace, weights
from cacheseek.errors import CacheSeekError, ConfigError, GeometryError, LayoutMismatchError, StoreError, StoreWarmingError
from cacheseek.hooks import RuntimeHooks
from cacheseek.integrations.telefuser import unattached_release
from cacheseek.kv.ring import RingGeometry
from cacheseek.layout.auto import layout_name_of_runtime
from cacheseek.layout.bshd import BshdLayout
from cacheseek.metrics_server import serve_metrics
from cacheseek.registry import LAYOUTS
from cacheseek.reuse.exact_prefix.actions import action_bytes
from cacheseek.reuse.exact_prefix.config import WorldKVConfig
from cacheseek.reuse.exact_prefix.encodes import SessionEncodes
from cacheseek.reuse.exact_prefix.handout import HandOut
from cacheseek.reuse.exact_prefix.hook_failures import counted_failures
from cacheseek.reuse.exact_prefix.keys import canonical_json_bytes, config_blob_hash, node_key, root_hash, sha256
from cacheseek.reuse.exact_prefix.lazy_keys import UNKNOWN, ControlUnknownError, LazyActionKeys
from cacheseek.reuse.exact_prefix.live_chunks import LiveChunks
from cacheseek.reuse.exact_prefix.manager import WorldKVManager
from cacheseek.reuse.exact_prefix.prefix_window import PrefixWindow
from cacheseek.reuse.exact_prefix.trie import NamespaceForest, load_forest_snapshot, save_forest_snapshot
from cacheseek.reuse.exact_prefix.types import TrieNode

log = logging.getLogger(__name__)

__all__ = ["make_full_kv_config", "make_rolling_config", "LingBotWorldKVBinding", "action_bytes", "serve_metrics"]


_DEFAULT_MODEL_FINGERPRINT = b"lingbot-world-fast"
_warned_weights: list[bool] = []
_logged_bypass: list[bool] = []
_warned_unattached: list[bool] = []


def _warn_no_weights_fingerprint() -> None:
    if not _warned_weights:
        _warned_weights.append(True)
        log.warning("the runtime has no weights_fingerprint and model_fingerprint is the default: two "
                    "checkpoints would share a namespace; pass model_fingerprint=<hash of the weights>")


def _real_model(runtime: Any) -> bool:
    """A runtime of a real model (TeleFuser's), whose weights a default name cannot identify."""
    return type(runtime).__module__.split(".")[0] == "telefuser"


def make_full_kv_config(*, break_even_k: int = 1) -> WorldKVConfig:
    """Full-length attention: the window is every chunk of the path."""
    return WorldKVConfig(window_chunks=0, sink_chunks=0, break_even_k=break_even_k)


def make_rolling_config(
    *, local_attn_size: int = 7, sink_size: int = 3, chunk_size: int = 3, break_even_k: int = 1
) -> WorldKVConfig:
    ring = RingGeometry(chunk_size=chunk_size, frame_tokens=1, local_attn_size=local_attn_size,
                        sink_size=sink_size)
    return WorldKVConfig(window_chunks=ring.window_chunks, sink_chunks=ring.sink_chunks,
                         break_even_k=break_even_k)


def _image_fingerprint(image: Any) -> bytes:
    """The start image's identity: its mode, size and pixels (xxh3-128 of the pixel bytes inside
    the sha256 envelope: 0.1 ms for a 480p image, where sha256 of the bytes took 1.6 ms of every
    session on the H200 host; until issue 24 the envelope held the bytes themselves, so roots
    written before miss once)."""
    if image is None:
        return sha256(b"image", b"none")
    return sha256(b"image", b"xxh3-128", str(image.mode).encode(), canonical_json_bytes(list(image.size)),
                  xxhash.xxh3_128(image.tobytes()).digest())


class LingBotWorldKVBinding(LiveChunks, HandOut, RuntimeHooks):
    def __init__(self, manager: WorldKVManager, forest: NamespaceForest, *,
                 model_fingerprint: bytes = _DEFAULT_MODEL_FINGERPRINT, ingest_enabled: bool = True,
                 snapshot_path: Optional[str] = None, snapshot_on_finalize: bool = False, layout: Any = None,
                 fingerprint_fields: Optional[Sequence[Any]] = None,
                 require_weights_fingerprint: Optional[bool] = None, handout: bool = True,
                 decoder_state_every: int = 0) -> None:
        if unattached_release() and not _warned_unattached:
            _warned_unattached.append(True)
            log.warning("TeleFuser 0.1.0.post3 never calls a binding itself and no pipeline of this process is "
                        "attached, so its sessions run uncached (fix: call "
                        "cacheseek.integrations.telefuser.attach(pipeline) after pipeline.init(), before making "
                        "bindings)")
        self._auto_layout = layout is None  # told from the runtime (`layout_name_of_runtime`)
        if layout is None:
            layout = BshdLayout()
        self.manager = manager
        self.forest = forest
        self.model_fingerprint = model_fingerprint
        self.require_weights_fingerprint = require_weights_fingerprint
        self.ingest_enabled = ingest_enabled
        self.snapshot_path = snapshot_path
        self.snapshot_on_finalize = snapshot_on_finalize
        self.layout = layout
        self.fields = list(fingerprint_fields) if fingerprint_fields is not None else namespace.resolve_fields(None)
        self.last_fast_forward = 0
        self.handout_enabled = handout  # False: the eager restore even where the runtime serves frames
        if isinstance(decoder_state_every, bool) or not isinstance(decoder_state_every, int) or decoder_state_every < 0:
            raise ConfigError("manager.decoder_state_every", f"must be an integer >= 0, got {decoder_state_every!r}",
                              "0 rebuilds the decoder's state by replay; N stores it after chunks N-1, 2N-1, ...")
        self.decoder_state_every = decoder_state_every
        self._written: dict[int, TrieNode] = {}  # chunks this session wrote, until their frames are stored
        self._encodes = SessionEncodes(manager.encodes)  # asked before on_runtime_created: not reset there
        self._reset_live()
        self._reset_handout()
        if snapshot_path is not None and len(forest) == 0:
            try:
                load_forest_snapshot(snapshot_path, into=forest)
            except ConfigError as exc:  # the forest is marked incomplete: a reconcile removes nothing
                log.warning("forest snapshot not loaded, starting from the store's records alone: %s", exc)
        self.root: Optional[bytes] = None
        self.actions: list[bytes] = []
        self.ring: Optional[RingGeometry] = None
        self.ingest_errors = 0
        self.bytes_written = 0
        self.bytes_restored = 0
        self.bypassed_warming = False
        self._ns = None
        self._cursor: Optional[TrieNode] = None
        self._keys: Optional[LazyActionKeys] = None
        # A background warm-up yields to this session's start-up (the runtime's allocations)
        # until on_runtime_created returns; a token never released expires in the store.
        self._start_token: Any = manager.store.session_starting()

    # -- hooks (each inside `counted_failures`: TeleFuser swallows a hook's exceptions) ---------
    # the live-session hooks (on_control_arrived, on_chunk_control, restore_chunk) are `LiveChunks`'

    def session_encodes(self) -> Optional[SessionEncodes]:
        """The session's stored encodes (`encodes`), unless the store cannot serve yet."""
        return self._encodes if self.manager.store.ready else None

    def on_runtime_created(self, runtime: Any, session_config: Any) -> None:
        try:
            with counted_failures(self, "on_runtime_created"):
                self._on_runtime_created(runtime, session_config)
        finally:
            self._end_start_up()

    def on_chunk_finalized(self, runtime: Any, idx: int, denoised: Any) -> None:
        with counted_failures(self, "on_chunk_finalized"):
            self._on_chunk_finalized(runtime, idx, denoised)

    def close(self, timeout_s: float = 30.0) -> None:
        """End the session's use of the binding: the action keys' background thread is stopped
        and joined (bounded), a start-up token still held is released, the staging buffers of
        its live restores are freed where no other session holds them. Idempotent; the runtime
        need not call it (the thread ends by itself once every key is computed)."""
        self._end_start_up()
        if self._keys is not None and not self._keys.close(timeout_s):
            log.warning("the action keys' thread is still running after %.0f s", timeout_s)
        self._close_live()

    def _end_start_up(self) -> None:
        token, self._start_token = self._start_token, None
        if token is not None:
            token.release()

    def _on_runtime_created(self, runtime: Any, session_config: Any) -> None:
        if self._keys is not None:  # a binding used for a second session
            self._keys.close()
        self._ns, self._cursor, self._keys, self.actions = None, None, None, []
        self.root, self.last_fast_forward = None, 0
        self._written = {}
        self._reset_live()
        self._reset_handout()
        if self._auto_layout:
            self.layout = self._layout_of(runtime)
        self.ring = self._validate_geometry(runtime)  # a misconfiguration is refused even while warming
        runtime_weights = self._runtime_weights(runtime)
        self.bypassed_warming = not self.manager.store.ready
        if self.bypassed_warming:
            self._bypass_warming()
            return
        ctx = namespace.FingerprintContext(session_config, runtime, self.layout, self.manager.store)
        cfg = namespace.config_blob(self.fields, ctx)
        weights = sha256(b"weights", self.model_fingerprint, runtime_weights)
        cbh = config_blob_hash(cfg, weights_fingerprint=weights)
        prompt = _get(session_config, "prompt") or ""
        self.root = root_hash(image_fp=_image_fingerprint(_get(session_config, "image")),
                              prompt_fp=sha256(b"prompt", str(prompt).encode("utf-8")),
                              config_blob_hash=cbh)
        n_chunks = self.layout.n_chunks(runtime)
        planned = list(self.layout.controls(runtime) or ())[:n_chunks]  # a live session plans none
        self._keys = keys = LazyActionKeys(planned + [UNKNOWN] * (n_chunks - len(planned)))
        self.actions = keys
        known = keys.known_prefix()
        self._ns = self.forest.get_or_create_namespace(self.root, cbh)  # the lookup may adopt into it
        if known and self._handout:  # served from frames; the KV is restored only where it computes
            result = self.manager.find(self.root, keys[:known])
            if result.start_chunk > 0:
                self._lazy = result.node.path()
        elif known:
            window = PrefixWindow(self.layout, runtime, self.ring, self._published)
            result = self.manager.try_fast_forward(self.root, keys[:known], window)  # keys as the walk needs them
        if not known:
            self._cursor = self._ns.root
        elif self._lazy:
            self._cursor = result.node
            self.last_fast_forward = result.start_chunk
        elif result.start_chunk > 0:
            self._cursor = result.node
            self.bytes_restored = window.bytes_restored
            self.last_fast_forward = result.start_chunk
        else:
            self._cursor = self._ns.root
        if self.last_fast_forward > 0:  # a cached prefix: the encodes it ran are stored now
            self._encodes.commit(self.root)
        if self.ingest_enabled:
            keys.compute_rest_in_background()  # each chunk's ingest takes its key from there

    def _published(self, restored: int) -> None:
        """`PrefixWindow`'s publication: ``restored`` chunks are decoded only."""
        self.last_fast_forward = restored

    def _layout_of(self, runtime: Any) -> Any:
        """The adapter for ``runtime`` when none was given: the current one if it fits."""
        cls = LAYOUTS.get(layout_name_of_runtime(runtime))
        return self.layout if type(self.layout) is cls else cls()

    def _bypass_warming(self) -> None:
        """The store cannot serve yet (a background warm-up): the session runs as with no cache,
        without a namespace, keys or a lookup, and ingests nothing."""
        self.manager.metrics.add(sessions_bypassed_warming=1)
        if not _logged_bypass:
            _logged_bypass.append(True)
            log.info("the store is still warming up: sessions run uncached (no keys, no lookup, no "
                     "writes) until it is ready; counted as sessions_bypassed_warming")

    def _on_chunk_finalized(self, runtime: Any, idx: int, denoised: Any) -> None:
        if not self.ingest_enabled or self._ns is None:
            return
        if idx < self.last_fast_forward or idx in self._restored:  # TeleFuser main reports decode-only chunks
            return
        if self._unkeyed_from is not None:
            self._count_unkeyed(idx)
            return
        if self._cursor is None:
            return
        parent = self._cursor
        if parent.depth != idx - 1:
            raise CacheSeekError(f"chunk {idx} finalized but the trie cursor is at depth {parent.depth}")
        try:
            action = self.actions[idx]  # computed in the background by now, else waited for
        except ControlUnknownError:  # no control was ever named for this chunk: not keyable
            self._unkeyed_from = idx
            self._cursor = None
            self._count_unkeyed(idx)
            return
        except ValueError as exc:  # a control without a key: nothing from here on can be keyed
            self.ingest_errors += 1
            self._cursor = None
            self.manager.metrics.add(action_key_errors=1)
            log.warning("ingest of chunk %d failed (the run goes on uncached from here): %s", idx, exc)
            return
        finally:
            if self._keys is not None and idx == len(self._keys) - 1:
                self._keys.close()  # the session's last key: the thread is done
        key = node_key(parent.node_key, action)
        views = self.layout.tail_views(runtime, self.ring.chunk_size * self.ring.frame_tokens)
        latent = self._stored_latent(runtime, idx, denoised)
        if self.manager.store.accepts_device_views:
            payload = views
        else:
            payload = [(k.to("cpu", copy=True), v.to("cpu", copy=True)) for k, v in views]
            latent = latent.to("cpu", copy=True)
        nbytes = sum(int(k.numel() * k.element_size()) * 2 for k, _ in views)
        existing = parent.children.get(action)
        blob_before = existing.blob if existing is not None else None
        try:
            node = self.manager.ingest(self._ns, parent, action, key, idx, payload, latent,
                                       nbytes=nbytes, n_layers=len(payload))
            if node.blob is not blob_before and node.blob is not None and node.blob.error is None:
                self.bytes_written += nbytes
                self._written[idx] = node  # its frames follow (`HandOut.on_chunk_frames`)
                self._encodes.commit(self.root)  # a chunk of these inputs is cached: so are their encodes
        except CacheSeekError as exc:
            self.ingest_errors += 1
            level = logging.INFO if isinstance(exc, StoreWarmingError) else logging.WARNING  # expected while warming
            log.log(level, "ingest of chunk %d failed (the run goes on uncached): %s", idx, exc)
            node = self.forest.commit(self._ns, parent, action, key, idx)
        self._cursor = node
        if self.snapshot_on_finalize:
            self.flush_snapshot()

    def _stored_latent(self, runtime: Any, idx: int, denoised: Any) -> Any:
        """The latent as stored: the chunk's denoised x0 as the model produced it (its dtype, bf16
        on TeleFuser, never the float32 of the noise), contiguous, in the noise chunk's shape."""
        spec = self.layout.latent_spec(runtime)
        latent = denoised.detach()
        if tuple(latent.shape) != spec.shape:
            raise LayoutMismatchError(
                f"chunk {idx}: denoised latent {tuple(latent.shape)}, the runtime's chunks are {spec.shape}")
        return latent.contiguous()

    def flush_snapshot(self) -> bool:
        """Save the forest to ``snapshot_path`` (pruned first: nodes holding nothing, namespaces
        nobody uses); whether it was saved. A failed save (a full disk, a stalled one past 30 s,
        ``.prev`` a folder) is one warning line: the store's chunks stay findable by their records."""
        if not self.snapshot_path:
            return False
        try:
            save_forest_snapshot(self.forest, self.snapshot_path, live_sessions=self.manager.eviction.live_sessions)
        except StoreError as exc:
            log.warning("%s", exc)
            return False
        return True

    # -- geometry -----------------------------------------------------------------------------

    def _runtime_weights(self, runtime: Any) -> bytes:
        """The weights' identity as the runtime knows it (`cacheseek.weights`); refuses a real
        model that nothing identifies, since its KV would be shared with any other checkpoint."""
        found = getattr(runtime, "weights_fingerprint", None) or weights.current()
        if found:
            return bytes(found)
        if self.model_fingerprint != _DEFAULT_MODEL_FINGERPRINT:
            return b""
        if self.require_weights_fingerprint or (self.require_weights_fingerprint is None and _real_model(runtime)):
            raise ConfigError("namespace.model_fingerprint",
                              f"nothing identifies the weights of this {type(runtime).__name__}: two checkpoints "
                              "would restore each other's KV",
                              "call cacheseek.integrations.telefuser.attach(pipeline) before creating sessions (it "
                              "fingerprints the DiT), or pass model_fingerprint=<a name that changes with the weights>")
        _warn_no_weights_fingerprint()
        return b""

    def _validate_geometry(self, runtime: Any) -> RingGeometry:
        ring = self.layout.window(runtime)
        cfg = self.manager.cfg
        if ring.rolling:
            if (cfg.window_chunks, cfg.sink_chunks) != (ring.window_chunks, ring.sink_chunks):
                raise GeometryError(
                    "manager.window_chunks",
                    f"manager window ({cfg.window_chunks} recent + {cfg.sink_chunks} sink chunks) "
                    f"disagrees with the runtime's L={ring.local_attn_size}, S={ring.sink_size}, "
                    f"c={ring.chunk_size} (needs {ring.window_chunks} + {ring.sink_chunks})",
                    "build the config with make_rolling_config(local_attn_size=L, sink_size=S, chunk_size=c)")
        elif not cfg.full_length:
            raise GeometryError(
                "manager.window_chunks",
                f"the runtime keeps full-length KV but the manager restores only {cfg.window_chunks} chunks",
                "use make_full_kv_config()")
        return ring


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
