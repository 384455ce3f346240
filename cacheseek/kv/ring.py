"""Ring geometry: which global frame sits in which physical slot, and the copy runs of a restore.

The runtime's per-layer KV buffer is a shift-left buffer with a pinned sink (docs/design.md section 1),
not a circular one. After ``k`` chunks of ``c`` frames:

- full length (``local_attn_size == -1``): slots ``0..k*c-1`` hold frames ``0..k*c-1``;
- rolling (``L`` frames, sink ``S``): while ``k*c <= L`` the same; after that the buffer holds
  ``[frames 0..S-1][the latest L-S frames]``.

A restore copies, per layer and per K/V, each chunk's frames into their slots. Frames of one chunk
that land in consecutive slots form one contiguous copy run (B=1). Everything here is in frames
and tokens; bytes are ``tokens * token_bytes``. Torch-free.
"""

from __future__ import annotations

import math

import attrs

from cacheseek.errors import GeometryError

__all__ = ["RingGeometry", "CopyRun", "append_tokens", "shift_after_sink"]


@attrs.frozen(slots=True)
class CopyRun:
    """Copy ``n_tokens`` from token ``src_token`` of chunk ``chunk_depth``'s value to ring slot
    token ``dst_token``."""

    chunk_depth: int = attrs.field(validator=attrs.validators.ge(0))
    src_token: int = attrs.field(validator=attrs.validators.ge(0))
    dst_token: int = attrs.field(validator=attrs.validators.ge(0))
    n_tokens: int = attrs.field(validator=attrs.validators.gt(0))


def _positive(_inst, attribute, value) -> None:
    if not isinstance(value, int) or value <= 0:
        raise GeometryError(f"runtime.{attribute.name}", f"must be a positive int, got {value!r}")


@attrs.frozen(slots=True)
class RingGeometry:
    """Ring parameters in frames: ``chunk_size`` frames a chunk, ``frame_tokens`` tokens a frame,
    ``local_attn_size`` L (-1 = full length) and ``sink_size`` S. Validates ``L >= S + c``."""

    chunk_size: int = attrs.field(validator=_positive)
    frame_tokens: int = attrs.field(validator=_positive)
    local_attn_size: int = -1
    sink_size: int = 0

    def __attrs_post_init__(self) -> None:
        L, S, c = self.local_attn_size, self.sink_size, self.chunk_size
        if not isinstance(S, int) or S < 0:
            raise GeometryError("runtime.sink_size", f"must be an int >= 0, got {S!r}")
        if L == -1:
            if S != 0:
                raise GeometryError("runtime.sink_size", f"is {S} in full-length mode (local_attn_size=-1)",
                                    "set sink_size=0, or set local_attn_size to a rolling window")
            return
        if not isinstance(L, int) or L <= 0:
            raise GeometryError("runtime.local_attn_size", f"must be -1 or a positive int, got {L!r}")
        if L < S + c:
            raise GeometryError("runtime.local_attn_size",
                                f"rolling window L={L} is smaller than sink S={S} plus chunk size c={c}",
                                f"use local_attn_size >= {S + c} or a smaller sink_size")

    @property
    def rolling(self) -> bool:
        return self.local_attn_size != -1

    @property
    def window_chunks(self) -> int:
        """Recent chunks a restore needs (0 = every chunk, full length)."""
        if not self.rolling:
            return 0
        return math.ceil(max(self.local_attn_size - self.sink_size, 1) / self.chunk_size)

    @property
    def sink_chunks(self) -> int:
        return math.ceil(self.sink_size / self.chunk_size) if self.rolling else 0

    def slot_frames(self, k: int) -> list[int]:
        """Global frame index held by each filled physical slot after ``k`` chunks."""
        frames = k * self.chunk_size
        if not self.rolling or frames <= self.local_attn_size:
            return list(range(frames))
        recent = self.local_attn_size - self.sink_size
        return list(range(self.sink_size)) + list(range(frames - recent, frames))

    def cursors(self, k: int) -> tuple[int, int]:
        """``(global_end_index, local_end_index)`` in tokens after ``k`` chunks."""
        return (k * self.chunk_size * self.frame_tokens, len(self.slot_frames(k)) * self.frame_tokens)

    def window_depths(self, k: int) -> list[int]:
        """Chunk depths (oldest first) whose frames fill the ring after ``k`` chunks."""
        return sorted({f // self.chunk_size for f in self.slot_frames(k)})

    def restore_runs(self, k: int) -> tuple[CopyRun, ...]:
        """Contiguous copy runs (in tokens) that rebuild the ring of depth ``k``."""
        runs: list[CopyRun] = []
        c, ft = self.chunk_size, self.frame_tokens
        start = 0
        slots = self.slot_frames(k)
        while start < len(slots):
            chunk, first = divmod(slots[start], c)
            end = start + 1
            while end < len(slots) and slots[end] == slots[end - 1] + 1 and slots[end] // c == chunk:
                end += 1
            runs.append(CopyRun(chunk, first * ft, start * ft, (end - start) * ft))
            start = end
        return tuple(runs)


def append_tokens(local_end: int, n: int, size: int, sink_tokens: int) -> tuple[int, int]:
    """A chunk's first write of ``n`` tokens into a ring of ``size`` tokens filled to
    ``local_end``: ``(overflow, new local_end)``. When it would overflow, the tokens after the
    pinned sink shift left by ``overflow`` (`shift_after_sink`) and the ring ends full; the new
    tokens then land at ``[new local_end - n, new local_end)``. Raises `GeometryError` when the
    chunk cannot fit after the sink."""
    overflow = local_end + n - size
    if overflow <= 0:
        return 0, local_end + n
    if local_end - overflow - sink_tokens < 0:
        raise GeometryError("runtime.local_attn_size",
                            f"{n} tokens do not fit after a sink of {sink_tokens} in a ring of {size}")
    return overflow, size


def shift_after_sink(buf, local_end: int, overflow: int, sink_tokens: int) -> None:
    """Shift ``buf[:, sink + overflow : local_end]`` left to ``sink`` (a ``[1, size, ...]``
    tensor; the moved tokens are cloned first: source and destination overlap)."""
    rolled = local_end - overflow - sink_tokens
    src = sink_tokens + overflow
    buf[:, sink_tokens : sink_tokens + rolled] = buf[:, src : src + rolled].clone()
