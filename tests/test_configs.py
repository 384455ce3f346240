"""Every YAML under conf/ composes and instantiates; registry names equal YAML stems; typos and
wrong types are rejected at compose time; bad values name the field; ``store: null`` is memory."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from cacheseek.cli import CONF_DIR
from cacheseek.errors import ConfigError
from cacheseek.orchestrator import build_stack, instantiate
from cacheseek.registry import LAYOUTS, RUNTIMES, STORES, TRANSFERS, WORKLOADS, import_backends

import_backends()

CONF = Path(CONF_DIR)
REPO = CONF.parent
REGISTRIES = {"store": STORES, "transfer": TRANSFERS, "layout": LAYOUTS, "runtime": RUNTIMES,
              "workload": WORKLOADS}
PRESET_GROUPS = {"experiment", "model"}  # groups of presets (experiment: @package _global_; model: runtime), not backends
HAS_PLAN_TIER = (REPO / "cacheseek" / "stores" / "plan_tier" / "__init__.py").exists()
NEEDS_SERVICE = {"fluxon"}  # compose only: instantiating needs a running Fluxon service
SMALL_SEGMENT = 1 << 20


def stems(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _fake_cudart():
    from fakes.cudart import FakeCudart

    return FakeCudart()


# -- registry names equal YAML stems ---------------------------------------------------------------


def test_every_conf_group_is_a_registry_or_a_preset_group():
    groups = sorted(p.name for p in CONF.iterdir() if p.is_dir())
    assert set(groups) <= set(REGISTRIES) | PRESET_GROUPS, groups
    assert set(REGISTRIES) <= set(groups)
    for group in groups:
        assert stems(group), f"conf/{group} has no YAML"


@pytest.mark.parametrize("group", sorted(REGISTRIES))
def test_registry_names_equal_yaml_stems(group):
    names = set(REGISTRIES[group].names())
    files = set(stems(group))
    if group == "store" and not HAS_PLAN_TIER:  # the Plan tier is not in this checkout yet
        names.discard("fluxon_plan")
        files.discard("fluxon_plan")
    assert names == files, (
        f"registry {group}: only registered {sorted(names - files)}, only YAML {sorted(files - names)}"
    )


@pytest.mark.parametrize("group", sorted(REGISTRIES))
def test_yaml_pulls_in_the_registered_schema(group):
    """Each backend YAML extends its registered schema (that is what rejects typos)."""
    for name in stems(group):
        text = (CONF / group / f"{name}.yaml").read_text()
        assert f"/schema/{group}/{name}@_here_" in text, f"conf/{group}/{name}.yaml"


@pytest.mark.parametrize("group", sorted(REGISTRIES))
def test_every_yaml_key_is_a_constructor_parameter(group):
    """A key a backend YAML sets is a field of the schema made from the constructor's signature."""
    for name in stems(group):
        keys = set(OmegaConf.load(CONF / group / f"{name}.yaml")) - {"defaults"}
        fields = {f.name for f in dataclasses.fields(REGISTRIES[group].schema(name))}
        assert keys <= fields, f"conf/{group}/{name}.yaml: {sorted(keys - fields)} are not parameters"


def test_the_tiered_store_has_a_node_per_registered_store_from_its_yaml(compose_cfg):
    """No list of stores in tiered.yaml: every registered store is a tier, configured by its own YAML."""
    cfg = compose_cfg("+store=tiered")
    for name in set(STORES.names()) - {"tiered"}:
        own = compose_cfg(f"+store={name}").store
        assert cfg.store[name] == own, name


def test_registry_defaults_have_yaml():
    for group, reg in REGISTRIES.items():
        assert reg.default in stems(group), group


# -- every YAML composes and instantiates -----------------------------------------------------------


