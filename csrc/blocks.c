/*
 * kvtier._native.BlockTable: one namespace's DRAM blocks as compact native
 * records, driven by batched calls (no Python object per block).
 *
 * A block's durable fields (state, key, length, checksum, generation, epoch,
 * last access) live in its extent's persisted slot table (csrc/layout.h, the
 * daemon-only .meta mapping); the table writes them there itself, in the order
 * that makes a crash at any instant safe (segments.py: a commit writes every
 * field and the entry checksum first and the state byte last; a free flips the
 * state byte first).  What is volatile is kept here, 12 bytes a slot (kvt_rec):
 * a copy of the state, the pin count, the lower-tier state, the prefetched
 * and CLOCK reference bits, and the free-list link.  Counters per extent and
 * per table are kept in O(1) by account() around every change of a record.
 *
 * Blocks are named by refs: KVT_REF(extent_id, slot) (csrc/layout.h; an extent id is
 * below 2**31, as in the pages' hazard and grant words).  Every batch call
 * takes its refs (and other columns) as C-contiguous buffers of native uint64
 * (numpy arrays, bytes), copies and validates all of them first, and changes
 * nothing when one is invalid (ValueError naming the index and why); then it
 * applies the batch, which cannot fail.  Batches of KVT_BLK_NOGIL_MIN items or
 * more release the GIL while they apply.
 *
 * Concurrency: one mutex per table (a check() from a worker thread while the
 * event loop changes it).  A thread never blocks on the mutex while holding
 * the GIL (it tries, and else releases the GIL to wait), so no lock order
 * between the two can deadlock.
 *
 * Eviction, bounded work per call (and constant memory per block):
 *   sampled LRU (Redis' approximation): each victim is the oldest by the
 *     persisted last access of `sample` random evictable slots, with a pool of
 *     KVT_POOL_N good candidates kept across calls (optional);
 *   CLOCK: a reference bit set at every access (not at commit), a hand per table
 *     that clears set bits and takes the first unset evictable slot.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "blocks.h"
#include "index.h"

/* A session page's grant words (csrc/layout.h). */
#define W_GRANTS(p) ((uint64_t *)((char *)(p)->buf + KVT_W_GRANTS))

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the slot table is little-endian and is read with native loads"
#endif

/* A record's bits. */
#define R_LOWER 0x03      /* KVT_LOWER_* */
#define R_PREFETCHED 0x04 /* promoted by a prefetch, not read since */
#define R_REF 0x08        /* CLOCK's reference bit */
#define R_CHOSEN 0x10     /* picked by the victims() call running now (cleared before it returns) */

/* Largest extent id: refs and the pages' words keep 31 bits for it. */
#define KVT_MAX_EXTENT_ID KVT_REF_SEGMENT_MASK
/* Largest extent: slot numbers are 32 bits, and the free list stores slot + 1. */
#define KVT_MAX_SLOTS 0x7FFFFFFFu
/* Batches below this many items apply with the GIL held: releasing and taking
 * it back costs about as much as a few hundred records. */
#define KVT_BLK_NOGIL_MIN 512
/* The eviction pool of sampled LRU: Redis' EVPOOL_SIZE. */
#define KVT_POOL_N 16
/* Most samples per victim (Redis allows 1..64 for maxmemory-samples). */
#define KVT_MAX_SAMPLE 64
/* A sample is a random slot and the next eligible one after it, at most this
 * many records on: tables are dense in committed blocks when eviction runs, and
 * a sparse one costs a failed sample, not a long walk. */
#define KVT_SAMPLE_SCAN 32
/* Records one victims() call may examine: a base plus a share per victim.  CLOCK
 * in a table of blocks that were all read since the hand last passed needs one
 * revolution to find the first victim; past the bound the call returns short
 * and the next call goes on from where the hand stopped. */
#define KVT_SCAN_BASE 65536
#define KVT_SCAN_PER_VICTIM 256
/* check() reports at most this many problems (and how many more there were). */
#define KVT_CHECK_MAX 64

typedef struct {
    uint32_t next; /* free list: the next free slot + 1 (0: the end) */
    uint32_t pins;
    uint8_t state; /* KVT_ST_*: the daemon's copy of the persisted state byte */
    uint8_t bits;  /* R_* */
    uint16_t spare;
} kvt_rec;

_Static_assert(sizeof(kvt_rec) == 12, "a slot's native record is 12 bytes");

/* Slots in each category (account() keeps them). */
typedef struct {
    int64_t free, reserved, committed, pinned, dirty, doomed, evictable, clean;
} kvt_counts;

typedef struct {
    uint32_t id;
    uint32_t n_slots;
    uint8_t *meta; /* the slot table: n_slots entries of KVT_SLOT_BYTES */
    uint64_t created; /* the segment's created_unix_ns: the entry checksums' seed */
    kvt_rec *rec;
    uint32_t free_head; /* first free slot + 1 (0: none) */
    kvt_counts c;
    /* The largest last access its blocks were given (commit, touch, adopt): how
     * recently the extent was used, never decreasing while it is in the table.
     * Reclaim across namespaces takes the extent whose newest access is oldest. */
    uint64_t newest;
    Py_buffer view; /* held while the extent is in the table: its mapping stays */
} kvt_extent;

typedef struct {
    uint64_t ref;
    uint64_t last; /* its last access when it entered the pool */
} kvt_pooled;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    uint64_t block_bytes, slot_bytes;
    kvt_extent **ext; /* sorted by id */
    Py_ssize_t n_ext, cap_ext;
    kvt_counts c;
    uint64_t rng;
    uint32_t hand_id, hand_slot; /* CLOCK's hand */
    kvt_pooled pool[KVT_POOL_N];
    int pool_n;
    size_t bytes; /* native memory held */
} BlockTable;

typedef struct {
    kvt_extent *e;
    uint32_t slot;
} kvt_loc;

/* ------------------------------------------------------------------------- */
/* Small helpers                                                              */
/* ------------------------------------------------------------------------- */

static inline uint64_t
ld64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline void
st64(uint8_t *p, uint64_t v)
{
    memcpy(p, &v, 8);
}

static inline uint8_t *
entry_of(const kvt_extent *e, uint32_t slot)
{
    return e->meta + (size_t)slot * KVT_SLOT_BYTES;
}

static inline uint64_t
ref_of(const kvt_extent *e, uint32_t slot)
{
    return KVT_REF(e->id, slot);
}

/* The state byte, ordered after (commit) or before (free) the other writes of
 * the entry: the compiler may not move the plain stores across it. */
static inline void
set_state(uint8_t *p, uint8_t state)
{
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(p + KVT_SLOT_STATE, state, __ATOMIC_RELEASE);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

static inline uint64_t
entry_seed(const kvt_extent *e, uint32_t slot)
{
    return e->created ^ ((uint64_t)slot * KVT_SLOT_SEED_MUL);
}

static inline uint64_t
entry_sum(const kvt_extent *e, uint32_t slot, const uint8_t *p)
{
    return XXH3_64bits_withSeed(p + KVT_SLOT_SUM_FROM, KVT_SLOT_SUM_TO - KVT_SLOT_SUM_FROM,
                                entry_seed(e, slot));
}

static inline uint64_t
rnd(BlockTable *t)
{
    /* xorshift64*: the samples need speed, not quality */
    uint64_t x = t->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    t->rng = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static inline int
rec_lower(const kvt_rec *r)
{
    return r->bits & R_LOWER;
}

/* Add (sign 1) or take away (sign -1) what a record counts for. */
static inline void
account(BlockTable *t, kvt_extent *e, const kvt_rec *r, int64_t sign)
{
    int committed = r->state == KVT_ST_COMMITTED || r->state == KVT_ST_DOOMED;
    int evictable = r->state == KVT_ST_COMMITTED && r->pins == 0;
    int dirty = rec_lower(r) == KVT_LOWER_DIRTY;
    kvt_counts *cs[2] = {&e->c, &t->c};

    for (int i = 0; i < 2; i++) {
        kvt_counts *c = cs[i];
        c->free += sign * (r->state == KVT_ST_FREE);
        c->reserved += sign * (r->state == KVT_ST_RESERVED);
        c->committed += sign * committed;
        c->pinned += sign * (r->pins > 0);
        c->dirty += sign * (committed && dirty);
        c->doomed += sign * (r->state == KVT_ST_DOOMED);
        c->evictable += sign * evictable;
        c->clean += sign * (evictable && !dirty);
    }
}

static inline void
fl_push(kvt_extent *e, uint32_t slot)
{
    e->rec[slot].next = e->free_head;
    e->free_head = slot + 1;
}

static inline uint32_t
fl_pop(kvt_extent *e)
{
    uint32_t slot = e->free_head - 1;

    e->free_head = e->rec[slot].next;
    e->rec[slot].next = 0;
    return slot;
}

/* Never block on the table's mutex while holding the GIL (see the top). */
static void
tlock(BlockTable *t)
{
    if (pthread_mutex_trylock(&t->lock) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&t->lock);
        Py_END_ALLOW_THREADS
    }
}

static void
tunlock(BlockTable *t)
{
    pthread_mutex_unlock(&t->lock);
}

/* The extent with this id, or NULL (binary search: tables hold few extents). */
static kvt_extent *
find_ext(const BlockTable *t, uint64_t id, Py_ssize_t *at)
{
    Py_ssize_t lo = 0, hi = t->n_ext;

    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (t->ext[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (at != NULL)
        *at = lo;
    if (lo < t->n_ext && t->ext[lo]->id == id)
        return t->ext[lo];
    return NULL;
}

/* A C-contiguous buffer of uint64 (None allowed when optional): its items copied
 * into a fresh PyMem array (*out, *n).  Returns 0, or -1 with an exception. */
static int
copy_u64s(PyObject *obj, const char *name, uint64_t **out, Py_ssize_t *n)
{
    Py_buffer view;

    *out = NULL;
    *n = 0;
    if (PyObject_GetBuffer(obj, &view, PyBUF_STRIDES) < 0)
        return -1;
    if (!PyBuffer_IsContiguous(&view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s is not C-contiguous", name);
        PyBuffer_Release(&view);
        return -1;
    }
    if (view.len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, not a multiple of 8 (uint64 items)",
                     name, view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    *n = view.len / 8;
    *out = PyMem_Malloc(view.len > 0 ? (size_t)view.len : 1);
    if (*out == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(*out, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

/* Resolve refs to (extent, slot), all or nothing: -1 with ValueError naming the
 * first that names no slot of the table. */
static int
resolve(BlockTable *t, const uint64_t *refs, Py_ssize_t n, kvt_loc *locs, const char *name)
{
    kvt_extent *last = NULL;

    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t id = KVT_REF_SEGMENT(refs[i]), slot = KVT_REF_SLOT(refs[i]);
        kvt_extent *e = (last != NULL && last->id == id) ? last : find_ext(t, id, NULL);

        if (e == NULL) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] names extent %llu, which the table does not "
                         "hold", name, i, (unsigned long long)id);
            return -1;
        }
        if (slot >= e->n_slots) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] names slot %llu of extent %llu, which has "
                         "%u slots", name, i, (unsigned long long)slot, (unsigned long long)id,
                         e->n_slots);
            return -1;
        }
        locs[i].e = e;
        locs[i].slot = (uint32_t)slot;
        last = e;
    }
    return 0;
}

static const char *
state_name(uint8_t st)
{
    switch (st) {
    case KVT_ST_FREE: return "FREE";
    case KVT_ST_RESERVED: return "RESERVED";
    case KVT_ST_COMMITTED: return "COMMITTED";
    case KVT_ST_DOOMED: return "DOOMED";
    default: return "?";
    }
}

/* Every loc in state `want` (and, with distinct, no slot twice: uses R_CHOSEN as
 * a mark and clears it).  -1 with ValueError otherwise. */
static int
require(const kvt_loc *locs, Py_ssize_t n, uint8_t want, int distinct, const char *name)
{
    Py_ssize_t bad = -1;
    int twice = 0;

    for (Py_ssize_t i = 0; i < n; i++) {
        kvt_rec *r = &locs[i].e->rec[locs[i].slot];
        if (r->state != want) {
            bad = i;
            break;
        }
        if (distinct) {
            if (r->bits & R_CHOSEN) {
                bad = i;
                twice = 1;
                break;
            }
            r->bits |= R_CHOSEN;
        }
    }
    if (distinct) {
        Py_ssize_t end = bad < 0 ? n : bad;
        for (Py_ssize_t i = 0; i < end; i++)
            locs[i].e->rec[locs[i].slot].bits &= (uint8_t)~R_CHOSEN;
    }
    if (bad >= 0) {
        const kvt_rec *r = &locs[bad].e->rec[locs[bad].slot];
        if (twice)
            PyErr_Format(PyExc_ValueError, "%s[%zd] names slot %u of extent %u twice", name, bad,
                         locs[bad].slot, locs[bad].e->id);
        else
            PyErr_Format(PyExc_ValueError, "%s[%zd]: slot %u of extent %u is %s, not %s", name,
                         bad, locs[bad].slot, locs[bad].e->id, state_name(r->state),
                         state_name(want));
        return -1;
    }
    return 0;
}

static PyObject *
refs_bytes(const uint64_t *refs, Py_ssize_t n)
{
    return PyBytes_FromStringAndSize((const char *)refs, n * 8);
}

/* ------------------------------------------------------------------------- */
/* Slot-table writes (segments.Segment.mark_*, byte for byte)                 */
/* ------------------------------------------------------------------------- */

/* mark_reserved: every field zero but the generation, state RESERVED (first:
 * a COMMITTED entry stops being one before its fields change). */
static void
write_reserved(kvt_extent *e, uint32_t slot, uint64_t gen)
{
    uint8_t *p = entry_of(e, slot);

    set_state(p, KVT_ST_RESERVED);
    memset(p + 1, 0, KVT_SLOT_LAST_ACCESS + 8 - 1);
    st64(p + KVT_SLOT_GENERATION, gen);
}

/* mark_free: the state byte first, then the entry checksum is cleared. */
static void
write_free(kvt_extent *e, uint32_t slot)
{
    uint8_t *p = entry_of(e, slot);

    set_state(p, KVT_ST_FREE);
    st64(p + KVT_SLOT_ENTRY_SUM, 0);
}

/* mark_committed: every field and the entry checksum, then the state byte. */
static void
write_committed(kvt_extent *e, uint32_t slot, const uint8_t *key, uint8_t klen, uint64_t length,
                int has_sum, uint64_t checksum, uint64_t gen, uint64_t epoch, uint64_t last)
{
    uint8_t *p = entry_of(e, slot);

    p[KVT_SLOT_KEY_LEN] = klen;
    p[KVT_SLOT_FLAGS] = has_sum ? KVT_SLOT_HAS_CHECKSUM : 0;
    memset(p + 3, 0, KVT_SLOT_LENGTH - 3);
    st64(p + KVT_SLOT_LENGTH, length);
    st64(p + KVT_SLOT_CHECKSUM, has_sum ? checksum : 0);
    st64(p + KVT_SLOT_GENERATION, gen);
    st64(p + KVT_SLOT_EPOCH, epoch);
    memcpy(p + KVT_SLOT_KEY, key, klen);
    memset(p + KVT_SLOT_KEY + klen, 0, KVT_SLOT_MAX_KEY - klen);
    st64(p + KVT_SLOT_ENTRY_SUM, entry_sum(e, slot, p));
    st64(p + KVT_SLOT_LAST_ACCESS, last);
    set_state(p, KVT_ST_COMMITTED);
    if (last > e->newest)
        e->newest = last;
}

/* ------------------------------------------------------------------------- */
/* Type: construction                                                         */
/* ------------------------------------------------------------------------- */

static void
free_extent(kvt_extent *e)
{
    PyBuffer_Release(&e->view);
    PyMem_RawFree(e->rec);
    PyMem_RawFree(e);
}

static int
bt_init(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"block_bytes", "slot_bytes", "seed", NULL};
    unsigned long long block_bytes, slot_bytes, seed = 0;

    if (t->ext != NULL || t->bytes != 0) {
        PyErr_SetString(PyExc_TypeError, "BlockTable.__init__ may run only once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KK|K:BlockTable", kwlist, &block_bytes,
                                     &slot_bytes, &seed))
        return -1;
    if (block_bytes < 1 || slot_bytes < block_bytes || slot_bytes > (1ULL << 40)) {
        PyErr_Format(PyExc_ValueError, "need 1 <= block_bytes <= slot_bytes <= 2**40, got "
                     "block_bytes=%llu slot_bytes=%llu", block_bytes, slot_bytes);
        return -1;
    }
    t->block_bytes = block_bytes;
    t->slot_bytes = slot_bytes;
    t->rng = seed ^ 0x9E3779B97F4A7C15ULL;
    if (t->rng == 0)
        t->rng = 1;
    t->bytes = sizeof(BlockTable);
    return 0;
}

