"""`TierCodec`: a generic tier's codec and the device it runs on (`KeyValueTier`'s seam).

``encode_items`` turns the ``(key, value)`` items of one chunk's ``(k, v)`` layers into encoded
CPU values (the backend's input); ``decode`` turns what the backend read back into the value. The
role of a value (``k`` or ``v``) is the last part of its key (`cacheseek.kv.locators.layer_keys`).

``device``: where encode and decode run. ``auto`` is CUDA when torch has a GPU, else the CPU: a
restore then moves the smaller encoded bytes to the GPU and decodes there (the decoded value is
returned on that device; the ring's copy from it stays on the GPU). Encode takes the tier's CPU
snapshot to the device, encodes, and brings the encoded bytes back for the backend.
"""

from __future__ import annotations

from typing import Any

from cacheseek.codecs.base import KVCodec, get_codec
from cacheseek.errors import ConfigError, StoreError

__all__ = ["TierCodec", "resolve_device"]

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: Any) -> Any:
    """``store.codec_device``: ``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda`` (a
    ``torch.device``; torch is imported here, by a tier whose codec encodes, not by importing a store)."""
    if device not in DEVICES:
        raise ConfigError("store.codec_device", f"must be one of {', '.join(DEVICES)}, got {device!r}",
                          "store.codec_device=auto runs the codec on the GPU when there is one")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("store.codec_device", "is cuda, but torch sees no GPU", "use store.codec_device=auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


class TierCodec:
    """A tier's `KVCodec` (``name``: ``store.codec``) running on ``device`` (``store.codec_device``)."""

    def __init__(self, name: Any = "none", device: Any = "auto") -> None:
        self.codec: KVCodec = get_codec(name)
        if device not in DEVICES:
            resolve_device(device)  # the one error line, for every codec
        self.device = resolve_device(device) if not self.codec.identity else None

    @property
    def identity(self) -> bool:
        return self.codec.identity

    @property
    def codec_id(self) -> str:
        return self.codec.fingerprint

    def encode_items(self, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The items with each value encoded (CPU ``uint8`` tensors); unchanged for ``none``."""
        if self.identity:
            return items
        out = []
        for key, value in items:
            role = key.rpartition(":")[2]
            value = self.codec.check_value(key, value)
            try:
                out.append((key, self.codec.encode(value.to(self.device), role).cpu()))
            except Exception as exc:  # noqa: BLE001 - device memory, a driver error: this write fails, as a store's would
                raise StoreError(f"{key}: codec {self.codec.name} could not encode it on {self.device}: "
                                 f"{type(exc).__name__}: {exc}") from exc
        return out

    def decode(self, key: str, value: Any) -> Any:
        """The value an encoded ``value`` holds (`CorruptValueError` when it is not one)."""
        if self.identity or value is None:
            return value
        return self.codec.decode(key, value, self.device)
