/*
 * Writes without a call: the write area of a session's page (its layout: csrc/layout.h).
 *
 * The daemon keeps a few free slots of the session's namespace reserved for it
 * ahead of time, "grants", and names them in the page (one u64 each:
 * KVT_GRANT_VALID | segment << 32 | slot).  A writer takes grants by setting
 * KVT_GRANT_TAKEN with a compare-and-swap (so the daemon, which takes back idle
 * grants the same way, never takes one a writer is filling), copies its blocks
 * into the slots, and publishes one commit record per block in the page's ring
 * (the grant, the key, the length, the checksum), then the ring's head, then
 * rings the daemon's doorbell (a pipe).  The daemon copies each record out before it
 * looks at it (the client can change the ring at any time), checks it against
 * its own list of the session's grants, commits the blocks through the store,
 * writes each record's result byte, and publishes how far it got in the u32
 * DONE word, waking the futex waiters on it (only when a writer announced in
 * WAITERS that it sleeps: one still spinning costs the daemon no system call).
 * The writer waits on that word.
 *
 *   grants_take(page, n)           [(index, word)] of n grants now taken, or None
 *   grants_take_columns(page, n, slot_bytes)
 *                                  the same as columns: (entries, words, segment ids, offsets)
 *   grants_untake(page, taken)     give back grants taken and not committed
 *   commits_put(page, head, recs)  write records [(grant, word, key, length, checksum|None)]
 *                                  at head; the last one ends the batch; returns new head
 *   commits_put_columns(page, head, entries, words, keys, lengths, sums|None)
 *                                  the same from columns (no tuple per record)
 *   done_wait(page, target, secs)  wait until DONE reaches target (GIL released)
 *   readable_spin(fd, secs)        look for input on fd for up to secs, yielding the CPU
 *                                  between looks (GIL released): a fast call's answer
 *   commits_take(page, tail, max_length, held)
 *                                  the daemon: (head, batches, keys, columns, flags) of
 *                                  the records from tail, each batch [(start, end,
 *                                  refusal)] checked against held (the session's grant
 *                                  words), or (head, None, None, None, None)
 *   commits_done(page, tail, res)  the daemon: result bytes from tail, DONE = tail+len(res)
 *   page_cas(page, offset, old, new)  compare-and-swap of a u64 (grants)
 *   page_store(page, offset, value)   an atomic store of a u64 (grants)
 *   grants_store(page, entries, words) atomic stores of grant entries' words
 *   grants_grant(page, held, gens, refs, ref_gens)
 *                                  the daemon: grant refs (at ref_gens) in the first free
 *                                  entries of held (0: free) and the page, all or none
 *
 * Nothing a client writes here reaches further than its own grants: the daemon
 * commits only slots it granted to this session, bounds every count it reads,
 * and a record with anything out of range refuses its whole batch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include "index.h"

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* How long a writer spins for the daemon's answer before it sleeps on the futex. */
#define SPIN_NS 400000LL

#define W_U64(p, off) ((uint64_t *)((char *)(p)->buf + (off)))
#define W_U32(p, off) ((uint32_t *)((char *)(p)->buf + (off)))
#define RECORD(p, i) ((unsigned char *)(p)->buf + KVT_W_RING + (size_t)(i) * KVT_W_RECORD)

/* Record layout: csrc/layout.h's KVT_R_* offsets. */
_Static_assert(KVT_R_KEY + KVT_W_KEY_MAX <= KVT_R_WORD && KVT_R_WORD + 8 <= KVT_W_RECORD,
               "a record holds its key and the grant word");

static int
get_wpage(PyObject *obj, Py_buffer *page)
{
    if (PyObject_GetBuffer(obj, page, PyBUF_WRITABLE) < 0)
        return -1;
    if (page->len < KVT_WPAGE_BYTES || ((uintptr_t)page->buf & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "page must be a writable, 8-byte aligned buffer of "
                                          "KVT_WPAGE_BYTES");
        PyBuffer_Release(page);
        return -1;
    }
    return 0;
}

static void
untake(Py_buffer *page, const Py_ssize_t *idx, const uint64_t *words, Py_ssize_t n)
{
    uint64_t *g = W_U64(page, KVT_W_GRANTS);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t want = words[i] | KVT_GRANT_TAKEN;
        __atomic_compare_exchange_n(&g[idx[i]], &want, words[i], 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE);
    }
}

/* Take n grants (CAS VALID -> VALID | TAKEN, first fit): their entries and the words
 * taken into idx and words (KVT_W_GRANTS_N room each); 1, or 0 with none taken (the page
 * has fewer than n). */