static PyObject *
bt_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);

    (void)args;
    (void)kwargs;
    if (t == NULL)
        return NULL;
    pthread_mutex_init(&t->lock, NULL);
    return (PyObject *)t;
}

static void
bt_dealloc(BlockTable *t)
{
    PyTypeObject *tp = Py_TYPE(t);

    for (Py_ssize_t i = 0; i < t->n_ext; i++)
        free_extent(t->ext[i]);
    PyMem_RawFree(t->ext);
    pthread_mutex_destroy(&t->lock);
    tp->tp_free((PyObject *)t);
    Py_DECREF(tp);
}

static int
ready(BlockTable *t)
{
    if (t->bytes == 0) {
        PyErr_SetString(PyExc_ValueError, "BlockTable was not initialised");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Extents                                                                    */
/* ------------------------------------------------------------------------- */

PyDoc_STRVAR(bt_add_extent_doc,
"add_extent($self, extent_id, n_slots, meta, created_unix_ns, /)\n--\n\n"
"Add a freshly formatted extent: every slot FREE (its table all zeros).\n"
"meta is a writable buffer over the extent's slot table (n_slots entries of\n"
"128 bytes: the .meta mapping from the table offset); the table keeps it\n"
"exported until remove_extent.  created_unix_ns seeds the entry checksums.\n"
"For a previous run's extent, call adopt() next.  Raises ValueError for an\n"
"id taken or out of range (0..2**31-1), n_slots out of range (1..2**31-1)\n"
"or a buffer too small; TypeError for a read-only buffer.");

static PyObject *
bt_add_extent(BlockTable *t, PyObject *args)
{
    unsigned long long id, n_slots, created;
    PyObject *meta;
    kvt_extent *e = NULL;
    Py_ssize_t at;

    if (!PyArg_ParseTuple(args, "KKOK:add_extent", &id, &n_slots, &meta, &created))
        return NULL;
    if (ready(t) < 0)
        return NULL;
    if (id > KVT_MAX_EXTENT_ID || n_slots < 1 || n_slots > KVT_MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "need extent_id <= 2**31-1 and 1 <= n_slots <= 2**31-1, "
                     "got extent_id=%llu n_slots=%llu", id, n_slots);
        return NULL;
    }
    e = PyMem_RawCalloc(1, sizeof *e);
    if (e == NULL)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(meta, &e->view, PyBUF_STRIDES) < 0) {
        PyMem_RawFree(e);
        return NULL;
    }
    if (e->view.readonly) {
        PyErr_SetString(PyExc_TypeError, "meta is read-only");
        PyBuffer_Release(&e->view);
        PyMem_RawFree(e);
        return NULL;
    }
    if (!PyBuffer_IsContiguous(&e->view, 'C') ||
        (unsigned long long)e->view.len < n_slots * KVT_SLOT_BYTES) {
        PyErr_Format(PyExc_ValueError, "meta must be a C-contiguous buffer of at least %llu "
                     "bytes (%llu slots of %d), got %zd", n_slots * KVT_SLOT_BYTES, n_slots,
                     KVT_SLOT_BYTES, e->view.len);
        PyBuffer_Release(&e->view);
        PyMem_RawFree(e);
        return NULL;
    }
    e->rec = PyMem_RawCalloc((size_t)n_slots, sizeof(kvt_rec));
    if (e->rec == NULL) {
        PyBuffer_Release(&e->view);
        PyMem_RawFree(e);
        return PyErr_NoMemory();
    }
    e->id = (uint32_t)id;
    e->n_slots = (uint32_t)n_slots;
    e->meta = e->view.buf;
    e->created = created;
    tlock(t);
    if (find_ext(t, id, &at) != NULL) {
        tunlock(t);
        PyErr_Format(PyExc_ValueError, "extent %llu is already in the table", id);
        free_extent(e);
        return NULL;
    }
    if (t->n_ext == t->cap_ext) {
        Py_ssize_t cap = t->cap_ext ? 2 * t->cap_ext : 8;
        kvt_extent **grown = PyMem_RawRealloc(t->ext, (size_t)cap * sizeof *grown);
        if (grown == NULL) {
            tunlock(t);
            free_extent(e);
            return PyErr_NoMemory();
        }
        t->bytes += (size_t)(cap - t->cap_ext) * sizeof *grown;
        t->ext = grown;
        t->cap_ext = cap;
    }
    memmove(&t->ext[at + 1], &t->ext[at], (size_t)(t->n_ext - at) * sizeof *t->ext);
    t->ext[at] = e;
    t->n_ext++;
    /* pop() hands out the lowest slot first */
    for (uint32_t s = e->n_slots; s-- > 0;) {
        fl_push(e, s);
        account(t, e, &e->rec[s], 1);
    }
    t->bytes += sizeof *e + (size_t)n_slots * sizeof(kvt_rec);
    tunlock(t);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(bt_remove_extent_doc,
"remove_extent($self, extent_id, force=False)\n--\n\n"
"Take an extent out of the table (its blocks are gone from it; the slot table\n"
"is not written) and release its buffer.  Returns (committed, reserved): the\n"
"slots it held in those states.  Raises ValueError for an extent the table\n"
"does not hold, or, unless force, one with a pinned slot (a leased block is\n"
"never dropped; the store ends or moves its leases first).");

static PyObject *
bt_remove_extent(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"extent_id", "force", NULL};
    unsigned long long id;
    int force = 0;
    Py_ssize_t at;
    kvt_extent *e;
    long long committed, reserved;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "K|p:remove_extent", kwlist, &id, &force))
        return NULL;
    if (ready(t) < 0)
        return NULL;
    tlock(t);
    e = find_ext(t, id, &at);
    if (e == NULL || (e->c.pinned > 0 && !force)) {
        tunlock(t);
        if (e == NULL)
            PyErr_Format(PyExc_ValueError, "extent %llu is not in the table", id);
        else
            PyErr_Format(PyExc_ValueError, "extent %llu has %lld pinned slots", id,
                         (long long)e->c.pinned);
        return NULL;
    }
    committed = e->c.committed;
    reserved = e->c.reserved;
    t->c.free -= e->c.free;
    t->c.reserved -= e->c.reserved;
    t->c.committed -= e->c.committed;
    t->c.pinned -= e->c.pinned;
    t->c.dirty -= e->c.dirty;
    t->c.doomed -= e->c.doomed;
    t->c.evictable -= e->c.evictable;
    t->c.clean -= e->c.clean;
    memmove(&t->ext[at], &t->ext[at + 1], (size_t)(t->n_ext - at - 1) * sizeof *t->ext);
    t->n_ext--;
    t->bytes -= sizeof *e + (size_t)e->n_slots * sizeof(kvt_rec);
    /* pooled refs of this extent fail their check when popped */
    tunlock(t);
    free_extent(e);
    return Py_BuildValue("(LL)", committed, reserved);
}

/* ------------------------------------------------------------------------- */
/* Adoption (tests/unit/slot_oracle.py is its Python model)                   */
/* ------------------------------------------------------------------------- */

enum {
    D_KEY_LEN, D_LENGTH, D_FLAGS, D_SUM_FLAG, D_GEN, D_SEQ, D_EPOCH, D_CUT, D_SUM, D_STATE, D_N
};

/* The reasons, word for word as the oracle (tests/unit/slot_oracle.py) counts them. */
static const char *const drop_reason[D_N] = {
    "key length out of range",
    "length out of range",
    "unknown flags",
    "checksum without its flag",
    "generation out of range",
    "access sequence out of range",
    "commit epoch from the future",
    "data cut off by a client",
    "entry checksum mismatch",
    "invalid state byte",
};

typedef struct {
    BlockTable *t;
    kvt_extent *e;
    uint64_t boot_epoch, intact, referenced_from;
    uint64_t dropped[D_N];
    uint64_t adopted, reserved, freed, max_last;
} adopt_job;

static void
adopt_run(adopt_job *j)
{
    kvt_extent *e = j->e;
    const uint64_t block_bytes = j->t->block_bytes, slot_bytes = j->t->slot_bytes;

    /* The extent is all FREE (checked): take its records out of the counts, scan,
     * and count them again. */
    for (uint32_t s = 0; s < e->n_slots; s++)
        account(j->t, e, &e->rec[s], -1);
    e->free_head = 0;
    for (uint32_t s = 0; s < e->n_slots; s++) {
        uint8_t *p = entry_of(e, s);
        uint8_t st = p[KVT_SLOT_STATE], klen = p[KVT_SLOT_KEY_LEN], flags = p[KVT_SLOT_FLAGS];
        uint64_t length = ld64(p + KVT_SLOT_LENGTH), csum = ld64(p + KVT_SLOT_CHECKSUM);
        uint64_t gen = ld64(p + KVT_SLOT_GENERATION), epoch = ld64(p + KVT_SLOT_EPOCH);
        uint64_t last = ld64(p + KVT_SLOT_LAST_ACCESS);
        kvt_rec *r = &e->rec[s];
        int ok = st == KVT_ST_COMMITTED, why = -1;

        if (ok) {
            if (klen < 1 || klen > KVT_SLOT_MAX_KEY)
                why = D_KEY_LEN;
            else if (length < 1 || length > block_bytes)
                why = D_LENGTH;
            else if (flags & ~KVT_SLOT_HAS_CHECKSUM)
                why = D_FLAGS;
            else if (!(flags & KVT_SLOT_HAS_CHECKSUM) && csum != 0)
                why = D_SUM_FLAG;
            else if (gen >= KVT_MAX_GENERATION)
                why = D_GEN;
            else if (last >= KVT_MAX_ACCESS_SEQ)
                why = D_SEQ;
            else if (epoch > j->boot_epoch)
                why = D_EPOCH;
            /* (s + 1) * slot_bytes: no overflow, s < 2**31 and slot_bytes <= 2**40 */
            else if (((uint64_t)s + 1) * slot_bytes > j->intact)
                why = D_CUT;
            else if (entry_sum(e, s, p) != ld64(p + KVT_SLOT_ENTRY_SUM))
                why = D_SUM;
            if (why >= 0) {
                j->dropped[why]++;
                ok = 0;
            }
        }
        if (st > KVT_ST_DOOMED)
            j->dropped[D_STATE]++;
        memset(r, 0, sizeof *r);
        if (ok) {
            r->state = KVT_ST_COMMITTED;
            /* CLOCK after a restart: the recently used blocks keep a second chance */
            r->bits = KVT_LOWER_DIRTY | (last >= j->referenced_from ? R_REF : 0);
            j->adopted++;
            if (last > j->max_last)
                j->max_last = last;
        }
        else if (st == KVT_ST_RESERVED) {
            /* quarantined: a writer of the previous daemon may still be copying */
            r->state = KVT_ST_RESERVED;
            j->reserved++;
            if (gen >= KVT_MAX_GENERATION / 2)
                write_reserved(e, s, 0);
        }
        else {
            if (st != KVT_ST_FREE)
                write_free(e, s);
            /* Generations start again below the upper half (the oracle keeps
             * that in memory; here the table is the memory). */
            if (gen >= KVT_MAX_GENERATION / 2)
                st64(p + KVT_SLOT_GENERATION, 0);
            r->state = KVT_ST_FREE;
            j->freed++;
        }
    }
    for (uint32_t s = e->n_slots; s-- > 0;) {
        if (e->rec[s].state == KVT_ST_FREE)
            fl_push(e, s);
        account(j->t, e, &e->rec[s], 1);
    }
    e->newest = j->max_last;
}

PyDoc_STRVAR(bt_adopt_doc,
"adopt($self, extent_id, boot_epoch, intact_bytes, referenced_from=2**64-1, /)\n--\n\n"
"Take over a previous run's slot table: every\n"
"field of every COMMITTED entry is checked (key length, length against\n"
"block_bytes, flags, checksum flag, generation and access bounds, commit\n"
"epoch <= boot_epoch, data past intact_bytes of the data file, the seeded\n"
"entry checksum); those that pass become unpinned DIRTY blocks, RESERVED\n"
"slots stay RESERVED (quarantined: release_claims frees them), everything\n"
"else is freed in the table too; generations in the upper half of their\n"
"range restart at 0.  Adopted blocks whose last access is at least\n"
"referenced_from get their CLOCK bit (the store passes, say, the median last\n"
"access of all extents: the hand then takes the older half first).\n"
"Returns {'adopted', 'reserved', 'free',\n"
"'max_last_access', 'dropped': {reason: count}} with recovery's reasons.\n"
"Raises ValueError unless the extent is in the table and all FREE (as\n"
"add_extent left it).  The GIL is released during the scan.");

