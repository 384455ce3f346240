"""The HBM tier (its pool in host memory here, ``device=cpu``) on TeleFuser's real pipeline, sized
``auto`` for the gate: the frames stored beside each chunk are counted in the pool, so after the
gate a full hit hands out every chunk from its frames, bit for bit a cold run's (issue 32: the
pool held the gate's KV and nothing else, and a chunk the gate needed was evicted or its frames
dropped). A damaged frames value in the pool is a miss (the chunk is computed), never handed out.
"""

from __future__ import annotations

import pytest

from cacheseek.kv import frames as frames_value
from cacheseek.kv.locators import frames_locator
from cacheseek.orchestrator import build_stack


@pytest.fixture
def stack(compose_cfg, tmp_path):
    cfg = compose_cfg("runtime=telefuser", "runtime.n_layers=1", "runtime.n_heads=1", "runtime.head_dim=14",
                      "runtime.ffn_dim=32", "runtime.text_dim=16", "runtime.height=32", "runtime.width=32",
                      "runtime.vae=stand_in", "runtime.text_encoder=stand_in", "+store=hbm",
                      "workload.total_chunks=3", "workload.prefix_chunks=2", "workload.ring_check=false")
    stack = build_stack(cfg, run_dir=tmp_path)
    yield stack
    stack.close()


def _frames_of(stack, actions):
    """The stored frames value of each chunk of ``actions``' cached path: (locator, node key)."""
    binding = stack.new_binding()
    session = stack.runtime_factory.make(actions, hooks=binding)
    session.generate()
    return [(frames_locator(n.node_key), n.node_key) for n in binding._lazy], session.frame_hashes


def test_auto_sized_hbm_hands_out_every_chunk_after_the_gate(stack):
    (sized,) = [n for n in stack.notes if n.startswith("store.capacity_bytes=auto")]
    assert "beside them 4 frames of" in sized  # the gate keeps 4 chunks, each with its frames
    gate = stack.workload
    res = gate.run(stack)
    assert res["passed"], res["verdicts"]
    cold = {r["name"]: r for r in res["requests"]}["A"]
    again = gate._request(stack, "B2", gate.P + gate.X, "P+X")
    assert (again.frames_served, again.chunks_materialized) == (3, 0)  # nothing evicted, nothing decoded
    a = gate._request(stack, "A2", gate.P + gate.X, "P+X", manager=stack.new_manager(), ingest=False)
    assert again.frame_hashes == a.frame_hashes  # bit for bit what a session that computes hands out
    m = stack.metrics.as_dict()
    assert m["frames_dropped"] == 0 and m["frames_corrupt"] == 0 and cold["frames_served"] == 0


def test_a_damaged_frames_value_in_the_pool_is_a_miss(stack):
    gate = stack.workload
    actions = gate.P + gate.X
    first = gate._request(stack, "A", actions, "P+X")
    values, served_hashes = _frames_of(stack, actions)
    assert served_hashes == [bytes.fromhex(h) for h in first.frame_hashes]
    loc, key = values[1]
    reader, client = stack.store._reader, stack.store.plan_client
    spec_bytes = frames_value.packed_nbytes(_spec(stack, actions))
    with reader.reading([loc], [1]) as read:
        table, _ = read.transfer(None)
        (src,) = reader._value_pointers(read, table, [spec_bytes], raw=True)
        client.value_tensor(src, spec_bytes)[-1] ^= 0x01  # one pixel byte of chunk 1's frames
    before = stack.metrics.as_dict()
    again = gate._request(stack, "B2", actions, "P+X")
    after = stack.metrics.as_dict()
    assert after["frames_corrupt"] - before["frames_corrupt"] == 1
    assert again.frames_served == 1 and again.frame_hashes == first.frame_hashes  # computed, never handed out


def _spec(stack, actions):
    from cacheseek.integrations.telefuser.handout import frames_spec

    session = stack.runtime_factory.make(actions, hooks=None)
    session.start()
    return frames_spec(session.runtime, 1)
