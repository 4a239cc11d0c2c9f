/*
 * The shared index: a namespace's DRAM keys in one flat hash table that the
 * daemon writes and its clients read, without asking the daemon
 * (daemon/kvtierd/shared_index.py owns the file; client/kvtier/_core.py reads it).
 *
 *   index_format(buf, capacity, seed, max_probe=1024)  lay out an empty table in zeroed buf
 *   index_set(buf, key, tier, ref, loc=None)  insert or update: 1, 0 (probe limit), -1 (full)
 *   index_set_many(buf, keys, tier, start, locs=None)  index_set of keys[start:] (ref 0)
 *                                           until one finds the table full: (stopped at, skipped)
 *   index_remove(buf, key)                  True if the key was there
 *   index_remove_many(buf, keys)            1 per key that was there (bytes)
 *   index_get(buf, key)                     (tier, ref) or None
 *   index_locate(buf, key)                  (segment, slot, offset, length, checksum) or None
 *   index_present_many(buf, keys)           1 per key the table holds, else 0 (bytes; a reader's)
 *   index_lookup(buf, keys, stats=None)     (tiers of the leading hits, final) or None
 *   index_acquire(buf, keys, page, at)      lease the leading hits without a call, or None
 *   hazards_clear(page, at, n)              end such a lease
 *   hazards_collect(pages)                  the daemon's side: every hazard the pages hold
 *   index_copy(dst, src)                    put every live entry of src into dst
 *   index_info(buf)                         (capacity, live, used, flags)
 *   index_set_flags(buf, flags)             the header's flags word (SUPERSEDED, ...)
 *   index_fingerprint(key)                  the 17 bytes an entry stores for key
 *   index_fingerprints(buf)                 those of every live entry
 *   keys_check(keys, max_len, repeats=True) (first bad key, first repeated key), -1: none
 *
 * Layout (little-endian, fixed, version 2): a 64-byte header, then capacity
 * (a power of two) entries of 64 bytes (one cache line), linear probing from a
 * seeded XXH3-64 of the key's fingerprint.  An entry holds its fingerprint (the
 * key itself when it is 16 bytes, the BLAKE2b output block_keys makes; else
 * XXH3-128 of the key and a flag), the key's tier, a 64-bit reference the
 * daemon owns, and where the block is (segment, slot, offset, length,
 * checksum): what a client needs to lease it without a call.
 *
 * One writer (the daemon's event loop), any number of readers in other
 * processes, no locks: every entry carries a sequence number, odd while the
 * writer changes it (a seqlock), and a reader retries an entry whose number
 * moved.  Readers map the file read-only (the daemon seals it against writable
 * mappings and resizing), so nothing a client does reaches the daemon's copy.
 * A table is never resized in place: the daemon builds a new one, sets
 * SUPERSEDED here, and from then on changes only the new one; a reader checks
 * the flag after its reads, so a lookup never answers from a table that a
 * later change skipped.
 *
 * Bounded work on both sides: at most max_probe (1024) entries per key (a writer that
 * chose keys colliding on purpose only fills its own namespace's table, and a
 * key past the limit stays out of it: the daemon then sets MISS_NOT_FINAL and
 * readers ask it about misses), and at most SPIN_LIMIT retries of a busy entry.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "blocks.h"
#include "index.h"

#define IDX_MAGIC 0x31305844495456ULL /* "VTIDX01" */
#define IDX_VERSION 2u
#define SPIN_LIMIT 10000
#define MAX_KEY 64

enum { E_EMPTY = 0, E_LIVE = 1, E_TOMB = 2 };
enum { F_HASHED = 1 };

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t entry_bytes;
    uint64_t capacity;
    uint64_t seed;
    uint64_t live;  /* live entries */
    uint64_t used;  /* live + tombstones */
    uint32_t flags; /* KVT_IDX_SUPERSEDED | KVT_IDX_MISS_NOT_FINAL */
    uint32_t max_probe;
    uint64_t reserved;
} idx_header;

typedef struct {
    uint32_t seq;
    uint8_t state;
    uint8_t tier;
    uint8_t flags;   /* the fingerprint's: F_HASHED */
    uint8_t has_sum; /* checksum holds the writer's XXH3-64 */
    uint64_t fp0;
    uint64_t fp1;
    uint64_t ref;
    /* Where the block's bytes are: what a reader needs to lease it without a call. */
    uint32_t segment;
    uint32_t slot;
    uint64_t offset;
    uint64_t length;
    uint64_t checksum;
} idx_entry;

/* A block's location as the writer gives it (segment 0: none, a key-only entry). */
typedef struct {
    uint32_t segment, slot;
    uint64_t offset, length, checksum;
    int has_checksum;
} location;

_Static_assert(sizeof(idx_header) == KVT_IDX_HEADER_BYTES, "header is 64 bytes");
_Static_assert(sizeof(idx_entry) == KVT_IDX_ENTRY_BYTES, "entry is 64 bytes");

typedef struct {
    uint64_t fp0, fp1;
    uint8_t flags;
} fingerprint;

typedef struct {
    idx_header *h;
    idx_entry *e;
    uint64_t mask;
    uint64_t seed;
    uint32_t max_probe;
} table;

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static fingerprint
fp_of(const uint8_t *key, size_t n)
{
    fingerprint f;
    if (n == 16) {
        memcpy(&f.fp0, key, 8);
        memcpy(&f.fp1, key + 8, 8);
        f.flags = 0;
    } else {
        XXH128_hash_t x = XXH3_128bits(key, n);
        f.fp0 = x.low64;
        f.fp1 = x.high64;
        f.flags = F_HASHED;
    }
    return f;
}

static inline uint64_t
home(const table *t, const fingerprint *f)
{
    uint64_t v[2] = {f->fp0, f->fp1};
    return XXH3_64bits_withSeed(v, sizeof v, t->seed) & t->mask;
}

/* 0 with *t filled, or -1 with a Python error set. */
static int
open_table(Py_buffer *buf, table *t)
{
    if (buf->len < (Py_ssize_t)KVT_IDX_HEADER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "index buffer is shorter than its header");
        return -1;
    }
    idx_header *h = (idx_header *)buf->buf;
    uint64_t cap = h->capacity;
    if (h->magic != IDX_MAGIC || h->version != IDX_VERSION || h->entry_bytes != KVT_IDX_ENTRY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "index buffer does not hold a version-2 index");
        return -1;
    }
    if (cap == 0 || (cap & (cap - 1)) != 0 || cap > ((uint64_t)1 << 40)
        || (uint64_t)buf->len < KVT_IDX_HEADER_BYTES + cap * KVT_IDX_ENTRY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "index capacity does not match its buffer");
        return -1;
    }
    t->h = h;
    t->e = (idx_entry *)((char *)buf->buf + KVT_IDX_HEADER_BYTES);
    t->mask = cap - 1;
    t->seed = h->seed;
    t->max_probe = h->max_probe == 0 || h->max_probe > cap ? (uint32_t)(cap < KVT_IDX_MAX_PROBE ? cap : KVT_IDX_MAX_PROBE)
                                                          : h->max_probe;
    return 0;
}

/* ---------------------------------------------------------------- writer */
static const location NO_LOCATION = {0, 0, 0, 0, 0, 0};

static inline void
entry_write(idx_entry *e, uint8_t state, uint8_t tier, const fingerprint *f, uint64_t ref,
            const location *loc)
{
    uint32_t s = __atomic_load_n(&e->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&e->seq, s + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&e->state, state, __ATOMIC_RELAXED);
    __atomic_store_n(&e->tier, tier, __ATOMIC_RELAXED);
    if (f != NULL) {
        __atomic_store_n(&e->flags, f->flags, __ATOMIC_RELAXED);
        __atomic_store_n(&e->fp0, f->fp0, __ATOMIC_RELAXED);
        __atomic_store_n(&e->fp1, f->fp1, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&e->ref, ref, __ATOMIC_RELAXED);
    __atomic_store_n(&e->segment, loc->segment, __ATOMIC_RELAXED);
    __atomic_store_n(&e->slot, loc->slot, __ATOMIC_RELAXED);
    __atomic_store_n(&e->offset, loc->offset, __ATOMIC_RELAXED);
    __atomic_store_n(&e->length, loc->length, __ATOMIC_RELAXED);
    __atomic_store_n(&e->checksum, loc->checksum, __ATOMIC_RELAXED);
    __atomic_store_n(&e->has_sum, (uint8_t)(loc->has_checksum != 0), __ATOMIC_RELAXED);
    __atomic_store_n(&e->seq, s + 2, __ATOMIC_RELEASE);
}

static inline int
same(const idx_entry *e, const fingerprint *f)
{
    return e->fp0 == f->fp0 && e->fp1 == f->fp1 && e->flags == f->flags;
}

/* The writer's own probe (no retries: only it changes entries) from entry i (the
 * key's home: w_find; a batch computes the homes first).  Returns the entry holding
 * f, or NULL; *slot gets the first reusable entry on the way (a tombstone, else the
 * empty entry that ended the probe), or NULL. */
static idx_entry *
w_find_from(const table *t, const fingerprint *f, uint64_t i, idx_entry **slot)
{
    idx_entry *reuse = NULL;
    for (uint32_t p = 0; p < t->max_probe; p++, i = (i + 1) & t->mask) {
        idx_entry *e = &t->e[i];
        if (e->state == E_EMPTY) {
            if (reuse == NULL)
                reuse = e;
            break;
        }
        if (e->state == E_LIVE && same(e, f)) {
            *slot = reuse;
            return e;
        }
        if (e->state == E_TOMB && reuse == NULL)
            reuse = e;
    }
    *slot = reuse;
    return NULL;
}

static inline idx_entry *
w_find(const table *t, const fingerprint *f, idx_entry **slot)
{
    return w_find_from(t, f, home(t, f), slot);
}

/* t_set of a key its probe just found absent, into the probe's reusable entry (slot):
 * 1 stored, 0 past the probe limit (no slot), -1 the table is 3/4 full. */
static int
t_set_new(table *t, idx_entry *slot, const fingerprint *f, uint8_t tier, uint64_t ref,
          const location *loc)
{
    if (slot == NULL)
        return 0;
    if (slot->state == E_EMPTY) {
        if ((t->h->used + 1) * 4 > (t->mask + 1) * 3)
            return -1;
        t->h->used++;
    }
    entry_write(slot, E_LIVE, tier, f, ref, loc);
    t->h->live++;
    return 1;
}

/* Set f's entry, probing from its home entry h: 1 stored, 0 past the probe limit, -1
 * the table is 3/4 full. */
static int
t_set_from(table *t, const fingerprint *f, uint64_t h, uint8_t tier, uint64_t ref,
           const location *loc)
{
    idx_entry *slot;
    idx_entry *e = w_find_from(t, f, h, &slot);
    if (e != NULL) {
        entry_write(e, E_LIVE, tier, f, ref, loc);
        return 1;
    }
    return t_set_new(t, slot, f, tier, ref, loc);
}

static inline int
t_set(table *t, const fingerprint *f, uint8_t tier, uint64_t ref, const location *loc)
{
    return t_set_from(t, f, home(t, f), tier, ref, loc);
}

/* ---------------------------------------------------------------- reader */
enum { R_MISS = 0, R_HIT = 1, R_UNSURE = 2 };

/* What a reader saw of an entry, all of it from one unchanged sequence number. */
typedef struct {
    const idx_entry *e;
    uint32_t seq;
    uint8_t tier;
    location loc;
} snapshot;

/* Probe for f, from its home entry i, in a table another process changes; *out on a
 * hit. */
static int
r_find_from(const table *t, const fingerprint *f, uint64_t i, snapshot *out)
{
    for (uint32_t p = 0; p < t->max_probe; p++, i = (i + 1) & t->mask) {
        const idx_entry *e = &t->e[i];
        uint8_t state, fl;
        uint64_t a, b;
        uint32_t s1;
        int spins = 0;
        for (;;) {
            s1 = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);
            if ((s1 & 1) == 0) {
                state = __atomic_load_n(&e->state, __ATOMIC_RELAXED);
                out->tier = __atomic_load_n(&e->tier, __ATOMIC_RELAXED);
                fl = __atomic_load_n(&e->flags, __ATOMIC_RELAXED);
                a = __atomic_load_n(&e->fp0, __ATOMIC_RELAXED);
                b = __atomic_load_n(&e->fp1, __ATOMIC_RELAXED);
                out->loc.segment = __atomic_load_n(&e->segment, __ATOMIC_RELAXED);
                out->loc.slot = __atomic_load_n(&e->slot, __ATOMIC_RELAXED);
                out->loc.offset = __atomic_load_n(&e->offset, __ATOMIC_RELAXED);
                out->loc.length = __atomic_load_n(&e->length, __ATOMIC_RELAXED);
                out->loc.checksum = __atomic_load_n(&e->checksum, __ATOMIC_RELAXED);
                out->loc.has_checksum = __atomic_load_n(&e->has_sum, __ATOMIC_RELAXED);
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (__atomic_load_n(&e->seq, __ATOMIC_RELAXED) == s1)
                    break;
            }
            if (++spins > SPIN_LIMIT)
                return R_UNSURE;
            cpu_relax();
        }
        if (state == E_EMPTY)
            return R_MISS;
        if (state == E_LIVE && a == f->fp0 && b == f->fp1 && fl == f->flags) {
            out->e = e;
            out->seq = s1;
            return R_HIT;
        }
    }
    return R_UNSURE;
}

