"""Helpers of the Plan data path tests: host memory, recording proxies, the fake CUDA runtime."""

from __future__ import annotations

import ctypes
import importlib.util
from typing import Any

import pytest
import torch

from cacheseek.plan.base import REQUIRED_PLAN_CALLS
from cacheseek.kv.ring import RingGeometry
from cacheseek.reuse.exact_prefix.types import Skeleton, Tier, TrieNode
from cacheseek.stores.base import RestoreTarget
from cacheseek.transfer.batch import CopyBatch
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from cacheseek.transfer.memory import HostMapping

from fakes.cudart import FakeCudart

STREAM = 7  # a non-legacy stream handle for the fake

NEEDS_CUDA = [  # ``pytestmark`` of a module whose tests run on a real GPU
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
                       reason="needs CUDA and cuda-bindings"),
]


class HostBuffer:
    """``n`` bytes of host memory with its address, kept alive by the object."""

    def __init__(self, n: int, fill: int = 0) -> None:
        self.buf = (ctypes.c_char * n)(*([fill] * n)) if fill else (ctypes.c_char * n)()
        self.ptr = ctypes.addressof(self.buf)
        self.n = n

    def mapping(self, generation: int = 1, writable: bool = True) -> HostMapping:
        return HostMapping(self.ptr, self.n, generation, writable)

    def read(self, off: int = 0, n: int | None = None) -> bytes:
        return ctypes.string_at(self.ptr + off, self.n - off if n is None else n)

    def write(self, data: bytes, off: int = 0) -> None:
        ctypes.memmove(self.ptr + off, data, len(data))


class RecordingClient:
    """Delegates to a Plan client and logs each Plan call as ``("plan", name, keys-or-None)``."""

    def __init__(self, inner: Any, log: list) -> None:
        self._inner = inner
        self._log = log

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in REQUIRED_PLAN_CALLS + ("close",):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._log.append(("plan", name, args[0] if name in ("local_fast_put_start", "get_start", "remove") else None))
            return attr(*args, **kwargs)

        return call


class RecordingTransfer:
    """Delegates to a transfer runtime and keeps every batch's descriptors and device ranges
    (synchronous ``copy_batch`` and asynchronous ``submit_batch`` alike; the log names both
    ``copy_batch``, plus ``("transfer", "wait", n)`` when a submitted batch is waited for)."""

    def __init__(self, inner: Any, log: list | None = None) -> None:
        self._inner = inner
        self._log = log
        self.batches: list[list] = []
        self.device_ranges: list[list] = []
        self.streams: list = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _keep(self, descriptors, stream, device_ranges) -> None:
        descs = descriptors.descriptors() if isinstance(descriptors, CopyBatch) else list(descriptors)
        self.batches.append(descs)
        self.device_ranges.append(list(device_ranges))
        self.streams.append(stream)
        if self._log is not None:
            self._log.append(("transfer", "copy_batch", len(descs)))

    def copy_batch(self, descriptors, *, stream=None, device_ranges=(), **kw):
        self._keep(descriptors, stream, device_ranges)
        return self._inner.copy_batch(descriptors, stream=stream, device_ranges=device_ranges, **kw)

    def submit_batch(self, batch, *, stream=None, device_ranges=(), **kw):
        self._keep(batch, stream, device_ranges)
        return self._inner.submit_batch(batch, stream=stream, device_ranges=device_ranges, **kw)


def fake_cuda_runtime(*, log: list | None = None, batch_api: str | None = "13", stream: int = STREAM) -> tuple[CudaTransferRuntime, FakeCudart]:
    """A CUDA runtime over the fake cudart, with CPU tensors standing in for CUDA tensors."""
    fake = FakeCudart(batch_api=batch_api, unknown_is_device=True, log=log)
    runtime = CudaTransferRuntime(cudart=fake, current_stream=lambda: stream, tensor_device_type="cpu")
    return runtime, fake


LATENT_SHAPE = (1, 4, 3, 2, 2)


