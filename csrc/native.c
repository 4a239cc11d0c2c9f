/*
 * kvtier._native: GIL-free bulk memory helpers for the kvtier client and daemon.
 *
 *   copy(dst, src, threads=0)   copy all of src into the start of dst
 *   prefault(buf, threads=0)    fault every page of buf in writable, content unchanged
 *
 * Both take buffer-protocol objects (mmap, memoryview, bytearray, numpy array).
 *
 * Why native code: the KV blocks live in /dev/shm segments and are hundreds of
 * MiB per request.  One core cannot saturate DRAM bandwidth with memcpy, and the
 * first touch of a fresh shared-memory page (fault + zero-fill) runs at only
 * ~1 GB/s per thread, so large jobs are split over a few pthreads.  The GIL is
 * released around every copy and touch, so the daemon's event loop and other
 * client threads keep running meanwhile.
 *
 * Layout (house style "C returns codes, the binding raises"): the kvt_* functions
 * are plain C over pointers and lengths; they never touch Python objects and
 * cannot fail (a thread that cannot be started just means the calling thread
 * does that share itself).  The py_* bindings parse and validate arguments,
 * raise with exact messages, and release every buffer on every path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* Pages are touched every 4096 bytes: the smallest page size on every platform
 * we run on.  With larger (or huge) pages some pages are merely touched twice. */
#define KVT_PAGE ((size_t)4096)

/* Jobs below 4 MiB run on the calling thread: starting a pthread costs tens of
 * microseconds, comparable to copying a few MiB on one core. */
#define KVT_PARALLEL_MIN ((size_t)4 << 20)

/* Each thread gets at least 1 MiB of work, for the same reason. */
#define KVT_MIN_PER_THREAD ((size_t)1 << 20)

/* threads=0 caps: a memcpy saturates memory bandwidth with ~4 cores, while page
 * faults are CPU-bound in the kernel and keep scaling to ~8. */
#define KVT_COPY_AUTO_THREADS 4
#define KVT_PREFAULT_AUTO_THREADS 8

/* Hard cap on any request, so a typo cannot spawn thousands of threads. */
#define KVT_MAX_THREADS 64

/* ------------------------------------------------------------------------- */
/* Plain C core                                                               */
/* ------------------------------------------------------------------------- */

typedef void *(*kvt_worker)(void *);

/* Run njobs (1..KVT_MAX_THREADS) jobs of job_size bytes each from the array jobs:
 * job 0 on the calling thread, the others on fresh pthreads.  A job whose thread
 * cannot be created runs on the calling thread instead. */
static void
kvt_run_jobs(kvt_worker fn, void *jobs, size_t job_size, int njobs)
{
    pthread_t tids[KVT_MAX_THREADS];
    int started[KVT_MAX_THREADS];

    for (int i = 1; i < njobs; i++) {
        void *job = (char *)jobs + (size_t)i * job_size;
        started[i] = pthread_create(&tids[i], NULL, fn, job) == 0;
        if (!started[i])
            fn(job);
    }
    fn(jobs);
    for (int i = 1; i < njobs; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
    }
}

/* How many threads to use for a job of len bytes; requested 0 means auto,
 * i.e. min(auto_cap, online cpus). */
static int
kvt_threads_for(size_t len, size_t requested, int auto_cap)
{
    size_t n = requested;

    if (len < KVT_PARALLEL_MIN)
        return 1;
    if (n == 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        n = cpus < 1 ? 1 : (size_t)cpus;
        if (n > (size_t)auto_cap)
            n = (size_t)auto_cap;
    }
    if (n > KVT_MAX_THREADS)
        n = KVT_MAX_THREADS;
    if (n > len / KVT_MIN_PER_THREAD)
        n = len / KVT_MIN_PER_THREAD;
    return n < 1 ? 1 : (int)n;
}

/* Copies at least this big bypass the cache with non-temporal stores: a KV
 * block written into shared memory is read next by another process (or a DMA
 * engine), not by this core, so pulling each destination line into the cache
 * first (read-for-ownership) only costs bandwidth and evicts useful data.
 * glibc switches to such stores only above ~3/4 of the L3 size per call, far
 * above one block; 256 KiB keeps small copies on the cached path. */
#define KVT_STREAM_MIN ((size_t)256 << 10)

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>

