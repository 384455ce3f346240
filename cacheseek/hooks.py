"""`RuntimeHooks`: what a runtime, and `attach`'s TeleFuser seams, call on a session's binding.

Required: ``on_runtime_created(runtime, session_config)`` and ``on_chunk_finalized(runtime, idx,
denoised)`` (upstream's two hooks). Everything else has a default meaning "this binding takes no
part", so the seams call and never probe: ``accept_handout()``, ``on_control_arrived``,
``on_chunk_control``, ``withdraw_control`` (nothing), ``restore_chunk`` (None: compute it),
``next_chunk`` (None: compute it, handing nothing out), ``on_chunk_frames`` (nothing),
``materialize`` (0 chunks), ``chunk_finished`` (not timed), ``session_encodes`` (None: the
session's encodes run). `LingBotWorldKVBinding` subclasses
it; a caller's own binding is wrapped by `as_hooks`, the only place that looks at what it has.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["RuntimeHooks", "as_hooks"]


class RuntimeHooks:
    """The binding's side of the runtime seam (see the module docstring)."""

    def on_runtime_created(self, runtime: Any, session_config: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_runtime_created")

    def on_chunk_finalized(self, runtime: Any, idx: int, denoised: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__}.on_chunk_finalized")

    def accept_handout(self) -> None:
        return None

    def on_control_arrived(self, runtime: Any, idx: int, control: Any) -> None:
        return None

    def on_chunk_control(self, runtime: Any, idx: int, control: Any, *, may_restore: bool = False) -> None:
        return None

    def withdraw_control(self, idx: int) -> None:
        return None

    def restore_chunk(self, runtime: Any, idx: int) -> Any:
        return None

    def next_chunk(self, runtime: Any, idx: int, spec: Any, decoder: Any = None) -> Any:
        return None

    def on_chunk_frames(self, runtime: Any, idx: int, frames: Any, decoder: Any = None) -> None:
        return None

    def materialize(self, runtime: Any) -> int:
        return 0

    def chunk_finished(self, idx: int, seconds: float, *, since_session_start: bool = False) -> None:
        return None

    def session_encodes(self) -> Optional[Any]:
        """Where this session's encodes are kept (`reuse.exact_prefix.encodes.SessionEncodes`),
        asked before the runtime exists; None: the runtime runs them."""
        return None


_OPTIONAL = ("accept_handout", "on_control_arrived", "on_chunk_control", "withdraw_control", "restore_chunk",
             "next_chunk", "on_chunk_frames", "materialize", "chunk_finished", "session_encodes")


class _CallerHooks(RuntimeHooks):
    """A caller's own binding behind the contract: its calls, resolved once."""

    def __init__(self, obj: Any) -> None:
        self.wrapped = obj
        for name in ("on_runtime_created", "on_chunk_finalized") + _OPTIONAL:
            fn = getattr(obj, name, None)
            if callable(fn):
                setattr(self, name, fn)

    def __getattr__(self, name: str) -> Any:  # the caller's own attributes (its counters, ...)
        if name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def as_hooks(obj: Any) -> Optional[RuntimeHooks]:
    """``obj`` when it is `RuntimeHooks` (or None), else the caller's own binding behind the
    contract. A runtime wraps its hooks once, when it is made; a seam that finds the binding on a
    session wraps it where it finds it (a few attribute reads)."""
    if obj is None or isinstance(obj, RuntimeHooks):
        return obj
    return _CallerHooks(obj)
