"""The KV codecs on their own (`cacheseek.codecs`): the lossless codec's bit-exact round trip over
adversarial bf16, its size on KV-like values, KIVI int8/int4 error bounds, and a damaged or foreign
encoded value read as corrupt (a miss), never as KV. CPU; the CUDA run of the same code is marked."""

from __future__ import annotations

import pytest
import torch

from cacheseek.codecs.base import get_codec
from cacheseek.codecs.bitpack import pack_bits, unpack_bits
from cacheseek.codecs.quality import psnr_db
from cacheseek.errors import ConfigError, CorruptValueError

LOSSLESS = get_codec("lossless")


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def adversarial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    special = torch.tensor([0x7FC0, 0x7FC1, 0xFFFF - 65536, 0x7F81, -32768, 0, 0x7F80, 0xFF80 - 65536, 0x0001,
                            0x007F, 0x8001 - 65536, 0x0080], dtype=torch.int16)  # NaN payloads, -0, inf, denormals
    kv = (torch.randn(1, 96, 4, 32, generator=g) * 0.5).to(torch.bfloat16)
    return {
        "random_bits": torch.randint(-32768, 32768, (4099,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16),
        "specials": special.repeat(37).view(torch.bfloat16),
        "all_same": torch.full((3, 1000), 1.5, dtype=torch.bfloat16),
        "all_zero": torch.zeros(2, 5, 7, dtype=torch.bfloat16),
        "neg_zero": torch.full((33,), -0.0, dtype=torch.bfloat16),
        "kv_like": kv,
        "kv_with_specials": torch.cat([kv.reshape(-1), special.view(torch.bfloat16)]).reshape(-1),
        "wide_exponents": (torch.randn(5000, generator=g) * torch.logspace(-30, 30, 5000)).to(torch.bfloat16),
        "one": torch.tensor([3.0], dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "non_contiguous": kv[0].transpose(0, 1),
        "float16": torch.randn(300, generator=g).to(torch.float16),
        "float32": torch.randn(300, generator=g),
    }


@pytest.mark.parametrize("name", sorted(adversarial()))
def test_lossless_round_trip_is_bit_exact(name):
    x = adversarial()[name]
    enc = LOSSLESS.encode(x, "k")
    got = LOSSLESS.decode("key", enc)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got.contiguous().view(torch.uint8), x.contiguous().view(torch.uint8))
    assert enc.numel() <= x.numel() * x.element_size() + 512  # never much larger than raw (header only)


def test_lossless_compresses_kv_like_values():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 512, 8, 64, generator=g) * 0.7).to(torch.bfloat16)
    ratio = x.numel() * 2 / LOSSLESS.encode(x, "v").numel()
    assert ratio >= 1.25


@pytest.mark.parametrize("bits", range(1, 9))
def test_bitpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (1001,), dtype=torch.int32).to(torch.uint8)
    assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, 1001), codes)


@pytest.mark.parametrize("name,min_db", [("int8", 45.0), ("int4", 25.0)])
@pytest.mark.parametrize("role", ["k", "v"])
def test_kivi_error_is_bounded(name, min_db, role):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1, 300, 4, 64, generator=g) * torch.linspace(0.1, 3, 64)).to(torch.bfloat16)
    codec = get_codec(name)
    enc = codec.encode(x, role)
    got = codec.decode("key", enc)
    assert codec.lossy and got.dtype == x.dtype and got.shape == x.shape
    assert enc.numel() < x.numel() * 2
    assert psnr_db(got.float(), x.float()) >= min_db


def test_kivi_groups_follow_the_role():
    """K per channel: a channel of huge values spoils only its own channel's precision; V per token:
    a huge token spoils only its own token's."""
    x = torch.randn(1, 256, 2, 64).to(torch.bfloat16)
    spiky_channel = x.clone()
    spiky_channel[..., 0, 5] *= 1000
    codec = get_codec("int8")
    got = codec.decode("k", codec.encode(spiky_channel, "k")).float()
    rest = torch.ones(2, 64, dtype=torch.bool)
    rest[0, 5] = False
    assert psnr_db(got[..., rest], spiky_channel.float()[..., rest]) > 40
    spiky_token = x.clone()
    spiky_token[:, 7] *= 1000
    got = codec.decode("v", codec.encode(spiky_token, "v")).float()
    keep = torch.arange(256) != 7
    assert psnr_db(got[:, keep], spiky_token.float()[:, keep]) > 40


@pytest.mark.parametrize("name", ["lossless", "int8", "int4"])
def test_damaged_or_foreign_values_are_corrupt(name):
    codec = get_codec(name)
    x = (torch.randn(1, 64, 2, 32) * 0.5).to(torch.bfloat16)
    enc = codec.encode(x, "k")
    cases = {
        "truncated": enc[:-16],
        "bad magic": torch.cat([enc[:1] ^ 1, enc[1:]]),
        "raw bf16 (no codec)": x,
        "other codec": get_codec("int8" if name != "int8" else "int4").encode(x, "k"),
        "too long": torch.cat([enc, torch.zeros(16, dtype=torch.uint8)]),
        "a string": "hello",
    }
    for what, value in cases.items():
        with pytest.raises(CorruptValueError):
            codec.decode("key", value)
            pytest.fail(what)


def test_lossless_escape_count_is_checked():
    """Codes that all read as escapes while the header stores none: refused. (Damage that maps codes
    onto other table entries is not detectable here; the store's checksum over the encoded bytes
    catches it: tests/kv_codecs/test_tier_codecs.py.)"""
    x = torch.tensor([1.0, 2.0, 1e30, 1e-30] * 64, dtype=torch.bfloat16)
    enc = LOSSLESS.encode(x, "k").clone()
    header_end = int.from_bytes(bytes(enc[8:12].tolist()), "little") + 12
    codes_at = header_end + 16  # after the table section (padded to 16 bytes)
    enc[codes_at:codes_at + 96] = 0xFF  # 256 codes of 3 bits: every code the escape code
    with pytest.raises(CorruptValueError, match="escape"):
        LOSSLESS.decode("key", enc)


def test_unknown_codec_is_a_config_error():
    with pytest.raises(ConfigError, match="store.codec"):
        get_codec("zstd")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["lossless", "int8", "int4"])
def test_cuda_matches_the_cpu_reference(name):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    codec = get_codec(name)
    for x in adversarial().values():
        if name != "lossless" and (x.numel() == 0 or not torch.isfinite(x.float()).all()):
            continue
        cpu = codec.encode(x, "k")
        gpu = codec.encode(x.cuda(), "k")
        assert torch.equal(gpu.cpu(), cpu)  # one format on both devices
        assert torch.equal(_bits(codec.decode("k", cpu, "cuda")), _bits(codec.decode("k", cpu)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes on the host, bit for bit (NaN payloads too), whatever its dtype and strides
    (a size-1 dimension may keep any stride, which a dtype view refuses)."""
    out = torch.empty(t.numel(), dtype=t.dtype)
    out.copy_(t.reshape(-1))
    return out.view(torch.uint8)
