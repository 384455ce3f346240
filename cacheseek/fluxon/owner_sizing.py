"""How much ``dram`` an owner needs for a geometry's values to survive: the rule checked at start.

fluxon-py 0.2.4's master keeps, per owner, a cache of 0.8 x dram split into 8 segments, and a
value whose power-of-two slot does not fit one such segment is evicted at once, silently (seen:
both 64 MiB values of a 1 GiB owner vanished; with 3 GiB they stayed). So an owner needs
``dram >= DRAM_PER_SLOT x slot`` of the largest value the geometry writes (a 480p KV value is
45.7 MiB of payload in a 64 MiB slot: 640 MiB), plus room for the replicas: a value another host
put is pulled into a new slot of the reading host's own segment on its first read there.

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


@attrs.frozen(slots=True)
class OwnerSizing:
    """``largest_value``: payload bytes of the largest value (one layer's K or V of a chunk, or
    its latent); ``replica_room``: bytes kept for replicas of values other hosts put;
    ``what``: where the value size comes from, for the error ("geometry lingbot_480p, bfloat16")."""

    largest_value: int = attrs.field(validator=attrs.validators.ge(1))
    replica_room: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    what: str = "the largest value"

    @classmethod
    def for_geometry(cls, geometry_name: str, replica_room: int = 0, itemsize: int = 2) -> "OwnerSizing":
        from cacheseek.runtime.geometry import get_geometry

        g = get_geometry(geometry_name)
        largest = max(g.kv_nbytes_per_chunk(itemsize), g.latent_nbytes(itemsize))
        return cls(largest, replica_room, f"geometry {g.name}, {itemsize}-byte elements")

    @property
    def slot(self) -> int:
        return slot_bytes(self.largest_value)

    @property
    def required(self) -> int:
        return DRAM_PER_SLOT * self.slot + self.replica_room

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
            f"{format_size(self.largest_value)} in a {format_size(self.slot)} slot, and the owner needs "
            f"{DRAM_PER_SLOT} x {format_size(self.slot)} = {format_size(DRAM_PER_SLOT * self.slot)} "
            f"+ {format_size(self.replica_room)} replica room = {format_size(self.required)} (a smaller "
            "segment evicts such a value at once, silently)",
            f"give --dram {format_size(self.fitting_dram).replace(' ', '')} or more")