/* ---------------------------------------------------------------- bindings */
/* Keys a batch lookup hashes (and prefetches the home entry of) ahead of its probe: a
 * big table misses the cache (and the TLB) on every key, and the misses of independent
 * keys overlap.  (A prefix lookup stops at its first miss: the hashes past it are the
 * only waste.) */
#define LOOKUP_AHEAD 16

/* The keys (bytes objects, checked) of a batch lookup, hashed LOOKUP_AHEAD ahead. */
typedef struct {
    const table *t;
    PyObject **keys;
    Py_ssize_t n;
    fingerprint f[LOOKUP_AHEAD];
    uint64_t h[LOOKUP_AHEAD];
} lookahead;

static inline void
lookahead_hash(lookahead *a, Py_ssize_t i)
{
    int at = (int)(i % LOOKUP_AHEAD);
    PyObject *key = a->keys[i];
    a->f[at] = fp_of((const uint8_t *)PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
    a->h[at] = home(a->t, &a->f[at]);
    __builtin_prefetch(&a->t->e[a->h[at]], 0, 3);
}

static void
lookahead_start(lookahead *a, const table *t, PyObject **keys, Py_ssize_t n)
{
    a->t = t;
    a->keys = keys;
    a->n = n;
    for (Py_ssize_t i = 0; i < n && i < LOOKUP_AHEAD; i++)
        lookahead_hash(a, i);
}

/* Key i's fingerprint (*f) and home entry (returned), in order: key i + LOOKUP_AHEAD
 * is hashed and prefetched meanwhile. */
static inline uint64_t
lookahead_next(lookahead *a, Py_ssize_t i, fingerprint *f)
{
    int at = (int)(i % LOOKUP_AHEAD);
    uint64_t h = a->h[at];
    *f = a->f[at];
    if (i + LOOKUP_AHEAD < a->n)
        lookahead_hash(a, i + LOOKUP_AHEAD);
    return h;
}

/* The index of the first of keys[0..n) that is not bytes of 1..MAX_KEY bytes, or -1: the
 * batch lookups check every key before their look-ahead reads them raw. */
static Py_ssize_t
first_bad_key(PyObject *const *keys, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = keys[i];
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) < 1 || PyBytes_GET_SIZE(k) > MAX_KEY)
            return i;
    }
    return -1;
}

static int
get_key(PyObject *obj, Py_buffer *key)
{
    if (PyObject_GetBuffer(obj, key, PyBUF_SIMPLE) < 0)
        return -1;
    if (key->len < 1 || key->len > MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "key is %zd bytes (1..%d allowed)", key->len, MAX_KEY);
        PyBuffer_Release(key);
        return -1;
    }
    return 0;
}

/* The fingerprint of key object obj: 0, or -1 with a Python error set. */
static int
key_fp(PyObject *obj, fingerprint *f)
{
    Py_buffer key;
    if (get_key(obj, &key) < 0)
        return -1;
    *f = fp_of(key.buf, (size_t)key.len);
    PyBuffer_Release(&key);
    return 0;
}

/* loc: None (no location) or (segment, slot, offset, length, checksum or None). */
static int
get_location(PyObject *obj, location *loc)
{
    *loc = NO_LOCATION;
    if (obj == Py_None)
        return 0;
    PyObject *sum = Py_None;
    unsigned int segment, slot;
    unsigned long long offset, length;
    if (!PyTuple_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "a location is (segment, slot, offset, length, checksum)");
        return -1;
    }
    if (!PyArg_ParseTuple(obj, "IIKKO:location", &segment, &slot, &offset, &length, &sum))
        return -1;
    loc->segment = segment;
    loc->slot = slot;
    loc->offset = offset;
    loc->length = length;
    if (sum != Py_None) {
        loc->checksum = PyLong_AsUnsignedLongLong(sum);
        if (loc->checksum == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        loc->has_checksum = 1;
    }
    return 0;
}

PyObject *
kvt_py_index_format(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    unsigned long long cap, seed;
    unsigned int max_probe = KVT_IDX_MAX_PROBE;
    if (!PyArg_ParseTuple(args, "w*KK|I:index_format", &buf, &cap, &seed, &max_probe))
        return NULL;
    PyObject *ret = NULL;
    if (cap < 8 || (cap & (cap - 1)) != 0 || cap > ((uint64_t)1 << 40)) {
        PyErr_Format(PyExc_ValueError, "capacity %llu is not a power of two in 8..2**40", cap);
    } else if ((uint64_t)buf.len < KVT_IDX_HEADER_BYTES + cap * KVT_IDX_ENTRY_BYTES) {
        PyErr_Format(PyExc_ValueError, "a table of %llu entries needs %llu bytes, buffer has %zd",
                     cap, (unsigned long long)(KVT_IDX_HEADER_BYTES + cap * KVT_IDX_ENTRY_BYTES), buf.len);
    } else {
        idx_header *h = (idx_header *)buf.buf;
        memset(h, 0, KVT_IDX_HEADER_BYTES);
        h->version = IDX_VERSION;
        h->entry_bytes = KVT_IDX_ENTRY_BYTES;
        h->capacity = cap;
        h->seed = seed;
        if (max_probe == 0 || max_probe > KVT_IDX_MAX_PROBE)
            max_probe = KVT_IDX_MAX_PROBE;
        h->max_probe = (uint32_t)(cap < max_probe ? cap : max_probe);
        __atomic_store_n(&h->magic, IDX_MAGIC, __ATOMIC_RELEASE);
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&buf);
    return ret;
}

PyObject *
kvt_py_index_set(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    PyObject *key_obj, *loc_obj = Py_None;
    unsigned int tier;
    unsigned long long ref;
    fingerprint f;
    if (!PyArg_ParseTuple(args, "w*OIK|O:index_set", &buf, &key_obj, &tier, &ref, &loc_obj))
        return NULL;
    PyObject *ret = NULL;
    table t;
    location loc;
    if (open_table(&buf, &t) == 0 && get_location(loc_obj, &loc) == 0) {
        if (tier > 255) {
            PyErr_SetString(PyExc_ValueError, "tier must be 0..255");
        } else if (key_fp(key_obj, &f) == 0) {
            ret = PyLong_FromLong(t_set(&t, &f, (uint8_t)tier, ref, &loc));
        }
    }
    PyBuffer_Release(&buf);
    return ret;
}

PyObject *
kvt_py_index_set_many(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    PyObject *keys, *locs = Py_None;
    unsigned int tier;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "w*OIn|O:index_set_many", &buf, &keys, &tier, &start, &locs))
        return NULL;
    PyObject *ret = NULL, *seq = NULL, *skipped = NULL, *lseq = NULL;
    table t;
    if (open_table(&buf, &t) < 0)
        goto done;
    if (tier > 255) {
        PyErr_SetString(PyExc_ValueError, "tier must be 0..255");
        goto done;
    }
    seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (seq == NULL || (skipped = PyList_New(0)) == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = start < 0 ? 0 : start;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (locs != Py_None) {
        lseq = PySequence_Fast(locs, "locs must be a sequence of locations");
        if (lseq == NULL)
            goto done;
        if (PySequence_Fast_GET_SIZE(lseq) != n) {
            PyErr_SetString(PyExc_ValueError, "keys and locs differ in length");
            goto done;
        }
    }
    for (; i < n; i++) {
        location loc;
        if (get_location(lseq == NULL ? Py_None : PySequence_Fast_GET_ITEM(lseq, i), &loc) < 0)
            goto done;
        fingerprint f;
        if (key_fp(items[i], &f) < 0)
            goto done;
        int r = t_set(&t, &f, (uint8_t)tier, 0, &loc);
        if (r < 0)
            break;
        if (r == 0) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL || PyList_Append(skipped, at) < 0) {
                Py_XDECREF(at);
                goto done;
            }
            Py_DECREF(at);
        }
    }
    ret = Py_BuildValue("(nO)", i, skipped);