static PyObject *
bt_adopt(BlockTable *t, PyObject *args)
{
    unsigned long long id, boot_epoch, intact, referenced_from = UINT64_MAX;
    adopt_job j;
    PyObject *dropped, *out;

    if (!PyArg_ParseTuple(args, "KKK|K:adopt", &id, &boot_epoch, &intact, &referenced_from))
        return NULL;
    if (ready(t) < 0)
        return NULL;
    memset(&j, 0, sizeof j);
    j.t = t;
    j.boot_epoch = boot_epoch;
    j.intact = intact;
    j.referenced_from = referenced_from;
    tlock(t);
    j.e = find_ext(t, id, NULL);
    if (j.e == NULL || j.e->c.free != j.e->n_slots) {
        tunlock(t);
        PyErr_Format(PyExc_ValueError, j.e == NULL ? "extent %llu is not in the table"
                     : "extent %llu is in use (adopt takes a fresh extent)", id);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    adopt_run(&j);
    Py_END_ALLOW_THREADS
    tunlock(t);
    dropped = PyDict_New();
    if (dropped == NULL)
        return NULL;
    for (int i = 0; i < D_N; i++) {
        PyObject *v;
        if (j.dropped[i] == 0)
            continue;
        v = PyLong_FromUnsignedLongLong(j.dropped[i]);
        if (v == NULL || PyDict_SetItemString(dropped, drop_reason[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(dropped);
            return NULL;
        }
        Py_DECREF(v);
    }
    out = Py_BuildValue("{sKsKsKsKsO}", "adopted", j.adopted, "reserved", j.reserved, "free",
                        j.freed, "max_last_access", j.max_last, "dropped", dropped);
    Py_DECREF(dropped);
    return out;
}

/* ------------------------------------------------------------------------- */
/* Claims                                                                     */
/* ------------------------------------------------------------------------- */

static int
cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static int
in_sorted(const uint64_t *v, Py_ssize_t n, uint64_t x)
{
    Py_ssize_t lo = 0, hi = n;

    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (v[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && v[lo] == x;
}

/* An optional skip set (hazards): its refs sorted, bit 63 (the hazard bit) dropped.
 * Sorted only when it is not already (the daemon passes its hazards sorted, and a
 * client may write thousands of them). */
static int
get_skip(PyObject *obj, uint64_t **skip, Py_ssize_t *n)
{
    *skip = NULL;
    *n = 0;
    if (obj == NULL || obj == Py_None)
        return 0;
    if (copy_u64s(obj, "skip", skip, n) < 0)
        return -1;
    int sorted = 1;
    for (Py_ssize_t i = 0; i < *n; i++) {
        (*skip)[i] &= ~(1ULL << 63);
        if (i > 0 && (*skip)[i] < (*skip)[i - 1])
            sorted = 0;
    }
    if (!sorted)
        qsort(*skip, (size_t)*n, 8, cmp_u64);
    return 0;
}


/* Parse refs into locs under the lock: 0, or -1 with an exception (unlocked). */
typedef struct {
    uint64_t *refs;
    kvt_loc *locs;
    Py_ssize_t n;
} kvt_batch;

static void
batch_free(kvt_batch *b)
{
    PyMem_Free(b->refs);
    PyMem_Free(b->locs);
    b->refs = NULL;
    b->locs = NULL;
}

/* Copy refs (before the lock) ... */
static int
batch_copy(PyObject *obj, kvt_batch *b)
{
    memset(b, 0, sizeof *b);
    if (copy_u64s(obj, "refs", &b->refs, &b->n) < 0)
        return -1;
    b->locs = PyMem_Malloc((size_t)(b->n > 0 ? b->n : 1) * sizeof *b->locs);
    if (b->locs == NULL) {
        batch_free(b);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* ... and resolve them (with the lock held; on failure unlocks and frees). */
static int
batch_resolve(BlockTable *t, kvt_batch *b)
{
    if (resolve(t, b->refs, b->n, b->locs, "refs") < 0) {
        tunlock(t);
        batch_free(b);
        return -1;
    }
    return 0;
}

/* The start of every batch call: the table is ready, the refs copied, the lock taken
 * and the refs resolved; on failure nothing is held. */
static int
batch_begin(BlockTable *t, PyObject *refs, kvt_batch *b)
{
    if (ready(t) < 0 || batch_copy(refs, b) < 0)
        return -1;
    tlock(t);
    return batch_resolve(t, b);
}

#define APPLY(t, n, stmt)                                                                   \
    do {                                                                                    \
        if ((n) >= KVT_BLK_NOGIL_MIN) {                                                     \
            Py_BEGIN_ALLOW_THREADS stmt; Py_END_ALLOW_THREADS                               \
        }                                                                                   \
        else {                                                                              \
            stmt;                                                                           \
        }                                                                                   \
    } while (0)

static int unpin_apply(BlockTable *t, kvt_loc *locs, Py_ssize_t n, uint64_t *out,
                       Py_ssize_t *n_freed, const char *name);

PyDoc_STRVAR(bt_claim_doc,
"claim($self, n, skip=None, evict=None)\n--\n\n"
"Take n free slots into RESERVED (the slot table too, generation + 1), all or\n"
"nothing, lowest extent id and lowest slot first; free slots named in skip\n"
"(refs or hazard words: slots clients still read) stay free.  With evict,\n"
"those COMMITTED unpinned blocks are evicted into RESERVED in the same call\n"
"(the room a reserve made), all of it or nothing.  Returns (refs, short):\n"
"the free slots' refs as bytes of uint64, short 0; or (b'', short) with\n"
"nothing changed when short more free slots are needed (grow or evict first).");

static void evict_run(BlockTable *t, const kvt_loc *locs, Py_ssize_t n, int reserve);

static PyObject *
bt_claim(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"n", "skip", "evict", NULL};
    Py_ssize_t n, n_skip = 0, got = 0, n_kept = 0;
    PyObject *skip_obj = NULL, *evict_obj = Py_None, *out = NULL;
    uint64_t *skip = NULL, *refs = NULL;
    kvt_loc *kept = NULL;
    kvt_batch ev;

    memset(&ev, 0, sizeof ev);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|OO:claim", kwlist, &n, &skip_obj,
                                     &evict_obj))
        return NULL;
    if (ready(t) < 0)
        return NULL;
    if (n < 0 || n > (Py_ssize_t)KVT_MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "n must be in 0..2**31-1, got %zd", n);
        return NULL;
    }
    if (get_skip(skip_obj, &skip, &n_skip) < 0)
        return NULL;
    if (evict_obj != Py_None && batch_copy(evict_obj, &ev) < 0) {
        PyMem_Free(skip);
        return NULL;
    }
    tlock(t);
    if (evict_obj != Py_None) { /* the victims first: evictable, or nothing changes */
        if (resolve(t, ev.refs, ev.n, ev.locs, "evict") < 0
            || require(ev.locs, ev.n, KVT_ST_COMMITTED, 1, "evict") < 0) {
            tunlock(t);
            goto done;
        }
        for (Py_ssize_t i = 0; i < ev.n; i++) {
            if (ev.locs[i].e->rec[ev.locs[i].slot].pins) {
                tunlock(t);
                PyErr_Format(PyExc_ValueError, "evict[%zd]: slot %u of extent %u is pinned",
                             i, ev.locs[i].slot, ev.locs[i].e->id);
                goto done;
            }
        }
    }
    if (t->c.free < n) {
        Py_ssize_t short_by = n - (Py_ssize_t)t->c.free;
        tunlock(t);
        out = Py_BuildValue("(yn)", "", short_by);
        goto done;
    }
    refs = PyMem_Malloc((size_t)(n > 0 ? n : 1) * 8);
    kept = PyMem_Malloc((size_t)(n_skip > 0 ? n_skip : 1) * sizeof *kept);
    if (refs == NULL || kept == NULL) {
        tunlock(t);
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t x = 0; x < t->n_ext && got < n; x++) {
        kvt_extent *e = t->ext[x];
        while (e->free_head != 0 && got < n) {
            uint32_t s = fl_pop(e);
            if (n_skip && in_sorted(skip, n_skip, ref_of(e, s))) {
                kept[n_kept].e = e;  /* at most n_skip: each skip names one slot */
                kept[n_kept++].slot = s;
                continue;
            }
            refs[got++] = ref_of(e, s);
        }
        while (n_kept > 0) { /* back in their order */
            n_kept--;
            fl_push(kept[n_kept].e, kept[n_kept].slot);
        }
    }
    if (got < n) { /* the skipped ones were needed: put back what was taken */
        for (Py_ssize_t i = got; i-- > 0;) {
            kvt_extent *e = find_ext(t, KVT_REF_SEGMENT(refs[i]), NULL);
            fl_push(e, (uint32_t)refs[i]);
        }
        tunlock(t);
        out = Py_BuildValue("(yn)", "", n - got);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        kvt_extent *e = find_ext(t, KVT_REF_SEGMENT(refs[i]), NULL);
        uint32_t s = (uint32_t)refs[i];
        kvt_rec *r = &e->rec[s];
        account(t, e, r, -1);
        write_reserved(e, s, ld64(entry_of(e, s) + KVT_SLOT_GENERATION) + 1);
        r->state = KVT_ST_RESERVED;
        r->bits = 0;
        account(t, e, r, 1);
    }
    if (ev.n)
        evict_run(t, ev.locs, ev.n, 1); /* into this claim: COMMITTED -> RESERVED */
    tunlock(t);
    out = Py_BuildValue("(y#n)", (const char *)refs, n * 8, (Py_ssize_t)0);
done:
    PyMem_Free(refs);
    PyMem_Free(kept);
    PyMem_Free(skip);
    batch_free(&ev);
    return out;
}

static void
free_slots(BlockTable *t, const kvt_loc *locs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        kvt_extent *e = locs[i].e;
        kvt_rec *r = &e->rec[locs[i].slot];
        account(t, e, r, -1);
        write_free(e, locs[i].slot);
        r->state = KVT_ST_FREE;
        r->bits = 0;
        r->pins = 0;
        account(t, e, r, 1);
        fl_push(e, locs[i].slot);
    }
}

PyDoc_STRVAR(bt_release_claims_doc,
"release_claims($self, refs, unpin=None)\n--\n\n"
"Free RESERVED slots (abort, a length-0 commit, an expired quarantine, a\n"
"grant taken back) and, with unpin, end one pin per ref of unpin as unpin()\n"
"does: all of both or nothing (a session's close, the expiry sweep).  Returns\n"
"the refs of the DOOMED blocks the unpins freed (bytes of u64).  Raises\n"
"ValueError when a ref names no slot, a slot that is not RESERVED, or one\n"
"slot twice, or an unpin has no pin to end.");

static PyObject *
bt_release_claims(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"refs", "unpin", NULL};
    PyObject *refs_obj, *unpin_obj = Py_None, *out;
    kvt_batch b, u;
    Py_ssize_t n_freed = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:release_claims", kwlist, &refs_obj,
                                     &unpin_obj))
        return NULL;
    memset(&u, 0, sizeof u);
    if (unpin_obj != Py_None && (ready(t) < 0 || batch_copy(unpin_obj, &u) < 0))
        return NULL;
    if (batch_begin(t, refs_obj, &b) < 0) {
        batch_free(&u);
        return NULL;
    }
    if (require(b.locs, b.n, KVT_ST_RESERVED, 1, "refs") < 0
        || (unpin_obj != Py_None
            && (resolve(t, u.refs, u.n, u.locs, "unpin") < 0
                || unpin_apply(t, u.locs, u.n, u.refs, &n_freed, "unpin") < 0))) {
        tunlock(t);
        batch_free(&b);
        batch_free(&u);
        return NULL;
    }
    APPLY(t, b.n, free_slots(t, b.locs, b.n));
    tunlock(t);
    out = refs_bytes(u.refs, n_freed);
    batch_free(&b);
    batch_free(&u);
    return out;
}

/* ------------------------------------------------------------------------- */
/* Commit                                                                     */
/* ------------------------------------------------------------------------- */

typedef struct {
    BlockTable *t;
    const kvt_loc *locs;
    Py_ssize_t n;
    const uint8_t *keys; /* n rows of KVT_SLOT_MAX_KEY */
    const uint8_t *klens;
    const uint64_t *lengths, *sums;
    const uint8_t *has_sum;
    uint64_t first_access, epoch;
} commit_job;

static void
commit_run(commit_job *j)
{
    for (Py_ssize_t i = 0; i < j->n; i++) {
        kvt_extent *e = j->locs[i].e;
        uint32_t s = j->locs[i].slot;
        kvt_rec *r = &e->rec[s];
        uint64_t gen = ld64(entry_of(e, s) + KVT_SLOT_GENERATION);

        account(j->t, e, r, -1);
        write_committed(e, s, j->keys + (size_t)i * KVT_SLOT_MAX_KEY, j->klens[i], j->lengths[i],
                        j->has_sum[i], j->sums[i], gen, j->epoch,
                        j->first_access + (uint64_t)i);
        r->state = KVT_ST_COMMITTED;
        r->pins = 0;
        /* CLOCK: no reference bit until a block is read again.  Set at commit, a table
         * that just filled has every bit set and the hand needs a revolution to find a
         * victim; the hit ratio was the same either way (docs/benchmarks.md). */
        r->bits = KVT_LOWER_DIRTY;
        account(j->t, e, r, 1);
    }
}

/* The keys of the n slots just committed at locs into the index in ib, a run of slots
 * of one extent per call (kvt_index_put_slots); the index (in locs) they went in to,
 * with left (the indices left out) and *n_left.  No Python: runs without the GIL. */
static Py_ssize_t
publish_run(const BlockTable *t, Py_buffer *ib, const kvt_loc *locs, Py_ssize_t n,
            uint64_t *run, Py_ssize_t *left, Py_ssize_t *n_left)
{
    Py_ssize_t i0 = 0;
    *n_left = 0;
    while (i0 < n) {
        kvt_extent *e = locs[i0].e;
        Py_ssize_t i1 = i0, got, nl = 0;
        while (i1 < n && locs[i1].e == e) {
            run[i1] = locs[i1].slot;
            i1++;
        }
        got = kvt_index_put_slots(ib, e->meta, run + i0, i1 - i0, e->id, t->slot_bytes,
                                  left + *n_left, &nl);
        for (Py_ssize_t k = *n_left; k < *n_left + nl; k++)
            left[k] += i0;
        *n_left += nl;
        if (got < i1 - i0) /* 3/4 full (never -1: the caller opened the index first) */
            return i0 + (got > 0 ? got : 0);
        i0 = i1;
    }
    return n;
}

PyDoc_STRVAR(bt_commit_doc,
"commit($self, refs, keys, lengths, checksums, has_checksum, first_access, epoch,\n"
"       release=None, index=None, /)\n--\n\n"
"Make RESERVED slots COMMITTED, all or nothing: each slot-table entry gets\n"
"keys[i] (bytes, 1..64), lengths[i] (uint64, 1..block_bytes), checksums[i]\n"
"when has_checksum[i] (uint64 buffer and uint8 buffer, or None: no\n"
"checksums / all of them), the generation its reservation wrote, epoch, the\n"
"entry checksum and last access first_access + i, and then its state byte.\n"
"The blocks are DIRTY, unpinned, their CLOCK bit clear.  Raises\n"
"ValueError (nothing written) when a column's length differs, a ref names no\n"
"RESERVED slot or one twice, a key or length is out of range, or\n"
"first_access + n reaches 2**48; TypeError when a key is not bytes.  With\n"
"release, those RESERVED slots are freed in the same call (the length-0 slots\n"
"of a Commit): every slot of both named once.  With index (a writable\n"
"buffer holding a shared index, csrc/index.c), the keys are published there\n"
"in the same call, read from the entries just written (index_set_slots'\n"
"rules), and it returns (done, left): the refs before done went in, but for\n"
"left's indices (a key the index held already, or one past the probe limit);\n"
"done < n when the index reached 3/4 full (the caller grows it and publishes\n"
"the rest).  ValueError (nothing written) when index holds no index.");

