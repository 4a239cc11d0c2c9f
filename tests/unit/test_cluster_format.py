"""The cluster tier's objects (``kvtierd.cluster.format``): names only the cluster's
secret can compute, per namespace and geometry; headers whose tag, key, geometry and
length are all checked before a block is served."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from kvtierd.cluster.format import HEADER_BYTES, BadObject, Header, Naming, load_secret

SECRET = b"0123456789abcdef-cluster"
BB = 64 * 1024


def header(key: bytes = b"k" * 16, length: int = BB) -> Header:
    return Header(key, length, 0xDEADBEEF, BB, 77, 1234)


def test_names_depend_on_secret_namespace_and_geometry() -> None:
    n = Naming(SECRET)
    base = n.name("ns", b"\x01" * 16, BB, 77)
    assert base.startswith("kvt1/") and base.endswith("01" * 16)
    others = {
        Naming(SECRET + b"x").name("ns", b"\x01" * 16, BB, 77),
        n.name("ns2", b"\x01" * 16, BB, 77),
        n.name("ns", b"\x01" * 16, 2 * BB, 77),
        n.name("ns", b"\x01" * 16, BB, 78),
    }
    assert base not in others and len(others) == 4
    assert n.name("ns", b"\x01" * 16, BB, 77) == base  # stable (every host computes it)
    assert "ns" not in base  # the namespace name itself does not leak into the name


def test_a_header_round_trips_and_every_field_is_checked() -> None:
    n = Naming(SECRET)
    h = header()
    raw = n.pack("ns", h)
    assert len(raw) == HEADER_BYTES
    assert n.unpack("ns", raw, h.key, BB, 77) == h
    with pytest.raises(BadObject, match="tag"):
        n.unpack("other", raw, h.key, BB, 77)  # another namespace's key
    with pytest.raises(BadObject, match="tag"):
        Naming(SECRET + b"!").unpack("ns", raw, h.key, BB, 77)  # another cluster
    with pytest.raises(BadObject, match="holds key"):
        n.unpack("ns", raw, b"j" * 16, BB, 77)
    with pytest.raises(BadObject, match="geometry"):
        n.unpack("ns", raw, h.key, BB, 78)
    for offset in (0, 12, 20, 60, 100):  # magic, length, checksum, geometry, key
        bad = bytearray(raw)
        bad[offset] ^= 1
        with pytest.raises(BadObject):
            n.unpack("ns", bytes(bad), h.key, BB, 77)
    with pytest.raises(BadObject, match="bytes"):
        n.unpack("ns", raw[:-1], h.key, BB, 77)


def test_a_length_beyond_the_block_is_refused_even_when_tagged() -> None:
    n = Naming(SECRET)
    raw = n.pack("ns", header(length=BB + 1))
    with pytest.raises(BadObject, match="exceeds"):
        n.unpack("ns", raw, b"k" * 16, BB, 77)


def test_another_format_version_is_named() -> None:
    n = Naming(SECRET)
    raw = bytearray(n.pack("ns", header()))
    struct.pack_into("<H", raw, 8, 9)
    with pytest.raises(BadObject, match="version 9"):
        n.unpack("ns", bytes(raw), b"k" * 16, BB, 77)


def test_short_secrets_and_readable_secret_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        Naming(b"short")
    p = tmp_path / "secret"
    p.write_bytes(b"  " + SECRET + b"\n")
    os.chmod(p, 0o600)
    assert load_secret(str(p)) == SECRET
    os.chmod(p, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_secret(str(p))
    p.write_bytes(b"tiny")
    os.chmod(p, 0o600)
    with pytest.raises(ValueError, match="openssl rand"):
        load_secret(str(p))


def test_headers_packed_as_a_batch_are_the_headers_packed_one_by_one() -> None:
    n = Naming(SECRET)
    ks = [os.urandom(16), b"", b"k" * 64, os.urandom(32)]
    lengths, sums = [BB, 1, BB - 7, 4096], [1, 2**64 - 1, 0, 0xDEADBEEF]
    packed = n.pack_many("ns", ks, lengths, sums, BB, 77, 1234)
    assert packed == b"".join(n.pack("ns", Header(k, ln, c, BB, 77, 1234))
                              for k, ln, c in zip(ks, lengths, sums, strict=True))
    for i, k in enumerate(ks):
        got = n.unpack("ns", packed[i * HEADER_BYTES : (i + 1) * HEADER_BYTES], k, BB, 77)
        assert (got.length, got.checksum) == (lengths[i], sums[i])
    assert n.pack_many("ns", [], [], [], BB, 77, 1) == b""
    with pytest.raises(ValueError, match="at most 64"):
        n.pack_many("ns", [b"k" * 65], [1], [1], BB, 77, 1)