done:
    Py_XDECREF(lseq);
    Py_XDECREF(skipped);
    Py_XDECREF(seq);
    PyBuffer_Release(&buf);
    return ret;
}

/* Take e out of the table: a tombstone, unless the entry after it is empty.  Then no
 * probe runs through e (a key's probe from its home meets no empty entry before the
 * key), so e is emptied, and so are the tombstones just before it (their successor is
 * now empty), one at a time: a reader between two of these writes finds what it would
 * have found before them.  Without this, a pool that evicts as it commits filled its
 * table with tombstones and rebuilt it every few batches.  (Only the daemon writes; a
 * reader that meets an entry mid-write retries it: entry_write's seq.) */
static void
remove_entry(table *t, idx_entry *e)
{
    uint64_t i = (uint64_t)(e - t->e);
    t->h->live--;
    if (__atomic_load_n(&t->e[(i + 1) & t->mask].state, __ATOMIC_RELAXED) != E_EMPTY) {
        entry_write(e, E_TOMB, 0, NULL, 0, &NO_LOCATION);
        return;
    }
    entry_write(e, E_EMPTY, 0, NULL, 0, &NO_LOCATION);
    t->h->used--;
    for (uint64_t j = (i - 1) & t->mask; j != i; j = (j - 1) & t->mask) {
        idx_entry *p = &t->e[j];
        if (__atomic_load_n(&p->state, __ATOMIC_RELAXED) != E_TOMB)
            break;
        entry_write(p, E_EMPTY, 0, NULL, 0, &NO_LOCATION);
        t->h->used--;
    }
}

/* Open the table in buf and find key_obj's entry the writer's way (*e: NULL when
 * absent): 0, or -1 with a Python error set. */
static int
find_entry(Py_buffer *buf, PyObject *key_obj, table *t, idx_entry **e)
{
    fingerprint f;
    if (open_table(buf, t) < 0 || key_fp(key_obj, &f) < 0)
        return -1;
    idx_entry *slot;
    *e = w_find(t, &f, &slot);
    return 0;
}

PyObject *
kvt_py_index_remove(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    PyObject *key_obj;
    if (!PyArg_ParseTuple(args, "w*O:index_remove", &buf, &key_obj))
        return NULL;
    PyObject *ret = NULL;
    table t;
    idx_entry *e;
    if (find_entry(&buf, key_obj, &t, &e) == 0) {
        if (e != NULL)
            remove_entry(&t, e);
        ret = PyBool_FromLong(e != NULL);
    }
    PyBuffer_Release(&buf);
    return ret;
}

PyObject *
kvt_py_index_remove_many(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    PyObject *keys_obj, *seq = NULL, *ret = NULL;
    if (!PyArg_ParseTuple(args, "w*O:index_remove_many", &buf, &keys_obj))
        return NULL;
    table t;
    if (open_table(&buf, &t) < 0)
        goto done;
    seq = PySequence_Fast(keys_obj, "keys must be a sequence of bytes");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL)
        goto done;
    char *hit = PyBytes_AS_STRING(out);
    /* Hashed and prefetched a group at a time, as index_find_many: an eviction's keys
     * are scattered over the table, and one cache miss each was most of its removal. */
    fingerprint fs[LOOKUP_AHEAD];
    uint64_t hs[LOOKUP_AHEAD];
    for (Py_ssize_t i = 0; i < n; i += LOOKUP_AHEAD) {
        int m = n - i < LOOKUP_AHEAD ? (int)(n - i) : LOOKUP_AHEAD, bad = 0;
        for (int k = 0; k < m; k++) {
            if (key_fp(items[i + k], &fs[k]) < 0) {
                m = k; /* the keys before it are removed, as one by one */
                bad = 1;
                break;
            }
            hs[k] = home(&t, &fs[k]);
            __builtin_prefetch(&t.e[hs[k]], 1, 3);
        }
        for (int k = 0; k < m; k++) {
            idx_entry *slot;
            idx_entry *e = w_find_from(&t, &fs[k], hs[k], &slot);
            if (e != NULL)
                remove_entry(&t, e);
            hit[i + k] = (char)(e != NULL);
        }
        if (bad) {
            Py_DECREF(out);
            goto done;
        }
    }
    ret = out;
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&buf);
    return ret;
}

PyObject *
kvt_py_index_get(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    PyObject *key_obj;
    if (!PyArg_ParseTuple(args, "y*O:index_get", &buf, &key_obj))
        return NULL;
    PyObject *ret = NULL;
    table t;
    idx_entry *e;
    if (find_entry(&buf, key_obj, &t, &e) == 0)
        ret = e == NULL ? Py_NewRef(Py_None)
                        : Py_BuildValue("(IK)", (unsigned)e->tier, (unsigned long long)e->ref);
    PyBuffer_Release(&buf);
    return ret;
}

static PyObject *
location_tuple(const location *loc, int with_slot)
{
    if (!with_slot) /* a reader's: (segment, offset, length, checksum, has_checksum) */
        return Py_BuildValue("(IKKKO)", (unsigned)loc->segment, (unsigned long long)loc->offset,
                             (unsigned long long)loc->length, (unsigned long long)loc->checksum,
                             loc->has_checksum ? Py_True : Py_False);
    /* the writer's, as it gave it: (segment, slot, offset, length, checksum or None) */
    PyObject *sum = loc->has_checksum ? PyLong_FromUnsignedLongLong(loc->checksum)
                                      : Py_NewRef(Py_None);
    if (sum == NULL)
        return NULL;
    return Py_BuildValue("(IIKKN)", (unsigned)loc->segment, (unsigned)loc->slot,
                         (unsigned long long)loc->offset, (unsigned long long)loc->length, sum);
}

PyObject *
kvt_py_index_locate(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    PyObject *key_obj;
    if (!PyArg_ParseTuple(args, "y*O:index_locate", &buf, &key_obj))
        return NULL;
    PyObject *ret = NULL;
    table t;
    idx_entry *e;
    if (find_entry(&buf, key_obj, &t, &e) == 0) {
        if (e == NULL) {
            ret = Py_NewRef(Py_None);
        } else {
            location loc = {e->segment, e->slot, e->offset, e->length, e->checksum, e->has_sum};
            ret = location_tuple(&loc, 1);
        }
    }
    PyBuffer_Release(&buf);
    return ret;
}

/* Keys hashed and their home entries prefetched this many ahead of their insert: the
 * inserts then find their cache lines (a table of millions of entries misses on each). */
#define SET_SLOTS_BATCH 16

typedef struct {
    table t;
    const uint8_t *tab;
    const uint64_t *slots;
    uint32_t segment;
    uint64_t slot_bytes;
    const uint64_t *homes; /* each slot's home entry, or NULL: computed here */
    const uint32_t *idx;   /* the slots to insert: slots[idx[k]], or NULL: slots[from + k] */
    Py_ssize_t from, m;    /* k in [0, m) */
    Py_ssize_t k;          /* in: the first k; out: where it stopped (m: all done) */
    Py_ssize_t *left;      /* indices into slots left out (room for m) */
    Py_ssize_t n_left;
} set_slots_job;

static inline Py_ssize_t
set_slots_pick(const set_slots_job *j, Py_ssize_t k)
{
    return j->idx != NULL ? (Py_ssize_t)j->idx[k] : j->from + k;
}

static inline void
set_slots_ahead(const set_slots_job *j, Py_ssize_t k, fingerprint *f, uint64_t *h)
{
    Py_ssize_t i = set_slots_pick(j, k);
    const uint8_t *p = j->tab + j->slots[i] * KVT_SLOT_BYTES;
    *f = fp_of(p + KVT_SLOT_KEY, p[KVT_SLOT_KEY_LEN]);
    *h = j->homes != NULL ? j->homes[i] : home(&j->t, f);
    __builtin_prefetch(&j->t.e[*h], 1, 3);
}

static void
set_slots_run(set_slots_job *j)
{
    fingerprint f[SET_SLOTS_BATCH];
    uint64_t h[SET_SLOTS_BATCH];
    for (Py_ssize_t k = j->k; k < j->m && k < j->k + SET_SLOTS_BATCH; k++)
        set_slots_ahead(j, k, &f[k % SET_SLOTS_BATCH], &h[k % SET_SLOTS_BATCH]);
    for (Py_ssize_t k = j->k; k < j->m; k++) {
        int at = (int)(k % SET_SLOTS_BATCH);
        fingerprint fi = f[at];
        uint64_t hi = h[at];
        if (k + SET_SLOTS_BATCH < j->m)
            set_slots_ahead(j, k + SET_SLOTS_BATCH, &f[at], &h[at]);
        Py_ssize_t i = set_slots_pick(j, k);
        uint64_t s = j->slots[i];
        const uint8_t *p = j->tab + s * KVT_SLOT_BYTES;
        idx_entry *reuse;
        int r = 0; /* present: the caller's to decide */
        if (w_find_from(&j->t, &fi, hi, &reuse) == NULL) {
            uint64_t length, checksum;
            memcpy(&length, p + KVT_SLOT_LENGTH, 8);
            memcpy(&checksum, p + KVT_SLOT_CHECKSUM, 8);
            int has = (p[KVT_SLOT_FLAGS] & KVT_SLOT_HAS_CHECKSUM) != 0;
            location loc = {j->segment, (uint32_t)s, s * j->slot_bytes, length,
                            has ? checksum : 0, has};
            r = t_set_new(&j->t, reuse, &fi, 1, 0, &loc); /* (the probe just made) */
            if (r < 0) {
                j->k = k; /* 3/4 full: grow, then call again from here */
                return;
            }
        }
        if (r == 0)
            j->left[j->n_left++] = i;
    }
    j->k = j->m;
}

/* kvt_index_put_slots (csrc/index.h): a commit's keys published by the block table in
 * the same call that committed them (BlockTable.commit's index), read from the slot
 * entries it just wrote: index_set_slots without its Python steps.  The caller checked
 * the slots (COMMITTED, key length: it wrote them).  Returns how many of slots went in
 * order (n, or where the table reached 3/4 full: the caller grows it and goes on), -1
 * with a Python error when buf holds no index; left (room for n) gets the indices of
 * keys the table held already or past the probe limit. */
