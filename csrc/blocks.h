/* The block table (csrc/blocks.c) and the one definition of the persisted slot
 * entry that it, the daemon and recovery read and write.
 *
 * A segment's slot table (daemon/kvtierd/segments.py, format 2) is n_slots
 * entries of KVT_SLOT_BYTES at KVT_SLOT_TABLE_OFFSET of the extent's .meta
 * file.  Every multi-byte field is little-endian.  The offsets below are
 * exported as kvtier._native.SLOT_LAYOUT, and tests/unit/test_block_table.py
 * fails when segments.SLOT_DTYPE disagrees with them.
 */
#ifndef KVT_BLOCKS_H
#define KVT_BLOCKS_H

#include <Python.h>

#define KVT_SLOT_TABLE_OFFSET 4096 /* the header page comes first */
#define KVT_SLOT_BYTES 128

#define KVT_SLOT_STATE 0        /* u8: KVT_ST_* (written last at commit, first at free) */
#define KVT_SLOT_KEY_LEN 1      /* u8: 1..KVT_SLOT_MAX_KEY when committed */
#define KVT_SLOT_FLAGS 2        /* u8: KVT_SLOT_HAS_CHECKSUM */
#define KVT_SLOT_LENGTH 8       /* u64: committed bytes, 1..block_bytes */
#define KVT_SLOT_CHECKSUM 16    /* u64: the writer's XXH3-64, 0 without the flag */
#define KVT_SLOT_GENERATION 24  /* u64: bumped at every reserve, < KVT_MAX_GENERATION */
#define KVT_SLOT_EPOCH 32       /* u64: boot epoch of the daemon that committed it */
#define KVT_SLOT_KEY 40         /* KVT_SLOT_MAX_KEY bytes, zero-padded */
#define KVT_SLOT_ENTRY_SUM 104  /* u64: XXH3-64 of bytes [1, 104), seeded (below) */
#define KVT_SLOT_LAST_ACCESS 112 /* u64: access sequence, an LRU hint (not summed) */
#define KVT_SLOT_MAX_KEY 64
/* The entry checksum covers [KVT_SLOT_SUM_FROM, KVT_SLOT_SUM_TO): everything but the
 * state byte and the last access; seed = created_unix_ns ^ slot * KVT_SLOT_SEED_MUL. */
#define KVT_SLOT_SUM_FROM 1
#define KVT_SLOT_SUM_TO KVT_SLOT_ENTRY_SUM
#define KVT_SLOT_SEED_MUL 0x9E3779B97F4A7C15ULL
#define KVT_SLOT_HAS_CHECKSUM 1

/* The persisted state byte (segments.SlotState). */
#define KVT_ST_FREE 0
#define KVT_ST_RESERVED 1
#define KVT_ST_COMMITTED 2
#define KVT_ST_DOOMED 3 /* deleted while leased: freed at the last release */

/* Bounds adoption enforces (segments.MAX_GENERATION, MAX_ACCESS_SEQ). */
#define KVT_MAX_GENERATION (1ULL << 48)
#define KVT_MAX_ACCESS_SEQ (1ULL << 48)

/* What the tiers below DRAM hold of a block (store.Lower). */
#define KVT_LOWER_DIRTY 0
#define KVT_LOWER_CLEAN 1
#define KVT_LOWER_UNSPILLABLE 2

/* Eviction policies of BlockTable.victims. */
#define KVT_POLICY_LRU 0   /* sampled LRU on the persisted last access */
#define KVT_POLICY_CLOCK 1 /* CLOCK: a reference bit per slot, a hand per table */

/* slot_usage(table): a previous run's slot table's COMMITTED last accesses (recovery). */
PyObject *kvt_py_slot_usage(PyObject *module, PyObject *arg);
extern const char kvt_slot_usage_doc[];

/* Registers the BlockTable type and SLOT_LAYOUT in the module (its exec slot). */
int kvt_blocks_init(PyObject *module);

#endif
