"""`CopyBatch` and `CopyCounters` alone: building batches as arrays, splitting them by direction,
and the per-direction totals a finished batch adds (no runtime, no memory)."""

from __future__ import annotations

import numpy as np
import pytest

from cacheseek.errors import TransferError
from cacheseek.transfer.batch import DIRECTIONS, CopyBatch, CopyDescriptor, Direction
from cacheseek.transfer.stats import CopyCounters, DirectionStats

H2D, D2H, H2H, D2D = Direction.H2D, Direction.D2H, Direction.H2H, Direction.D2D


def test_codes_index_directions():
    assert [d.code for d in DIRECTIONS] == [0, 1, 2, 3] and set(DIRECTIONS) == set(Direction)
    assert H2D.dst_on_device and not H2D.src_on_device and D2D.src_on_device and not H2H.dst_on_device


def test_of_broadcasts_a_scalar_source_and_size():
    batch = CopyBatch.of([0x100, 0x200, 0x300], 0x1000, 16, D2H)
    assert batch.srcs.tolist() == [0x1000] * 3 and batch.sizes.tolist() == [16] * 3
    assert batch.dsts.dtype == np.int64 and batch.codes.dtype == np.int8
    assert len(batch) == 3 and batch.nbytes == 48 and batch.direction(2) is D2H


def test_of_refuses_arrays_of_different_lengths():
    with pytest.raises(TransferError, match="differ in length: 2, 3, 2"):
        CopyBatch.of([1, 2], [1, 2, 3], [4, 4], H2D)


def test_from_descriptors_names_the_first_non_descriptor():
    good = CopyDescriptor(0x100, 0x200, 8, H2H)
    with pytest.raises(TransferError, match="descriptor 1 is a tuple"):
        CopyBatch.from_descriptors([good, (1, 2, 3, "h2h")])


def test_descriptors_round_trip_and_coerce_keeps_a_batch():
    descs = [CopyDescriptor(0x100, 0x200, 8, H2D), CopyDescriptor(0x300, 0x400, 16, D2D)]
    batch = CopyBatch.coerce(descs)
    assert batch.descriptors() == descs
    assert CopyBatch.coerce(batch) is batch


def test_concat_keeps_order_and_an_empty_concat_is_an_empty_batch():
    a = CopyBatch.of([0x100], [0x200], [8], H2D)
    b = CopyBatch.of([0x300, 0x400], [0x500, 0x600], [4, 4], D2H)
    both = CopyBatch.concat([a, b])
    assert both.dsts.tolist() == [0x100, 0x300, 0x400] and [both.direction(i) for i in range(3)] == [H2D, D2H, D2H]
    empty = CopyBatch.concat([])
    assert len(empty) == 0 and empty.nbytes == 0 and empty.by_direction() == {}


def test_by_direction_splits_bytes_and_copies():
    batch = CopyBatch.concat([
        CopyBatch.of([1, 2], [3, 4], [10, 20], H2D),
        CopyBatch.of([5], [6], [7], D2D),
        CopyBatch.of([8, 9, 10], [11, 12, 13], [1, 1, 1], H2D),
    ])
    assert batch.by_direction() == {H2D: (33, 5), D2D: (7, 1)}


def test_counters_split_a_mixed_batch_by_bytes():
    counters = CopyCounters()
    counters.add({H2D: (300, 3), D2H: (100, 1)}, 2.0)
    counters.add({H2D: (100, 1)}, 1.0)
    stats = counters.snapshot(n_registered=2, registered_bytes=4096, register_seconds=0.5)
    assert stats.h2d == DirectionStats(400, 2.5, 4) and stats.d2h == DirectionStats(100, 0.5, 1)
    assert stats.h2h == DirectionStats() and stats.batches == 2
    assert (stats.n_registered, stats.registered_bytes, stats.register_seconds) == (2, 4096, 0.5)
    assert stats.as_dict()["h2d_bytes"] == 400 and stats.direction(D2H).copies == 1


def test_an_empty_batch_counts_without_time():
    counters = CopyCounters()
    counters.add({}, 1.0)
    stats = counters.snapshot(n_registered=0, registered_bytes=0, register_seconds=0.0)
    assert stats.batches == 1 and all(stats.direction(d) == DirectionStats() for d in Direction)
