"""Sizes: one parser with units for every size (cacheseek.sizes), and the sizes fitted to the
workload or refused before anything is allocated (cacheseek.sizing)."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import ConfigError
from cacheseek.runtime.geometry import get_geometry
from cacheseek.sizes import AUTO, format_size, parse_size
from cacheseek.sizing import CacheNeed, SizeField, check_capacity, need_for, resolve_sizes
from cacheseek.workloads.prefix_gate import PrefixGate

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("text,expected", [
    ("256MiB", 256 * MiB), ("1GiB", GiB), ("24GiB", 24 * GiB), ("64M", 64 * MiB), ("1.5GiB", 3 << 29),
    (1024, 1024), ("16mib", 16 * MiB), (" 16MiB ", 16 * MiB), ("0", 0), ("4096", 4096), ("2k", 2048),
    ("1TiB", 1 << 40), (8.0, 8),
])
def test_parse_size_reads_binary_units(text, expected):
    assert parse_size(text, "store.x") == expected


@pytest.mark.parametrize("bad", ["abc", "12 parsecs", -1, True, 1.5, [1], "auto", None, "1 GiB GiB"])
def test_parse_size_names_the_field_and_the_spelling_that_works(bad):
    with pytest.raises(ConfigError) as ei:
        parse_size(bad, "store.segment_bytes")
    assert ei.value.field == "store.segment_bytes" and "512MiB" in ei.value.fix


@pytest.mark.parametrize("text,binary,decimal", [
    ("1.5GB", "1.5GiB", 1_500_000_000), ("512MB", "512MiB", 512_000_000), ("2kB", "2KiB", 2000),
    ("1TB", "1TiB", 10**12), ("16 gb", "16GiB", 16 * 10**9),
])
def test_a_decimal_unit_is_refused_with_the_binary_spelling_and_the_bytes(text, binary, decimal):
    with pytest.raises(ConfigError, match="decimal unit") as ei:
        parse_size(text, "store.capacity_bytes")
    assert ei.value.field == "store.capacity_bytes"
    assert f"write {binary} (binary) or {decimal} " in ei.value.fix


@pytest.mark.parametrize("text,word", [("5 GiB", "5GiB"), ("16 mib", "16mib"), ("64 M", "64M"), ("4096 b", "4096b")])
def test_a_space_inside_a_size_is_refused(text, word):
    with pytest.raises(ConfigError, match="space inside") as ei:
        parse_size(text, "store.capacity_bytes")
    assert ei.value.fix == f"write it as one word: {word}"


def test_a_given_size_is_echoed_as_read_next_to_the_auto_ones():
    fields = [SizeField("capacity_bytes", "capacity", room=400 * GiB), SizeField("staging", "staging", room=GiB)]
    cfg = {"capacity_bytes": "1.5GiB", "staging": "auto"}
    notes = resolve_sizes(cfg, fields, _need())
    assert notes[0] == "store.capacity_bytes=1.5GiB -> 1.50 GiB = 1610612736 bytes (as given)"
    assert notes[1].startswith("store.staging=auto -> ")
    assert resolve_sizes({"capacity_bytes": 4096}, fields[:1], _need()) == \
        ["store.capacity_bytes=4096 -> 4 KiB = 4096 bytes (as given)"]
    assert resolve_sizes({"capacity_bytes": None}, fields[:1], _need()) == \
        ["store.capacity_bytes=null -> unbounded (as given)"]


def test_auto_and_null_only_where_allowed():
    assert parse_size("auto", "f", allow_auto=True) == AUTO == parse_size(" AUTO ", "f", allow_auto=True)
    assert parse_size(None, "f", allow_none=True) is None and parse_size("null", "f", allow_none=True) is None
    with pytest.raises(ConfigError, match="at least 4 KiB"):
        parse_size("1KiB", "f", minimum=4096)


def test_format_size():
    assert [format_size(n) for n in (96, 4096, 3 << 29, 256 * MiB, None)] == \
        ["96 B", "4 KiB", "1.50 GiB", "256 MiB", "unbounded"]


class _Factory:
    def __init__(self, geometry: str, dtype: str = "bfloat16") -> None:
        self.geometry, self.dtype = get_geometry(geometry), dtype


def _need(geometry: str = "tiny", n: int = 4, p: int = 2) -> CacheNeed:
    need = need_for(_Factory(geometry), PrefixGate(total_chunks=n, prefix_chunks=p))
    assert need is not None
    return need


def test_the_gate_needs_its_chunks_at_the_geometry_size():
    tiny = _need()
    assert tiny.chunks == 6 and tiny.chunk_bytes == 4 * 96 + 192  # 2 layers x K,V of 96 B + a latent
    assert tiny.footprint(256) == 5 * 256  # every value rounded up to a 256-byte block
    big = _need("lingbot_480p", 3, 1)
    assert big.chunks == 5 and big.chunk_bytes == 80 * 47_923_200 + 599_040  # DESIGN figures: 3.57 GiB
    assert need_for(_Factory("tiny"), object()) is None  # a workload that does not say


def test_auto_segment_fits_the_workload_below_the_watermark_within_free_memory():
    need = _need("lingbot_480p", 3, 1)
    cfg = {"segment_bytes": "auto"}
    notes = resolve_sizes(cfg, [SizeField("segment_bytes", "segment", room=400 * GiB)], need, high_watermark=0.9)
    assert cfg["segment_bytes"] >= need.chunks * need.chunk_bytes / 0.9 and cfg["segment_bytes"] % MiB == 0
    assert len(notes) == 1 and notes[0].startswith("store.segment_bytes=auto -> 19.8") and "5 chunks" in notes[0]
    capped = {"segment_bytes": "auto"}
    resolve_sizes(capped, [SizeField("segment_bytes", "segment", room=10 * GiB)], need)
    assert capped["segment_bytes"] == int(10 * GiB * 0.8)


def test_a_segment_that_cannot_hold_one_chunk_is_refused_with_the_numbers():
    need = _need("lingbot_480p", 3, 1)
    with pytest.raises(ConfigError) as ei:
        resolve_sizes({"segment_bytes": "256MiB"}, [SizeField("segment_bytes", "segment", room=400 * GiB)], need)
    msg = str(ei.value)
    assert ei.value.field == "store.segment_bytes" and "256 MiB cannot hold one chunk" in msg
    assert "3.57 GiB" in msg and "store.segment_bytes=auto" in ei.value.fix
    with pytest.raises(ConfigError, match="only"):  # auto with too little free memory says so too
        resolve_sizes({"segment_bytes": "auto"}, [SizeField("segment_bytes", "segment", room=GiB)], need)


def test_a_segment_larger_than_free_memory_is_refused():
    with pytest.raises(ConfigError) as ei:
        resolve_sizes({"segment_bytes": "100GiB"}, [SizeField("segment_bytes", "segment", room=20 * GiB)], _need())
    assert ei.value.field == "store.segment_bytes" and "free memory" in str(ei.value)


def test_auto_capacity_is_unbounded_when_it_fits_and_capped_when_not():
    need = _need("lingbot_480p", 3, 1)
    cfg = {"capacity_bytes": "auto"}
    resolve_sizes(cfg, [SizeField("capacity_bytes", "capacity", room=400 * GiB)], need)
    assert cfg["capacity_bytes"] is None
    resolve_sizes(cfg := {"capacity_bytes": "auto"}, [SizeField("capacity_bytes", "capacity", room=10 * GiB)], need)
    assert cfg["capacity_bytes"] == int(10 * GiB * 0.8)
    resolve_sizes(cfg := {"capacity_bytes": None}, [SizeField("capacity_bytes", "capacity", room=GiB)], need)
    assert cfg["capacity_bytes"] is None  # null stays unbounded, whatever the room
    with pytest.raises(ConfigError, match="0 B cannot hold one chunk"):
        resolve_sizes({"capacity_bytes": 0}, [SizeField("capacity_bytes", "capacity")], _need())


def test_auto_staging_is_two_chunks_at_a_nested_path_that_may_be_missing():
    need = _need()
    cfg: dict = {"client": "fluxon"}
    resolve_sizes(cfg, [SizeField("client_options.staging_bytes", "staging", room=GiB, alignment=256)], need)
    assert cfg["client_options"]["staging_bytes"] == 4096  # 2 x 1.25 KiB, rounded up to a page


def test_a_reported_capacity_must_hold_one_chunk():
    check_capacity(None, _need(), "store", "more")
    check_capacity(GiB, _need(), "store", "more")
    with pytest.raises(ConfigError, match="16 MiB cannot hold one chunk") as ei:
        check_capacity(16 * MiB, _need("lingbot_480p", 3, 1), "store", "restart the service with --dram 8GiB")
    assert "--dram" in ei.value.fix


class _FramesFactory(_Factory):
    """A runtime that stores frames of ``frames`` bytes beside each chunk and a decoder state of
    ``state`` bytes at each resume point (`need_for` asks ``beside_chunk_bytes``)."""

    def __init__(self, geometry: str, frames: int, state: int) -> None:
        super().__init__(geometry)
        self.frames, self.state, self.asked = frames, state, []

    def beside_chunk_bytes(self, decoder_state_every: int) -> dict[str, int]:
        self.asked.append(decoder_state_every)
        out = {"frames": self.frames}
        if decoder_state_every > 0:
            out["decoder state"] = self.state
        return out


def test_auto_counts_the_frames_and_decoder_states_stored_beside_the_chunks():
    # issue 32's miscount: the HBM pool of the gate at 14B held 4 chunks of KV and nothing else, so the
    # frames and the decoder state (1.76 GiB) stored beside them evicted a chunk the gate's B needed
    gate = PrefixGate(total_chunks=3, prefix_chunks=2)  # A writes depths 0,1,2; C writes depth 2
    assert gate.cache_chunks == 4 and gate.cache_chunk_depths == [0, 1, 2, 2]
    frames, state = 14_376_960 + 80, 1_890_000_000
    need = need_for(_FramesFactory("lingbot_480p", frames, state), gate, 2)
    assert need.beside == (("frames", frames, 4), ("decoder state", state, 1))  # a state after chunk 1 only
    assert need.total() == 4 * need.chunk_bytes + 4 * frames + state
    assert need.beside_bytes(256) == 4 * (-(-frames // 256) * 256) + (-(-state // 256) * 256)
    field = SizeField("capacity_bytes", "segment", room=120 * GiB, alignment=256, device_room=True)
    cfg = {"capacity_bytes": "auto"}
    (note,) = resolve_sizes(cfg, [field], need, high_watermark=0.9)
    assert cfg["capacity_bytes"] >= need.total(256) / 0.9 > 4 * need.footprint(256) / 0.9 + state
    assert "beside them 4 frames of 13.7" in note and "1 decoder state of 1.76 GiB" in note
    plain = need_for(_Factory("lingbot_480p"), gate, 2)  # a runtime that stores nothing beside its chunks
    assert plain.beside == () and plain.total() == 4 * plain.chunk_bytes


@pytest.mark.parametrize("every,states", [(0, 0), (1, 4), (2, 1), (3, 2), (4, 0)])
def test_decoder_states_are_counted_at_the_resume_points_of_the_chunks_kept(every, states):
    gate = PrefixGate(total_chunks=3, prefix_chunks=2)
    factory = _FramesFactory("tiny", 100, 1000)
    need = need_for(factory, gate, every)
    assert factory.asked == [every]
    assert dict((w, c) for w, _, c in need.beside) == {"frames": 4, **({"decoder state": states} if states else {})}


def test_decoder_states_of_a_workload_without_depths_are_one_in_every():
    class Chunks:
        cache_chunks = 5

    need = need_for(_FramesFactory("tiny", 100, 1000), Chunks(), 2)
    assert need.beside == (("frames", 100, 5), ("decoder state", 1000, 3))


def test_auto_capacity_counts_what_is_beside_the_chunks():
    need = need_for(_FramesFactory("tiny", 10_000, 0), PrefixGate(total_chunks=4, prefix_chunks=2), 0)
    cfg = {"capacity_bytes": "auto"}
    resolve_sizes(cfg, [SizeField("capacity_bytes", "capacity", room=need.total() + 100)], need)
    assert cfg["capacity_bytes"] == int((need.total() + 100) * 0.8)  # the room is capped: frames count
    assert need.total() > int((need.total() + 100) * 0.8) > need.chunks * need.chunk_bytes


def test_the_runtimes_say_what_they_store_beside_a_chunk():
    from cacheseek.kv import decoder_state, frames
    from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
    from cacheseek.workloads.interactive import InteractiveWorkload

    assert SyntheticRuntimeFactory(geometry="tiny").beside_chunk_bytes(2) == {}  # no hand-out: nothing stored
    rt = SyntheticRuntimeFactory(geometry="tiny", handout=True)
    g = rt.geometry
    assert rt.beside_chunk_bytes(0) == {"frames": 64 + 4 * 4 + g.chunk_size * 3 * g.latent_h * g.latent_w * 4}
    state = decoder_state.packed_nbytes(decoder_state.DecoderStateSpec([((3, g.latent_h, g.latent_w), torch.float32)]))
    assert rt.beside_chunk_bytes(2)["decoder state"] == state
    wl = InteractiveWorkload(sessions=6, depth=3, branching=2)
    assert len(wl.cache_chunk_depths) == wl.cache_chunks and set(wl.cache_chunk_depths) <= {0, 1, 2}
    need = need_for(rt, wl, 2)
    assert dict((w, c) for w, _, c in need.beside) == {"frames": wl.cache_chunks,
                                                       "decoder state": wl.cache_chunk_depths.count(1)}
    assert frames.packed_nbytes(frames.FramesSpec((12, 480, 832, 3), torch.uint8)) == 14_376_960 + 64 + 4 * 4  # 480x832, 12 frames: 13.7 MiB