static PyObject *
bt_commit(BlockTable *t, PyObject *args)
{
    PyObject *refs_obj, *keys_obj, *lengths_obj, *sums_obj, *has_obj, *seq = NULL;
    unsigned long long first_access, epoch;
    kvt_batch b;
    commit_job j;
    uint8_t *keys = NULL, *klens = NULL, *has = NULL;
    uint64_t *lengths = NULL, *sums = NULL;
    Py_ssize_t n_len = 0, n_sum = 0, i;
    PyObject *out = NULL;

    PyObject *release_obj = Py_None, *index_obj = Py_None;
    kvt_batch rb;
    kvt_loc *all = NULL;
    /* Publishing in the index (index given): its buffer, the slots of one extent's run,
     * the indices left out. */
    Py_buffer ib;
    int have_index = 0;
    uint64_t *run = NULL;
    Py_ssize_t *left = NULL, n_left = 0, done = 0;

    memset(&rb, 0, sizeof rb);
    if (!PyArg_ParseTuple(args, "OOOOOKK|OO:commit", &refs_obj, &keys_obj, &lengths_obj,
                          &sums_obj, &has_obj, &first_access, &epoch, &release_obj,
                          &index_obj))
        return NULL;
    if (ready(t) < 0)
        return NULL;
    if (index_obj != Py_None) {
        /* Checked before anything changes: a commit never half-publishes for want of
         * an index. */
        if (PyObject_GetBuffer(index_obj, &ib, PyBUF_WRITABLE) < 0)
            return NULL;
        have_index = 1;
        if (kvt_index_put_slots(&ib, NULL, NULL, 0, 0, 0, NULL, &n_left) < 0) {
            PyBuffer_Release(&ib);
            return NULL;
        }
    }
    if (batch_copy(refs_obj, &b) < 0) {
        if (have_index)
            PyBuffer_Release(&ib);
        return NULL;
    }
    memset(&j, 0, sizeof j);
    if (release_obj != Py_None && batch_copy(release_obj, &rb) < 0)
        goto fail;
    seq = PySequence_Fast(keys_obj, "keys must be a sequence of bytes");
    if (seq == NULL)
        goto fail;
    if (PySequence_Fast_GET_SIZE(seq) != b.n) {
        PyErr_Format(PyExc_ValueError, "refs and keys differ in length (%zd != %zd)", b.n,
                     PySequence_Fast_GET_SIZE(seq));
        goto fail;
    }
    keys = PyMem_Calloc((size_t)(b.n > 0 ? b.n : 1), KVT_SLOT_MAX_KEY);
    klens = PyMem_Malloc((size_t)(b.n > 0 ? b.n : 1));
    has = PyMem_Malloc((size_t)(b.n > 0 ? b.n : 1));
    if (keys == NULL || klens == NULL || has == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (i = 0; i < b.n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t kl;
        if (!PyBytes_Check(k)) {
            PyErr_Format(PyExc_TypeError, "keys[%zd] is %s, not bytes", i, Py_TYPE(k)->tp_name);
            goto fail;
        }
        kl = PyBytes_GET_SIZE(k);
        if (kl < 1 || kl > KVT_SLOT_MAX_KEY) {
            PyErr_Format(PyExc_ValueError, "keys[%zd] is %zd bytes (1..%d allowed)", i, kl,
                         KVT_SLOT_MAX_KEY);
            goto fail;
        }
        memcpy(keys + (size_t)i * KVT_SLOT_MAX_KEY, PyBytes_AS_STRING(k), (size_t)kl);
        klens[i] = (uint8_t)kl;
    }
    if (copy_u64s(lengths_obj, "lengths", &lengths, &n_len) < 0)
        goto fail;
    if (n_len != b.n) {
        PyErr_Format(PyExc_ValueError, "refs and lengths differ in length (%zd != %zd)", b.n,
                     n_len);
        goto fail;
    }
    for (i = 0; i < b.n; i++) {
        if (lengths[i] < 1 || lengths[i] > t->block_bytes) {
            PyErr_Format(PyExc_ValueError, "lengths[%zd] = %llu is outside 1..%llu (block_bytes)",
                         i, (unsigned long long)lengths[i], (unsigned long long)t->block_bytes);
            goto fail;
        }
    }
    if (sums_obj == Py_None) {
        sums = PyMem_Calloc((size_t)(b.n > 0 ? b.n : 1), 8);
        if (sums == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        memset(has, 0, (size_t)(b.n > 0 ? b.n : 1));
        if (has_obj != Py_None) {
            PyErr_SetString(PyExc_ValueError, "has_checksum without checksums");
            goto fail;
        }
    }
    else {
        if (copy_u64s(sums_obj, "checksums", &sums, &n_sum) < 0)
            goto fail;
        if (n_sum != b.n) {
            PyErr_Format(PyExc_ValueError, "refs and checksums differ in length (%zd != %zd)",
                         b.n, n_sum);
            goto fail;
        }
        if (has_obj == Py_None)
            memset(has, 1, (size_t)(b.n > 0 ? b.n : 1));
        else {
            Py_buffer hv;
            if (PyObject_GetBuffer(has_obj, &hv, PyBUF_SIMPLE) < 0)
                goto fail;
            if (hv.len != b.n) {
                PyErr_Format(PyExc_ValueError, "refs and has_checksum differ in length "
                             "(%zd != %zd)", b.n, hv.len);
                PyBuffer_Release(&hv);
                goto fail;
            }
            for (i = 0; i < b.n; i++)
                has[i] = ((const uint8_t *)hv.buf)[i] != 0;
            PyBuffer_Release(&hv);
        }
    }
    if (first_access >= KVT_MAX_ACCESS_SEQ || (uint64_t)b.n >= KVT_MAX_ACCESS_SEQ - first_access) {
        PyErr_Format(PyExc_ValueError, "first_access %llu + %zd blocks reaches 2**48",
                     first_access, b.n);
        goto fail;
    }
    all = PyMem_Malloc((size_t)(b.n + rb.n > 0 ? b.n + rb.n : 1) * sizeof *all);
    if (have_index) {
        run = PyMem_Malloc((size_t)(b.n > 0 ? b.n : 1) * sizeof *run);
        left = PyMem_Malloc((size_t)(b.n > 0 ? b.n : 1) * sizeof *left);
    }
    if (all == NULL || (have_index && (run == NULL || left == NULL))) {
        PyErr_NoMemory();
        goto fail;
    }
    tlock(t);
    if (batch_resolve(t, &b) < 0)
        goto fail;
    if (require(b.locs, b.n, KVT_ST_RESERVED, 1, "refs") < 0
        || resolve(t, rb.refs, rb.n, rb.locs, "release") < 0) {
        tunlock(t);
        goto fail;
    }
    /* The slots to commit and those to free: RESERVED, each named once in both. */
    if (b.n)
        memcpy(all, b.locs, (size_t)b.n * sizeof *all);
    if (rb.n) /* (no release: rb.locs is NULL) */
        memcpy(all + b.n, rb.locs, (size_t)rb.n * sizeof *all);
    if (require(all, b.n + rb.n, KVT_ST_RESERVED, 1, "refs + release") < 0) {
        tunlock(t);
        goto fail;
    }
    j.t = t;
    j.locs = b.locs;
    j.n = b.n;
    j.keys = keys;
    j.klens = klens;
    j.lengths = lengths;
    j.sums = sums;
    j.has_sum = has;
    j.first_access = first_access;
    j.epoch = epoch;
    APPLY(t, b.n, commit_run(&j));
    if (rb.n)
        free_slots(t, rb.locs, rb.n);
    if (have_index) /* (under the lock: the extents' mappings stay while it reads them) */
        APPLY(t, b.n, done = publish_run(t, &ib, b.locs, b.n, run, left, &n_left));
    tunlock(t);
    if (!have_index) {
        out = Py_None;
        Py_INCREF(out);
    }
    else {
        PyObject *lst = PyList_New(n_left);
        if (lst != NULL) {
            for (i = 0; i < n_left; i++) {
                PyObject *v = PyLong_FromSsize_t(left[i]);
                if (v == NULL) {
                    Py_CLEAR(lst);
                    break;
                }
                PyList_SET_ITEM(lst, i, v);
            }
        }
        if (lst != NULL) {
            out = Py_BuildValue("(nN)", done, lst);
        }
    }
fail:
    if (have_index)
        PyBuffer_Release(&ib);
    PyMem_Free(run);
    PyMem_Free(left);
    Py_XDECREF(seq);
    PyMem_Free(all);
    batch_free(&rb);
    batch_free(&b);
    PyMem_Free(keys);
    PyMem_Free(klens);
    PyMem_Free(has);
    PyMem_Free(lengths);
    PyMem_Free(sums);
    return out;
}

/* ------------------------------------------------------------------------- */
/* A session's commit ring, in one call                                       */
/* ------------------------------------------------------------------------- */

PyDoc_STRVAR(bt_commit_ring_doc,
"commit_ring($self, page, tail, max_length, held, index, first_access, epoch,\n"
"            exists, want_keys, answer_min=-1, /)\n--\n\n"
"Commit the records a writer published in its session page (a writable\n"
"KVT_WPAGE_BYTES buffer) since tail, in one call, when the ring is the plain\n"
"case: every record names a grant the session holds (held: its KVT_W_GRANTS_N\n"
"grant words, a writable u64 buffer), no grant or key twice in the ring, each\n"
"key 1..64 bytes and absent from the index (index: the shared index's\n"
"writable buffer, with room for the ring's keys), each length 1..max_length,\n"
"and, when exists is not None, exists(keys) (a callable given the ring's keys)\n"
"true for none.  Then the slots (RESERVED, named by the grant words) become\n"
"COMMITTED as commit() makes them (last access first_access + i, epoch), their\n"
"keys are published in index, and each record's grant ends: its word in held\n"
"and in the page becomes 0.  Returns (n, refs, entries, nbytes, done, n_left,\n"
"left, keys, answered): the records committed, their slot refs and grant\n"
"entries (bytes of u64), their bytes, commit()'s done and left of the publishing\n"
"(left: the first n_left u64 of a bytes), the keys (a list of bytes, made only\n"
"when want_keys or exists; else None), and whether the answers were written.\n"
"The answers (COMMITTED each) and DONE are written here, and the writer woken,\n"
"when the session still holds answer_min grants or more once the ring's have\n"
"ended (so its next put finds them); else they are the caller's to write\n"
"(commits_done), after it granted more.  Returns None,\n"
"having changed nothing, for any other ring (empty, impossible, a record\n"
"commits_take or the store would refuse or answer per batch, a key present,\n"
"a slot the table would refuse): the caller takes it the general way.");

_Static_assert(KVT_W_RING_N <= 256, "a ring's counts are small ints (bt_commit_ring)");

static PyObject *
bt_commit_ring(BlockTable *t, PyObject *args)
{
    PyObject *page_obj, *held_obj, *index_obj, *exists, *out = NULL, *keys = NULL;
    unsigned long long tail, max_length, first_access, epoch;
    int want_keys;
    long long answer_min = -1;
    Py_buffer page, held, ib;
    kvt_ring *r = NULL;
    kvt_batch b;
    uint64_t *found = NULL, *run = NULL;
    Py_ssize_t *left = NULL, n_left = 0, done = 0, n;
    commit_job j;

    if (!PyArg_ParseTuple(args, "OKKOOKKOp|L:commit_ring", &page_obj, &tail, &max_length,
                          &held_obj, &index_obj, &first_access, &epoch, &exists, &want_keys,
                          &answer_min))
        return NULL;
    if (ready(t) < 0)
        return NULL;
    if (PyObject_GetBuffer(page_obj, &page, PyBUF_WRITABLE) < 0)
        return NULL;
    if (page.len < KVT_WPAGE_BYTES || ((uintptr_t)page.buf & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "page must be a writable, 8-byte aligned buffer of "
                                          "KVT_WPAGE_BYTES");
        PyBuffer_Release(&page);
        return NULL;
    }
    if (PyObject_GetBuffer(held_obj, &held, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&page);
        return NULL;
    }
    if (PyObject_GetBuffer(index_obj, &ib, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&held);
        PyBuffer_Release(&page);
        return NULL;
    }
    memset(&b, 0, sizeof b);
    if (held.len != KVT_W_GRANTS_N * 8 || ((uintptr_t)held.buf & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "held must be the 8-byte aligned u64 words of every "
                                          "grant entry");
        goto done;
    }
    /* (the index checked before anything changes, as commit() does) */
    if (kvt_index_put_slots(&ib, NULL, NULL, 0, 0, 0, NULL, &n_left) < 0)
        goto done;
    r = PyMem_Malloc(sizeof *r);
    found = PyMem_Malloc(KVT_W_RING_N * sizeof *found);
    run = PyMem_Malloc(KVT_W_RING_N * sizeof *run);
    left = PyMem_Malloc(KVT_W_RING_N * sizeof *left);
    b.refs = PyMem_Malloc(KVT_W_RING_N * sizeof *b.refs);
    b.locs = PyMem_Malloc(KVT_W_RING_N * sizeof *b.locs);
    if (r == NULL || found == NULL || run == NULL || left == NULL || b.refs == NULL
        || b.locs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!kvt_ring_read(&page, tail, max_length < t->block_bytes ? max_length : t->block_bytes,
                       (const uint64_t *)held.buf, r)) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    n = r->n;
    if (first_access >= KVT_MAX_ACCESS_SEQ || (uint64_t)n >= KVT_MAX_ACCESS_SEQ - first_access) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    const uint8_t *kp[KVT_W_RING_N];
    for (Py_ssize_t i = 0; i < n; i++)
        kp[i] = r->key[i];
    if (kvt_index_find_rows(&ib, kp, r->klen, n, found) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (found[i] != 0) { /* present (or a hashed key's look-alike): per batch */
            out = Py_NewRef(Py_None);
            goto done;
        }
    if (want_keys || exists != Py_None) {
        if ((keys = PyList_New(n)) == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *k = PyBytes_FromStringAndSize((const char *)r->key[i], r->klen[i]);
            if (k == NULL)
                goto done;
            PyList_SET_ITEM(keys, i, k);
        }
    }
    if (exists != Py_None) {
        /* A lower tier's question (the store's own code): may run Python, never this
         * table's calls, and nothing below was decided before it answered. */
        PyObject *held_below = PyObject_CallOneArg(exists, keys), *seq;
        if (held_below == NULL)
            goto done;
        seq = PySequence_Fast(held_below, "exists must return a sequence");
        Py_DECREF(held_below);
        if (seq == NULL)
            goto done;
        int any = 0;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && !any; i++) {
            int v = PyObject_IsTrue(PySequence_Fast_GET_ITEM(seq, i));
            if (v < 0) {
                Py_DECREF(seq);
                goto done;
            }
            any = v;
        }
        if (!any && PySequence_Fast_GET_SIZE(seq) != n) {
            PyErr_SetString(PyExc_ValueError, "exists answered for another number of keys");
            Py_DECREF(seq);
            goto done;
        }
        Py_DECREF(seq);
        if (any) {
            out = Py_NewRef(Py_None);
            goto done;
        }
    }
    /* Every object of the answer is made before anything changes: once the slots are
     * committed, nothing can fail. */
    uint64_t nbytes = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        nbytes += r->length[i];
    PyObject *ans = PyTuple_New(9);
    if (ans == NULL)
        goto done;
    PyObject *items[4] = {PyBytes_FromStringAndSize(NULL, n * 8),
                          PyBytes_FromStringAndSize(NULL, n * 8),
                          PyBytes_FromStringAndSize(NULL, n * 8),
                          PyLong_FromUnsignedLongLong(nbytes)};
    for (int k = 0; k < 4; k++)
        if (items[k] == NULL) {
            for (int m = 0; m < 4; m++)
                Py_XDECREF(items[m]);
            Py_DECREF(ans);
            goto done;
        }
    b.n = n;
    for (Py_ssize_t i = 0; i < n; i++)
        b.refs[i] = r->word[i] & ~(KVT_GRANT_VALID | KVT_GRANT_TAKEN);
    tlock(t);
    if (resolve(t, b.refs, n, b.locs, "refs") < 0
        || require(b.locs, n, KVT_ST_RESERVED, 1, "refs") < 0) {
        /* The grants say RESERVED and the table does not: the general way answers it. */
        tunlock(t);
        PyErr_Clear();
        for (int m = 0; m < 4; m++)
            Py_DECREF(items[m]);
        Py_DECREF(ans);
        out = Py_NewRef(Py_None);
        goto done;
    }
    memset(&j, 0, sizeof j);
    j.t = t;
    j.locs = b.locs;
    j.n = n;
    j.keys = &r->key[0][0];
    j.klens = r->klen;
    j.lengths = r->length;
    j.sums = r->sum;
    j.has_sum = r->has_sum;
    j.first_access = first_access;
    j.epoch = epoch;
    commit_run(&j);
    done = publish_run(t, &ib, b.locs, n, run, left, &n_left);
    tunlock(t);
    /* Applied: each grant ends, in the session's words and then in the page (before
     * DONE: the writer never sees them as its own again). */
    uint64_t *hw = (uint64_t *)held.buf, *pg = W_GRANTS(&page);
    uint64_t *refs_out = (uint64_t *)PyBytes_AS_STRING(items[0]);
    uint64_t *entries_out = (uint64_t *)PyBytes_AS_STRING(items[1]);
    uint64_t *left_out = (uint64_t *)PyBytes_AS_STRING(items[2]);
    for (Py_ssize_t i = 0; i < n; i++) {
        hw[r->grant[i]] = 0;
        __atomic_store_n(&pg[r->grant[i]], 0, __ATOMIC_RELEASE);
        refs_out[i] = b.refs[i];
        entries_out[i] = r->grant[i];
    }
    for (Py_ssize_t k = 0; k < n_left; k++)
        left_out[k] = (uint64_t)left[k];
    /* The answer now, without a return to the caller first, when the writer keeps
     * enough grants for its next put (else the caller grants more before it answers). */
    int answered = 0;
    if (answer_min >= 0) {
        long long kept = 0;
        for (Py_ssize_t e = 0; e < KVT_W_GRANTS_N; e++)
            kept += hw[e] != 0;
        if (kept >= answer_min) {
            kvt_commits_finish(&page, tail, NULL, KVT_W_COMMITTED, n);
            answered = 1;
        }
    }
    /* (n, done and n_left are at most KVT_W_RING_N: small ints, never allocated) */
    PyTuple_SET_ITEM(ans, 0, PyLong_FromSsize_t(n));
    PyTuple_SET_ITEM(ans, 1, items[0]);
    PyTuple_SET_ITEM(ans, 2, items[1]);
    PyTuple_SET_ITEM(ans, 3, items[3]);
    PyTuple_SET_ITEM(ans, 4, PyLong_FromSsize_t(done));
    PyTuple_SET_ITEM(ans, 5, PyLong_FromSsize_t(n_left));
    PyTuple_SET_ITEM(ans, 6, items[2]);
    PyTuple_SET_ITEM(ans, 7, Py_NewRef(keys != NULL ? keys : Py_None));
    PyTuple_SET_ITEM(ans, 8, PyBool_FromLong(answered));
    out = ans;
done:
    Py_XDECREF(keys);
    PyMem_Free(r);
    PyMem_Free(found);
    PyMem_Free(run);
    PyMem_Free(left);
    batch_free(&b);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&held);
    PyBuffer_Release(&page);
    return out;
}

PyDoc_STRVAR(bt_unpublish_doc,
"unpublish($self, refs, index, /)\n--\n\n"
"Take the blocks at refs out of the shared index whose writable buffer is index,\n"
"by the keys their slot entries hold: an entry of such a key is removed only\n"
"where it names that block (an eviction's victims, hidden before the hazard\n"
"check, without the keys as Python objects).  Refs naming a slot that holds no\n"
"COMMITTED or DOOMED block are left out.  Returns bytes, 1 per ref whose entry\n"
"was removed.  ValueError when a ref names no slot of the table or index holds\n"
"no index.");

static PyObject *
bt_unpublish(BlockTable *t, PyObject *args)
{
    PyObject *refs_obj, *index_obj, *out = NULL;
    Py_buffer ib;
    kvt_batch b;
    const uint8_t **keys = NULL;
    uint8_t *klens = NULL;
    uint32_t *segs = NULL, *slots = NULL;

    if (!PyArg_ParseTuple(args, "OO:unpublish", &refs_obj, &index_obj))
        return NULL;
    if (PyObject_GetBuffer(index_obj, &ib, PyBUF_WRITABLE) < 0)
        return NULL;
    if (batch_begin(t, refs_obj, &b) < 0) {
        PyBuffer_Release(&ib);
        return NULL;
    }
    Py_ssize_t n = b.n, room = n > 0 ? n : 1;
    keys = PyMem_Malloc((size_t)room * sizeof *keys);
    klens = PyMem_Malloc((size_t)room);
    segs = PyMem_Malloc((size_t)room * sizeof *segs);
    slots = PyMem_Malloc((size_t)room * sizeof *slots);
    out = PyBytes_FromStringAndSize(NULL, n);
    if (keys == NULL || klens == NULL || segs == NULL || slots == NULL || out == NULL) {
        tunlock(t);
        Py_CLEAR(out);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *p = entry_of(b.locs[i].e, b.locs[i].slot);
        uint8_t st = p[KVT_SLOT_STATE], kl = p[KVT_SLOT_KEY_LEN];
        int live = (st == KVT_ST_COMMITTED || st == KVT_ST_DOOMED) && kl >= 1
                   && kl <= KVT_SLOT_MAX_KEY;
        keys[i] = live ? p + KVT_SLOT_KEY : NULL;
        klens[i] = kl;
        segs[i] = (uint32_t)b.locs[i].e->id;
        slots[i] = b.locs[i].slot;
    }
    /* (under the lock: the extents' mappings stay while the keys are read) */
    if (kvt_index_remove_at(&ib, keys, klens, segs, slots, n,
                            (uint8_t *)PyBytes_AS_STRING(out)) < 0)
        Py_CLEAR(out);
    tunlock(t);
done:
    PyMem_Free(keys);
    PyMem_Free(klens);
    PyMem_Free(segs);
    PyMem_Free(slots);
    batch_free(&b);
    PyBuffer_Release(&ib);
    return out;
}

/* ------------------------------------------------------------------------- */
/* Pins                                                                       */
/* ------------------------------------------------------------------------- */

PyDoc_STRVAR(bt_pin_doc,
"pin($self, refs, /)\n--\n\n"
"Pin COMMITTED blocks (a lease, a hazard, a demotion in flight): each ref's\n"
"pin count + 1 (a ref twice: + 2); a pinned block is never a victim.  All or\n"
"nothing: ValueError when a ref names no COMMITTED slot (DOOMED ones are\n"
"deleted: not pinned again) or a count would pass 2**32-1.");

static PyObject *
bt_pin(BlockTable *t, PyObject *arg)
{
    kvt_batch b;
    Py_ssize_t i, bad = -1;

    if (batch_begin(t, arg, &b) < 0)
        return NULL;
    if (require(b.locs, b.n, KVT_ST_COMMITTED, 0, "refs") < 0) {
        tunlock(t);
        batch_free(&b);
        return NULL;
    }
    for (i = 0; i < b.n; i++) {
        kvt_rec *r = &b.locs[i].e->rec[b.locs[i].slot];
        if (r->pins == UINT32_MAX) {
            bad = i;
            break;
        }
        account(t, b.locs[i].e, r, -1);
        r->pins++;
        account(t, b.locs[i].e, r, 1);
    }
    if (bad >= 0) { /* take back what this call added */
        for (i = bad; i-- > 0;) {
            kvt_rec *r = &b.locs[i].e->rec[b.locs[i].slot];
            account(t, b.locs[i].e, r, -1);
            r->pins--;
            account(t, b.locs[i].e, r, 1);
        }
        tunlock(t);
        PyErr_Format(PyExc_ValueError, "refs[%zd]: pin count would pass 2**32-1", bad);
        batch_free(&b);
        return NULL;
    }
    tunlock(t);
    batch_free(&b);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(bt_unpin_doc,
"unpin($self, refs, /)\n--\n\n"
"End pins granted by pin(): each ref's count - 1.  A DOOMED block whose last\n"
"pin ends is freed here (the slot table too).  Returns the refs freed (bytes\n"
"of uint64).  All or nothing: ValueError when a ref names a slot that is not\n"
"COMMITTED or DOOMED or holds fewer pins than the batch ends.");

/* End one pin per loc (a loc may repeat), all or nothing: -1 with ValueError and every
 * count as it was when one has no pin left.  Then the DOOMED blocks at 0 pins are freed,
 * each once; their refs go to out[0 .. *n_freed) (out may be the batch's refs). */
static int
unpin_apply(BlockTable *t, kvt_loc *locs, Py_ssize_t n, uint64_t *out, Py_ssize_t *n_freed,
            const char *name)
{
    Py_ssize_t i, bad = -1;

    for (i = 0; i < n; i++) {
        kvt_rec *r = &locs[i].e->rec[locs[i].slot];
        if ((r->state != KVT_ST_COMMITTED && r->state != KVT_ST_DOOMED) || r->pins == 0) {
            bad = i;
            break;
        }
        account(t, locs[i].e, r, -1);
        r->pins--;
        account(t, locs[i].e, r, 1);
    }
    if (bad >= 0) {
        uint8_t st = locs[bad].e->rec[locs[bad].slot].state;
        for (i = bad; i-- > 0;) {
            kvt_rec *r = &locs[i].e->rec[locs[i].slot];
            account(t, locs[i].e, r, -1);
            r->pins++;
            account(t, locs[i].e, r, 1);
        }
        PyErr_Format(PyExc_ValueError, "%s[%zd]: slot %u of extent %u is %s with no pin left "
                     "to end", name, bad, locs[bad].slot, locs[bad].e->id, state_name(st));
        return -1;
    }
    *n_freed = 0;
    for (i = 0; i < n; i++) {
        kvt_loc l = locs[i];
        kvt_rec *r = &l.e->rec[l.slot];
        if (r->state == KVT_ST_DOOMED && r->pins == 0) {
            out[(*n_freed)++] = ref_of(l.e, l.slot);
            free_slots(t, &l, 1); /* now FREE: a second ref to it is not freed again */
        }
    }
    return 0;
}

static PyObject *
bt_unpin(BlockTable *t, PyObject *arg)
{
    kvt_batch b;
    Py_ssize_t n_freed = 0;
    PyObject *out;

    if (batch_begin(t, arg, &b) < 0)
        return NULL;
    if (unpin_apply(t, b.locs, b.n, b.refs, &n_freed, "refs") < 0) {
        tunlock(t);
        batch_free(&b);
        return NULL;
    }
    tunlock(t);
    out = refs_bytes(b.refs, n_freed);
    batch_free(&b);
    return out;
}

/* ------------------------------------------------------------------------- */
/* Delete, evict                                                              */
/* ------------------------------------------------------------------------- */

static void
delete_run(BlockTable *t, const kvt_loc *locs, Py_ssize_t n, Py_ssize_t *doomed)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        kvt_extent *e = locs[i].e;
        kvt_rec *r = &e->rec[locs[i].slot];
        if (r->pins) {
            account(t, e, r, -1);
            set_state(entry_of(e, locs[i].slot), KVT_ST_DOOMED); /* a crash keeps it deleted */
            r->state = KVT_ST_DOOMED;
            r->bits &= (uint8_t)~(R_REF | R_PREFETCHED);
            account(t, e, r, 1);
            (*doomed)++;
        }
        else {
            free_slots(t, &locs[i], 1);
        }
    }
}

