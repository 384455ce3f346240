"""Action keys (`cacheseek.reuse.exact_prefix.actions`): the encoding is pinned, the quantization
is the old per-value path's, and every input form of the same values gives the same key.

The key names trie nodes in shared stores, so it must be the same in every process and on every
machine: a change of encoding must fail here (pinned digests), not silently miss every cache.
Timing is in experiments/action_keys, not here."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from cacheseek.reuse.exact_prefix import actions
from cacheseek.reuse.exact_prefix.actions import NO_CONTROL, QUANTUM, action_bytes, action_keys, quantized_values

REPO = Path(__file__).resolve().parents[2]

# One fixed small control (i4 encoding) and one with a value past the int32 range (i8 encoding).
PINNED_I4 = ([[0.0, 1e-6, -0.5, 0.0078125], [1.0, -2147.0, 3.25, 0.1]],
             "549933810720a16a1edac1f4c216456d2d523bad0274472fca1ac9eab55d70bd")
PINNED_I8 = ([3000.0, -0.25], "471962999ac1e9451338f4ef0ac645bcd25cec8457257a304a875df0ee0d8d0e")


def _old_quantized(t: torch.Tensor) -> list[int]:
    """The old per-value path (before 3e58b43), the reference for the quantized integers."""
    return [int(round(float(x) * 1_000_000)) for x in t.detach().float().cpu().reshape(-1).tolist()]


def _spec_key(shape: tuple[int, ...], q: np.ndarray) -> bytes:
    """The key as the module docstring specifies it, written out from hashlib alone."""

    def part(b: bytes) -> bytes:
        return len(b).to_bytes(8, "little") + b

    shape_bytes = np.asarray(shape, dtype="<i8").tobytes()
    data = q.astype(q.dtype.newbyteorder("<")).tobytes()
    preimage = (part(b"action") + part(b"q1e-6/xxh3-128") + part(q.dtype.str.encode()) + part(shape_bytes)
                + part(len(data).to_bytes(8, "little")) + part(xxhash.xxh3_128_digest(data)))
    return hashlib.sha256(preimage).digest()


# --- encoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("values, digest", [PINNED_I4, PINNED_I8], ids=["i4", "i8"])
def test_pinned_digest(values, digest):
    """Changing the encoding (scale, rounding, byte order, layout of the preimage) fails here."""
    assert action_bytes(torch.tensor(values, dtype=torch.float32)).hex() == digest
    assert action_bytes(values).hex() == digest


@pytest.mark.parametrize("values", [PINNED_I4[0], PINNED_I8[0]], ids=["i4", "i8"])
def test_key_matches_documented_encoding(values):
    q = quantized_values(values)
    assert q.dtype == (np.dtype("<i8") if np.max(np.abs(values)) > 2147.483647 else np.dtype("<i4"))
    assert action_bytes(values) == _spec_key(np.shape(values), q)


def test_key_is_32_bytes_and_none_is_noctrl():
    assert len(action_bytes([0.5])) == 32
    assert action_bytes(None) == NO_CONTROL == b"noctrl"


def test_deterministic_across_processes():
    """A fresh interpreter (another hash seed) computes the same key for the same seeded values."""
    code = textwrap.dedent("""
        import numpy as np
        from cacheseek.reuse.exact_prefix.actions import action_bytes
        x = np.random.default_rng(1234).standard_normal((1, 384, 3, 2, 4)).astype(np.float32)
        print(action_bytes(x).hex())
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "97"}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=60, check=True).stdout.strip()
    x = np.random.default_rng(1234).standard_normal((1, 384, 3, 2, 4)).astype(np.float32)
    assert child == action_bytes(x).hex() == action_bytes(torch.from_numpy(x)).hex()


# --- quantization --------------------------------------------------------------------------------


def test_quantum_is_one_millionth():
    assert QUANTUM == 1e-6
    assert quantized_values([1e-6, -1e-6, 0.5, 0.0]).tolist() == [1, -1, 500000, 0]


def test_within_half_a_quantum_same_key_1e_5_apart_another():
    base = action_bytes(np.array([0.25, -1.5], dtype=np.float64))
    assert action_bytes(np.array([0.25 + 4e-7, -1.5 - 4.9e-7])) == base
    assert action_bytes(np.array([0.25 - 4.9e-7, -1.5 + 3e-7])) == base
    assert action_bytes(np.array([0.25 + 1e-5, -1.5])) != base
    assert action_bytes(np.array([0.25, -1.5 + 1e-5])) != base
    assert action_bytes(np.array([0.25 + 6e-7, -1.5])) != base  # just past half a quantum