@pytest.mark.parametrize("name", stems("store"))
def test_store_yaml_composes_and_instantiates(compose_cfg, tmp_path, name):
    overrides = [f"+store={name}"]
    if name == "localdisk":
        overrides.append(f"store.root={tmp_path / 'kv'}")
    if name == "fluxon_plan":
        overrides.append(f"store.segment_bytes={SMALL_SEGMENT}")
    cfg = compose_cfg(*overrides)
    assert cfg.store._target_ == f"{STORES.get(name).__module__}.{STORES.get(name).__qualname__}"
    if name in NEEDS_SERVICE:
        return
    if name == "fluxon_plan" and not HAS_PLAN_TIER:
        pytest.skip("cacheseek/stores/plan_tier/ is not in this checkout")
    stack = build_stack(cfg, run_dir=tmp_path / "run")
    try:
        assert stack.store_name == name
        assert isinstance(stack.store, STORES.get(name))
    finally:
        stack.close()


def test_localdisk_root_null_goes_under_the_run_folder(compose_cfg, tmp_path):
    cfg = compose_cfg("+store=localdisk")
    assert cfg.store.root is None
    stack = build_stack(cfg, run_dir=tmp_path / "run")
    try:
        assert Path(stack.store.root) == tmp_path / "run" / "kvstore"
    finally:
        stack.close()


@pytest.mark.parametrize("name", stems("transfer"))
def test_transfer_yaml_composes_and_instantiates(compose_cfg, name):
    from cacheseek.transfer.base import TransferRuntimeBase

    from hydra.utils import instantiate as hydra_instantiate

    cfg = compose_cfg(f"transfer={name}")
    kwargs = {"cudart": _fake_cudart()} if name == "cuda" and not cuda_available() else {}
    # hydra's own instantiate: the ``auto`` target is a factory function, not a class
    obj = hydra_instantiate(cfg.transfer, _convert_="all", **kwargs)
    try:
        if name == "auto":  # a factory: follows the device (cpu here)
            assert isinstance(obj, TRANSFERS.get("host"))
        else:
            assert isinstance(obj, TRANSFERS.get(name))
        assert isinstance(obj, TransferRuntimeBase)
    finally:
        obj.close()


@pytest.mark.parametrize("name", stems("transfer"))
def test_transfer_yaml_builds_a_stack(compose_cfg, tmp_path, name):
    cfg = compose_cfg(f"transfer={name}")
    kwargs = {"cudart": _fake_cudart()} if name == "cuda" and not cuda_available() else {}
    stack = build_stack(cfg, run_dir=tmp_path, **kwargs)
    try:
        expected = "host" if name == "auto" else name
        assert isinstance(stack.transfer, TRANSFERS.get(expected))
    finally:
        stack.close()
        stack.transfer.close()


@pytest.mark.parametrize("name", stems("layout"))
def test_layout_yaml_composes_and_instantiates(compose_cfg, name):
    cfg = compose_cfg(f"layout={name}")
    expected = "bshd" if name == "auto" else name  # auto: a factory; follows the runtime (none here)
    assert isinstance(instantiate(cfg.layout), LAYOUTS.get(expected))


class _RuntimeNamingItsLayout:
    layout_name = "telefuser_main"


def test_auto_layout_follows_the_runtime_and_a_contrary_choice_is_refused(compose_cfg):
    from cacheseek.orchestrator import build_layout

    runtime = _RuntimeNamingItsLayout()
    assert isinstance(build_layout(compose_cfg().layout, runtime), LAYOUTS.get("telefuser_main"))
    assert isinstance(build_layout(compose_cfg().layout, object()), LAYOUTS.get("bshd"))
    with pytest.raises(ConfigError, match="layout=telefuser_main"):
        build_layout(compose_cfg("layout=bshd").layout, runtime)


@pytest.mark.parametrize("name", stems("runtime"))
def test_runtime_yaml_composes_and_instantiates(compose_cfg, name):
    if name == "telefuser":
        pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")
    cfg = compose_cfg(f"runtime={name}")
    factory = instantiate(cfg.runtime)
    assert isinstance(factory, RUNTIMES.get(name))
    rt = factory.make([[0.0, 0.1], [0.2, 0.3]])
    assert len(rt.generate()) == 2


@pytest.mark.parametrize("name", stems("workload"))
def test_workload_yaml_composes_and_instantiates(compose_cfg, name):
    cfg = compose_cfg(f"workload={name}")
    assert isinstance(instantiate(cfg.workload), WORKLOADS.get(name))


