import hashlib

from cacheseek.reuse.exact_prefix import keys


def test_sha256_is_length_prefixed():
    expect = hashlib.sha256((2).to_bytes(8, "little") + b"ab" + (1).to_bytes(8, "little") + b"c").digest()
    assert keys.sha256(b"ab", b"c") == expect
    assert keys.sha256(b"ab", b"c") != keys.sha256(b"a", b"bc")


def test_canonical_json_sorted_compact():
    assert keys.canonical_json_bytes({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'


def test_domains_are_distinct():
    root = keys.root_hash(image_fp=b"i", prompt_fp=b"p", config_blob_hash=b"c")
    assert root != keys.sha256(b"i", b"p", b"c")
    assert keys.node_key(root, b"x") != keys.sha256(b"node", b"x", root)


def test_action_chain_and_seed():
    root = b"r" * 32
    chain = keys.build_action_chain(root, [b"a", b"b"])
    assert chain[0] == keys.node_key(root, b"a")
    assert chain[1] == keys.node_key(chain[0], b"b")
    assert len(chain[1]) == 32
    s = keys.derive_seed(chain[1])
    assert 0 <= s < 2**64 and s == keys.derive_seed(chain[1])


def test_config_blob_hash_covers_fields_and_weights():
    base = {"seed": 1, "window": [7, 3]}
    h = keys.config_blob_hash(base, weights_fingerprint=b"w")
    assert h != keys.config_blob_hash({"seed": 1, "window": [7, 2]}, weights_fingerprint=b"w")
    assert h != keys.config_blob_hash(base, weights_fingerprint=b"w2")
    assert h == keys.config_blob_hash(dict(reversed(list(base.items()))), weights_fingerprint=b"w")