Py_ssize_t
kvt_index_put_slots(Py_buffer *buf, const uint8_t *tab, const uint64_t *slots, Py_ssize_t n,
                    uint32_t segment, uint64_t slot_bytes, Py_ssize_t *left, Py_ssize_t *n_left)
{
    set_slots_job j;
    memset(&j, 0, sizeof j);
    if (open_table(buf, &j.t) < 0)
        return -1;
    j.m = n;
    j.slots = slots;
    j.tab = tab;
    j.segment = segment;
    j.slot_bytes = slot_bytes;
    j.left = left;
    set_slots_run(&j);
    *n_left = j.n_left;
    return j.k;
}

/* Adoption's inserts on several threads (index_set_slots with threads > 1).  Each
 * thread owns a contiguous range of the table's entries and inserts the keys whose
 * home lies in it at least max_probe entries before its end: a probe never goes past
 * max_probe entries, so it stays in the range -- no entry is written by two threads,
 * and no thread reads an entry another writes (the one-writer protocol holds per
 * entry; readers see each entry's seqlock as always).  The keys homed nearer a
 * range's end are inserted after, by the calling thread alone.  Each thread counts
 * what it adds in a header of its own, summed into the table's after.  Only used when
 * the table takes every key without growing (a stop half way would break "everything
 * before the index returned went in"). */
typedef struct {
    set_slots_job j;        /* its own keys: j.idx, j.m; j.t.h points to hdr */
    idx_header hdr;
    const set_slots_job *all;
    uint64_t *homes;        /* shared: phase 1 fills [from, to) */
    Py_ssize_t from, to;
    uint64_t lo, hi;        /* the table entries [lo, hi) are its own */
    int phase;
} par_slots_job;

static inline int
par_owns(uint64_t h, uint64_t lo, uint64_t hi, uint32_t max_probe)
{
    return h >= lo && h + max_probe <= hi;
}

static void *
par_slots_worker(void *arg)
{
    par_slots_job *p = arg;
    const set_slots_job *all = p->all;
    if (p->phase == 1) { /* the homes of a share of the slots */
        for (Py_ssize_t i = p->from; i < p->to; i++) {
            const uint8_t *e = all->tab + all->slots[i] * KVT_SLOT_BYTES;
            fingerprint f = fp_of(e + KVT_SLOT_KEY, e[KVT_SLOT_KEY_LEN]);
            p->homes[i] = home(&all->t, &f);
        }
        return NULL;
    }
    uint32_t *mine = (uint32_t *)p->j.idx; /* (allocated by the caller: room for all) */
    Py_ssize_t m = 0;
    for (Py_ssize_t i = all->from; i < all->from + all->m; i++) {
        if (par_owns(p->homes[i], p->lo, p->hi, all->t.max_probe))
            mine[m++] = (uint32_t)i;
    }
    p->j.m = m;
    set_slots_run(&p->j);
    return NULL;
}

static int
cmp_ssize(const void *a, const void *b)
{
    Py_ssize_t x = *(const Py_ssize_t *)a, y = *(const Py_ssize_t *)b;
    return (x > y) - (x < y);
}

#define PAR_SLOTS_MAX_THREADS 8
/* Fewer keys than this go in on one thread (two thread starts cost ~0.1 ms). */
#define PAR_SLOTS_MIN 16384

/* set_slots_run(j) on up to `threads` threads when the table has room for every key
 * (else, or for a small batch, on this one).  0, or -1: no memory (nothing changed). */
static int
set_slots_par(set_slots_job *j, int threads)
{
    uint64_t cap = j->t.mask + 1;
    Py_ssize_t n = j->m - j->k;
    if (threads > PAR_SLOTS_MAX_THREADS)
        threads = PAR_SLOTS_MAX_THREADS;
    if (threads < 2 || n < PAR_SLOTS_MIN || j->idx != NULL || j->homes != NULL
        || (uint64_t)(j->from + j->m) > UINT32_MAX
        || cap < (uint64_t)threads * 4 * j->t.max_probe
        || (j->t.h->used + (uint64_t)n) * 4 > cap * 3) {
        set_slots_run(j);
        return 0;
    }
    set_slots_job all = *j;
    all.from = j->from + j->k;
    all.m = n;
    all.k = 0;
    par_slots_job par[PAR_SLOTS_MAX_THREADS];
    uint64_t *homes = malloc((size_t)(j->from + j->m) * sizeof *homes);
    uint32_t *idx = malloc((size_t)threads * (size_t)n * sizeof *idx);
    Py_ssize_t *left = malloc((size_t)threads * (size_t)n * sizeof *left);
    uint32_t *rest = malloc((size_t)n * sizeof *rest);
    if (homes == NULL || idx == NULL || left == NULL || rest == NULL) {
        free(homes);
        free(idx);
        free(left);
        free(rest);
        return -1;
    }
    for (int q = 0; q < threads; q++) {
        par_slots_job *p = &par[q];
        memset(p, 0, sizeof *p);
        p->all = &all;
        p->homes = homes;
        p->from = all.from + n * q / threads;
        p->to = all.from + n * (q + 1) / threads;
        p->lo = cap * (uint64_t)q / (uint64_t)threads;
        p->hi = cap * (uint64_t)(q + 1) / (uint64_t)threads;
        p->hdr = *j->t.h;
        p->j = all;
        p->j.t.h = &p->hdr;
        p->j.homes = homes;
        p->j.idx = idx + (size_t)q * (size_t)n;
        p->j.left = left + (size_t)q * (size_t)n;
        p->j.n_left = 0;
        p->phase = 1;
    }
    kvt_run_jobs(par_slots_worker, par, sizeof par[0], threads);
    for (int q = 0; q < threads; q++)
        par[q].phase = 2;
    kvt_run_jobs(par_slots_worker, par, sizeof par[0], threads);
    /* Their counts into the table's, then the keys no thread owned, here. */
    uint64_t used = j->t.h->used, live = j->t.h->live;
    for (int q = 0; q < threads; q++) {
        j->t.h->used += par[q].hdr.used - used;
        j->t.h->live += par[q].hdr.live - live;
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = all.from; i < all.from + n; i++) {
        uint64_t h = homes[i];
        int q = 0;
        while (q + 1 < threads && h >= par[q].hi)
            q++;
        if (!par_owns(h, par[q].lo, par[q].hi, j->t.max_probe))
            rest[m++] = (uint32_t)i;
    }
    set_slots_job tail = all;
    tail.homes = homes;
    tail.idx = rest;
    tail.m = m;
    tail.left = j->left + j->n_left;
    tail.n_left = 0;
    set_slots_run(&tail); /* (room checked above: it cannot stop) */
    Py_ssize_t n_left = j->n_left + tail.n_left;
    for (int q = 0; q < threads; q++) {
        memcpy(j->left + n_left, par[q].j.left, (size_t)par[q].j.n_left * sizeof *left);
        n_left += par[q].j.n_left;
    }
    qsort(j->left + j->n_left, (size_t)(n_left - j->n_left), sizeof *left, cmp_ssize);
    j->n_left = n_left;
    j->k = j->m;
    free(homes);
    free(idx);
    free(left);
    free(rest);
    return 0;
}

/* index_set_slots(buf, table, slots, segment, slot_bytes, start, threads=1): the keys of COMMITTED
 * slot-table entries put in the table from the entries themselves (an adopted extent:
 * no Python object per key), each at (segment, slot, slot * slot_bytes, length,
 * checksum).  A key the table holds already is not changed: its index in slots goes to
 * the list returned (the caller decides which copy stays), and so does a key past the
 * probe limit (kept apart by the caller).  Stops when the table is 3/4 full: returns
 * (index stopped at, [indices left out]); the caller grows the table and goes on.
 * Every slot from start on is checked (in range, COMMITTED, key length) before the
 * table changes: ValueError names the first that is not, and nothing was written.
 * The GIL is released while the keys go in; with threads > 1 they go in on that many
 * threads (set_slots_par: a recovery's batch, when the table has room for them all --
 * which keys of a probe-limit pile-up stay out may then differ, nothing else). */
PyObject *
kvt_py_index_set_slots(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf, tab, sl;
    unsigned int segment;
    unsigned long long slot_bytes;
    Py_ssize_t start;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "w*y*y*IKn|i:index_set_slots", &buf, &tab, &sl, &segment,
                          &slot_bytes, &start, &threads))
        return NULL;
    PyObject *ret = NULL, *out = NULL;
    set_slots_job j;
    memset(&j, 0, sizeof j);
    j.m = sl.len / 8;
    j.k = start < 0 ? 0 : start;
    j.slots = (const uint64_t *)sl.buf;
    j.tab = (const uint8_t *)tab.buf;
    j.segment = segment;
    j.slot_bytes = slot_bytes;
    if (open_table(&buf, &j.t) < 0)
        goto done;
    if (sl.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "slots must be whole uint64s");
        goto done;
    }
    for (Py_ssize_t i = j.k; i < j.m; i++) {
        uint64_t s = j.slots[i];
        if (s >= (uint64_t)tab.len / KVT_SLOT_BYTES) {
            PyErr_Format(PyExc_ValueError, "slots[%zd] = %llu is past the slot table", i,
                         (unsigned long long)s);
            goto done;
        }
        const uint8_t *p = j.tab + s * KVT_SLOT_BYTES;
        uint8_t klen = p[KVT_SLOT_KEY_LEN];
        if (p[KVT_SLOT_STATE] != KVT_ST_COMMITTED || klen < 1 || klen > KVT_SLOT_MAX_KEY) {
            PyErr_Format(PyExc_ValueError, "slots[%zd] = %llu is no COMMITTED entry", i,
                         (unsigned long long)s);
            goto done;
        }
    }
    if (j.k < j.m) {
        j.left = PyMem_RawMalloc((size_t)(j.m - j.k) * sizeof *j.left);
        if (j.left == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if (j.m - j.k >= 512) {
        int no_memory;
        Py_BEGIN_ALLOW_THREADS
        no_memory = set_slots_par(&j, threads) < 0;
        Py_END_ALLOW_THREADS
        if (no_memory) {
            PyErr_NoMemory();
            goto done;
        }
    }
    else {
        set_slots_run(&j);
    }
    if ((out = PyList_New(j.n_left)) == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < j.n_left; k++) {
        PyObject *v = PyLong_FromSsize_t(j.left[k]);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(out, k, v);
    }
    ret = Py_BuildValue("(nO)", j.k, out);
done:
    PyMem_RawFree(j.left);
    Py_XDECREF(out);
    PyBuffer_Release(&sl);
    PyBuffer_Release(&tab);
    PyBuffer_Release(&buf);
    return ret;
}

/* index_find_many(buf, keys): the writer's batch lookup, for the daemon's own use of the
 * table as its key index: one u64 per key, segment << 32 | slot of its live
 * entry, or 0 (absent, or a key-only entry).  A fingerprint match, not a key match: the
 * caller checks hashed keys against the slot entry (BlockTable.match_keys). */
PyObject *
kvt_py_index_find_many(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*O:index_find_many", &buf, &keys))
        return NULL;
    PyObject *ret = NULL, *seq = NULL;
    table t;
    if (open_table(&buf, &t) < 0)
        goto done;
    seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    ret = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (ret == NULL)
        goto done;
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(ret);
    fingerprint fs[LOOKUP_AHEAD];
    uint64_t hs[LOOKUP_AHEAD];
    for (Py_ssize_t i = 0; i < n; i += LOOKUP_AHEAD) {
        int m = n - i < LOOKUP_AHEAD ? (int)(n - i) : LOOKUP_AHEAD;
        for (int k = 0; k < m; k++) { /* hashed and prefetched a group at a time */
            if (key_fp(items[i + k], &fs[k]) < 0) {
                Py_CLEAR(ret);
                goto done;
            }
            hs[k] = home(&t, &fs[k]);
            __builtin_prefetch(&t.e[hs[k]], 0, 3);
        }
        for (int k = 0; k < m; k++) {
            idx_entry *slot;
            const idx_entry *e = w_find_from(&t, &fs[k], hs[k], &slot);
            out[i + k] = e == NULL || e->segment == 0 ? 0 : KVT_REF(e->segment, e->slot);
        }
    }
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&buf);
    return ret;
}

