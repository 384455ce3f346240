"""A session's prompt and condition-video encodes are kept for the next session with a binding
(`integrations.telefuser.encodes`), bit for bit, on TeleFuser's real pipeline (its Wan VAE and
umT5 encoder, tiny); a session without a cache encodes as TeleFuser does."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.telefuser

telefuser = pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")

from cacheseek.integrations.telefuser import hooks_of  # noqa: E402
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager  # noqa: E402
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config  # noqa: E402
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory  # noqa: E402
from cacheseek.stores.memory import InMemoryTierStore  # noqa: E402

ACTIONS = [[0.2, -0.1, 0.0], [0.4, 0.3, -0.2]]


@pytest.fixture(scope="module")
def factory():
    return TeleFuserRuntimeFactory(n_layers=1, n_heads=1, head_dim=14, ffn_dim=32, text_dim=64, text_layers=1,
                                   height=32, width=32, vae="wan", text_encoder="umt5")


def test_the_second_session_skips_both_encodes_and_matches_bit_for_bit(factory):
    hooks = hooks_of(factory.pipeline)
    kept = hooks.encodes
    cold = factory.make(ACTIONS, hooks=None)
    cold.generate(stop_after=0)
    misses, hits = kept.misses, kept.hits
    assert (kept.misses, kept.hits) == (misses, hits)  # no binding: TeleFuser's own encodes, nothing kept
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config())
    sessions = []
    for _ in range(2):
        b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint)
        s = factory.make(ACTIONS, hooks=b)
        s.generate()
        sessions.append(s)
    assert kept.misses == misses + 2 and kept.hits == hits + 2  # the first encodes and keeps, the second reuses
    a, b = (s.runtime for s in sessions)
    assert torch.equal(a.prompt_emb.view(torch.int16), cold.runtime.prompt_emb.view(torch.int16))
    assert torch.equal(b.prompt_emb.view(torch.int16), cold.runtime.prompt_emb.view(torch.int16))
    assert torch.equal(b.encoded_image_latent.view(torch.int16), cold.runtime.encoded_image_latent.view(torch.int16))
    assert b.prompt_emb.data_ptr() != a.prompt_emb.data_ptr()  # a copy: no session writes another's
    assert sessions[1].frame_hashes == sessions[0].frame_hashes
