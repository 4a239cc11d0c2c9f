"""Stub for kvtier._native (csrc/native.c): GIL-free bulk memory and file helpers.

Use them through kvtier._accel, which falls back to numpy (checksum: the
xxhash package, file I/O: os.pwritev/os.preadv) when the extension is missing.
With install_fault_guard() done, the memory helpers raise OSError(EFAULT) for a
SIGBUS in a buffer (a mapped file truncated under it) instead of dying.
Checked by ``python -m mypy.stubtest kvtier._native``.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeAlias, final, overload

# Any object exporting the buffer protocol (mmap, memoryview, bytearray,
# numpy array); Python 3.11 has no collections.abc.Buffer to say so.
_Buffer: TypeAlias = Any

def copy(dst: _Buffer, src: _Buffer, threads: int = 0) -> int:
    """Copy all bytes of src into the start of dst; return the number copied."""

def prefault(buf: _Buffer, threads: int = 0) -> int:
    """Fault every page of buf in writable, leaving its content unchanged."""

def xxh3_dispatch() -> str:
    """The XXH3 path for inputs over 240 bytes: "sse2" or "avx2" (KVTIER_XXH3), or "portable"."""

def checksum(buf: _Buffer) -> int:
    """Return the XXH3-64 hash (seed 0) of the bytes of buf, as an int."""

def slot_usage(table: _Buffer, /) -> tuple[int, int, bytes]:
    """A slot table's COMMITTED entries with an in-bounds last access: (count, newest, lasts)."""

def hash_rows(buf: _Buffer, stride: int, start: int, stop: int, seeds: _Buffer) -> bytes:
    """XXH3-64 of bytes [start, stop) of each stride-byte row of buf, row i seeded with seeds[i]."""

def ssd_find_slots(buckets: _Buffer, tables: Sequence[_Buffer], bases: Sequence[int],
                   keys: Sequence[_Buffer], namespace: _Buffer) -> bytes:
    """The SSD tier's key index asked about many keys: one int64 per key, its slot id or -1."""

def gather(dst: _Buffer, pieces: Iterable[_Buffer], threads: int = 0) -> int:
    """Copy the buffers of pieces back to back into the start of dst; return the total."""

def scatter(src: _Buffer, pieces: Iterable[_Buffer], threads: int = 0) -> int:
    """Fill the buffers of pieces, in order, from consecutive bytes of src; return the total."""

@overload
def scatter_hash(srcs: Iterable[_Buffer], pieces: Iterable[Iterable[_Buffer]],
                 threads: int = 0, hash: Literal[True] = True) -> list[int]: ...
@overload
def scatter_hash(srcs: Iterable[_Buffer], pieces: Iterable[Iterable[_Buffer]],
                 threads: int, hash: Literal[False]) -> None:
    """Scatter each srcs[i] into pieces[i]; return each source's XXH3-64 (None with
    hash=False: the copies only), in one pass."""

def scatter_hash_at(srcs: Iterable[_Buffer], bases: Iterable[_Buffer], offsets: Iterable[int],
                    limit: int, threads: int = 0, hash: bool = True
                    ) -> tuple[list[int] | None, list[int]]:
    """scatter_hash with one piece a source: srcs[i] into bases[i] from byte offsets[i]
    on; returns (each source's XXH3-64, None with hash=False; each source's size)."""

def pwrite_full(fd: int, buf: _Buffer, offset: int, threads: int = 0) -> int:
    """Write all of buf to fd at file position offset; return the number written."""

def pread_full(fd: int, buf: _Buffer, offset: int, threads: int = 0) -> int:
    """Read into all of buf from fd at offset; return the number read (less only at EOF)."""

def install_fault_guard() -> bool:
    """Make a SIGBUS in copy/prefault/checksum/gather/scatter(_hash) raise OSError(EFAULT).

    Installs the process's SIGBUS handler once; True if this call installed it.
    """

def fault_guard_installed() -> bool:
    """Return True if install_fault_guard() has installed the guard."""

