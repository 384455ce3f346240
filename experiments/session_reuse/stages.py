"""Stage timers for a request on TeleFuser's release: where a full hit's wall goes (issue 32).

`stage_timers(sync)` wraps, while the block runs, the calls a request makes and sums each one's
wall time, synchronized before and after (``sync``: the device's, so a stage owns its GPU work):

- ``create_runtime``: the session's creation (the release's ``create_runtime`` as attached);
  inside it ``encode_prompt`` (umT5), ``encode_condition`` (the Wan encode of the condition video;
  both as attached: a kept encode's copy, or the encode)
  and ``on_runtime_created`` (CacheSeek: keys, lookup);
- ``chunk_seam``: each ``generate_next_chunk`` as attached; inside it ``next_chunk`` (CacheSeek's
  choice: the frames read, or the materialization), ``frames_read`` (the store read and the
  checks), ``hand_out`` (``PIL.Image.fromarray`` per frame), ``materialize`` (the served path
  restored at divergence), ``decoder_replay`` (the decoder's state set: a stored one loaded, the
  served latents after it decoded again), ``decoder_state_read`` (a stored state read and
  checked), ``decoder_state_write`` (one stored at a resume point), ``decode`` and
  ``tensor2video`` (a computed chunk's);
- ``control_build``: a live chunk's control built by TeleFuser (``build_control_override``, as
  its service builds one before each chunk), outside ``chunk_seam``.

Stages nest (a stage inside another is counted in both); the rest of a request's wall is outside
every stage.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from typing import Any, Callable, Iterator

__all__ = ["stage_timers"]

STAGES = {
    "create_runtime": "cacheseek.runtime.telefuser:TeleFuserSession._start",
    "encode_prompt": "cacheseek.integrations.telefuser.encodes:KeptEncodes.encode_prompt",
    "encode_condition": "cacheseek.integrations.telefuser.encodes:KeptEncodes.encode_condition",
    "on_runtime_created": "cacheseek.reuse.exact_prefix.telefuser_lingbot:LingBotWorldKVBinding.on_runtime_created",
    "chunk_seam": "cacheseek.integrations.telefuser.chunk_controls:NextChunkSeam.__call__",
    "next_chunk": "cacheseek.reuse.exact_prefix.telefuser_lingbot:LingBotWorldKVBinding.next_chunk",
    "frames_read": "cacheseek.reuse.exact_prefix.frames:ChunkFrames.read",
    "hand_out": "cacheseek.integrations.telefuser.handout:hand_out",
    "materialize": "cacheseek.reuse.exact_prefix.telefuser_lingbot:LingBotWorldKVBinding.materialize",
    "decoder_replay": "cacheseek.integrations.telefuser.handout:prepare",
    "decoder_state_read": "cacheseek.reuse.exact_prefix.decoder_states:ChunkDecoderStates.read",
    "decoder_catch_up": "cacheseek.reuse.exact_prefix.decoder_states:LateState.catch_up",
    "decoder_state_write": "cacheseek.reuse.exact_prefix.decoder_states:ChunkDecoderStates.write",
    "control_build": "cacheseek.runtime.telefuser:TeleFuserRuntimeFactory.chunk_override",
    "decode": "telefuser.pipelines.lingbot_world_fast.pipeline:LingBotWorldFastPipeline.decode_video_cached",
    "tensor2video": "telefuser.core.base_pipeline:BasePipeline.tensor2video",
}


@contextlib.contextmanager
def stage_timers(sync: Callable[[], None], only: Any = None, stages: Any = None) -> Iterator[dict[str, float]]:
    """Yields ``{stage: seconds}``, filled while the block runs (``only``: these stages;
    ``stages``: ``{name: "module:Owner.attr"}`` in place of `STAGES`); every wrapped attribute is
    put back after. A stage whose owner cannot be imported (another TeleFuser layout) is left out."""
    totals: dict[str, float] = {}
    saved = []
    for name, where in (STAGES if stages is None else stages).items():
        if only is not None and name not in only:
            continue
        module, _, path = where.partition(":")
        try:
            owner: Any = importlib.import_module(module)
            *outer, attr = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            fn = getattr(owner, attr)
        except (ImportError, AttributeError):
            continue
        totals[name] = 0.0
        saved.append((owner, attr, vars(owner).get(attr) if isinstance(owner, type) else fn))
        setattr(owner, attr, _timed(fn, name, totals, sync))
    try:
        yield totals
    finally:
        for owner, attr, fn in reversed(saved):
            if fn is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)


def _timed(fn: Any, name: str, totals: dict[str, float], sync: Callable[[], None]) -> Any:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            totals[name] += time.perf_counter() - start

    return timed