@pytest.mark.parametrize("name", stems("experiment"))
def test_experiment_yaml_composes_and_instantiates(compose_cfg, tmp_path, name):
    cfg = compose_cfg(f"+experiment={name}")
    OmegaConf.to_container(cfg, resolve=True)
    small = []
    if cfg.runtime._target_.endswith("TeleFuserRuntimeFactory"):  # a real-width DiT: built small here
        pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra")
        small = ["runtime.n_layers=1", "runtime.n_heads=1", "runtime.head_dim=14", "runtime.ffn_dim=32",
                 "runtime.text_dim=16", "runtime.height=32", "runtime.width=32"]
    if cfg.runtime.device.startswith("cuda") and not cuda_available():
        with pytest.raises(ConfigError) as ei:
            build_stack(cfg, run_dir=tmp_path)
        assert ei.value.field == "runtime.device"
        cfg = compose_cfg(f"+experiment={name}", "runtime.device=cpu", *small)
    elif small:
        cfg = compose_cfg(f"+experiment={name}", *small)
    stack = build_stack(cfg, run_dir=tmp_path)
    try:
        assert stack.runtime_factory.geometry.name == cfg.runtime.get("geometry", "telefuser")
        stack.manager_config()  # the manager window agrees with the preset's ring
        workload = instantiate(cfg.workload)  # the preset's workload (abcd unless it overrides it)
        registered = {f"{c.__module__}.{c.__qualname__}": c for c in map(WORKLOADS.get, WORKLOADS.names())}
        assert isinstance(workload, registered[cfg.workload._target_])
    finally:
        stack.close()


# -- typos and wrong types are rejected at compose time ----------------------------------------------


def _chain(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["+store=localdisk", "store.rooot=/x"], "store.rooot"),
        (["+store=localdisk", "store.write_back=maybe"], "store.write_back"),
        (["+store=localdisk", "store.queue_depth=deep"], "store.queue_depth"),
        (["+store=memory", "store.root=/x"], "store.root"),
        (["runtime.local_attn_size=abc"], "runtime.local_attn_size"),
        (["runtime.geometri=tiny"], "runtime.geometri"),
        (["runtime.num_steps=1.5"], "runtime.num_steps"),
        (["manager.break_even=2"], "manager.break_even"),
        (["manager.break_even_k=two"], "manager.break_even_k"),
        (["workload.total_chunks=x"], "workload.total_chunks"),
        (["workload.ring_check=perhaps"], "workload.ring_check"),
        (["namespace.feilds=[seed]"], "namespace.feilds"),
        (["+store=fluxon_plan", "store.client_options.io_threads=many"], "store.client_options.io_threads"),
        (["+store=fluxon_plan", "store.client_options.stagin_bytes=1GiB"], "store.client_options.stagin_bytes"),
        (["+store=fluxon_plan", "store.staging_slots=two"], "store.staging_slots"),
        (["+store=nope"], "store/nope"),
        (["transfer=nope"], "transfer/nope"),
        (["+experiment=nope"], "experiment/nope"),
    ],
)
def test_typos_and_wrong_types_rejected_at_compose(compose_cfg, overrides, field):
    with pytest.raises(ConfigCompositionException) as ei:
        compose_cfg(*overrides)
    assert field in _chain(ei.value)


# -- values only the registries can check: ConfigError naming the field at build time ---------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["runtime.geometry=huge"], "runtime.geometry"),
        (["runtime.local_attn_size=4", "runtime.sink_size=3"], "runtime.local_attn_size"),
        (["runtime.dtype=int8"], "runtime.dtype"),
        (["runtime.device=tpu"], "runtime.device"),
        (["runtime.num_steps=0"], "runtime.num_steps"),
        (["namespace.fields=[seed,nope]"], "namespace.fields"),
        (["+store=localdisk", "store.root=/proc/forbidden"], "store.root"),
        (["+store=localdisk", "store.queue_depth=0"], "store.queue_depth"),
        (["layout=telefuser_main"], "layout"),  # the synthetic runtime's sessions are bshd
        (["+store=localdisk", "+store.rooot=x"], "store.rooot"),  # + adds a key the schema lacks
        (["+manager.foo=1"], "manager.foo"),
        (["+store.capacity_bytes=1GiB"], "store"),  # no store chosen
        (["manager.break_even_k=-1"], "manager.break_even_k"),
        (["manager.decoder_state_every=-2"], "manager.decoder_state_every"),
        (["manager.eviction.high_watermark=1.5"], "manager.eviction.high_watermark"),
        (["+store=memory", "store.capacity_bytes=1.5GB"], "store.capacity_bytes"),
        (["+store=fluxon_plan", "store.client_options.staging_bytes=1GiB"], "store.client_options.staging_bytes"),
    ],
)
def test_bad_values_name_the_field(compose_cfg, tmp_path, overrides, field):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as ei:
        build_stack(cfg, run_dir=tmp_path).close()
    assert ei.value.field == field
    assert str(ei.value).startswith(field)