# The shared index (csrc/index.c): the daemon's table of a namespace's DRAM keys,
# which clients map read-only and search (kvtierd.shared_index, kvtier._index).
def index_format(buf: _Buffer, capacity: int, seed: int, max_probe: int = 1024) -> None:
    """Lay out an empty table of capacity (a power of two) entries in zeroed buf; probes
    stop after max_probe entries (at most 1024)."""

# Where a block is, as the daemon publishes it: (segment, slot, offset, length, checksum).
_Location: TypeAlias = tuple[int, int, int, int, int | None]

def index_set(buf: _Buffer, key: bytes, tier: int, ref: int, loc: _Location | None = None) -> int:
    """Insert or update key: 1 stored, 0 past the probe limit, -1 the table is full."""

def index_set_many(buf: _Buffer, keys: list[bytes], tier: int, start: int,
                   locs: Sequence[_Location] | None = None) -> tuple[int, list[int]]:
    """index_set of keys[start:] until the table is full: (index stopped at, indices skipped)."""

def index_remove(buf: _Buffer, key: bytes) -> bool:
    """Remove key; True if it was there."""

def index_remove_many(buf: _Buffer, keys: Sequence[bytes]) -> bytes:
    """Remove each key; bytes, 1 per key that was there."""

def index_get(buf: _Buffer, key: bytes) -> tuple[int, int] | None:
    """(tier, ref) of key, or None (the writer's view: no retries)."""

def index_locate(buf: _Buffer, key: bytes) -> _Location | None:
    """Where key's block is, as published (the writer's view), or None."""

def index_set_slots(buf: _Buffer, table: _Buffer, slots: _Buffer, segment: int,
                    slot_bytes: int, start: int, threads: int = 1) -> tuple[int, list[int]]:
    """The keys of COMMITTED slot-table entries into the table, from slots[start:], on up
    to ``threads`` threads: (index stopped at, indices left out: present already, or
    past the probe limit)."""

def index_find_many(buf: _Buffer, keys: Sequence[bytes]) -> bytes:
    """One u64 per key: segment << 32 | slot of its live entry, or 0 (the writer's view)."""

def index_present_many(buf: _Buffer, keys: Sequence[bytes]) -> bytes:
    """One byte per key: 1 if the table holds it now, else 0 (the reader's view: seqlocked,
    safe while the daemon writes; a busy entry, a key past the probe limit or a superseded
    table answer 0).  ValueError unless every key is bytes of 1..64 bytes."""

def index_acquire(buf: _Buffer, keys: list[bytes], page: _Buffer, at: int,
                  serial: int) -> list[tuple[int, int, int, int, bool]] | None:
    """Lease the leading keys present without a call, with hazards (and the lease's serial)
    at page entries at..: (segment, offset, length, checksum, has_checksum) of each, or
    None (ask the daemon: no hazard is left then)."""

def hazards_clear(page: _Buffer, at: int, n: int) -> int:
    """End a lease without a call: zero the hazards at..at+n; how many the daemon had
    already zeroed (expired)."""

def hazards_collect(pages: Sequence[_Buffer]) -> set[int]:
    """Every non-zero hazard of the pages, read after a full fence."""

def hazards_list(page: _Buffer) -> list[tuple[int, int, int]]:
    """(index, hazard, serial) of each non-zero hazard of the page."""

def hazards_expire(page: _Buffer, index: int, hazard: int) -> bool:
    """Zero hazard ``index`` if it still holds ``hazard`` (the daemon ends a lease)."""

def grants_take(page: _Buffer, n: int) -> list[tuple[int, int]] | None:
    """Take n grants of the page's write area: [(entry, word)], or None (none taken)."""

def grants_take_columns(page: _Buffer, n: int, slot_bytes: int
                        ) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """``grants_take`` as columns: (entries, words, segment ids, offsets = slot *
    slot_bytes, saturated at 2**64 - 1), or None (none taken)."""

def grants_untake(page: _Buffer, taken: Sequence[tuple[int, int]]) -> None:
    """Give back grants taken and not committed."""

def commits_put(page: _Buffer, head: int,
                records: Sequence[tuple[int, int, bytes, int, int | None]]) -> int:
    """Write commit records (grant entry, grant word, key, length, checksum) at head, the
    last ending the batch, then publish them; the new head."""

