"""Shared fixtures: composed Hydra configs (no output folders) and torch availability."""

from __future__ import annotations

import importlib.util

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import cacheseek.schema  # noqa: F401
from cacheseek.cli import CONF_DIR
from cacheseek.registry import import_backends

import_backends()

FLUXON_PY_REASON = "needs fluxon-py (pip install -e '.[fluxon]', or bash tools/install_fluxon_deps.sh)"


def pytest_collection_modifyitems(items):
    """Tests marked ``fluxon_py`` skip, with the reason, where fluxon-py is not installed."""
    if importlib.util.find_spec("fluxon_py") is not None:
        return
    skip = pytest.mark.skip(reason=FLUXON_PY_REASON)
    for item in items:
        if item.get_closest_marker("fluxon_py") is not None:
            item.add_marker(skip)


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> DictConfig composed from conf/ like the CLI does."""

    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    yield _compose
    GlobalHydra.instance().clear()


@pytest.fixture
def gated():
    """``make(segment_bytes=1 MiB, fail=False) -> (store, client)``: a Plan tier store (host
    transfer, no overlap) warming in the background over an embedded client whose segment is
    ready only once ``client.gate`` is set (``client.asked``: the warm-up asked for it; ``fail``:
    it then fails). The warm-up first waits for a first session's start-up, as every background
    warm-up does: ``store.session_starting().release()`` lets it go on. Closed after the test."""
    import threading

    from cacheseek.plan.embedded import EmbeddedPlanClient
    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.transfer.host_transfer import HostTransferRuntime

    class GatedClient(EmbeddedPlanClient):
        def __init__(self, segment_bytes: int, fail: bool) -> None:
            super().__init__(segment_bytes=segment_bytes, prefault_threads=1)
            self.gate = threading.Event()
            self.fail = fail
            self.asked = threading.Event()

        def wait_local_segments_ready(self):
            self.asked.set()
            assert self.gate.wait(20)
            if self.fail:
                raise OSError(12, "Cannot allocate memory")
            return super().wait_local_segments_ready()

    made = []

    def make(segment_bytes: int = 1 << 20, fail: bool = False):
        client = GatedClient(segment_bytes, fail)
        store = PlanTierStore(plan_client=client, transfer=HostTransferRuntime(), overlap=False, warmup="background")
        made.append((store, client))
        return store, client

    yield make
    for store, client in made:
        client.gate.set()
        store.close()
        client.close()


class Scrape(dict):
    """One scrape of a Prometheus endpoint: ``{(sample name, ((label, value), ...)): value}``."""

    def get_value(self, name: str, **labels: str) -> float:
        """The sample ``name{labels}``; a missing one fails the test with what is there."""
        key = (name, tuple(sorted(labels.items())))
        assert key in self, f"{name}{labels} not served; served: {sorted(k for k in self if k[0] == name)}"
        return self[key]

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over every sample whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.items() if n == name and want <= set(ls))

    declared: set = set()

    def families(self) -> set[str]:
        """Every sample name served, and every family declared (one with no sample yet, as a
        labelled counter before its first event, counts: its ``# TYPE`` line is served)."""
        return {n for n, _ in self} | self.declared


@pytest.fixture
def scrape():
    """``scrape(url) -> Scrape``: GET the endpoint over HTTP (bounded) and parse the exposition."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def _scrape(url: str) -> Scrape:
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
        out = Scrape()
        out.declared = set()
        for family in text_string_to_metric_families(text):
            out.declared.add(family.name + ("_total" if family.type == "counter" else ""))
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    return _scrape