def test_exact_halves_round_to_even():
    """m/128 is exact in float32 and float64, and m/128 * 1e6 = m * 7812.5 exactly: for odd m the
    product is an exact half, rounded to the even neighbour (as Python's round did)."""
    halves = [m / 128 for m in (1, 3, 5, -1, -3, 7)]  # 7812.5, 23437.5, 39062.5, ...
    expect = [7812, 23438, 39062, -7812, -23438, 54688]
    assert [x * 1e6 % 1 for x in halves] == [0.5] * 6
    assert quantized_values(halves).tolist() == expect
    assert quantized_values(np.float32(halves)).tolist() == expect
    assert quantized_values(torch.tensor(halves, dtype=torch.float32)).tolist() == expect
    assert [round(x * 1_000_000) for x in halves] == expect


def test_old_and_new_paths_quantize_alike():
    """The old per-value Python path and the vectorized one give the same integers, here on random
    float32 values of several magnitudes, exact halves and a bf16 tensor."""
    g = torch.Generator().manual_seed(7)
    x = torch.cat([
        torch.randn(20000, generator=g),
        torch.randn(2000, generator=g) * 1000,
        torch.rand(2000, generator=g) * 1e-5,
        torch.tensor([m / 128 for m in range(-64, 65)]),
    ])
    assert quantized_values(x).tolist() == _old_quantized(x)
    xb = x[:4000].to(torch.bfloat16)
    assert quantized_values(xb).tolist() == _old_quantized(xb)


def test_many_blocks_match_one_shot_reference():
    """A control longer than one internal block (2**18 values) is quantized and hashed as one."""
    x = np.random.default_rng(3).standard_normal(300_001).astype(np.float32)
    q = np.rint(x.astype(np.float64) * 1e6).astype("<i4")
    assert np.array_equal(quantized_values(x), q)
    assert action_bytes(x) == _spec_key(x.shape, q)


# --- input forms ---------------------------------------------------------------------------------

VALUES = [[0.1, -0.5, 0.0078125], [1.234567, 0.0, -3.0]]


@pytest.mark.parametrize("form", [
    lambda v: torch.tensor(v, dtype=torch.float32),
    lambda v: torch.tensor(v, dtype=torch.float64),
    lambda v: np.array(v, dtype=np.float32),
    lambda v: np.array(v, dtype=np.float64),
    lambda v: v,
    lambda v: tuple(tuple(r) for r in v),
    lambda v: torch.tensor(v).T.contiguous().T,  # a non-contiguous view: its logical C order counts
], ids=["torch_f32", "torch_f64", "np_f32", "np_f64", "list", "tuple", "torch_strided"])
def test_same_values_same_key_in_every_form(form):
    assert action_bytes(form(VALUES)) == action_bytes(np.array(VALUES, dtype=np.float64))


def test_integer_values_key_like_floats():
    assert action_bytes([[1, -2, 3]]) == action_bytes(torch.tensor([[1.0, -2.0, 3.0]]))
    assert action_bytes(np.array([1, 2], dtype=np.int16)) == action_bytes([1.0, 2.0])


