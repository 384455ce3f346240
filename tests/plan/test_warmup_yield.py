"""A background warm-up yields to session start-up (issue 14): it begins by waiting for the first
session's start-up (ended by that session, `wait_ready`, `close`, or after ``warmup_yield_s``);
while a session is starting (`session_starting`, taken by the binding) the warm-up registers no
further piece; it resumes once the token is released, and a token never released holds it at most
``warmup_yield_s``. A tiered store is ready while any level is, and its token holds every warming
level."""

from __future__ import annotations

import threading
import time

import pytest

from cacheseek.errors import ConfigError
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.stores.memory import InMemoryTierStore
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.stores.startup import NO_TOKEN, SessionStarts, StartToken, combine
from cacheseek.stores.tiered import TieredStore
from cacheseek.transfer.host_transfer import HostTransferRuntime

MiB = 1 << 20


def eventually(check, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.005)
    return check()


# -- the gate --------------------------------------------------------------------------------------

def test_wait_clear_blocks_while_a_start_is_held_and_returns_when_it_ends():
    starts = SessionStarts(yield_s=30)
    assert starts.wait_clear() == 0.0
    token = starts.begin()
    assert starts.starting == 1
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(starts.wait_clear()))
    t.start()
    assert eventually(lambda: starts.waiting == 1)
    assert waited == []  # still held
    token.release()
    token.release()  # idempotent
    t.join(5)
    assert not t.is_alive() and waited[0] > 0 and starts.starting == 0 and starts.expired == 0


def test_a_start_never_released_expires_after_yield_s():
    starts = SessionStarts(yield_s=0.2)
    starts.begin()  # leaked
    t0 = time.monotonic()
    assert 0.15 <= starts.wait_clear() < 5 and time.monotonic() - t0 < 5
    assert starts.expired == 1 and starts.starting == 0 and starts.wait_clear() == 0.0


def test_combine_releases_every_token_and_yield_s_zero_holds_nothing():
    a, b = SessionStarts(30), SessionStarts(30)
    with combine([a.begin(), NO_TOKEN, b.begin()]):
        assert (a.starting, b.starting) == (1, 1)
    assert (a.starting, b.starting) == (0, 0)
    assert combine([NO_TOKEN]) is NO_TOKEN and SessionStarts(0).begin() is NO_TOKEN
    assert isinstance(a.begin(), StartToken)


# -- the Plan tier ---------------------------------------------------------------------------------

@pytest.fixture
def held_fault(monkeypatch):
    """The warm-up's first piece fault waits for ``go`` (``reached`` is set when it is there)."""
    reached, go = threading.Event(), threading.Event()
    original = EmbeddedPlanClient.fault_local_range
    first = [True]

    def fault_local_range(self, ptr, length):
        if first[0]:
            first[0] = False
            reached.set()
            assert go.wait(10)
        original(self, ptr, length)

    monkeypatch.setattr(EmbeddedPlanClient, "fault_local_range", fault_local_range)
    yield reached, go
    go.set()


def test_the_warm_up_registers_no_piece_while_a_session_is_starting_then_resumes(make_store, held_fault):
    reached, go = held_fault
    store, parts = make_store("fake_cuda", segment_bytes=12 * MiB, register_piece_bytes="2MiB",
                              warmup="background", warmup_yield_s=30)
    fake = parts["fake"]
    store.session_starting().release()  # the first session's start-up: the warm-up begins
    assert reached.wait(10)
    yields = store.stats.warmup_yields
    token = store.session_starting()  # a session starts while piece 0 is being faulted
    go.set()
    assert eventually(lambda: store.starts.waiting == 1)  # the warm-up waits before piece 1
    assert len(fake.calls_named("cudaHostRegister")) == 1 and not store.ready
    token.release()
    assert store.wait_ready(30)
    assert len(fake.calls_named("cudaHostRegister")) == 6
    stats = store.stats
    assert stats.warmup_yields == yields + 1 and stats.warmup_yield_seconds > 0 and stats.register_pieces == 6
    assert store.session_starting() is NO_TOKEN  # warm: nothing to yield any more


def test_a_token_never_released_holds_the_warm_up_at_most_warmup_yield_s(make_store, held_fault):
    reached, go = held_fault
    store, _ = make_store("fake_cuda", segment_bytes=6 * MiB, register_piece_bytes="2MiB",
                          warmup="background", warmup_yield_s=0.3)
    assert reached.wait(10)  # no session came: the first-start wait expired after 0.3 s
    before = store.stats
    assert before.warmup_yields == 1 and 0.25 <= before.warmup_yield_seconds < 5
    store.session_starting()  # a binding made and never used
    go.set()
    assert eventually(lambda: store.ready, 10)
    after = store.stats
    assert after.warmup_yields == 2 and 0.25 <= after.warmup_yield_seconds - before.warmup_yield_seconds < 5


