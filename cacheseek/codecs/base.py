"""`KVCodec`: how a generic tier encodes one K or V value (``store.codec``).

A codec is a class in the `CODECS` registry (``none``, ``lossless``, ``int8``, ``int4``) with
``encode(value, role) -> uint8 tensor`` (role ``"k"`` or ``"v"``: KIVI quantizes K per channel and V
per token) and ``decode(key, encoded, device) -> tensor``. Both are torch ops on the value's (or
the given) device, so the same code is the CPU reference CI runs and the CUDA path on a GPU.

Where it sits: `KeyValueTier` encodes each K and V before the backend stores it and decodes after
the backend read it (latents and non-pair layers are never encoded). So a backend's checksum
(LocalDisk, Fluxon) covers the *encoded* bytes: it is checked as the bytes come off the medium,
before any decode, at no extra pass over the larger decoded value; a damaged encoded value is a
`CorruptValueError` and so a miss. The decoder trusts nothing either (`cacheseek.codecs.container`):
a value written under another codec, or one whose sections do not add up, is a miss, never KV.

The codec is part of the namespace fingerprint (field ``codec``: ``fingerprint``, name and format
version): chunks written under one codec are never found under another.

``lossy`` codecs (int8, int4) restore KV that differs from what was computed: the gate reports a
quality verdict (PSNR of frames against a cold run, the first chunk that differs) instead of
bit-exactness, and results say ``lossy``.
"""

from __future__ import annotations

from typing import Any

from cacheseek.errors import ConfigError, StoreError
from cacheseek.registry import CODECS

__all__ = ["KVCodec", "NoneCodec", "get_codec", "codec_fingerprint"]

ROLES = ("k", "v")
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # what a codec encodes


class KVCodec:
    """The codec seam; see the module docstring. Subclasses set ``name``, ``version``, ``lossy``."""

    name = "none"
    version = 1
    lossy = False
    identity = False  # True: values pass through untouched (the tier skips encode and decode)

    @property
    def fingerprint(self) -> str:
        """What the namespace fingerprint records: the name and the format version."""
        return f"{self.name}/v{self.version}"

    def encode(self, value: Any, role: str) -> Any:
        """``value`` (a tensor) as one ``uint8`` tensor on its device (`cacheseek.codecs.container`)."""
        raise NotImplementedError

    def decode(self, key: str, value: Any, device: Any = None) -> Any:
        """The tensor ``value`` holds, on ``device`` (default: the value's); `CorruptValueError`
        when it is not a value this codec wrote."""
        raise NotImplementedError

    def check_value(self, key: str, value: Any) -> Any:
        """``value`` as a floating tensor the codec takes, else `StoreError` naming the key."""
        import torch  # only a codec that encodes needs torch: importing a store stays torch-free

        if not isinstance(value, torch.Tensor) or str(value.dtype).removeprefix("torch.") not in DTYPE_NAMES:
            raise StoreError(f"{key}: codec {self.name} takes bfloat16, float16 or float32 tensors, "
                             f"got {getattr(value, 'dtype', type(value).__name__)}")
        return value


@CODECS.register("none")
class NoneCodec(KVCodec):
    """Values stored as they are (the default)."""

    identity = True

    def encode(self, value: Any, role: str) -> Any:
        return value

    def decode(self, key: str, value: Any, device: Any = None) -> Any:
        return value


def get_codec(name: Any) -> KVCodec:
    """The codec named ``name`` (``store.codec``); an unknown name is a `ConfigError` listing them."""
    if not isinstance(name, str) or name not in CODECS:
        raise ConfigError("store.codec", f"unknown codec {name!r}",
                          f"use one of: {', '.join(CODECS.names())} (none stores K and V as they are)")
    return CODECS.get(name)()


def codec_fingerprint(store: Any) -> Any:
    """The namespace's ``codec`` field of a store: its ``codec_id`` (a generic tier's codec, a
    tiered store's levels), ``none`` for stores that move raw bytes (Plan, HBM)."""
    return store.codec_id or KVCodec().fingerprint