def test_a_bad_manager_section_is_refused_before_the_store_is_built(compose_cfg, tmp_path):
    cfg = compose_cfg("+store=localdisk", "manager.break_even_k=0")
    with pytest.raises(ConfigError, match=r"manager\.break_even_k=1"):
        build_stack(cfg, run_dir=tmp_path)
    assert not (tmp_path / "kvstore").exists()


def test_a_store_field_without_a_store_names_a_store_that_has_it():
    from cacheseek.hydra_errors import choose_a_store

    assert choose_a_store("store", {"capacity_bytes": "1GiB"}).fix == \
        "choose a store first: +store=memory store.capacity_bytes=1GiB"  # the default store has it
    assert "+store=localdisk store.root=/tmp/kv" in choose_a_store("store", {"root": "/tmp/kv"}).fix
    assert "+store=localdisk store.root=x (rooot: no store has it)" in choose_a_store("store", {"rooot": "x"}).fix
    assert "+store=NAME" in choose_a_store("store", {"nothing_like_it": 1}).fix
    assert "defaults" not in choose_a_store("store", {"default": 1}).fix  # the tiered store's Hydra list is no field


def test_disk_root_under_a_regular_file_names_store_root(compose_cfg, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    cfg = compose_cfg("+store=localdisk", f"store.root={f / 'sub'}")
    with pytest.raises(ConfigError) as ei:
        build_stack(cfg, run_dir=tmp_path)
    assert ei.value.field == "store.root"


def test_sink_in_full_length_mode_names_the_field(compose_cfg, tmp_path):
    """A sink with full-length attention is rejected (by the binding, at the first session)."""
    from cacheseek.cli import run

    cfg = compose_cfg("runtime.sink_size=2")
    with pytest.raises(ConfigError) as ei:
        run(cfg, tmp_path)
    assert ei.value.field == "runtime.sink_size"


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["workload.total_chunks=1"], "workload.total_chunks"),
        (["workload.prefix_chunks=0"], "workload.prefix_chunks"),
        (["workload.prefix_chunks=4"], "workload.prefix_chunks"),
    ],
)
def test_bad_workload_values_name_the_field(compose_cfg, overrides, field):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as ei:
        instantiate(cfg.workload)
    assert ei.value.field == field


def test_bad_break_even_is_a_config_error(compose_cfg, tmp_path):
    cfg = compose_cfg("manager.break_even_k=0")
    with pytest.raises(ConfigError) as ei:
        build_stack(cfg, run_dir=tmp_path)
    assert ei.value.field == "manager.break_even_k"


# -- store: null is the embedded default -------------------------------------------------------------


def test_store_null_resolves_to_memory(compose_cfg, tmp_path, caplog):
    from cacheseek.stores.memory import InMemoryTierStore

    cfg = compose_cfg()
    assert cfg.store is None
    with caplog.at_level(logging.INFO, logger="cacheseek.orchestrator"):
        stack = build_stack(cfg, run_dir=tmp_path)
    try:
        assert stack.store_name == "memory" == STORES.default
        assert isinstance(stack.store, InMemoryTierStore)
        assert any("store: null" in r.getMessage() for r in caplog.records)
    finally:
        stack.close()


def test_explicit_store_memory_equals_default(compose_cfg, tmp_path):
    stack = build_stack(compose_cfg("+store=memory"), run_dir=tmp_path)
    try:
        assert stack.store_name == "memory"
    finally:
        stack.close()
