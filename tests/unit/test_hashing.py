"""Tests for kvtier.block_keys: pinned known answers, determinism, chaining, input checks."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import kvtier
from kvtier.hashing import KEY_BYTES, block_keys

#: Known answers, computed once from the v1 algorithm and pinned: any change to the
#: hashing (domain tag, salt framing, token encoding, digest size, chaining) breaks
#: these, and with them every cache built by an older client.
KNOWN_ANSWERS = [
    # (tokens, block_tokens, salt, keys as hex)
    (list(range(32)), 16, b"", [
        "77ce6752c2b37d2dbf68fd7a0b5f6262",
        "878fbd99de54684eaad97fc9805ee634",
    ]),
    (list(range(32)), 16, b"tenant", [
        "0a709fb64c7b1b1ee464d150b1568732",
        "e72a3a5f46815bdda501558e38a9ec4c",
    ]),
    (list(range(40)), 8, b"", [
        "7f0915cc8906d3c1aa106f99bcc263ee",
        "d5287caad47b015d75eb5a27ce07148a",
        "e8ac17629ccb3a8b1a6ea86e02d8b5dc",
        "1587c0ced74bbe248fbce46ee7675724",
        "38d144db65bfcc12baec40b69f19d500",
    ]),
    ([0], 1, b"", ["dee54694c8be7a83ce660c23eb32278c"]),
]


def reference_block_keys(tokens: list[int], block_tokens: int, salt: bytes) -> list[bytes]:
    """The algorithm as documented, written out independently of the library."""
    prev = hashlib.blake2b(
        b"kvtier.block_keys.v1" + struct.pack("<IQ", len(salt), block_tokens) + salt,
        digest_size=16,
    ).digest()
    out = []
    for i in range(len(tokens) // block_tokens):
        block = tokens[i * block_tokens : (i + 1) * block_tokens]
        prev = hashlib.blake2b(prev + struct.pack(f"<{len(block)}q", *block),
                               digest_size=16).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize(("tokens", "block_tokens", "salt", "expected"), KNOWN_ANSWERS)
def test_block_keys_match_the_pinned_known_answers(
    tokens: list[int], block_tokens: int, salt: bytes, expected: list[str]
) -> None:
    assert [k.hex() for k in kvtier.block_keys(tokens, block_tokens, salt)] == expected


@pytest.mark.parametrize(("tokens", "block_tokens", "salt", "expected"), KNOWN_ANSWERS)
def test_block_keys_follow_the_documented_chained_blake2b(
    tokens: list[int], block_tokens: int, salt: bytes, expected: list[str]
) -> None:
    assert block_keys(tokens, block_tokens, salt) == reference_block_keys(tokens, block_tokens,
                                                                          salt)


def test_large_token_ids_hash_as_little_endian_int64() -> None:
    tokens = [2**63 - 1, 2**32, 151_935, 0]
    assert block_keys(tokens, 2, b"s") == reference_block_keys(tokens, 2, b"s")


_CHILD = (
    "import kvtier, sys; "
    "sys.stdout.write(','.join(k.hex() for k in kvtier.block_keys(list(range(64)), 16, b'salt')))"
)


def test_block_keys_are_identical_across_processes_and_hash_seeds() -> None:
    here = ",".join(k.hex() for k in block_keys(list(range(64)), 16, b"salt"))
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                             capture_output=True, text=True, timeout=60).stdout
        outputs.add(out)
    assert outputs == {here}


def test_equal_blocks_after_different_prefixes_get_different_keys() -> None:
    block = list(range(100, 116))
    a = block_keys(list(range(16)) + block, 16)
    b = block_keys(list(range(1, 17)) + block, 16)
    assert a[0] != b[0] and a[1] != b[1]
    # and the same block at the start has yet another key
    assert block_keys(block, 16)[0] not in (a[1], b[1])


def test_keys_of_a_prefix_are_a_prefix_of_the_keys() -> None:
    tokens = list(range(1000, 1080))
    full = block_keys(tokens, 16)
    for n in range(0, 81, 8):
        assert block_keys(tokens[:n], 16) == full[: n // 16]


def test_a_changed_token_changes_its_block_key_and_every_later_one() -> None:
    tokens = list(range(64))
    base = block_keys(tokens, 16)
    tokens[20] = 9999
    changed = block_keys(tokens, 16)
    assert changed[0] == base[0]
    assert all(c != b for c, b in zip(changed[1:], base[1:], strict=True))


def test_a_partial_tail_block_gets_no_key() -> None:
    assert len(block_keys(list(range(31)), 16)) == 1
    assert len(block_keys(list(range(15)), 16)) == 0
    assert block_keys(list(range(47)), 16) == block_keys(list(range(32)), 16)
    assert block_keys([], 16) == []
    assert block_keys(np.array([], dtype=np.int64), 16) == []


def test_keys_are_128_bit() -> None:
    keys = block_keys(list(range(160)), 16, b"x")
    assert KEY_BYTES == 16
    assert len(keys) == 10 and all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 10


def test_salt_and_block_size_separate_key_spaces() -> None:
    tokens = list(range(32))
    assert block_keys(tokens, 16, b"a")[0] != block_keys(tokens, 16, b"b")[0]
    assert block_keys(tokens, 16, b"")[0] != block_keys(tokens, 16, b"\x00")[0]
    assert block_keys(tokens, 16)[0] != block_keys(tokens, 8)[1]
    assert block_keys(tokens, 16)[0] != block_keys(tokens, 32)[0]


def test_salt_str_equals_its_utf8_bytes() -> None:
    tokens = list(range(32))
    assert block_keys(tokens, 16, "tenant") == block_keys(tokens, 16, b"tenant")
    assert block_keys(tokens, 16, "t\u00e9n\u00e4nt") == block_keys(tokens, 16,
                                                                   "t\u00e9n\u00e4nt".encode())


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int16, np.uint16, np.uint32, np.uint64])
def test_numpy_and_list_inputs_give_equal_keys(dtype: type) -> None:
    tokens = [0, 1, 2, 300, 7, 32000, 5, 6] * 4
    expected = block_keys(tokens, 8, b"s")
    assert block_keys(np.array(tokens, dtype=dtype), 8, b"s") == expected
    assert block_keys(tuple(tokens), 8, b"s") == expected
    # a non-contiguous view hashes its values, not its memory
    strided = np.repeat(np.array(tokens, dtype=dtype), 2)[::2]
    assert block_keys(strided, 8, b"s") == expected


@pytest.mark.parametrize("block_tokens", [0, -1, -16, True, False, 1.5, 16.0, "16", None])
def test_bad_block_tokens_is_value_error(block_tokens: object) -> None:
    with pytest.raises(ValueError, match="block_tokens must be a positive int"):
        block_keys(list(range(32)), block_tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [[1, 2, -1, 4], np.array([0, -5], dtype=np.int32)])
def test_negative_tokens_are_value_error(tokens: object) -> None:
    with pytest.raises(ValueError, match="tokens must be non-negative"):
        block_keys(tokens, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [[[1, 2], [3, 4]], np.zeros((2, 16), dtype=np.int64), 5])
def test_tokens_that_are_not_one_dimensional_are_value_error(tokens: object) -> None:
    with pytest.raises(ValueError, match="tokens must be one-dimensional"):
        block_keys(tokens, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [
    [1.0, 2.0], np.array([1.5, 2.5]), np.array([1, 2], dtype=np.float32), [True, False],
    ["1", "2"], [2**64, 1],
])
def test_non_integer_tokens_are_value_error(tokens: object) -> None:
    with pytest.raises(ValueError, match="tokens must be integers"):
        block_keys(tokens, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [
    [2**63],
    np.array([2**63, 2**64 - 1], dtype=np.uint64),
], ids=["list", "uint64-array"])
def test_token_ids_of_2_63_or_more_are_value_error(tokens: object) -> None:
    """The contract is 0 <= token < 2**63; bigger ids must not be silently reinterpreted."""
    with pytest.raises(ValueError, match="tokens"):
        block_keys(tokens, 1)  # type: ignore[arg-type]
