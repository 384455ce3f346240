"""A session's prompt and condition encodes are stored in the cache's store, shared across
processes (`reuse.exact_prefix.encodes`, `integrations.telefuser.encodes`), on TeleFuser's real
pipeline (its Wan VAE and umT5 encoder, tiny): a new stack on the same LocalDisk root, with a new
pipeline (nothing kept in the process), skips both encodes and hands out a cold run's frames bit
for bit; a damaged stored encode is a miss (the encode runs, the frames still a cold run's);
another prompt or image never gets them."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.telefuser

telefuser = pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")

from cacheseek.integrations.telefuser import hooks_of  # noqa: E402
from cacheseek.kv.locators import encode_locators  # noqa: E402
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager  # noqa: E402
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config  # noqa: E402
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory  # noqa: E402
from cacheseek.stores.localdisk import LocalDiskTierStore  # noqa: E402
from cacheseek.stores.memory import InMemoryTierStore  # noqa: E402

ACTIONS = [[0.2, -0.1, 0.0], [0.4, 0.3, -0.2]]


def _factory() -> TeleFuserRuntimeFactory:
    return TeleFuserRuntimeFactory(n_layers=1, n_heads=1, head_dim=14, ffn_dim=32, text_dim=64, text_layers=1,
                                   height=32, width=32, vae="wan", text_encoder="umt5")


@pytest.fixture(scope="module")
def factory():
    return _factory()


@pytest.fixture(scope="module")
def cold(factory):
    s = factory.make(ACTIONS, hooks=None)
    s.generate()
    return s


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


def _same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@contextlib.contextmanager
def _stack(root):
    store = LocalDiskTierStore(str(root))
    try:
        yield WorldKVManager(NamespaceForest(), store, make_full_kv_config())
    finally:
        store.close()


def _session(factory, manager, *, image=None):
    b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint)
    s = factory.make(ACTIONS, hooks=b, image=image)
    s.generate()
    return s


def _counts(kept) -> tuple[int, int, int]:
    return kept.hits, kept.loaded, kept.misses


def test_a_new_stack_and_pipeline_on_the_same_root_skip_both_encodes_bit_for_bit(factory, cold, tmp_path):
    root = tmp_path / "disk"
    with _stack(root) as m:
        first = _session(factory, m)
        assert m.metrics.as_dict()["encodes_written"] == 2
    other = _factory()  # a new pipeline: new encoders, an empty in-process keep (as a new worker)
    kept = hooks_of(other.pipeline).encodes
    with _stack(root) as m:
        before = _counts(kept)
        second = _session(other, m)
        got = m.metrics.as_dict()
    assert _counts(kept) == (before[0], before[1] + 2, before[2])  # both from the store, none encoded
    assert (got["encodes_loaded"], got["encodes_missing"], got["encodes_written"]) == (2, 0, 0)
    assert second.frame_hashes == cold.frame_hashes == first.frame_hashes
    assert _same(second.runtime.prompt_emb, cold.runtime.prompt_emb)
    assert _same(second.runtime.encoded_image_latent, cold.runtime.encoded_image_latent)


@pytest.mark.parametrize("damaged", ["enc", "encb"])
@pytest.mark.parametrize("kind", ["memory", "localdisk"])
def test_a_damaged_stored_encode_is_a_miss_and_the_frames_stay_a_cold_runs(factory, cold, tmp_path, kind, damaged):
    """Memory holds what it was given: the encode's own checks catch the damage. LocalDisk
    checksums every file itself: its read is a miss before the encode's checks run."""
    root = tmp_path / "disk"
    shared = InMemoryTierStore()

    @contextlib.contextmanager
    def stack():
        if kind == "localdisk":
            with _stack(root) as m:
                yield m
        else:
            yield WorldKVManager(NamespaceForest(), shared, make_full_kv_config())

    kept = hooks_of(factory.pipeline).encodes
    kept.clear()  # the process's keep forgotten (as in a new worker): only the store serves
    with stack() as m:
        _session(factory, m)
        assert len([k for k in m.store.keys() if k.endswith(":" + damaged)]) == 2
    if kind == "memory":
        for key in [k for k in shared.keys() if k.endswith(":" + damaged)]:
            with torch.inference_mode():  # written in TeleFuser's inference mode
                shared.backend.read(key)[60 if damaged == "enc" else -1] ^= 0x40  # its body digest; a body byte
    else:
        files = [p for p in root.rglob("*") if p.is_file() and p.name.endswith("%3A" + damaged)]
        assert len(files) == 2
        for p in files:
            raw = bytearray(p.read_bytes())
            raw[-1] ^= 0x40
            p.write_bytes(bytes(raw))
    kept.clear()
    with stack() as m:
        before = _counts(kept)
        s = _session(factory, m)
        got = m.metrics.as_dict()
    assert _counts(kept) == (before[0], before[1], before[2] + 2)  # both encoded again
    caught = "encodes_corrupt" if kind == "memory" else "encodes_missing"
    assert got[caught] == 2 and got["encodes_loaded"] == 0
    assert got["encodes_written"] == 2  # stored again: the session has a cached prefix
    assert s.frame_hashes == cold.frame_hashes
    assert _same(s.runtime.prompt_emb, cold.runtime.prompt_emb)
    assert _same(s.runtime.encoded_image_latent, cold.runtime.encoded_image_latent)
    kept.clear()
    with stack() as m:
        _session(factory, m)
        assert m.metrics.as_dict()["encodes_loaded"] == 2  # the rewritten values serve again


