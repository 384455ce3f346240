"""The per-chunk seam: the control each chunk actually runs with reaches the session's binding.

A live TeleFuser session knows no controls when it is created: its service streams one per
chunk. On the 0.1.0.post3 release and the hooked commit the service calls
``pipeline.generate_next_chunk(runtime, control_override=pipeline.build_control_override(runtime,
chunk))``, and the chunk runs with the override, else the planned ``runtime.control_chunks[idx]``,
else none (`released_chunk_control`, TeleFuser's own rule). On TeleFuser main the service submits
``try_submit_chunk(session, i, control)`` up to two chunks ahead, and chunk ``i`` runs with that
control. Either way the binding is told, through ``on_chunk_control(runtime, idx, control)``,
before the chunk runs (`report`), so that each chunk is keyed by its own control and never by a
placeholder, and so that a chunk on a cached path can be restored instead of computed (the
binding's `ChunkWindow`): on the release and the hooked commit the chunk runs next in the same
thread, so the seam lets the binding restore it there.

A chunk the binding serves from stored frames is handed out without running (`handout`).

`NextChunkSeam` wraps ``generate_next_chunk`` of one release or hooked pipeline instance (the
integration's hooks install it) and reports each chunk's wall to the binding (``chunk_finished``:
the metrics' per-chunk wall and time to first frame); main's seam is in `cacheseek.integrations.telefuser.streaming`.
A `ControlMismatchError` (a chunk restored for its planned control run with another one)
propagates to the caller of ``generate_next_chunk`` / ``try_submit_chunk``: the run stops rather
than show the planned control's frames. Every other failure is the binding's to count.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from cacheseek.hooks import as_hooks
from cacheseek.integrations.telefuser import handout

__all__ = ["NextChunkSeam", "OverrideSeam", "released_chunk_control", "report"]


def released_chunk_control(runtime: Any, control_override: Any) -> Any:
    """The control TeleFuser's release and hooked ``generate_next_chunk`` give the current chunk."""
    if control_override is not None:
        return control_override
    planned = getattr(runtime, "control_chunks", None)
    idx = int(runtime.current_chunk_index)
    return planned[idx] if planned is not None and idx < len(planned) else None


def report(binding: Any, runtime: Any, idx: int, control: Any, *, may_restore: bool = False) -> None:
    """Tell ``binding`` that chunk ``idx`` runs with ``control`` (a binding without the hook, e.g.
    a caller's own, is left alone); ``may_restore``: the chunk runs next in this thread, so the
    binding may restore it instead (a live session on a cached path)."""
    as_hooks(binding).on_chunk_control(runtime, idx, control, may_restore=may_restore)


class NextChunkSeam:
    """``generate_next_chunk`` of one pipeline instance, reporting each chunk's control first;
    with ``pipeline``, a chunk the binding serves is handed out from its stored frames and a
    computed chunk's frames go to the binding (`handout`)."""

    def __init__(self, generate_next_chunk: Any, pipeline: Optional[Any] = None) -> None:
        self.inner = generate_next_chunk
        self.pipeline = pipeline
        self._decoder_specs: dict = {}  # `handout.WanDecoder`'s state layouts, per chunk size and frame

    def __call__(self, runtime: Any, *args: Any, **kwargs: Any) -> Any:
        binding = as_hooks(getattr(runtime, "world_kv_binding", None))
        idx = int(runtime.current_chunk_index)
        if binding is None or idx >= len(runtime.noise_chunks):
            return self.inner(runtime, *args, **kwargs)
        t0 = time.perf_counter()
        override = kwargs.get("control_override", args[0] if args else None)
        control = released_chunk_control(runtime, override)
        plan = decoder = None
        with torch.inference_mode():  # the ring is an inference tensor: a restore writes it here
            report(binding, runtime, idx, control, may_restore=True)
            if self.pipeline is not None:
                decoder = handout.WanDecoder(self.pipeline, runtime, self._decoder_specs)
                plan = binding.next_chunk(runtime, idx, handout.frames_spec(runtime, idx), decoder)
        if plan is not None and plan.handed_out:
            images = handout.hand_out(runtime, plan.frames)
        else:
            if plan is not None:
                handout.prepare(self.pipeline, runtime, plan, self.inner, decoder)
            with handout.late_decoder(self.pipeline, plan, decoder):
                images = self.inner(runtime, *args, **kwargs)
            if plan is not None:
                binding.on_chunk_frames(runtime, idx, handout.frames_of(images), decoder)
        binding.chunk_finished(idx, time.perf_counter() - t0, since_session_start=True)
        return images


class OverrideSeam:
    """``build_control_override`` of one pipeline instance: the override it builds is the next
    chunk's control as it arrives (the service builds it right before the chunk), so its key is
    started then (``on_control_arrived``)."""

    def __init__(self, build_control_override: Any) -> None:
        self.inner = build_control_override

    def __call__(self, runtime: Any, *args: Any, **kwargs: Any) -> Any:
        override = self.inner(runtime, *args, **kwargs)
        binding = as_hooks(getattr(runtime, "world_kv_binding", None))
        if binding is not None and override is not None:
            binding.on_control_arrived(runtime, int(runtime.current_chunk_index), override)
        return override
