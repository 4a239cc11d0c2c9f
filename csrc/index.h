/* The shared index's bindings (csrc/index.c), listed in native.c's method table. */
#ifndef KVT_INDEX_H
#define KVT_INDEX_H

#include <Python.h>

#include "layout.h"

/* native.c: njobs jobs of job_size bytes from jobs, job 0 on the calling thread and
 * the others on their own pthreads, all joined before it returns. */
typedef void *(*kvt_worker)(void *);
void kvt_run_jobs(kvt_worker fn, void *jobs, size_t job_size, int njobs);

PyObject *kvt_py_index_format(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_many(PyObject *m, PyObject *args);
PyObject *kvt_py_index_remove(PyObject *m, PyObject *args);
PyObject *kvt_py_index_remove_many(PyObject *m, PyObject *args);
PyObject *kvt_py_keys_check(PyObject *m, PyObject *args);
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
PyObject *kvt_py_readable_spin(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_take(PyObject *m, PyObject *args);
PyObject *kvt_py_commits_done(PyObject *m, PyObject *args);
PyObject *kvt_py_commit_results(PyObject *m, PyObject *args);
PyObject *kvt_py_page_cas(PyObject *m, PyObject *args);
PyObject *kvt_py_page_store(PyObject *m, PyObject *args);
PyObject *kvt_py_grants_store(PyObject *m, PyObject *args);
PyObject *kvt_py_grants_grant(PyObject *m, PyObject *args);
PyObject *kvt_py_index_copy(PyObject *m, PyObject *args);
PyObject *kvt_py_index_info(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_flags(PyObject *m, PyObject *args);
PyObject *kvt_py_index_fingerprint(PyObject *m, PyObject *arg);
PyObject *kvt_py_index_fingerprints(PyObject *m, PyObject *args);
/* Store.check's key cross-check: compact rows, compared without the GIL. */
PyObject *kvt_py_index_rows(PyObject *m, PyObject *args);
PyObject *kvt_py_check_keys(PyObject *m, PyObject *args);
PyObject *kvt_py_fingerprint_rows(PyObject *m, PyObject *arg);
PyObject *kvt_py_index_populate(PyObject *m, PyObject *args);
/* The fingerprint an entry stores for a key of n bytes (1..64): BlockTable.check_rows. */
void kvt_fingerprint(const uint8_t *key, size_t n, uint64_t *fp0, uint64_t *fp1,
                     uint8_t *flags);

/* A commit ring's records as the daemon copied them out of a session's page
 * (kvt_ring_read, csrc/writes.c): keys zero-padded to KVT_W_KEY_MAX, each record's
 * grant entry, the grant word it names, length, checksum and whether it has one. */
typedef struct {
    Py_ssize_t n;
    uint64_t head;
    uint32_t grant[KVT_W_RING_N];
    uint64_t word[KVT_W_RING_N];
    uint64_t length[KVT_W_RING_N];
    uint64_t sum[KVT_W_RING_N];
    uint8_t has_sum[KVT_W_RING_N];
    uint8_t klen[KVT_W_RING_N];
    uint8_t key[KVT_W_RING_N][KVT_W_KEY_MAX];
} kvt_ring;

/* Copy the records published in page (a writable KVT_WPAGE_BYTES buffer) since tail into
 * r.  Returns 1 when the ring is the plain case -- at least one record, and every one
 * would pass commits_take's checks against max_length and held (the session's
 * KVT_W_GRANTS_N grant words) with no grant entry and no key named twice in the whole
 * ring -- else 0 (an empty ring, an impossible head, or anything commits_take would
 * refuse or the store would answer per batch: the caller takes the ring the general
 * way).  Reads only: nothing in the page changes. */
int kvt_ring_read(Py_buffer *page, uint64_t tail, uint64_t max_length, const uint64_t *held,
                  kvt_ring *r);

/* The daemon's answer to the n records of a writable page's ring from tail: each
 * record's result byte (res[i], or fill when res is NULL), then DONE = tail + n, and a
 * futex wake of the writers asleep on it (commits_done). */
void kvt_commits_finish(Py_buffer *page, uint64_t tail, const unsigned char *res,
                        unsigned char fill, Py_ssize_t n);

/* index_find_many's lookup of n keys (keys[i] of klens[i] bytes; NULL: none) in the
 * index buf holds: out[i] is the ref of its live entry, or 0.  0, or -1 with a Python
 * error when buf holds no index. */
int kvt_index_find_rows(Py_buffer *buf, const uint8_t *const *keys, const uint8_t *klens,
                        Py_ssize_t n, uint64_t *out);

/* Take out of the index buf holds the entries of n keys (keys[i] of klens[i] bytes; NULL:
 * none) that name the block at (segments[i], slots[i]); hit[i] says which did.  An entry
 * of the key naming another block stays.  0, or -1 with a Python error when buf holds
 * no index. */
int kvt_index_remove_at(Py_buffer *buf, const uint8_t *const *keys, const uint8_t *klens,
                        const uint32_t *segments, const uint32_t *slots, Py_ssize_t n,
                        uint8_t *hit);

/* The keys of COMMITTED slot entries (tab: one extent's slot table) into the index held
 * by buf, without the GIL's Python steps: BlockTable.commit publishes through it. */
Py_ssize_t kvt_index_put_slots(Py_buffer *buf, const uint8_t *tab, const uint64_t *slots,
                               Py_ssize_t n, uint32_t segment, uint64_t slot_bytes,
                               Py_ssize_t *left, Py_ssize_t *n_left);

#endif