def test_bf16_tensor_keys_like_its_float32_values():
    x = torch.randn(1, 384, 3, 2, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert action_bytes(x) == action_bytes(x.float())
    assert action_bytes(x.to(torch.float16)) == action_bytes(x.to(torch.float16).float())
    assert quantized_values(x).shape == (x.numel(),)


def test_shape_is_part_of_the_key():
    v = [0.5, -0.25, 1.0, 2.0]
    keys = {action_bytes(np.array(v).reshape(s)) for s in [(1, 4), (4,), (2, 2), (4, 1), (1, 1, 4)]}
    assert len(keys) == 5
    assert action_bytes([]) != action_bytes(np.empty((0, 3)))


def test_order_of_values_is_part_of_the_key():
    t = torch.tensor([[0.5, -0.25], [1.0, 2.0]])
    assert action_bytes(t.T) != action_bytes(t)
    assert action_bytes(t.T) == action_bytes(t.T.contiguous())


# --- wide values, bad values ---------------------------------------------------------------------


def test_int64_fallback_past_int32_range():
    assert quantized_values([2147.483647]).dtype == np.int32
    assert quantized_values([2147.483648]).dtype == np.int64
    assert quantized_values([3000.0, -4e6]).tolist() == [3_000_000_000, -4_000_000_000_000]
    # values that wrap in int32 stay distinct in int64
    assert action_bytes([3000.0]) != action_bytes([3000.0 - 2**32 / 1e6])
    assert action_bytes([3000.0, 1.0]) != action_bytes([3000.0, 1.000001])
    # the same value bytes under another integer width: dtype and shape keep the keys apart
    wide, narrow = [3000.0], [-1294.967296, 0.0]
    assert quantized_values(wide).tobytes() == quantized_values(narrow).tobytes()
    assert action_bytes(wide) != action_bytes(narrow)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_values_raise(bad):
    for control in ([0.5, bad], np.array([0.5, bad], dtype=np.float32), torch.tensor([[0.5, bad]]),
                    torch.tensor([0.5, bad], dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="non-finite"):
            action_bytes(control)
        with pytest.raises(ValueError, match="non-finite"):
            quantized_values(control)


def test_values_too_large_to_quantize_raise():
    with pytest.raises(ValueError, match="too large"):
        action_bytes([1e13])


def test_non_numeric_controls_raise():
    with pytest.raises(ValueError, match="no action key"):
        action_bytes(np.array(["a", "b"]))
    with pytest.raises(ValueError, match="no action key"):
        action_bytes(torch.tensor([1 + 2j]))


# --- the device path: torch on the tensor's own device -------------------------------------------
# `quantize_on_device` is what a CUDA tensor takes; run on CPU tensors here, it must give the numpy
# path's integers, width and digest bit for bit (both are IEEE float64 multiply and rint).


def _adversarial() -> list[tuple[str, torch.Tensor]]:
    halves = [(k + 0.5) * 1e-6 for k in range(-6, 6)] + [5e-7, -5e-7, 2.5e-6, -2.5e-6, 1.5e-6, -1.5e-6]
    halves += [m / 128 for m in range(-129, 130, 2)]  # exact halves of the quantum after * 1e6
    edge = 2147.483647
    near_i4 = [edge, -edge, np.nextafter(edge, 0.0), np.nextafter(edge, 3000.0), 2147.4836475,
               -2147.4836475, 2147.483646, 2147.4836465]
    g = torch.Generator().manual_seed(11)
    mixed = torch.cat([torch.randn(50_000, generator=g, dtype=torch.float64) * s for s in (1e-6, 1e-3, 1, 100, 2147)])
    return [
        ("halves_f64", torch.tensor(halves, dtype=torch.float64)),
        ("halves_f32", torch.tensor(halves, dtype=torch.float32)),
        ("near_i4_f64", torch.tensor(near_i4, dtype=torch.float64)),
        ("at_i4_edge_f64", torch.tensor([edge, -edge, 0.5e-6], dtype=torch.float64)),
        ("past_i4_edge_f64", torch.tensor([np.nextafter(edge, 3000.0), 1.0], dtype=torch.float64)),
        ("near_i4_f32", torch.tensor(near_i4, dtype=torch.float32)),
        ("at_neg_i4_edge", torch.tensor([-2147.483648, 1.0], dtype=torch.float64)),
        ("int64_wide", torch.tensor([3000.0, -4e6, 4.6e12, -4.6e12, 2.5e-6], dtype=torch.float64)),
        ("mixed_f64", mixed),
        ("mixed_f32", mixed.float()),
        ("mixed_bf16", mixed[:100_000].to(torch.bfloat16)),
        ("mixed_f16", (mixed[:100_000] / 2147).to(torch.float16)),
        ("int64", torch.tensor([[1, -2], [2147, 4_000_000]], dtype=torch.int64)),
        ("int32_small", torch.tensor([0, 1, -2147], dtype=torch.int32)),
        ("bool", torch.tensor([True, False, True])),
        ("strided", mixed[:600].reshape(20, 30).T),
        ("empty", torch.empty(0, 3)),
        ("empty_bf16", torch.empty(2, 0, dtype=torch.bfloat16)),
        ("scalar", torch.tensor(0.0000005)),
    ]


ADVERSARIAL = _adversarial()


@pytest.mark.parametrize("name, x", ADVERSARIAL, ids=[n for n, _ in ADVERSARIAL])
def test_device_path_is_bit_identical_to_numpy_path(name, x):
    on_device = actions.quantize_on_device(x)
    on_host = actions.quantize(x)  # a CPU tensor takes the numpy path
    assert on_device.shape == on_host.shape == tuple(x.shape)
    assert on_device.dtype == on_host.dtype and on_device.size == on_host.size == x.numel()
    a = np.concatenate([b.copy() for b in on_device.blocks()] or [np.empty(0, on_device.dtype)])
    b = np.concatenate([b.copy() for b in on_host.blocks()] or [np.empty(0, on_host.dtype)])
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert actions.digest(on_device) == actions.digest(on_host) == action_bytes(x)


def test_device_path_width_rule_and_halves():
    """Spot values, so a bug shared by both paths would still show: the i4/i8 edge and halves."""
    q = actions.quantize_on_device(torch.tensor([2147.483647, -2147.483647], dtype=torch.float64))
    assert q.dtype == np.dtype("<i4") and next(q.blocks()).tolist() == [2147483647, -2147483647]
    q = actions.quantize_on_device(torch.tensor([2147.483648], dtype=torch.float64))
    assert q.dtype == np.dtype("<i8") and next(q.blocks()).tolist() == [2147483648]
    halves = torch.tensor([m / 128 for m in (1, 3, 5, -1, -3, 7)], dtype=torch.float32)
    assert next(actions.quantize_on_device(halves).blocks()).tolist() == [7812, 23438, 39062, -7812, -23438, 54688]


def test_device_path_pinned_digests_and_leaves_the_input_alone():
    for values, digest in (PINNED_I4, PINNED_I8):
        x = torch.tensor(values, dtype=torch.float64)
        before = x.clone()
        assert actions.digest(actions.quantize_on_device(x)).hex() == digest
        assert torch.equal(x, before)  # a float64 control is not scaled in place


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_device_path_non_finite_and_too_large_raise(bad):
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match="non-finite"):
            actions.quantize_on_device(torch.tensor([0.5, bad, 1.0], dtype=dtype))
    with pytest.raises(ValueError, match="too large"):
        actions.quantize_on_device(torch.tensor([1e13]))
    with pytest.raises(ValueError, match="no action key"):
        actions.quantize_on_device(torch.tensor([1 + 2j]))


# --- action_keys: many chunks on a small pool ----------------------------------------------------


def _controls() -> list:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(1, 384, 3, 2, 4, generator=g), None, [0.5, -0.25],
            np.float32(np.arange(300_001) * 1e-3), torch.randn(7, generator=g).to(torch.bfloat16),
            torch.randn(2, 3, generator=g, dtype=torch.float64).T, np.empty((0, 3))]


