/* The block table (csrc/blocks.c): its bindings and its own constants.  The persisted
 * slot entry it reads and writes is defined in csrc/layout.h. */
#ifndef KVT_BLOCKS_H
#define KVT_BLOCKS_H

#include <Python.h>

#include "layout.h"

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

/* Registers the BlockTable type and BLOCK_TABLE (its constants) in the module (its exec
 * slot). */
int kvt_blocks_init(PyObject *module);

#endif