static int
take(Py_buffer *page, Py_ssize_t n, Py_ssize_t *idx, uint64_t *words)
{
    Py_ssize_t got = 0;
    uint64_t *g = W_U64(page, KVT_W_GRANTS);
    for (Py_ssize_t i = 0; i < KVT_W_GRANTS_N && got < n; i++) {
        uint64_t v = __atomic_load_n(&g[i], __ATOMIC_ACQUIRE);
        if (!(v & KVT_GRANT_VALID) || (v & KVT_GRANT_TAKEN))
            continue;
        if (__atomic_compare_exchange_n(&g[i], &v, v | KVT_GRANT_TAKEN, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            idx[got] = i;
            words[got++] = v;
        }
    }
    if (got < n) {
        untake(page, idx, words, got);
        return 0;
    }
    return 1;
}

PyObject *
kvt_py_grants_take(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On:grants_take", &page_obj, &n))
        return NULL;
    Py_buffer page;
    if (get_wpage(page_obj, &page) < 0)
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t idx[KVT_W_GRANTS_N];
    uint64_t words[KVT_W_GRANTS_N];
    if (n < 1 || n > KVT_W_GRANTS_N || !take(&page, n, idx, words)) {
        ret = Py_NewRef(Py_None);
        goto done;
    }
    if ((ret = PyList_New(n)) == NULL) {
        untake(&page, idx, words, n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = Py_BuildValue("(nK)", idx[i], (unsigned long long)words[i]);
        if (t == NULL) {
            untake(&page, idx, words, n);
            Py_CLEAR(ret);
            goto done;
        }
        PyList_SET_ITEM(ret, i, t);
    }
done:
    PyBuffer_Release(&page);
    return ret;
}

/* A list of n Python ints from the u64s at v (stride u64s apart), or NULL. */
static PyObject *
u64_list(const uint64_t *v, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(v[i]);
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, o);
    }
    return out;
}

/* grants_take_columns(page, n, slot_bytes): grants_take as columns, for a writer's hot
 * path (no tuple per grant): (entries, words, segment ids, offsets), four lists of n
 * ints, the last two decoded from the words (segment: bits 32..61, slot: bits 0..31;
 * offset: slot * slot_bytes, saturated at 2**64 - 1: the words are the daemon's, and an
 * offset past the mapping is refused by the view made of it), or None (none taken). */
PyObject *
kvt_py_grants_take_columns(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    Py_ssize_t n;
    unsigned long long slot_bytes;
    if (!PyArg_ParseTuple(args, "OnK:grants_take_columns", &page_obj, &n, &slot_bytes))
        return NULL;
    Py_buffer page;
    if (get_wpage(page_obj, &page) < 0)
        return NULL;
    PyObject *ret = NULL, *cols[4] = {NULL, NULL, NULL, NULL};
    Py_ssize_t idx[KVT_W_GRANTS_N];
    uint64_t words[KVT_W_GRANTS_N], col[KVT_W_GRANTS_N];
    if (n < 1 || n > KVT_W_GRANTS_N || !take(&page, n, idx, words)) {
        ret = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        col[i] = (uint64_t)idx[i];
    if ((cols[0] = u64_list(col, n)) == NULL || (cols[1] = u64_list(words, n)) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        col[i] = KVT_REF_SEGMENT(words[i]) & KVT_GRANT_SEGMENT_MASK;
    if ((cols[2] = u64_list(col, n)) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t off;
        if (__builtin_mul_overflow(KVT_REF_SLOT(words[i]), (uint64_t)slot_bytes, &off))
            off = UINT64_MAX;
        col[i] = off;
    }
    if ((cols[3] = u64_list(col, n)) == NULL)
        goto fail;
    ret = PyTuple_Pack(4, cols[0], cols[1], cols[2], cols[3]);
    if (ret != NULL)
        goto done;
fail:
    untake(&page, idx, words, n);
done:
    for (int c = 0; c < 4; c++)
        Py_XDECREF(cols[c]);
    PyBuffer_Release(&page);
    return ret;
}

PyObject *
kvt_py_grants_untake(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj, *taken;
    if (!PyArg_ParseTuple(args, "OO:grants_untake", &page_obj, &taken))
        return NULL;
    Py_buffer page;
    if (get_wpage(page_obj, &page) < 0)
        return NULL;
    PyObject *ret = NULL, *seq = PySequence_Fast(taken, "taken must be a sequence");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at;
        unsigned long long word;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nK", &at, &word))
            goto done;
        if (at < 0 || at >= KVT_W_GRANTS_N) {
            PyErr_SetString(PyExc_ValueError, "no such grant in a page");
            goto done;
        }
        uint64_t w = (uint64_t)word;
        untake(&page, &at, &w, 1);
    }
    ret = Py_NewRef(Py_None);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&page);
    return ret;
}