@pytest.mark.parametrize("cpus", [1, 2, 8], ids=["inline", "pool2", "pool4"])
def test_action_keys_are_action_bytes_in_order(monkeypatch, cpus):
    monkeypatch.setattr(actions, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(actions, "MAX_KEY_THREADS", 4)
    monkeypatch.setattr(actions, "POOL_MIN_VALUES", 1)  # every control is worth a thread
    controls = _controls()
    assert action_keys(controls) == [action_bytes(c) for c in controls]
    assert action_keys(iter(controls[:2])) == [action_bytes(controls[0]), NO_CONTROL]
    assert action_keys([]) == []
    assert action_keys([None, None]) == [NO_CONTROL, NO_CONTROL]


def test_action_keys_hash_on_several_threads(monkeypatch):
    import threading

    seen, digest = set(), actions.digest
    barrier = threading.Barrier(3, timeout=30)

    def recording(q):
        if q.size > 1:
            seen.add(threading.current_thread().name)
            barrier.wait()  # the three large chunks hash at once, or this times out
        return digest(q)

    monkeypatch.setattr(actions, "usable_cpus", lambda: 8)

    monkeypatch.setattr(actions, "MAX_KEY_THREADS", 4)
    monkeypatch.setattr(actions, "digest", recording)
    controls = [np.full(1 << 18, float(i)) for i in range(3)] + [[0.5]]  # three worth a thread, one small
    assert action_keys(controls) == [digest(actions.quantize(c)) for c in controls]
    assert len(seen) == 3 and all(n.startswith("cacheseek-action-keys") for n in seen)


def test_action_keys_of_small_controls_run_inline(monkeypatch):
    """Starting a pool costs about a millisecond: controls below 2**18 values are keyed inline."""
    import threading

    seen, digest = set(), actions.digest
    monkeypatch.setattr(actions, "usable_cpus", lambda: 8)
    monkeypatch.setattr(actions, "MAX_KEY_THREADS", 4)
    monkeypatch.setattr(actions, "digest", lambda q: (seen.add(threading.current_thread().name), digest(q))[1])
    controls = [np.full((1 << 18) - 1, 1.0), torch.ones(1 << 18), [0.25] * 10]  # one large control only
    assert action_keys(controls) == [action_bytes(c) for c in controls]
    assert seen == {threading.current_thread().name}


@pytest.mark.parametrize("cpus", [1, 4], ids=["inline", "pool"])
def test_action_keys_name_the_chunk_that_has_no_key(monkeypatch, cpus):
    monkeypatch.setattr(actions, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(actions, "MAX_KEY_THREADS", 4)
    monkeypatch.setattr(actions, "POOL_MIN_VALUES", 1)
    good = np.zeros(10)
    with pytest.raises(ValueError, match=r"chunk 2's control: .*non-finite"):
        action_keys([good, None, np.array([0.0, float("nan")]), good])
    with pytest.raises(ValueError, match=r"chunk 1's control: .*non-finite"):  # the first in order
        action_keys([good, torch.tensor([float("inf")]), good, [float("nan")]])
    with pytest.raises(ValueError, match=r"chunk 0's control: .*too large"):
        action_keys([[1e13], good])
    with pytest.raises(ValueError, match=r"chunk 3's control: .*no action key"):
        action_keys([good, good, good, np.array(["a"])])


@pytest.mark.parametrize("cpus", [1, 4], ids=["inline", "pool"])
def test_action_keys_stage_device_tensors_in_the_caller(monkeypatch, cpus):
    """The CUDA route without a GPU: torch tensors take the device path, quantized in the calling
    thread and hashed on the pool; keys and the first-in-order error are unchanged."""
    import threading

    staged_in = set()
    quantize = actions.quantize_on_device

    def recording(t, **kw):
        staged_in.add(threading.current_thread().name)
        return quantize(t, **kw)

    monkeypatch.setattr(actions, "is_cuda_tensor", lambda c: isinstance(c, torch.Tensor))
    monkeypatch.setattr(actions, "quantize_on_device", recording)
    monkeypatch.setattr(actions, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(actions, "MAX_KEY_THREADS", 4)
    monkeypatch.setattr(actions, "POOL_MIN_VALUES", 1)
    controls = _controls()
    expect = [action_bytes(c) for c in controls]
    staged_in.clear()
    assert action_keys(controls) == expect
    assert staged_in == {threading.current_thread().name}
    good = torch.zeros(10)
    with pytest.raises(ValueError, match=r"chunk 1's control: .*non-finite"):  # hashed on the pool
        action_keys([good, np.array([float("nan")]), torch.tensor([float("inf")])])  # chunk 2 fails staging
    with pytest.raises(ValueError, match=r"chunk 2's control: .*non-finite"):
        action_keys([good, good, torch.tensor([1.0, float("nan")]), good])


# --- CUDA: the device path on a GPU ---------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, x", ADVERSARIAL, ids=[n for n, _ in ADVERSARIAL])
def test_cuda_tensor_keys_like_its_cpu_copy(name, x):
    on_gpu = x.to("cuda")
    assert actions.is_cuda_tensor(on_gpu)
    q = actions.quantize(on_gpu)
    assert q.shape == tuple(x.shape)
    assert np.concatenate([b.copy() for b in q.blocks()] or [np.empty(0, q.dtype)]).tobytes() == \
        quantized_values(x).tobytes()
    assert action_bytes(on_gpu) == action_bytes(x)
    assert quantized_values(on_gpu).tobytes() == quantized_values(x).tobytes()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_digests_and_action_keys(monkeypatch):
    for values, digest in (PINNED_I4, PINNED_I8):
        for dtype in (torch.float32, torch.float64):
            assert action_bytes(torch.tensor(values, dtype=dtype, device="cuda")).hex() == digest
    g = torch.Generator().manual_seed(9)
    big = [torch.randn(1, 384, 3, 60, 104, generator=g) * 2 for _ in range(3)]  # the 480p control's shape
    assert action_keys([c.cuda() for c in big] + [None]) == [action_bytes(c) for c in big] + [NO_CONTROL]
    monkeypatch.setattr(actions, "MAX_KEY_THREADS", 3)  # the pool: each chunk's integers in its own array
    monkeypatch.setattr(actions, "usable_cpus", lambda: 3)
    assert action_keys([c.cuda() for c in big]) == [action_bytes(c) for c in big]
    monkeypatch.undo()
    bad = big[1].cuda()
    bad[0, 5, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"chunk 1's control: .*non-finite"):
        action_keys([big[0].cuda(), bad])
