"""Hydra's compose errors as `ConfigError`: the field, what is wrong, and the override that works.

Hydra reports a bad override in 6 to 14 lines (the exception, its OmegaConf cause, the config
search path, a hint about HYDRA_FULL_ERROR). `config_error_from_hydra` reads the exception
objects instead of the text where it can (``MissingConfigException.options``, the cause's
``full_key`` and ``object_type``) and returns one `ConfigError`, or None for an exception that is
not a bad input. The cases:

- an unknown option of a group (``+store=nope``): the field is the group, the fix lists the options;
- ``store=localdisk`` for a group that is not in the defaults list: the fix is ``+store=localdisk``;
- a key that is not in a schema (``store.rooot=x``): the fix names the closest fields;
- a store's key while no store is chosen (``store.capacity_bytes=1GiB``): the fix chooses a store
  that has the key (`choose_a_store`), so that following it gives a run, not a second error;
- a value of the wrong type (``runtime.local_attn_size=abc``, ``store.fsync=maybe``): the fix
  says which type;
- a comma list outside a sweep (``store.tiers=hbm,localdisk``): the fix writes the brackets;
- a group chosen twice, an override that does not parse;
- a preset for another runtime (``+model=lingbot_world_14b`` sets TeleFuser's fields while the
  runtime is the synthetic one): the fix chooses the runtime whose schema has them.

Hydra adds a key with a leading ``+`` even to a typed section (``+store.rooot=x`` once a store
is chosen), where the constructor would fail on it with a traceback; `appended_key` finds such a
key in the composed config, for the orchestrator to refuse like a typo.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Optional

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from cacheseek.errors import ConfigError
from cacheseek.registry import RUNTIMES, STORES

__all__ = ["APPENDED_GROUPS", "appended_key", "choose_a_store", "config_error_from_hydra"]

# Groups that are not in conf/config.yaml's defaults list: they are picked with a leading "+".
APPENDED_GROUPS = ("store", "experiment")

# Groups of conf/: ``GROUP=a,b`` outside a sweep is two choices, not a list.
_GROUPS = ("runtime", "transfer", "layout", "workload") + APPENDED_GROUPS

_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string",
               "int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def config_error_from_hydra(exc: BaseException) -> Optional[ConfigError]:
    """The `ConfigError` that ``exc`` (raised while Hydra composed the config) stands for."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, MissingConfigException):
        return _missing_option(exc)
    if isinstance(exc, OverrideParseException):
        override = getattr(exc, "override", "") or ""
        field = override.split("=", 1)[0].lstrip("+~") or "overrides"
        return ConfigError(field, f"cannot parse the override {override!r}: {_first_line(exc)}",
                           "write KEY=VALUE; quote values with spaces, brackets or commas: "
                           "'store.root=\"/tmp/a b\"'")
    if isinstance(exc, ConfigCompositionException):
        return _composition(exc)
    if isinstance(exc, OmegaConfBaseException):
        return _omegaconf(exc, getattr(exc, "full_key", None) or "config")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _missing_option(exc: Any) -> ConfigError:
    missing = str(getattr(exc, "missing_cfg_file", "") or "")
    group, _, option = missing.rpartition("/")
    options = [o for o in (getattr(exc, "options", None) or []) if not o.startswith("_")]
    if not group:  # the primary config itself, or a path Hydra could not split
        return ConfigError("config", _first_line(exc))
    plus = "+" if group in APPENDED_GROUPS else ""
    fix = f"use {plus}{group}=NAME with NAME one of: {', '.join(options)}" if options else \
        f"see python -m cacheseek --help for the {group} options"
    return ConfigError(group, f"unknown {group} {option!r}", fix)


def _composition(exc: BaseException) -> ConfigError:
    text = str(exc)
    cause = exc.__cause__
    if m := re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text):
        return _comma_list(m.group(1), m.group(2))
    if m := re.search(r"Could not override '([^']+)'\. No match in the defaults list", text):
        group = m.group(1)
        hint = re.search(r"use (\+\S+)", text)
        return ConfigError(group, f"{group} is not in the defaults list, so it is picked with a leading +",
                           f"write {hint.group(1) if hint else '+' + group + '=NAME'}")
    if m := re.search(r"Multiple values for (\S+?)\.", text):
        group = m.group(1)
        return ConfigError(group, f"{group} is chosen more than once",
                           f"give +{group}=NAME once (a sweep over several is -m +{group}=a,b)")
    if m := re.search(r"In '([^/']+)/([^']+)': \w+ raised while composing config:\s*Key '([^']+)' not in '(\w+)'",
                      text):
        return _preset_for_another_runtime(*m.groups())
    m = re.search(r"(?:Could not override|Could not append to config\. An item is already at) '([^']+)'", text) \
        or re.search(r"Error merging override \+?([^=\s]+)=", text)
    field = m.group(1) if m else None
    if isinstance(cause, OmegaConfBaseException):
        given = re.search(r"use \+[^=\s]+=(.*)", text) \
            or re.search(r"Error merging override \+?[^=\s]+=(.*)", text)  # the override's value
        return _omegaconf(cause, getattr(cause, "full_key", None) or field or "config",
                          given.group(1).strip() if given else "...")
    return ConfigError(field or "config", _first_line(exc))


