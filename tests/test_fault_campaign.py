"""The short fault campaign (experiments/fault_campaign, issues 12 and 23): kill -9 of a LocalDisk
writer, bit flips, truncations, a full disk, a full store, concurrent sessions, swapped values,
crafted snapshots, links, FIFOs, stalled media, ENOSPC recovery and a shared root. Every
session's frames must equal a cold run's (no wrong output), nothing committed may be lost, no
session may hang and nothing outside the root may change. The kill -9 of the
Fluxon owner needs a real service in a private network namespace: its rows are skipped here and
run by tests/fluxon/test_fault_campaign_fluxon.py."""

from __future__ import annotations

import json

import pytest

from repo_scripts import load_script


def load():
    return load_script("experiments/fault_campaign/campaign.py", "fault_campaign")


@pytest.mark.slow
def test_short_fault_campaign(tmp_path):
    campaign = load()
    res = campaign.main(["short=true", f"out_dir={tmp_path}"])
    rows = {r["fault"]: r for r in res["rows"]}
    assert set(rows) == {"kill9", "bitflip", "truncate", "enospc", "full_store", "concurrent",
                         "swap", "crafted_snapshot", "links", "fifo", "stalled", "enospc_recovery",
                         "shared_root", "fluxon_kill9", "fluxon_plan_kill9"} == set(campaign.FAULTS)
    must_be_zero = ("wrong_outputs", "committed_lost", "hung", "outside_changes")
    failing = {name: {k: r[k] for k in must_be_zero if r.get(k)} for name, r in rows.items()
               if any(r.get(k) for k in must_be_zero)}
    assert failing == {}, failing
    assert all(res["totals"][k] == 0 for k in must_be_zero), res["totals"]
    for name, r in rows.items():
        if r.get("skipped"):  # no tmpfs mount allowed; no Fluxon service possible here
            assert name in ("enospc", "enospc_recovery", "fluxon_kill9", "fluxon_plan_kill9"), name
            continue
        # a crafted snapshot is refused whole at load (a ConfigError): no session can run on it
        refused_whole = name == "crafted_snapshot" and r.get("refused") == r["injected"]
        assert r["injected"] > 0 and (r["sessions"] > 0 or refused_whole), name
    assert rows["kill9"]["restarts"] == rows["kill9"]["injected"]
    assert rows["bitflip"]["corrupt_values"] + rows["truncate"]["corrupt_values"] > 0
    assert rows["full_store"]["dropped_writes"] == 0 and rows["concurrent"]["stuck_threads"] == 0
    assert rows["shared_root"]["shared_ok"] == rows["shared_root"]["injected"]  # a root shared live
    assert rows["crafted_snapshot"]["not_config_errors"] == 0
    assert rows["links"]["open_errors"] * 2 == rows["links"]["injected"]  # each planted shard link refused
    assert rows["stalled"]["orphan_files"] == 0
    assert json.loads((tmp_path / "results.json").read_text())["totals"] == res["totals"]
    assert (tmp_path / "fault_campaign.png").stat().st_size > 0
    assert "| kill9 |" in (tmp_path / "results.md").read_text()


def test_the_campaign_gives_the_logging_level_back(tmp_path):
    """The campaign silences CacheSeek's logger while it injects faults, and restores it: it also
    runs inside test sessions whose later tests read log records."""
    import logging

    logger = logging.getLogger("cacheseek")
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        load().main(["short=true", "faults=full_store", f"out_dir={tmp_path}"])
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)
