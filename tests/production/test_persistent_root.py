"""A persistent LocalDisk root is its own index: the chunk records the store writes (issue 31).

A second stack on the root hits what the first committed, found by key in the root's records (no
snapshot is loaded or saved); its reconcile removes nothing committed. Two stacks on one root at
once share it: each hits what the other committed, and neither loses anything. A ``forest.json``
in the root (an older version's snapshot, or a FIFO someone put there) is never opened. The CLI's
side (two runs, a run beside another) is tests/test_cli.py.
"""

from __future__ import annotations

import os

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
    assert any(k.endswith(":rec") for k in committed) and not (root / "forest.json").exists()

    second = build_stack(cfg, run_dir=tmp_path)
    try:
        assert set(second.store.keys()) == committed  # its reconcile removed nothing committed
        rows, results = _gate(second)
        n = cfg.workload.total_chunks
        assert results["warm"] and results["passed"], results["verdicts"]
        assert rows["A"]["hit_depth"] == n and rows["A"]["frames"] == "ok"  # == R, a cold run
        assert rows["R"]["hit_depth"] == 0 and rows["A"]["expect"].startswith("K>=0 (warm)")
        assert rows["C"]["hit_depth"] == n  # the first run's C wrote all of P+Y
        assert second.metrics.as_dict()["index_adopted"] >= n
        assert check_invariants(second.forest, second.store.keys()) == []
    finally:
        second.close()


def test_two_stacks_on_one_root_at_once_share_it(compose_cfg, tmp_path):
    root = tmp_path / "kv"
    cfg = compose_cfg("+store=localdisk", f"store.root={root}")
    first = build_stack(cfg, run_dir=tmp_path / "a")
    try:
        _gate(first)
        before = set(first.store.keys())
        second = build_stack(cfg, run_dir=tmp_path / "b")
        try:
            rows, results = _gate(second)  # a live neighbour's chunks, found by key
            assert results["passed"] and rows["A"]["hit_depth"] == cfg.workload.total_chunks
            assert before <= set(second.store.keys())
        finally:
            second.close()
        assert before <= set(first.store.keys())
        rows, results = _gate(first)  # the first is unharmed
        assert results["passed"]
    finally:
        first.close()


def test_a_snapshot_file_in_the_root_is_never_opened(compose_cfg, tmp_path):
    root = tmp_path / "kv"
    cfg = compose_cfg("+store=localdisk", f"store.root={root}")
    stack = build_stack(cfg, run_dir=tmp_path)
    _gate(stack)
    stack.close()
    values = _values(root)
    os.mkfifo(root / "forest.json")  # an open would block
    stack = build_stack(cfg, run_dir=tmp_path)
    try:
        rows, results = _gate(stack)
        assert results["passed"] and rows["A"]["hit_depth"] == cfg.workload.total_chunks
    finally:
        stack.close()
    assert values <= _values(root)
