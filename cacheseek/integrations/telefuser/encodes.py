"""A session's encodes kept: the prompt embedding and the condition video's latents, once per input.

Every TeleFuser session pays, in ``create_runtime``, umT5's prompt encode (0.03 s at 480p) and
the Wan VAE's encode of the condition video (0.28-0.37 s), hit or not: more than everything else
a full hit of 3 chunks costs once its frames are handed out. Both are functions of the session's
inputs and the encoders, so `KeptEncodes` serves a session created with a binding from two
levels, and runs the encode only when both miss:

- in the process: each result keyed by its inputs and the encoder object's identity and
  parameter versions (an in-place weight load bumps them: a new key), on the encoders' device,
  at most `KeptEncodes.ENTRIES` of each, least recently used first out (``hits``);
- in the cache's store (`cacheseek.reuse.exact_prefix.encodes`, the binding's
  ``session_encodes()``), shared by every process of the cache (``loaded``), under a key of
  what determines the encode's bits (`prompt_key`, `condition_key`): the input (the prompt's
  text and the tokenizer's settings; the condition image's tensor as TeleFuser resized it, its
  dtype, and the frame count), the encoder's weights (`cacheseek.weights.tensor_fingerprint`,
  computed at ``attach`` and again after an in-place write to them) and the kernels' identity
  (device type, GPU or CPU instruction set, torch, CUDA and cuDNN versions). A session that runs
  an encode hands its copy to the binding, which stores it once the session holds a cached chunk.

Either copy is bit-for-bit the encode (the same kernels on the same inputs give the same bits,
which the whole cache relies on; the stored value is checked against its key and digest).
Counted: ``hits`` (the process), ``loaded`` (the store), ``misses`` (encoded).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

import torch
import xxhash

from cacheseek import weights
from cacheseek.hooks import as_hooks
from cacheseek.kv.frames import host_bytes

__all__ = ["KeptEncodes", "prompt_key", "condition_key", "tensor_digest"]


def _module_version(module: Any) -> tuple:
    """The module's identity and the versions of its parameters (bumped by in-place writes)."""
    params = module.parameters() if hasattr(module, "parameters") else ()
    return id(module), sum(p._version for p in params)


def _encoder_tensors(encoder: Any) -> list:
    """An encoder's tensors: a module's parameters and buffers (a wrapper's too, as TeleFuser's
    callers wrap its VAE), else its tensor attributes."""
    if _is_module(encoder):
        return list(encoder.parameters()) + list(encoder.buffers())
    return [v for _, v in sorted(vars(encoder).items()) if isinstance(v, torch.Tensor)]


def _is_module(encoder: Any) -> bool:
    return isinstance(encoder, torch.nn.Module) or all(
        callable(getattr(encoder, name, None)) for name in ("state_dict", "parameters", "buffers"))


def _version(t: torch.Tensor) -> int:
    """Bumped by every in-place write; an inference tensor tracks none (nothing writes it)."""
    return 0 if t.is_inference() else t._version


def _kernels(device: torch.device) -> bytes:
    """What else decides an encode's low bits: the device kind and its kernels' libraries."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name}|sm_{props.major}{props.minor}|{props.multi_processor_count}"
    else:
        where = torch.backends.cpu.get_cpu_capability()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return f"{device.type}|{where}|{torch.__version__}|{torch.version.cuda}|{cudnn}".encode()


def _tokenizer_settings(tokenizer: Any) -> bytes:
    """A tokenizer's type and plain settings (a path by its last part: hosts mount it elsewhere)."""
    plain = {}
    for k, v in sorted(getattr(tokenizer, "__dict__", {}).items()):
        if isinstance(v, str):
            plain[k] = os.path.basename(v.rstrip("/"))
        elif isinstance(v, (int, float, bool)) or v is None:
            plain[k] = v
    return f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}|{sorted(plain.items())}".encode()


