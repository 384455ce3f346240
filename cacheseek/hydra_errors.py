"""Hydra's compose errors as `ConfigError`: the field, what is wrong, and the override that works.

Hydra reports a bad override in 6 to 14 lines (the exception, its OmegaConf cause, the config
search path, a hint about HYDRA_FULL_ERROR). `config_error_from_hydra` reads the exception
objects instead of the text where it can (``MissingConfigException.options``, the cause's
``full_key`` and ``object_type``) and returns one `ConfigError`, or None for an exception that is
not a bad input. The cases:

- an unknown option of a group (``+store=nope``): the field is the group, the fix lists the options;
- ``store=localdisk`` for a group that is not in the defaults list: the fix is ``+store=localdisk``;
- a key that is not in a schema (``store.rooot=x``): the fix names the closest fields;
- a value of the wrong type (``runtime.local_attn_size=abc``): the fix says which type;
- a group chosen twice, an override that does not parse.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Optional

from cacheseek.errors import ConfigError

__all__ = ["APPENDED_GROUPS", "config_error_from_hydra"]

# Groups that are not in conf/config.yaml's defaults list: they are picked with a leading "+".
APPENDED_GROUPS = ("store", "experiment")

_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def config_error_from_hydra(exc: BaseException) -> Optional[ConfigError]:
    """The `ConfigError` that ``exc`` (raised while Hydra composed the config) stands for."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

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
    m = re.search(r"Could not override '([^']+)'\. No match in the defaults list", text)
    if m:
        group = m.group(1)
        hint = re.search(r"use (\+\S+)", text)
        return ConfigError(group, f"{group} is not in the defaults list, so it is picked with a leading +",
                           f"write {hint.group(1) if hint else '+' + group + '=NAME'}")
    m = re.search(r"Multiple values for (\S+?)\.", text)
    if m:
        group = m.group(1)
        return ConfigError(group, f"{group} is chosen more than once",
                           f"give +{group}=NAME once (a sweep over several is -m +{group}=a,b)")
    field = None
    m = re.search(r"(?:Could not override|Could not append to config\. An item is already at) '([^']+)'", text) \
        or re.search(r"Error merging override \+?([^=\s]+)=", text)
    if m:
        field = m.group(1)
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf(cause, getattr(cause, "full_key", None) or field or "config")
    return ConfigError(field or "config", _first_line(exc))


def _omegaconf(exc: Any, field: str) -> ConfigError:
    from omegaconf.errors import ConfigKeyError, ValidationError

    message = _first_line(exc)
    if isinstance(exc, ValidationError):
        m = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", message)
        if m:
            want = _TYPE_WORDS.get(m.group(3), m.group(3).lower())
            return ConfigError(field, f"{m.group(1)!r} is not {want}", f"give {want}: {field}=...")
        return ConfigError(field, message)
    if isinstance(exc, (ConfigKeyError, AttributeError)) and "not in" in message:
        return _unknown_key(field, getattr(exc, "object_type", None))
    return ConfigError(field, message)


def _unknown_key(field: str, object_type: Any) -> ConfigError:
    parent, _, key = field.rpartition(".")
    if object_type is None or not dataclasses.is_dataclass(object_type):
        return ConfigError(field, "no such field", f"a new key in an open section takes a leading +: +{field}=...")
    names = [f.name for f in dataclasses.fields(object_type) if not f.name.startswith("_")]
    prefix = f"{parent}." if parent else ""
    close = difflib.get_close_matches(key, names, n=2)
    hint = f"did you mean {' or '.join(prefix + c for c in close)}? " if close else ""
    return ConfigError(field, f"no such field in {object_type.__name__}",
                       f"{hint}the fields are: {', '.join(names)}")
