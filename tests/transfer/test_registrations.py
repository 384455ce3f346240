"""`RegistrationTable` alone: reference counts per (ptr, length, generation), the address index
validation reads, and the register/unregister callbacks (no runtime, no memory behind them)."""

from __future__ import annotations

import threading
import time

import pytest

from cacheseek.errors import RegistrationError, TransferError
from cacheseek.transfer.memory import HostMapping
from cacheseek.transfer.registrations import Registration, RegistrationTable


class Backend:
    """Records the callbacks; ``owned=False`` answers like "already registered elsewhere"."""

    def __init__(self, owned: bool = True) -> None:
        self.owned = owned
        self.registered: list[HostMapping] = []
        self.unregistered: list[Registration] = []
        self.fail_register: set[int] = set()  # ptrs whose registration raises
        self.fail_unregister: set[int] = set()

    def register_one(self, mapping: HostMapping) -> tuple[bool, bool]:
        if mapping.ptr in self.fail_register:
            raise RegistrationError(f"refused {mapping.ptr:#x}")
        self.registered.append(mapping)
        return self.owned, not mapping.writable

    def unregister_one(self, registration: Registration) -> None:
        self.unregistered.append(registration)
        if registration.mapping.ptr in self.fail_unregister:
            raise RegistrationError(f"cannot unregister {registration.mapping.ptr:#x}")


def m(ptr: int, length: int = 0x100, generation: int = 0, writable: bool = True) -> HostMapping:
    return HostMapping(ptr, length, generation, writable)


def test_counts_users_and_unregisters_on_the_last():
    table, be = RegistrationTable(), Backend()
    table.register([m(0x1000)], be.register_one)
    table.register([m(0x1000), m(0x1000)], be.register_one)
    assert be.registered == [m(0x1000)] and table.users(m(0x1000)) == 3
    table.unregister([m(0x1000)], be.unregister_one)
    table.unregister([m(0x1000)], be.unregister_one)
    assert be.unregistered == [] and table.registered() == [m(0x1000)] and table.users(m(0x1000)) == 1
    table.unregister([m(0x1000)], be.unregister_one)
    assert [r.mapping for r in be.unregistered] == [m(0x1000)]
    assert table.registered() == [] and table.users(m(0x1000)) == 0


def test_unknown_mapping_is_ignored_and_a_new_generation_is_a_new_registration():
    table, be = RegistrationTable(), Backend()
    table.unregister([m(0x1000)], be.unregister_one)
    table.register([m(0x1000, generation=0), m(0x1000, generation=1)], be.register_one)
    assert len(be.registered) == 2 and table.totals()[:2] == (2, 0x200)
    table.unregister([m(0x1000, generation=0)], be.unregister_one)
    assert table.registered() == [m(0x1000, generation=1)]


def test_a_registration_made_by_someone_else_is_never_undone():
    table, be = RegistrationTable(), Backend(owned=False)
    table.register([m(0x1000)], be.register_one)
    table.unregister([m(0x1000)], be.unregister_one)
    table.register([m(0x2000)], be.register_one)
    table.drop_all(be.unregister_one)
    assert be.unregistered == [] and table.registered() == []


def test_read_only_flag_comes_from_the_callback():
    table, be = RegistrationTable(), Backend()
    table.register([m(0x1000, writable=False)], be.register_one)
    (entry,) = table.index().entries
    assert entry[1].read_only and not entry[1].mapping.writable


def test_a_failed_registration_keeps_the_earlier_ones_and_can_be_retried():
    table, be = RegistrationTable(), Backend()
    be.fail_register.add(0x2000)
    with pytest.raises(RegistrationError, match="0x2000"):
        table.register([m(0x1000), m(0x2000), m(0x3000)], be.register_one)
    assert table.registered() == [m(0x1000)] and table.users(m(0x2000)) == 0
    be.fail_register.clear()
    table.register([m(0x2000)], be.register_one)  # not stuck as "being registered"
    assert table.registered() == [m(0x1000), m(0x2000)]


def test_register_takes_only_host_mappings():
    table, be = RegistrationTable(), Backend()
    with pytest.raises(TypeError, match="HostMapping"):
        table.register([(0x1000, 0x100, 0)], be.register_one)


def test_every_mapping_is_unregistered_before_the_first_error_is_raised():
    table, be = RegistrationTable(), Backend()
    table.register([m(0x1000), m(0x2000), m(0x3000)], be.register_one)
    be.fail_unregister.add(0x1000)
    with pytest.raises(RegistrationError, match="0x1000"):
        table.drop_all(be.unregister_one)
    assert len(be.unregistered) == 3 and table.registered() == []


def test_drop_all_ignores_the_counts():
    table, be = RegistrationTable(), Backend()
    table.register([m(0x1000)] * 3, be.register_one)
    table.drop_all(be.unregister_one)
    assert len(be.unregistered) == 1 and table.users(m(0x1000)) == 0


def test_concurrent_registrations_of_one_mapping_make_one_call():
    table, be = RegistrationTable(), Backend()
    release = threading.Event()
    calls = []

    def slow_register(mapping):
        calls.append(mapping)
        release.wait(5)
        return be.register_one(mapping)

    threads = [threading.Thread(target=table.register, args=([m(0x1000)], slow_register)) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # let the others reach the table while the first registers
    release.set()
    for t in threads:
        t.join(5)
    assert len(calls) == 1 and table.users(m(0x1000)) == 6


def test_index_is_sorted_and_a_snapshot():
    table, be = RegistrationTable(), Backend()
    table.register([m(0x3000), m(0x1000, writable=False), m(0x2000, length=0x80)], be.register_one)
    index = table.index()
    assert [p for p, _ in index.entries] == [0x1000, 0x2000, 0x3000]
    assert index.starts.tolist() == [0x1000, 0x2000, 0x3000]
    assert index.ends.tolist() == [0x1100, 0x2080, 0x3100]
    assert index.writable.tolist() == [False, True, True]
    table.unregister([m(0x2000, length=0x80)], be.unregister_one)
    assert index.starts.tolist() == [0x1000, 0x2000, 0x3000]  # the earlier snapshot is unchanged
    assert table.index().starts.tolist() == [0x1000, 0x3000]


def test_timings_and_totals():
    table, be = RegistrationTable(), Backend()
    table.register([m(0x1000), m(0x2000, length=0x40), m(0x1000)], be.register_one)
    assert [mapping for mapping, _ in table.timings()] == [m(0x1000), m(0x2000, length=0x40)]
    n, nbytes, seconds = table.totals()
    assert (n, nbytes) == (2, 0x140) and seconds == pytest.approx(sum(s for _, s in table.timings()))


def test_unregister_errors_other_than_transfer_errors_propagate_at_once():
    table, be = RegistrationTable(), Backend()
    table.register([m(0x1000), m(0x2000)], be.register_one)

    def boom(reg):
        raise KeyError("bug")

    with pytest.raises(KeyError):
        table.unregister([m(0x1000), m(0x2000)], boom)
    assert table.registered() == [m(0x2000)]
    assert issubclass(RegistrationError, TransferError)