def _key(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def prompt_key(prompt: str, tokenizer: Any, encoder_id: bytes, device: torch.device) -> bytes:
    """The stored prompt embedding's key: the text, the tokenizer, the encoder, the kernels."""
    return _key(b"cacheseek.encode.prompt.v1", str(prompt).encode("utf-8"), _tokenizer_settings(tokenizer),
                encoder_id, _kernels(device))


def condition_key(image_digest: bytes, frame_num: int, encoder_id: bytes, device: torch.device) -> bytes:
    """The stored condition latents' key: the resized image tensor (its `tensor_digest`), the frame
    count, the VAE, the kernels."""
    return _key(b"cacheseek.encode.condition.v1", image_digest, str(int(frame_num)).encode(), encoder_id,
                _kernels(device))


def tensor_digest(t: Any) -> bytes:
    """A tensor's bytes (xxh3-128), shape and dtype."""
    return xxhash.xxh3_128(host_bytes(t)).digest() + str((tuple(t.shape), t.dtype)).encode()


class KeptEncodes:
    """The memo of one pipeline's ``encode_prompt`` and ``_encode_condition_video`` (see the
    module docstring); `install` puts its wrappers on the pipeline instance, `remove` takes them
    off. Only a session created with a binding uses it (`for_session`): one without a cache
    encodes as TeleFuser does."""

    ENTRIES = 16

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self._lock = threading.Lock()
        self._kept: "OrderedDict[tuple, list]" = OrderedDict()  # key -> [encode, its store key or None]
        self.hits = 0
        self.loaded = 0
        self.misses = 0
        self.installed = False
        self._active = threading.local()
        self._ids: dict[int, tuple[int, Optional[bytes]]] = {}  # encoder id -> (version fingerprinted, fingerprint)

    @contextlib.contextmanager
    def for_session(self, binding: Any) -> Iterator[None]:
        """While a session is created in this thread: kept encodes serve it when it has a binding."""
        before = getattr(self._active, "on", False), getattr(self._active, "stored", None)
        hooks = as_hooks(binding)
        self._active.on = hooks is not None
        self._active.stored = hooks.session_encodes() if hooks is not None else None
        try:
            yield
        finally:
            self._active.on, self._active.stored = before

    def clear(self) -> None:
        """Forget what the process keeps (the store's copies stay): as a fresh worker starts."""
        with self._lock:
            self._kept.clear()

    def install(self) -> None:
        p = self.pipeline
        self._encode_prompt = p.encode_prompt
        self._encode_condition = p._encode_condition_video
        p.encode_prompt = lambda prompt: self.encode_prompt(prompt)  # looked up per call (timers patch the class)
        p._encode_condition_video = lambda image_tensor, frame_num: self.encode_condition(image_tensor, frame_num)
        self.installed = True
        for encoder in (getattr(p, "text_encoder", None), getattr(p, "vae", None)):  # fingerprinted now,
            if encoder is not None:                                                     # not in a session
                self._encoder_id(encoder)

    def remove(self) -> None:
        if self.installed:
            for name in ("encode_prompt", "_encode_condition_video"):
                if name in vars(self.pipeline):
                    delattr(self.pipeline, name)
            self.installed = False

    def encode_prompt(self, prompt: str) -> Any:
        p = self.pipeline
        key = ("prompt", str(prompt), _module_version(p.text_encoder))

        def stored_key() -> Optional[bytes]:
            found = self._encoder_id(p.text_encoder)
            return None if found is None else prompt_key(prompt, p.tokenizer, found[0], found[1])
        return self._kept_or(key, stored_key, lambda: self._encode_prompt(prompt))

    def encode_condition(self, image_tensor: Any, frame_num: int) -> Any:
        p = self.pipeline
        digest = tensor_digest(image_tensor)
        key = ("condition", digest, int(frame_num), _module_version(p.vae))

        def stored_key() -> Optional[bytes]:
            found = self._encoder_id(p.vae)
            return None if found is None else condition_key(digest, frame_num, found[0], found[1])
        return self._kept_or(key, stored_key, lambda: self._encode_condition(image_tensor, frame_num))

    def _encoder_id(self, encoder: Any) -> Optional[tuple[bytes, torch.device]]:
        """The encoder's weights fingerprint (`weights.tensor_fingerprint` of its state, computed
        again when an in-place write bumped its tensors' versions) and device; None when it holds
        no tensors. A 5.7B umT5-XXL costs about 0.14 s on an H200 (the DiT's 14B: 0.35 s), paid
        at `install` (``attach``), not by a session."""
        tensors = _encoder_tensors(encoder)
        if not tensors:
            return None
        version = sum(_version(t) for t in tensors)
        with self._lock:
            seen = self._ids.get(id(encoder))
        if seen is None or seen[0] != version:
            named = (encoder.state_dict().items() if _is_module(encoder)
                     else [(k, v) for k, v in vars(encoder).items() if isinstance(v, torch.Tensor)])
            with torch.no_grad():
                fp = weights.tensor_fingerprint(sorted(named))
            seen = (version, type(encoder).__qualname__.encode() + fp)
            with self._lock:
                self._ids[id(encoder)] = seen
        return seen[1], tensors[0].device

    def _kept_or(self, key: tuple, stored_key: Callable[[], Optional[bytes]], encode: Callable[[], Any]) -> Any:
        if not getattr(self._active, "on", False):
            return encode()
        with self._lock:
            entry = self._kept.get(key)
            if entry is not None:
                self._kept.move_to_end(key)
                self.hits += 1
        stored = self._active.stored
        if entry is not None:
            kept, skey = entry
            if stored is not None:
                skey = skey or stored_key()  # the memo's key names the store's (inputs, encoder version)
                if skey is not None:
                    stored.kept(skey, kept)  # the memo's own copy, never handed out
                    entry[1] = skey
            return kept.clone()
        skey = stored_key() if stored is not None else None
        out = stored.read(skey, self.pipeline.device) if skey is not None else None
        if out is not None:
            with self._lock:
                self.loaded += 1
                self._keep(key, [out.clone(), skey])
            return out
        out = encode()
        copy = out.clone()
        with self._lock:
            self.misses += 1
            self._keep(key, [copy, skey])
        if skey is not None:
            stored.ran(skey, copy)  # stored once the session holds a cached chunk
        return out

    def _keep(self, key: tuple, value: list) -> None:
        self._kept[key] = value
        while len(self._kept) > self.ENTRIES:
            self._kept.popitem(last=False)
