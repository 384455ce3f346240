"""The HBM tier (its pool in host memory here, ``device=cpu``) on TeleFuser's real pipeline, sized
``auto`` for the gate: the frames stored beside each chunk are counted in the pool, so after the
gate a full hit hands out every chunk from its frames, bit for bit a cold run's (issue 32: the
pool held the gate's KV and nothing else, and a chunk the gate needed was evicted or its frames
dropped). A damaged frames value in the pool is a miss (the chunk is computed), never handed out.
"""

from __future__ import annotations

import pytest
import torch

from cacheseek.kv import frames as frames_value
from cacheseek.kv.locators import frames_locator
from cacheseek.orchestrator import build_stack
from cacheseek.reuse.exact_prefix import NamespaceForest


@pytest.fixture
def stack(compose_cfg, tmp_path):
    cfg = compose_cfg("runtime=telefuser", "runtime.n_layers=1", "runtime.n_heads=1", "runtime.head_dim=14",
                      "runtime.ffn_dim=32", "runtime.text_dim=16", "runtime.height=32", "runtime.width=32",
                      "runtime.vae=stand_in", "runtime.text_encoder=stand_in", "+store=hbm",
                      "workload.total_chunks=3", "workload.prefix_chunks=2", "workload.ring_check=false")
    stack = build_stack(cfg, run_dir=tmp_path)
    yield stack
    stack.close()


def _chunk_nodes(stack, binding):
    """The trie nodes of the chunks ``binding``'s session ran, in order."""
    node = stack.forest.resolve(binding.root).root
    out = []
    for key in list(binding.actions):
        node = node.children[key]
        out.append(node)
    return out


def test_auto_sized_hbm_hands_out_every_chunk_after_the_gate(stack):
    (sized,) = [n for n in stack.notes if n.startswith("store.capacity_bytes=auto")]
    assert "beside them 4 frames of" in sized  # the gate keeps 4 chunks, each with its frames
    assert "1 session's encodes of" in sized  # and its session's prompt and condition encodes, stored once
    gate = stack.workload
    res = gate.run(stack)
    assert res["passed"], res["verdicts"]
    cold = {r["name"]: r for r in res["requests"]}["A"]
    again, hashes, _ = stack.run_session(gate.P + gate.X)
    assert (again.frames_served, again.chunks_materialized) == (3, 0)  # nothing evicted, nothing decoded
    cold_run, computed, _ = stack.run_session(gate.P + gate.X, manager=stack.new_manager(NamespaceForest(), shared_index=False),
                                              ingest=False)
    assert cold_run.frames_served == 0 and cold_run.chunks_computed == 3 and hashes == computed  # bit for bit what a session that computes hands out
    m = stack.metrics.as_dict()
    assert m["frames_dropped"] == 0 and m["frames_corrupt"] == 0 and cold["frames_served"] == 0


def test_a_damaged_frames_value_in_the_pool_is_a_miss(stack):
    gate = stack.workload
    actions = gate.P + gate.X
    binding = stack.new_binding()
    session = stack.runtime_factory.make(actions, hooks=binding)
    session.generate()
    stack.store.flush()
    first = session.frame_hashes
    node = _chunk_nodes(stack, binding)[1]
    loc, size = frames_locator(node.node_key), frames_value.packed_nbytes(_spec(stack, actions))
    value = bytearray(stack.store.get_skeleton(loc, nbytes=size))  # the pool's value, read back raw
    value[-1] ^= 0x01  # one pixel byte of chunk 1's frames
    stack.store.free_skeleton(loc)
    stack.store.put_skeleton(loc, torch.frombuffer(value, dtype=torch.uint8))
    before = stack.metrics.as_dict()
    again, hashes, _ = stack.run_session(actions)
    after = stack.metrics.as_dict()
    assert after["frames_corrupt"] - before["frames_corrupt"] == 1
    assert again.frames_served == 1 and hashes == first  # computed, never handed out


def _spec(stack, actions):
    from cacheseek.integrations.telefuser.handout import frames_spec

    session = stack.runtime_factory.make(actions, hooks=None)
    session.start()
    return frames_spec(session.runtime, 1)