class ColdRing:
    """The runtime's shift-left ring with a pinned sink (docs/design.md section 1), filled chunk by
    chunk with values that encode (layer, k/v, global token), like a cold run."""

    def __init__(self, geom: RingGeometry, total_chunks: int, *, n_layers: int = 2, heads: int = 2,
                 dim: int = 4, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.geom = geom
        frames = geom.local_attn_size if geom.rolling else total_chunks * geom.chunk_size
        self.kv_size = frames * geom.frame_tokens
        self.shape = (1, self.kv_size, heads, dim)
        self.dtype, self.device = dtype, device
        self.kv = [tuple(torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(2)) for _ in range(n_layers)]
        self.local_end = 0
        self.global_end = 0

    def write_chunk(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Write the next chunk as the runtime would; return the ring-tail views (the payload)."""
        n = self.geom.chunk_size * self.geom.frame_tokens
        if self.local_end + n > self.kv_size:
            overflow = self.local_end + n - self.kv_size
            sink = self.geom.sink_size * self.geom.frame_tokens
            for pair in self.kv:
                for t in pair:
                    t[:, sink : self.local_end - overflow] = t[:, sink + overflow : self.local_end].clone()
            self.local_end -= overflow
        heads, dim = self.shape[2:]
        tokens = torch.arange(self.global_end, self.global_end + n, dtype=torch.float32, device=self.device)
        hd = torch.arange(heads * dim, dtype=torch.float32, device=self.device).reshape(heads, dim) / 100
        for layer, pair in enumerate(self.kv):
            for half, t in enumerate(pair):
                values = tokens[:, None, None] + layer * 10000 + half * 5000 + hd
                t[0, self.local_end : self.local_end + n] = values.to(self.dtype)
        self.local_end += n
        self.global_end += n
        tail = slice(self.local_end - n, self.local_end)
        return [(k[:, tail].detach(), v[:, tail].detach()) for k, v in self.kv]

    def snapshot(self):
        return [tuple(t.clone() for t in pair) for pair in self.kv], self.local_end, self.global_end


def ingest(store: Any, geom: RingGeometry, n_chunks: int, **ring_kw: Any):
    """Run a cold session through the store: per chunk a skeleton latent and the ring-tail KV.
    Returns (nodes, ring state after each chunk, latents, kv_size)."""
    ring = ColdRing(geom, n_chunks, **ring_kw)
    nodes, states, latents = [], [], []
    parent = None
    for depth in range(n_chunks):
        payload = ring.write_chunk()
        key = bytes([depth + 1]) * 32
        latent = torch.full(LATENT_SHAPE, float(depth + 1), dtype=ring.dtype, device=ring.device)
        store.put_skeleton(f"{key.hex()}:lat", latent)
        handle = store.put_async(f"{key.hex()}:kv", payload, tier=Tier.FLUXON_DRAM)
        node = TrieNode(key, b"a", depth, parent, skeleton=Skeleton(f"{key.hex()}:lat"), blob=handle)
        nodes.append(node)
        states.append(ring.snapshot())
        latents.append(latent)
        parent = node
    store.flush()  # overlapped writes turn ready on the completion thread
    return nodes, states, latents, ring.kv_size


def restore_target(geom: RingGeometry, k: int, kv_size: int, *, n_layers: int = 2, heads: int = 2, dim: int = 4,
                   dtype: torch.dtype = torch.float32, device: str = "cpu") -> RestoreTarget:
    """An empty ring and private latent targets for a restore of depth ``k``."""
    zeros = lambda shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    return RestoreTarget(
        kv=tuple(tuple(zeros((1, kv_size, heads, dim)) for _ in range(2)) for _ in range(n_layers)),
        runs=geom.restore_runs(k),
        window_depths=tuple(geom.window_depths(k)),
        token_bytes=heads * dim * torch.empty((), dtype=dtype).element_size(),
        chunk_tokens=geom.chunk_size * geom.frame_tokens,
        latents=tuple(zeros(LATENT_SHAPE) for _ in range(k)),
    )


def assert_restores_match(store: Any, geom: RingGeometry, nodes: list, states: list, kv_size: int,
                          depths: tuple[int, ...], **ring_kw: Any) -> None:
    """Restore each depth in ``depths`` of an `ingest` path into a fresh target and assert its
    ring equals the cold session's ring at that depth, up to ``local_end``."""
    for k in depths:
        target = restore_target(geom, k, kv_size, **ring_kw)
        assert store.read_path(nodes[:k], [nodes[d] for d in geom.window_depths(k)], target)
        cold, local_end, _ = states[k - 1]
        for (rk, rv), (ck, cv) in zip(target.kv, cold):
            assert torch.equal(rk[:, :local_end], ck[:, :local_end]) and torch.equal(rv[:, :local_end], cv[:, :local_end])


def latent_levels(store, locator: str) -> tuple[int, ...]:
    """The levels of a tiered store whose own store holds the latent ``locator``."""
    return tuple(i for i, lv in enumerate(store.levels) if lv.contains([locator])[0])
