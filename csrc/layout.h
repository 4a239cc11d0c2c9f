/* The one definition of every record that C, the daemon and the client share:
 *
 *   the DRAM slot entry   a segment's persisted slot table (.meta file): csrc/blocks.c
 *                         writes it, daemon/kvtierd/segments.py and recovery read it;
 *   the SSD slot entry    a spill file's slot table: daemon/kvtierd/spill/format.py writes
 *                         it, ssd_find_slots (csrc/native.c) reads it;
 *   the session page      a client's page (csrc/index.c, csrc/writes.c; kvtier._index
 *                         and kvtierd.shared_index) and its commit records;
 *   the slot ref          how a block's place is named in one u64 (kvtier._slot_ref).
 *
 * Plain C: no Python here, nothing but numbers, so any C program can include it
 * (tests/unit/test_layout_header.py compiles one).  Python never writes these numbers
 * itself: the module exports every constant below as kvtier._native.LAYOUT (the KVT_
 * prefix dropped) and the field tables as kvtier._native.FIELDS (csrc/layout.c), and
 * kvtier._page and kvtierd.layout read them from there.  The test fails when what
 * Python reads differs from what a C compiler reads here.  Every multi-byte field is
 * little-endian.
 */
#ifndef KVT_LAYOUT_H
#define KVT_LAYOUT_H

#include <stdint.h>

/* ------------------------------------------------------------------ the slot ref */

/* A block's place: segment (extent) id << KVT_REF_SHIFT | slot.  A segment id is
 * below 2**31, so a hazard word (KVT_HAZARD_BIT | ref) and a grant word
 * (KVT_GRANT_VALID [| KVT_GRANT_TAKEN] | ref) keep their flags in the top bits. */
#define KVT_REF_SHIFT 32
#define KVT_REF_SLOT_MASK 0xFFFFFFFFull
#define KVT_REF_SEGMENT_MASK 0x7FFFFFFFull /* a ref's segment id, a hazard's bit dropped */
#define KVT_REF(segment, slot) ((uint64_t)(segment) << KVT_REF_SHIFT | (uint64_t)(slot))
#define KVT_REF_SEGMENT(ref) ((uint64_t)(ref) >> KVT_REF_SHIFT)
#define KVT_REF_SLOT(ref) ((uint64_t)(ref) & KVT_REF_SLOT_MASK)

/* ------------------------------------------------------------------ the DRAM slot entry */

/* A segment's slot table (daemon/kvtierd/segments.py, format 2) is n_slots entries of
 * KVT_SLOT_BYTES at KVT_SLOT_TABLE_OFFSET of the extent's .meta file. */
#define KVT_SLOT_TABLE_OFFSET 4096 /* the header page comes first */
#define KVT_SLOT_BYTES 128         /* a 64-byte key and the fixed fields: two cache lines */

#define KVT_SLOT_STATE 0         /* u8: KVT_ST_* (written last at commit, first at free) */
#define KVT_SLOT_KEY_LEN 1       /* u8: 1..KVT_SLOT_MAX_KEY when committed */
#define KVT_SLOT_FLAGS 2         /* u8: KVT_SLOT_HAS_CHECKSUM */
#define KVT_SLOT_LENGTH 8        /* u64: committed bytes, 1..block_bytes */
#define KVT_SLOT_CHECKSUM 16     /* u64: the writer's XXH3-64, 0 without the flag */
#define KVT_SLOT_GENERATION 24   /* u64: bumped at every reserve, < KVT_MAX_GENERATION */
#define KVT_SLOT_EPOCH 32        /* u64: boot epoch of the daemon that committed it */
#define KVT_SLOT_KEY 40          /* KVT_SLOT_MAX_KEY bytes, zero-padded */
#define KVT_SLOT_ENTRY_SUM 104   /* u64: XXH3-64 of bytes [1, 104), seeded (below) */
#define KVT_SLOT_LAST_ACCESS 112 /* u64: access sequence, an LRU hint (not summed) */
#define KVT_SLOT_MAX_KEY 64
/* The entry checksum covers [KVT_SLOT_SUM_FROM, KVT_SLOT_SUM_TO): everything but the
 * state byte and the last access; seed = created_unix_ns ^ slot * KVT_SLOT_SEED_MUL
 * (the 64-bit golden ratio: a row copied to another slot does not verify). */