def commits_put_columns(page: _Buffer, head: int, entries: Sequence[int],
                        words: Sequence[int], keys: Sequence[bytes], lengths: Sequence[int],
                        sums: Sequence[int | None] | None) -> int:
    """``commits_put`` of the records (entries[i], words[i], keys[i], lengths[i], sums[i])
    without a tuple per record (sums None: no checksums); the new head."""

def done_wait(page: _Buffer, target: int, seconds: float) -> bool:
    """Wait (GIL released) until the page's DONE word reaches target; True if it did."""

def readable_spin(fd: int, seconds: float) -> bool:
    """Look for input on ``fd`` for up to ``seconds``, yielding the CPU between looks (GIL
    released); True if there is some (or end of file, or an error: a read says which)."""

def commits_take(page: _Buffer, tail: int, max_length: int, held: _Buffer | None = None
                 ) -> tuple[int, list[tuple[int, int, int]], list[bytes], bytes, bytes] | \
        tuple[int, None, None, None, None]:
    """The daemon's side: (head, batches, keys, columns, flags) of the records from tail,
    copied out of the page, or (head, None, None, None, None) for an impossible head.
    ``batches``: [(start, end, refusal)], each batch ending with a LAST record (or the
    last one); its refusal 0, INVALID (a key not of 1..64 bytes, a length not of
    1..max_length, a grant entry out of range, a grant or key twice) or LOST (a word not
    the one ``held``, the session's grant words, has for its entry).  ``columns``: six
    rows of u64 (grant entry, grant word, its slot ref, length, checksum, has a checksum);
    ``flags``: one byte per record."""

def commits_done(page: _Buffer, tail: int, results: bytes) -> None:
    """The daemon's side: result bytes of the records from tail, then DONE and a wake-up."""

def commit_results(page: _Buffer, at: int, n: int) -> bytes:
    """The result bytes of records at..at+n."""

def grants_store(page: _Buffer, entries: _Buffer, words: _Buffer) -> None:
    """Atomic stores of u64 ``words`` into grant ``entries`` (u64 columns; ValueError,
    nothing stored, for an entry out of range)."""

def grants_grant(page: _Buffer, held: _Buffer, gens: _Buffer, refs: _Buffer,
                 ref_gens: _Buffer) -> None:
    """Grant ``refs`` (at ``ref_gens``) in the first entries whose word in ``held`` (the
    daemon's u64 words of every grant entry, with their generations in ``gens``) is 0:
    each word becomes VALID | ref there and in the page.  ValueError, nothing changed,
    for fewer free entries than refs or a ref with a flag bit."""

def page_cas(page: _Buffer, offset: int, old: int, new: int) -> bool:
    """Compare-and-swap of the u64 at offset; True if swapped."""

def page_store(page: _Buffer, offset: int, value: int) -> None:
    """An atomic store of the u64 at offset."""

def index_lookup(buf: _Buffer, keys: list[bytes],
                 stats: _Buffer | None = None) -> tuple[bytes, bool] | None:
    """The tiers of the leading keys present and whether a miss there is final; None when
    the table cannot answer (superseded, a key not 1..64 bytes, an entry kept busy)."""

def index_copy(dst: _Buffer, src: _Buffer) -> tuple[int, int]:
    """Put src's live entries into dst: (copied, skipped at the probe limit)."""

def index_info(buf: _Buffer) -> tuple[int, int, int, int]:
    """(capacity, live entries, used entries, flags)."""

def index_set_flags(buf: _Buffer, flags: int) -> None:
    """Set the header's flags word (1: superseded, 2: a miss is not final)."""

def keys_check(keys: Sequence[bytes], max_len: int, repeats: bool = True) -> tuple[int, int]:
    """(first key not bytes of 1..max_len, first key repeating an earlier one: -1 without
    ``repeats``), -1: none."""

def index_fingerprint(key: bytes) -> bytes:
    """The 17 bytes a table entry stores for key."""

def index_fingerprints(buf: _Buffer) -> list[bytes]:
    """The fingerprints of every live entry."""

def index_rows(buf: _Buffer) -> bytes:
    """Every live entry's fingerprint as a 24-byte row (fp0, fp1, flags as u64s)."""

