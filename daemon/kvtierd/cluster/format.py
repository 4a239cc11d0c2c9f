"""What kvtier keeps in Mooncake Store: object names and the tagged header.

Mooncake has no authentication: any process that reaches the master can name,
read, overwrite or remove any object.  What kvtier adds, from a secret every
daemon of one cluster shares (``cluster.secret_file``):

* **Names**: a block of namespace ``ns`` written for geometry ``g`` (block
  size, model hash) is ``kvt1/<prefix>/<key hex>`` where ``prefix`` is 128 bits
  of HMAC-SHA256 under a key derived from the secret and ``ns``.  Without the
  secret nobody can compute where a namespace's blocks are (a daemon of
  another cluster sharing the master never meets them); a namespace
  re-declared with another geometry has other names, so it never reads the
  old blocks.
* **A tagged header** after the data: namespace-keyed HMAC-SHA256 over the
  header's fields (key, length, xxh3-64 of the data, geometry, write time).  A
  reader checks the tag, that the header is for the key it asked, then the
  data's xxh3 -- every read, before the block is served.  Objects written
  without the secret, or for another key or namespace, or damaged in transit
  or at rest, are misses, never served.

What this does not give: confidentiality (the bytes cross the network in the
clear, and Mooncake's transfer engine has no encryption), and protection from
an attacker *on* the cluster network who can both observe a valid object and
write memory: xxh3 is not a cryptographic hash, so such an attacker could
craft other data under a copied header.  Run the cluster on a network only
the serving hosts reach (docs/deployment.md, "Fleet").

Object layout: the data, zero-padded to the namespace's ``block_bytes``, then
:data:`HEADER_BYTES` of header.  Every object of a geometry has the same
size, so a read can name its buffers' sizes before it knows the block's
length (Mooncake's scatter reads want the exact object size).
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import stat
import struct
from collections.abc import Sequence
from typing import Final

#: The header after each object's data.
HEADER_BYTES: Final = 256
MAGIC: Final = b"KVTCLU\x00\x01"
VERSION: Final = 1
MAX_KEY_BYTES: Final = 64
#: Object names: a version, the namespace's 128-bit prefix, the key in hex.
NAME_PREFIX: Final = "kvt1/"
TAG_BYTES: Final = 32
# magic, version, key_len, pad, length, checksum, block_bytes, model_hash, written_ns, key
_HEAD = struct.Struct(f"<8sHHIQQQQQ{MAX_KEY_BYTES}s")
assert _HEAD.size + TAG_BYTES <= HEADER_BYTES


class BadObject(ValueError):
    """A cluster object that is not the block asked for (the reason says which check)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    key: bytes
    length: int
    checksum: int
    block_bytes: int
    model_hash: int
    written_ns: int


class Naming:
    """Object names and header tags for one cluster secret (thread-safe; caches keys)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self._secret = secret
        self._keys: dict[str, bytes] = {}
        self._prefixes: dict[tuple[str, int, int], str] = {}

    def _ns_key(self, namespace: str) -> bytes:
        k = self._keys.get(namespace)
        if k is None:
            k = hmac.digest(self._secret, b"kvtier-cluster-namespace\0" + namespace.encode(),
                            "sha256")
            self._keys[namespace] = k
        return k

    def prefix(self, namespace: str, block_bytes: int, model_hash: int) -> str:
        """``kvt1/<32 hex>/``: where the namespace's blocks of this geometry live."""
        g = (namespace, block_bytes, model_hash)
        p = self._prefixes.get(g)
        if p is None:
            d = hmac.digest(self._ns_key(namespace),
                            b"name\0" + struct.pack("<QQ", block_bytes, model_hash), "sha256")
            p = self._prefixes[g] = f"{NAME_PREFIX}{d[:16].hex()}/"
        return p

    def name(self, namespace: str, key: bytes, block_bytes: int, model_hash: int) -> str:
        return self.prefix(namespace, block_bytes, model_hash) + key.hex()

    def pack(self, namespace: str, h: Header) -> bytes:
        """The :data:`HEADER_BYTES` written after a block's (padded) data."""
        return self.pack_many(namespace, [h.key], [h.length], [h.checksum], h.block_bytes,
                              h.model_hash, h.written_ns)

    def pack_many(self, namespace: str, keys: Sequence[bytes], lengths: Sequence[int],
                  checksums: Sequence[int], block_bytes: int, model_hash: int,
                  written_ns: int) -> bytes:
        """The headers of a batch written at once, one after another (each what ``pack``
        gives for its block, without a :class:`Header` per block)."""
        for k in keys:
            if len(k) > MAX_KEY_BYTES:
                raise ValueError(f"key of {len(k)} bytes (at most {MAX_KEY_BYTES})")
        ns_key = self._ns_key(namespace)
        out = bytearray(HEADER_BYTES * len(keys))
        pack_into, digest = _HEAD.pack_into, hmac.digest
        tag_at = _HEAD.size
        view = memoryview(out)
        for i, (key, length, checksum) in enumerate(zip(keys, lengths, checksums,
                                                         strict=True)):
            at = i * HEADER_BYTES
            pack_into(out, at, MAGIC, VERSION, len(key), 0, length, checksum, block_bytes,
                      model_hash, written_ns, key)
            out[at + tag_at : at + tag_at + TAG_BYTES] = digest(
                ns_key, view[at : at + tag_at], "sha256")
        view.release()
        return bytes(out)

    def unpack(self, namespace: str, raw: bytes, key: bytes, block_bytes: int,
               model_hash: int) -> Header:
        """The header of the object read for ``key``, checked; ``BadObject`` otherwise.

        The data's own checksum is the caller's to verify (it is in ``dst``).
        """
        if len(raw) != HEADER_BYTES:
            raise BadObject(f"header of {len(raw)} bytes, not {HEADER_BYTES}")
        head = raw[: _HEAD.size]
        tag = raw[_HEAD.size : _HEAD.size + TAG_BYTES]
        magic, version, key_len, _pad, length, checksum, bb, mh, written, kbytes = \
            _HEAD.unpack(head)
        if magic != MAGIC:
            raise BadObject("not a kvtier cluster object (bad magic)")
        if version != VERSION:
            raise BadObject(f"object format version {version} (this daemon reads {VERSION})")
        if not hmac.compare_digest(tag, hmac.digest(self._ns_key(namespace), head, "sha256")):
            raise BadObject("header tag does not verify (another cluster secret, another "
                            "namespace, or damaged)")
        h = Header(bytes(kbytes[:key_len]), length, checksum, bb, mh, written)
        if h.key != key:
            raise BadObject(f"object holds key {h.key.hex()}")
        if (bb, mh) != (block_bytes, model_hash):
            raise BadObject("object written for another geometry")
        if length > block_bytes:
            raise BadObject(f"length {length} exceeds block_bytes {block_bytes}")
        return h


def load_secret(path: str) -> bytes:
    """The cluster secret from its file (surrounding whitespace dropped).

    Refused when the file is readable by others than its owner: every daemon of
    the cluster must keep it as private as a TLS key.
    """
    st = os.stat(path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            "chmod 600 it")
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"{path}: the cluster secret must be at least 16 bytes "
                         f"(it has {len(secret)}); e.g. `openssl rand -hex 32 > {path}`")
    return secret


