"""`MemcpyBatch`: a batch of copies through ``cudaMemcpyBatchAsync``, in a few calls.

The bindings convert a call's lists at about 1.4 us a copy before the driver sees any of it, so
a batch goes out as `_LEAD_COPIES` copies first (the engine starts while the rest converts), then
twice as many each call, at most ``max_batch``: each later call converts faster than the engine
drains the one before. The call's signature differs between bindings (12.8 also returns a
failing index, 13.x does not); it is read from the function's signature line. A driver that does
not support the call is reported once (`submit` returns where the caller's per-copy loop takes
over, after a synchronize in case anything went out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from cacheseek.errors import TransferError
from cacheseek.transfer.base import SubmitFailed
from cacheseek.transfer.batch import CopyBatch
from cacheseek.transfer.cuda_bindings import parameter_names

__all__ = ["MemcpyBatch"]

_UNSUPPORTED = ("cudaErrorNotSupported", "cudaErrorCallRequiresNewerDriver")
_LEAD_COPIES = 32  # the first call of a batch
_BATCH_13_PARAMS = ("dsts", "srcs", "sizes", "count", "attrs", "attrsIdxs", "numAttrs", "stream")


class MemcpyBatch:
    """``fn`` (the bindings' ``cudaMemcpyBatchAsync``) over ``cudart``; ``name(err)`` names an
    error, ``clear()`` clears the sticky last error, ``synchronize(stream)`` waits for a stream."""

    def __init__(self, cudart: Any, fn: Callable[..., Any], max_batch: int, *, name: Callable[[Any], str],
                 clear: Callable[[], None], synchronize: Callable[[int], None]) -> None:
        self._rt = cudart
        self._fn = fn
        self._params = parameter_names(fn)
        self.max_batch = max_batch
        err = cudart.cudaError_t
        self._ok = err.cudaSuccess
        self._unsupported = tuple(getattr(err, n) for n in _UNSUPPORTED if hasattr(err, n))
        self._name, self._clear, self._synchronize = name, clear, synchronize

    def calls(self, n: int) -> list[tuple[int, int]]:
        """``(lo, hi)`` of each call for ``n`` copies (module docstring)."""
        out, lo, size = [], 0, min(_LEAD_COPIES, self.max_batch)
        while lo < n:
            out.append((lo, min(n, lo + size)))
            lo, size = lo + size, min(2 * size, self.max_batch)
        return out

    def submit(self, batch: CopyBatch, stream: int) -> Optional[int]:
        """Submit ``batch`` on ``stream``; None when every copy went out, else the index of the
        first copy left to a per-copy loop (the driver does not support the call)."""
        dsts, srcs, sizes = batch.dsts.tolist(), batch.srcs.tolist(), batch.sizes.tolist()
        for lo, hi in self.calls(len(dsts)):
            if not self._call(dsts[lo:hi], srcs[lo:hi], sizes[lo:hi], stream, n_before=lo):
                return lo
        return None

    def _call(self, dsts: list, srcs: list, sizes: list, stream: int, *, n_before: int = 0) -> bool:
        """One cudaMemcpyBatchAsync; False when the driver does not support it (after a
        synchronize in case anything went out)."""
        rt = self._rt
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        values = {
            "dsts": dsts,
            "srcs": srcs,
            "sizes": sizes,
            "count": len(dsts),
            "attrs": [attr],
            "attrsIdxs": [0],
            "numAttrs": 1,
            "failIdx": None,
            "hStream": stream,
            "stream": stream,
        }
        ret = self._fn(*(values[n] for n in self._params or _BATCH_13_PARAMS))
        ret = ret if isinstance(ret, tuple) else (ret,)
        err = ret[0]
        if err == self._ok:
            return True
        self._clear()
        if err in self._unsupported:
            self._synchronize(stream)
            return False
        fail_idx = ret[1] if len(ret) > 1 else None
        where = f" at copy {n_before + int(fail_idx)}" if fail_idx is not None else ""
        raise SubmitFailed(
            -1,
            TransferError(
                f"cudaMemcpyBatchAsync of {len(dsts)} copies failed{where}: {self._name(err)}"
            ),
        )