def fingerprint_rows(keys: Sequence[bytes]) -> bytes:
    """The 24-byte rows of keys' fingerprints."""

def check_keys(extent_rows: Sequence[_Buffer], index_rows: _Buffer, unpublished_rows: _Buffer,
               seed: int) -> tuple[int, bool, bool, list[tuple[int, int]], int, bool]:
    """The key index against the slot tables' check rows: (committed keys, a key committed
    twice, the index holding a key twice, [(extent position, slot)] of up to 5 committed
    keys not in the index, distinct index keys no slot holds, an unpublished key no slot
    holds)."""

def varints_field(field: int, values: _Buffer) -> bytes:
    """``values`` (a buffer of u8, u32 or u64) encoded as the packed repeated field number
    ``field`` (b"" for none), to merge into a protobuf message (``csrc/wire.c``)."""

def varints_column(message: _Buffer, field: int) -> bytes:
    """The u64 values, as bytes, of repeated varint field number ``field`` of a serialized
    protobuf message (packed or not); ValueError when the message is malformed."""

def index_populate(buf: _Buffer, write: bool = True, touch: bool = True) -> bool:
    """Fault every page of buf in now (GIL released); False: madvise could not (then,
    with touch, each page was touched)."""

# The shared layouts (csrc/layout.h, exported by csrc/layout.c): Python's one source of
# every offset and size of the slot entry, the SSD entry, the session page, its commit
# records and the slot ref (kvtier._page, kvtier._slot_ref, kvtierd.layout).

#: Every constant of csrc/layout.h, by name without its KVT_ prefix.
LAYOUT: dict[str, int]
#: Each record's fields ("slot_entry", "ssd_entry", "commit_record"): name -> (offset,
#: bytes, kind), kind "u" a little-endian unsigned integer, "s" a byte string.
FIELDS: dict[str, dict[str, tuple[int, int, str]]]


# The block table (csrc/blocks.c): a namespace's DRAM blocks as native records over the
# persisted slot tables; kvtierd.block_table wraps it.  Refs are uint64 slot refs
# (kvtier._slot_ref), passed and returned as buffers of native uint64 (numpy arrays, bytes).

#: The table's own constants (csrc/blocks.h): its record's bytes, the eviction policies'
#: and the lower-tier states' codes.
BLOCK_TABLE: dict[str, int]