/* Each of n keys (keys[i] of klens[i] bytes; NULL: none) found by the writer in the index
 * buf holds, LOOKUP_AHEAD at a time, hashed and their home entries prefetched first (a
 * batch's keys are scattered over the table, and one cache miss each was most of a
 * lookup): found(&t, i, its live entry or NULL, arg) for each key in order.  0, or -1
 * with a Python error when buf holds no index. */
typedef void (*found_fn)(table *t, Py_ssize_t i, idx_entry *e, void *arg);

static int
w_find_each(Py_buffer *buf, const uint8_t *const *keys, const uint8_t *klens, Py_ssize_t n,
            found_fn found, void *arg)
{
    table t;
    if (open_table(buf, &t) < 0)
        return -1;
    fingerprint fs[LOOKUP_AHEAD];
    uint64_t hs[LOOKUP_AHEAD];
    for (Py_ssize_t i = 0; i < n; i += LOOKUP_AHEAD) {
        int m = n - i < LOOKUP_AHEAD ? (int)(n - i) : LOOKUP_AHEAD;
        for (int k = 0; k < m; k++) {
            if (keys[i + k] == NULL)
                continue;
            fs[k] = fp_of(keys[i + k], klens[i + k]);
            hs[k] = home(&t, &fs[k]);
            __builtin_prefetch(&t.e[hs[k]], 1, 3);
        }
        for (int k = 0; k < m; k++) {
            idx_entry *slot;
            found(&t, i + k, keys[i + k] == NULL ? NULL : w_find_from(&t, &fs[k], hs[k], &slot),
                  arg);
        }
    }
    return 0;
}

static void
found_ref(table *Py_UNUSED(t), Py_ssize_t i, idx_entry *e, void *out)
{
    ((uint64_t *)out)[i] = e == NULL || e->segment == 0 ? 0 : KVT_REF(e->segment, e->slot);
}

int
kvt_index_find_rows(Py_buffer *buf, const uint8_t *const *keys, const uint8_t *klens,
                    Py_ssize_t n, uint64_t *out)
{
    return w_find_each(buf, keys, klens, n, found_ref, out);
}

typedef struct {
    const uint32_t *segments, *slots;
    uint8_t *hit;
} remove_at_job;

static void
found_remove(table *t, Py_ssize_t i, idx_entry *e, void *arg)
{
    remove_at_job *j = arg;
    j->hit[i] = e != NULL && e->segment == j->segments[i] && e->slot == j->slots[i];
    if (j->hit[i])
        remove_entry(t, e);
}

int
kvt_index_remove_at(Py_buffer *buf, const uint8_t *const *keys, const uint8_t *klens,
                    const uint32_t *segments, const uint32_t *slots, Py_ssize_t n, uint8_t *hit)
{
    remove_at_job j = {segments, slots, hit};
    return w_find_each(buf, keys, klens, n, found_remove, &j);
}

/* index_present_many(buf, keys): the reader's batch presence test, for a client that
 * reads the table while the daemon writes it (a reserve from grants marks the keys the
 * table holds EXISTS, as a Reserve call would): bytes, 1 per key the table holds now (a
 * live entry, key-only entries included), else 0.  Each entry is read under its seqlock
 * (r_find_from, as index_lookup), so a key the writer leaves alone is never missed nor
 * garbled; an entry that stays busy past the spin limit, a key past the probe limit or a
 * superseded table answer 0 (absent): the answer is a hint, and a key that is present
 * after all is EXISTS at commit instead.  Every key must be bytes of 1..64 bytes
 * (ValueError otherwise, nothing answered).  Keys are hashed and prefetched
 * LOOKUP_AHEAD ahead of their probe. */
PyObject *
kvt_py_index_present_many(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*O:index_present_many", &buf, &keys))
        return NULL;
    PyObject *ret = NULL, *seq = NULL;
    table t;
    if (open_table(&buf, &t) < 0)
        goto done;
    seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t bad = first_bad_key(items, n);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "keys[%zd] is not bytes of 1..%d bytes", bad, MAX_KEY);
        goto done;
    }
    ret = PyBytes_FromStringAndSize(NULL, n);
    if (ret == NULL)
        goto done;
    char *out = PyBytes_AS_STRING(ret);
    if (__atomic_load_n(&t.h->flags, __ATOMIC_ACQUIRE) & KVT_IDX_SUPERSEDED) {
        memset(out, 0, (size_t)n);
        goto done;
    }
    lookahead ahead;
    lookahead_start(&ahead, &t, items, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        fingerprint f;
        snapshot snap;
        uint64_t h = lookahead_next(&ahead, i, &f);
        out[i] = (char)(r_find_from(&t, &f, h, &snap) == R_HIT);
    }
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&buf);
    return ret;
}

/* ---------------------------------------------------------------- leases without a call
 * A session's page (KVT_PAGE_*, layout.h) is the client's to write.  To lease
 * the blocks of keys it finds, a reader publishes a hazard for each block's
 * slot in the page, then (after a full fence) checks that every entry it read
 * still has the same sequence number and that the table is not superseded.
 * The daemon takes an entry out of the table before it reuses the entry's
 * slot, and (after a full fence) never reuses a slot a page names: so either
 * the reader sees the entry change and leases nothing, or the daemon sees the
 * hazard and keeps the slot.  The daemon trusts the page for nothing else: a
 * hazard only keeps slots of the page's own namespace from reuse, and the
 * access ring (blocks read, for the LRU) is a hint it checks. */
static inline uint64_t
hazard_of(uint32_t segment, uint32_t slot)
{
    return KVT_HAZARD_BIT | KVT_REF(segment, slot);
}

static int
get_page(PyObject *obj, Py_buffer *page)
{
    if (PyObject_GetBuffer(obj, page, PyBUF_WRITABLE) < 0)
        return -1;
    if (page->len < KVT_PAGE_BYTES || ((uintptr_t)page->buf & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "page must be a writable, 8-byte aligned buffer of "
                                          "KVT_PAGE_BYTES");
        PyBuffer_Release(page);
        return -1;
    }
    return 0;
}

#define PAGE_U64(p, off) ((uint64_t *)((char *)(p)->buf + (off)))

