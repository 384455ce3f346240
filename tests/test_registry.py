"""The lazy registry: a name resolves to its class on first use, duplicates are refused, and a
miss lists the known names."""

import subprocess
import sys

import pytest

from cacheseek.errors import ConfigError
from cacheseek.registry import STORES, Registry


def test_a_name_is_imported_on_first_use_only():
    code = ("import sys\nfrom cacheseek.registry import STORES\n"
            "assert 'localdisk' in STORES and 'cacheseek.stores.localdisk' not in sys.modules\n"
            "cls = STORES.get('localdisk')\n"
            "assert cls.__name__ == 'LocalDiskTierStore' and 'cacheseek.stores.localdisk' in sys.modules\n"
            "assert STORES.schema('localdisk').__name__ == 'LocalDiskSchema'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_duplicates_are_refused_and_a_miss_names_the_known():
    reg = Registry("thing", {"a": "collections:OrderedDict"})
    with pytest.raises(ValueError, match="duplicate name 'a'"):
        reg.register("a")(dict)
    reg.register("b")(dict)
    reg.register("b")(dict)  # the same object again is no duplicate
    with pytest.raises(ValueError, match="duplicate name 'b'"):
        reg.register("b")(list)
    import collections

    assert reg.get("a") is collections.OrderedDict and reg.names() == ["a", "b"]
    with pytest.raises(ConfigError, match="use one of: a, b"):
        reg.get("c")


def test_every_entry_resolves_to_the_class_that_registered_it():
    for name in STORES.names():
        cls = STORES.get(name)
        assert STORES.get(name) is cls and STORES.schema(name) is not None
