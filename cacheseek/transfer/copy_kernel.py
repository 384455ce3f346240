"""Many copies in one kernel launch: the range-copy kernel, its parameter table, and its launchers.

Why: a batch of copies costs the copy engines a fixed time per descriptor. For the HBM tier's
device-to-device restores (240 copies of 45.7 MiB for three 480p chunks) and for rolled-ring
restores (hundreds of runs of a few hundred KiB from the registered host segment) that fixed cost
is 10-30% of the transfer. One kernel that walks a table of ranges has no cost per range: its
blocks take fixed-size tiles from every range alike, so the copy runs at the speed of the memory
it reads (HBM, or host memory over PCIe through the device's mapping of registered memory).

The table is the kernel's only parameter, passed by value (no device buffer to allocate, fill
and keep alive per launch; the driver copies parameters at launch). Layout (`PARAM_BYTES`,
little-endian, `MAX_RANGES` = 1024 slots, so a larger batch is several launches in stream order):

    u64 src[1024]; u64 dst[1024]; u64 size[1024]; u32 first_tile[1025]; u32 n

``first_tile`` is the prefix sum of each range's tiles (`TILE_BYTES` = 64 KiB): tile ``t`` belongs
to the range ``i`` with ``first_tile[i] <= t < first_tile[i + 1]``, found by binary search.
Every address and size must be a multiple of 16 (the kernel moves 16-byte words); `aligned`
says whether a batch is, and the transfer runtime sends only such batches here.

Launchers (the `RangeKernel` seam):
- `CudaRangeKernel`: compiled once per device with NVRTC, loaded and launched through the CUDA
  driver API of cuda-bindings, on the caller's stream;
- a fake in the tests (tests/fakes/range_kernel.py) runs the same tables over host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional, Protocol

import attrs

from cacheseek.errors import TransferError
from cacheseek.transfer.lazy import LazyModule

np = LazyModule("numpy")

__all__ = ["MAX_RANGES", "TILE_BYTES", "PARAM_BYTES", "RangeTable", "RangeKernel", "aligned", "range_tables",
           "CudaRangeKernel", "KernelShape"]

MAX_RANGES = 1024
TILE_SHIFT = 16
TILE_BYTES = 1 << TILE_SHIFT
WORD = 16
_SRC, _DST, _SIZE = 0, 8 * MAX_RANGES, 16 * MAX_RANGES
_FIRST = 24 * MAX_RANGES
_N = _FIRST + 4 * (MAX_RANGES + 1)
PARAM_BYTES = _N + 4  # 28,680 B: under the 32,764 B a kernel's parameters may take (CUDA >= 12.1)
_HINTS = {"stream": ("__ldcs(%s)", "__stcs(%s, %s)"), "plain": ("(*(%s))", "(*(%s) = %s)")}


@attrs.frozen(slots=True)
class KernelShape:
    """How the kernel walks its tiles: ``threads`` a block, ``blocks_per_sm`` resident blocks,
    ``unroll`` 16-byte loads in flight per thread before their stores, and the cache ``hint``
    ("stream": evict-first loads and stores, the data is not read again; "plain")."""

    threads: int = attrs.field(default=512, validator=attrs.validators.in_([128, 256, 512, 1024]))
    blocks_per_sm: int = attrs.field(default=4, validator=attrs.validators.in_([1, 2, 4, 8, 16]))
    unroll: int = attrs.field(default=8, validator=attrs.validators.in_([1, 2, 4, 8, 16]))
    hint: str = attrs.field(default="plain", validator=attrs.validators.in_(sorted(_HINTS)))

    def source(self) -> str:
        load, store = _HINTS[self.hint]
        return _SOURCE % {"max_ranges": MAX_RANGES, "tile_shift": TILE_SHIFT, "threads": self.threads,
                          "unroll": self.unroll, "load": load % "(p)", "store": store % ("(p)", "(v)")}


_SOURCE = r"""
#define MAX_RANGES %(max_ranges)d
#define TILE_SHIFT %(tile_shift)d
#define UNROLL %(unroll)d
#define LOAD(p) %(load)s
#define STORE(p, v) %(store)s
struct Ranges {
  unsigned long long src[MAX_RANGES];
  unsigned long long dst[MAX_RANGES];
  unsigned long long size[MAX_RANGES];
  unsigned int first_tile[MAX_RANGES + 1];
  unsigned int n;
};