#define KVT_SLOT_SUM_FROM 1
#define KVT_SLOT_SUM_TO KVT_SLOT_ENTRY_SUM
#define KVT_SLOT_SEED_MUL 0x9E3779B97F4A7C15ull
#define KVT_SLOT_HAS_CHECKSUM 1

/* The persisted state byte (segments.SlotState). */
#define KVT_ST_FREE 0
#define KVT_ST_RESERVED 1
#define KVT_ST_COMMITTED 2
#define KVT_ST_DOOMED 3 /* deleted while leased: freed at the last release */

/* Bounds adoption enforces: at a million reserves a second, 2**48 lasts nine years. */
#define KVT_MAX_GENERATION (1ull << 48)
#define KVT_MAX_ACCESS_SEQ (1ull << 48)

/* ------------------------------------------------------------------ the SSD slot entry */

/* A spill file (daemon/kvtierd/spill/format.py, version 1) holds n_slots entries of
 * KVT_SSD_ENTRY after its header page.  The SSD tier's key index hashes an entry's
 * zero-padded key and namespace, KVT_SSD_FIELD bytes from KVT_SSD_KEY_AT (XXH3-64
 * seeded with key_len | ns_len << 8). */
#define KVT_SSD_ENTRY 256       /* a 64-byte key and a 128-byte namespace plus the fixed fields */
#define KVT_SSD_STATE 0         /* u8: FREE 0, COMMITTED 1 (format.EntryState) */
#define KVT_SSD_KEY_LEN 1       /* u8: 1..KVT_SSD_MAX_KEY */
#define KVT_SSD_NS_LEN 2        /* u8: 0..KVT_SSD_NAME */
#define KVT_SSD_LENGTH 8        /* u64: committed bytes */
#define KVT_SSD_CHECKSUM 16     /* u64: XXH3-64 of the data */
#define KVT_SSD_BLOCK_BYTES 24  /* u64: the namespace's block_bytes */
#define KVT_SSD_MODEL_HASH 32   /* u64: XXH3-64 of its model_uid */
#define KVT_SSD_SEQ 40          /* u64: write sequence (newest wins, LRU after a restart) */
#define KVT_SSD_KEY_AT 48       /* KVT_SSD_MAX_KEY bytes, zero-padded */
#define KVT_SSD_MAX_KEY 64
#define KVT_SSD_NS_AT 112       /* KVT_SSD_NAME bytes, zero-padded, right after the key */
#define KVT_SSD_NAME 128
#define KVT_SSD_ENTRY_SUM 240   /* u64: XXH3-64 (seed 0) of bytes [0, 240) */
#define KVT_SSD_FIELD (KVT_SSD_MAX_KEY + KVT_SSD_NAME)

/* ------------------------------------------------------------------ the session page */

/* The shared index (csrc/index.c): a header, then capacity entries, each a cache line;
 * a probe visits at most KVT_IDX_MAX_PROBE entries.  The header's flags word: */
#define KVT_IDX_HEADER_BYTES 64u
#define KVT_IDX_ENTRY_BYTES 64u
#define KVT_IDX_MAX_PROBE 1024u
#define KVT_IDX_SUPERSEDED 1u     /* a newer table replaced this one: map that */
#define KVT_IDX_MISS_NOT_FINAL 2u /* a miss here may be a hit below DRAM: ask the daemon */

/* A session's page: written by its client, read (and expired) by the daemon
 * (index.c's leases).  Byte offsets of little-endian u64s. */
#define KVT_PAGE_BYTES 16384
#define KVT_PAGE_COUNTERS 0    /* the client's counters, KVT_PAGE_COUNTERS_N u64s: */
#define KVT_PAGE_COUNTERS_N 7  /* lookups, lookup hit keys, lookup missed keys, acquires,
                                * acquire hit keys, acquire missed keys, bytes leased */
#define KVT_PAGE_HAZARD_HI 64  /* hazards at [0, hi) may be non-zero (the client keeps it) */
#define KVT_PAGE_RING_HEAD 72  /* blocks read so far (the ring's next position) */
#define KVT_PAGE_MAX_LEASES 80 /* daemon-written: the session's lease limit */
#define KVT_PAGE_MAX_RESERVATIONS 88   /* daemon-written: its reservation limit */
#define KVT_PAGE_LOCAL_RESERVATIONS 96 /* client-written: reservations it holds from
                                        * grants (a page with a write area) */