PyDoc_STRVAR(bt_delete_doc,
"delete($self, refs, /)\n--\n\n"
"Delete COMMITTED blocks: an unpinned one is freed now, a pinned one becomes\n"
"DOOMED (persisted: a restart never brings it back) and is freed by the unpin\n"
"that ends its last pin.  Returns how many were doomed.  All or nothing:\n"
"ValueError when a ref names no COMMITTED slot, or one twice.");

static PyObject *
bt_delete(BlockTable *t, PyObject *arg)
{
    kvt_batch b;
    Py_ssize_t doomed = 0;

    if (batch_begin(t, arg, &b) < 0)
        return NULL;
    if (require(b.locs, b.n, KVT_ST_COMMITTED, 1, "refs") < 0) {
        tunlock(t);
        batch_free(&b);
        return NULL;
    }
    APPLY(t, b.n, delete_run(t, b.locs, b.n, &doomed));
    tunlock(t);
    batch_free(&b);
    return PyLong_FromSsize_t(doomed);
}

static void
evict_run(BlockTable *t, const kvt_loc *locs, Py_ssize_t n, int reserve)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        kvt_extent *e = locs[i].e;
        uint32_t s = locs[i].slot;
        kvt_rec *r = &e->rec[s];
        if (reserve) {
            account(t, e, r, -1);
            write_reserved(e, s, ld64(entry_of(e, s) + KVT_SLOT_GENERATION) + 1);
            r->state = KVT_ST_RESERVED;
            r->bits = 0;
            account(t, e, r, 1);
        }
        else {
            free_slots(t, &locs[i], 1);
        }
    }
}

PyDoc_STRVAR(bt_evict_doc,
"evict($self, refs, reserve=False)\n--\n\n"
"Evict unpinned COMMITTED blocks (the one exit of DRAM blocks): freed, or with\n"
"reserve taken straight into RESERVED (generation + 1) for the reservation\n"
"that needed the room.  All or nothing: ValueError when a ref names no\n"
"COMMITTED slot, a pinned one, or one twice.");

static PyObject *
bt_evict(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"refs", "reserve", NULL};
    PyObject *refs_obj;
    int reserve = 0;
    kvt_batch b;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p:evict", kwlist, &refs_obj, &reserve))
        return NULL;
    if (batch_begin(t, refs_obj, &b) < 0)
        return NULL;
    if (require(b.locs, b.n, KVT_ST_COMMITTED, 1, "refs") < 0) {
        tunlock(t);
        batch_free(&b);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        if (b.locs[i].e->rec[b.locs[i].slot].pins) {
            tunlock(t);
            PyErr_Format(PyExc_ValueError, "refs[%zd]: slot %u of extent %u is pinned", i,
                         b.locs[i].slot, b.locs[i].e->id);
            batch_free(&b);
            return NULL;
        }
    }
    APPLY(t, b.n, evict_run(t, b.locs, b.n, reserve));
    tunlock(t);
    batch_free(&b);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------- */
/* Lower tiers, accesses                                                      */
/* ------------------------------------------------------------------------- */

PyDoc_STRVAR(bt_set_lower_doc,
"set_lower($self, refs, lower, generations=None)\n--\n\n"
"Record what the spill tiers hold of COMMITTED blocks (0 DIRTY, 1 CLEAN, 2\n"
"UNSPILLABLE).  A ref whose slot is not COMMITTED now, or (with generations,\n"
"a uint64 buffer) holds another generation (evicted and reused since), is\n"
"skipped.  Returns how many changed.  ValueError (nothing changed) for a\n"
"lower out of range, a ref naming no slot, or columns of different lengths.");

static PyObject *
bt_set_lower(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"refs", "lower", "generations", NULL};
    PyObject *refs_obj, *gens_obj = Py_None;
    int lower;
    kvt_batch b;
    uint64_t *gens = NULL;
    Py_ssize_t n_gens = 0, changed = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oi|O:set_lower", kwlist, &refs_obj, &lower,
                                     &gens_obj))
        return NULL;
    if (ready(t) < 0)
        return NULL;
    if (lower < KVT_LOWER_DIRTY || lower > KVT_LOWER_UNSPILLABLE) {
        PyErr_Format(PyExc_ValueError, "lower must be 0, 1 or 2, got %d", lower);
        return NULL;
    }
    if (batch_copy(refs_obj, &b) < 0)
        return NULL;
    if (gens_obj != Py_None) {
        if (copy_u64s(gens_obj, "generations", &gens, &n_gens) < 0) {
            batch_free(&b);
            return NULL;
        }
        if (n_gens != b.n) {
            PyErr_Format(PyExc_ValueError, "refs and generations differ in length (%zd != %zd)",
                         b.n, n_gens);
            PyMem_Free(gens);
            batch_free(&b);
            return NULL;
        }
    }
    tlock(t);
    if (batch_resolve(t, &b) < 0) {
        PyMem_Free(gens);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        kvt_extent *e = b.locs[i].e;
        uint32_t s = b.locs[i].slot;
        kvt_rec *r = &e->rec[s];
        if (r->state != KVT_ST_COMMITTED || rec_lower(r) == lower)
            continue;
        if (gens != NULL && ld64(entry_of(e, s) + KVT_SLOT_GENERATION) != gens[i])
            continue;
        account(t, e, r, -1);
        r->bits = (uint8_t)((r->bits & ~R_LOWER) | lower);
        account(t, e, r, 1);
        changed++;
    }
    tunlock(t);
    PyMem_Free(gens);
    batch_free(&b);
    return PyLong_FromSsize_t(changed);
}

PyDoc_STRVAR(bt_touch_doc,
"touch($self, refs, first_access, hints=False)\n--\n\n"
"Record reads: each COMMITTED slot's persisted last access becomes\n"
"first_access + i and its CLOCK bit is set; its prefetched mark is cleared.\n"
"Slots that are not COMMITTED are skipped.  With hints (refs from clients'\n"
"pages: any value), refs naming no slot of the table are skipped too;\n"
"without, they raise ValueError and nothing is changed.  Returns (touched,\n"
"were_prefetched).  ValueError when first_access + n reaches 2**48.");

static PyObject *
bt_touch(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"refs", "first_access", "hints", NULL};
    PyObject *refs_obj;
    unsigned long long first;
    int hints = 0;
    kvt_batch b;
    Py_ssize_t touched = 0, prefetched = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OK|p:touch", kwlist, &refs_obj, &first,
                                     &hints))
        return NULL;
    if (ready(t) < 0 || batch_copy(refs_obj, &b) < 0)
        return NULL;
    if (first >= KVT_MAX_ACCESS_SEQ || (uint64_t)b.n >= KVT_MAX_ACCESS_SEQ - first) {
        PyErr_Format(PyExc_ValueError, "first_access %llu + %zd reaches 2**48", first, b.n);
        batch_free(&b);
        return NULL;
    }
    tlock(t);
    if (!hints && batch_resolve(t, &b) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        kvt_extent *e;
        uint32_t s;
        kvt_rec *r;
        if (hints) {
            uint64_t id = KVT_REF_SEGMENT(b.refs[i]), slot = KVT_REF_SLOT(b.refs[i]);
            e = find_ext(t, id & KVT_REF_SEGMENT_MASK, NULL); /* a hazard word's top bit dropped */
            if (e == NULL || slot >= e->n_slots)
                continue;
            s = (uint32_t)slot;
        }
        else {
            e = b.locs[i].e;
            s = b.locs[i].slot;
        }
        r = &e->rec[s];
        if (r->state != KVT_ST_COMMITTED)
            continue;
        st64(entry_of(e, s) + KVT_SLOT_LAST_ACCESS, first + (uint64_t)i);
        if (first + (uint64_t)i > e->newest)
            e->newest = first + (uint64_t)i;
        if (r->bits & R_PREFETCHED)
            prefetched++;
        r->bits = (uint8_t)((r->bits | R_REF) & ~R_PREFETCHED);
        touched++;
    }
    tunlock(t);
    batch_free(&b);
    return Py_BuildValue("(nn)", touched, prefetched);
}

PyDoc_STRVAR(bt_set_prefetched_doc,
"set_prefetched($self, refs, /)\n--\n\n"
"Mark COMMITTED blocks as promoted by a prefetch (touch() clears the mark and\n"
"counts it).  Others are skipped; returns how many were marked.  ValueError\n"
"(nothing changed) for a ref naming no slot.");

static PyObject *
bt_set_prefetched(BlockTable *t, PyObject *arg)
{
    kvt_batch b;
    Py_ssize_t marked = 0;

    if (batch_begin(t, arg, &b) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        kvt_rec *r = &b.locs[i].e->rec[b.locs[i].slot];
        if (r->state == KVT_ST_COMMITTED && !(r->bits & R_PREFETCHED)) {
            r->bits |= R_PREFETCHED;
            marked++;
        }
    }
    tunlock(t);
    batch_free(&b);
    return PyLong_FromSsize_t(marked);
}

/* ------------------------------------------------------------------------- */
/* Victims                                                                    */
/* ------------------------------------------------------------------------- */

enum { W_EVICT, W_DEMOTE };

typedef struct {
    BlockTable *t;
    int want;   /* W_EVICT: evictable (and with spill, not DIRTY); W_DEMOTE: DIRTY unpinned */
    int spill;
    const uint64_t *skip;
    Py_ssize_t n_skip;
    int64_t budget; /* records it may still examine */
    int64_t *weights; /* per extent, prefix sums of eligible counts */
} vjob;

static inline int
eligible(const vjob *v, const kvt_extent *e, uint32_t s)
{
    const kvt_rec *r = &e->rec[s];

    if (r->state != KVT_ST_COMMITTED || r->pins != 0 || (r->bits & R_CHOSEN))
        return 0;
    if (v->want == W_DEMOTE) {
        if (rec_lower(r) != KVT_LOWER_DIRTY)
            return 0;
    }
    else if (v->spill && rec_lower(r) == KVT_LOWER_DIRTY) {
        return 0;
    }
    return v->n_skip == 0 || !in_sorted(v->skip, v->n_skip, ref_of(e, s));
}

static inline int64_t
eligible_count(const vjob *v, const kvt_extent *e)
{
    if (v->want == W_DEMOTE)
        return e->c.evictable - e->c.clean;
    return v->spill ? e->c.clean : e->c.evictable;
}

/* One sample: a random extent (weighted by its eligible slots), a random slot in
 * it, and the first eligible slot from there on (at most KVT_SAMPLE_SCAN). */
