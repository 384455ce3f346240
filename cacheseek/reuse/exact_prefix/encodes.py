"""`StoredEncodes`: a session's prompt and condition encodes kept in the store (the manager's ``encodes``).

A session pays two encodes before its first chunk (TeleFuser's ``create_runtime``: umT5's prompt
embedding and the Wan VAE's condition-video latents), hit or not. Both are functions of the
session's inputs and the encoders, so one stored copy serves every later session of those
inputs in every process that shares the store: a restarted worker and the other workers of a
service skip both. The integration derives each encode's key (what determines its bits: the
input, the encoder's weights, the kernels' identity; `cacheseek.integrations.telefuser.encodes`)
and asks the session's `SessionEncodes` for it before encoding. The key, not the namespace, names
it: the encodes run before the runtime (and so the namespace root) exists, and a key that covers
every bit the encode depends on serves exactly the sessions whose fresh encode would be the same
bits (sessions of other seeds or samplers share them; another prompt or image never does).

Values (`cacheseek.kv.encode`): a fixed-size head (the commit point: written last, removed first)
and the body, bound to the key and xxh3-128-checked on every read, written through the store's
small-value path (``put_skeleton``, as latents and frames are), so every store and tier holds and
counts them. Lifetime:

- looked up always when a binding asks (a hit is bit-for-bit the encode, and a miss costs one
  head read); a missing value is ``encodes_missing``, a damaged one ``encodes_corrupt`` (removed):
  both run the encode;
- written only once the session holds a cached chunk (it stored one, or found a cached prefix):
  inputs that never produced a chunk leave nothing. A full store drops the encode
  (``encodes_dropped``): it never evicts KV to make room;
- freed when a namespace that used it loses its last chunk in this process's forest (eviction,
  invalidation) and no other namespace this process saw uses it; never while this process reads
  it (another process's reader of a value freed meanwhile gets a miss: the head goes first, and
  a torn body fails its digest). Reconcile keeps encodes (they are no chunk's values and are
  written whole, head last), so a restarted worker finds them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch

from cacheseek.errors import CorruptValueError, StoreError
from cacheseek.kv import encode as encode_value
from cacheseek.kv.locators import encode_locators

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

log = logging.getLogger(__name__)

__all__ = ["StoredEncodes", "SessionEncodes", "is_encode_locator"]

_PENDING = 8  # encodes a session keeps for its write (two per session; more: a reused binding)


class _EncodeBook:
    """What a process knows of the encodes in one store: its readers, the keys to free after
    them, the namespaces that used each key and the keys it stored or loaded. Shared by every
    manager on that store (a session's binding makes its own manager: a book per manager would
    store the same encodes again each session and free one under another manager's reader)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.readers: dict[bytes, int] = {}
        self.doomed: set[bytes] = set()
        self.users: dict[bytes, set[bytes]] = {}  # encode key -> namespace roots that used it
        self.held: set[bytes] = set()  # keys this process stored or loaded (and has not freed)


_BOOKS: "weakref.WeakKeyDictionary[Any, _EncodeBook]" = weakref.WeakKeyDictionary()
_BOOKS_LOCK = threading.Lock()


def _book_of(store: Any) -> _EncodeBook:
    with _BOOKS_LOCK:
        return _BOOKS.setdefault(store, _EncodeBook())


def is_encode_locator(key: str) -> bool:
    """Whether ``key`` is an encode's head or body (reconcile keeps them)."""
    return key.endswith((":enc", ":encb"))


class StoredEncodes:
    """The encodes in the manager's store (see the module docstring)."""

    def __init__(self, ctx: "WorldKVManager") -> None:
        self.ctx = ctx
        self.book = _book_of(ctx.store)  # one per store in a process: every manager on it sees the same

    def holds(self, key: bytes) -> bool:
        """Whether this process stored or loaded ``key`` and has not freed it since."""
        with self.book.lock:
            return key in self.book.held

    # -- read -----------------------------------------------------------------------------------

    def read(self, key: bytes, device: Any) -> Optional[torch.Tensor]:
        """The encode ``key`` on ``device``, or None (missing, unreadable, or failing a check:
        then removed). Never raises."""
        ctx = self.ctx
        head_loc, body_loc = encode_locators(key)
        with self.book.lock:
            self.book.readers[key] = self.book.readers.get(key, 0) + 1
        try:
            head = self._get(head_loc, encode_value.HEAD_NBYTES)
            if head is None:
                ctx.metrics.add(encodes_missing=1)
                return None
            parsed = encode_value.unpack_head(key, head, head_loc)
            body = self._get(body_loc, parsed.nbytes)
            if body is None:
                ctx.metrics.add(encodes_missing=1)
                return None
            out = encode_value.unpack_body(parsed, body, body_loc).to(device)
        except CorruptValueError as exc:
            log.warning("stored encode %s: %s; removed, the encode runs instead", key.hex()[:12], exc.problem)
            ctx.metrics.add(encodes_corrupt=1)
            with self.book.lock:
                self.book.doomed.add(key)
            return None
        except Exception as exc:  # noqa: BLE001 - a read that fails is a miss
            log.warning("reading the stored encode %s failed: %s", key.hex()[:12], exc)
            ctx.metrics.add(encodes_missing=1)
            return None
        finally:
            self._leave(key)
        with self.book.lock:
            self.book.held.add(key)
        ctx.metrics.add(encodes_loaded=1)
        return out

    def _get(self, locator: str, nbytes: int) -> Any:
        if self.ctx.store.reads_paths:  # a Plan-style store: read by length, raw bytes back
            return self.ctx.store.get_skeleton(locator, nbytes=nbytes)
        return self.ctx.store.get_skeleton(locator)

    def _leave(self, key: bytes) -> None:
        with self.book.lock:
            n = self.book.readers.pop(key) - 1
            if n:
                self.book.readers[key] = n
                return
            doomed = key in self.book.doomed
            self.book.doomed.discard(key)
        if doomed:
            self._remove(key)

    # -- write ----------------------------------------------------------------------------------

    def write(self, key: bytes, tensor: torch.Tensor) -> bool:
        """Store the encode ``key`` (``tensor``, on its device where the store takes device
        tensors): body first, head last. False when not stored (``encodes_dropped``). Never raises."""
        ctx = self.ctx
        head_loc, body_loc = encode_locators(key)
        try:
            head, body = encode_value.pack(key, tensor)
            if ctx.store.accepts_device_views and tensor.device.type != "cpu":
                head, body = head.to(tensor.device), body.to(tensor.device)
                torch.cuda.current_stream(tensor.device).synchronize()
            ctx.store.put_skeleton(body_loc, body)
            ctx.store.put_skeleton(head_loc, head)
        except Exception as exc:  # noqa: BLE001 - not stored: the next session encodes
            level = logging.INFO if isinstance(exc, StoreError) else logging.WARNING
            log.log(level, "the encode %s was not stored: %s", key.hex()[:12], exc)
            ctx.metrics.add(encodes_dropped=1)
            self.free(key)
            return False
        with self.book.lock:
            self.book.held.add(key)
        ctx.metrics.add(encodes_written=1)
        return True

    # -- lifetime -------------------------------------------------------------------------------

    def note(self, root: bytes, keys: Any) -> None:
        """Namespace ``root``'s session used the encodes ``keys``: they live while it holds a chunk."""
        with self.book.lock:
            for key in keys:
                self.book.users.setdefault(key, set()).add(root)

    def chunk_left(self, node: Any) -> None:
        """A chunk's KV left (eviction, invalidation): when its namespace holds no chunk now, the
        encodes only it used are freed. Never raises."""
        if not self.book.users:
            return
        try:
            top = node
            while top.parent is not None:
                top = top.parent
            root = top.node_key
            with self.ctx.forest.lock:
                ns = self.ctx.forest.resolve(root)
                if ns is not None and any(not n.state.vacant for n in ns.iter_nodes()):  # ready or being written
                    return
            with self.book.lock:
                gone = []
                for key, roots in list(self.book.users.items()):
                    if root in roots:
                        roots.discard(root)
                        if not roots:
                            del self.book.users[key]
                            gone.append(key)
            for key in gone:
                self.free(key)
        except Exception as exc:  # noqa: BLE001 - an encode left behind costs bytes, never bits
            log.warning("freeing the encodes of a namespace failed: %s", exc)

    def free(self, key: bytes) -> None:
        """Remove the encode ``key`` (head first), once no reader of this process holds it."""
        with self.book.lock:
            if self.book.readers.get(key):
                self.book.doomed.add(key)
                return
        self._remove(key)

    def _remove(self, key: bytes) -> None:
        with self.book.lock:
            self.book.held.discard(key)
        if not self.ctx.store.frees_latents:
            return
        for loc in encode_locators(key):
            try:
                self.ctx.store.free_skeleton(loc)
            except Exception as exc:  # noqa: BLE001
                log.warning("freeing the stored encode %s failed: %s", loc, exc)


class SessionEncodes:
    """One session's side (`RuntimeHooks.session_encodes`): reads encodes before the runtime
    exists, keeps the ones it ran, and writes them once the session holds a cached chunk."""

    def __init__(self, stored: StoredEncodes) -> None:
        self.stored = stored
        self._lock = threading.Lock()
        self._pending: list[tuple[bytes, torch.Tensor]] = []
        self._used: list[bytes] = []

    def read(self, key: bytes, device: Any) -> Optional[torch.Tensor]:
        """The stored encode ``key`` on ``device``, or None: run the encode, then `ran`."""
        out = self.stored.read(key, device)
        if out is not None:
            with self._lock:
                self._used.append(key)
        return out

    def kept(self, key: bytes, tensor: torch.Tensor) -> None:
        """The process served the encode ``key`` from its own keep: stored by `commit` unless
        the store holds it as far as this process knows."""
        if self.stored.holds(key):
            with self._lock:
                self._used.append(key)
        else:
            self.ran(key, tensor)

    def ran(self, key: bytes, tensor: torch.Tensor) -> None:
        """The session ran the encode ``key``: ``tensor`` (the caller's own copy) is stored by `commit`."""
        with self._lock:
            self._used.append(key)
            self._pending = (self._pending + [(key, tensor)])[-_PENDING:]

    def commit(self, root: bytes) -> None:
        """The session holds a cached chunk of namespace ``root``: note its encodes and store the
        ones it ran (never raises)."""
        with self._lock:
            pending, self._pending = self._pending, []
            used, self._used = self._used, []
        self.stored.note(root, used)
        for key, tensor in pending:
            self.stored.write(key, tensor)