extern "C" __global__ void __launch_bounds__(%(threads)d) copy_ranges(const Ranges r) {
  const unsigned int tiles = r.first_tile[r.n];
  const unsigned int step = blockDim.x;
  for (unsigned int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    unsigned int lo = 0, hi = r.n;
    while (hi - lo > 1) {
      const unsigned int mid = (lo + hi) >> 1;
      if (r.first_tile[mid] <= tile) lo = mid; else hi = mid;
    }
    const unsigned long long off = (unsigned long long)(tile - r.first_tile[lo]) << TILE_SHIFT;
    const unsigned long long left = r.size[lo] - off;
    const unsigned int words = (unsigned int)((left < (1ull << TILE_SHIFT) ? left : (1ull << TILE_SHIFT)) >> 4);
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(r.src[lo] + off);
    uint4* __restrict__ d = reinterpret_cast<uint4*>(r.dst[lo] + off);
    unsigned int w = threadIdx.x;
    for (; w + (UNROLL - 1) * step < words; w += UNROLL * step) {
      uint4 v[UNROLL];
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) v[k] = LOAD(s + w + k * step);
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) STORE(d + w + k * step, v[k]);
    }
    for (; w < words; w += step) STORE(d + w, LOAD(s + w));
  }
}
"""

class RangeTable:
    """One launch's parameter block (`PARAM_BYTES` bytes, module docstring) and its tile count."""

    __slots__ = ("buffer", "tiles", "n")

    def __init__(self, dsts: "np.ndarray", srcs: "np.ndarray", sizes: "np.ndarray") -> None:
        n = len(sizes)
        if not 0 < n <= MAX_RANGES:
            raise TransferError(f"a range table holds 1 to {MAX_RANGES} ranges, got {n}")
        tiles = (sizes + (TILE_BYTES - 1)) >> TILE_SHIFT
        first = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(tiles, out=first[1:])
        if int(first[-1]) >= 2**32:
            raise TransferError(f"a range table of {int(sizes.sum())} B has more than 2**32 tiles")
        buf = np.zeros(PARAM_BYTES, dtype=np.uint8)
        buf[_SRC : _SRC + 8 * n] = srcs.astype("<u8").view(np.uint8)
        buf[_DST : _DST + 8 * n] = dsts.astype("<u8").view(np.uint8)
        buf[_SIZE : _SIZE + 8 * n] = sizes.astype("<u8").view(np.uint8)
        buf[_FIRST : _FIRST + 4 * (n + 1)] = first.astype("<u4").view(np.uint8)
        buf[_N : _N + 4] = np.array([n], dtype="<u4").view(np.uint8)
        self.buffer = buf
        self.tiles = int(first[-1])
        self.n = n

    def ranges(self) -> Iterator[tuple[int, int, int, int]]:
        """``(tile, dst, src, nbytes)`` per tile, as the kernel maps them (for a fake kernel)."""
        buf = self.buffer
        n = int(buf[_N : _N + 4].view("<u4")[0])
        srcs = buf[_SRC : _SRC + 8 * n].view("<u8")
        dsts = buf[_DST : _DST + 8 * n].view("<u8")
        sizes = buf[_SIZE : _SIZE + 8 * n].view("<u8")
        first = buf[_FIRST : _FIRST + 4 * (n + 1)].view("<u4")
        for tile in range(int(first[n])):
            i = int(np.searchsorted(first, tile, side="right")) - 1
            off = (tile - int(first[i])) << TILE_SHIFT
            nbytes = min(TILE_BYTES, int(sizes[i]) - off)
            yield tile, int(dsts[i]) + off, int(srcs[i]) + off, nbytes


def aligned(dsts: "np.ndarray", srcs: "np.ndarray", sizes: "np.ndarray") -> bool:
    """True when every address and size is a multiple of the kernel's 16-byte word."""
    return not bool(((dsts | srcs | sizes) & (WORD - 1)).any())


def range_tables(dsts: "np.ndarray", srcs: "np.ndarray", sizes: "np.ndarray") -> list[RangeTable]:
    """The launches for a batch (int64 arrays ``[n]``): ceil(n / `MAX_RANGES`) tables."""
    if not aligned(dsts, srcs, sizes):
        raise TransferError("the range-copy kernel moves 16-byte words: every address and size must be a multiple of 16")
    return [RangeTable(dsts[lo : lo + MAX_RANGES], srcs[lo : lo + MAX_RANGES], sizes[lo : lo + MAX_RANGES])
            for lo in range(0, len(sizes), MAX_RANGES)]


