"""The world_kv hooks installed around a released TeleFuser pipeline (``telefuser==0.1.0.post3``).

The released LingBot-World-fast pipeline is the hooked one minus the hook calls, so the same
behaviour is added at its seams, on one pipeline instance, without touching TeleFuser's code:

- ``create_runtime``: after the original returns, the runtime gets the hooked layout's fields
  (``kv_local_attn_size``, ``kv_sink_size`` from the pipeline config, an empty
  ``world_kv_cached_latents``, ``world_kv_binding`` from ``session_config.world_kv_binding``) and
  the binding's ``on_runtime_created`` runs, under ``torch.inference_mode`` as in TeleFuser; a
  failure empties ``world_kv_cached_latents`` and the session runs cold (TeleFuser's rule);
- ``denoise_stage.denoise_chunk``: a chunk whose latent the binding restored is not denoised:
  the cached latent, cast to the pipeline's device and dtype, is returned (no DiT call, no RNG
  draw);
- ``build_control_override``: the override it builds starts its key (`chunk_controls.OverrideSeam`);
- ``generate_next_chunk``: the control the chunk runs with (the override, else the planned one)
  reaches the binding first (`chunk_controls.NextChunkSeam`): it keys the chunk, and a chunk on a
  cached path is restored instead of computed;
- ``dit`` as called by ``generate_next_chunk`` (only the clean-KV rewrite forward; the denoise
  stage holds the DiT itself): skipped for a restored chunk; for a computed chunk it runs, then
  the binding's ``on_chunk_finalized(runtime, idx, denoised)`` (a failure is logged, the run goes
  on).

A call is tied to its runtime by the identity of the ring list it passes (``self_kv_cache`` /
``kv_cache``); sessions of one pipeline may interleave. `ReleasedHooks.remove` restores the
pipeline's own attributes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Optional

import torch

from cacheseek import weights
from cacheseek.hooks import as_hooks
from cacheseek.integrations.telefuser.hooked import HookedHooks

log = logging.getLogger(__name__)

__all__ = ["ReleasedHooks"]


class ReleasedHooks(HookedHooks):
    """The hook shim of one pipeline instance; made by `cacheseek.integrations.telefuser.attach`.
    The hooked pipeline's seams, plus the denoise stage and the DiT's rewrite forward."""

    def __init__(self, pipeline: Any) -> None:
        super().__init__(pipeline)
        self._stage = pipeline.denoise_stage
        self._dit = pipeline.dit
        self._lock = threading.Lock()
        self._runtimes: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._pending: dict[int, tuple[int, Optional[Any]]] = {}  # ring id -> (chunk, denoised | None if cached)

    def install(self) -> None:
        self.pipeline.denoise_stage = _DenoiseStage(self, self._stage)
        self.pipeline.dit = _RewriteForward(self, self._dit)
        super().install()

    def remove(self) -> None:
        """Also give the pipeline its own denoise stage and DiT back (idempotent)."""
        if self.installed:
            self.pipeline.denoise_stage = self._stage
            self.pipeline.dit = self._dit
        super().remove()

    # -- create_runtime ---------------------------------------------------------------------

    def create_runtime(self, session_config: Any, *args: Any, **kwargs: Any) -> Any:
        with self.encodes.for_session(getattr(session_config, "world_kv_binding", None)):
            runtime = self._create_runtime(session_config, *args, **kwargs)
        cfg = self.pipeline.config
        window = int(cfg.local_attn_size)
        runtime.kv_local_attn_size = window
        runtime.kv_sink_size = int(cfg.sink_size) if window != -1 else 0
        runtime.world_kv_cached_latents = {}
        binding = getattr(session_config, "world_kv_binding", None)
        runtime.world_kv_binding = binding
        if binding is None:
            return runtime
        as_hooks(binding).accept_handout()  # generate_next_chunk hands out served chunks' frames (`handout`)
        with self._lock:
            self._runtimes[id(runtime.self_kv_cache)] = runtime
        try:
            with torch.inference_mode(), weights.of_model(self._dit):
                binding.on_runtime_created(runtime, session_config)
        except Exception as exc:  # TeleFuser's rule: a failing hook leaves a cold run
            log.warning("world_kv on_runtime_created failed; falling back to a cold run: %s", exc)
            runtime.world_kv_cached_latents = {}
        return runtime

    # -- per chunk --------------------------------------------------------------------------

    def runtime_of(self, ring: Any) -> Optional[Any]:
        with self._lock:
            return self._runtimes.get(id(ring))

    def denoise(self, kwargs: dict[str, Any], call: Any) -> Any:
        runtime = self.runtime_of(kwargs.get("self_kv_cache"))
        if runtime is None:
            return call()
        idx = int(runtime.current_chunk_index)
        cached = runtime.world_kv_cached_latents.pop(idx, None) if runtime.world_kv_cached_latents else None
        if cached is not None:
            self._pending[id(runtime.self_kv_cache)] = (idx, None)
            return cached.to(device=self.pipeline.device, dtype=self.pipeline.torch_dtype)
        denoised = call()
        self._pending[id(runtime.self_kv_cache)] = (idx, denoised)
        return denoised

    def rewrite(self, kwargs: dict[str, Any], call: Any) -> Any:
        ring = kwargs.get("kv_cache")
        runtime = self.runtime_of(ring)
        pending = self._pending.pop(id(ring), None) if runtime is not None else None
        if pending is None:
            return call()
        idx, denoised = pending
        if denoised is None:  # a restored chunk: its KV is in the ring already
            return None
        out = call()
        binding = runtime.world_kv_binding
        if binding is not None:
            try:
                binding.on_chunk_finalized(runtime, idx, denoised)
            except Exception as exc:  # TeleFuser's rule: the run goes on uncached
                log.warning("world_kv on_chunk_finalized failed at chunk %d: %s", idx, exc)
        return out


class _Proxy:
    """Forwards every attribute but the intercepted call to the wrapped object."""

    def __init__(self, hooks: ReleasedHooks, inner: Any) -> None:
        object.__setattr__(self, "_hooks", hooks)
        object.__setattr__(self, "_inner", inner)

    @property
    def wrapped(self) -> Any:
        """The object this proxy stands in for (what `detach` puts back)."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


class _DenoiseStage(_Proxy):
    def denoise_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._hooks.denoise(kwargs, lambda: self._inner.denoise_chunk(*args, **kwargs))


class _RewriteForward(_Proxy):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._hooks.rewrite(kwargs, lambda: self._inner(*args, **kwargs))