static int
sample_one(vjob *v, kvt_extent **pe, uint32_t *ps)
{
    BlockTable *t = v->t;
    int64_t total = v->weights[t->n_ext];
    uint64_t pick;
    Py_ssize_t lo = 0, hi = t->n_ext - 1;
    kvt_extent *e;
    uint32_t s;

    if (total <= 0)
        return 0;
    pick = rnd(t) % (uint64_t)total; /* the extent whose prefix range holds pick */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if ((uint64_t)v->weights[mid + 1] <= pick)
            lo = mid + 1;
        else
            hi = mid;
    }
    e = t->ext[lo];
    s = (uint32_t)(rnd(t) % e->n_slots);
    for (int k = 0; k < KVT_SAMPLE_SCAN && v->budget > 0; k++) {
        v->budget--;
        if (eligible(v, e, s)) {
            *pe = e;
            *ps = s;
            return 1;
        }
        if (++s == e->n_slots)
            s = 0;
    }
    return 0;
}

static inline uint64_t
last_of(const kvt_extent *e, uint32_t s)
{
    return ld64(entry_of(e, s) + KVT_SLOT_LAST_ACCESS);
}

static void
pool_insert(BlockTable *t, uint64_t ref, uint64_t last)
{
    int i, at;

    for (i = 0; i < t->pool_n; i++)
        if (t->pool[i].ref == ref)
            return;
    if (t->pool_n == KVT_POOL_N && last >= t->pool[KVT_POOL_N - 1].last)
        return; /* younger than every pooled candidate */
    for (at = 0; at < t->pool_n && t->pool[at].last <= last; at++)
        ;
    if (t->pool_n < KVT_POOL_N)
        t->pool_n++;
    memmove(&t->pool[at + 1], &t->pool[at], (size_t)(t->pool_n - 1 - at) * sizeof t->pool[0]);
    t->pool[at].ref = ref;
    t->pool[at].last = last;
}

/* Sampled LRU: up to n victims into out; returns how many. */
static Py_ssize_t
victims_lru(vjob *v, uint64_t *out, Py_ssize_t n, int sample, int use_pool)
{
    BlockTable *t = v->t;
    Py_ssize_t got = 0;

    while (got < n && v->budget > 0) {
        kvt_extent *best_e = NULL;
        uint32_t best_s = 0;
        uint64_t best_last = UINT64_MAX;

        for (int k = 0; k < sample && v->budget > 0; k++) {
            kvt_extent *e;
            uint32_t s;
            if (!sample_one(v, &e, &s))
                continue;
            if (use_pool)
                pool_insert(t, ref_of(e, s), last_of(e, s));
            else if (last_of(e, s) < best_last) {
                best_last = last_of(e, s);
                best_e = e;
                best_s = s;
            }
        }
        if (use_pool) {
            /* the oldest pooled candidate that is still eligible and unread since */
            while (t->pool_n > 0 && best_e == NULL) {
                kvt_pooled c = t->pool[0];
                kvt_extent *e = find_ext(t, KVT_REF_SEGMENT(c.ref), NULL);
                uint32_t s = (uint32_t)c.ref;
                memmove(&t->pool[0], &t->pool[1], (size_t)(t->pool_n - 1) * sizeof t->pool[0]);
                t->pool_n--;
                if (e != NULL && s < e->n_slots && eligible(v, e, s) && last_of(e, s) == c.last) {
                    best_e = e;
                    best_s = s;
                }
            }
        }
        if (best_e == NULL) {
            if (v->weights[t->n_ext] <= 0)
                break; /* nothing eligible at all */
            continue;  /* unlucky samples: the budget bounds the retries */
        }
        best_e->rec[best_s].bits |= R_CHOSEN;
        out[got++] = ref_of(best_e, best_s);
    }
    return got;
}

/* CLOCK: advance the hand, clearing set reference bits, taking unset ones. */
static Py_ssize_t
victims_clock(vjob *v, uint64_t *out, Py_ssize_t n)
{
    BlockTable *t = v->t;
    Py_ssize_t got = 0, x;
    kvt_extent *e;
    uint32_t s;

    if (t->n_ext == 0 || v->weights[t->n_ext] <= 0)
        return 0;
    /* Two revolutions at most: the first clears every bit it may, the second takes
     * every slot left eligible; a third finds nothing the second did not (nothing
     * changes eligibility during the call), and a call that comes up short leaves
     * the hand where it started.  Without it, a table whose few eligible blocks are
     * skipped (pinned, hazarded, chosen already: the weights count them) -- with
     * spill, a pool of DIRTY blocks waiting for demotion -- was walked round for the
     * whole budget, ~100K records, at every claim, and the hand left wherever the
     * budget ran out. */
    int64_t total = 0;
    for (x = 0; x < t->n_ext; x++)
        total += t->ext[x]->n_slots;
    if (v->budget > 2 * total)
        v->budget = 2 * total;
    find_ext(t, t->hand_id, &x); /* the hand's extent, or the next one if it went */
    if (x >= t->n_ext || t->ext[x]->id != t->hand_id) {
        s = 0;
        if (x >= t->n_ext)
            x = 0;
    }
    else {
        s = t->hand_slot;
    }
    e = t->ext[x];
    if (s >= e->n_slots)
        s = 0;
    while (got < n && v->budget > 0) {
        kvt_rec *r = &e->rec[s];
        v->budget--;
        int elig = eligible(v, e, s);
        if (r->bits & R_REF) {
            /* The hand passing takes an unpinned block's second chance, DIRTY ones
             * included (with spill they are not eligible until demoted, and demotion
             * picks blocks without their bit first): else a block read once would stay
             * in DRAM for good while unread ones stream past it. */
            if (elig || (v->spill && r->state == KVT_ST_COMMITTED && r->pins == 0
                         && rec_lower(r) == KVT_LOWER_DIRTY))
                r->bits &= (uint8_t)~R_REF;
        }
        else if (elig) {
            r->bits |= R_CHOSEN;
            out[got++] = ref_of(e, s);
        }
        if (++s == e->n_slots) {
            s = 0;
            x = (x + 1) % t->n_ext;
            e = t->ext[x];
        }
    }
    t->hand_id = e->id;
    t->hand_slot = s;
    return got;
}

/* Demotion candidates by CLOCK: the DIRTY unpinned slots the hand reaches first,
 * those without their bit first; the hand does not move, no bit changes. */
static Py_ssize_t
demote_clock(vjob *v, uint64_t *out, Py_ssize_t n)
{
    BlockTable *t = v->t;
    Py_ssize_t got = 0, x, n_later = 0;
    uint64_t *later;
    kvt_extent *e;
    uint32_t s;
    int64_t total = 0;

    if (t->n_ext == 0 || v->weights[t->n_ext] <= 0)
        return 0;
    for (x = 0; x < t->n_ext; x++)
        total += t->ext[x]->n_slots;
    if (v->budget > total)
        v->budget = total; /* one revolution */
    later = PyMem_RawMalloc((size_t)n * 8);
    if (later == NULL)
        return -1;
    find_ext(t, t->hand_id, &x);
    s = (x < t->n_ext && t->ext[x]->id == t->hand_id) ? t->hand_slot : 0;
    if (x >= t->n_ext)
        x = 0;
    e = t->ext[x];
    if (s >= e->n_slots)
        s = 0;
    while (got < n && v->budget > 0) {
        v->budget--;
        if (eligible(v, e, s)) {
            if (!(e->rec[s].bits & R_REF))
                out[got++] = ref_of(e, s);
            else if (n_later < n)
                later[n_later++] = ref_of(e, s);
        }
        if (++s == e->n_slots) {
            s = 0;
            x = (x + 1) % t->n_ext;
            e = t->ext[x];
        }
    }
    for (Py_ssize_t i = 0; i < n_later && got < n; i++)
        out[got++] = later[i];
    PyMem_RawFree(later);
    return got;
}

static void
unchoose(BlockTable *t, const uint64_t *refs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        kvt_extent *e = find_ext(t, KVT_REF_SEGMENT(refs[i]), NULL);
        e->rec[(uint32_t)refs[i]].bits &= (uint8_t)~R_CHOSEN;
    }
}

typedef struct {
    vjob v;
    uint64_t *out;
    Py_ssize_t n, got;
    int policy, sample, pool;
} victims_call;

static void
victims_run(victims_call *c)
{
    BlockTable *t = c->v.t;

    if (c->v.want == W_DEMOTE && c->policy == KVT_POLICY_CLOCK)
        c->got = demote_clock(&c->v, c->out, c->n);
    else if (c->policy == KVT_POLICY_CLOCK)
        c->got = victims_clock(&c->v, c->out, c->n);
    else
        c->got = victims_lru(&c->v, c->out, c->n, c->sample, c->pool);
    /* demote_clock marks nothing; every other path marked what it chose */
    if (c->got > 0 && !(c->v.want == W_DEMOTE && c->policy == KVT_POLICY_CLOCK))
        unchoose(t, c->out, c->got);
}

static PyObject *
victims_common(BlockTable *t, PyObject *args, PyObject *kwargs, int want)
{
    static char *kwlist[] = {"n", "policy", "sample", "pool", "spill", "skip", NULL};
    victims_call c;
    PyObject *skip_obj = Py_None, *out = NULL;
    uint64_t *skip = NULL;
    Py_ssize_t n_skip = 0;
    int spill = 0;

    memset(&c, 0, sizeof c);
    c.sample = 5;
    c.pool = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs,
                                     want == W_EVICT ? "ni|ippO:victims" : "ni|ippO:dirty",
                                     kwlist, &c.n, &c.policy, &c.sample, &c.pool, &spill,
                                     &skip_obj))
        return NULL;
    if (ready(t) < 0)
        return NULL;
    if (c.n < 0 || c.n > (Py_ssize_t)KVT_MAX_SLOTS || c.sample < 1 || c.sample > KVT_MAX_SAMPLE
        || (c.policy != KVT_POLICY_LRU && c.policy != KVT_POLICY_CLOCK)) {
        PyErr_Format(PyExc_ValueError, "need 0 <= n <= 2**31-1, policy LRU (%d) or CLOCK (%d) "
                     "and 1 <= sample <= %d, got n=%zd policy=%d sample=%d", KVT_POLICY_LRU,
                     KVT_POLICY_CLOCK, KVT_MAX_SAMPLE, c.n, c.policy, c.sample);
        return NULL;
    }
    if (get_skip(skip_obj, &skip, &n_skip) < 0)
        return NULL;
    tlock(t);
    if (c.n > t->c.evictable) /* no more can be eligible, whatever n asks */
        c.n = (Py_ssize_t)t->c.evictable;
    c.out = PyMem_Malloc((size_t)(c.n > 0 ? c.n : 1) * 8);
    c.v.weights = PyMem_RawMalloc((size_t)(t->n_ext + 1) * sizeof(int64_t));
    if (c.out == NULL || c.v.weights == NULL) {
        PyMem_RawFree(c.v.weights);
        tunlock(t);
        PyErr_NoMemory();
        goto done;
    }
    c.v.t = t;
    c.v.want = want;
    c.v.spill = spill;
    c.v.skip = skip;
    c.v.n_skip = n_skip;
    c.v.budget = KVT_SCAN_BASE + (int64_t)KVT_SCAN_PER_VICTIM * c.n * (c.sample > 1 ? c.sample : 1);
    c.v.weights[0] = 0;
    for (Py_ssize_t x = 0; x < t->n_ext; x++)
        c.v.weights[x + 1] = c.v.weights[x] + eligible_count(&c.v, t->ext[x]);
    APPLY(t, c.n * 64, victims_run(&c));
    PyMem_RawFree(c.v.weights);
    tunlock(t);
    if (c.got < 0)
        PyErr_NoMemory();
    else
        out = refs_bytes(c.out, c.got);
done:
    PyMem_Free(c.out);
    PyMem_Free(skip);
    return out;
}

PyDoc_STRVAR(bt_victims_doc,
"victims($self, n, policy, sample=5, pool=True, spill=False, skip=None)\n--\n\n"
"Choose up to n blocks to evict: COMMITTED, unpinned, with spill not DIRTY,\n"
"not named in skip (refs or hazard words).  policy 0: sampled LRU, each\n"
"victim the least recently accessed (persisted last access) of `sample`\n"
"(1..64) random eligible slots, with pool a pool of 16 candidates kept\n"
"across calls; policy 1: CLOCK (the hand clears the reference bits of the\n"
"eligible slots it passes, with spill of the unpinned DIRTY ones too, and takes\n"
"the first eligible slot without one).  Changes nothing but the policy's own\n"
"state: the caller evicts them (evict()).  Returns refs (bytes of uint64),\n"
"distinct; fewer than n when fewer are eligible or the call's work bound\n"
"(65536 + 256 * n * sample records) ran out (call again: CLOCK goes on where\n"
"its hand stopped).");

static PyObject *
bt_victims(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    return victims_common(t, args, kwargs, W_EVICT);
}

PyDoc_STRVAR(bt_dirty_doc,
"dirty($self, n, policy, sample=5, pool=True, spill=False, skip=None)\n--\n\n"
"Demotion candidates: up to n unpinned COMMITTED DIRTY blocks that the policy\n"
"would evict first (sampled LRU: the oldest of `sample` random ones each, no\n"
"pool; CLOCK: the first the hand reaches, those without their bit first; the\n"
"hand does not move).  Returns refs (bytes of uint64), distinct.  pool and\n"
"spill are accepted and ignored.");

static PyObject *
bt_dirty(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    return victims_common(t, args, kwargs, W_DEMOTE);
}

/* ------------------------------------------------------------------------- */
/* Reading                                                                    */
/* ------------------------------------------------------------------------- */

static PyObject *
counts_dict(const kvt_counts *c, long long n_slots, uint64_t newest)
{
    return Py_BuildValue("{sLsLsLsLsLsLsLsLsLsK}", "slots", n_slots, "free", (long long)c->free,
                         "reserved", (long long)c->reserved, "committed", (long long)c->committed,
                         "pinned", (long long)c->pinned, "dirty", (long long)c->dirty,
                         "doomed", (long long)c->doomed, "evictable", (long long)c->evictable,
                         "clean", (long long)c->clean, "newest_access",
                         (unsigned long long)newest);
}

PyDoc_STRVAR(bt_counts_doc,
"counts($self, extent_id=None, /)\n--\n\n"
"The slots of one extent (or of the whole table) by category, in O(1):\n"
"{'slots', 'free', 'reserved', 'committed' (DOOMED included), 'pinned',\n"
"'dirty' (committed and DIRTY), 'doomed', 'evictable' (COMMITTED, unpinned),\n"
"'clean' (evictable and not DIRTY), 'newest_access' (the largest last access its\n"
"blocks were given by commit, touch or adopt: never decreases while the extent\n"
"is in the table; of the table: the largest of its extents')}.  ValueError for\n"
"an unknown extent.");

static PyObject *
bt_counts(BlockTable *t, PyObject *args)
{
    PyObject *id_obj = Py_None, *out;

    if (!PyArg_ParseTuple(args, "|O:counts", &id_obj) || ready(t) < 0)
        return NULL;
    tlock(t);
    if (id_obj == Py_None) {
        kvt_counts c = t->c;
        long long slots = 0;
        uint64_t newest = 0;
        for (Py_ssize_t x = 0; x < t->n_ext; x++) {
            slots += t->ext[x]->n_slots;
            if (t->ext[x]->newest > newest)
                newest = t->ext[x]->newest;
        }
        tunlock(t);
        return counts_dict(&c, slots, newest);
    }
    else {
        unsigned long long id = PyLong_AsUnsignedLongLong(id_obj);
        kvt_extent *e;
        kvt_counts c;
        long long slots;
        if (id == (unsigned long long)-1 && PyErr_Occurred()) {
            tunlock(t);
            return NULL;
        }
        e = find_ext(t, id, NULL);
        if (e == NULL) {
            tunlock(t);
            PyErr_Format(PyExc_ValueError, "extent %llu is not in the table", id);
            return NULL;
        }
        c = e->c;
        slots = e->n_slots;
        uint64_t newest = e->newest;
        tunlock(t);
        out = counts_dict(&c, slots, newest);
    }
    return out;
}

PyDoc_STRVAR(bt_inspect_doc,
"inspect($self, refs, /)\n--\n\n"
"The native record and persisted generation of each ref, as bytes of\n"
"16-byte rows: u8 state, u8 lower, u8 flags (1 prefetched, 2 CLOCK bit),\n"
"u8 0, u32 pins, u64 generation (block_table.RECORD_DTYPE).  ValueError for a\n"
"ref naming no slot.");

