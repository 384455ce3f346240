"""At a divergence the stored decoder state is read while the chunk computes (`LateState`).

The synthetic runtime's decoder loads late: the binding starts the read as the session
materializes, the runtime denoises the chunk, then catches the decoder up right before the
chunk's decode. A store whose read of the state waits until the chunk has been denoised shows
that the read is not on the path before the denoise (it would never finish there); a read that
outlasts the wait bound is a miss and the decoder is rebuilt by replay, bit-exact either way. A
damaged state on this path is a miss too (tests/test_decoder_states.py, whose runtime loads late).
"""

from __future__ import annotations

import threading

import torch

from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager, handout
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
from cacheseek.runtime.synthetic.runtime import SyntheticDecoder
from cacheseek.stores.memory import InMemoryTierStore

N, K = 6, 4


def acts(seed: int, n: int = N) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, generator=g).mul(2).sub(1).tolist() for _ in range(n)]


X = acts(0)
FORK = X[:K] + acts(K + 10)[K:]
FACTORY = SyntheticRuntimeFactory(geometry="tiny", local_attn_size=-1, sink_size=0, handout=True)


class SlowStateReads(InMemoryTierStore):
    """The memory tier whose reads of decoder states wait for ``release`` (at most ``wait_s``)."""

    def __init__(self, wait_s: float) -> None:
        super().__init__()
        self.release = threading.Event()
        self.wait_s = wait_s
        self.reads = 0
        self.timed_out = False

    def get_skeleton(self, locator, like=None, *, nbytes=None):
        if locator.endswith(":dec"):
            self.reads += 1
            self.timed_out |= not self.release.wait(self.wait_s)
        return super().get_skeleton(locator, like, nbytes=nbytes)


class Binding(LingBotWorldKVBinding):
    """Opens the store's gate once chunk ``open_at`` is denoised (its ``on_chunk_finalized``)."""

    open_at = -1

    def on_chunk_finalized(self, runtime, idx, denoised):
        super().on_chunk_finalized(runtime, idx, denoised)
        if idx == self.open_at:
            self.manager.store.release.set()


def session(store, forest, actions, *, open_at=-1):
    manager = WorldKVManager(forest, store, make_full_kv_config(), frames_in_flight=N, decoder_states_in_flight=N)
    b = Binding(manager, forest, decoder_state_every=2)
    b.open_at = open_at
    hashes = FACTORY.make(actions, hooks=b).generate()
    store.flush()
    return b, hashes


def test_the_state_is_read_while_the_chunk_denoises_and_loaded_before_its_decode():
    store = SlowStateReads(wait_s=5.0)
    forest = NamespaceForest()
    store.release.set()
    session(store, forest, X)  # writes the states after chunks 1, 3, 5
    store.release.clear()
    c, hashes = session(store, forest, FORK, open_at=K)  # the read finishes only once chunk K is denoised
    assert store.reads == 1 and not store.timed_out  # read in a synchronous way it would wait in vain
    assert hashes == FACTORY.make(FORK, hooks=None).generate()
    m = c.manager.metrics.as_dict()
    assert (c.frames_served, m["decoder_states_restored"], m["decoder_replays"]) == (K, 1, 0)


def test_a_read_past_the_wait_bound_is_a_miss_and_the_decoder_is_replayed(monkeypatch):
    monkeypatch.setattr(handout, "LATE_WAIT_S", 0.2)
    store = SlowStateReads(wait_s=1.0)
    forest = NamespaceForest()
    store.release.set()
    session(store, forest, X)
    store.release.clear()  # never opened: the read takes 1 s, the decoder waits 0.2 s
    c, hashes = session(store, forest, FORK)
    assert hashes == FACTORY.make(FORK, hooks=None).generate()
    m = c.manager.metrics.as_dict()
    assert m["decoder_states_missing"] == 1 and m["decoder_replays"] == K


def test_a_decoder_that_does_not_load_late_gets_the_state_before_the_chunk(monkeypatch):
    monkeypatch.setattr(SyntheticDecoder, "loads_late", False)
    store = SlowStateReads(wait_s=0.0)
    forest = NamespaceForest()
    session(store, forest, X)
    plans = []
    real = LingBotWorldKVBinding.next_chunk

    def seen(self, runtime, idx, spec, **kw):
        plans.append(real(self, runtime, idx, spec, **kw))
        return plans[-1]

    monkeypatch.setattr(LingBotWorldKVBinding, "next_chunk", seen)
    c, hashes = session(store, forest, FORK)
    assert hashes == FACTORY.make(FORK, hooks=None).generate()
    diverged = plans[K]
    assert diverged.late_state is None and diverged.decoder_state is not None and diverged.replay_from == K
    m = c.manager.metrics.as_dict()
    assert (m["decoder_states_restored"], m["decoder_replays"]) == (1, 0)