static void
kvt_memcpy_stream(char *dst, const char *src, size_t len)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    size_t i, body;

    if (len < KVT_STREAM_MIN) {
        memcpy(dst, src, len);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    body = len & ~(size_t)63;
    for (i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence(); /* streamed stores are weakly ordered: make them visible first */
    memcpy(dst + body, src + body, len - body);
}
#else
#define kvt_memcpy_stream memcpy
#endif

typedef struct {
    char *dst;
    const char *src;
    size_t len;
} kvt_copy_job;

static void *
kvt_copy_worker(void *arg)
{
    kvt_copy_job *job = arg;
    kvt_memcpy_stream(job->dst, job->src, job->len);
    return NULL;
}

/* Copy len bytes from src to dst over up to threads threads (0 = auto). */
static void
kvt_copy(char *dst, const char *src, size_t len, size_t threads)
{
    kvt_copy_job jobs[KVT_MAX_THREADS];
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    size_t chunk, off;
    int n, njobs = 0;

    if (len == 0)
        return;
    /* Overlapping ranges (two views of one buffer): chunks copied in parallel
     * would read bytes another chunk already overwrote, so use one memmove. */
    if (d < s + len && s < d + len) {
        memmove(dst, src, len);
        return;
    }
    n = kvt_threads_for(len, threads, KVT_COPY_AUTO_THREADS);
    if (n == 1) {
        kvt_memcpy_stream(dst, src, len);
        return;
    }
    /* Chunks are whole pages, so no two threads write the same page. */
    chunk = (len + (size_t)n - 1) / (size_t)n;
    chunk = (chunk + KVT_PAGE - 1) / KVT_PAGE * KVT_PAGE;
    for (off = 0; off < len; off += chunk) {
        jobs[njobs].dst = dst + off;
        jobs[njobs].src = src + off;
        jobs[njobs].len = len - off < chunk ? len - off : chunk;
        njobs++;
    }
    kvt_run_jobs(kvt_copy_worker, jobs, sizeof jobs[0], njobs);
}

typedef struct {
    uintptr_t base;  /* start of the first page the buffer overlaps */
    uintptr_t start; /* start of the buffer itself (base <= start) */
    size_t first;    /* pages [first, last) relative to base */
    size_t last;
} kvt_touch_job;

static void *
kvt_touch_worker(void *arg)
{
    kvt_touch_job *job = arg;

    for (size_t i = job->first; i < job->last; i++) {
        uintptr_t p = job->base + i * KVT_PAGE;
        if (p < job->start)
            p = job->start;
        /* An atomic add of 0 is a write fault (so the page is mapped writable,
         * not just readable) that changes nothing, even if another thread or
         * process writes that byte at the same moment: a plain read followed by
         * a write back could undo their write. */
        __atomic_fetch_add((unsigned char *)p, 0, __ATOMIC_RELAXED);
    }
    return NULL;
}

/* Touch every page that [buf, buf+len) overlaps, over up to threads threads
 * (0 = auto); returns the number of pages touched. */
static size_t
kvt_prefault(char *buf, size_t len, size_t threads)
{
    kvt_touch_job jobs[KVT_MAX_THREADS];
    uintptr_t start = (uintptr_t)buf;
    uintptr_t base = start & ~(uintptr_t)(KVT_PAGE - 1);
    size_t pages, per, first;
    int n, njobs = 0;

    if (len == 0)
        return 0;
    pages = (start + len - base + KVT_PAGE - 1) / KVT_PAGE;
    n = kvt_threads_for(len, threads, KVT_PREFAULT_AUTO_THREADS);
    per = (pages + (size_t)n - 1) / (size_t)n;
    for (first = 0; first < pages; first += per) {
        jobs[njobs].base = base;
        jobs[njobs].start = start;
        jobs[njobs].first = first;
        jobs[njobs].last = pages - first < per ? pages : first + per;
        njobs++;
    }
    kvt_run_jobs(kvt_touch_worker, jobs, sizeof jobs[0], njobs);
    return pages;
}

/* ------------------------------------------------------------------------- */
/* Python bindings                                                            */
/* ------------------------------------------------------------------------- */

/* Get a C-contiguous (and, if writable, writable) buffer of obj, which the
 * caller must release; on error sets an exception and returns -1.
 *
 * We request strided buffers and check contiguity and writability ourselves
 * instead of asking with PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE: exporters refuse
 * those requests with their own exception types and messages (BufferError from
 * memoryview, ValueError from numpy), and callers get exact, uniform errors. */
static int
kvt_get_buffer(PyObject *obj, Py_buffer *view, const char *name, int writable)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES) < 0)
        return -1; /* TypeError: not a bytes-like object */
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s is not C-contiguous", name);
        PyBuffer_Release(view);
        return -1;
    }
    if (writable && view->readonly) {
        PyErr_Format(PyExc_TypeError, "%s is read-only", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
kvt_check_threads(Py_ssize_t threads)
{
    if (threads < 0) {
        PyErr_Format(PyExc_ValueError, "threads must be >= 0, got %zd", threads);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(py_copy_doc,
"copy($module, dst, src, threads=0)\n"
"--\n"
"\n"
"Copy all bytes of src into the start of dst; return the number copied.\n"
"\n"
"dst must be a writable, C-contiguous buffer at least as large as src (in\n"
"bytes), src any C-contiguous buffer; the rest of dst is left alone.\n"
"Overlapping buffers are copied as by memmove.  Copies of 4 MiB or more are\n"
"split over up to threads threads (0: min(4, online cpus); 1: one thread).\n"
"The GIL is released during the copy.\n"
"\n"
"Raises ValueError if dst is too small, a buffer is not C-contiguous or\n"
"threads < 0; TypeError if dst is read-only or an argument is not a buffer.");

static PyObject *
py_copy(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"dst", "src", "threads", NULL};
    PyObject *dst_obj, *src_obj;
    Py_ssize_t threads = 0;
    Py_buffer dst, src;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|n:copy", kwlist,
                                     &dst_obj, &src_obj, &threads))
        return NULL;
    if (kvt_check_threads(threads) < 0)
        return NULL;
    if (kvt_get_buffer(dst_obj, &dst, "dst", 1) < 0)
        return NULL;
    if (kvt_get_buffer(src_obj, &src, "src", 0) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "dst holds %zd bytes, src has %zd",
                     dst.len, src.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }

    Py_BEGIN_ALLOW_THREADS
    kvt_copy(dst.buf, src.buf, (size_t)src.len, (size_t)threads);
    Py_END_ALLOW_THREADS

    Py_ssize_t copied = src.len;
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyLong_FromSsize_t(copied);
}

PyDoc_STRVAR(py_prefault_doc,
"prefault(buf, threads=0)\n"
"--\n"
"\n"
"Fault every page of buf in writable, leaving its content unchanged.\n"
"\n"
"Each 4096-byte page the buffer overlaps gets one atomic add of 0, which\n"
"is safe against concurrent writers.  Returns the number of pages touched:\n"
"ceil(len / 4096) for a page-aligned buffer.  Buffers of 4 MiB or more are\n"
"split over up to threads threads (0: min(8, online cpus); 1: one thread).\n"
"The GIL is released while touching.\n"
"\n"
"Raises ValueError if buf is not C-contiguous or threads < 0; TypeError if\n"
"buf is read-only or not a buffer.");

static PyObject *
py_prefault(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "threads", NULL};
    PyObject *buf_obj;
    Py_ssize_t threads = 0;
    Py_buffer buf;
    size_t pages;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n:prefault", kwlist,
                                     &buf_obj, &threads))
        return NULL;
    if (kvt_check_threads(threads) < 0)
        return NULL;
    if (kvt_get_buffer(buf_obj, &buf, "buf", 1) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    pages = kvt_prefault(buf.buf, (size_t)buf.len, (size_t)threads);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&buf);
    return PyLong_FromSize_t(pages);
}

static PyMethodDef native_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_VARARGS | METH_KEYWORDS,
     py_copy_doc},
    {"prefault", (PyCFunction)(void (*)(void))py_prefault,
     METH_VARARGS | METH_KEYWORDS, py_prefault_doc},
    {NULL, NULL, 0, NULL},
};

/* The module has no state, so it is safe in subinterpreters and without a GIL. */
static PyModuleDef_Slot native_slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

PyDoc_STRVAR(native_doc,
"GIL-free bulk memory helpers for kvtier (use them through kvtier._accel).\n"
"\n"
"copy(dst, src, threads=0) copies a buffer into another; prefault(buf,\n"
"threads=0) makes every page of a buffer resident and writable.  Both\n"
"release the GIL and split jobs of 4 MiB or more over a few threads.");

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier._native",
    .m_doc = native_doc,
    .m_size = 0,
    .m_methods = native_methods,
    .m_slots = native_slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