PyObject *
kvt_py_index_acquire(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf, page;
    PyObject *keys, *page_obj;
    Py_ssize_t at;
    unsigned long long serial;
    if (!PyArg_ParseTuple(args, "y*OOnK:index_acquire", &buf, &keys, &page_obj, &at, &serial))
        return NULL;
    PyObject *ret = NULL, *seq = NULL, *locs = NULL;
    snapshot *snaps = NULL;
    int have_page = 0;
    table t;
    if (open_table(&buf, &t) < 0 || get_page(page_obj, &page) < 0)
        goto done;
    have_page = 1;
    seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (at < 0 || n > KVT_PAGE_HAZARDS_N || at > KVT_PAGE_HAZARDS_N - n) {
        PyErr_SetString(PyExc_ValueError, "hazards at..at+len(keys) are outside the page");
        goto done;
    }
    if (__atomic_load_n(&t.h->flags, __ATOMIC_ACQUIRE) & KVT_IDX_SUPERSEDED) {
        ret = Py_NewRef(Py_None);
        goto done;
    }
    if (first_bad_key(items, n) >= 0) {
        ret = Py_NewRef(Py_None);
        goto done;
    }
    snaps = PyMem_Malloc(sizeof(snapshot) * (size_t)(n > 0 ? n : 1));
    if (snaps == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *hz = PAGE_U64(&page, KVT_PAGE_HAZARDS) + at;
    uint64_t *serials = PAGE_U64(&page, KVT_PAGE_SERIALS) + at;
    Py_ssize_t hits = 0;
    int unsure = 0;
    lookahead ahead;
    lookahead_start(&ahead, &t, items, n);
    for (; hits < n; hits++) {
        fingerprint f;
        uint64_t h = lookahead_next(&ahead, hits, &f);
        int r = r_find_from(&t, &f, h, &snaps[hits]);
        if (r == R_MISS)
            break;
        if (r == R_UNSURE || snaps[hits].loc.segment == 0) {
            unsure = 1;
            break;
        }
        __atomic_store_n(&serials[hits], serial, __ATOMIC_RELAXED); /* the daemon reads it after */
        __atomic_store_n(&hz[hits], hazard_of(snaps[hits].loc.segment, snaps[hits].loc.slot),
                         __ATOMIC_RELEASE);
    }
    /* Publish the hazards, then look again: the daemon's side is a removal, a full
     * fence and a read of the hazards. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint32_t flags = __atomic_load_n(&t.h->flags, __ATOMIC_RELAXED);
    int valid = !unsure && !(flags & KVT_IDX_SUPERSEDED)
                && (hits == n || !(flags & KVT_IDX_MISS_NOT_FINAL));
    for (Py_ssize_t i = 0; valid && i < hits; i++)
        valid = __atomic_load_n(&snaps[i].e->seq, __ATOMIC_ACQUIRE) == snaps[i].seq;
    if (!valid) {
        for (Py_ssize_t i = 0; i < hits; i++)
            __atomic_store_n(&hz[i], 0, __ATOMIC_RELEASE);
        ret = Py_NewRef(Py_None);
        goto done;
    }
    locs = PyList_New(hits);
    if (locs == NULL)
        goto release;
    for (Py_ssize_t i = 0; i < hits; i++) {
        PyObject *loc = location_tuple(&snaps[i].loc, 0);
        if (loc == NULL)
            goto release;
        PyList_SET_ITEM(locs, i, loc);
    }
    /* The blocks read, for the daemon's LRU (a ring it drains when it evicts). */
    uint64_t *ring = PAGE_U64(&page, KVT_PAGE_RING);
    uint64_t pos = __atomic_fetch_add(PAGE_U64(&page, KVT_PAGE_RING_HEAD), (uint64_t)hits,
                                      __ATOMIC_RELAXED);
    for (Py_ssize_t i = 0; i < hits; i++)
        __atomic_store_n(&ring[(pos + (uint64_t)i) % KVT_PAGE_RING_N], hz[i], __ATOMIC_RELAXED);
    uint64_t *c = PAGE_U64(&page, 0), nbytes = 0;
    for (Py_ssize_t i = 0; i < hits; i++)
        nbytes += snaps[i].loc.length;
    __atomic_fetch_add(&c[6], nbytes, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c[3], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c[4], (uint64_t)hits, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c[5], (uint64_t)(n - hits), __ATOMIC_RELAXED);
    ret = Py_NewRef(locs);
    goto done;
release:
    for (Py_ssize_t i = 0; i < hits; i++)
        __atomic_store_n(&hz[i], 0, __ATOMIC_RELEASE);
done:
    PyMem_Free(snaps);
    Py_XDECREF(locs);
    Py_XDECREF(seq);
    if (have_page)
        PyBuffer_Release(&page);
    PyBuffer_Release(&buf);
    return ret;
}

PyObject *
kvt_py_hazards_clear(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer page;
    PyObject *page_obj;
    Py_ssize_t at, n;
    if (!PyArg_ParseTuple(args, "Onn:hazards_clear", &page_obj, &at, &n))
        return NULL;
    if (get_page(page_obj, &page) < 0)
        return NULL;
    PyObject *ret = NULL;
    if (at < 0 || n < 0 || n > KVT_PAGE_HAZARDS_N || at > KVT_PAGE_HAZARDS_N - n) {
        PyErr_SetString(PyExc_ValueError, "hazards at..at+n are outside the page");
    } else {
        /* Release order: the reads of the leased bytes come before the slot is free.  An
         * entry already 0 was expired by the daemon (its lease outlived leases.ttl). */
        uint64_t *hz = PAGE_U64(&page, KVT_PAGE_HAZARDS) + at;
        Py_ssize_t expired = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            expired += __atomic_exchange_n(&hz[i], 0, __ATOMIC_ACQ_REL) == 0;
        ret = PyLong_FromSsize_t(expired);
    }
    PyBuffer_Release(&page);
    return ret;
}

PyObject *
kvt_py_hazards_collect(PyObject *Py_UNUSED(m), PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "pages must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    PyObject *found = PySet_New(NULL);
    if (found == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    /* The daemon's half of the handshake: its removals from the table come first. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t p = 0; p < n; p++) {
        Py_buffer page;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, p), &page, PyBUF_SIMPLE) < 0)
            goto fail;
        if (page.len < KVT_PAGE_BYTES || ((uintptr_t)page.buf & 7) != 0) {
            PyBuffer_Release(&page);
            PyErr_SetString(PyExc_ValueError, "a page is not KVT_PAGE_BYTES, 8-byte aligned");
            goto fail;
        }
        uint64_t hi = __atomic_load_n(PAGE_U64(&page, KVT_PAGE_HAZARD_HI), __ATOMIC_RELAXED);
        if (hi > KVT_PAGE_HAZARDS_N)
            hi = KVT_PAGE_HAZARDS_N;
        const uint64_t *hz = PAGE_U64(&page, KVT_PAGE_HAZARDS);
        int err = 0;
        for (uint64_t i = 0; i < hi && !err; i++) {
            uint64_t v = __atomic_load_n(&hz[i], __ATOMIC_ACQUIRE);
            if (v == 0)
                continue;
            PyObject *o = PyLong_FromUnsignedLongLong(v);
            err = o == NULL || PySet_Add(found, o) < 0;
            Py_XDECREF(o);
        }
        PyBuffer_Release(&page);
        if (err)
            goto fail;
    }
    Py_DECREF(seq);
    return found;
fail:
    Py_DECREF(seq);
    Py_DECREF(found);
    return NULL;
}

/* The daemon's view of one page: [(index, hazard, serial)] of its non-zero hazards. */
PyObject *
kvt_py_hazards_list(PyObject *Py_UNUSED(m), PyObject *arg)
{
    Py_buffer page;
    if (PyObject_GetBuffer(arg, &page, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    if (page.len < KVT_PAGE_BYTES || ((uintptr_t)page.buf & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "a page is not KVT_PAGE_BYTES, 8-byte aligned");
        goto done;
    }
    if ((out = PyList_New(0)) == NULL)
        goto done;
    uint64_t hi = __atomic_load_n(PAGE_U64(&page, KVT_PAGE_HAZARD_HI), __ATOMIC_RELAXED);
    if (hi > KVT_PAGE_HAZARDS_N)
        hi = KVT_PAGE_HAZARDS_N;
    const uint64_t *hz = PAGE_U64(&page, KVT_PAGE_HAZARDS);
    const uint64_t *serials = PAGE_U64(&page, KVT_PAGE_SERIALS);
    for (uint64_t i = 0; i < hi; i++) {
        uint64_t v = __atomic_load_n(&hz[i], __ATOMIC_ACQUIRE);
        if (v == 0)
            continue;
        uint64_t serial = __atomic_load_n(&serials[i], __ATOMIC_RELAXED);
        PyObject *t = Py_BuildValue("(KKK)", (unsigned long long)i, (unsigned long long)v,
                                    (unsigned long long)serial);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(t);
    }
done:
    PyBuffer_Release(&page);
    return out;
}

/* The daemon ends a lease that outlived leases.ttl: hazard i back to 0 if it still
 * holds v (the client may have released it and leased again meanwhile). */
PyObject *
kvt_py_hazards_expire(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer page;
    Py_ssize_t i;
    unsigned long long v;
    if (!PyArg_ParseTuple(args, "w*nK:hazards_expire", &page, &i, &v))
        return NULL;
    PyObject *ret = NULL;
    if (page.len < KVT_PAGE_BYTES || ((uintptr_t)page.buf & 7) != 0 || i < 0
        || i >= KVT_PAGE_HAZARDS_N) {
        PyErr_SetString(PyExc_ValueError, "no such hazard in a page");
    } else {
        uint64_t want = v;
        int done = __atomic_compare_exchange_n(PAGE_U64(&page, KVT_PAGE_HAZARDS) + i, &want, 0,
                                               0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        ret = PyBool_FromLong(done);
    }
    PyBuffer_Release(&page);
    return ret;
}

PyObject *
kvt_py_index_lookup(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf, stats = {0};
    PyObject *keys, *stats_obj = Py_None;
    if (!PyArg_ParseTuple(args, "y*O|O:index_lookup", &buf, &keys, &stats_obj))
        return NULL;
    PyObject *ret = NULL, *seq = NULL;
    int have_stats = 0;
    table t;
    if (open_table(&buf, &t) < 0)
        goto done;
    if (stats_obj != Py_None) {
        if (PyObject_GetBuffer(stats_obj, &stats, PyBUF_WRITABLE) < 0)
            goto done;
        have_stats = 1;
        if (stats.len < 24 || ((uintptr_t)stats.buf & 7) != 0) {
            PyErr_SetString(PyExc_ValueError, "stats must be a writable, 8-byte aligned buffer of 24+ bytes");
            goto done;
        }
    }
    seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint32_t flags = __atomic_load_n(&t.h->flags, __ATOMIC_ACQUIRE);
    if (flags & KVT_IDX_SUPERSEDED) {
        ret = Py_NewRef(Py_None);
        goto done;
    }
    /* Every key is checked first, as the daemon does: a malformed one anywhere in the
     * list (past a miss too) gets the daemon's answer (an error), not a count. */
    if (first_bad_key(items, n) >= 0) {
        ret = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *tiers = PyBytes_FromStringAndSize(NULL, n);
    if (tiers == NULL)
        goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(tiers);
    Py_ssize_t hits = 0;
    int unsure = 0;
    lookahead ahead;
    lookahead_start(&ahead, &t, items, n);
    for (; hits < n; hits++) {
        fingerprint f;
        uint64_t h = lookahead_next(&ahead, hits, &f);
        snapshot snap;
        int r = r_find_from(&t, &f, h, &snap);
        out[hits] = snap.tier;
        if (r == R_MISS)
            break;
        if (r == R_UNSURE) {
            unsure = 1;
            break;
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    flags = __atomic_load_n(&t.h->flags, __ATOMIC_RELAXED);
    if (unsure || (flags & KVT_IDX_SUPERSEDED)) {
        Py_DECREF(tiers);
        ret = Py_NewRef(Py_None);
        goto done;
    }
    int final = hits == n || !(flags & KVT_IDX_MISS_NOT_FINAL);
    if (have_stats && final) {
        uint64_t *c = (uint64_t *)stats.buf;
        __atomic_fetch_add(&c[0], 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&c[1], (uint64_t)hits, __ATOMIC_RELAXED);
        __atomic_fetch_add(&c[2], (uint64_t)(n - hits), __ATOMIC_RELAXED);
    }
    if (_PyBytes_Resize(&tiers, hits) < 0)
        goto done;
    ret = Py_BuildValue("(NO)", tiers, final ? Py_True : Py_False);
done:
    Py_XDECREF(seq);
    if (have_stats)
        PyBuffer_Release(&stats);
    PyBuffer_Release(&buf);
    return ret;
}

PyObject *
kvt_py_index_copy(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:index_copy", &dst, &src))
        return NULL;
    PyObject *ret = NULL;
    table d, s;
    if (open_table(&dst, &d) == 0 && open_table(&src, &s) == 0) {
        uint64_t copied = 0, skipped = 0;
        int full = 0;
        /* The live entries a group at a time: their new homes prefetched, then inserted
         * (a rebuild of millions of keys misses the cache on every insert). */
        const idx_entry *group[LOOKUP_AHEAD];
        uint64_t hs[LOOKUP_AHEAD];
        for (uint64_t i = 0; i <= s.mask && !full;) {
            int m = 0;
            for (; i <= s.mask && m < LOOKUP_AHEAD; i++) {
                const idx_entry *e = &s.e[i];
                if (e->state != E_LIVE)
                    continue;
                fingerprint f = {e->fp0, e->fp1, e->flags};
                hs[m] = home(&d, &f);
                __builtin_prefetch(&d.e[hs[m]], 1, 3);
                group[m++] = e;
            }
            for (int k = 0; k < m && !full; k++) {
                const idx_entry *e = group[k];
                fingerprint f = {e->fp0, e->fp1, e->flags};
                location loc = {e->segment, e->slot, e->offset, e->length, e->checksum,
                                e->has_sum};
                int r = t_set_from(&d, &f, hs[k], e->tier, e->ref, &loc);
                if (r < 0)
                    full = 1;
                else if (r == 0)
                    skipped++;
                else
                    copied++;
            }
        }
        if (full)
            PyErr_SetString(PyExc_ValueError, "the destination index is too small");
        else
            ret = Py_BuildValue("(KK)", (unsigned long long)copied, (unsigned long long)skipped);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return ret;
}

PyObject *
kvt_py_index_info(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*:index_info", &buf))
        return NULL;
    PyObject *ret = NULL;
    table t;
    if (open_table(&buf, &t) == 0)
        ret = Py_BuildValue("(KKKI)", (unsigned long long)(t.mask + 1),
                            (unsigned long long)t.h->live, (unsigned long long)t.h->used,
                            __atomic_load_n(&t.h->flags, __ATOMIC_ACQUIRE));
    PyBuffer_Release(&buf);
    return ret;
}

PyObject *
kvt_py_index_set_flags(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "w*I:index_set_flags", &buf, &flags))
        return NULL;
    PyObject *ret = NULL;
    table t;
    if (open_table(&buf, &t) == 0) {
        __atomic_store_n(&t.h->flags, flags, __ATOMIC_SEQ_CST);
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&buf);
    return ret;
}

static PyObject *
fp_bytes(const fingerprint *f)
{
    char b[17];
    memcpy(b, &f->fp0, 8);
    memcpy(b + 8, &f->fp1, 8);
    b[16] = (char)f->flags;
    return PyBytes_FromStringAndSize(b, sizeof b);
}

/* keys_check(keys, max_len, repeats=True): a batch of keys judged in one pass (the
 * service's check of a request's keys, the store's of a Reserve before anything is
 * claimed): (bad, repeated), the index of the first key that is not bytes of
 * 1..max_len and of the first that repeats an earlier key (-1 without ``repeats``),
 * each -1 when none.  Keys are hashed (XXH3-64) into a table of twice
 * their count, compared byte for byte on a hash match: no Python object per key. */
PyObject *
kvt_py_keys_check(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *keys_obj;
    Py_ssize_t max_len;
    int repeats = 1;
    if (!PyArg_ParseTuple(args, "On|p:keys_check", &keys_obj, &max_len, &repeats))
        return NULL;
    PyObject *seq = PySequence_Fast(keys_obj, "keys must be a sequence of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), bad = -1, repeated = -1;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* slots: 1 + the index of a key seen (always bytes), 0 empty; hashes[i]: key i's. */
    uint32_t *slots = NULL;
    uint64_t *hashes = NULL;
    size_t cap = 16;
    if (repeats && n > 1) {
        if ((uint64_t)n >= UINT32_MAX) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "too many keys");
            return NULL;
        }
        while (cap < 2 * (size_t)n)
            cap <<= 1;
        slots = PyMem_Calloc(cap, sizeof *slots);
        hashes = PyMem_Malloc((size_t)n * sizeof *hashes);
        if (slots == NULL || hashes == NULL) {
            PyMem_Free(slots);
            PyMem_Free(hashes);
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
    for (Py_ssize_t i = 0; i < n && (bad < 0 || (slots != NULL && repeated < 0)); i++) {
        PyObject *k = items[i];
        Py_ssize_t len = PyBytes_Check(k) ? PyBytes_GET_SIZE(k) : -1;
        if ((len < 1 || len > max_len) && bad < 0)
            bad = i;
        if (slots == NULL || repeated >= 0 || len < 0)
            continue;
        const char *p = PyBytes_AS_STRING(k);
        uint64_t h = XXH3_64bits(p, (size_t)len);
        size_t j = (size_t)h & (cap - 1);
        for (; slots[j] != 0; j = (j + 1) & (cap - 1)) {
            PyObject *o = items[slots[j] - 1];
            if (hashes[slots[j] - 1] == h && PyBytes_GET_SIZE(o) == len
                && memcmp(PyBytes_AS_STRING(o), p, (size_t)len) == 0) {
                repeated = i;
                break;
            }
        }
        if (repeated < 0) {
            hashes[i] = h;
            slots[j] = (uint32_t)i + 1;
        }
    }
    PyMem_Free(slots);
    PyMem_Free(hashes);
    Py_DECREF(seq);
    return Py_BuildValue("(nn)", bad, repeated);
}

PyObject *
kvt_py_index_fingerprint(PyObject *Py_UNUSED(m), PyObject *arg)
{
    fingerprint f;
    if (key_fp(arg, &f) < 0)
        return NULL;
    return fp_bytes(&f);
}

PyObject *
kvt_py_index_fingerprints(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*:index_fingerprints", &buf))
        return NULL;
    PyObject *ret = NULL;
    table t;
    if (open_table(&buf, &t) == 0 && (ret = PyList_New(0)) != NULL) {
        for (uint64_t i = 0; i <= t.mask; i++) {
            idx_entry *e = &t.e[i];
            if (e->state != E_LIVE)
                continue;
            fingerprint f = {e->fp0, e->fp1, e->flags};
            PyObject *b = fp_bytes(&f);
            if (b == NULL || PyList_Append(ret, b) < 0) {
                Py_XDECREF(b);
                Py_CLEAR(ret);
                break;
            }
            Py_DECREF(b);
        }
    }
    PyBuffer_Release(&buf);
    return ret;
}

/* ---------------------------------------------------------------- the cross-check
 * Store.check without a Python object per block: check_snapshot copies what the check
 * reads into compact rows on the event loop (BlockTable.check_rows: 24 bytes a slot;
 * index_rows: 24 bytes a live entry), and check_keys compares them in a worker thread
 * with the GIL released. */

void
kvt_fingerprint(const uint8_t *key, size_t n, uint64_t *fp0, uint64_t *fp1, uint8_t *flags)
{
    fingerprint f = fp_of(key, n);
    *fp0 = f.fp0;
    *fp1 = f.fp1;
    *flags = f.flags;
}

/* index_rows(buf): the fingerprint of every live entry, 24 bytes each (fp0, fp1, flags as
 * little-endian u64s), in table order. */
PyObject *
kvt_py_index_rows(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*:index_rows", &buf))
        return NULL;
    PyObject *ret = NULL;
    table t;
    if (open_table(&buf, &t) == 0) {
        /* sized by the header's count, grown if the entries say more (a check trusts
         * neither) */
        uint64_t cap = t.h->live < t.mask + 1 ? t.h->live + 1 : t.mask + 1, n = 0;
        uint64_t *rows = malloc(cap * 24);
        int oom = rows == NULL;
        Py_BEGIN_ALLOW_THREADS
        for (uint64_t i = 0; i <= t.mask && !oom; i++) {
            const idx_entry *e = &t.e[i];
            if (e->state != E_LIVE)
                continue;
            if (n == cap) {
                uint64_t *grown = realloc(rows, 2 * cap * 24);
                if (grown == NULL) {
                    oom = 1;
                    break;
                }
                rows = grown;
                cap *= 2;
            }
            rows[3 * n] = e->fp0;
            rows[3 * n + 1] = e->fp1;
            rows[3 * n + 2] = e->flags;
            n++;
        }
        Py_END_ALLOW_THREADS
        if (oom)
            PyErr_NoMemory();
        else
            ret = PyBytes_FromStringAndSize((const char *)rows, (Py_ssize_t)(n * 24));
        free(rows);
    }
    PyBuffer_Release(&buf);
    return ret;
}

/* A set of fingerprints (rows of three u64s, elsewhere) for check_keys: open addressing,
 * each entry a row number + 1, hashed with a seed the caller draws (clients choose their
 * keys: a fixed hash would let them make the check quadratic). */
typedef struct {
    const uint64_t *rows; /* fp0, fp1, flags per row */
    uint64_t *e;
    uint64_t mask, seed;
} fpset;

static inline uint64_t
fps_hash(const fpset *s, const uint64_t *row)
{
    uint64_t v[2] = {row[0], row[1] ^ (row[2] << 56)};
    return XXH3_64bits_withSeed(v, sizeof v, s->seed) & s->mask;
}

static int
fps_init(fpset *s, const uint64_t *rows, uint64_t n, uint64_t seed)
{
    uint64_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    s->rows = rows;
    s->mask = cap - 1;
    s->seed = seed;
    s->e = calloc(cap, sizeof *s->e);
    return s->e == NULL ? -1 : 0;
}

/* The row number of the set's entry equal to row (fp0, fp1, flags), or -1. */
static int64_t
fps_find(const fpset *s, const uint64_t *row)
{
    for (uint64_t i = fps_hash(s, row);; i = (i + 1) & s->mask) {
        uint64_t v = s->e[i];
        if (v == 0)
            return -1;
        const uint64_t *r = s->rows + 3 * (v - 1);
        if (r[0] == row[0] && r[1] == row[1] && r[2] == row[2])
            return (int64_t)(v - 1);
    }
}

/* Insert row k; 0, or 1 when an equal row was there already (k is then not inserted). */
static int
fps_add(fpset *s, uint64_t k)
{
    const uint64_t *row = s->rows + 3 * k;
    for (uint64_t i = fps_hash(s, row);; i = (i + 1) & s->mask) {
        uint64_t v = s->e[i];
        if (v == 0) {
            s->e[i] = k + 1;
            return 0;
        }
        const uint64_t *r = s->rows + 3 * (v - 1);
        if (r[0] == row[0] && r[1] == row[1] && r[2] == row[2])
            return 1;
    }
}

/* A committed key that neither the index nor the unpublished keys hold. */
typedef struct {
    uint64_t fp[3];
    uint32_t extent, slot; /* the position of its rows in the list, the slot */
} missing_key;

static int
cmp_missing(const void *a, const void *b)
{
    /* as Python sorts the 17 bytes of fingerprint(): fp0, fp1 little-endian, then flags */
    const missing_key *x = a, *y = b;
    uint8_t bx[17], by[17];
    memcpy(bx, &x->fp[0], 8);
    memcpy(bx + 8, &x->fp[1], 8);
    bx[16] = (uint8_t)x->fp[2];
    memcpy(by, &y->fp[0], 8);
    memcpy(by + 8, &y->fp[1], 8);
    by[16] = (uint8_t)y->fp[2];
    return memcmp(bx, by, sizeof bx);
}

/* BlockTable.check_rows' row (csrc/blocks.c writes them). */
#define CHECK_ROW_BYTES 24

typedef struct {
    Py_buffer *ext; /* each extent's check rows */
    Py_ssize_t n_ext;
    const uint64_t *index_rows, *unpublished;
    uint64_t n_index, n_unpublished, seed;
    /* out */
    uint64_t keys, stray;
    int dup_committed, dup_index, unpublished_gone, oom;
    missing_key *missing;
    uint64_t n_missing;
} keys_job;

static void
check_keys_run(keys_job *j)
{
    fpset idx = {0}, unp = {0};
    uint8_t *seen = NULL, *seen_u = NULL;
    uint64_t cap_missing = 0;

    if (fps_init(&idx, j->index_rows, j->n_index, j->seed) < 0
        || fps_init(&unp, j->unpublished, j->n_unpublished, j->seed) < 0
        || (seen = calloc(j->n_index + 1, 1)) == NULL
        || (seen_u = calloc(j->n_unpublished + 1, 1)) == NULL) {
        j->oom = 1;
        goto done;
    }
    for (uint64_t k = 0; k < j->n_index; k++)
        if (fps_add(&idx, k))
            j->dup_index = 1;
    for (uint64_t k = 0; k < j->n_unpublished; k++)
        fps_add(&unp, k); /* (a dict's keys: distinct) */
    for (Py_ssize_t x = 0; x < j->n_ext; x++) {
        const uint8_t *rows = j->ext[x].buf;
        Py_ssize_t n = j->ext[x].len / CHECK_ROW_BYTES;
        for (Py_ssize_t s = 0; s < n; s++) {
            const uint8_t *r = rows + s * CHECK_ROW_BYTES;
            uint8_t klen = r[17];
            if (r[16] != KVT_ST_COMMITTED || klen < 1 || klen > KVT_SLOT_MAX_KEY)
                continue;
            uint64_t fp[3];
            memcpy(&fp[0], r, 8);
            memcpy(&fp[1], r + 8, 8);
            fp[2] = r[18];
            j->keys++;
            int64_t at = j->n_unpublished ? fps_find(&unp, fp) : -1;
            if (at >= 0) {
                j->dup_committed |= seen_u[at];
                seen_u[at] = 1;
                continue;
            }
            at = fps_find(&idx, fp);
            if (at >= 0) {
                j->dup_committed |= seen[at];
                seen[at] = 1;
                continue;
            }
            if (j->n_missing == cap_missing) {
                uint64_t cap = cap_missing ? 2 * cap_missing : 16;
                missing_key *grown = realloc(j->missing, cap * sizeof *grown);
                if (grown == NULL) {
                    j->oom = 1;
                    goto done;
                }
                j->missing = grown;
                cap_missing = cap;
            }
            missing_key *mk = &j->missing[j->n_missing++];
            memcpy(mk->fp, fp, sizeof fp);
            mk->extent = (uint32_t)x;
            mk->slot = (uint32_t)s;
        }
    }
    if (j->n_missing > 1) {
        /* sorted as the message lists them; a key missing twice is committed twice */
        qsort(j->missing, j->n_missing, sizeof *j->missing, cmp_missing);
        uint64_t w = 1;
        for (uint64_t k = 1; k < j->n_missing; k++) {
            if (cmp_missing(&j->missing[k], &j->missing[w - 1]) == 0)
                j->dup_committed = 1;
            else
                j->missing[w++] = j->missing[k];
        }
        j->n_missing = w;
    }
    /* distinct index fingerprints no committed key (outside unpublished) names */
    for (uint64_t i = 0; i <= idx.mask; i++)
        if (idx.e[i] != 0 && !seen[idx.e[i] - 1])
            j->stray++;
    for (uint64_t k = 0; k < j->n_unpublished; k++)
        if (!seen_u[k])
            j->unpublished_gone = 1;
done:
    free(idx.e);
    free(unp.e);
    free(seen);
    free(seen_u);
}

/* check_keys(extent_rows, index_rows, unpublished_rows, seed): the key index against the
 * slot tables, from compact rows (BlockTable.check_rows of each extent of a namespace,
 * index_rows of its table, and the rows of the keys it keeps apart: 24 bytes each, fp0,
 * fp1, flags).  Returns (committed keys, a key committed twice, the index holding a key
 * twice, [(position in extent_rows, slot)] of up to 5 committed keys neither the index
 * nor the unpublished keys hold -- sorted by fingerprint, distinct --, how many distinct
 * index keys no slot holds (outside the unpublished), an unpublished key no slot holds).
 * The GIL is released while it compares. */
PyObject *
kvt_py_check_keys(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *ext_list, *ret = NULL, *seq = NULL, *missing = NULL;
    Py_buffer ib, ub;
    unsigned long long seed;
    keys_job j;
    Py_ssize_t got = 0;

    if (!PyArg_ParseTuple(args, "Oy*y*K:check_keys", &ext_list, &ib, &ub, &seed))
        return NULL;
    memset(&j, 0, sizeof j);
    if (ib.len % 24 != 0 || ub.len % 24 != 0) {
        PyErr_SetString(PyExc_ValueError, "index and unpublished rows are 24 bytes each");
        goto done;
    }
    seq = PySequence_Fast(ext_list, "extent_rows must be a sequence of buffers");
    if (seq == NULL)
        goto done;
    j.n_ext = PySequence_Fast_GET_SIZE(seq);
    j.ext = PyMem_Calloc((size_t)j.n_ext + 1, sizeof *j.ext);
    if (j.ext == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < j.n_ext; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &j.ext[got], PyBUF_SIMPLE) < 0)
            goto done;
        if (j.ext[got].len % CHECK_ROW_BYTES != 0 || j.ext[got].len / CHECK_ROW_BYTES > UINT32_MAX) {
            PyBuffer_Release(&j.ext[got]);
            PyErr_Format(PyExc_ValueError, "extent_rows[%zd] is no whole number of rows", got);
            goto done;
        }
    }
    j.index_rows = ib.buf;
    j.n_index = (uint64_t)ib.len / 24;
    j.unpublished = ub.buf;
    j.n_unpublished = (uint64_t)ub.len / 24;
    j.seed = seed;
    Py_BEGIN_ALLOW_THREADS
    check_keys_run(&j);
    Py_END_ALLOW_THREADS
    if (j.oom) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t shown = j.n_missing < 5 ? j.n_missing : 5;
    if ((missing = PyList_New((Py_ssize_t)shown)) == NULL)
        goto done;
    for (uint64_t k = 0; k < shown; k++) {
        PyObject *v = Py_BuildValue("(II)", j.missing[k].extent, j.missing[k].slot);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(missing, (Py_ssize_t)k, v);
    }
    ret = Py_BuildValue("(KOOOKO)", (unsigned long long)j.keys, j.dup_committed ? Py_True : Py_False,
                        j.dup_index ? Py_True : Py_False, missing, (unsigned long long)j.stray,
                        j.unpublished_gone ? Py_True : Py_False);
done:
    for (Py_ssize_t k = 0; k < got; k++)
        PyBuffer_Release(&j.ext[k]);
    PyMem_Free(j.ext);
    free(j.missing);
    Py_XDECREF(missing);
    Py_XDECREF(seq);
    PyBuffer_Release(&ub);
    PyBuffer_Release(&ib);
    return ret;
}

/* fingerprint_rows(keys): the 24-byte rows (fp0, fp1, flags) of keys' fingerprints. */
PyObject *
kvt_py_fingerprint_rows(PyObject *Py_UNUSED(m), PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "keys must be a sequence of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *ret = PyBytes_FromStringAndSize(NULL, n * 24);
    if (ret != NULL) {
        uint64_t *out = (uint64_t *)PyBytes_AS_STRING(ret);
        for (Py_ssize_t i = 0; i < n; i++) {
            fingerprint f;
            if (key_fp(PySequence_Fast_GET_ITEM(seq, i), &f) < 0) {
                Py_CLEAR(ret);
                break;
            }
            out[3 * i] = f.fp0;
            out[3 * i + 1] = f.fp1;
            out[3 * i + 2] = f.flags;
        }
    }
    Py_DECREF(seq);
    return ret;
}

/* index_populate(buf, write=True, touch=True): allocate every page of a freshly made
 * table now (what its first writes would fault in one page at a time), with the GIL
 * released: recovery runs it in a thread while it adopts the extents, a client for the
 * segments it maps.  The writer may go on meanwhile: madvise only faults pages in, and
 * where it cannot (a kernel before 5.14), with touch, each page is touched with an
 * atomic add of 0 (write) or a read -- never for a file that may be cut short (a client's
 * segment: SIGBUS), where madvise just fails; write=False: MADV_POPULATE_READ.  Returns
 * whether madvise populated it. */
#define POPULATE_CHUNK ((uintptr_t)4 << 20)
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
PyObject *
kvt_py_index_populate(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer buf;
    int write = 1, touch = 1;
    if (!PyArg_ParseTuple(args, "y*|pp:index_populate", &buf, &write, &touch))
        return NULL;
    if (write && buf.readonly) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_TypeError, "write=True needs a writable buffer");
        return NULL;
    }
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    uintptr_t a = (uintptr_t)buf.buf, end = a + (uintptr_t)buf.len;
    uintptr_t from = (a + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
    int populated = 0;
    Py_BEGIN_ALLOW_THREADS
    /* in chunks: each call holds the process's mmap lock, which an mmap or a thread's
     * start elsewhere in the process waits for */
    populated = from < end;
    for (uintptr_t p = from; p < end && populated; p += POPULATE_CHUNK) {
        size_t n = end - p < POPULATE_CHUNK ? end - p : POPULATE_CHUNK;
        populated = madvise((void *)p, n, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0;
    }
    if (!populated && touch) {
        for (uintptr_t p = a; p < end; p += (uintptr_t)page) {
            if (write)
                __atomic_fetch_add((uint8_t *)p, 0, __ATOMIC_RELAXED);
            else
                (void)__atomic_load_n((const uint8_t *)p, __ATOMIC_RELAXED);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyBool_FromLong(populated);
}