def test_another_prompt_or_image_never_gets_them(factory, cold, tmp_path):
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config())
    _session(factory, manager)
    kept = hooks_of(factory.pipeline).encodes
    kept.clear()  # the process's keep forgotten: only the store can serve
    prompt = factory.prompt
    factory.prompt = "a blue boat on a lake"
    try:
        ref = factory.make(ACTIONS, hooks=None)
        ref.generate(stop_after=0)
        s = _session(factory, manager)
    finally:
        factory.prompt = prompt
    got = manager.metrics.as_dict()
    assert (got["encodes_loaded"], got["encodes_missing"]) == (1, 1)  # the same image's latents; not the prompt
    assert _same(s.runtime.prompt_emb, ref.runtime.prompt_emb)
    assert not _same(s.runtime.prompt_emb, cold.runtime.prompt_emb)
    kept.clear()
    image = torch.arange(32 * 32 * 3, dtype=torch.int64).reshape(32, 32, 3).mul(7).remainder(251).to(torch.uint8)
    from PIL import Image

    pil = Image.fromarray(image.numpy(), "RGB")
    ref = factory.make(ACTIONS, hooks=None, image=pil)
    ref.generate(stop_after=0)
    s = _session(factory, manager, image=pil)
    got = manager.metrics.as_dict()
    assert (got["encodes_loaded"], got["encodes_missing"]) == (2, 2)  # its prompt's embedding; not the image's
    assert _same(s.runtime.encoded_image_latent, ref.runtime.encoded_image_latent)
    assert not _same(s.runtime.encoded_image_latent, cold.runtime.encoded_image_latent)


def test_the_encodes_leave_with_their_namespaces_last_chunk(factory, tmp_path):
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config())
    hooks_of(factory.pipeline).encodes.clear()
    b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint)
    factory.make(ACTIONS, hooks=b).generate()
    stored = [k for k in manager.store.keys() if k.endswith((":enc", ":encb"))]
    assert len(stored) == 4
    assert manager.reconcile()["orphans_removed"] == 0 and all(
        k in manager.store.keys() for k in stored)  # reconcile keeps them
    ns = manager.forest.resolve(b.root)
    nodes = sorted((n for n in ns.iter_nodes() if n.has_kv), key=lambda n: -n.depth)
    for n in nodes[:-1]:
        assert manager.evict_blob(n)
        assert all(k in manager.store.keys() for k in stored)  # a chunk is left: kept
    assert manager.evict_blob(nodes[-1])
    assert not any(k in manager.store.keys() for k in stored)


