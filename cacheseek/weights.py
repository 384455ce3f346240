"""The identity of a model's weights: what keeps two checkpoints out of each other's namespace.

A chunk's KV depends on every weight of the DiT, so the namespace root covers a fingerprint of
them (docs/design.md, "Keys"). It comes, first found wins, from:

1. ``namespace.model_fingerprint`` / the binding's ``model_fingerprint`` when the user names the
   checkpoint (any string that changes with the weights: a content hash, a release tag);
2. the runtime's own ``weights_fingerprint`` attribute (the synthetic runtime has one);
3. the model that created the runtime: `of_model` marks it around ``create_runtime`` (the
   TeleFuser hooks installed by ``attach`` do), and `current` hashes it on first use.

The hash is xxh3-128 over every tensor of ``module.state_dict()`` in name order (name, shape,
dtype, then the bytes, copied to the host in 256 MiB pieces), computed once per module object.
xxh3 rather than sha256: a 14B bf16 DiT is 28 GB and hashing it must not dominate start-up; the
threat is an honest mix-up of checkpoints, not a crafted collision. Weights modified in place after
the first hash (a LoRA merged later) are not seen: name such a checkpoint with
``model_fingerprint``.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Optional

__all__ = ["module_fingerprint", "of_model", "current"]

_PIECE = 256 << 20
_cache: "weakref.WeakKeyDictionary[Any, bytes]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()
_current: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("cacheseek_model", default=None)


def module_fingerprint(module: Any) -> bytes:
    """16-byte xxh3-128 digest of ``module``'s state dict; cached per module object."""
    with _cache_lock:
        cached = _cache.get(module)
    if cached is not None:
        return cached
    import torch
    import xxhash

    h = xxhash.xxh3_128(b"cacheseek.weights.v2")
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict().items()):
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{flat.numel()}|".encode())
            for start in range(0, flat.numel(), _PIECE):
                h.update(flat[start:start + _PIECE].cpu().numpy().data)
    digest = h.digest()
    with _cache_lock:
        _cache[module] = digest
    return digest


@contextlib.contextmanager
def of_model(module: Any) -> Iterator[None]:
    """Within the block, runtimes are created by ``module``: `current` fingerprints it."""
    token = _current.set(module)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Optional[bytes]:
    """The fingerprint of the model marked by the innermost `of_model`; None outside one, or for a
    model without a state dict (a stand-in: a real DiT is a torch module)."""
    module = _current.get()
    if module is None or not callable(getattr(module, "state_dict", None)):
        return None
    return module_fingerprint(module)