/* Record i of a batch of n at ring position pos: the grant's entry and word, the key
 * (1..KVT_W_KEY_MAX bytes), its length (< 2**32), its checksum (has_sum).  0, or -1 with
 * ValueError set (nothing written). */
static int
record_put(Py_buffer *page, unsigned long long pos, Py_ssize_t i, Py_ssize_t n, uint32_t grant,
           uint64_t word, const Py_buffer *key, unsigned long long length, uint64_t sum,
           int has_sum)
{
    if (key->len < 1 || key->len > KVT_W_KEY_MAX || length > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a record's key is 1..64 bytes, its length < 2**32");
        return -1;
    }
    unsigned char *r = RECORD(page, pos % KVT_W_RING_N);
    uint32_t l32 = (uint32_t)length;
    memcpy(r + KVT_R_GRANT, &grant, 4);
    memcpy(r + KVT_R_WORD, &word, 8);
    memcpy(r + KVT_R_LENGTH, &l32, 4);
    memcpy(r + KVT_R_CHECKSUM, &sum, 8);
    r[KVT_R_KEYLEN] = (unsigned char)key->len;
    r[KVT_R_FLAGS] = (unsigned char)((has_sum ? KVT_W_HAS_SUM : 0) | (i == n - 1 ? KVT_W_LAST : 0));
    r[KVT_R_RESULT] = 0;
    memcpy(r + KVT_R_KEY, key->buf, (size_t)key->len);
    return 0;
}

/* A checksum argument: None (has 0), or an int < 2**64.  0, or -1 with an error set. */
static int
get_sum(PyObject *obj, uint64_t *sum, int *has)
{
    *sum = 0;
    *has = obj != Py_None;
    if (!*has)
        return 0;
    unsigned long long s = PyLong_AsUnsignedLongLong(obj);
    if (s == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *sum = s;
    return 0;
}

/* The records before the head that publishes them: the new head. */
static PyObject *
publish(Py_buffer *page, unsigned long long head, Py_ssize_t n)
{
    __atomic_store_n(W_U64(page, KVT_W_HEAD), head + (unsigned long long)n, __ATOMIC_RELEASE);
    return PyLong_FromUnsignedLongLong(head + (unsigned long long)n);
}

PyObject *
kvt_py_commits_put(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj, *recs;
    unsigned long long head;
    if (!PyArg_ParseTuple(args, "OKO:commits_put", &page_obj, &head, &recs))
        return NULL;
    Py_buffer page;
    if (get_wpage(page_obj, &page) < 0)
        return NULL;
    PyObject *ret = NULL, *seq = PySequence_Fast(recs, "records must be a sequence");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > KVT_W_RING_N) {
        PyErr_SetString(PyExc_ValueError, "a batch is 1..KVT_W_RING_N records");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned int grant;
        unsigned long long word;
        Py_buffer key;
        unsigned long long length;
        PyObject *sum_obj;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "IKy*KO", &grant, &word, &key,
                              &length, &sum_obj))
            goto done;
        uint64_t sum;
        int has, bad = get_sum(sum_obj, &sum, &has) < 0
                       || record_put(&page, head + (unsigned long long)i, i, n, grant, word, &key,
                                     length, sum, has) < 0;
        PyBuffer_Release(&key);
        if (bad)
            goto done;
    }
    ret = publish(&page, head, n);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&page);
    return ret;
}

/* commits_put_columns(page, head, entries, words, keys, lengths, sums): commits_put of
 * the records (entries[i], words[i], keys[i], lengths[i], sums[i]) without a tuple per
 * record: sequences of one length (sums: None for no checksums at all, or a sequence of
 * ints and Nones). */
