"""The ``telefuser_main`` layout: TeleFuser main's LingBot-World-fast (from 2026-07-13, commit
1ef8b53 "refactor chunk sessions and cache lifecycle", and the streaming scheduler of 07e9c3b and
69b2bf2 onwards).

The runtime the hooks receive is a ``LingBotWorldFastGenerationSession``: ``chunk_size``,
``frame_tokens``, ``latent_f/h/w``, ``chunk_count``, ``config`` (the session config),
``cache_handle`` and ``world_kv_cached_latents``. Everything else lives in the pipeline's
in-process denoise stage, in ``denoise_stage._cache_registry[session.cache_handle]``:

- ``self_kv_cache``: per layer ``k``/``v`` ``[1, kv_size, H, D]`` in the DiT's dtype and the cursors
  ``global_end_index`` / ``local_end_index`` as 0-d int64 tensors that the DiT fills in place
  (so they are filled, never replaced); ``kv_size = frame_tokens * L`` rolling, ``* latent_f``
  full length;
- ``timesteps``; ``generator`` (the denoiser's re-noise draws: ``len(timesteps) - 1`` per
  computed chunk, of x0's shape and dtype); ``noise_generator`` and ``noise_shape``
  ``(1, 16, chunk_size, h, w)``: one float32 noise draw per chunk, which TeleFuser itself makes
  for a decode-only chunk too (``advance_noise``), so a restore leaves it alone.

The window (L, S) is the pipeline config's ``local_attn_size`` / ``sink_size``. The DiT returns
float32 and x0 keeps it, so a chunk's latent is float32 ``noise_shape``. The session holds no
controls: they are passed chunk by chunk to the streaming scheduler (``try_submit_chunk``), where
the integration reports each to the binding as it is submitted; a caller that knows the whole
sequence up front may plan it (`plan_controls`; the integration's ``generate_video`` does), so
the binding can restore a cached prefix when the session is created.

The session does not name its pipeline. `creating(pipeline)` marks the pipeline that is creating
sessions in this thread (the integration wraps ``_create_initialized_session``, which calls
``on_runtime_created`` before it returns); the first lookup of a session records its pipeline
for later calls from TeleFuser's actor threads, and the integration records it with `own` once
the session is returned. Records are weak: they go with the session.

Streaming order per chunk (TeleFuser's denoise actor): a chunk with a cached latent pops it,
advances the noise generator once, casts the latent to the pipeline's dtype and calls
``on_chunk_finalized`` with it; any other chunk draws its noise, denoises, rewrites the clean KV
and calls ``on_chunk_finalized`` with x0. Then the decoder gets the latent.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from cacheseek.errors import LayoutMismatchError
from cacheseek.kv.ring import RingGeometry
from cacheseek.layout.ring_layout import LatentSpec, RingLayout
from cacheseek.registry import LAYOUTS

__all__ = ["TeleFuserMainLayout", "creating", "forget_controls", "own", "plan_controls", "planned_controls"]

_CREATING: contextvars.ContextVar[Any] = contextvars.ContextVar("cacheseek_telefuser_pipeline", default=None)


class _WeakIdentityMap:
    """Object -> value by identity, dropped when the object is collected (TeleFuser's session
    types are dataclasses: unhashable, but weak-referenceable)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[int, Any] = {}

    def set(self, obj: Any, value: Any) -> None:
        key = id(obj)
        with self._lock:
            fresh = key not in self._values
            self._values[key] = value
        if fresh:
            weakref.finalize(obj, self.pop_key, key)

    def get(self, obj: Any) -> Any:
        with self._lock:
            return self._values.get(id(obj))

    def pop(self, obj: Any) -> Any:
        return self.pop_key(id(obj))

    def pop_key(self, key: int) -> Any:
        with self._lock:
            return self._values.pop(key, None)


_OWNERS = _WeakIdentityMap()
_CONTROLS = _WeakIdentityMap()


@contextlib.contextmanager
def creating(pipeline: Any) -> Iterator[None]:
    """Sessions looked up in this thread inside the block belong to ``pipeline``."""
    token = _CREATING.set(pipeline)
    try:
        yield
    finally:
        _CREATING.reset(token)