#define KVT_PAGE_MAX_HAZARDS 104 /* daemon-written: KVT_MAX_HAZARDS_SET | n, the hazard
                                  * entries [0, n) the session may use (the daemon reads
                                  * no entry past n; 0 from an older daemon: all) */
#define KVT_MAX_HAZARDS_SET (1ull << 63)
#define KVT_PAGE_RING 1024     /* the ring of blocks read: hazard values */
#define KVT_PAGE_RING_N 384
#define KVT_PAGE_HAZARDS 4096  /* one u64 per leased block, 0 when unused or expired */
#define KVT_PAGE_SERIALS 10240 /* beside each hazard, its lease's serial (non-zero) */
#define KVT_PAGE_HAZARDS_N 768
#define KVT_HAZARD_BIT (1ull << 63) /* a hazard is BIT | slot ref */

/* A page with a write area (csrc/writes.c) is twice as long; the first half is the
 * page above.  Byte offsets in the second half: */
#define KVT_WPAGE_BYTES 32768
#define KVT_W_HEAD 16384      /* u64: commit records the client published */
#define KVT_W_DONE 16392      /* u32 (a futex word): records the daemon finished */
#define KVT_W_WAITERS 16396   /* u32: writers asleep on DONE (the daemon wakes them) */
#define KVT_W_WANT 16400      /* u64: how many grants the client would like to hold */
#define KVT_W_GRANTS 16896    /* one u64 per grant: 0, or VALID | slot ref */
#define KVT_W_GRANTS_N 256
#define KVT_GRANT_VALID (1ull << 63)
#define KVT_GRANT_TAKEN (1ull << 62) /* set by the writer filling the slot */
#define KVT_GRANT_SEGMENT_MASK 0x3FFFFFFFull /* a grant word's segment: bits 32..61 */
#define KVT_W_RING 18944      /* the commit records */
#define KVT_W_RECORD 96
#define KVT_W_RING_N 128
#define KVT_W_KEY_MAX 64
/* A commit record: byte offsets of its fields. */
#define KVT_R_GRANT 0         /* u32: the grant entry */
#define KVT_R_LENGTH 4        /* u32 */
#define KVT_R_CHECKSUM 8      /* u64 */
#define KVT_R_KEYLEN 16       /* u8 */
#define KVT_R_FLAGS 17        /* u8: KVT_W_HAS_SUM | KVT_W_LAST */
#define KVT_R_RESULT 18       /* u8: the daemon's answer, KVT_W_COMMITTED .. */
#define KVT_R_KEY 24          /* KVT_W_KEY_MAX bytes */
#define KVT_R_WORD 88         /* u64: the grant's word as the writer took it */
#define KVT_W_HAS_SUM 1       /* a record's flags */
#define KVT_W_LAST 2          /* the last record of a commit (all or nothing up to it) */
/* A record's result byte. */
#define KVT_W_COMMITTED 1
#define KVT_W_EXISTS 2        /* the key was present (or being written): the grant stays */
#define KVT_W_INVALID 3       /* the batch was malformed: nothing of it committed */
#define KVT_W_LOST 4          /* a record of the batch names no grant the session holds
                               * (committed already, taken back, expired, never its own):
                               * nothing of it committed (docs/security.md) */
#define KVT_W_FAILED 5        /* the daemon itself failed (its slot table could not be
                               * written): nothing of it committed; never a writer's fault */

/* ------------------------------------------------------------------ the field tables */

/* Every field of each record, X(name, offset, bytes, kind): kind 'u' a little-endian
 * unsigned integer, 's' a byte string.  Python builds its numpy dtypes and structs
 * from these (kvtierd.layout); the gaps between fields are zero padding. */
#define KVT_SLOT_FIELDS(X)                                     \
    X(state, KVT_SLOT_STATE, 1, 'u')                           \
    X(key_len, KVT_SLOT_KEY_LEN, 1, 'u')                       \
    X(flags, KVT_SLOT_FLAGS, 1, 'u')                           \
    X(length, KVT_SLOT_LENGTH, 8, 'u')                         \
    X(checksum, KVT_SLOT_CHECKSUM, 8, 'u')                     \
    X(generation, KVT_SLOT_GENERATION, 8, 'u')                 \
    X(epoch, KVT_SLOT_EPOCH, 8, 'u')                           \
    X(key, KVT_SLOT_KEY, KVT_SLOT_MAX_KEY, 's')                \
    X(entry_sum, KVT_SLOT_ENTRY_SUM, 8, 'u')                   \
    X(last_access, KVT_SLOT_LAST_ACCESS, 8, 'u')