PyObject *
kvt_py_commits_put_columns(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj, *cols[5];
    unsigned long long head;
    if (!PyArg_ParseTuple(args, "OKOOOOO:commits_put_columns", &page_obj, &head, &cols[0],
                          &cols[1], &cols[2], &cols[3], &cols[4]))
        return NULL;
    Py_buffer page;
    if (get_wpage(page_obj, &page) < 0)
        return NULL;
    static const char *const names[5] = {"entries", "words", "keys", "lengths", "sums"};
    PyObject *ret = NULL, *seq[5] = {NULL, NULL, NULL, NULL, NULL};
    int ncols = cols[4] == Py_None ? 4 : 5;
    Py_ssize_t n = -1;
    for (int c = 0; c < ncols; c++) {
        if ((seq[c] = PySequence_Fast(cols[c], "a column must be a sequence")) == NULL)
            goto done;
        Py_ssize_t len = PySequence_Fast_GET_SIZE(seq[c]);
        if (n >= 0 && len != n) {
            PyErr_Format(PyExc_ValueError, "%s and %s differ in length (%zd != %zd)", names[0],
                         names[c], n, len);
            goto done;
        }
        n = len;
    }
    if (n < 1 || n > KVT_W_RING_N) {
        PyErr_SetString(PyExc_ValueError, "a batch is 1..KVT_W_RING_N records");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long grant = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq[0], i));
        if (grant == (unsigned long)-1 && PyErr_Occurred())
            goto done;
        if (grant > UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "a grant entry is < 2**32");
            goto done;
        }
        unsigned long long word = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq[1], i));
        if (word == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        unsigned long long length = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq[3], i));
        if (length == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        uint64_t sum = 0;
        int has = 0;
        if (ncols == 5 && get_sum(PySequence_Fast_GET_ITEM(seq[4], i), &sum, &has) < 0)
            goto done;
        Py_buffer key;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq[2], i), &key, PyBUF_SIMPLE) < 0)
            goto done;
        int bad = record_put(&page, head + (unsigned long long)i, i, n, (uint32_t)grant, word,
                             &key, length, sum, has) < 0;
        PyBuffer_Release(&key);
        if (bad)
            goto done;
    }
    ret = publish(&page, head, n);
done:
    for (int c = 0; c < 5; c++)
        Py_XDECREF(seq[c]);
    PyBuffer_Release(&page);
    return ret;
}

/* DONE reached target (wrapping u32 arithmetic). */
static int
reached(const uint32_t *word, uint32_t target)
{
    return (int32_t)(__atomic_load_n(word, __ATOMIC_ACQUIRE) - target) >= 0;
}

PyObject *
kvt_py_done_wait(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    unsigned long long target;
    double secs;
    if (!PyArg_ParseTuple(args, "OKd:done_wait", &page_obj, &target, &secs))
        return NULL;
    Py_buffer page;
    if (get_wpage(page_obj, &page) < 0)
        return NULL;
    uint32_t *word = W_U32(&page, KVT_W_DONE);
    uint32_t *waiters = W_U32(&page, KVT_W_WAITERS);
    uint32_t t32 = (uint32_t)target;
    int ok = reached(word, t32);
    if (!ok) {
        struct timespec end, now;
        clock_gettime(CLOCK_MONOTONIC, &end);
        now = end;
        end.tv_sec += (time_t)secs;
        end.tv_nsec += (long)((secs - (double)(time_t)secs) * 1e9);
        if (end.tv_nsec >= 1000000000L) {
            end.tv_sec++;
            end.tv_nsec -= 1000000000L;
        }
        Py_BEGIN_ALLOW_THREADS
        /* Spin first, yielding now and then (the daemon may be waiting for this CPU):
         * the daemon answers within a few hundred microseconds, and a writer that
         * sleeps is woken a hundred microseconds late on a virtual machine whose idle
         * vCPU halted. */
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long spin_end = (long long)now.tv_sec * 1000000000LL + now.tv_nsec + SPIN_NS;
        while (!(ok = reached(word, t32))) {
            for (int i = 0; i < 64; i++)
                CPU_RELAX();
            clock_gettime(CLOCK_MONOTONIC, &now);
            if ((long long)now.tv_sec * 1000000000LL + now.tv_nsec >= spin_end)
                break;
            sched_yield();
        }
        while (!ok) {
            uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if ((ok = (int32_t)(seen - t32) >= 0))
                break;
            clock_gettime(CLOCK_MONOTONIC, &now);
            long long left = (long long)(end.tv_sec - now.tv_sec) * 1000000000LL
                             + (end.tv_nsec - now.tv_nsec);
            if (left <= 0)
                break;
            struct timespec rel = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
            /* Say so before sleeping (the daemon wakes only announced sleepers), then
             * look again: a DONE stored before the announcement is seen here. */
            __atomic_add_fetch(waiters, 1, __ATOMIC_SEQ_CST);
            if ((ok = reached(word, t32))) {
                __atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
                break;
            }
            /* Not FUTEX_PRIVATE: the word is in memory two processes map. */
            long r = syscall(SYS_futex, word, FUTEX_WAIT, seen, &rel, NULL, 0);
            int err = errno;
            __atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
            if (r < 0 && err != EAGAIN && err != EINTR && err != ETIMEDOUT)
                break;
            ok = reached(word, t32);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&page);
    return PyBool_FromLong(ok);
}

/* A caller of a fast call looks for its answer this way before it sleeps in recv: the
 * daemon answers within a few hundred microseconds, a thread asleep in recv is woken
 * late (an idle vCPU halts), and waking it costs the daemon's send.  Spinning with a
 * sched_yield between looks leaves the CPU to the daemon when they share one. */
PyObject *
kvt_py_readable_spin(PyObject *Py_UNUSED(m), PyObject *args)
{
    int fd;
    double secs;
    if (!PyArg_ParseTuple(args, "id:readable_spin", &fd, &secs))
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd must be a file descriptor");
        return NULL;
    }
    long long spin = secs > 0 ? (long long)(secs * 1e9) : 0;
    int ready = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long end = (long long)now.tv_sec * 1000000000LL + now.tv_nsec + spin;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, 0);
        if (r > 0) {
            ready = 1; /* input, or end of file or an error: recv says which */
            break;
        }
        if (r < 0 && errno != EINTR) {
            err = errno;
            break;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((long long)now.tv_sec * 1000000000LL + now.tv_nsec >= end)
            break;
        sched_yield();
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(ready);
}