def test_a_store_full_drops_the_encodes_and_never_evicts_kv(factory):
    store = InMemoryTierStore()
    manager = WorldKVManager(NamespaceForest(), store, make_full_kv_config())
    hooks_of(factory.pipeline).encodes.clear()
    real = store.put_skeleton

    def refuse_encodes(locator, value):
        if locator.endswith((":enc", ":encb")):
            from cacheseek.errors import StoreFullError
            raise StoreFullError("memory: full (test)")
        return real(locator, value)

    store.put_skeleton = refuse_encodes
    b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint)
    s = factory.make(ACTIONS, hooks=b)
    s.generate()
    got = manager.metrics.as_dict()
    assert got["encodes_dropped"] == 2 and got["encodes_written"] == 0 and got["evictions"] == 0
    assert not any(k.endswith((":enc", ":encb")) for k in store.keys())
    assert encode_locators(b"\0" * 32)[0].endswith(":enc")


def test_a_plan_tier_shared_by_two_stacks_serves_both_encodes(factory, cold):
    """The Plan tier (read by length: the head, then the body it names), as two workers on one
    Fluxon segment see it: the second stack's session, with nothing kept in the process, loads both."""
    from cacheseek.plan.embedded import EmbeddedPlanClient
    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.transfer.host_transfer import HostTransferRuntime

    store = PlanTierStore(plan_client=EmbeddedPlanClient(segment_bytes=64 << 20, prefault_threads=1),
                          transfer=HostTransferRuntime(), overlap=False)
    kept = hooks_of(factory.pipeline).encodes
    try:
        kept.clear()
        _session(factory, WorldKVManager(NamespaceForest(), store, make_full_kv_config()))
        kept.clear()
        m = WorldKVManager(NamespaceForest(), store, make_full_kv_config())
        before = _counts(kept)
        s = _session(factory, m)
    finally:
        store.close()
    assert _counts(kept) == (before[0], before[1] + 2, before[2])
    assert m.metrics.as_dict()["encodes_loaded"] == 2
    assert s.frame_hashes == cold.frame_hashes
    assert _same(s.runtime.prompt_emb, cold.runtime.prompt_emb)
    assert _same(s.runtime.encoded_image_latent, cold.runtime.encoded_image_latent)


def test_encoder_weights_written_in_place_make_a_new_key(factory, cold):
    """A weight load into the same encoder object (its tensors' versions bumped) is another
    encoder: its sessions never get the encode stored for the old weights."""
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config())
    kept = hooks_of(factory.pipeline).encodes
    kept.clear()
    _session(factory, manager)
    param = next(factory.pipeline.text_encoder.parameters())
    saved = param.detach().clone()
    try:
        with torch.no_grad():
            param.add_(0.5)
        kept.clear()
        ref = factory.make(ACTIONS, hooks=None)
        ref.generate(stop_after=0)
        s = _session(factory, manager)
        got = manager.metrics.as_dict()
        assert (got["encodes_loaded"], got["encodes_missing"]) == (1, 3)  # the condition's latents only
        assert _same(s.runtime.prompt_emb, ref.runtime.prompt_emb)
        assert not _same(s.runtime.prompt_emb, cold.runtime.prompt_emb)
    finally:
        with torch.no_grad():
            param.copy_(saved)
        kept.clear()


def test_managers_on_one_store_write_the_encodes_once(factory, tmp_path):
    """A session's binding gets a manager of its own (`Stack.new_binding`); the encodes one of
    them stored are known to the next on the same store, which does not write them again."""
    store = InMemoryTierStore()
    forest = NamespaceForest()
    first = WorldKVManager(forest, store, make_full_kv_config())
    _session(factory, first)
    second = WorldKVManager(forest, store, make_full_kv_config(), metrics=first.metrics)
    _session(factory, second)
    m = first.metrics.as_dict()
    assert m["encodes_written"] == 2 and m["encodes_dropped"] == 0
    store.close()
