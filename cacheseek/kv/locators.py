"""Store keys of a chunk's values, derived from its 32-byte node key.

    KV locator      {hex}:kv            one blob: every layer of one chunk
    K and V values  {hex}:kv:L{i}:k, {hex}:kv:L{i}:v
    object value    {hex}:kv:L{i}       a layer that is not a (k, v) pair (generic tiers only)
    latent          {hex}:lat           the chunk's skeleton
    frames          {hex}:frm           what the runtime handed out for the chunk (`kv.frames`)
    decoder state   {hex}:dec           the decoder's causal state after the chunk (`kv.decoder_state`)
    encode          {hex}:enc, :encb    a session's encode, head and body (`kv.encode`; ``hex`` the
                                        encode's key, not a chunk's)

Both the trie (which names values) and every store (which writes and frees them) use these, so
they live below both.
"""

from __future__ import annotations

import functools

__all__ = ["kv_locator", "latent_locator", "frames_locator", "decoder_state_locator", "encode_locators", "layer_keys", "object_key", "blob_keys", "node_key_of"]


def kv_locator(key: bytes) -> str:
    return f"{key.hex()}:kv"


def latent_locator(key: bytes) -> str:
    return f"{key.hex()}:lat"


def frames_locator(key: bytes) -> str:
    return f"{key.hex()}:frm"


def decoder_state_locator(key: bytes) -> str:
    return f"{key.hex()}:dec"


def encode_locators(key: bytes) -> tuple[str, str]:
    """The head and body locators of the encode ``key`` (`cacheseek.kv.encode`)."""
    return f"{key.hex()}:enc", f"{key.hex()}:encb"


def node_key_of(locator: str) -> bytes:
    """The node key a KV locator ``{hex}:kv`` (or a latent locator ``{hex}:lat``) was made from."""
    head, _, _ = locator.partition(":")
    return bytes.fromhex(head)


def layer_keys(locator: str, layer: int) -> tuple[str, str]:
    """Store keys of one layer's K and V under a KV locator ``{hex}:kv``."""
    return f"{locator}:L{layer}:k", f"{locator}:L{layer}:v"


def object_key(locator: str, layer: int) -> str:
    """Store key of one layer stored as a single value (a layer that is not a ``(k, v)`` pair)."""
    return f"{locator}:L{layer}"


def blob_keys(locator: str, n_layers: int, *, pairs: bool = True) -> list[str]:
    """Every store key of a blob's KV: K and V per layer, or one key per layer (``pairs=False``)."""
    if pairs:
        return list(_pair_keys(locator, n_layers))
    return [object_key(locator, layer) for layer in range(n_layers)]


@functools.lru_cache(maxsize=1024)
def _pair_keys(locator: str, n_layers: int) -> tuple[str, ...]:
    """A restore names the same hot blobs again and again: their 80 keys are built once."""
    return tuple(key for layer in range(n_layers) for key in layer_keys(locator, layer))