/* The columns commits_take answers, each n u64 (kvtierd.shared_index.PageRecords). */
enum { COL_GRANT, COL_WORD, COL_REF, COL_LENGTH, COL_SUM, COL_HAS_SUM, COL_N };

/* Why the batch lo..hi (its columns and keys) cannot commit, or 0: a key or length
 * out of range or a grant entry or key named twice is INVALID (the batch is
 * malformed); a record that names no grant the session holds is LOST, however it got
 * there: an entry past the grant table, a word of 0, or a word that is not the one
 * its entry holds (held: the session's words, NULL: none) -- committed, taken back,
 * expired, another session's or namespace's slot.  INVALID is answered before LOST.
 * (FastPath.commit_granted checks again, per batch, the grants that the batches
 * before it in the same ring ended.) */
static uint8_t
refuse_batch(const uint64_t *cols, Py_ssize_t n, const uint64_t *words, PyObject *keys,
             Py_ssize_t lo, Py_ssize_t hi, uint64_t max_length, const uint64_t *held)
{
    const uint64_t *grant = cols + COL_GRANT * n, *length = cols + COL_LENGTH * n;
    uint64_t seen[KVT_W_GRANTS_N / 64] = {0};
    for (Py_ssize_t i = lo; i <= hi; i++) {
        Py_ssize_t klen = PyBytes_GET_SIZE(PyList_GET_ITEM(keys, i));
        if (klen == 0 || length[i] == 0 || length[i] > max_length)
            return KVT_W_INVALID;
        if (grant[i] < KVT_W_GRANTS_N) { /* past the table: no grant (LOST below) */
            if (seen[grant[i] / 64] >> (grant[i] % 64) & 1)
                return KVT_W_INVALID;
            seen[grant[i] / 64] |= 1ull << (grant[i] % 64);
        }
        const char *k = PyBytes_AS_STRING(PyList_GET_ITEM(keys, i));
        for (Py_ssize_t j = lo; j < i; j++) { /* a batch is at most KVT_W_RING_N records */
            PyObject *other = PyList_GET_ITEM(keys, j);
            if (PyBytes_GET_SIZE(other) == klen && memcmp(PyBytes_AS_STRING(other), k, klen) == 0)
                return KVT_W_INVALID;
        }
    }
    for (Py_ssize_t i = lo; i <= hi; i++)
        if (held == NULL || grant[i] >= KVT_W_GRANTS_N || words[i] == 0 ||
            held[grant[i]] != words[i])
            return KVT_W_LOST;
    return 0;
}