def test_a_background_warm_up_begins_after_the_first_session_start_up(make_store, monkeypatch):
    """Nothing of the warm-up (not even its transfer runtime or its segment) runs while the first
    session starts; the session's release starts it, and `wait_ready` does too."""
    from cacheseek.stores.plan_tier.segments import TransferLink

    started = threading.Event()
    original = TransferLink.warm_up
    monkeypatch.setattr(TransferLink, "warm_up", lambda self, device: (started.set(), original(self, device))[1])
    store, parts = make_store("fake_cuda", segment_bytes=4 * MiB, register_piece_bytes="2MiB",
                              warmup="background", warmup_yield_s=30)
    assert started.wait(10)  # the thread runs, and waits at the first step
    assert eventually(lambda: store.starts.waiting == 1)
    token = store.session_starting()  # the first session: its start-up ends the first wait too
    time.sleep(0.05)
    assert parts["fake"].calls_named("cudaHostRegister") == [] and not store.ready
    token.release()
    assert store.wait_ready(10) and len(parts["fake"].calls_named("cudaHostRegister")) == 2
    idle, _ = make_store("fake_cuda", segment_bytes=4 * MiB, register_piece_bytes="2MiB",
                         warmup="background", warmup_yield_s=30)
    t0 = time.monotonic()
    assert idle.wait_ready(10) and time.monotonic() - t0 < 5  # wait_ready: no session to wait for


def test_a_foreground_store_hands_out_no_token_and_a_bad_yield_is_refused():
    client = EmbeddedPlanClient(segment_bytes=1 << 20, prefault_threads=1)
    try:
        store = PlanTierStore(plan_client=client, transfer=HostTransferRuntime(), overlap=False)
        assert store.ready and store.session_starting() is NO_TOKEN
        store.close()
        with pytest.raises(ConfigError, match="store.warmup_yield_s"):
            PlanTierStore(plan_client=client, transfer=HostTransferRuntime(), overlap=False, warmup_yield_s=-1)
    finally:
        client.close()


def test_a_tiered_store_is_ready_while_any_level_is_and_its_token_holds_every_warming_level(gated):
    plan, client = gated()
    memory = InMemoryTierStore()
    try:
        alone = TieredStore(stores=[("fluxon_plan", plan)])
        both = TieredStore(stores=[("memory", memory), ("fluxon_plan", plan)])
        assert not plan.ready and not alone.ready and both.ready  # memory has no warm-up: it serves
        assert plan.starts.starting == 1  # the wait for a first session
        with both.session_starting():
            assert plan.starts.starting == 2
        assert plan.starts.starting == 0
        client.gate.set()
        assert plan.wait_ready(10) and alone.ready and alone.session_starting() is NO_TOKEN
    finally:
        memory.close()


def test_the_warm_up_yields_at_most_total_s_in_all_and_close_ends_every_wait():
    starts = SessionStarts(yield_s=30, total_s=0.2)
    starts.begin()  # back-to-back starts would each hold it; the total bounds them
    assert 0.15 <= starts.wait_clear() < 5
    starts.begin()
    assert starts.wait_clear() == 0.0  # its budget is spent
    closing = SessionStarts(yield_s=30)
    closing.begin()
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(closing.wait_clear()))
    t.start()
    assert eventually(lambda: closing.waiting == 1)
    closing.close()
    t.join(5)
    assert not t.is_alive() and waited[0] < 5
    assert closing.begin() is NO_TOKEN and closing.wait_clear() == 0.0


def test_close_does_not_wait_for_a_session_token_never_released(gated):
    store, client = gated()
    store.session_starting()  # a binding made and never used (the store yields up to 2 s to it)
    client.gate.set()
    t0 = time.monotonic()
    store.close()
    assert time.monotonic() - t0 < 1.5


def test_a_tiered_store_waits_for_every_level_and_releases_taken_tokens_on_failure(gated):
    plan, client = gated()

    class Failing(InMemoryTierStore):
        def session_starting(self):
            raise RuntimeError("no token")

    failing = Failing()
    try:
        tiered = TieredStore(stores=[("fluxon_plan", plan), ("memory", failing)])
        with pytest.raises(RuntimeError, match="no token"):
            tiered.session_starting()
        assert plan.starts.starting == 0  # the plan level's token (and the first-start one) released
        assert not tiered.wait_ready(0.05)
        client.gate.set()
        assert tiered.wait_ready(10) and plan.ready
    finally:
        failing.close()