#define KVT_SSD_FIELDS(X)                                      \
    X(state, KVT_SSD_STATE, 1, 'u')                            \
    X(key_len, KVT_SSD_KEY_LEN, 1, 'u')                        \
    X(ns_len, KVT_SSD_NS_LEN, 1, 'u')                          \
    X(length, KVT_SSD_LENGTH, 8, 'u')                          \
    X(checksum, KVT_SSD_CHECKSUM, 8, 'u')                      \
    X(block_bytes, KVT_SSD_BLOCK_BYTES, 8, 'u')                \
    X(model_hash, KVT_SSD_MODEL_HASH, 8, 'u')                  \
    X(seq, KVT_SSD_SEQ, 8, 'u')                                \
    X(key, KVT_SSD_KEY_AT, KVT_SSD_MAX_KEY, 's')               \
    X(namespace, KVT_SSD_NS_AT, KVT_SSD_NAME, 's')             \
    X(entry_sum, KVT_SSD_ENTRY_SUM, 8, 'u')

#define KVT_RECORD_FIELDS(X)                                   \
    X(grant, KVT_R_GRANT, 4, 'u')                              \
    X(length, KVT_R_LENGTH, 4, 'u')                            \
    X(checksum, KVT_R_CHECKSUM, 8, 'u')                        \
    X(key_len, KVT_R_KEYLEN, 1, 'u')                           \
    X(flags, KVT_R_FLAGS, 1, 'u')                              \
    X(result, KVT_R_RESULT, 1, 'u')                            \
    X(key, KVT_R_KEY, KVT_W_KEY_MAX, 's')                      \
    X(word, KVT_R_WORD, 8, 'u')

/* Each field lies inside its record, and an integer is naturally aligned (the daemon
 * and the client read them with native loads and atomics). */
#define KVT_FIELD_FITS_(size, name, off, n, kind)                                     \
    _Static_assert((off) + (n) <= (size) && ((kind) != 'u' || (off) % (n) == 0),     \
                   #name " lies inside its record, aligned");
#define KVT_SLOT_FITS_(name, off, n, kind) KVT_FIELD_FITS_(KVT_SLOT_BYTES, slot_##name, off, n, kind)
#define KVT_SSD_FITS_(name, off, n, kind) KVT_FIELD_FITS_(KVT_SSD_ENTRY, ssd_##name, off, n, kind)
#define KVT_RECORD_FITS_(name, off, n, kind) KVT_FIELD_FITS_(KVT_W_RECORD, record_##name, off, n, kind)
KVT_SLOT_FIELDS(KVT_SLOT_FITS_)
KVT_SSD_FIELDS(KVT_SSD_FITS_)
KVT_RECORD_FIELDS(KVT_RECORD_FITS_)
#undef KVT_SLOT_FITS_
#undef KVT_SSD_FITS_
#undef KVT_RECORD_FITS_
#undef KVT_FIELD_FITS_

_Static_assert(KVT_SSD_NS_AT == KVT_SSD_KEY_AT + KVT_SSD_MAX_KEY,
               "the SSD entry's namespace follows its key: the index hashes both at once");
_Static_assert(KVT_SSD_KEY_AT + KVT_SSD_FIELD <= KVT_SSD_ENTRY_SUM, "the field is summed");
_Static_assert(KVT_SLOT_KEY + KVT_SLOT_MAX_KEY <= KVT_SLOT_SUM_TO, "the key is summed");
_Static_assert(KVT_W_KEY_MAX == KVT_SLOT_MAX_KEY, "a record's key fits a slot's");
_Static_assert(KVT_PAGE_SERIALS + 8 * KVT_PAGE_HAZARDS_N <= KVT_PAGE_BYTES, "the page fits");
_Static_assert(KVT_W_RING + KVT_W_RING_N * KVT_W_RECORD <= KVT_WPAGE_BYTES, "the ring fits");
_Static_assert(KVT_W_HEAD >= KVT_PAGE_BYTES, "the write area follows the page");

#endif