PyObject *
kvt_py_commits_take(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj, *held_obj = Py_None;
    unsigned long long tail, max_length;
    if (!PyArg_ParseTuple(args, "OKK|O:commits_take", &page_obj, &tail, &max_length, &held_obj))
        return NULL;
    Py_buffer page, held = {0};
    if (get_wpage(page_obj, &page) < 0)
        return NULL;
    if (held_obj != Py_None) {
        if (PyObject_GetBuffer(held_obj, &held, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&page);
            return NULL;
        }
        if (held.len != KVT_W_GRANTS_N * 8 || ((uintptr_t)held.buf & 7) != 0) {
            PyErr_SetString(PyExc_ValueError, "held must be the 8-byte aligned u64 words of "
                                              "every grant entry");
            PyBuffer_Release(&held);
            PyBuffer_Release(&page);
            return NULL;
        }
    }
    PyObject *ret = NULL, *keys = NULL, *cols_obj = NULL, *batches = NULL, *flags_obj = NULL;
    uint64_t head = __atomic_load_n(W_U64(&page, KVT_W_HEAD), __ATOMIC_ACQUIRE);
    if (head < tail || head - tail > KVT_W_RING_N) {
        ret = Py_BuildValue("(KOOOO)", (unsigned long long)head, Py_None, Py_None, Py_None,
                            Py_None);
        goto done;
    }
    Py_ssize_t n = (Py_ssize_t)(head - tail);
    uint64_t words[KVT_W_RING_N];
    if ((keys = PyList_New(n)) == NULL || (batches = PyList_New(0)) == NULL ||
        (cols_obj = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)COL_N * n * 8)) == NULL ||
        (flags_obj = PyBytes_FromStringAndSize(NULL, n)) == NULL)
        goto done;
    uint64_t *cols = (uint64_t *)PyBytes_AS_STRING(cols_obj);
    unsigned char *flags = (unsigned char *)PyBytes_AS_STRING(flags_obj);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* One copy of the record, then only the copy is read. */
        unsigned char r[KVT_W_RECORD];
        memcpy(r, RECORD(&page, (tail + (uint64_t)i) % KVT_W_RING_N), KVT_W_RECORD);
        uint32_t grant, length;
        uint64_t sum;
        memcpy(&grant, r + KVT_R_GRANT, 4);
        memcpy(&words[i], r + KVT_R_WORD, 8);
        memcpy(&length, r + KVT_R_LENGTH, 4);
        memcpy(&sum, r + KVT_R_CHECKSUM, 8);
        flags[i] = r[KVT_R_FLAGS];
        cols[COL_GRANT * n + i] = grant;
        cols[COL_WORD * n + i] = words[i];
        cols[COL_REF * n + i] = words[i] & ~(KVT_GRANT_VALID | KVT_GRANT_TAKEN);
        cols[COL_LENGTH * n + i] = length;
        cols[COL_SUM * n + i] = sum;
        cols[COL_HAS_SUM * n + i] = (r[KVT_R_FLAGS] & KVT_W_HAS_SUM) != 0;
        unsigned klen = r[KVT_R_KEYLEN];
        if (klen > KVT_W_KEY_MAX)
            klen = 0; /* refused below: keys are 1..64 bytes */
        PyObject *k = PyBytes_FromStringAndSize((const char *)r + KVT_R_KEY, (Py_ssize_t)klen);
        if (k == NULL)
            goto done;
        PyList_SET_ITEM(keys, i, k);
    }
    /* Batches end with a LAST record (or the last one taken): all or nothing each. */
    for (Py_ssize_t lo = 0, i = 0; i < n; i++) {
        if ((flags[i] & KVT_W_LAST) || i == n - 1) {
            uint8_t why = refuse_batch(cols, n, words, keys, lo, i, max_length,
                                       held.buf != NULL ? (const uint64_t *)held.buf : NULL);
            PyObject *b = Py_BuildValue("(nnB)", lo, i + 1, why);
            if (b == NULL || PyList_Append(batches, b) < 0) {
                Py_XDECREF(b);
                goto done;
            }
            Py_DECREF(b);
            lo = i + 1;
        }
    }
    ret = Py_BuildValue("(KOOOO)", (unsigned long long)head, batches, keys, cols_obj, flags_obj);
done:
    Py_XDECREF(cols_obj);
    Py_XDECREF(flags_obj);
    Py_XDECREF(keys);
    Py_XDECREF(batches);
    if (held.buf != NULL)
        PyBuffer_Release(&held);
    PyBuffer_Release(&page);
    return ret;
}

/* FNV-1a of a key: the plain ring's check for a key named twice (kvt_ring_read). */
static inline uint32_t
key_hash(const uint8_t *k, unsigned n)
{
    uint32_t h = 2166136261u;
    for (unsigned i = 0; i < n; i++)
        h = (h ^ k[i]) * 16777619u;
    return h;
}

