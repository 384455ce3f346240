"""The short Fluxon rows of the fault campaign (experiments/fault_campaign, issue 12): the owner of
a real local service (the process that owns the segment) is killed with SIGKILL a few ms into a
chunk's write, for ``+store=fluxon`` and for ``+store=fluxon_plan store.client=fluxon``.

The data in the killed owner's segment is gone with it. What must hold: no session gets wrong
frames (a restore after the kill fails within the op bound and the session runs cold), the
manager invalidates what died once the store is reopened on the restarted service, writes land
again and what they wrote restores, and nothing ready lacks its values. About 3 minutes here.
"""

from __future__ import annotations

import json

import pytest

from repo_scripts import load_script

FLUXON_ROWS = ("fluxon_kill9", "fluxon_plan_kill9")


def load():
    return load_script("experiments/fault_campaign/campaign.py", "fault_campaign")


@pytest.mark.fluxon
def test_short_fluxon_owner_kill9(fluxon_env, tmp_path):
    res = load().main(["short=true", f"faults={','.join(FLUXON_ROWS)}", f"out_dir={tmp_path}"])
    rows = {r["fault"]: r for r in res["rows"]}
    assert set(rows) == set(FLUXON_ROWS)
    for name, r in rows.items():
        assert not r.get("skipped"), r
        assert r["injected"] == r["restarts"] >= 1, r
        assert r["wrong_outputs"] == 0 and r["committed_lost"] == 0, r
        assert r["dead_owner_sessions"] >= 1 and r["restore_errors"] >= 1, r  # restores failed, ran cold
        assert r["gone_with_owner"] >= 1, r  # what the owner held was invalidated on reopen
        assert r["recover_s"] is not None and r["write_again_s"] is not None, r  # sessions and writes came back
    assert json.loads((tmp_path / "results.json").read_text())["totals"] == res["totals"]
    assert "| fluxon_plan_kill9 |" in (tmp_path / "results.md").read_text()