class RangeKernel(Protocol):
    """Launches the range-copy kernel on a stream. ``host_readable``: whether the kernel can read
    registered host memory at its host address (then H2D batches may use it)."""

    host_readable: bool

    def launch(self, table: RangeTable, stream: int) -> None: ...


class CudaRangeKernel:
    """The kernel compiled with NVRTC for ``device`` (an index; None: the current device) and
    loaded into its primary context. Raises `TransferError` naming what is missing (NVRTC, a
    driver that takes 28 KiB of parameters) when it cannot be built."""

    def __init__(self, cudart: Any, device: Optional[int] = None, shape: KernelShape = KernelShape()) -> None:
        try:
            from cuda.bindings import driver, nvrtc
        except ImportError as exc:
            raise TransferError(f"the range-copy kernel needs cuda-bindings' driver and nvrtc modules: {exc}") from exc
        self._driver = driver
        rt = cudart
        if device is None:
            err, device = rt.cudaGetDevice()[:2]
            _check_rt(rt, err, "cudaGetDevice")
        _check_rt(rt, rt.cudaSetDevice(device)[0], f"cudaSetDevice({device})")
        _check_rt(rt, rt.cudaFree(0)[0], "cudaFree(0) (make the primary context current)")
        attr = rt.cudaDeviceAttr
        major = _attribute(rt, attr.cudaDevAttrComputeCapabilityMajor, device)
        minor = _attribute(rt, attr.cudaDevAttrComputeCapabilityMinor, device)
        self.sm_count = _attribute(rt, attr.cudaDevAttrMultiProcessorCount, device)
        self.host_readable = bool(_attribute(rt, attr.cudaDevAttrCanUseHostPointerForRegisteredMem, device)
                                  and _attribute(rt, attr.cudaDevAttrUnifiedAddressing, device))
        self.device = device
        self.shape = shape
        image = _compile(nvrtc, shape.source(), f"sm_{major}{minor}")
        err, self._module = driver.cuModuleLoadData(image)
        _check_driver(driver, err, "cuModuleLoadData(range-copy kernel)")
        err, self._function = driver.cuModuleGetFunction(self._module, b"copy_ranges")
        _check_driver(driver, err, "cuModuleGetFunction(copy_ranges)")
        self._grid_max = self.sm_count * shape.blocks_per_sm

    def launch(self, table: RangeTable, stream: int) -> None:
        params = np.array([table.buffer.ctypes.data], dtype=np.uint64)
        grid = max(1, min(table.tiles, self._grid_max))
        (err,) = self._driver.cuLaunchKernel(self._function, grid, 1, 1, self.shape.threads, 1, 1, 0, stream,
                                             params.ctypes.data, 0)[:1]
        _check_driver(self._driver, err, f"cuLaunchKernel(copy_ranges, {table.n} ranges)")

    def __repr__(self) -> str:
        return f"CudaRangeKernel(device={self.device}, sms={self.sm_count}, host_readable={self.host_readable}, {self.shape})"


def _compile(nvrtc: Any, source: str, arch: str) -> bytes:
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"copy_ranges.cu", 0, [], [])
    _check_nvrtc(nvrtc, err, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[:1]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)[:2]
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise TransferError(f"NVRTC could not compile the range-copy kernel for {arch}: {log.decode(errors='replace').strip()}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)[:2]
        _check_nvrtc(nvrtc, err, "nvrtcGetCUBINSize")
        image = b" " * size
        _check_nvrtc(nvrtc, nvrtc.nvrtcGetCUBIN(prog, image)[0], "nvrtcGetCUBIN")
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _attribute(rt: Any, attr: Any, device: int) -> int:
    err, value = rt.cudaDeviceGetAttribute(attr, device)[:2]
    _check_rt(rt, err, f"cudaDeviceGetAttribute({attr})")
    return int(value)


def _check_rt(rt: Any, err: Any, what: str) -> None:
    if err != rt.cudaError_t.cudaSuccess:
        rt.cudaGetLastError()
        raise TransferError(f"{what} failed: {err}")


def _check_driver(driver: Any, err: Any, what: str) -> None:
    if err != driver.CUresult.CUDA_SUCCESS:
        raise TransferError(f"{what} failed: {err}")


def _check_nvrtc(nvrtc: Any, err: Any, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise TransferError(f"{what} failed: {err}")