int
kvt_ring_read(Py_buffer *page, uint64_t tail, uint64_t max_length, const uint64_t *held,
              kvt_ring *r)
{
    uint64_t head = __atomic_load_n(W_U64(page, KVT_W_HEAD), __ATOMIC_ACQUIRE);
    r->n = 0;
    r->head = head;
    if (head <= tail || head - tail > KVT_W_RING_N || held == NULL)
        return 0;
    Py_ssize_t n = (Py_ssize_t)(head - tail);
    uint64_t seen[KVT_W_GRANTS_N / 64] = {0};
    /* Open addressing over 2 * KVT_W_RING_N buckets: record index + 1, 0 empty. */
    uint8_t buckets[2 * KVT_W_RING_N];
    memset(buckets, 0, sizeof buckets);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* One copy of the record, then only the copy is read. */
        unsigned char rec[KVT_W_RECORD];
        memcpy(rec, RECORD(page, (tail + (uint64_t)i) % KVT_W_RING_N), KVT_W_RECORD);
        uint32_t grant, length;
        memcpy(&grant, rec + KVT_R_GRANT, 4);
        memcpy(&r->word[i], rec + KVT_R_WORD, 8);
        memcpy(&length, rec + KVT_R_LENGTH, 4);
        memcpy(&r->sum[i], rec + KVT_R_CHECKSUM, 8);
        unsigned klen = rec[KVT_R_KEYLEN];
        r->grant[i] = grant;
        r->length[i] = length;
        r->has_sum[i] = (rec[KVT_R_FLAGS] & KVT_W_HAS_SUM) != 0;
        if (klen == 0 || klen > KVT_W_KEY_MAX || length == 0 || length > max_length
            || grant >= KVT_W_GRANTS_N || r->word[i] == 0 || held[grant] != r->word[i]
            || (seen[grant / 64] >> (grant % 64) & 1))
            return 0;
        seen[grant / 64] |= 1ull << (grant % 64);
        r->klen[i] = (uint8_t)klen;
        memset(r->key[i], 0, KVT_W_KEY_MAX);
        memcpy(r->key[i], rec + KVT_R_KEY, klen);
        for (uint32_t b = key_hash(r->key[i], klen);; b++) {
            uint8_t *at = &buckets[b % (2 * KVT_W_RING_N)];
            if (*at == 0) {
                *at = (uint8_t)(i + 1);
                break;
            }
            if (r->klen[*at - 1] == klen && memcmp(r->key[*at - 1], r->key[i], klen) == 0)
                return 0;
        }
    }
    r->n = n;
    return 1;
}

void
kvt_commits_finish(Py_buffer *page, uint64_t tail, const unsigned char *res, unsigned char fill,
                   Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        __atomic_store_n(RECORD(page, (tail + (uint64_t)i) % KVT_W_RING_N) + KVT_R_RESULT,
                         res != NULL ? res[i] : fill, __ATOMIC_RELAXED);
    uint32_t *word = W_U32(page, KVT_W_DONE);
    __atomic_store_n(word, (uint32_t)(tail + (uint64_t)n), __ATOMIC_SEQ_CST);
    /* A writer still spinning needs no system call (nor the wake-up's preemption);
     * one that announced its sleep after the store above sees DONE and does not sleep. */
    if (__atomic_load_n(W_U32(page, KVT_W_WAITERS), __ATOMIC_SEQ_CST) != 0)
        syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

PyObject *
kvt_py_commits_done(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    unsigned long long tail;
    Py_buffer results;
    if (!PyArg_ParseTuple(args, "OKy*:commits_done", &page_obj, &tail, &results))
        return NULL;
    Py_buffer page;
    if (get_wpage(page_obj, &page) < 0) {
        PyBuffer_Release(&results);
        return NULL;
    }
    PyObject *ret = NULL;
    if (results.len > KVT_W_RING_N) {
        PyErr_SetString(PyExc_ValueError, "more results than the ring holds");
        goto done;
    }
    kvt_commits_finish(&page, tail, results.buf, 0, results.len);
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&results);
    PyBuffer_Release(&page);
    return ret;
}

PyObject *
kvt_py_commit_results(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    unsigned long long at;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OKn:commit_results", &page_obj, &at, &n))
        return NULL;
    Py_buffer page;
    if (get_wpage(page_obj, &page) < 0)
        return NULL;
    PyObject *ret = NULL;
    if (n < 0 || n > KVT_W_RING_N) {
        PyErr_SetString(PyExc_ValueError, "more results than the ring holds");
        goto done;
    }
    if ((ret = PyBytes_FromStringAndSize(NULL, n)) == NULL)
        goto done;
    char *out = PyBytes_AS_STRING(ret);
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = (char)__atomic_load_n(RECORD(&page, (at + (uint64_t)i) % KVT_W_RING_N) + KVT_R_RESULT,
                                       __ATOMIC_ACQUIRE);
done:
    PyBuffer_Release(&page);
    return ret;
}

/* The aligned u64 at off in a writable buffer (page acquired), or NULL with an error. */
static uint64_t *
page_word(PyObject *obj, Py_ssize_t off, Py_buffer *page)
{
    if (PyObject_GetBuffer(obj, page, PyBUF_WRITABLE) < 0)
        return NULL;
    if (((uintptr_t)page->buf & 7) != 0 || off < 0 || (off & 7) != 0 || off > page->len - 8) {
        PyErr_SetString(PyExc_ValueError, "no such aligned u64 in the page");
        PyBuffer_Release(page);
        return NULL;
    }
    return (uint64_t *)((char *)page->buf + off);
}