def _preset_for_another_runtime(group: str, name: str, key: str, schema: str) -> ConfigError:
    """``+GROUP=NAME`` sets ``key``, which the chosen runtime's ``schema`` lacks: the fix chooses a
    runtime that has it (a model preset is TeleFuser's), else says which key does not fit."""
    runtimes = [n for n in RUNTIMES.names() if key in _schema_fields(RUNTIMES, n)]
    plus = "" if group in ("runtime", "transfer", "layout", "workload") else "+"
    if runtimes:
        return ConfigError(group, f"{name} sets runtime.{key}, which the chosen runtime ({schema}) does not have: "
                           f"it is a preset of runtime={runtimes[0]}",
                           f"choose that runtime with it: runtime={runtimes[0]} {plus}{group}={name}")
    return ConfigError(group, f"{name} sets {key}, which {schema} does not have",
                       f"see python -m cacheseek --help for what {group} presets fit")


def _comma_list(key: str, value: str) -> ConfigError:
    """``KEY=a,b`` in a single run: Hydra reads it as a sweep. A group takes one choice; a field
    that holds a list takes brackets."""
    field = key.lstrip("+~")
    sweep = f"a sweep over them is -m {key}={value}"
    if field in _GROUPS:
        first = value.split(",")[0]
        return ConfigError(field, f"{value!r} is several choices, and a run takes one",
                           f"choose one: {key}={first}; {sweep}")
    return ConfigError(field, f"{value!r} is read as a sweep over several values",
                       f"a list takes brackets: {key}=[{value}]; {sweep}")


def _omegaconf(exc: Any, field: str, given: str = "...") -> ConfigError:
    message = _first_line(exc)
    if isinstance(exc, ValidationError):
        m = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", message) \
            or re.search(r"Value '(.*)' is not a valid (\w+)", message)
        if m:
            want = _TYPE_WORDS.get(m.group(m.lastindex), m.group(m.lastindex).lower())
            value = "true" if want == "true or false" else "..."
            return ConfigError(field, f"{m.group(1)!r} is not {want}", f"give {want}: {field}={value}")
        if "is not a ListConfig, list or tuple" in message:
            return ConfigError(field, f"{given!r} is one value, and {field} takes a list",
                               f"a list takes brackets: {field}=[{given}]")
        return ConfigError(field, message)
    if isinstance(exc, (ConfigKeyError, AttributeError)) and "not in" in message:
        return unknown_key(field, getattr(exc, "object_type", None), given)
    return ConfigError(field, message)


def unknown_key(field: str, object_type: Any, given: str = "...") -> ConfigError:
    """``field`` is not a field of ``object_type`` (a schema dataclass; None: the section is open,
    or it is ``store`` and no store is chosen). ``given``: the value the user wrote."""
    parent, _, key = field.rpartition(".")
    if parent == "store" and not dataclasses.is_dataclass(object_type):  # store: null, an empty dict
        return choose_a_store(field, {key: given})
    if object_type is None or not dataclasses.is_dataclass(object_type):
        return ConfigError(field, "no such field", f"a new key in an open section takes a leading +: +{field}=...")
    names = [f.name for f in dataclasses.fields(object_type) if not f.name.startswith("_")]
    prefix = f"{parent}." if parent else ""
    close = difflib.get_close_matches(key, names, n=2)
    hint = f"did you mean {' or '.join(prefix + c for c in close)}? " if close else ""
    return ConfigError(field, f"no such field in {object_type.__name__}",
                       f"{hint}the fields are: {', '.join(names)}")


def choose_a_store(field: str, given: dict[str, Any], what: str = "") -> ConfigError:
    """``store.KEY=VALUE`` overrides (``given`` by key; ``what`` names them where ``field`` does
    not) set while no store is chosen.
    The fix chooses a store whose schema has every key, the default store first, and repeats
    the values, so that the command it shows runs; a key no store has gets the closest one."""
    fields = {name: _schema_fields(STORES, name) for name in STORES.names()}
    order = sorted(fields, key=lambda name: name != STORES.default)
    keys = dict(given)
    for key in list(keys):
        if not any(key in names for names in fields.values()):
            close = difflib.get_close_matches(key, sorted(set().union(*fields.values())), n=1)
            if close:
                keys[close[0]] = keys.pop(key)
    store = next((name for name in order if set(keys) <= fields[name]), None)
    problem = f"{what} set, but no store was chosen".strip()
    if store is None:
        return ConfigError(field, problem, f"choose one first: +store=NAME, NAME one of "
                           f"{', '.join(STORES.names())}, then its fields (+store=NAME --cfg job lists them)")
    unknown = sorted(set(given) - set(keys))
    renamed = f" ({', '.join(unknown)}: no store has it)" if unknown else ""
    settings = " ".join(f"store.{k}={_override_value(v)}" for k, v in keys.items())
    return ConfigError(field, problem, f"choose a store first: +store={store} {settings}{renamed}")


def _schema_fields(registry: Any, name: str) -> set[str]:
    try:
        schema = registry.schema(name)
    except KeyError:
        return set()
    # ``defaults``: the tiered store's Hydra defaults list (`level_keywords`), not a field to set
    return {f.name for f in dataclasses.fields(schema) if not f.name.startswith("_") and f.name != "defaults"}


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return "..." if isinstance(value, (dict, list)) else str(value)


def appended_key(cfg: Any) -> Optional[ConfigError]:
    """The first key of ``cfg`` (a composed config) that its section's schema lacks, as a
    `ConfigError` naming it and the closest fields; None when there is none. Hydra lets
    ``+section.key=...`` add one to a typed section; the constructor would fail on it."""
    def walk(node: Any, path: str) -> Optional[ConfigError]:
        kind = OmegaConf.get_type(node)
        names = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
        for key in node:
            field = f"{path}{key}"
            if names is not None and key not in names:
                return unknown_key(field, kind)
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
                found = walk(child, field + ".")
                if found is not None:
                    return found
        return None

    return walk(cfg, "") if isinstance(cfg, DictConfig) else None
