"""Whole-tier listings of the SSD tier: every entry or key held, O(entries).

Tools, tests, ``keys_of`` for a namespace's drop and warm lists: each runs off
the event loop.  The slot columns are read vectorised under the tier's lock
and copied, so the Python objects (entries, ``bytes`` keys) are made after it
is released.
"""

from __future__ import annotations

import threading

import numpy as np

from kvtierd.spill import format as fmt
from kvtierd.spill.ssd_files import INDEXED, SsdEntry, entry_at
from kvtierd.spill.ssd_index import SsdKeyIndex
from kvtierd.spill.ssd_names import NamespaceNames


class SsdListing:
    """Lists what the SSD tier's index holds (reads only; takes the tier's lock)."""

    def __init__(self, lock: threading.Lock, key_index: SsdKeyIndex,
                 names: NamespaceNames) -> None:
        self._lock = lock
        self._key_index = key_index
        self._names = names

    def entries(self, namespace: str | None = None) -> list[SsdEntry]:
        """A snapshot of every indexed entry (of ``namespace`` when given)."""
        with self._lock:
            out: list[SsdEntry] = []
            for f in self._key_index.files:
                mask = f.state == INDEXED
                if namespace is not None:
                    mask &= f.nsid == self._names.ids.get(namespace, -1)
                out.extend(entry_at(self._names.names, f, int(s)) for s in np.flatnonzero(mask))
            return out

    def all_keys(self) -> list[tuple[str, bytes]]:
        """Every (namespace, key) held."""
        parts = self._snapshot_keys(None, None)
        names = self._names.names
        return [(names[i], k[:n].tobytes()) for ids, lens, keys in parts
                for i, n, k in zip(ids.tolist(), lens.tolist(), keys, strict=True)]

    def keys_of(self, namespace: str, geometry: tuple[int, int] | None = None) -> list[bytes]:
        """The keys held for ``namespace`` (only those written for ``geometry``, a
        (block_bytes, model hash) pair, when given)."""
        parts = self._snapshot_keys(namespace, geometry)
        return [k[:n].tobytes() for _, lens, keys in parts
                for n, k in zip(lens.tolist(), keys, strict=True)]

    def _snapshot_keys(self, namespace: str | None, geometry: tuple[int, int] | None
                       ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(namespace ids, key lengths, key fields) of the indexed entries, copied under
        the lock (vectorised) so the bytes objects are made outside it."""
        out = []
        with self._lock:
            want = -1 if namespace is None else self._names.ids.get(namespace)
            if want is None:
                return []
            for f in self._key_index.files:
                mask = f.state == INDEXED
                if want >= 0:
                    mask &= f.nsid == want
                if geometry is not None:
                    rows = f.rows()
                    mask &= (rows["block_bytes"] == geometry[0]) & (
                        rows["model_hash"] == geometry[1])
                    del rows
                sel = np.flatnonzero(mask)
                raw = f.raw()
                out.append((f.nsid[sel], raw[sel, 1].copy(),
                            raw[sel, fmt.KEY_AT : fmt.KEY_AT + fmt.MAX_KEY_BYTES].copy()))
                del raw
        return out