static PyObject *
bt_inspect(BlockTable *t, PyObject *arg)
{
    kvt_batch b;
    PyObject *out;
    uint8_t *rows;

    if (ready(t) < 0 || batch_copy(arg, &b) < 0)
        return NULL;
    out = PyBytes_FromStringAndSize(NULL, b.n * 16);
    if (out == NULL) {
        batch_free(&b);
        return NULL;
    }
    rows = (uint8_t *)PyBytes_AS_STRING(out);
    tlock(t);
    if (batch_resolve(t, &b) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        const kvt_extent *e = b.locs[i].e;
        const kvt_rec *r = &e->rec[b.locs[i].slot];
        uint8_t *row = rows + 16 * i;
        row[0] = r->state;
        row[1] = (uint8_t)rec_lower(r);
        row[2] = (uint8_t)(((r->bits & R_PREFETCHED) ? 1 : 0) | ((r->bits & R_REF) ? 2 : 0));
        row[3] = 0;
        memcpy(row + 4, &r->pins, 4);
        st64(row + 8, ld64(entry_of(e, b.locs[i].slot) + KVT_SLOT_GENERATION));
    }
    tunlock(t);
    batch_free(&b);
    return out;
}

PyDoc_STRVAR(bt_entries_doc,
"entries($self, refs, keys=True)\n--\n\n"
"Each ref's persisted slot entry, as (keys, rows): keys a list of bytes (the\n"
"entry's key, its length clamped to 64; None with keys=False), rows bytes of 40-byte rows: u64\n"
"length, u64 checksum, u64 generation, u64 last access, u8 state, u8 flags\n"
"(1: has a checksum), 6 bytes 0 (block_table.ENTRY_DTYPE).  What handles and\n"
"eviction plans read in one call instead of one slot table read per block.\n"
"ValueError for a ref naming no slot.");

static PyObject *
bt_entries(BlockTable *t, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"refs", "keys", NULL};
    kvt_batch b;
    PyObject *arg, *rows = NULL, *keys = NULL, *out = NULL;
    uint8_t *keybuf = NULL;
    uint8_t *row;
    Py_ssize_t i;
    int want_keys = 1;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p:entries", kwlist, &arg, &want_keys))
        return NULL;
    if (ready(t) < 0 || batch_copy(arg, &b) < 0)
        return NULL;
    rows = PyBytes_FromStringAndSize(NULL, b.n * 40);
    keybuf = PyMem_Malloc((size_t)(b.n > 0 ? b.n : 1) * (KVT_SLOT_MAX_KEY + 1));
    if (rows == NULL || keybuf == NULL) {
        if (keybuf == NULL)
            PyErr_NoMemory();
        goto done;
    }
    row = (uint8_t *)PyBytes_AS_STRING(rows);
    tlock(t);
    if (resolve(t, b.refs, b.n, b.locs, "refs") < 0) {
        tunlock(t);
        goto done;
    }
    for (i = 0; i < b.n; i++) {
        const uint8_t *p = entry_of(b.locs[i].e, b.locs[i].slot);
        uint8_t *r = row + 40 * i;
        uint8_t kl = p[KVT_SLOT_KEY_LEN];
        if (kl > KVT_SLOT_MAX_KEY)
            kl = KVT_SLOT_MAX_KEY;
        keybuf[(size_t)i * (KVT_SLOT_MAX_KEY + 1)] = kl;
        memcpy(keybuf + (size_t)i * (KVT_SLOT_MAX_KEY + 1) + 1, p + KVT_SLOT_KEY, kl);
        st64(r, ld64(p + KVT_SLOT_LENGTH));
        st64(r + 8, ld64(p + KVT_SLOT_CHECKSUM));
        st64(r + 16, ld64(p + KVT_SLOT_GENERATION));
        st64(r + 24, ld64(p + KVT_SLOT_LAST_ACCESS));
        r[32] = p[KVT_SLOT_STATE];
        r[33] = p[KVT_SLOT_FLAGS] & KVT_SLOT_HAS_CHECKSUM;
        memset(r + 34, 0, 6);
    }
    tunlock(t);
    if (!want_keys) {
        out = PyTuple_Pack(2, Py_None, rows);
        goto done;
    }
    keys = PyList_New(b.n);
    if (keys == NULL)
        goto done;
    for (i = 0; i < b.n; i++) {
        const uint8_t *k = keybuf + (size_t)i * (KVT_SLOT_MAX_KEY + 1);
        PyObject *key = PyBytes_FromStringAndSize((const char *)k + 1, k[0]);
        if (key == NULL)
            goto done;
        PyList_SET_ITEM(keys, i, key);
    }
    out = PyTuple_Pack(2, keys, rows);
done:
    Py_XDECREF(keys);
    Py_XDECREF(rows);
    PyMem_Free(keybuf);
    batch_free(&b);
    return out;
}

/* Whether the slot at loc holds a COMMITTED block whose persisted key is key (kl bytes;
 * 0: none can): the check of a shared-index hit on a key held as its hash (match_keys,
 * find_keys).  Under the table's lock. */
static int
slot_holds_key(const kvt_loc *loc, const uint8_t *key, uint8_t kl)
{
    const uint8_t *p = entry_of(loc->e, loc->slot);
    return loc->e->rec[loc->slot].state == KVT_ST_COMMITTED && kl != 0
           && p[KVT_SLOT_KEY_LEN] == kl && memcmp(p + KVT_SLOT_KEY, key, kl) == 0;
}

PyDoc_STRVAR(bt_match_keys_doc,
"match_keys($self, refs, keys, /)\n--\n\n"
"Whether each refs[i] holds a COMMITTED block whose persisted key is keys[i]\n"
"(bytes): one byte each, 1 or 0.  What a lookup through the shared index\n"
"checks when the index holds a key's hash, not the key.  ValueError for a ref\n"
"naming no slot or columns of different lengths; TypeError for a key that is\n"
"not bytes.");

static PyObject *
bt_match_keys(BlockTable *t, PyObject *args)
{
    PyObject *refs_obj, *keys_obj, *seq = NULL, *out = NULL;
    kvt_batch b;
    uint8_t *keys = NULL, *klens = NULL;
    Py_ssize_t i;

    if (!PyArg_ParseTuple(args, "OO:match_keys", &refs_obj, &keys_obj))
        return NULL;
    if (ready(t) < 0 || batch_copy(refs_obj, &b) < 0)
        return NULL;
    seq = PySequence_Fast(keys_obj, "keys must be a sequence of bytes");
    if (seq == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(seq) != b.n) {
        PyErr_Format(PyExc_ValueError, "refs and keys differ in length (%zd != %zd)", b.n,
                     PySequence_Fast_GET_SIZE(seq));
        goto done;
    }
    keys = PyMem_Calloc((size_t)(b.n > 0 ? b.n : 1), KVT_SLOT_MAX_KEY);
    klens = PyMem_Calloc((size_t)(b.n > 0 ? b.n : 1), 1);
    if (keys == NULL || klens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < b.n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t kl;
        if (!PyBytes_Check(k)) {
            PyErr_Format(PyExc_TypeError, "keys[%zd] is %s, not bytes", i, Py_TYPE(k)->tp_name);
            goto done;
        }
        kl = PyBytes_GET_SIZE(k);
        if (kl >= 1 && kl <= KVT_SLOT_MAX_KEY) { /* else no slot can hold it: 0 */
            memcpy(keys + (size_t)i * KVT_SLOT_MAX_KEY, PyBytes_AS_STRING(k), (size_t)kl);
            klens[i] = (uint8_t)kl;
        }
    }
    out = PyBytes_FromStringAndSize(NULL, b.n);
    if (out == NULL)
        goto done;
    tlock(t);
    if (resolve(t, b.refs, b.n, b.locs, "refs") < 0) {
        tunlock(t);
        Py_CLEAR(out);
        goto done;
    }
    for (i = 0; i < b.n; i++)
        PyBytes_AS_STRING(out)[i] = (char)slot_holds_key(
            &b.locs[i], keys + (size_t)i * KVT_SLOT_MAX_KEY, klens[i]);
    tunlock(t);
done:
    Py_XDECREF(seq);
    PyMem_Free(keys);
    PyMem_Free(klens);
    batch_free(&b);
    return out;
}

/* find_keys holds up to this many keys' pointers on the stack (a delete's or a small
 * commit's; more are allocated). */
#define FIND_KEYS_STACK 16

PyDoc_STRVAR(bt_find_keys_doc,
"find_keys($self, index, keys, /)\n--\n\n"
"Keys.find in one call: each of keys' block ref in the shared index `index` (the\n"
"daemon's writable buffer of its current table), a hit on a key the index holds as\n"
"its hash (any key not 16 bytes long) checked against the slot entry as match_keys\n"
"does (COMMITTED, the same key), else 0: a bytearray of one uint64 each.  Every key\n"
"must be bytes of 1..64 (TypeError, ValueError; nothing answered); ValueError for an\n"
"index entry naming no slot of the table, or a buffer holding no index.");

static PyObject *
bt_find_keys(BlockTable *t, PyObject *args)
{
    Py_buffer buf;
    PyObject *keys_obj, *seq = NULL, *out = NULL;
    const uint8_t *stack_keys[FIND_KEYS_STACK], **keys = stack_keys;
    uint8_t stack_lens[FIND_KEYS_STACK], *klens = stack_lens;
    Py_ssize_t n = 0;

    if (!PyArg_ParseTuple(args, "y*O:find_keys", &buf, &keys_obj))
        return NULL;
    if (ready(t) < 0)
        goto done;
    seq = PySequence_Fast(keys_obj, "keys must be a sequence of bytes");
    if (seq == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n > FIND_KEYS_STACK) {
        keys = PyMem_Malloc((size_t)n * sizeof *keys);
        klens = PyMem_Malloc((size_t)n);
        if (keys == NULL || klens == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(k)) {
            PyErr_Format(PyExc_TypeError, "keys[%zd] is %s, not bytes", i, Py_TYPE(k)->tp_name);
            goto done;
        }
        Py_ssize_t kl = PyBytes_GET_SIZE(k);
        if (kl < 1 || kl > KVT_SLOT_MAX_KEY) {
            PyErr_Format(PyExc_ValueError, "keys[%zd] is %zd bytes (1..%d allowed)", i, kl,
                         KVT_SLOT_MAX_KEY);
            goto done;
        }
        keys[i] = (const uint8_t *)PyBytes_AS_STRING(k);
        klens[i] = (uint8_t)kl;
    }
    out = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL)
        goto done;
    uint64_t *refs = (uint64_t *)PyByteArray_AS_STRING(out);
    if (kvt_index_find_rows(&buf, keys, klens, n, refs) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    tlock(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (refs[i] == 0 || klens[i] == 16) /* (a 16-byte key is its own fingerprint) */
            continue;
        kvt_loc loc;
        if (resolve(t, &refs[i], 1, &loc, "the index's ref") < 0) {
            tunlock(t);
            Py_CLEAR(out);
            goto done;
        }
        if (!slot_holds_key(&loc, keys[i], klens[i]))
            refs[i] = 0;
    }
    tunlock(t);
done:
    if (keys != stack_keys)
        PyMem_Free((void *)keys);
    if (klens != stack_lens)
        PyMem_Free(klens);
    Py_XDECREF(seq);
    PyBuffer_Release(&buf);
    return out;
}

PyDoc_STRVAR(bt_rescale_access_doc,
"rescale_access($self, shift, /)\n--\n\n"
"Shift every COMMITTED block's persisted last access right by shift bits (and\n"
"each extent's newest access): the order of accesses stays (ties may appear),\n"
"and a long-lived cache's access sequence goes back far below the 2**48 bound\n"
"adoption enforces.  The field is outside the entry checksum.  Returns how many\n"
"blocks were rescaled.  ValueError for a shift outside 0..63.  The GIL is held\n"
"(one pass over the records; recovery calls it once).");

static PyObject *
bt_rescale_access(BlockTable *t, PyObject *arg)
{
    long shift = PyLong_AsLong(arg);
    Py_ssize_t n = 0;

    if (shift == -1 && PyErr_Occurred())
        return NULL;
    if (shift < 0 || shift > 63) {
        PyErr_Format(PyExc_ValueError, "shift %ld is outside 0..63", shift);
        return NULL;
    }
    if (ready(t) < 0)
        return NULL;
    tlock(t);
    for (Py_ssize_t x = 0; x < t->n_ext; x++) {
        kvt_extent *e = t->ext[x];
        for (uint32_t s = 0; s < e->n_slots; s++) {
            if (e->rec[s].state != KVT_ST_COMMITTED)
                continue;
            uint8_t *p = entry_of(e, s) + KVT_SLOT_LAST_ACCESS;
            st64(p, ld64(p) >> shift);
            n++;
        }
        e->newest >>= shift;
    }
    tunlock(t);
    return PyLong_FromSsize_t(n);
}

PyDoc_STRVAR(bt_committed_doc,
"committed($self, extent_id, /)\n--\n\n"
"The refs (bytes of uint64, ascending) of an extent's COMMITTED slots: what a\n"
"warm start indexes after adopt().  ValueError for an unknown extent.");

static PyObject *
bt_committed(BlockTable *t, PyObject *arg)
{
    unsigned long long id = PyLong_AsUnsignedLongLong(arg);
    kvt_extent *e;
    uint64_t *refs;
    Py_ssize_t n = 0;
    PyObject *out;

    if (id == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (ready(t) < 0)
        return NULL;
    tlock(t);
    e = find_ext(t, id, NULL);
    if (e == NULL) {
        tunlock(t);
        PyErr_Format(PyExc_ValueError, "extent %llu is not in the table", id);
        return NULL;
    }
    refs = PyMem_Malloc((size_t)(e->c.committed > 0 ? e->c.committed : 1) * 8);
    if (refs == NULL) {
        tunlock(t);
        return PyErr_NoMemory();
    }
    for (uint32_t s = 0; s < e->n_slots; s++)
        if (e->rec[s].state == KVT_ST_COMMITTED)
            refs[n++] = ref_of(e, s);
    tunlock(t);
    out = refs_bytes(refs, n);
    PyMem_Free(refs);
    return out;
}

PyDoc_STRVAR(bt_extents_doc,
"extents($self, /)\n--\n\n"
"The ids of the table's extents, ascending.");

static PyObject *
bt_extents(BlockTable *t, PyObject *Py_UNUSED(arg))
{
    PyObject *out;

    if (ready(t) < 0)
        return NULL;
    tlock(t);
    out = PyList_New(t->n_ext);
    for (Py_ssize_t x = 0; out != NULL && x < t->n_ext; x++) {
        PyObject *v = PyLong_FromUnsignedLong(t->ext[x]->id);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, x, v);
    }
    tunlock(t);
    return out;
}

/* ------------------------------------------------------------------------- */
/* check()                                                                    */
/* ------------------------------------------------------------------------- */

typedef struct {
    char (*msg)[160];
    int n;
    long more;
} problems;