PyObject *
kvt_py_page_cas(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    Py_ssize_t off;
    unsigned long long old, new;
    if (!PyArg_ParseTuple(args, "OnKK:page_cas", &page_obj, &off, &old, &new))
        return NULL;
    Py_buffer page;
    uint64_t *w = page_word(page_obj, off, &page);
    if (w == NULL)
        return NULL;
    uint64_t want = old;
    int done = __atomic_compare_exchange_n(w, &want, (uint64_t) new, 0, __ATOMIC_ACQ_REL,
                                           __ATOMIC_ACQUIRE);
    PyBuffer_Release(&page);
    return PyBool_FromLong(done);
}

PyObject *
kvt_py_page_store(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    Py_ssize_t off;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "OnK:page_store", &page_obj, &off, &value))
        return NULL;
    Py_buffer page;
    uint64_t *w = page_word(page_obj, off, &page);
    if (w == NULL)
        return NULL;
    __atomic_store_n(w, (uint64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&page);
    Py_RETURN_NONE;
}

/* A u64 column of a writable buffer: exactly n words when n >= 0, 8-byte aligned.  0, or
 * -1 with ValueError. */
static int
u64_column(Py_buffer *b, Py_ssize_t n, const char *what)
{
    if (b->len % 8 != 0 || ((uintptr_t)b->buf & 7) != 0 || (n >= 0 && b->len != n * 8)) {
        PyErr_Format(PyExc_ValueError, "%s must be an aligned u64 column%s", what,
                     n >= 0 ? " of every grant entry" : "");
        return -1;
    }
    return 0;
}

PyObject *
kvt_py_grants_grant(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    Py_buffer held, gens, refs, ref_gens, page;
    if (!PyArg_ParseTuple(args, "Ow*w*y*y*:grants_grant", &page_obj, &held, &gens, &refs,
                          &ref_gens))
        return NULL;
    PyObject *ret = NULL;
    int have_page = get_wpage(page_obj, &page) == 0;
    if (!have_page || u64_column(&held, KVT_W_GRANTS_N, "held") < 0
        || u64_column(&gens, KVT_W_GRANTS_N, "gens") < 0 || u64_column(&refs, -1, "refs") < 0
        || u64_column(&ref_gens, refs.len / 8, "gens of refs") < 0)
        goto done;
    Py_ssize_t n = refs.len / 8, free = 0;
    uint64_t *hw = held.buf, *hg = gens.buf;
    const uint64_t *r = refs.buf, *rg = ref_gens.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (r[i] & (KVT_GRANT_VALID | KVT_GRANT_TAKEN)) {
            PyErr_Format(PyExc_ValueError, "refs[%zd] is no slot ref", i);
            goto done;
        }
    for (Py_ssize_t e = 0; e < KVT_W_GRANTS_N; e++)
        free += hw[e] == 0;
    if (n > free) {
        PyErr_Format(PyExc_ValueError, "%zd grants, %zd free entries", n, free);
        goto done;
    }
    uint64_t *g = W_U64(&page, KVT_W_GRANTS);
    for (Py_ssize_t i = 0, e = 0; i < n; i++, e++) {
        while (hw[e] != 0)
            e++;
        hw[e] = r[i] | KVT_GRANT_VALID;
        hg[e] = rg[i];
        __atomic_store_n(&g[e], hw[e], __ATOMIC_RELEASE);
    }
    ret = Py_NewRef(Py_None);
done:
    if (have_page)
        PyBuffer_Release(&page);
    PyBuffer_Release(&held);
    PyBuffer_Release(&gens);
    PyBuffer_Release(&refs);
    PyBuffer_Release(&ref_gens);
    return ret;
}

PyObject *
kvt_py_grants_store(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *page_obj;
    Py_buffer entries, words;
    if (!PyArg_ParseTuple(args, "Oy*y*:grants_store", &page_obj, &entries, &words))
        return NULL;
    Py_buffer page;
    PyObject *ret = NULL;
    if (get_wpage(page_obj, &page) < 0) {
        PyBuffer_Release(&entries);
        PyBuffer_Release(&words);
        return NULL;
    }
    Py_ssize_t n = entries.len / 8;
    const uint64_t *e = entries.buf, *w = words.buf;
    if (entries.len % 8 != 0 || words.len != entries.len || ((uintptr_t)e & 7) != 0 ||
        ((uintptr_t)w & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "entries and words must be aligned u64 columns of "
                                          "one length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (e[i] >= KVT_W_GRANTS_N) {
            PyErr_SetString(PyExc_ValueError, "no such grant entry");
            goto done;
        }
    uint64_t *g = W_U64(&page, KVT_W_GRANTS);
    for (Py_ssize_t i = 0; i < n; i++)
        __atomic_store_n(&g[e[i]], w[i], __ATOMIC_RELEASE);
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&entries);
    PyBuffer_Release(&words);
    PyBuffer_Release(&page);
    return ret;
}
