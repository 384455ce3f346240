"""`validate_batch` alone: which copies a batch may hold, given registered host mappings
(a `HostIndex`) and declared device ranges. Addresses are plain numbers: nothing is copied."""

from __future__ import annotations

import pytest

from cacheseek.errors import TransferError
from cacheseek.transfer.batch import CopyBatch, CopyDescriptor, Direction
from cacheseek.transfer.memory import HostMapping, MemoryRange
from cacheseek.transfer.registrations import HostIndex, Registration
from cacheseek.transfer.validation import validate_batch

H2D, D2H, H2H, D2D = Direction.H2D, Direction.D2H, Direction.H2H, Direction.D2D

HOST = HostMapping(0x10000, 0x1000, 0)  # writable
RO = HostMapping(0x20000, 0x1000, 0, writable=False)
DEV = MemoryRange(0x90000, 0x1000)


def hosts(*mappings: HostMapping) -> HostIndex:
    return HostIndex.of([Registration(mp, True, not mp.writable) for mp in mappings])


class DeviceProbe:
    """``is_device_memory``: records what it was asked; ``answer`` is its reply."""

    def __init__(self, answer: bool = False) -> None:
        self.answer = answer
        self.asked: list[tuple[int, int]] = []

    def __call__(self, ptr: int, nbytes: int) -> bool:
        self.asked.append((ptr, nbytes))
        return self.answer


def check(copies, *, index=None, devices=(DEV,), probe=None):
    batch = copies if isinstance(copies, CopyBatch) else CopyBatch.from_descriptors(copies)
    validate_batch(batch, index if index is not None else hosts(HOST, RO), devices, probe or DeviceProbe())


def test_a_valid_mixed_batch_passes_without_asking_about_device_memory():
    probe = DeviceProbe()
    check([
        CopyDescriptor(DEV.ptr, HOST.ptr, 64, H2D),
        CopyDescriptor(HOST.ptr + 64, DEV.ptr + 64, 64, D2H),
        CopyDescriptor(HOST.ptr + 128, RO.ptr, 64, H2H),
        CopyDescriptor(DEV.ptr + 128, DEV.ptr + 512, 64, D2D),
    ], probe=probe)
    assert probe.asked == []


def test_a_large_batch_is_checked_as_arrays():
    n = 4096
    dsts = [DEV.ptr + i for i in range(n)]
    check(CopyBatch.of(dsts, [HOST.ptr + i for i in range(n)], 1, H2D))


def test_empty_batch_passes():
    check(CopyBatch.of([], [], [], H2D), index=hosts(), devices=())


def test_non_positive_sizes_and_addresses_are_named():
    batch = CopyBatch.of([DEV.ptr, DEV.ptr + 64], [HOST.ptr, HOST.ptr], [64, 0], H2D)
    with pytest.raises(TransferError, match=r"descriptor 1: .* 0 B: addresses and size must be positive"):
        check(batch)


def test_a_source_outside_every_mapping_is_named():
    with pytest.raises(TransferError, match=r"descriptor 1 \(h2d\): src \[0x10fc1, \+64\) is not inside a registered host mapping"):
        check([CopyDescriptor(DEV.ptr, HOST.ptr, 64, H2D), CopyDescriptor(DEV.ptr + 64, HOST.ptr + HOST.length - 63, 64, H2D)])


def test_a_read_only_mapping_is_not_a_destination():
    with pytest.raises(TransferError, match="dst .* is not inside a writable registered host mapping"):
        check([CopyDescriptor(RO.ptr, DEV.ptr, 64, D2H)])


def test_an_undeclared_device_range_asks_the_runtime():
    copy = [CopyDescriptor(HOST.ptr, 0x50000, 64, D2H)]
    with pytest.raises(TransferError, match="src .* is not inside a declared device range"):
        check(copy, probe=DeviceProbe(False))
    probe = DeviceProbe(True)
    check(copy, probe=probe)
    assert probe.asked == [(0x50000, 64)]


def test_a_direction_that_contradicts_the_memory_fails():
    with pytest.raises(TransferError, match=r"\(h2d\): src .* not inside a registered host mapping"):
        check([CopyDescriptor(DEV.ptr, DEV.ptr + 512, 64, H2D)])  # a device source called host


def test_overlapping_destinations_fail():
    with pytest.raises(TransferError, match=f"overlap at destination {DEV.ptr + 32:#x}"):
        check([CopyDescriptor(DEV.ptr, HOST.ptr, 64, H2D), CopyDescriptor(DEV.ptr + 32, HOST.ptr, 64, H2D)])


def test_adjacent_destinations_and_shared_sources_pass():
    check([CopyDescriptor(DEV.ptr, HOST.ptr, 64, H2D), CopyDescriptor(DEV.ptr + 64, HOST.ptr, 64, H2D)])


def test_a_copy_inside_an_earlier_of_two_overlapping_mappings_passes():
    big = HostMapping(0x10000, 0x4000, 0)
    small = HostMapping(0x11000, 0x100, 1)  # starts later, so it is the nearest start for 0x12000
    check([CopyDescriptor(DEV.ptr, 0x12000, 64, H2D)], index=hosts(big, small))
    with pytest.raises(TransferError):
        check([CopyDescriptor(DEV.ptr, 0x12000, 64, H2D)], index=hosts(small))


def test_device_ranges_built_once_validate_like_the_list_they_hold():
    """A `DeviceRanges` (sorted once, reused across batches) admits and refuses exactly what its
    list of ranges does, and names the same descriptor."""
    from cacheseek.transfer.memory import DeviceRanges

    other = MemoryRange(0x80000, 0x100)
    declared = DeviceRanges.of([DEV, other])
    assert [r.ptr for r in declared] == [other.ptr, DEV.ptr] and DeviceRanges.of(declared) is declared
    good = [CopyDescriptor(DEV.ptr, HOST.ptr, 64, H2D), CopyDescriptor(other.ptr, HOST.ptr + 64, 0x100, H2D)]
    check(good, devices=declared)
    bad = good + [CopyDescriptor(other.ptr + 0x80, HOST.ptr + 512, 0x100, H2D)]  # runs past `other`
    for devices in (declared, [DEV, other]):
        with pytest.raises(TransferError, match="descriptor 2 .*not inside a declared device range"):
            check(bad, devices=devices)
