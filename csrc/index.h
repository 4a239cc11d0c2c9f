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
/* 80: max_leases, 88: max_reservations (daemon-written), 96: reservations the client
 * holds from grants (client-written, a page with a write area), 104: 1 << 63 | the
 * hazard entries [0, n) the session may use (daemon-written; the daemon reads no
 * entry past n; 0 from an older daemon: all of them) */
#define KVT_PAGE_RING 1024     /* the ring of blocks read: hazard values */
#define KVT_PAGE_RING_N 384
#define KVT_PAGE_HAZARDS 4096  /* one u64 per leased block, 0 when unused or expired */
#define KVT_PAGE_SERIALS 10240 /* beside each hazard, its lease's serial (non-zero) */
#define KVT_PAGE_HAZARDS_N 768
#define KVT_HAZARD_BIT (1ull << 63) /* a hazard is BIT | segment << 32 | slot */

/* A page with a write area (csrc/writes.c) is twice as long; the first half is the
 * page above.  Byte offsets in the second half: */
#define KVT_WPAGE_BYTES 32768
#define KVT_W_HEAD 16384      /* u64: commit records the client published */
#define KVT_W_DONE 16392      /* u32 (a futex word): records the daemon finished */
#define KVT_W_WAITERS 16396   /* u32: writers asleep on DONE (the daemon wakes them) */
#define KVT_W_WANT 16400      /* u64: how many grants the client would like to hold */
#define KVT_W_GRANTS 16896    /* one u64 per grant: 0, or VALID | segment << 32 | slot */
#define KVT_W_GRANTS_N 256
#define KVT_GRANT_VALID (1ull << 63)
#define KVT_GRANT_TAKEN (1ull << 62) /* set by the writer filling the slot */
#define KVT_W_RING 18944      /* the commit records */
#define KVT_W_RECORD 96
#define KVT_W_RING_N 128
#define KVT_W_KEY_MAX 64
#define KVT_W_HAS_SUM 1       /* a record's flags */
#define KVT_W_LAST 2          /* the last record of a commit (all or nothing up to it) */

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
PyObject *kvt_py_grants_take(PyObject *m, PyObject *args);
PyObject *kvt_py_grants_untake(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_put(PyObject *m, PyObject *args);
PyObject *kvt_py_done_wait(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_take(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_done(PyObject *m, PyObject *args);
PyObject *kvt_py_commit_results(PyObject *m, PyObject *args);
PyObject *kvt_py_page_cas(PyObject *m, PyObject *args);
PyObject *kvt_py_page_store(PyObject *m, PyObject *args);
PyObject *kvt_py_index_copy(PyObject *m, PyObject *args);
PyObject *kvt_py_index_info(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_flags(PyObject *m, PyObject *args);
PyObject *kvt_py_index_fingerprint(PyObject *m, PyObject *arg);
PyObject *kvt_py_index_fingerprints(PyObject *m, PyObject *args);

#endif