@final
class BlockTable:
    """One namespace's blocks: 12 bytes of native state per slot, batched calls."""

    def __init__(self, block_bytes: int, slot_bytes: int, seed: int = 0) -> None: ...
    @property
    def native_bytes(self) -> int:
        """Bytes of native memory the table holds."""
    @property
    def block_bytes(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def n_slots(self) -> int:
        """Slots of all the table's extents."""
    @property
    def n_free(self) -> int:
        """FREE slots of all the table's extents."""
    def add_extent(self, extent_id: int, n_slots: int, meta: _Buffer, created_unix_ns: int,
                   /) -> None:
        """Add a freshly formatted extent (all FREE) over its writable slot table."""
    def remove_extent(self, extent_id: int, force: bool = False) -> tuple[int, int]:
        """Drop an extent (refused while a slot is pinned, unless force): (committed, reserved)."""
    def adopt(self, extent_id: int, boot_epoch: int, intact_bytes: int,
              referenced_from: int = ..., /) -> dict[str, Any]:
        """Validate and take over a previous run's slot table (recovery.scan_slots in C)."""
    def claim(self, n: int, skip: _Buffer | None = None,
              evict: _Buffer | None = None) -> tuple[bytes, int]:
        """Take n free slots (and evict the blocks of evict) into RESERVED, all or
        nothing: (refs, 0) or (b'', short)."""
    def release_claims(self, refs: _Buffer, unpin: _Buffer | None = None) -> bytes:
        """Free RESERVED slots and end the pins of unpin; the DOOMED refs freed."""
    def commit(self, refs: _Buffer, keys: Sequence[bytes], lengths: _Buffer,
               checksums: _Buffer | None, has_checksum: _Buffer | None, first_access: int,
               epoch: int, release: _Buffer | None = None, index: _Buffer | None = None,
               /) -> tuple[int, list[int]] | None:
        """Make RESERVED slots COMMITTED (the slot table's entries, state byte last) and
        free the RESERVED slots of release; with index, publish their keys there too:
        (done, left)."""
    def commit_ring(self, page: _Buffer, tail: int, max_length: int, held: _Buffer,
                    index: _Buffer, first_access: int, epoch: int,
                    exists: Callable[[list[bytes]], Sequence[object]] | None, want_keys: bool,
                    answer_min: int = -1,
                    /) -> (tuple[int, bytes, bytes, int, int, int, bytes, list[bytes] | None,
                                 bool] | None):
        """A session's plain commit ring in one call (commit's transition, the keys
        published, the grants ended in held and the page, and the answers with DONE
        when held keeps answer_min grants or more): (n, refs, entries, nbytes, done,
        n_left, left, keys, answered), or None having changed nothing."""
    def unpublish(self, refs: _Buffer, index: _Buffer, /) -> bytes:
        """Take the blocks at refs out of the shared index by their slot entries' keys,
        only where the index names that block: 1 per ref removed."""
    def pin(self, refs: _Buffer, /) -> None:
        """Pin COMMITTED blocks (count + 1 per ref)."""
    def unpin(self, refs: _Buffer, /) -> bytes:
        """End pins; the DOOMED blocks whose last pin ended are freed: their refs."""
    def delete(self, refs: _Buffer, /) -> int:
        """Free unpinned COMMITTED blocks, doom pinned ones: how many were doomed."""
    def evict(self, refs: _Buffer, reserve: bool = False) -> None:
        """Free (or with reserve, take into RESERVED) unpinned COMMITTED blocks."""
    def set_lower(self, refs: _Buffer, lower: int, generations: _Buffer | None = None) -> int:
        """Record the spill tiers' state of COMMITTED blocks: how many changed."""
    def touch(self, refs: _Buffer, first_access: int, hints: bool = False) -> tuple[int, int]:
        """Record reads (last access, CLOCK bit): (touched, were prefetched)."""
    def set_prefetched(self, refs: _Buffer, /) -> int:
        """Mark COMMITTED blocks as prefetched: how many were marked."""
    def victims(self, n: int, policy: int, sample: int = 5, pool: bool = True,
                spill: bool = False, skip: _Buffer | None = None) -> bytes:
        """Up to n blocks to evict, chosen by sampled LRU (0) or CLOCK (1)."""
    def dirty(self, n: int, policy: int, sample: int = 5, pool: bool = True,
              spill: bool = False, skip: _Buffer | None = None) -> bytes:
        """Up to n unpinned DIRTY blocks the policy would evict first (demotion candidates)."""
    def counts(self, extent_id: int | None = None, /) -> dict[str, int]:
        """Slots by category, of one extent or the table, in O(1)."""
    def inspect(self, refs: _Buffer, /) -> bytes:
        """16-byte rows: state, lower, flags, 0, pins (u32), generation (u64)."""
    def entries(self, refs: _Buffer, keys: bool = True) -> tuple[list[bytes] | None, bytes]:
        """Each ref's persisted key and entry fields."""
    def find_keys(self, index: _Buffer, keys: Sequence[bytes], /) -> bytearray:
        """Each key's ref in the shared index whose slot entry holds it, else 0 (u64 each)."""
    def match_keys(self, refs: _Buffer, keys: Sequence[bytes], /) -> bytes:
        """1 or 0 per ref: whether it holds a COMMITTED block whose persisted key is keys[i]."""
    def committed(self, extent_id: int, /) -> bytes:
        """The refs of an extent's COMMITTED slots, ascending."""
    def rescale_access(self, shift: int, /) -> int:
        """Shift every COMMITTED block's last access right by shift bits; how many."""
    def extents(self, /) -> list[int]:
        """The extents' ids, ascending."""
    def check(self, /) -> list[str]:
        """Cross-check the records against the slot tables: the problems found."""
    def check_rows(self, extent_id: int, /) -> bytes:
        """24 bytes a slot: fingerprint or generation, state, key length, flags, pins."""
