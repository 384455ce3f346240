"""CacheSeek around TeleFuser main's streaming LingBot-World-fast pipeline (the ``main`` layout).

TeleFuser main calls the binding's hooks itself (``on_runtime_created`` inside
``_create_initialized_session``, ``on_chunk_finalized`` in its denoise actor), but three things
the binding needs are not on the session it passes, so `StreamingHooks` adds them at the
pipeline's seams, on one pipeline instance, without touching TeleFuser's code:

- whose ring: ``_create_initialized_session`` (called by ``generate_video`` and by TeleFuser's
  service) runs inside `cacheseek.layout.telefuser_main.creating`, so the layout adapter learns
  which pipeline's denoise stage holds the session's cache handle;
- which controls: the streaming runtime's ``try_submit_chunk(session, i, control)`` (TeleFuser's
  service submits each control as it arrives, up to two chunks ahead) reports chunk ``i``'s
  control to the binding first (`chunk_controls.report`), which keys the chunk by it;
  ``generate_video(session_config, controls)`` materializes deferred controls first and plans them
  for the session (`plan_controls`), so a cached prefix is restored when the session is created;
- the decoded latent of a restored chunk: TeleFuser casts a cached latent to the pipeline's
  dtype (bf16) before decoding it, while a computed chunk's x0 is decoded as the DiT returned it
  (float32). That rounds the restored chunks' frames, and an fp32 Wan VAE (TeleFuser's default
  decode config) refuses the bf16 input outright (``Input type (c10::BFloat16) and bias type
  (float) should be the same``). So the VAE decode worker is wrapped: for a chunk the binding
  restored, when TeleFuser's input is exactly the restored latent cast to its dtype, the decoder
  gets the restored latent as stored, i.e. what a cold run decodes. Anything else is decoded as
  TeleFuser passes it.

- a live session's chunk on a cached path: the denoise stage's ``denoise_and_update_cache``
  (the denoise actor's call for a chunk without a cached latent) restores it instead, in the
  actor thread, where the DiT would have written it (`LingBotWorldKVBinding.restore_chunk`): the
  KV, cursors and re-noise draws are published, the noise RNG advances as for a decode-only
  chunk, and the stored x0 is returned as the DiT's, float32 as a computed chunk's.

TeleFuser's streaming runtime takes the decode worker when it is first built, so `attach` must
come before the pipeline's first generation (``warmup`` and ``LingBotWorldFastService.start``
generate). A denoise stage in ``ParallelWorker`` processes (multi-GPU) keeps the ring out of
this process: refused. `StreamingHooks.remove` restores the pipeline's own attributes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from cacheseek import weights
from cacheseek.hooks import as_hooks
from cacheseek.integrations.telefuser.chunk_controls import report
from cacheseek.integrations.telefuser.layouts import UnsupportedTeleFuserError
from cacheseek.integrations.telefuser.pypi_release import _Proxy
from cacheseek.layout.telefuser_main import creating, forget_controls, own, plan_controls

log = logging.getLogger(__name__)

__all__ = ["StreamingHooks"]


class StreamingHooks:
    """The seams of one TeleFuser-main pipeline; made by `cacheseek.integrations.telefuser.attach`."""

    def __init__(self, pipeline: Any) -> None:
        if getattr(pipeline, "_streaming_runtime", None) is not None:
            raise UnsupportedTeleFuserError(
                "this pipeline has generated already (its streaming runtime holds the VAE decode worker): "
                "attach CacheSeek right after init(), before warmup(), generate_video() or a service start")
        if type(pipeline.denoise_stage).__name__ == "ParallelWorker":
            raise UnsupportedTeleFuserError(
                "the denoise stage runs in ParallelWorker processes (dit_config.parallel_config with more "
                "than one device): the ring lives there, out of this process's reach; run the DiT on one "
                "device to reuse KV")
        self.pipeline = pipeline
        self._create = pipeline._create_initialized_session
        self._generate_video = pipeline.generate_video
        self._decode_worker = pipeline.vae_decode_worker
        self._stage = pipeline.denoise_stage
        self._get_streaming_runtime = pipeline._get_streaming_runtime
        self._sessions: "weakref.WeakValueDictionary[Any, Any]" = weakref.WeakValueDictionary()  # by cache handle
        self._admitted: dict[Any, set[int]] = {}  # cache handle -> chunks the scheduler took
        self._lock = threading.Lock()
        self._restored: dict[int, dict[int, Any]] = {}  # cache handle -> chunk -> latent as stored
        self._next_decode: dict[int, int] = {}
        self._warned = False
        self.installed = False

    @property
    def own_decode_worker(self) -> Any:
        """The pipeline's own VAE decode worker, without the exact-decode seam (`remove` puts it back)."""
        return self._decode_worker

    def install(self) -> None:
        p = self.pipeline
        p._create_initialized_session = self.create_session
        p.generate_video = self.generate_video
        p.vae_decode_worker = _ExactDecode(self, self._decode_worker)
        p.denoise_stage = _LiveDenoise(self, self._stage)
        p._get_streaming_runtime = self.streaming_runtime
        if not hasattr(p, "create_runtime"):
            p.create_runtime = _release_api_on_main
        self.installed = True

    def remove(self) -> None:
        """Give the pipeline its own session factory, generate_video and decode worker back."""
        if not self.installed:
            return
        p = self.pipeline
        for name in ("_create_initialized_session", "generate_video", "_get_streaming_runtime", "create_runtime"):
            if name in vars(p):
                delattr(p, name)
        p.vae_decode_worker = self._decode_worker
        p.denoise_stage = self._stage
        runtime = getattr(p, "_streaming_runtime", None)
        if runtime is not None and "try_submit_chunk" in vars(runtime):
            del runtime.try_submit_chunk
        self.installed = False

    # -- sessions -------------------------------------------------------------------------------

    def create_session(self, session_config: Any, *args: Any, **kwargs: Any) -> Any:
        with creating(self.pipeline), weights.of_model(self.pipeline.dit):
            session = self._create(session_config, *args, **kwargs)
        own(session, self.pipeline)
        restored = dict(session.world_kv_cached_latents or {})
        with self._lock:
            self._sessions[session.cache_handle] = session
            self._admitted.pop(session.cache_handle, None)  # a cache handle used again
            if restored:
                self._restored[session.cache_handle] = restored
                self._next_decode[session.cache_handle] = 0
        return session

    def generate_video(self, session_config: Any, controls: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(session_config, "world_kv_binding", None) is None:
            return self._generate_video(session_config, controls, *args, **kwargs)
        resolved = [c() if callable(c) else c for c in controls]
        plan_controls(session_config, resolved)
        try:
            return self._generate_video(session_config, resolved, *args, **kwargs)
        finally:
            forget_controls(session_config)

    # -- controls -------------------------------------------------------------------------------

    def streaming_runtime(self) -> Any:
        """The pipeline's one streaming runtime, whose ``try_submit_chunk`` reports each control."""
        runtime = self._get_streaming_runtime()
        if "try_submit_chunk" not in vars(runtime):
            submit = runtime.try_submit_chunk

            def try_submit_chunk(session: Any, chunk_index: int, control: Any, *args: Any, **kwargs: Any) -> Any:
                binding = self.submitting(session, chunk_index, control)
                admitted = False
                try:
                    admitted = bool(submit(session, chunk_index, control, *args, **kwargs))
                finally:
                    if binding is not None:
                        self.settled(session, chunk_index, binding, admitted)
                return admitted

            runtime.try_submit_chunk = try_submit_chunk
        return runtime

    def submitting(self, streaming_session: Any, chunk_index: int, control: Any) -> Any:
        """Chunk ``chunk_index`` of the session is being submitted with ``control``: tell its
        binding first (the denoise actor may take the chunk as soon as it is admitted). A chunk
        already admitted is left alone (TeleFuser refuses its second submission). Returns the
        binding told, or None."""
        handle = getattr(streaming_session, "cache_handle", None)
        with self._lock:
            session = self._sessions.get(handle)
            if chunk_index in self._admitted.get(handle, ()):
                return None
        binding = getattr(session, "world_kv_binding", None)
        if binding is None or not 0 <= int(chunk_index) < int(session.chunk_count):
            return None
        report(binding, session, int(chunk_index), control)
        return binding

    def settled(self, streaming_session: Any, chunk_index: int, binding: Any, admitted: bool) -> None:
        """A submission ended: an admitted chunk runs with its control; a refused one's control is
        withdrawn (the chunk may come again with another)."""
        handle = getattr(streaming_session, "cache_handle", None)
        if admitted:
            with self._lock:
                self._admitted.setdefault(handle, set()).add(int(chunk_index))
        else:
            as_hooks(binding).withdraw_control(int(chunk_index))

    def denoise(self, kwargs: dict[str, Any], call: Any) -> Any:
        """One ``denoise_and_update_cache`` call of the denoise actor: a chunk of a live session
        on a cached path is restored instead (`LingBotWorldKVBinding.restore_chunk`); the noise
        RNG then advances as for a decode-only chunk, and the stored x0 is returned as the DiT's."""
        handle = kwargs.get("cache_handle")
        with self._lock:
            session = self._sessions.get(handle)
        binding = as_hooks(getattr(session, "world_kv_binding", None))
        if binding is None or "current_start" not in kwargs:
            return call()
        idx = int(kwargs["current_start"]) // (int(session.chunk_size) * int(session.frame_tokens))
        latent = binding.restore_chunk(session, idx)
        if latent is None:
            return call()
        advanced = self._stage.advance_noise(cache_handle=handle)
        if callable(advanced):
            advanced()
        return latent

    # -- decode ---------------------------------------------------------------------------------

    def decode_input(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` of one ``decode_chunk`` call, with a restored chunk's latent as stored."""
        handle = kwargs.get("cache_handle")
        latents = kwargs.get("latents")
        with self._lock:
            restored = self._restored.get(handle)
            if restored is None or latents is None:
                return kwargs
            idx = 0 if kwargs.get("is_first_clip") else self._next_decode[handle]
            self._next_decode[handle] = idx + 1
            exact = restored.pop(idx, None)
            if not restored:
                self._restored.pop(handle, None)
                self._next_decode.pop(handle, None)
        if exact is None:
            return kwargs
        if _cast_equals(exact, latents):
            return {**kwargs, "latents": exact.to(latents.device)}
        if not self._warned:
            self._warned = True
            log.warning("chunk %d of cache handle %s: TeleFuser decodes a latent that is not the restored "
                        "one cast to %s; decoding it unchanged", idx, handle, latents.dtype)
        return kwargs

    def released(self, handle: Any) -> None:
        with self._lock:
            self._admitted.pop(handle, None)
            self._restored.pop(handle, None)
            self._next_decode.pop(handle, None)


def _release_api_on_main(*args: Any, **kwargs: Any) -> Any:
    """The release's ``create_runtime`` called on TeleFuser main, which has none: say what to call."""
    raise UnsupportedTeleFuserError(
        "TeleFuser main's LingBotWorldFastPipeline has no create_runtime (that is the 0.1.0.post3 API): run "
        "pipeline.generate_video(session_config, controls), or stream a live session as its service does "
        "(session = pipeline._create_initialized_session(session_config); streaming = "
        "pipeline._get_streaming_runtime(); streaming.submit_chunk(streaming.create_session(session), i, control)); "
        "examples/telefuser_live_sessions.py shows both layouts")


def _cast_equals(exact: Any, latents: Any) -> bool:
    if tuple(exact.shape) != tuple(latents.shape):
        return False
    cast = exact.to(device=latents.device, dtype=latents.dtype)
    return bool(torch.equal(cast.contiguous().reshape(-1).view(torch.uint8),
                            latents.contiguous().reshape(-1).view(torch.uint8)))


class _LiveDenoise(_Proxy):
    def denoise_and_update_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self._hooks.denoise(kwargs, lambda: self._inner.denoise_and_update_cache(*args, **kwargs))


class _ExactDecode(_Proxy):
    def decode_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.decode_chunk(*args, **self._hooks.decode_input(kwargs))

    def release_cache(self, cache_handle: Any, *args: Any, **kwargs: Any) -> Any:
        self._hooks.released(cache_handle)
        return self._inner.release_cache(cache_handle, *args, **kwargs)
