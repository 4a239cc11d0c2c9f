/* The shared index's bindings (csrc/index.c), listed in native.c's method table. */
#ifndef KVT_INDEX_H
#define KVT_INDEX_H

#include <Python.h>

/* The header's flags word. */
#define KVT_IDX_SUPERSEDED 1u     /* a newer table replaced this one: map that */
#define KVT_IDX_MISS_NOT_FINAL 2u /* a miss here may be a hit below DRAM: ask the daemon */

/* A session's page: written by its client, read (and expired) by the daemon
 * (index.c's leases).  Byte offsets of little-endian u64s.  This header is the one
 * definition of the page: Python reads it through _native.page_layout()
 * (client/kvtier/_page.py), never from numbers of its own. */
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

/* native.c: njobs jobs of job_size bytes from jobs, job 0 on the calling thread and
 * the others on their own pthreads, all joined before it returns. */
typedef void *(*kvt_worker)(void *);
void kvt_run_jobs(kvt_worker fn, void *jobs, size_t job_size, int njobs);

PyObject *kvt_py_index_format(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_many(PyObject *m, PyObject *args);
PyObject *kvt_py_index_remove(PyObject *m, PyObject *args);
PyObject *kvt_py_index_remove_many(PyObject *m, PyObject *args);
PyObject *kvt_py_index_get(PyObject *m, PyObject *args);
PyObject *kvt_py_index_lookup(PyObject *m, PyObject *args);
PyObject *kvt_py_index_locate(PyObject *m, PyObject *args);
PyObject *kvt_py_index_find_many(PyObject *m, PyObject *args);
PyObject *kvt_py_index_present_many(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_slots(PyObject *m, PyObject *args);
PyObject *kvt_py_index_acquire(PyObject *m, PyObject *args);
PyObject *kvt_py_hazards_clear(PyObject *m, PyObject *args);
PyObject *kvt_py_hazards_collect(PyObject *m, PyObject *arg);
PyObject *kvt_py_hazards_list(PyObject *m, PyObject *arg);
PyObject *kvt_py_hazards_expire(PyObject *m, PyObject *args);
PyObject *kvt_py_grants_take(PyObject *m, PyObject *args);
PyObject *kvt_py_grants_take_columns(PyObject *m, PyObject *args);
PyObject *kvt_py_grants_untake(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_put(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_put_columns(PyObject *m, PyObject *args);
PyObject *kvt_py_done_wait(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_take(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_done(PyObject *m, PyObject *args);
PyObject *kvt_py_commit_results(PyObject *m, PyObject *args);
PyObject *kvt_py_page_cas(PyObject *m, PyObject *args);
PyObject *kvt_py_page_store(PyObject *m, PyObject *args);
PyObject *kvt_py_grants_store(PyObject *m, PyObject *args);
PyObject *kvt_py_index_copy(PyObject *m, PyObject *args);
PyObject *kvt_py_index_info(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_flags(PyObject *m, PyObject *args);
PyObject *kvt_py_index_fingerprint(PyObject *m, PyObject *arg);
PyObject *kvt_py_index_fingerprints(PyObject *m, PyObject *args);
PyObject *kvt_py_page_layout(PyObject *m, PyObject *args);
/* Store.check's key cross-check (issue 26): compact rows, compared without the GIL. */
PyObject *kvt_py_index_rows(PyObject *m, PyObject *args);
PyObject *kvt_py_check_keys(PyObject *m, PyObject *args);
PyObject *kvt_py_fingerprint_rows(PyObject *m, PyObject *arg);
PyObject *kvt_py_index_populate(PyObject *m, PyObject *args);
/* The fingerprint an entry stores for a key of n bytes (1..64): BlockTable.check_rows. */
void kvt_fingerprint(const uint8_t *key, size_t n, uint64_t *fp0, uint64_t *fp1,
                     uint8_t *flags);

#endif
