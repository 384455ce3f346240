"""A mapping registered in pieces (`RegistrationTable` with ``piece_bytes``, `HostMapping.pieces`)
and the cut of copies at the joints between registrations (`split_at_joints`). No memory behind
the addresses: the bookkeeping and the arrays only."""

from __future__ import annotations

import numpy as np
import pytest

from cacheseek.errors import RegistrationError
from cacheseek.transfer.batch import CopyBatch, CopyDescriptor, Direction
from cacheseek.transfer.joints import split_at_joints
from cacheseek.transfer.memory import HostMapping
from cacheseek.transfer.registrations import HostIndex, Registration, RegistrationTable

P = 0x1000  # one piece (a page)
BASE = 0x100000


class Backend:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail_register: set[int] = set()

    def register_one(self, mapping: HostMapping) -> tuple[bool, bool]:
        self.calls.append(("register", mapping.ptr))
        if mapping.ptr in self.fail_register:
            raise RegistrationError(f"refused {mapping.ptr:#x}")
        return True, not mapping.writable

    def unregister_one(self, registration: Registration) -> None:
        self.calls.append(("unregister", registration.mapping.ptr))


def seg(length: int = 4 * P, generation: int = 1) -> HostMapping:
    return HostMapping(BASE, length, generation)


def registered(be: Backend) -> set[int]:
    live: set[int] = set()
    for op, ptr in be.calls:
        (live.add if op == "register" else live.discard)(ptr)
    return live - be.fail_register


def test_pieces_are_consecutive_and_the_last_is_shorter():
    m = HostMapping(BASE, 3 * P + 100, 2, writable=False)
    pieces = m.pieces(P)
    assert [(p.ptr - BASE, p.length) for p in pieces] == [(0, P), (P, P), (2 * P, P), (3 * P, 100)]
    assert all(p.generation == 2 and not p.writable for p in pieces)
    assert m.pieces(0) == m.pieces(None) == m.pieces(8 * P) == (m,)
    for bad in (100, -P, 1.5):
        with pytest.raises(ValueError, match="piece_bytes"):
            m.pieces(bad)


def test_a_mapping_in_pieces_is_one_user_and_every_piece_is_undone_on_the_last_unregister():
    table, be = RegistrationTable(), Backend()
    kw = dict(unregister_one=be.unregister_one, piece_bytes=P)
    table.register([seg()], be.register_one, **kw)
    table.register([seg()], be.register_one, **kw)  # a second user: no driver call
    assert [c for c in be.calls if c[0] == "register"] == [("register", BASE + i * P) for i in range(4)]
    assert table.users(seg()) == 2 and table.registered() == [seg()]
    assert table.totals()[:2] == (1, 4 * P) and table.n_pieces() == 4
    assert [m.length for m in table.pieces(seg())] == [P] * 4
    assert len(table.timings()) == 1  # one entry per mapping, the sum of its pieces
    index = table.index()
    assert len(index.entries) == 4 and index.joints.tolist() == [BASE + P, BASE + 2 * P, BASE + 3 * P]
    table.unregister([seg()], be.unregister_one)
    assert registered(be) == {BASE + i * P for i in range(4)}
    table.unregister([seg()], be.unregister_one)
    assert registered(be) == set() and table.registered() == [] and table.n_pieces() == 0
    assert len(table.index().joints) == 0


