"""Issue 34 on TeleFuser's real pipeline: `serve_metrics(manager)` serves the binding's counters
while live sessions stream one control per chunk, as TeleFuser's services run them (the live
sessions of ``examples/telefuser_live_sessions.py``): after each session, the endpoint's live
hits equal the chunks the sessions restored, its restore bytes the bytes they restored, and its
written chunks the chunks written; attach's seam times each chunk (restored or computed) and
each session's first frame."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cacheseek.reuse.exact_prefix.telefuser_lingbot import serve_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "telefuser_live_sessions.py"


def _example():
    spec = importlib.util.spec_from_file_location("telefuser_live_sessions_for_metrics", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # builds the tiny pipeline, attaches, one manager; runs no session
    return module


def test_serve_metrics_counts_a_telefuser_services_live_sessions(scrape):
    ex = _example()
    server = serve_metrics(ex.manager, port=0)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        bindings = []
        for actions in (ex.X, ex.B, ex.X):  # A computes, B shares A's first two chunks, C repeats A
            bindings.append(ex.live_session(actions))
            s = scrape(server.url)
            restored = sum(len(b.restored_chunks) for b in bindings)
            assert s.total("cacheseek_hits_total", kind="live") == restored
            assert s.total("cacheseek_lookups_total") == 4 * len(bindings)
            assert s.total("cacheseek_transfer_bytes_sum", direction="restore") == sum(b.bytes_restored for b in bindings)
            assert s.total("cacheseek_written_chunks_total") == ex.manager.metrics.writes
            assert s.total("cacheseek_hook_failures_total") == 0
        assert [len(b.restored_chunks) for b in bindings] == [0, 2, 4]
        assert s.total("cacheseek_written_chunks_total") == 6
        # attach's seam timed every chunk: A computed all 4, B restored chunks 0-1, C all 4
        assert s.get_value("cacheseek_session_first_frame_seconds_count", start="computed") == 1
        assert s.get_value("cacheseek_session_first_frame_seconds_count", start="restored") == 2
        assert s.get_value("cacheseek_chunk_seconds_count", source="restored") == 1 + 3
        assert s.get_value("cacheseek_chunk_seconds_count", source="computed") == 3 + 2
    finally:
        server.close()
        from cacheseek.integrations.telefuser import detach

        detach(ex.pipeline)
