"""Issue 23 item 4: a persistent LocalDisk root keeps its own forest snapshot.

`build_stack` loads ``{root}/forest.json`` and `Stack.close` saves it, so a second stack on the
root hits what the first committed and its reconcile removes nothing committed; a second stack
on a root in use is refused with one `ConfigError` naming ``store.root`` and the holder, and the
first's values stay. The CLI's side (two runs, a run beside a holder) is tests/test_cli.py.
"""

from __future__ import annotations

import pytest

from cacheseek.errors import ConfigError
from cacheseek.orchestrator import build_stack
from cacheseek.stores.localdisk import LocalDiskTierStore

from prodkit import check_invariants


def _values(root) -> set[str]:
    store = LocalDiskTierStore(root)
    try:
        return set(store.keys())
    finally:
        store.close()


def _gate(stack):
    results = stack.workload.run(stack)
    return {r["name"]: r for r in results["requests"]}, results


def test_a_second_stack_on_the_root_hits_what_the_first_committed(compose_cfg, tmp_path):
    root = tmp_path / "kv"
    cfg = compose_cfg("+store=localdisk", f"store.root={root}")
    first = build_stack(cfg, run_dir=tmp_path)
    try:
        rows, results = _gate(first)
        assert results["passed"] and not results["warm"] and rows["A"]["hit_depth"] == 0
    finally:
        first.close()
    committed = _values(root)
    assert committed and (root / "forest.json").is_file()

    second = build_stack(cfg, run_dir=tmp_path)
    try:
        assert set(second.store.keys()) == committed  # its reconcile removed nothing committed
        assert any("committed chunks from a previous run" in n for n in second.notes)
        rows, results = _gate(second)
        n = cfg.workload.total_chunks
        assert results["warm"] and results["passed"], results["verdicts"]
        assert rows["A"]["hit_depth"] == n and rows["A"]["frames"] == "ok"  # == R, a cold run
        assert rows["R"]["hit_depth"] == 0 and rows["A"]["expect"].startswith("K>=0 (warm)")
        assert rows["C"]["hit_depth"] == n  # the first run's C wrote all of P+Y
        assert check_invariants(second.forest, second.store.keys()) == []
    finally:
        second.close()


def test_a_second_stack_on_a_root_in_use_is_refused_and_wipes_nothing(compose_cfg, tmp_path):
    root = tmp_path / "kv"
    cfg = compose_cfg("+store=localdisk", f"store.root={root}")
    first = build_stack(cfg, run_dir=tmp_path)
    try:
        _gate(first)
        before = set(first.store.keys())
        with pytest.raises(ConfigError) as err:
            build_stack(cfg, run_dir=tmp_path)
        assert err.value.field == "store.root" and str(root) in str(err.value)
        assert "in use" in str(err.value) and "process" in str(err.value) and "store.root" in err.value.fix
        assert set(first.store.keys()) == before
        rows, results = _gate(first)  # the holder is unharmed
        assert results["passed"]
    finally:
        first.close()


def test_a_snapshot_the_root_cannot_load_is_one_error_and_frees_the_lock(compose_cfg, tmp_path):
    root = tmp_path / "kv"
    cfg = compose_cfg("+store=localdisk", f"store.root={root}")
    stack = build_stack(cfg, run_dir=tmp_path)
    _gate(stack)
    stack.close()
    values = _values(root)
    (root / "forest.json").write_text('{"version": 99, "namespaces": []}')
    with pytest.raises(ConfigError, match="snapshot"):
        build_stack(cfg, run_dir=tmp_path)
    assert _values(root) == values  # the refused stack let the root go, nothing reconciled away
