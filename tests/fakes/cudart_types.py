"""The cuda-bindings ``cudart`` value types that `FakeCudart` answers with: error codes, copy
kinds, memory types, batch-copy attributes and the flag constants, spelled and numbered as
``cuda.bindings.runtime`` spells them (so code under test cannot tell them apart)."""

from __future__ import annotations

import enum

__all__ = [
    "cudaError_t",
    "cudaMemcpyKind",
    "cudaMemoryType",
    "cudaMemcpySrcAccessOrder",
    "cudaMemcpyFlags",
    "cudaMemcpyAttributes",
    "cudaPointerAttributes",
    "cudaHostRegisterDefault",
    "cudaHostRegisterPortable",
    "cudaHostRegisterMapped",
    "cudaHostRegisterReadOnly",
    "cudaStreamDefault",
    "cudaStreamNonBlocking",
    "cudaEventDefault",
    "cudaEventDisableTiming",
]

cudaHostRegisterDefault = 0
cudaHostRegisterPortable = 1
cudaHostRegisterMapped = 2
cudaHostRegisterReadOnly = 8
cudaStreamDefault = 0
cudaStreamNonBlocking = 1
cudaEventDefault = 0
cudaEventDisableTiming = 2


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevicePointer = 17
    cudaErrorInvalidResourceHandle = 400
    cudaErrorNotReady = 600
    cudaErrorCallRequiresNewerDriver = 36
    cudaErrorIllegalAddress = 700
    cudaErrorHostMemoryAlreadyRegistered = 712
    cudaErrorHostMemoryNotRegistered = 713
    cudaErrorLaunchFailure = 719
    cudaErrorNotSupported = 801
    cudaErrorUnknown = 999


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class cudaMemoryType(enum.IntEnum):
    cudaMemoryTypeUnregistered = 0
    cudaMemoryTypeHost = 1
    cudaMemoryTypeDevice = 2
    cudaMemoryTypeManaged = 3


class cudaMemcpySrcAccessOrder(enum.IntEnum):
    cudaMemcpySrcAccessOrderInvalid = 0
    cudaMemcpySrcAccessOrderStream = 1
    cudaMemcpySrcAccessOrderDuringApiCall = 2
    cudaMemcpySrcAccessOrderAny = 3


class cudaMemcpyFlags(enum.IntEnum):
    cudaMemcpyFlagDefault = 0
    cudaMemcpyFlagPreferOverlapWithCompute = 1


class cudaMemcpyAttributes:
    def __init__(self) -> None:
        self.srcAccessOrder = cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderInvalid
        self.flags = cudaMemcpyFlags.cudaMemcpyFlagDefault
        self.srcLocHint = None
        self.dstLocHint = None


class cudaPointerAttributes:
    def __init__(self, type: cudaMemoryType, device: int = 0) -> None:
        self.type = type
        self.device = device
        self.devicePointer = 0
        self.hostPointer = 0
