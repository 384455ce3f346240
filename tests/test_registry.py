"""The registries: a backend named once at its class is read off the source and imported on
first use, duplicates are refused, a miss lists the known names, and a config is the
constructor's signature."""

import collections
import dataclasses
import inspect
import subprocess
import sys
from typing import Any, Optional

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from cacheseek.errors import ConfigError
from cacheseek.registry import LAYOUTS, REGISTRIES, STORES, Registry, import_backends, schema_of


def test_a_name_is_read_off_the_source_and_imported_on_first_use_only():
    """Naming a backend once, at its class, is enough: the registry reads the name off its
    package's source (no import) and imports the module when the name is first used."""
    code = ("import sys\nfrom cacheseek.registry import STORES\n"
            "assert 'localdisk' in STORES and 'cacheseek.stores.localdisk' not in sys.modules\n"
            "assert 'fluxon_plan' in STORES.names() and 'torch' not in sys.modules\n"
            "cls = STORES.get('localdisk')\n"
            "assert cls.__name__ == 'LocalDiskTierStore' and 'cacheseek.stores.localdisk' in sys.modules\n"
            "assert STORES.schema('localdisk').__name__ == 'LocalDiskTierStoreConfig'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_duplicates_are_refused_and_a_miss_names_the_known():
    reg = Registry("thing")
    reg.register("a")(collections.OrderedDict)
    with pytest.raises(ValueError, match="duplicate name 'a'"):
        reg.register("a")(dict)
    reg.register("b")(dict)
    reg.register("b")(dict)  # the same object again is no duplicate
    with pytest.raises(ValueError, match="duplicate name 'b'"):
        reg.register("b")(list)
    assert reg.get("a") is collections.OrderedDict and reg.names() == ["a", "b"] and reg.name_of(dict) == "b"
    with pytest.raises(ConfigError, match="use one of: a, b"):
        reg.get("c")


def test_a_backend_registered_late_is_in_the_schemas_that_list_every_backend():
    """A configured registry stores each schema once its backends are found; one registered after
    that (a module imported later) gets its schema at once, and a schema built from the list of
    backends (the tiered store's one node per store) is built again with it."""
    reg = Registry("late_thing", configured=True)

    class Listing:
        def __init__(self, **nodes: Any) -> None: ...

    class Late:
        def __init__(self, size: int = 1) -> None: ...

    reg.register("listing", keywords=lambda: [(n, Any, None) for n in reg.names() if n != "listing"])(Listing)
    reg.register("late")(Late)
    assert [f.name for f in dataclasses.fields(reg.schema("listing"))] == ["_target_", "late"]
    assert OmegaConf.structured(reg.schema("late")).size == 1


def test_every_entry_resolves_to_the_class_that_registered_it():
    for name in STORES.names():
        cls = STORES.get(name)
        assert STORES.get(name) is cls and STORES.schema(name) is not None


def _entries():
    import_backends()
    return [(reg, name) for reg in REGISTRIES for name in reg.names()]


@pytest.mark.parametrize("reg, name", _entries(), ids=lambda x: getattr(x, "group", x))
def test_a_config_default_is_the_constructors_default(reg, name):
    """Every field of a backend's schema is a parameter of its constructor, with the same
    default (or, for ``**kwargs`` fields, one the constructor does not name)."""
    params = inspect.signature(reg.get(name)).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for f in dataclasses.fields(reg.schema(name)):
        if f.name == "_target_":
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if f.name not in params:
            assert takes_kwargs, f"{reg.group}/{name}: {f.name} is not a constructor parameter"
            continue
        given = params[f.name].default
        given = "???" if given is inspect.Parameter.empty else list(given) if isinstance(given, tuple) else given
        assert default == given, f"{reg.group}/{name}.{f.name}: config {default!r}, constructor {given!r}"


def test_the_schema_is_the_signature_less_the_objects_handed_over():
    class Thing:
        def __init__(self, path: str, size: int = 3, name: Optional[str] = None, tags: tuple = ("a",),
                     anything: "dict[str, Any] | None" = None, *, client: Any = None) -> None: ...

    schema = schema_of(Thing, objects=("client",), keywords=[("extra", Any, None)])
    fields = {f.name: f for f in dataclasses.fields(schema)}
    assert list(fields) == ["_target_", "path", "size", "name", "tags", "anything", "extra"]
    assert fields["size"].type is int and fields["name"].type == Optional[str] and fields["anything"].type is Any
    cfg = OmegaConf.structured(schema)
    assert cfg.tags == ["a"] and cfg.size == 3 and OmegaConf.is_missing(cfg, "path")
    with pytest.raises(ValidationError, match="size"):
        cfg.size = "big"  # a wrong type is refused, naming the field
    with pytest.raises(TypeError, match="objects"):
        schema_of(Thing, objects=("nope",))


def test_plan_client_options_are_typed_and_checked_when_the_client_is_built():
    from cacheseek.stores.plan_tier import PlanTierStore

    options = OmegaConf.structured(STORES.schema("fluxon_plan")).client_options
    with pytest.raises(ValidationError, match="io_threads"):
        options.io_threads = "many"
    with pytest.raises(ConfigError, match="store.client_options.staging_bytes") as info:
        PlanTierStore(segment_bytes="1MiB", client_options={"staging_bytes": "1GiB"})
    assert "embedded" in str(info.value)


def test_every_store_class_declares_the_tier_it_is():
    from cacheseek.kv.handles import Tier

    tiers = {name: STORES.get(name).tier for name in STORES.names() if name != "tiered"}
    assert all(isinstance(t, Tier) for t in tiers.values()), tiers
    assert (tiers["hbm"], tiers["localdisk"], tiers["memory"]) == (Tier.HBM_STAGING, Tier.DISK, Tier.CPU)


def test_layouts_declare_the_runtimes_and_releases_they_match():
    from types import SimpleNamespace

    from cacheseek.integrations.telefuser.layouts import TeleFuserLayout
    from cacheseek.layout.auto import layout_name_of_runtime

    assert layout_name_of_runtime(SimpleNamespace(self_kv_cache=[])) == "bshd"
    assert layout_name_of_runtime(SimpleNamespace(cache_handle=object())) == "telefuser_main"
    assert layout_name_of_runtime(SimpleNamespace()) == "bshd"  # the default
    assert {r.value: r.layout_name for r in TeleFuserLayout} == {
        "hooked": "bshd", "released": "bshd", "main": "telefuser_main"}
    claimed = [r for name in LAYOUTS.names() if name != "auto" for r in LAYOUTS.get(name).telefuser_releases]
    assert sorted(claimed) == sorted(r.value for r in TeleFuserLayout), "each release laid out by one layout"