def own(session: Any, pipeline: Any) -> None:
    """Record that ``session`` belongs to ``pipeline`` (the integration does, once it returns)."""
    _OWNERS.set(session, pipeline)


def plan_controls(session_config: Any, controls: Sequence[Any]) -> None:
    """The control tensors (one per chunk, ``[1, 6*.., c, h, w]`` float32) a session made from
    ``session_config`` will be driven with: the action keys of its prefix lookup."""
    _CONTROLS.set(session_config, list(controls))


def forget_controls(session_config: Any) -> None:
    _CONTROLS.pop(session_config)


def planned_controls(session_config: Any) -> list[Any] | None:
    return _CONTROLS.get(session_config)


@LAYOUTS.register("telefuser_main")
class TeleFuserMainLayout(RingLayout):
    runtime_layout = "telefuser_main"
    telefuser_releases = ("main",)

    @classmethod
    def matches(cls, runtime: Any) -> bool:
        """A session whose ring sits behind a cache handle, with no ring of its own."""
        return hasattr(runtime, "cache_handle") and not hasattr(runtime, "self_kv_cache")

    # -- the session's pipeline and cache state ---------------------------------------------------

    def pipeline(self, session: Any) -> Any:
        owner = _OWNERS.get(session)
        if owner is None:
            owner = _CREATING.get()
            if owner is None:
                raise LayoutMismatchError("this TeleFuser session was not created by an attached pipeline: call "
                                          "cacheseek.integrations.telefuser.attach(pipeline) before creating sessions")
            _OWNERS.set(session, owner)
        return owner

    def cache_state(self, session: Any) -> Any:
        """The denoise stage's state of the session's cache handle."""
        stage = self.pipeline(session).denoise_stage
        registry = getattr(stage, "_cache_registry", None)
        if not isinstance(registry, dict):
            raise LayoutMismatchError(
                f"the denoise stage {type(stage).__name__} keeps no in-process cache registry (a "
                "multi-GPU ParallelWorker keeps the ring in its worker processes): CacheSeek restores "
                "into a denoise stage of this process only")
        handle = getattr(session, "cache_handle", None)
        state = registry.get(handle) if handle is not None else None
        if state is None:
            raise LayoutMismatchError(f"cache handle {handle!r} is not registered in the denoise stage "
                                      "(the session was released or never initialized)")
        return state

    # -- RingLayout -------------------------------------------------------------------------------

    def ring_layers(self, runtime: Any) -> Any:
        return self.cache_state(runtime).self_kv_cache

    def window(self, runtime: Any) -> Any:
        cfg = self.pipeline(runtime).config
        L = int(cfg.local_attn_size)
        ring = RingGeometry(chunk_size=int(runtime.chunk_size), frame_tokens=int(runtime.frame_tokens),
                            local_attn_size=L, sink_size=int(cfg.sink_size) if L != -1 else 0)
        frames = L if L != -1 else int(runtime.latent_f)
        kv_size = int(self.ring_layers(runtime)[0]["k"].shape[1])
        if kv_size != ring.frame_tokens * frames:
            raise LayoutMismatchError(f"ring holds {kv_size} tokens, the pipeline config implies "
                                      f"{ring.frame_tokens} x {frames}")
        return ring

    def n_chunks(self, runtime: Any) -> int:
        return int(runtime.chunk_count)

    def controls(self, runtime: Any) -> list[Any] | None:
        """The controls planned for the session (`plan_controls`), None for a live session whose
        controls stream in chunk by chunk (each reaches the binding as it is submitted)."""
        return planned_controls(runtime.config)

    def timesteps(self, runtime: Any) -> Any:
        return self.cache_state(runtime).timesteps

    def generator(self, runtime: Any) -> Any:
        return self.cache_state(runtime).generator

    def latent_spec(self, runtime: Any) -> LatentSpec:
        """float32 ``noise_shape`` on the ring's device (see the module doc)."""
        state = self.cache_state(runtime)
        shape = tuple(int(x) for x in state.noise_shape)
        return LatentSpec(shape, torch.float32, state.self_kv_cache[0]["k"].device)

    def fingerprint_fields(self, runtime: Any) -> dict[str, Any]:
        return {**super().fingerprint_fields(runtime), "runtime_layout": self.runtime_layout}
