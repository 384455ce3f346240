"""Shared fixtures: composed Hydra configs (no output folders) and torch availability."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import cacheseek.schema  # noqa: F401
from cacheseek.cli import CONF_DIR
from cacheseek.registry import import_backends

import_backends()


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> DictConfig composed from conf/ like the CLI does."""

    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    yield _compose
    GlobalHydra.instance().clear()
