"""Issue 12 item 9 on TeleFuser's real pipeline: the binding fingerprints the DiT that built the
runtime, so two checkpoints never restore each other's KV, and it refuses a TeleFuser runtime that
nothing identifies."""

from __future__ import annotations

import pytest

from cacheseek import weights
from cacheseek.errors import ConfigError
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_rolling_config
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory
from cacheseek.stores.memory import InMemoryTierStore

ACTIONS = [[0.3, -0.2, 0.1, 0.0], [-0.5, 0.4, 0.0, 0.2], [0.1, 0.1, -0.3, 0.0]]


def _manager():
    return WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_rolling_config(local_attn_size=7, sink_size=3))


def _run(factory, manager, *, ingest=True):
    """One session with a binding that is given no model_fingerprint: only attach identifies the weights."""
    binding = LingBotWorldKVBinding(manager, manager.forest, ingest_enabled=ingest)
    session = factory.make(ACTIONS, hooks=binding)
    session.generate()
    manager.store.flush()
    return binding, session


def test_another_checkpoint_is_a_cold_miss_and_the_same_weights_hit():
    manager = _manager()
    a = TeleFuserRuntimeFactory(local_attn_size=7, sink_size=3, weight_seed=1)
    written, _ = _run(a, manager)
    assert written.manager.metrics.hook_failures == 0 and len(manager.forest) == 1

    other = TeleFuserRuntimeFactory(local_attn_size=7, sink_size=3, weight_seed=2)
    missed, _ = _run(other, manager, ingest=False)
    assert missed.manager.metrics.hook_failures == 0 and missed.last_fast_forward == 0 and missed.root != written.root

    same = TeleFuserRuntimeFactory(local_attn_size=7, sink_size=3, weight_seed=1)  # another module, same bits
    hit, _ = _run(same, manager, ingest=False)
    assert hit.root == written.root and hit.last_fast_forward == len(ACTIONS)
    assert weights.module_fingerprint(a.pipeline.dit) == weights.module_fingerprint(same.pipeline.dit)


def test_a_telefuser_runtime_nothing_identifies_is_refused():
    factory = TeleFuserRuntimeFactory(local_attn_size=7, sink_size=3)
    session_config = factory.session_config(ACTIONS)
    runtime = factory.pipeline.create_runtime(session_config)  # the hooks run no binding: none is set
    binding = LingBotWorldKVBinding(_manager(), NamespaceForest())
    with pytest.raises(ConfigError) as info:
        binding.on_runtime_created(runtime, session_config)
    assert info.value.field == "namespace.model_fingerprint" and "attach(pipeline)" in info.value.fix
    assert binding.manager.metrics.hook_failures == 1

    named = LingBotWorldKVBinding(_manager(), NamespaceForest(), model_fingerprint=b"lingbot-world-fast@ckpt-7")
    named.on_runtime_created(runtime, session_config)
    assert named.manager.metrics.hook_failures == 0 and named.root is not None


def test_the_marked_model_is_hashed_once_and_a_stand_in_is_not():
    import torch

    assert weights.current() is None
    layer = torch.nn.Linear(3, 2)
    with weights.of_model(layer):
        first = weights.current()
        assert len(first) == 16 and weights.current() is first  # cached per module
        with weights.of_model(object()):  # a stand-in without a state dict (a test double)
            assert weights.current() is None
    with torch.no_grad():
        layer.bias.add_(1)
    assert weights.module_fingerprint(torch.nn.Linear(3, 2)) != first
