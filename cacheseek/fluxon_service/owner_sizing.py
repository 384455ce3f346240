"""How much ``dram`` an owner needs for a geometry's values to survive: the rule checked at start.

fluxon-py 0.2.4's master keeps, per owner, a cache of 0.8 x dram split into ``CACHE_SEGMENTS`` (8)
segments, and a value's power-of-two slot must fit one of them: a larger one is evicted at once,
silently (seen: both 64 MiB payloads, 128 MiB slots, vanished from a 1 GiB owner; 3 GiB kept them). So an owner
needs ``dram >= DRAM_PER_SLOT x slot`` of the largest value the geometry writes (a 480p KV value
is 45.7 MiB of payload in a 64 MiB slot: 640 MiB). Each such step holds at most 8 of those
values (one per segment), fewer in practice: values spread unevenly over the segments, and one
that lands in a full segment evicts another (experiments/multi_host/probe.py: a 640 MiB owner
kept 6 of 12 such values, 1280 MiB 14 of 20; an evicted value is a miss, never other bytes).
An owner holds the values placed on it and replicas: a value another host put is pulled into a
new slot of the reading host's segment on its first read there. ``values`` is how many
largest-slot values (placed and replicas) one owner must keep at once; give it headroom.

`OwnerSizing` is that rule for one geometry; `check` raises `ConfigError` naming ``dram`` with
the numbers and the size that fits.
"""

from __future__ import annotations

import attrs

from cacheseek.errors import ConfigError
from cacheseek.fluxon.config import SEGMENT_ALIGN
from cacheseek.fluxon.values import slot_bytes
from cacheseek.sizes import format_size

__all__ = ["DRAM_PER_SLOT", "OwnerSizing"]

DRAM_PER_SLOT = 10  # 1 / (0.8 / 8): the master's per-owner cache segment a slot must fit
CACHE_SEGMENTS = 8


@attrs.frozen(slots=True)
class OwnerSizing:
    """``largest_value``: payload bytes of the largest value (one layer's K or V of a chunk, or
    its latent: ``tools/fluxon_service.py --geometry`` derives it); ``values``: how many of them
    one owner keeps at once (placed and replicas); ``what``: where the value size comes from, for
    the error ("geometry lingbot_480p, 2-byte elements")."""

    largest_value: int = attrs.field(validator=attrs.validators.ge(1))
    values: int = attrs.field(default=CACHE_SEGMENTS, validator=attrs.validators.ge(1))
    what: str = "the largest value"

    @property
    def slot(self) -> int:
        return slot_bytes(self.largest_value)

    @property
    def required(self) -> int:
        return DRAM_PER_SLOT * self.slot * -(-self.values // CACHE_SEGMENTS)

    @property
    def fitting_dram(self) -> int:
        """`required`, rounded up to Fluxon's 16 MiB segment granule: the smallest --dram that fits."""
        return -(-self.required // SEGMENT_ALIGN) * SEGMENT_ALIGN

    def check(self, dram_bytes: int) -> None:
        if dram_bytes >= self.required:
            return
        raise ConfigError(
            "dram",
            f"{format_size(dram_bytes)} is too small for {self.what}: its largest value is "
            f"{format_size(self.largest_value)} in a {format_size(self.slot)} slot; to keep {self.values} of "
            f"them (placed and replicas) the owner needs {DRAM_PER_SLOT} x {format_size(self.slot)} x "
            f"ceil({self.values} / {CACHE_SEGMENTS}) = {format_size(self.required)} (below that such values "
            "are evicted, silently)",
            f"give --dram {self.fitting_dram >> 20}MiB or more")
