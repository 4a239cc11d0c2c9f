/* The shared index's bindings (csrc/index.c), listed in native.c's method table. */
#ifndef KVT_INDEX_H
#define KVT_INDEX_H

#include <Python.h>

/* The header's flags word. */
#define KVT_IDX_SUPERSEDED 1u     /* a newer table replaced this one: map that */
#define KVT_IDX_MISS_NOT_FINAL 2u /* a miss here may be a hit below DRAM: ask the daemon */

/* A session's page: written by its client, read (and expired) by the daemon
 * (index.c's leases).  Byte offsets of little-endian u64s. */
#define KVT_PAGE_BYTES 16384
/* 0..55: lookups, lookup hit keys, lookup missed keys, acquires, acquire hit keys,
 * acquire missed keys, bytes leased */
#define KVT_PAGE_HAZARD_HI 64  /* hazards at [0, hi) may be non-zero (the client keeps it) */
#define KVT_PAGE_RING_HEAD 72  /* blocks read so far (the ring's next position) */
#define KVT_PAGE_RING 1024     /* the ring of blocks read: hazard values */
#define KVT_PAGE_RING_N 384
#define KVT_PAGE_HAZARDS 4096  /* one u64 per leased block, 0 when unused or expired */
#define KVT_PAGE_SERIALS 10240 /* beside each hazard, its lease's serial (non-zero) */
#define KVT_PAGE_HAZARDS_N 768
#define KVT_HAZARD_BIT (1ull << 63) /* a hazard is BIT | segment << 32 | slot */

PyObject *kvt_py_index_format(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_many(PyObject *m, PyObject *args);
PyObject *kvt_py_index_remove(PyObject *m, PyObject *args);
PyObject *kvt_py_index_get(PyObject *m, PyObject *args);
PyObject *kvt_py_index_lookup(PyObject *m, PyObject *args);
PyObject *kvt_py_index_locate(PyObject *m, PyObject *args);
PyObject *kvt_py_index_acquire(PyObject *m, PyObject *args);
PyObject *kvt_py_hazards_clear(PyObject *m, PyObject *args);
PyObject *kvt_py_hazards_collect(PyObject *m, PyObject *arg);
PyObject *kvt_py_hazards_list(PyObject *m, PyObject *arg);
PyObject *kvt_py_hazards_expire(PyObject *m, PyObject *args);
PyObject *kvt_py_index_copy(PyObject *m, PyObject *args);
PyObject *kvt_py_index_info(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_flags(PyObject *m, PyObject *args);
PyObject *kvt_py_index_fingerprint(PyObject *m, PyObject *arg);
PyObject *kvt_py_index_fingerprints(PyObject *m, PyObject *args);

#endif
