"""How a `CacheMetrics` field is exported: the Prometheus family it feeds, declared on the field.

A counter of `cacheseek.metrics.CacheMetrics` is one attrs field, and the field says what it is
on the endpoint, so that adding a counter is one line in one place::

    frames_decoded: int = counter("cacheseek_decoded_frames_total", "Frames decoded from stored latents.")

That line puts ``frames_decoded`` in ``results.json`` (``CacheMetrics.as_dict``), makes
``metrics.add(frames_decoded=n)`` count it, and exposes ``cacheseek_decoded_frames_total`` on the
endpoint (`cacheseek.prometheus`); the test of the endpoint checks every declared family is served.
Three kinds of field:

- `counter` (an ``int``, or a ``float`` of seconds with ``default=0.0``): one sample; constant
  ``labels`` let several fields share a family (``cacheseek_lookups_total{kind="prefix"}`` and
  ``{kind="live"}``);
- `labelled` (a dict from a tuple of label values to a number): one sample per key;
- `histogram` (a dict from a tuple of label values to a `Histogram` with ``bounds``).

Names follow Prometheus's rules: ``cacheseek_`` prefix, base units (seconds, bytes) in the name,
``_total`` on counters. Label values must come from bounded sets (a tier, a direction, a hook
name): never a session, a key or a path.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["EXPORT", "Export", "counter", "labelled", "histogram", "exports"]

EXPORT = "cacheseek.export"  # the attrs metadata key


@attrs.frozen(slots=True)
class Export:
    """One field's place on the endpoint: ``family`` (its full name; a counter's ends in
    ``_total``), ``kind`` (``counter``, ``labelled``, ``histogram``), ``help``, constant
    ``labels`` (a counter's), ``label_names`` (the key order of a labelled or histogram dict)
    and the histogram's ``bounds``."""

    family: str
    kind: str = attrs.field(validator=attrs.validators.in_(("counter", "labelled", "histogram")))
    help: str
    labels: tuple[tuple[str, str], ...] = ()
    label_names: tuple[str, ...] = ()
    bounds: tuple[float, ...] = ()

    def __attrs_post_init__(self) -> None:
        if not self.family.startswith("cacheseek_"):
            raise ValueError(f"{self.family}: exported metrics are named cacheseek_*")
        if self.kind != "histogram" and not self.family.endswith("_total"):
            raise ValueError(f"{self.family}: a counter's name ends in _total")


def counter(family: str, help: str, *, default: Any = 0, **labels: str) -> Any:
    """A scalar counter field exported as ``family{labels}``."""
    return attrs.field(default=default, metadata={EXPORT: Export(family, "counter", help, tuple(labels.items()))})


def labelled(family: str, help: str, *label_names: str) -> Any:
    """A dict field ``{(label values...): count}`` exported as ``family{label_names}``."""
    return attrs.field(factory=dict, metadata={EXPORT: Export(family, "labelled", help, (), label_names)})


def histogram(family: str, help: str, bounds: tuple[float, ...], *label_names: str) -> Any:
    """A dict field ``{(label values...): Histogram}`` exported as histogram ``family``."""
    return attrs.field(factory=dict, metadata={EXPORT: Export(family, "histogram", help, (), label_names,
                                                              tuple(bounds))})


def exports(cls: type) -> list[tuple[str, Export]]:
    """``(field name, Export)`` of every exported field of the attrs class ``cls``, in order."""
    return [(f.name, f.metadata[EXPORT]) for f in attrs.fields(cls) if EXPORT in f.metadata]
