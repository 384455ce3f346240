"""The public Fluxon Plan client's per-plan calls, alone, over fakes: a commit's per-key codes
and when it stops issuing, and a get's transferable prefix. No Fluxon, no torch."""

from __future__ import annotations

import pytest

from cacheseek.errors import PlanError, StoreClosedError, StoreError, StoreFullError, StoreTimeoutError
from cacheseek.fluxon.errors import FluxonValueTooLargeError
from cacheseek.plan.base import SegmentMapping
from cacheseek.plan.fluxon_calls import CommitOutcome, PutKeyCode, fetch_prefix, put_code, release_all
from cacheseek.plan.pipeline import run_in_order


def inline(n, call, settle, stop, *, limit=None):
    run_in_order(n, call, settle, stop, width=1, limit=limit)


def test_put_codes_name_the_cause():
    assert put_code(FluxonValueTooLargeError("x")) is PutKeyCode.TOO_LARGE
    assert put_code(StoreFullError("x")) is PutKeyCode.STORE_FULL
    assert put_code(StoreTimeoutError("x")) is PutKeyCode.TIMEOUT
    assert put_code(StoreClosedError("x")) is PutKeyCode.CLOSED
    assert put_code(StoreError("x")) is PutKeyCode.FAILED
    assert put_code(RuntimeError("x")) is PutKeyCode.FAILED


def test_a_commit_reports_every_key_and_names_at_most_three_failures():
    keys = [f"k{i}" for i in range(6)]
    outcome = CommitOutcome(keys)

    def put(i):
        if i % 2:
            raise StoreFullError(f"full {i}")

    outcome.run(inline, put)
    result = outcome.result()
    assert result.status == 0 and not result.ok and not outcome.stuck
    assert result.key_codes == (0, 6000, 0, 6000, 0, 6000)
    assert result.message.startswith("3 of 6 puts failed: k1: full 1; k3: full 3; k5: full 5")
    all_ok = CommitOutcome(keys)
    all_ok.run(inline, lambda i: None)
    assert all_ok.result().ok and all_ok.result().message == ""


@pytest.mark.parametrize("error, code, stuck", [(StoreTimeoutError("slow"), PutKeyCode.TIMEOUT, True),
                                                (StoreClosedError("gone"), PutKeyCode.CLOSED, False)])
def test_after_a_timeout_or_a_close_no_further_put_is_issued(error, code, stuck):
    issued = []
    outcome = CommitOutcome(["a", "b", "c", "d"])

    def put(i):
        issued.append(i)
        if i == 1:
            raise error

    outcome.run(inline, put)
    assert issued == [0, 1] and outcome.stuck is stuck
    assert outcome.result().key_codes == (0, int(code), 3, 3)  # the rest NOT_ATTEMPTED


def test_a_commit_that_fails_before_its_first_put():
    outcome = CommitOutcome(["a", "b"])
    outcome.failed(StoreClosedError("no staging"))
    result = outcome.result()
    assert result.key_codes == (3, 3) and "commit failed: StoreClosedError: no staging" in result.message
    assert not outcome.stuck
    outcome.failed(StoreTimeoutError("late"))
    assert outcome.stuck


class View:
    def __init__(self, key, ptr, nbytes=16, zero_copy=True):
        self.key, self.ptr, self.nbytes, self.zero_copy = key, ptr, nbytes, zero_copy
        self.released = False

    def release(self):
        assert not self.released, "released twice"
        self.released = True


OWNER = SegmentMapping(0x10000, 0x10000, 1, False)


def fake_store(present, *, foreign=()):
    made = {}

    def get_view(key):
        if key not in present:
            return None
        made[key] = View(key, 0x40000 if key in foreign else OWNER.ptr + 64 * len(made))
        return made[key]

    return get_view, made


def test_the_prefix_is_the_leading_whole_groups_and_the_rest_is_released():
    keys = ("a", "b", "c", "d", "e")
    get_view, made = fake_store({"a", "b", "c", "e"})  # d missing: its group (c, d) is cut
    views = fetch_prefix(keys, (2, 2, 1), get_view, OWNER, inline)
    assert [v.key for v in views] == ["a", "b"] and not any(v.released for v in views)
    assert made["c"].released  # fetched, beyond the prefix: released at once
    assert "e" not in made  # never asked: issuing stopped at the cut
    release_all(views)
    assert all(v.released for v in made.values())
    get_view, _ = fake_store(set())
    assert fetch_prefix(keys, (5,), get_view, OWNER, inline) == []


def test_a_value_that_is_not_a_zero_copy_view_into_the_owner_is_refused():
    get_view, made = fake_store({"a", "b"}, foreign={"b"})
    with pytest.raises(PlanError, match=r"fluxon value 'b' \(16 B at 0x40000\) is not a zero-copy view"):
        fetch_prefix(("a", "b"), (1, 1), get_view, OWNER, inline)
    assert all(v.released for v in made.values())  # nothing is left held


def test_a_failed_get_releases_everything_before_it_raises():
    made = []

    def get_view(key):
        if key == "c":
            raise StoreTimeoutError("fluxon get of key 'c' did not complete")
        made.append(View(key, OWNER.ptr + 64 * len(made)))
        return made[-1]

    with pytest.raises(StoreTimeoutError):
        fetch_prefix(("a", "b", "c"), (1, 1, 1), get_view, OWNER, inline)
    assert len(made) == 2 and all(v.released for v in made)