def test_hooks_run_before_each_piece_and_between_pieces():
    table, be = RegistrationTable(), Backend()
    order: list[tuple[str, int]] = []
    table.register([seg(3 * P)], lambda m: (order.append(("register", m.ptr)), be.register_one(m))[1],
                   unregister_one=be.unregister_one, piece_bytes=P,
                   before_piece=lambda m: order.append(("fault", m.ptr)),
                   after_piece=lambda m: order.append(("pause", m.ptr)))
    steps = [(what, (ptr - BASE) // P) for what, ptr in order]
    assert steps == [("fault", 0), ("register", 0), ("pause", 0), ("fault", 1), ("register", 1), ("pause", 1),
                     ("fault", 2), ("register", 2)]


def test_a_failing_middle_piece_leaves_nothing_registered_and_names_the_piece_and_the_fix():
    table, be = RegistrationTable(), Backend()
    be.fail_register.add(BASE + 2 * P)
    with pytest.raises(RegistrationError, match=r"piece 2 .*register_piece_bytes") as info:
        table.register([seg()], be.register_one, unregister_one=be.unregister_one, piece_bytes=P)
    assert "refused" in str(info.value) and "2 piece(s) before it were unregistered" in str(info.value)
    assert ("unregister", BASE) in be.calls and ("unregister", BASE + P) in be.calls
    assert registered(be) == set()
    assert table.registered() == [] and table.users(seg()) == 0 and table.n_pieces() == 0
    assert len(table.index().entries) == 0
    be.fail_register.clear()  # the mapping can be registered again
    table.register([seg()], be.register_one, unregister_one=be.unregister_one, piece_bytes=P)
    assert table.n_pieces() == 4


def test_a_failing_fault_hook_undoes_the_pieces_before_it():
    table, be = RegistrationTable(), Backend()

    def fault(m: HostMapping) -> None:
        if m.ptr == BASE + 3 * P:
            raise OSError(12, "Cannot allocate memory")

    with pytest.raises(RegistrationError, match="piece 3"):
        table.register([seg()], be.register_one, unregister_one=be.unregister_one, piece_bytes=P, before_piece=fault)
    assert registered(be) == set() and table.registered() == []


def test_in_pieces_needs_the_undo_callback():
    with pytest.raises(TypeError, match="unregister_one"):
        RegistrationTable().register([seg()], Backend().register_one, piece_bytes=P)


# -- split_at_joints --------------------------------------------------------------------------------


def index_of(*ranges: tuple[int, int]) -> HostIndex:
    return HostIndex.of([Registration(HostMapping(p, n, 1), True, False) for p, n in ranges])


PIECES = index_of((BASE, P), (BASE + P, P), (BASE + 2 * P, P))  # joints at +P and +2P
DEV = 0x9000000


def cut(batch: list[CopyDescriptor], index: HostIndex = PIECES) -> list[tuple]:
    out = split_at_joints(CopyBatch.from_descriptors(batch), index)
    return [(d.dst, d.src, d.nbytes, d.direction) for d in out.descriptors()]


def test_nothing_is_cut_without_joints_or_crossings_and_the_same_batch_comes_back():
    apart = index_of((BASE, P), (BASE + 2 * P, P))  # not touching: no joint
    assert len(apart.joints) == 0
    batch = CopyBatch.from_descriptors([CopyDescriptor(DEV, BASE + 10, 100, Direction.H2D)])
    assert split_at_joints(batch, apart) is batch
    inside = CopyBatch.from_descriptors([CopyDescriptor(DEV, BASE + P, P, Direction.H2D),
                                         CopyDescriptor(BASE, DEV, P, Direction.D2H)])
    assert split_at_joints(inside, PIECES) is inside  # ends exactly at a joint: not crossing


def test_a_host_source_over_a_joint_is_cut_in_order_with_the_device_side_offset():
    got = cut([CopyDescriptor(DEV, BASE, 8, Direction.H2D),
               CopyDescriptor(DEV + 100, BASE + P - 16, 48, Direction.H2D),
               CopyDescriptor(DEV + 200, BASE + 50, 8, Direction.H2D)])
    assert got == [(DEV, BASE, 8, Direction.H2D),
                   (DEV + 100, BASE + P - 16, 16, Direction.H2D), (DEV + 116, BASE + P, 32, Direction.H2D),
                   (DEV + 200, BASE + 50, 8, Direction.H2D)]


def test_a_copy_over_two_joints_becomes_three_and_a_host_destination_is_cut_too():
    got = cut([CopyDescriptor(BASE + P - 4, DEV, P + 8, Direction.D2H)])
    assert got == [(BASE + P - 4, DEV, 4, Direction.D2H), (BASE + P, DEV + 4, P, Direction.D2H),
                   (BASE + 2 * P, DEV + P + 4, 4, Direction.D2H)]


def test_h2h_is_cut_where_either_side_crosses_and_device_sides_never():
    got = cut([CopyDescriptor(BASE + 2 * P - 10, BASE + P - 4, 20, Direction.H2H),
               CopyDescriptor(BASE + P - 4, BASE + P - 4, 8, Direction.D2D)])  # "device" addresses: kept
    assert got == [(BASE + 2 * P - 10, BASE + P - 4, 4, Direction.H2H),
                   (BASE + 2 * P - 6, BASE + P, 6, Direction.H2H),
                   (BASE + 2 * P, BASE + P + 6, 10, Direction.H2H),
                   (BASE + P - 4, BASE + P - 4, 8, Direction.D2D)]


def test_the_cut_keeps_every_byte_once():
    rng = np.random.default_rng(0)
    srcs = BASE + rng.integers(0, 2 * P, 200)
    sizes = rng.integers(1, P, 200)
    batch = CopyBatch.of(DEV + np.arange(200) * 2 * P, srcs, sizes, Direction.H2D)
    out = split_at_joints(batch, PIECES)
    assert out.nbytes == batch.nbytes and len(out) > len(batch)
    joints = PIECES.joints
    inner = np.searchsorted(joints, out.srcs + out.sizes, "left") - np.searchsorted(joints, out.srcs, "right")
    assert not inner.any()  # no piece crosses a joint any more
    assert np.all(out.dsts - out.srcs == np.repeat(batch.dsts - batch.srcs, np.bincount(
        np.searchsorted(np.cumsum(batch.sizes), np.cumsum(out.sizes), "left"), minlength=len(batch))))