static void
problem(problems *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void
problem(problems *p, const char *fmt, ...)
{
    va_list ap;

    if (p->n >= KVT_CHECK_MAX) {
        p->more++;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(p->msg[p->n++], sizeof p->msg[0], fmt, ap);
    va_end(ap);
}

static void
count_into(kvt_counts *c, const kvt_rec *r)
{
    int committed = r->state == KVT_ST_COMMITTED || r->state == KVT_ST_DOOMED;
    int evictable = r->state == KVT_ST_COMMITTED && r->pins == 0;
    int dirty = rec_lower(r) == KVT_LOWER_DIRTY;

    c->free += r->state == KVT_ST_FREE;
    c->reserved += r->state == KVT_ST_RESERVED;
    c->committed += committed;
    c->pinned += r->pins > 0;
    c->dirty += committed && dirty;
    c->doomed += r->state == KVT_ST_DOOMED;
    c->evictable += evictable;
    c->clean += evictable && !dirty;
}

static int
counts_differ(const kvt_counts *a, const kvt_counts *b)
{
    return memcmp(a, b, sizeof *a) != 0;
}

static void
check_run(BlockTable *t, problems *p, uint8_t *seen_buf)
{
    kvt_counts total;

    memset(&total, 0, sizeof total);
    for (Py_ssize_t x = 0; x < t->n_ext; x++) {
        kvt_extent *e = t->ext[x];
        kvt_counts c;
        uint32_t walked = 0, at = e->free_head;
        uint8_t *seen = seen_buf;

        memset(&c, 0, sizeof c);
        memset(seen, 0, e->n_slots);
        while (at != 0) {
            uint32_t s = at - 1;
            if (s >= e->n_slots) {
                problem(p, "extent %u: free list names slot %u of %u", e->id, s, e->n_slots);
                break;
            }
            if (seen[s]) {
                problem(p, "extent %u: free list holds slot %u twice (a cycle)", e->id, s);
                break;
            }
            seen[s] = 1;
            walked++;
            if (e->rec[s].state != KVT_ST_FREE)
                problem(p, "extent %u slot %u: on the free list but %s", e->id, s,
                        state_name(e->rec[s].state));
            at = e->rec[s].next;
        }
        for (uint32_t s = 0; s < e->n_slots; s++) {
            const kvt_rec *r = &e->rec[s];
            const uint8_t *q = entry_of(e, s);
            uint8_t st = q[KVT_SLOT_STATE];

            count_into(&c, r);
            if (st != r->state)
                problem(p, "extent %u slot %u: %s in the table, %s in the slot table", e->id, s,
                        state_name(r->state), st <= KVT_ST_DOOMED ? state_name(st) : "invalid");
            if (r->state == KVT_ST_FREE && !seen[s])
                problem(p, "extent %u slot %u: FREE but not on the free list", e->id, s);
            if (rec_lower(r) > KVT_LOWER_UNSPILLABLE)
                problem(p, "extent %u slot %u: lower %d is no tier state", e->id, s,
                        rec_lower(r));
            if (r->bits & R_CHOSEN)
                problem(p, "extent %u slot %u: still marked chosen", e->id, s);
            if (r->pins && r->state != KVT_ST_COMMITTED && r->state != KVT_ST_DOOMED)
                problem(p, "extent %u slot %u: %u pins on a %s slot", e->id, s, r->pins,
                        state_name(r->state));
            if (r->state == KVT_ST_DOOMED && r->pins == 0)
                problem(p, "extent %u slot %u: DOOMED without a pin (never freed)", e->id, s);
            if (r->state == KVT_ST_COMMITTED || r->state == KVT_ST_DOOMED) {
                uint8_t klen = q[KVT_SLOT_KEY_LEN];
                uint64_t length = ld64(q + KVT_SLOT_LENGTH);
                if (klen < 1 || klen > KVT_SLOT_MAX_KEY || length < 1 || length > t->block_bytes)
                    problem(p, "extent %u slot %u: key length %u or length %llu out of range",
                            e->id, s, klen, (unsigned long long)length);
                if (entry_sum(e, s, q) != ld64(q + KVT_SLOT_ENTRY_SUM))
                    problem(p, "extent %u slot %u: entry checksum does not verify", e->id, s);
            }
        }
        if (walked != (uint64_t)c.free)
            problem(p, "extent %u: free list holds %u slots, %lld are FREE", e->id, walked,
                    (long long)c.free);
        if (counts_differ(&c, &e->c))
            problem(p, "extent %u: counters (free %lld reserved %lld committed %lld pinned %lld "
                    "dirty %lld doomed %lld evictable %lld clean %lld) != records (%lld %lld "
                    "%lld %lld %lld %lld %lld %lld)", e->id, (long long)e->c.free,
                    (long long)e->c.reserved, (long long)e->c.committed, (long long)e->c.pinned,
                    (long long)e->c.dirty, (long long)e->c.doomed, (long long)e->c.evictable,
                    (long long)e->c.clean, (long long)c.free, (long long)c.reserved,
                    (long long)c.committed, (long long)c.pinned, (long long)c.dirty,
                    (long long)c.doomed, (long long)c.evictable, (long long)c.clean);
        total.free += c.free;
        total.reserved += c.reserved;
        total.committed += c.committed;
        total.pinned += c.pinned;
        total.dirty += c.dirty;
        total.doomed += c.doomed;
        total.evictable += c.evictable;
        total.clean += c.clean;
    }
    if (counts_differ(&total, &t->c))
        problem(p, "table counters do not equal the sum of its extents' records");
    for (Py_ssize_t x = 1; x < t->n_ext; x++)
        if (t->ext[x - 1]->id >= t->ext[x]->id)
            problem(p, "extents out of order");
}

PyDoc_STRVAR(bt_check_doc,
"check($self, /)\n--\n\n"
"Cross-check the native records against the slot tables: each slot's state\n"
"equals its persisted state byte, committed entries verify (key length,\n"
"length, entry checksum), the free lists hold exactly the FREE slots once,\n"
"pins only on COMMITTED/DOOMED slots and every DOOMED slot pinned, and every\n"
"counter equals a recount.  Returns the problems found (at most 64 and a\n"
"line saying how many more); empty when all adds up.  The GIL is released.");

static PyObject *
bt_check(BlockTable *t, PyObject *Py_UNUSED(arg))
{
    problems p;
    uint8_t *seen;
    uint32_t most = 1;
    PyObject *out;

    if (ready(t) < 0)
        return NULL;
    memset(&p, 0, sizeof p);
    p.msg = PyMem_RawCalloc(KVT_CHECK_MAX, sizeof *p.msg);
    if (p.msg == NULL)
        return PyErr_NoMemory();
    tlock(t);
    for (Py_ssize_t x = 0; x < t->n_ext; x++)
        if (t->ext[x]->n_slots > most)
            most = t->ext[x]->n_slots;
    seen = PyMem_RawMalloc(most);
    if (seen == NULL) {
        tunlock(t);
        PyMem_RawFree(p.msg);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    check_run(t, &p, seen);
    Py_END_ALLOW_THREADS
    tunlock(t);
    PyMem_RawFree(seen);
    out = PyList_New(0);
    for (int i = 0; out != NULL && i < p.n; i++) {
        PyObject *s = PyUnicode_FromString(p.msg[i]);
        if (s == NULL || PyList_Append(out, s) < 0)
            Py_CLEAR(out);
        Py_XDECREF(s);
    }
    if (out != NULL && p.more) {
        PyObject *s = PyUnicode_FromFormat("... and %ld more problems", p.more);
        if (s == NULL || PyList_Append(out, s) < 0)
            Py_CLEAR(out);
        Py_XDECREF(s);
    }
    PyMem_RawFree(p.msg);
    return out;
}

static PyObject *
bt_get_native_bytes(BlockTable *t, void *Py_UNUSED(closure))
{
    size_t bytes;

    tlock(t);
    bytes = t->bytes;
    tunlock(t);
    return PyLong_FromSize_t(bytes);
}

static PyObject *
bt_get_block_bytes(BlockTable *t, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(t->block_bytes);
}

static PyObject *
bt_get_slot_bytes(BlockTable *t, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(t->slot_bytes);
}

static PyObject *
bt_get_n_slots(BlockTable *t, void *Py_UNUSED(closure))
{
    long long slots = 0;
    tlock(t);
    for (Py_ssize_t x = 0; x < t->n_ext; x++)
        slots += t->ext[x]->n_slots;
    tunlock(t);
    return PyLong_FromLongLong(slots);
}

static PyObject *
bt_get_n_free(BlockTable *t, void *Py_UNUSED(closure))
{
    tlock(t);
    long long free = (long long)t->c.free;
    tunlock(t);
    return PyLong_FromLongLong(free);
}

/* ------------------------------------------------------------------------- */
/* Store.check's rows                                                          */
/* ------------------------------------------------------------------------- */

/* One slot as Store.check reads it (24 bytes; index.c's check_keys reads them). */
typedef struct {
    uint64_t a, b;   /* COMMITTED with a key of 1..64 bytes: its fingerprint (index.c);
                      * otherwise a = the persisted generation, b = 0 */
    uint8_t state;   /* the persisted state byte */
    uint8_t key_len; /* the persisted key length */
    uint8_t fp_flags;
    uint8_t pad;
    uint32_t pins;   /* the record's pin count */
} kvt_check_row;

_Static_assert(sizeof(kvt_check_row) == 24, "a check row is 24 bytes");

typedef struct {
    const kvt_extent *e;
    kvt_check_row *out;
} rows_job;

static void
check_rows_run(rows_job *j)
{
    const kvt_extent *e = j->e;
    for (uint32_t s = 0; s < e->n_slots; s++) {
        const uint8_t *p = entry_of(e, s);
        kvt_check_row *r = &j->out[s];
        uint8_t st = __atomic_load_n(p + KVT_SLOT_STATE, __ATOMIC_ACQUIRE);
        uint8_t klen = p[KVT_SLOT_KEY_LEN];
        r->state = st;
        r->key_len = klen;
        r->pad = 0;
        r->pins = e->rec[s].pins;
        if (st == KVT_ST_COMMITTED && klen >= 1 && klen <= KVT_SLOT_MAX_KEY) {
            kvt_fingerprint(p + KVT_SLOT_KEY, klen, &r->a, &r->b, &r->fp_flags);
        }
        else {
            r->a = ld64(p + KVT_SLOT_GENERATION);
            r->b = 0;
            r->fp_flags = 0;
        }
    }
}

PyDoc_STRVAR(bt_check_rows_doc,
"check_rows($self, extent_id, /)\n--\n\n"
"What Store.check reads of an extent, one 24-byte row a slot (bytes): for a\n"
"slot whose persisted state is COMMITTED with a key of 1..64 bytes, the key's\n"
"shared-index fingerprint (fp0, fp1 as u64s), else its persisted generation\n"
"and 0; then the persisted state byte, key length, the fingerprint's flags, a\n"
"pad byte and the record's pin count (u32).  One consistent copy (the table's\n"
"lock is held), taken with the GIL released.  ValueError for an extent the\n"
"table does not hold.");

static PyObject *
bt_check_rows(BlockTable *t, PyObject *arg)
{
    unsigned long long id = PyLong_AsUnsignedLongLong(arg);
    rows_job j;
    PyObject *out;

    if (id == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (ready(t) < 0)
        return NULL;
    tlock(t);
    j.e = find_ext(t, id, NULL);
    if (j.e == NULL) {
        tunlock(t);
        PyErr_Format(PyExc_ValueError, "extent %llu is not in the table", id);
        return NULL;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)j.e->n_slots * (Py_ssize_t)sizeof(kvt_check_row));
    if (out == NULL) {
        tunlock(t);
        return NULL;
    }
    j.out = (kvt_check_row *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    check_rows_run(&j);
    Py_END_ALLOW_THREADS
    tunlock(t);
    return out;
}

/* ------------------------------------------------------------------------- */
/* Type and module glue                                                       */
/* ------------------------------------------------------------------------- */

#define M(name, fn, flags) {name, (PyCFunction)(void (*)(void))fn, flags, fn##_doc}

static PyMethodDef bt_methods[] = {
    M("add_extent", bt_add_extent, METH_VARARGS),
    M("remove_extent", bt_remove_extent, METH_VARARGS | METH_KEYWORDS),
    M("adopt", bt_adopt, METH_VARARGS),
    M("claim", bt_claim, METH_VARARGS | METH_KEYWORDS),
    M("release_claims", bt_release_claims, METH_VARARGS | METH_KEYWORDS),
    M("commit", bt_commit, METH_VARARGS),
    M("commit_ring", bt_commit_ring, METH_VARARGS),
    M("unpublish", bt_unpublish, METH_VARARGS),
    M("pin", bt_pin, METH_O),
    M("unpin", bt_unpin, METH_O),
    M("delete", bt_delete, METH_O),
    M("evict", bt_evict, METH_VARARGS | METH_KEYWORDS),
    M("set_lower", bt_set_lower, METH_VARARGS | METH_KEYWORDS),
    M("touch", bt_touch, METH_VARARGS | METH_KEYWORDS),
    M("set_prefetched", bt_set_prefetched, METH_O),
    M("victims", bt_victims, METH_VARARGS | METH_KEYWORDS),
    M("dirty", bt_dirty, METH_VARARGS | METH_KEYWORDS),
    M("counts", bt_counts, METH_VARARGS),
    M("inspect", bt_inspect, METH_O),
    M("committed", bt_committed, METH_O),
    M("rescale_access", bt_rescale_access, METH_O),
    M("find_keys", bt_find_keys, METH_VARARGS),
    M("match_keys", bt_match_keys, METH_VARARGS),
    M("entries", bt_entries, METH_VARARGS | METH_KEYWORDS),
    M("extents", bt_extents, METH_NOARGS),
    M("check", bt_check, METH_NOARGS),
    M("check_rows", bt_check_rows, METH_O),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef bt_getset[] = {
    {"native_bytes", (getter)bt_get_native_bytes, NULL,
     "Bytes of native memory the table holds (records, extents, its object).", NULL},
    {"block_bytes", (getter)bt_get_block_bytes, NULL, "The namespace's block size.", NULL},
    {"slot_bytes", (getter)bt_get_slot_bytes, NULL, "Bytes between two slots' data.", NULL},
    {"n_slots", (getter)bt_get_n_slots, NULL,
     "Slots of all the table's extents (counts()['slots'] without the dict).", NULL},
    {"n_free", (getter)bt_get_n_free, NULL,
     "FREE slots of all the table's extents (counts()['free'] without the dict).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(bt_doc,
"BlockTable(block_bytes, slot_bytes, seed=0)\n--\n\n"
"One namespace's DRAM blocks: 12 bytes of native state per slot over the\n"
"extents' persisted slot tables, changed by batched calls (csrc/blocks.c;\n"
"use it through kvtierd.block_table).  seed seeds the eviction sampler.");

static PyType_Slot bt_slots[] = {
    {Py_tp_new, bt_new},
    {Py_tp_init, bt_init},
    {Py_tp_dealloc, bt_dealloc},
    {Py_tp_methods, bt_methods},
    {Py_tp_getset, bt_getset},
    {Py_tp_doc, (void *)bt_doc},
    {0, NULL},
};

static PyType_Spec bt_spec = {
    .name = "kvtier._native.BlockTable",
    .basicsize = sizeof(BlockTable),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = bt_slots,
};

/* slot_usage(table): one pass over a previous run's slot table, read only (recovery's
 * _usage: which extents to adopt first, and the access the CLOCK bits start from). */
const char kvt_slot_usage_doc[] =
"slot_usage($module, table, /)\n--\n\n"
"One pass over a slot table (whole entries of LAYOUT['SLOT_BYTES']): the\n"
"COMMITTED entries whose last access is in bounds (< max_access_seq), as\n"
"(count, newest last access or 0, their last accesses: bytes of u64 in slot\n"
"order).  Nothing is validated but the state byte and that bound (adopt() does\n"
"the rest) and nothing is written.  The GIL is released during the pass.\n"
"ValueError when the buffer is not whole entries.";

PyObject *
kvt_py_slot_usage(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *ret = NULL;
    if (b.len % KVT_SLOT_BYTES != 0) {
        PyErr_Format(PyExc_ValueError, "a slot table is whole %d-byte entries, got %zd bytes",
                     KVT_SLOT_BYTES, b.len);
        PyBuffer_Release(&b);
        return NULL;
    }
    size_t n = (size_t)b.len / KVT_SLOT_BYTES, count = 0;
    uint64_t newest = 0;
    uint64_t *lasts = PyMem_RawMalloc((n ? n : 1) * sizeof *lasts);
    if (lasts == NULL) {
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    const uint8_t *tab = (const uint8_t *)b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (size_t s = 0; s < n; s++) {
        const uint8_t *p = tab + s * KVT_SLOT_BYTES;
        if (p[KVT_SLOT_STATE] != KVT_ST_COMMITTED)
            continue;
        uint64_t last = ld64(p + KVT_SLOT_LAST_ACCESS);
        if (last >= KVT_MAX_ACCESS_SEQ)
            continue;
        lasts[count++] = last;
        if (last > newest)
            newest = last;
    }
    Py_END_ALLOW_THREADS
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)lasts,
                                                (Py_ssize_t)(count * sizeof *lasts));
    if (bytes != NULL)
        ret = Py_BuildValue("(nKN)", (Py_ssize_t)count, (unsigned long long)newest, bytes);
    PyMem_RawFree(lasts);
    PyBuffer_Release(&b);
    return ret;
}

int
kvt_blocks_init(PyObject *module)
{
    PyObject *type, *layout;

    type = PyType_FromModuleAndSpec(module, &bt_spec, NULL);
    if (type == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, "BlockTable", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    Py_DECREF(type);
    /* The slot entry's layout is csrc/layout.h's (LAYOUT, FIELDS: csrc/layout.c); these
     * are the table's own. */
    layout = Py_BuildValue("{sisisisisisisi}", "record_bytes", (int)sizeof(kvt_rec),
                           "scan_base", KVT_SCAN_BASE,
                           "policy_lru", KVT_POLICY_LRU, "policy_clock", KVT_POLICY_CLOCK,
                           "lower_dirty", KVT_LOWER_DIRTY, "lower_clean", KVT_LOWER_CLEAN,
                           "lower_unspillable", KVT_LOWER_UNSPILLABLE);
    if (layout == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, "BLOCK_TABLE", layout) < 0) {
        Py_DECREF(layout);
        return -1;
    }
    Py_DECREF(layout);
    return 0;
}
