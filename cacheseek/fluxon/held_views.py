"""`HeldViews`: the value views a client has handed out, and the removes they would hide.

fluxon-py 0.2.4 keeps serving a value to a process that holds a view of it, even after a remove
(any client's): that process's own gets return the held value until it releases it. A client
records, at each of its removes, the payload addresses of its views of that key still held; a
later read landing on one of those addresses is the removed value, and so a miss. A value put
again lands elsewhere and reads normally; once no view of the key is held, Fluxon answers right
again and the record is dropped.

Not locked by itself: the owner passes its lock, held around `track`, `hides` and `open_views`
by the caller; `forget` and `removed` take it.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["HeldViews"]


class HeldViews:
    """Views (objects with ``key``, ``_ptr`` and ``released``) not yet released, weakly held."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._views: "weakref.WeakSet[Any]" = weakref.WeakSet()
        # key -> payload addresses of views held when the key was removed
        self._removed_held: dict[str, set[int]] = {}

    def hides(self, key: str, ptr: int) -> bool:
        """Whether a value read back at ``ptr`` is one removed while held. Caller holds the lock."""
        return ptr in self._removed_held.get(key, ())

    def track(self, view: Any) -> bool:
        """Keep ``view`` until it is forgotten; False (not kept) when `hides` it. Caller holds the lock."""
        if self.hides(view.key, view._ptr):
            return False
        self._views.add(view)
        return True

    def open_views(self) -> list[Any]:
        """The views not yet forgotten. Caller holds the lock."""
        return list(self._views)

    def forget(self, view: Any) -> None:
        """``view`` was released."""
        with self._lock:
            self._views.discard(view)
            if view.key in self._removed_held and not any(
                    v.key == view.key and not v.released for v in self._views):
                del self._removed_held[view.key]  # Fluxon answers right again once none is held

    def removed(self, key: str) -> None:
        """``key`` was removed: the views of it held now hide their value from later reads."""
        with self._lock:
            held = {v._ptr for v in self._views if v.key == key and not v.released}
            if held:
                self._removed_held.setdefault(key, set()).update(held)
