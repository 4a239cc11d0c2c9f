/*
 * kvtier._native: GIL-free bulk memory helpers for the kvtier client and daemon.
 *
 *   copy(dst, src, threads=0)        copy all of src into the start of dst
 *   prefault(buf, threads=0)         fault every page of buf in writable, content unchanged
 *   checksum(buf)                    XXH3-64 (seed 0) of the bytes of buf
 *   gather(dst, pieces, threads=0)   copy the pieces back to back into dst
 *   scatter(src, pieces, threads=0)  fill the pieces in order from src
 *   scatter_hash(srcs, pieces, threads=0, hash=True)  scatter each srcs[i] into pieces[i]
 *                                    and return their XXH3-64s, in one pass
 *   scatter_hash_at(srcs, bases, offsets, limit, threads=0, hash=True)  the same, each
 *                                    source into bases[i] from offsets[i] on (a put's slots)
 *   pwrite_full(fd, buf, offset, threads=0)  write all of buf at offset
 *   pread_full(fd, buf, offset, threads=0)   fill buf from offset (short at EOF)
 *   hash_rows(buf, stride, start, stop, seeds)  XXH3-64 of a slice of each row
 *   ssd_find_slots(buckets, tables, bases, keys, namespace)  the SSD tier's key
 *                                    index asked about many keys in one call
 *
 *   install_fault_guard()            turn a SIGBUS in the calls above into OSError
 *   fault_guard_installed()          whether install_fault_guard() has run
 *
 *   The shared index's functions (csrc/index.c, csrc/writes.c) are listed here too;
 *   BlockTable with BLOCK_TABLE (csrc/blocks.c: a namespace's blocks as native records)
 *   and LAYOUT with FIELDS (csrc/layout.c: every number of csrc/layout.h) are added to
 *   the module by its exec slots.
 *
 * All take buffer-protocol objects (mmap, memoryview, bytearray, numpy array).
 *
 * Why native code: the KV blocks live in /dev/shm segments and are hundreds of
 * MiB per request.  One core cannot saturate DRAM bandwidth with memcpy, and the
 * first touch of a fresh shared-memory page (fault + zero-fill) runs at only
 * ~1 GB/s per thread, so large jobs are split over a few pthreads.  The GIL is
 * released around every copy and touch, so the daemon's event loop and other
 * client threads keep running meanwhile.  The spill tiers add checksums, the
 * gather/scatter of many small pieces in one call, and positional file I/O
 * that may run on O_DIRECT descriptors, where several requests in flight
 * (one per thread) are what keeps an NVMe device busy.
 *
 * Layout (house style "C returns codes, the binding raises"): the kvt_* functions
 * are plain C over pointers and lengths; they never touch Python objects and
 * return 0 or an errno (a thread that cannot be started just means the calling
 * thread does that share itself).  The memory helpers fail only with EFAULT,
 * when the fault guard caught a SIGBUS in a buffer (see "Fault guard").  The
 * py_* bindings parse and validate arguments, raise with exact messages, and
 * release every buffer on every path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The official single-header xxHash (csrc/third_party/xxhash, BSD-2-Clause),
 * compiled into this file.  On x86 setup.py also builds xxHash's own runtime
 * dispatcher (xxh_x86dispatch.c) and defines KVT_XXH_X86_DISPATCH: the header
 * alone is built for the baseline ISA (SSE2), and XXH3 runs faster with AVX2,
 * which the dispatcher picks when the CPU has it (setup.py says why not
 * AVX-512).  The xxhash package, our fallback, dispatches too. */
#define XXH_INLINE_ALL
#include "xxhash.h"
#include "index.h"
#include "wire.h"
#include "blocks.h"
#ifdef KVT_XXH_X86_DISPATCH
#include "xxh_x86dispatch.h" /* XXH3_64bits is now XXH3_64bits_dispatch */
#include "xxh_dispatch.h"    /* KVTIER_XXH3: which path it dispatches to */
#endif

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

/* checksum, gather and scatter keep the GIL below 64 KiB: such a call takes a
 * few microseconds, less than handing the GIL over and waiting to get it back. */
#define KVT_NOGIL_MIN ((size_t)64 << 10)

/* File transfers of 8 MiB or more are split into chunks of at least 2 MiB,
 * each written or read by its own thread, so several requests are in flight
 * at once (queue depth > 1, which an NVMe device needs to reach its bandwidth,
 * above all with O_DIRECT, where nothing is cached or read ahead).  threads=0
 * means 4: the device, not the CPU, is the limit. */
#define KVT_IO_PARALLEL_MIN ((size_t)8 << 20)
#define KVT_IO_MIN_PER_THREAD ((size_t)2 << 20)
#define KVT_IO_AUTO_THREADS 4

/* One pread/pwrite asks for at most 1 GiB: Linux transfers at most
 * 0x7ffff000 bytes per call anyway, and this keeps every request aligned. */
#define KVT_IO_MAX_REQUEST ((size_t)1 << 30)

/* A job of a guarded call looks every 1 MiB whether another job of it has
 * faulted, and stops if so: the call fails anyway, and a job can take
 * milliseconds.  1 MiB keeps the check (one load) far below the copy's cost. */
#define KVT_STEP ((size_t)1 << 20)

/* ------------------------------------------------------------------------- */
/* Fault guard                                                                */
/* ------------------------------------------------------------------------- */

/*
 * A client with a writable fd of a shared-memory file kvtierd has mapped can
 * truncate it at any instant.  The daemon's next load or store in the
 * vanished pages raises SIGBUS, which kills the process; so does a page the
 * file system cannot supply (holes punched in the file read back as zeros,
 * until tmpfs is full).
 * System calls on such memory fail with EFAULT instead, so only the CPU's own
 * accesses need this: every worker below that reads or writes a caller's
 * buffer (copy, prefault, checksum, gather, scatter, scatter_hash) does its
 * work "armed".
 * It calls sigsetjmp, points its thread's kvt_guard.armed at that jump buffer,
 * works, and disarms.  The SIGBUS handler (installed once, by
 * install_fault_guard) jumps back into an armed thread, which records the
 * fault in the call's kvt_fault and returns; the call returns EFAULT, and the
 * binding raises OSError.  A SIGBUS in a thread that is not armed (numpy
 * reading the same mapping, say) goes on to the handler there was before, or
 * kills the process exactly as if we had not been there.
 *
 * Only SIGBUS: a SIGSEGV in here is a bug of ours and must crash.
 *
 * Arming costs a sigsetjmp(env, 0) (register stores, no system call) and two
 * thread-local stores per job: about 10 ns, lost in the noise of a 4 KiB
 * checksum (~280 ns a call from Python) or a 64 KiB copy (~2 us).  Without
 * the handler the workers do not arm (one load instead): nothing could jump.
 *
 * Why SA_NODEFER: sigsetjmp(env, 0) does not save the signal mask, so
 * siglongjmp does not restore it.  The handler runs with SA_NODEFER and an
 * empty sa_mask, so the kernel blocks nothing while it runs, and jumping out
 * of it leaves the mask as it was.  Without SA_NODEFER, SIGBUS would stay
 * blocked after the jump, and the next one (a fault cannot be postponed)
 * would kill the process outright.  Saving the mask instead (sigsetjmp(env, 1))
 * would cost a sigprocmask system call per job and per call.
 *
 * What jumping out of a fault leaves behind: the copy stopped part way (the
 * destination is partly written), and nothing else: the workers hold no lock
 * and allocate nothing while armed.
 */

/* initial-exec: the handler must read kvt_guard with a plain load.  The
 * default TLS model of a shared object reaches it through __tls_get_addr,
 * which allocates a thread's block (malloc) at its first access: not
 * async-signal-safe, and any thread, one that never ran our code included,
 * may take a SIGBUS.  Initial-exec TLS lives in the static TLS block, out of
 * the surplus glibc keeps for dlopened objects; we take 16 bytes of it. */
#if defined(__GNUC__)
#define KVT_TLS_IE __attribute__((tls_model("initial-exec")))
#else
#define KVT_TLS_IE
#endif

typedef struct {
    sigjmp_buf *armed; /* where the handler jumps; NULL outside guarded work */
    void *addr;        /* the address of the fault it caught last (si_addr) */
} kvt_guard_state;

static _Thread_local kvt_guard_state kvt_guard KVT_TLS_IE;

/* SIGBUS's action before ours: written once, before ours is installed, and
 * only read afterwards (by the handler). */
static struct sigaction kvt_guard_prev;
static int kvt_guard_on; /* 1 once installed; read and written atomically */
static pthread_mutex_t kvt_guard_lock = PTHREAD_MUTEX_INITIALIZER;

/* Shared by the jobs of one call: whether one faulted, and where. */
typedef struct {
    int hit;        /* set by the first job that faults; read atomically */
    uintptr_t addr; /* that fault's address; read after the jobs are joined */
} kvt_fault;

static void
kvt_on_sigbus(int sig, siginfo_t *info, void *context)
{
    sigjmp_buf *env = kvt_guard.armed;

    /* si_code > 0: the kernel sent it for a fault here.  A SIGBUS sent with
     * kill() or raise() is not a fault, wherever it lands. */
    if (env != NULL && info->si_code > 0) {
        kvt_guard.armed = NULL;
        kvt_guard.addr = info->si_addr;
        siglongjmp(*env, 1);
    }
    if (kvt_guard_prev.sa_flags & SA_SIGINFO) {
        kvt_guard_prev.sa_sigaction(sig, info, context);
    }
    else if (kvt_guard_prev.sa_handler != SIG_DFL && kvt_guard_prev.sa_handler != SIG_IGN) {
        kvt_guard_prev.sa_handler(sig);
    }
    else {
        /* The default action (or SIG_IGN, which the kernel does not honour for
         * a fault): put it back and return.  The faulting instruction runs
         * again, faults again, and the process dies of SIGBUS as it would have
         * without us, core dump included.  A sent signal does not come back by
         * itself, so send it again; SA_NODEFER lets it in at once. */
        struct sigaction dfl;

        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(sig, &dfl, NULL);
        if (info->si_code <= 0)
            raise(sig);
    }
}

/* Install kvt_on_sigbus for SIGBUS unless done already.  Returns 1 if this
 * call installed it, 0 if an earlier one had, or -errno. */
static int
kvt_guard_install(void)
{
    struct sigaction act;
    int ret = 0;

    pthread_mutex_lock(&kvt_guard_lock);
    if (!__atomic_load_n(&kvt_guard_on, __ATOMIC_ACQUIRE)) {
        memset(&act, 0, sizeof act);
        act.sa_sigaction = kvt_on_sigbus;
        act.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&act.sa_mask);
        /* Read the old action first, then install: the handler may run on
         * another thread the moment it is installed, and must find it. */
        if (sigaction(SIGBUS, NULL, &kvt_guard_prev) != 0 ||
            sigaction(SIGBUS, &act, NULL) != 0) {
            ret = -errno;
        }
        else {
            __atomic_store_n(&kvt_guard_on, 1, __ATOMIC_RELEASE);
            ret = 1;
        }
    }
    pthread_mutex_unlock(&kvt_guard_lock);
    return ret;
}

/* Arm this thread with env, which the caller has just sigsetjmp'ed; the
 * signal fence keeps the compiler from moving the store after (or dropping
 * it before) the guarded accesses, which it may otherwise: nothing in plain
 * C reads it. */
static inline void
kvt_arm(sigjmp_buf *env)
{
    kvt_guard.armed = env;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

static inline void
kvt_disarm(void)
{
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    kvt_guard.armed = NULL;
}

/* After the handler jumped back into this thread: record the fault in the
 * call's fault (the first one wins), which also tells the other jobs to stop. */
static void
kvt_fault_record(kvt_fault *fault)
{
    if (__atomic_exchange_n(&fault->hit, 1, __ATOMIC_RELAXED) == 0)
        fault->addr = (uintptr_t)kvt_guard.addr;
}

static inline int
kvt_fault_seen(const kvt_fault *fault)
{
    return __atomic_load_n(&fault->hit, __ATOMIC_RELAXED);
}

/* Run work(arg) armed: if it faults, record that in fault and return early.
 * work must leave nothing to undo when it is cut short (no lock, no malloc).
 * A function of its own, so no local of a caller is live across the jump. */
static void
kvt_guarded(void (*work)(void *), void *arg, kvt_fault *fault)
{
    sigjmp_buf env;

    /* No handler, nothing can jump back here: skip the sigsetjmp. */
    if (!__atomic_load_n(&kvt_guard_on, __ATOMIC_RELAXED)) {
        work(arg);
        return;
    }
    if (sigsetjmp(env, 0) != 0) {
        kvt_fault_record(fault);
        return;
    }
    kvt_arm(&env);
    work(arg);
    kvt_disarm();
}

/* ------------------------------------------------------------------------- */
/* Plain C core                                                               */
/* ------------------------------------------------------------------------- */

/* Run njobs (1..KVT_MAX_THREADS) jobs of job_size bytes each from the array jobs:
 * job 0 on the calling thread, the others on fresh pthreads.  A job whose thread
 * cannot be created runs on the calling thread instead.  (index.h: index.c's
 * parallel adoption uses it too.) */
void
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

/* Copy 64 bytes a step with SSE2 loads and aligned stores: non-temporal
 * (stream) or cached.  The cached form exists to avoid `rep movsb` (see
 * kvt_memcpy_cached), so GCC must not distribute the loop back into a memcpy
 * call: the loads and stores are plain vector dereferences, which
 * -ftree-loop-distribute-patterns would turn into one. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
static inline void
kvt_memcpy_sse2(char *dst, const char *src, size_t len, int stream)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    size_t i, body;

    if (len < 64 + head) {
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
        if (stream) {
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        } else {
            _mm_store_si128((__m128i *)(dst + i), a);
            _mm_store_si128((__m128i *)(dst + i + 16), b);
            _mm_store_si128((__m128i *)(dst + i + 32), c);
            _mm_store_si128((__m128i *)(dst + i + 48), d);
        }
    }
    if (stream)
        _mm_sfence(); /* streamed stores are weakly ordered: make them visible first */
    memcpy(dst + body, src + body, len - body);
}

/* Copy with non-temporal stores whatever the length (the caller decided). */
static void
kvt_memcpy_nt(char *dst, const char *src, size_t len)
{
    kvt_memcpy_sse2(dst, src, len, 1);
}

/* Copy with cached stores, never `rep movsb`: see kvt_memcpy_cached. */
static void
kvt_memcpy_vec(char *dst, const char *src, size_t len)
{
    kvt_memcpy_sse2(dst, src, len, 0);
}
#else
#define kvt_memcpy_nt memcpy
#define kvt_memcpy_vec memcpy
#endif

/* Copies below this are left to memcpy whatever their alignment: glibc uses
 * `rep movsb` only from 2 KiB (SSE2/AVX2) or 4 KiB (AVX-512) up. */
#define KVT_ALIAS_MIN ((size_t)2 << 10)

/* How close (in bytes, either way) the destination may come to the source
 * modulo 4096 before the copy avoids `rep movsb`. */
#define KVT_ALIAS_NEAR ((uintptr_t)64)

/* memcpy, except where glibc's would run `rep movsb` into its slow case.
 * glibc copies from ~2 KiB up to the L2 size (AMD) or its non-temporal
 * threshold (Intel) with `rep movsb`, and AMD's runs many times slower when
 * the destination is a few bytes past the source modulo 4096 (page
 * aliasing; glibc bug 30994, where glibc 2.40 stopped using it on Zen 3/4).
 * A get hits exactly that: it copies from a page-aligned slot into a numpy
 * row, which malloc places 16 bytes past a page.  Measured on a Zen 4 EPYC
 * (glibc 2.36), 64 KiB from a page-aligned source: dst 0 B past it 1.8 us,
 * 1 and 8 B past 19-31 us, 16 B 2.3-3.4 us; on the AVX2-only EPYC of issue 53
 * the get's 64 KiB copies took 23 us each.  Those copies take the vector
 * loop above (2.1 us at any distance); all others stay with memcpy, which
 * is faster when the distance is safe. */
static inline void
kvt_memcpy_cached(char *dst, const char *src, size_t len)
{
    uintptr_t dist = ((uintptr_t)dst - (uintptr_t)src) & 4095;

    if (len >= KVT_ALIAS_MIN && dist != 0 &&
        (dist < KVT_ALIAS_NEAR || dist > 4096 - KVT_ALIAS_NEAR))
        kvt_memcpy_vec(dst, src, len);
    else
        memcpy(dst, src, len);
}

/* Copy len bytes (non-temporal stores if stream) in steps of KVT_STEP,
 * stopping early once another job of the call has faulted. */
static void
kvt_copy_steps(char *dst, const char *src, size_t len, int stream,
               const kvt_fault *fault)
{
    for (size_t off = 0; off < len && !kvt_fault_seen(fault); off += KVT_STEP) {
        size_t n = len - off < KVT_STEP ? len - off : KVT_STEP;

        if (stream)
            kvt_memcpy_nt(dst + off, src + off, n);
        else
            kvt_memcpy_cached(dst + off, src + off, n);
    }
}

typedef struct {
    char *dst;
    const char *src;
    size_t len;
    int move;         /* the buffers overlap: one memmove of all */
    kvt_fault *fault; /* shared by the jobs of the call */
} kvt_copy_job;

static void
kvt_copy_work(void *arg)
{
    kvt_copy_job *job = arg;

    if (job->move)
        memmove(job->dst, job->src, job->len);
    else
        kvt_copy_steps(job->dst, job->src, job->len, job->len >= KVT_STREAM_MIN,
                       job->fault);
}

static void *
kvt_copy_worker(void *arg)
{
    kvt_copy_job *job = arg;

    kvt_guarded(kvt_copy_work, job, job->fault);
    return NULL;
}

/* Copy len bytes from src to dst over up to threads threads (0 = auto).
 * Returns 0, or EFAULT if the fault guard caught a SIGBUS at *fault_addr
 * (dst is then partly written). */
static int
kvt_copy(char *dst, const char *src, size_t len, size_t threads, uintptr_t *fault_addr)
{
    kvt_copy_job jobs[KVT_MAX_THREADS];
    kvt_fault fault = {0, 0};
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    /* Overlapping ranges (two views of one buffer): chunks copied in parallel
     * would read bytes another chunk already overwrote, so use one memmove. */
    int move = d < s + len && s < d + len;
    size_t chunk, off;
    int n, njobs = 0;

    if (len == 0)
        return 0;
    n = move ? 1 : kvt_threads_for(len, threads, KVT_COPY_AUTO_THREADS);
    /* Chunks are whole pages, so no two threads write the same page.  (One
     * job skips the division: small copies are the common case.) */
    chunk = n == 1 ? len : (len + (size_t)n - 1) / (size_t)n;
    chunk = (chunk + KVT_PAGE - 1) / KVT_PAGE * KVT_PAGE;
    for (off = 0; off < len; off += chunk) {
        jobs[njobs].dst = dst + off;
        jobs[njobs].src = src + off;
        jobs[njobs].len = len - off < chunk ? len - off : chunk;
        jobs[njobs].move = move;
        jobs[njobs].fault = &fault;
        njobs++;
    }
    kvt_run_jobs(kvt_copy_worker, jobs, sizeof jobs[0], njobs);
    if (fault.hit) {
        *fault_addr = fault.addr;
        return EFAULT;
    }
    return 0;
}

typedef struct {
    uintptr_t base;   /* start of the first page the buffer overlaps */
    uintptr_t start;  /* start of the buffer itself (base <= start) */
    size_t first;     /* pages [first, last) relative to base */
    size_t last;
    kvt_fault *fault; /* shared by the jobs of the call */
} kvt_touch_job;

static void
kvt_touch_work(void *arg)
{
    kvt_touch_job *job = arg;

    for (size_t i = job->first; i < job->last; i++) {
        uintptr_t p = job->base + i * KVT_PAGE;

        if ((i - job->first) % (KVT_STEP / KVT_PAGE) == 0 && kvt_fault_seen(job->fault))
            break; /* another job faulted */
        if (p < job->start)
            p = job->start;
        /* An atomic add of 0 is a write fault (so the page is mapped writable,
         * not just readable) that changes nothing, even if another thread or
         * process writes that byte at the same moment: a plain read followed by
         * a write back could undo their write. */
        __atomic_fetch_add((unsigned char *)p, 0, __ATOMIC_RELAXED);
    }
}

static void *
kvt_touch_worker(void *arg)
{
    kvt_touch_job *job = arg;

    kvt_guarded(kvt_touch_work, job, job->fault);
    return NULL;
}

/* Touch every page that [buf, buf+len) overlaps, over up to threads threads
 * (0 = auto), and set *pages to their number.  Returns 0, or EFAULT if the
 * fault guard caught a SIGBUS at *fault_addr. */
static int
kvt_prefault(char *buf, size_t len, size_t threads, size_t *pages,
             uintptr_t *fault_addr)
{
    kvt_touch_job jobs[KVT_MAX_THREADS];
    kvt_fault fault = {0, 0};
    uintptr_t start = (uintptr_t)buf;
    uintptr_t base = start & ~(uintptr_t)(KVT_PAGE - 1);
    size_t per, first;
    int n, njobs = 0;

    *pages = 0;
    if (len == 0)
        return 0;
    *pages = (start + len - base + KVT_PAGE - 1) / KVT_PAGE;
    n = kvt_threads_for(len, threads, KVT_PREFAULT_AUTO_THREADS);
    per = (*pages + (size_t)n - 1) / (size_t)n;
    for (first = 0; first < *pages; first += per) {
        jobs[njobs].base = base;
        jobs[njobs].start = start;
        jobs[njobs].first = first;
        jobs[njobs].last = *pages - first < per ? *pages : first + per;
        jobs[njobs].fault = &fault;
        njobs++;
    }
    kvt_run_jobs(kvt_touch_worker, jobs, sizeof jobs[0], njobs);
    if (fault.hit) {
        *fault_addr = fault.addr;
        return EFAULT;
    }
    return 0;
}

/* One piece of a gather or scatter: its memory and where it goes in (or comes
 * from in) the flat buffer. */
typedef struct {
    char *ptr;
    size_t len;
    size_t off; /* offset in the flat buffer: the sum of the earlier lengths */
} kvt_piece;

typedef struct {
    char *flat;
    const kvt_piece *pieces;
    size_t npieces;
    size_t lo, hi; /* this job copies the bytes [lo, hi) of flat */
    int gather;    /* 1: pieces -> flat; 0: flat -> pieces */
    int stream;    /* non-temporal stores: decided on the whole call's size, since
                    * a block gathered from many small pages is still a big copy */
    int move;      /* buffers overlap: memmove piece after piece, all of them */
    kvt_fault *fault; /* shared by the jobs of the call */
} kvt_vec_job;

static void
kvt_vec_work(void *arg)
{
    kvt_vec_job *job = arg;
    const kvt_piece *p = job->pieces;
    size_t i = 0, hi = job->npieces;

    if (job->move) {
        for (i = 0; i < job->npieces; i++) {
            if (job->gather)
                memmove(job->flat + p[i].off, p[i].ptr, p[i].len);
            else
                memmove(p[i].ptr, job->flat + p[i].off, p[i].len);
        }
        return;
    }

    /* The ends of the pieces ascend: binary search for the first piece that
     * ends after lo, so each of the threads skips the others' pieces fast. */
    while (i < hi) {
        size_t mid = i + (hi - i) / 2;
        if (p[mid].off + p[mid].len <= job->lo)
            i = mid + 1;
        else
            hi = mid;
    }
    for (; i < job->npieces && p[i].off < job->hi; i++) {
        size_t a = p[i].off > job->lo ? p[i].off : job->lo;
        size_t b = p[i].off + p[i].len < job->hi ? p[i].off + p[i].len : job->hi;
        char *piece;

        if (b <= a)
            continue; /* an empty piece (whose pointer may even be NULL) */
        piece = p[i].ptr + (a - p[i].off);
        char *to = job->gather ? job->flat + a : piece;
        const char *from = job->gather ? piece : job->flat + a;

        /* Stops early, within a piece too, once another job has faulted. */
        kvt_copy_steps(to, from, b - a, job->stream, job->fault);
    }
}

static void *
kvt_vec_worker(void *arg)
{
    kvt_vec_job *job = arg;

    kvt_guarded(kvt_vec_work, job, job->fault);
    return NULL;
}

static int
kvt_cmp_piece_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const kvt_piece *)a)->ptr;
    uintptr_t y = (uintptr_t)((const kvt_piece *)b)->ptr;
    return (x > y) - (x < y);
}

/* Whether a byte written by the gather/scatter is also read or written by
 * another part of it: the flat buffer against every piece, and if asked
 * (a scatter over several threads: its pieces are all written, and threads
 * do not keep their order) the pieces against each other.  When in doubt (no
 * memory to sort with) the answer is yes. */
static int
kvt_vec_overlaps(const char *flat, const kvt_piece *pieces, size_t npieces,
                 size_t total, int pieces_too)
{
    uintptr_t f = (uintptr_t)flat;
    kvt_piece *sorted;
    uintptr_t end = 0;
    size_t i, n = 0;

    for (i = 0; i < npieces; i++) {
        uintptr_t s = (uintptr_t)pieces[i].ptr;
        if (pieces[i].len && s < f + total && f < s + pieces[i].len)
            return 1;
    }
    if (!pieces_too || npieces < 2)
        return 0;
    sorted = malloc(npieces * sizeof *sorted);
    if (sorted == NULL)
        return 1;
    for (i = 0; i < npieces; i++) {
        if (pieces[i].len)
            sorted[n++] = pieces[i];
    }
    qsort(sorted, n, sizeof *sorted, kvt_cmp_piece_ptr);
    for (i = 0; i < n; i++) {
        uintptr_t s = (uintptr_t)sorted[i].ptr;
        if (i > 0 && s < end)
            break;
        if (s + sorted[i].len > end)
            end = s + sorted[i].len;
    }
    free(sorted);
    return i < n;
}

/* Gather (pieces -> flat) or scatter (flat -> pieces) total bytes, over up to
 * threads threads (0 = auto).  The threads split the flat buffer, not the
 * list of pieces, so many small pieces and a few big ones spread alike.
 * Returns 0, or EFAULT if the fault guard caught a SIGBUS at *fault_addr
 * (the destination is then partly written). */
static int
kvt_gather_scatter(char *flat, const kvt_piece *pieces, size_t npieces,
                   size_t total, size_t threads, int gather, uintptr_t *fault_addr)
{
    kvt_vec_job jobs[KVT_MAX_THREADS];
    kvt_fault fault = {0, 0};
    size_t chunk, off;
    int n, move, njobs = 0;

    if (total == 0)
        return 0;
    n = kvt_threads_for(total, threads, KVT_COPY_AUTO_THREADS);
    /* Overlap (views of one buffer): copy piece after piece as by memmove,
     * so the result is the one of copying them in order, as documented.
     * Pieces that only overlap each other are fine on one thread, which
     * copies them in order (a gather only reads them anyway). */
    move = kvt_vec_overlaps(flat, pieces, npieces, total, !gather && n > 1);
    if (move)
        n = 1;
    chunk = (total + (size_t)n - 1) / (size_t)n;
    chunk = (chunk + KVT_PAGE - 1) / KVT_PAGE * KVT_PAGE;
    for (off = 0; off < total; off += chunk) {
        jobs[njobs].flat = flat;
        jobs[njobs].pieces = pieces;
        jobs[njobs].npieces = npieces;
        jobs[njobs].lo = off;
        jobs[njobs].hi = total - off < chunk ? total : off + chunk;
        jobs[njobs].gather = gather;
        jobs[njobs].stream = total >= KVT_STREAM_MIN;
        jobs[njobs].move = move;
        jobs[njobs].fault = &fault;
        njobs++;
    }
    kvt_run_jobs(kvt_vec_worker, jobs, sizeof jobs[0], njobs);
    if (fault.hit) {
        *fault_addr = fault.addr;
        return EFAULT;
    }
    return 0;
}

typedef struct {
    const void *buf;
    size_t len;
    XXH64_hash_t hash;
} kvt_hash_job;

static void
kvt_hash_work(void *arg)
{
    kvt_hash_job *job = arg;

    job->hash = XXH3_64bits(job->buf, job->len);
}

/* Set *hash to the XXH3-64 (seed 0) of len bytes at buf.  Returns 0, or
 * EFAULT if the fault guard caught a SIGBUS at *fault_addr. */
static int
kvt_checksum(const void *buf, size_t len, XXH64_hash_t *hash, uintptr_t *fault_addr)
{
    kvt_hash_job job = {buf, len, 0};
    kvt_fault fault = {0, 0};

    kvt_guarded(kvt_hash_work, &job, &fault);
    if (fault.hit) {
        *fault_addr = fault.addr;
        return EFAULT;
    }
    *hash = job.hash;
    return 0;
}

/* scatter_hash copies and hashes in chunks of 16 KiB: a chunk is copied, then
 * hashed from the source while its lines are still in L1 (48 KiB per core on
 * the Xeon we measured, 32 KiB on most x86), so the source is read from memory
 * once, not twice.  Measured there (31 blocks of 2 MiB from /dev/shm into 8
 * layer arrays, non-temporal stores): 16 and 64 KiB chunks ~11 ms, 4 KiB
 * ~13.5 ms (the cost of an update call per chunk), against ~16 ms for hashing
 * each block, then copying it.  Hashing the destination instead needs it in
 * the cache (cached stores, which cost more than streaming ones here): 13-14 ms.
 * Hashing the source is no weaker than the check-then-copy it replaces: either
 * way a writer changing the source between the two reads goes unseen, and no
 * byte is read from memory twice here. */
#define KVT_HASH_CHUNK ((size_t)16 << 10)

/* One source of a scatter_hash and the pieces it fills, in order, from its
 * start (their off is the offset in src); the bytes of src past the last piece
 * are hashed but not copied. */
typedef struct {
    const char *src;
    size_t len;
    const kvt_piece *pieces;
    size_t npieces;
} kvt_block;

typedef struct {
    const kvt_block *blocks;
    size_t first, last;    /* this job's blocks: [first, last) */
    int stream;            /* non-temporal stores (decided on the whole call) */
    int hash;              /* 0: copy only (hashes[b] = 0) */
    XXH64_hash_t *hashes;  /* the job writes hashes[first..last) */
    kvt_fault *fault;      /* shared by the jobs of the call */
} kvt_blocks_job;

static void
kvt_scatter_hash_work(void *arg)
{
    kvt_blocks_job *job = arg;
    XXH3_state_t state; /* 576 bytes, on this thread's stack: no malloc while armed */

    for (size_t b = job->first; b < job->last; b++) {
        const kvt_block *blk = &job->blocks[b];
        size_t done = 0; /* bytes of src copied (where a piece takes them) and hashed */

        XXH3_64bits_reset(&state);
        /* Piece after piece; i == npieces is the tail of src past the pieces (hashed
         * only: a copy without the hash stops at the last piece). */
        for (size_t i = 0; i <= blk->npieces; i++) {
            const kvt_piece *p = i < blk->npieces ? &blk->pieces[i] : NULL;
            size_t end = p != NULL ? p->off + p->len : job->hash ? blk->len : done;

            while (done < end) {
                size_t n = end - done < KVT_HASH_CHUNK ? end - done : KVT_HASH_CHUNK;
                const char *from = blk->src + done;

                if (kvt_fault_seen(job->fault))
                    return; /* another job faulted: the call fails anyway */
                if (p != NULL) {
                    char *to = p->ptr + (done - p->off);

                    if (job->stream)
                        kvt_memcpy_nt(to, from, n);
                    else
                        kvt_memcpy_cached(to, from, n);
                }
                if (job->hash)
                    XXH3_64bits_update(&state, from, n);
                done += n;
            }
        }
        job->hashes[b] = job->hash ? XXH3_64bits_digest(&state) : 0;
    }
}

static void *
kvt_scatter_hash_worker(void *arg)
{
    kvt_blocks_job *job = arg;

    kvt_guarded(kvt_scatter_hash_work, job, job->fault);
    return NULL;
}

/* A span of memory a scatter_hash reads (a source) or writes (a piece). */
typedef struct {
    uintptr_t start, end;
    int written;
} kvt_span;

static int
kvt_cmp_span(const void *a, const void *b)
{
    uintptr_t x = ((const kvt_span *)a)->start, y = ((const kvt_span *)b)->start;
    return (x > y) - (x < y);
}

/* Whether a byte a scatter_hash writes is also read or written by another
 * part of it (sources may share bytes: they are only read).  Returns 1 or 0,
 * or -1 without memory to sort with. */
static int
kvt_blocks_overlap(const kvt_block *blocks, size_t nblocks, size_t npieces)
{
    kvt_span *spans = malloc((nblocks + npieces ? nblocks + npieces : 1) * sizeof *spans);
    uintptr_t end_any = 0, end_written = 0;
    size_t n = 0, i;
    int hit = 0;

    if (spans == NULL)
        return -1;
    for (size_t b = 0; b < nblocks; b++) {
        if (blocks[b].len)
            spans[n++] = (kvt_span){(uintptr_t)blocks[b].src,
                                    (uintptr_t)blocks[b].src + blocks[b].len, 0};
        for (i = 0; i < blocks[b].npieces; i++) {
            const kvt_piece *p = &blocks[b].pieces[i];
            if (p->len)
                spans[n++] = (kvt_span){(uintptr_t)p->ptr, (uintptr_t)p->ptr + p->len, 1};
        }
    }
    qsort(spans, n, sizeof *spans, kvt_cmp_span);
    /* By start: a span overlaps an earlier one iff it starts before the
     * furthest end of those; it matters if either of the two is written. */
    for (i = 0; i < n && !hit; i++) {
        hit = spans[i].start < (spans[i].written ? end_any : end_written);
        if (spans[i].end > end_any)
            end_any = spans[i].end;
        if (spans[i].written && spans[i].end > end_written)
            end_written = spans[i].end;
    }
    free(spans);
    return hit;
}

/* Fill each block's pieces from its src and set hashes[b] to the XXH3-64
 * (seed 0) of all of blocks[b].src, reading each source byte from memory
 * once; npieces is the number of pieces of all blocks.  The threads (up to
 * threads, 0 = auto) split the blocks, not the bytes: a block is copied and
 * hashed by one thread, since its hash is one sequential state.  Returns 0;
 * EINVAL if a piece overlaps a source or another piece (nothing is copied);
 * ENOMEM; or EFAULT if the fault guard caught a SIGBUS at *fault_addr (the
 * pieces are then partly written). */
static int
kvt_scatter_hash(const kvt_block *blocks, size_t nblocks, size_t npieces, size_t threads,
                 int hash, XXH64_hash_t *hashes, uintptr_t *fault_addr)
{
    kvt_blocks_job jobs[KVT_MAX_THREADS];
    kvt_fault fault = {0, 0};
    size_t total = 0, sum = 0, b = 0;
    int n, overlap, njobs = 0;

    if (nblocks == 0)
        return 0;
    overlap = kvt_blocks_overlap(blocks, nblocks, npieces);
    if (overlap != 0)
        return overlap < 0 ? ENOMEM : EINVAL;
    for (b = 0; b < nblocks; b++)
        total += blocks[b].len;
    n = kvt_threads_for(total, threads, KVT_COPY_AUTO_THREADS);
    if ((size_t)n > nblocks)
        n = (int)nblocks;
    /* Runs of consecutive blocks, each ending once the bytes so far reach the
     * next n-th of the total; every job gets at least one block, the last one
     * all that are left. */
    b = 0;
    for (int k = 0; k < n && b < nblocks; k++) {
        size_t goal = total / (size_t)n * (size_t)(k + 1);

        jobs[njobs].blocks = blocks;
        jobs[njobs].first = b;
        do {
            sum += blocks[b++].len;
        } while (b < nblocks && (k == n - 1 || sum < goal));
        jobs[njobs].last = b;
        jobs[njobs].stream = total >= KVT_STREAM_MIN;
        jobs[njobs].hash = hash;
        jobs[njobs].hashes = hashes;
        jobs[njobs].fault = &fault;
        njobs++;
    }
    kvt_run_jobs(kvt_scatter_hash_worker, jobs, sizeof jobs[0], njobs);
    if (fault.hit) {
        *fault_addr = fault.addr;
        return EFAULT;
    }
    return 0;
}

typedef struct {
    int fd;
    int write;     /* 1: pwrite buf to the file; 0: pread the file into buf */
    char *buf;
    size_t len;
    off_t offset;
    size_t done;   /* bytes transferred so far */
    int *err;      /* shared by the jobs of one call: the first errno, or 0 */
} kvt_io_job;

static void *
kvt_io_worker(void *arg)
{
    kvt_io_job *job = arg;
    int short_read = 0;

    while (job->done < job->len) {
        size_t want = job->len - job->done;
        ssize_t got;
        int e, none = 0;

        /* Another chunk failed: the call fails, so stop early. */
        if (__atomic_load_n(job->err, __ATOMIC_RELAXED) != 0)
            break;
        if (want > KVT_IO_MAX_REQUEST)
            want = KVT_IO_MAX_REQUEST;
        if (job->write)
            got = pwrite(job->fd, job->buf + job->done, want,
                         job->offset + (off_t)job->done);
        else
            got = pread(job->fd, job->buf + job->done, want,
                        job->offset + (off_t)job->done);
        if (got > 0) {
            /* A short transfer: go on from where it stopped. */
            job->done += (size_t)got;
            short_read = !job->write && (size_t)got < want;
            continue;
        }
        if (got == 0 && !job->write)
            break; /* end of file */
        e = got == 0 ? EIO : errno; /* a write that writes nothing would spin */
        if (e == EINTR)
            continue;
        /* O_DIRECT: a read that stopped short at the end of the file leaves
         * an unaligned position, where the next read fails with EINVAL
         * instead of returning 0.  It is the end of the file all the same. */
        if (e == EINVAL && short_read)
            break;
        __atomic_compare_exchange_n(job->err, &none, e, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
        break;
    }
    return NULL;
}

/* How many of len bytes at offset a read of the regular file fd should ask
 * for: those up to the end of the file, rounded up to whole 4096-byte blocks
 * on an O_DIRECT descriptor (the caller aligns offset).  An O_DIRECT read
 * past the end of the file zero-fills the buffer to the end of the request
 * (iomap on ext4 and XFS), which would break "the rest of buf is left alone";
 * this way only the tail of the last block is written.  Anything else (not a
 * regular file, fstat failing) keeps len: the read itself will tell. */
static size_t
kvt_read_len(int fd, size_t len, off_t offset)
{
    struct stat st;
    size_t avail;

    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size - offset >= (off_t)len)
        return len;
    avail = st.st_size > offset ? (size_t)(st.st_size - offset) : 0;
#ifdef O_DIRECT
    {
        int flags = fcntl(fd, F_GETFL);
        if (flags != -1 && (flags & O_DIRECT))
            avail = (avail + KVT_PAGE - 1) / KVT_PAGE * KVT_PAGE;
    }
#endif
    return avail < len ? avail : len;
}

/* pwrite (writing=1) or pread (writing=0) all len bytes of buf at offset of fd,
 * transfers of 8 MiB or more in chunks over up to threads threads (0: 4).
 * Returns 0 and sets *done to the bytes transferred (less than len only for
 * a read that reached the end of the file: those before the first chunk that
 * came up short), or returns the errno of the first failure. */
static int
kvt_pio(int fd, int writing, char *buf, size_t len, off_t offset, size_t threads,
        size_t *done)
{
    kvt_io_job jobs[KVT_MAX_THREADS];
    size_t n = threads ? threads : KVT_IO_AUTO_THREADS;
    size_t chunk, off;
    int err = 0, njobs = 0;

    if (!writing)
        len = kvt_read_len(fd, len, offset);
    if (len < KVT_IO_PARALLEL_MIN)
        n = 1;
    if (n > KVT_MAX_THREADS)
        n = KVT_MAX_THREADS;
    if (n > len / KVT_IO_MIN_PER_THREAD)
        n = len / KVT_IO_MIN_PER_THREAD;
    if (n < 1)
        n = 1;
    /* Whole pages per chunk: with O_DIRECT the caller aligns buf, len and
     * offset to 4096, and then every chunk is aligned too. */
    chunk = (len + n - 1) / n;
    chunk = (chunk + KVT_PAGE - 1) / KVT_PAGE * KVT_PAGE;
    if (chunk == 0)
        chunk = len; /* len == 0: one empty job, no system call */
    off = 0;
    do {
        jobs[njobs].fd = fd;
        jobs[njobs].write = writing;
        jobs[njobs].buf = buf + off;
        jobs[njobs].len = len - off < chunk ? len - off : chunk;
        jobs[njobs].offset = offset + (off_t)off;
        jobs[njobs].done = 0;
        jobs[njobs].err = &err;
        njobs++;
        off += chunk;
    } while (off < len);
    kvt_run_jobs(kvt_io_worker, jobs, sizeof jobs[0], njobs);
    if (err != 0)
        return err;
    *done = 0;
    for (int i = 0; i < njobs; i++) {
        *done += jobs[i].done;
        if (jobs[i].done < jobs[i].len)
            break;
    }
    return 0;
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

/* The offset of addr in view, or -1 if it is not in it. */
static Py_ssize_t
kvt_offset_in(uintptr_t addr, const Py_buffer *view)
{
    uintptr_t start = (uintptr_t)view->buf;

    if (addr >= start && addr - start < (uintptr_t)view->len)
        return (Py_ssize_t)(addr - start);
    return -1;
}

/* Raise OSError(EFAULT) for a SIGBUS the guard caught at byte off of the
 * buffer called name (or, if name is NULL, at addr, in none of the call's
 * buffers as far as we can tell); returns NULL.  The message starts with
 * "memory fault (SIGBUS)", which kvtier._accel.is_memory_fault relies on. */
static PyObject *
kvt_raise_fault(const char *name, Py_ssize_t off, uintptr_t addr)
{
    static const char why[] = "the file mapped there was truncated, or its file "
                              "system could not supply the page";
    PyObject *msg, *args;

    if (name != NULL)
        msg = PyUnicode_FromFormat("memory fault (SIGBUS) at byte %zd of %s: %s",
                                   off, name, why);
    else
        msg = PyUnicode_FromFormat("memory fault (SIGBUS) at address %p: %s",
                                   (void *)addr, why);
    if (msg == NULL)
        return NULL;
    args = Py_BuildValue("(iN)", EFAULT, msg);
    if (args != NULL) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
    }
    return NULL;
}

/* kvt_raise_fault for a fault in one of two buffers (b may be NULL). */
static PyObject *
kvt_raise_fault2(uintptr_t addr, const char *name_a, const Py_buffer *a,
                 const char *name_b, const Py_buffer *b)
{
    Py_ssize_t off = kvt_offset_in(addr, a);

    if (off >= 0)
        return kvt_raise_fault(name_a, off, addr);
    if (b != NULL && (off = kvt_offset_in(addr, b)) >= 0)
        return kvt_raise_fault(name_b, off, addr);
    return kvt_raise_fault(NULL, -1, addr);
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
"With the fault guard installed (install_fault_guard), a SIGBUS while\n"
"touching a buffer (the file mapped there truncated, say) raises OSError\n"
"with errno EFAULT, \"memory fault (SIGBUS) at byte N of dst: ...\" (or\n"
"src), and dst is left partly written; without the guard the process dies.\n"
"\n"
"Raises ValueError if dst is too small, a buffer is not C-contiguous or\n"
"threads < 0; TypeError if dst is read-only or an argument is not a buffer.");

static PyObject *
py_copy(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"dst", "src", "threads", NULL};
    PyObject *dst_obj, *src_obj, *result;
    Py_ssize_t threads = 0;
    Py_buffer dst, src;
    uintptr_t fault_addr = 0;
    int err;

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
    err = kvt_copy(dst.buf, src.buf, (size_t)src.len, (size_t)threads, &fault_addr);
    Py_END_ALLOW_THREADS

    if (err != 0)
        result = kvt_raise_fault2(fault_addr, "dst", &dst, "src", &src);
    else
        result = PyLong_FromSsize_t(src.len);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
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
"With the fault guard installed (install_fault_guard), a SIGBUS while\n"
"touching buf (the file mapped there truncated, say) raises OSError with\n"
"errno EFAULT, \"memory fault (SIGBUS) at byte N of buf: ...\"; without\n"
"the guard the process dies.\n"
"\n"
"Raises ValueError if buf is not C-contiguous or threads < 0; TypeError if\n"
"buf is read-only or not a buffer.");

static PyObject *
py_prefault(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "threads", NULL};
    PyObject *buf_obj, *result;
    Py_ssize_t threads = 0;
    Py_buffer buf;
    size_t pages;
    uintptr_t fault_addr = 0;
    int err;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n:prefault", kwlist,
                                     &buf_obj, &threads))
        return NULL;
    if (kvt_check_threads(threads) < 0)
        return NULL;
    if (kvt_get_buffer(buf_obj, &buf, "buf", 1) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    err = kvt_prefault(buf.buf, (size_t)buf.len, (size_t)threads, &pages, &fault_addr);
    Py_END_ALLOW_THREADS

    if (err != 0)
        result = kvt_raise_fault2(fault_addr, "buf", &buf, NULL, NULL);
    else
        result = PyLong_FromSize_t(pages);
    PyBuffer_Release(&buf);
    return result;
}

PyDoc_STRVAR(py_checksum_doc,
"checksum($module, buf)\n"
"--\n"
"\n"
"Return the XXH3-64 hash (seed 0) of the bytes of buf, as an int.\n"
"\n"
"buf is any C-contiguous buffer; the result equals\n"
"xxhash.xxh3_64_intdigest(bytes(buf)).  The GIL is released for buffers of\n"
"64 KiB or more.\n"
"\n"
"With the fault guard installed (install_fault_guard), a SIGBUS while\n"
"touching buf (the file mapped there truncated, say) raises OSError with\n"
"errno EFAULT, \"memory fault (SIGBUS) at byte N of buf: ...\"; without\n"
"the guard the process dies.\n"
"\n"
"Raises ValueError if buf is not C-contiguous; TypeError if it is not a\n"
"buffer.");

static PyObject *
py_checksum(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", NULL};
    PyObject *buf_obj, *result;
    Py_buffer buf;
    XXH64_hash_t hash = 0;
    uintptr_t fault_addr = 0;
    int err;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:checksum", kwlist, &buf_obj))
        return NULL;
    if (kvt_get_buffer(buf_obj, &buf, "buf", 0) < 0)
        return NULL;

    if ((size_t)buf.len >= KVT_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        err = kvt_checksum(buf.buf, (size_t)buf.len, &hash, &fault_addr);
        Py_END_ALLOW_THREADS
    }
    else {
        err = kvt_checksum(buf.buf, (size_t)buf.len, &hash, &fault_addr);
    }

    if (err != 0)
        result = kvt_raise_fault2(fault_addr, "buf", &buf, NULL, NULL);
    else
        result = PyLong_FromUnsignedLongLong((unsigned long long)hash);
    PyBuffer_Release(&buf);
    return result;
}

/* kvt_raise_fault for a gather or scatter: the fault is in flat (called
 * flat_name) or in one of the n views of the pieces. */
static PyObject *
kvt_raise_vec_fault(uintptr_t addr, const Py_buffer *flat, const char *flat_name,
                    const Py_buffer *views, Py_ssize_t n)
{
    Py_ssize_t off = kvt_offset_in(addr, flat);

    if (off >= 0)
        return kvt_raise_fault(flat_name, off, addr);
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((off = kvt_offset_in(addr, &views[i])) >= 0) {
            char name[40];

            PyOS_snprintf(name, sizeof name, "pieces[%zd]", i);
            return kvt_raise_fault(name, off, addr);
        }
    }
    return kvt_raise_fault(NULL, -1, addr);
}

/* gather (gather=1) and scatter (gather=0): flat is dst or src. */
static PyObject *
kvt_vec_binding(PyObject *flat_obj, PyObject *pieces_obj, Py_ssize_t threads,
                int gather)
{
    PyObject *seq = NULL, *result = NULL;
    Py_buffer flat, *views = NULL;
    kvt_piece *pieces = NULL;
    Py_ssize_t n, got = 0;
    size_t total = 0;
    uintptr_t fault_addr = 0;
    int err;

    if (kvt_check_threads(threads) < 0)
        return NULL;
    if (kvt_get_buffer(flat_obj, &flat, gather ? "dst" : "src", gather) < 0)
        return NULL;
    /* A tuple: its items stay put (and alive) whatever exporting does. */
    seq = PySequence_Tuple(pieces_obj);
    if (seq == NULL)
        goto done;
    n = PyTuple_GET_SIZE(seq);
    views = PyMem_Calloc(n ? (size_t)n : 1, sizeof *views);
    pieces = PyMem_Calloc(n ? (size_t)n : 1, sizeof *pieces);
    if (views == NULL || pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (got = 0; got < n; got++) {
        char name[40];

        PyOS_snprintf(name, sizeof name, "pieces[%zd]", got);
        if (kvt_get_buffer(PyTuple_GET_ITEM(seq, got), &views[got], name, !gather) < 0)
            goto done;
        pieces[got].ptr = views[got].buf;
        pieces[got].len = (size_t)views[got].len;
        pieces[got].off = total;
        total += (size_t)views[got].len;
    }
    if (total > (size_t)flat.len) {
        if (gather)
            PyErr_Format(PyExc_ValueError, "dst holds %zd bytes, pieces have %zu",
                         flat.len, total);
        else
            PyErr_Format(PyExc_ValueError, "src has %zd bytes, pieces need %zu",
                         flat.len, total);
        goto done;
    }

    if (total >= KVT_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        err = kvt_gather_scatter(flat.buf, pieces, (size_t)n, total, (size_t)threads,
                                 gather, &fault_addr);
        Py_END_ALLOW_THREADS
    }
    else {
        err = kvt_gather_scatter(flat.buf, pieces, (size_t)n, total, (size_t)threads,
                                 gather, &fault_addr);
    }
    if (err != 0)
        kvt_raise_vec_fault(fault_addr, &flat, gather ? "dst" : "src", views, n);
    else
        result = PyLong_FromSize_t(total);

done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(pieces);
    Py_XDECREF(seq);
    PyBuffer_Release(&flat);
    return result;
}

PyDoc_STRVAR(py_gather_doc,
"gather($module, dst, pieces, threads=0)\n"
"--\n"
"\n"
"Copy the buffers of pieces back to back into the start of dst; return the\n"
"number of bytes copied (the sum of their sizes).\n"
"\n"
"pieces is a sequence (any iterable) of C-contiguous buffers, empty ones\n"
"included; dst a writable, C-contiguous buffer at least that large; the rest\n"
"of dst is left alone.  If a piece overlaps dst, the pieces are copied in\n"
"order, each as by memmove.  Gathers of 4 MiB or more are split over up to\n"
"threads threads (0: min(4, online cpus); 1: one thread).  All buffers are\n"
"acquired first; the GIL is then released once for the whole copy (if it\n"
"moves 64 KiB or more).\n"
"\n"
"With the fault guard installed (install_fault_guard), a SIGBUS while\n"
"touching a buffer (the file mapped there truncated, say) raises OSError\n"
"with errno EFAULT, \"memory fault (SIGBUS) at byte N of dst: ...\" (or\n"
"pieces[i]), and dst is left partly written; without the guard the\n"
"process dies.\n"
"\n"
"Raises ValueError if dst is too small, a buffer is not C-contiguous or\n"
"threads < 0; TypeError if dst is read-only, pieces is not iterable or an\n"
"item or dst is not a buffer.");

static PyObject *
py_gather(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"dst", "pieces", "threads", NULL};
    PyObject *dst_obj, *pieces_obj;
    Py_ssize_t threads = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|n:gather", kwlist,
                                     &dst_obj, &pieces_obj, &threads))
        return NULL;
    return kvt_vec_binding(dst_obj, pieces_obj, threads, 1);
}

PyDoc_STRVAR(py_scatter_doc,
"scatter($module, src, pieces, threads=0)\n"
"--\n"
"\n"
"Fill the buffers of pieces, in order, from consecutive bytes of src; return\n"
"the number of bytes copied (the sum of their sizes).\n"
"\n"
"pieces is a sequence (any iterable) of writable, C-contiguous buffers, empty\n"
"ones included; src a C-contiguous buffer at least that large, whose further\n"
"bytes are ignored.  If buffers overlap, the pieces are filled in order,\n"
"each as by memmove.  Scatters of 4 MiB or more are split over up to threads\n"
"threads (0: min(4, online cpus); 1: one thread).  All buffers are acquired\n"
"first; the GIL is then released once for the whole copy (if it moves 64 KiB\n"
"or more).\n"
"\n"
"With the fault guard installed (install_fault_guard), a SIGBUS while\n"
"touching a buffer (the file mapped there truncated, say) raises OSError\n"
"with errno EFAULT, \"memory fault (SIGBUS) at byte N of src: ...\" (or\n"
"pieces[i]), and the pieces are left partly written; without the guard\n"
"the process dies.\n"
"\n"
"Raises ValueError if src is too small, a buffer is not C-contiguous or\n"
"threads < 0; TypeError if a piece is read-only, pieces is not iterable or\n"
"an item or src is not a buffer.");

static PyObject *
py_scatter(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"src", "pieces", "threads", NULL};
    PyObject *src_obj, *pieces_obj;
    Py_ssize_t threads = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|n:scatter", kwlist,
                                     &src_obj, &pieces_obj, &threads))
        return NULL;
    return kvt_vec_binding(src_obj, pieces_obj, threads, 0);
}

/* kvt_raise_fault for a scatter_hash: the fault is in srcs[i] or pieces[i][j];
 * views holds, block after block, its source then its pieces. */
static PyObject *
kvt_raise_blocks_fault(uintptr_t addr, const Py_buffer *views, const kvt_block *blocks,
                       Py_ssize_t nblocks)
{
    const Py_buffer *v = views;
    char name[64];
    Py_ssize_t off;

    for (Py_ssize_t i = 0; i < nblocks; i++) {
        if ((off = kvt_offset_in(addr, v++)) >= 0) {
            PyOS_snprintf(name, sizeof name, "srcs[%zd]", i);
            return kvt_raise_fault(name, off, addr);
        }
        for (size_t j = 0; j < blocks[i].npieces; j++) {
            if ((off = kvt_offset_in(addr, v++)) >= 0) {
                PyOS_snprintf(name, sizeof name, "pieces[%zd][%zu]", i, j);
                return kvt_raise_fault(name, off, addr);
            }
        }
    }
    return kvt_raise_fault(NULL, -1, addr);
}

/* The arrays of one scatter_hash call (scatter_hash, scatter_hash_at): its buffers,
 * blocks, pieces and hashes.  kvt_call_alloc: 0, or -1 with MemoryError. */
typedef struct {
    Py_buffer *views;
    kvt_block *blocks;
    kvt_piece *pieces;
    XXH64_hash_t *hashes;
} kvt_call_mem;

static int
kvt_call_alloc(kvt_call_mem *m, size_t nviews, size_t npieces, size_t nblocks)
{
    m->views = PyMem_Calloc(nviews ? nviews : 1, sizeof *m->views);
    m->pieces = PyMem_Calloc(npieces ? npieces : 1, sizeof *m->pieces);
    m->blocks = PyMem_Calloc(nblocks ? nblocks : 1, sizeof *m->blocks);
    m->hashes = PyMem_Calloc(nblocks ? nblocks : 1, sizeof *m->hashes);
    if (m->views == NULL || m->pieces == NULL || m->blocks == NULL || m->hashes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Release the first got buffers of m and free its arrays. */
static void
kvt_call_free(kvt_call_mem *m, Py_ssize_t got)
{
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&m->views[i]);
    PyMem_Free(m->views);
    PyMem_Free(m->pieces);
    PyMem_Free(m->blocks);
    PyMem_Free(m->hashes);
}

/* kvt_scatter_hash over m's n blocks (total bytes: the GIL released from
 * KVT_NOGIL_MIN on).  0; EFAULT (the caller raises, naming the buffer at
 * *fault_addr); or -1 with ValueError (an overlap) or MemoryError. */
static int
kvt_call_run(kvt_call_mem *m, Py_ssize_t n, size_t npieces, size_t total, Py_ssize_t threads,
             int hash, uintptr_t *fault_addr)
{
    int err;

    if (total >= KVT_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        err = kvt_scatter_hash(m->blocks, (size_t)n, npieces, (size_t)threads, hash, m->hashes,
                               fault_addr);
        Py_END_ALLOW_THREADS
    }
    else {
        err = kvt_scatter_hash(m->blocks, (size_t)n, npieces, (size_t)threads, hash, m->hashes,
                               fault_addr);
    }
    if (err == 0 || err == EFAULT)
        return err;
    if (err == EINVAL)
        PyErr_SetString(PyExc_ValueError, "a piece overlaps a source or another piece");
    else
        PyErr_NoMemory();
    return -1;
}

/* The hashes of m's n blocks as a list of ints, or NULL with an error. */
static PyObject *
kvt_call_hashes(const kvt_call_mem *m, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);

    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong((unsigned long long)m->hashes[i]);

        if (h == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, h);
    }
    return out;
}

PyDoc_STRVAR(py_scatter_hash_doc,
"scatter_hash($module, srcs, pieces, threads=0, hash=True)\n"
"--\n"
"\n"
"Fill the buffers of pieces[i] from srcs[i], as scatter(srcs[i], pieces[i])\n"
"does, for every i, and return the XXH3-64 hash (seed 0) of each whole\n"
"srcs[i] as a list of ints, reading each source byte from memory once.\n"
"With hash=False the same copies, no hash, and None is returned (many\n"
"blocks copied in one call).\n"
"\n"
"hashes[i] equals checksum(srcs[i]), the bytes past its pieces included\n"
"(they are hashed, not copied).  srcs is a sequence (any iterable) of\n"
"C-contiguous buffers; pieces a sequence of as many sequences of writable,\n"
"C-contiguous buffers, empty ones included, whose sizes add up to at most\n"
"their source's.  Sources may share memory; a piece may not share any with\n"
"a source or another piece.  Each source is copied in chunks, each hashed\n"
"right after its copy while it is still in the CPU cache.  Calls of 4 MiB\n"
"or more are split over up to threads threads (0: min(4, online cpus); 1:\n"
"one thread), by sources: each source is copied and hashed by one thread.\n"
"All buffers are acquired first; the GIL is then released once for the\n"
"whole call (if it reads 64 KiB or more).\n"
"\n"
"With the fault guard installed (install_fault_guard), a SIGBUS while\n"
"touching a buffer (the file mapped there truncated, say) raises OSError\n"
"with errno EFAULT, \"memory fault (SIGBUS) at byte N of srcs[i]: ...\" (or\n"
"pieces[i][j]), and the pieces are left partly written; without the guard\n"
"the process dies.\n"
"\n"
"Raises ValueError if srcs and pieces differ in length, a source is smaller\n"
"than its pieces, a piece overlaps a source or another piece, a buffer is\n"
"not C-contiguous or threads < 0; TypeError if a piece is read-only, srcs,\n"
"pieces or an item of pieces is not iterable or an item is not a buffer.");

static PyObject *
py_scatter_hash(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"srcs", "pieces", "threads", "hash", NULL};
    PyObject *srcs_obj, *pieces_obj, *srcs = NULL, *outer = NULL, *result = NULL;
    int hash = 1;
    PyObject **inner = NULL;  /* the tuple of pieces of each source */
    kvt_call_mem m = {0};     /* views: block after block, its source, then its pieces */
    Py_ssize_t threads = 0, n = 0, ntuples = 0, got = 0, i;
    size_t npieces = 0, total = 0, k = 0;
    uintptr_t fault_addr = 0;
    int err;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|np:scatter_hash", kwlist,
                                     &srcs_obj, &pieces_obj, &threads, &hash))
        return NULL;
    if (kvt_check_threads(threads) < 0)
        return NULL;
    /* Tuples: their items stay put (and alive) whatever exporting does. */
    if ((srcs = PySequence_Tuple(srcs_obj)) == NULL ||
        (outer = PySequence_Tuple(pieces_obj)) == NULL)
        goto done;
    n = PyTuple_GET_SIZE(srcs);
    if (PyTuple_GET_SIZE(outer) != n) {
        PyErr_Format(PyExc_ValueError, "srcs and pieces differ in length (%zd != %zd)", n,
                     PyTuple_GET_SIZE(outer));
        goto done;
    }
    inner = PyMem_Calloc(n ? (size_t)n : 1, sizeof *inner);
    if (inner == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (ntuples = 0; ntuples < n; ntuples++) {
        inner[ntuples] = PySequence_Tuple(PyTuple_GET_ITEM(outer, ntuples));
        if (inner[ntuples] == NULL)
            goto done;
        npieces += (size_t)PyTuple_GET_SIZE(inner[ntuples]);
    }
    if (kvt_call_alloc(&m, (size_t)n + npieces, npieces, (size_t)n) < 0)
        goto done;
    for (i = 0; i < n; i++) {
        Py_ssize_t nm = PyTuple_GET_SIZE(inner[i]);
        size_t need = 0;
        char name[64];

        PyOS_snprintf(name, sizeof name, "srcs[%zd]", i);
        if (kvt_get_buffer(PyTuple_GET_ITEM(srcs, i), &m.views[got], name, 0) < 0)
            goto done;
        m.blocks[i].src = m.views[got].buf;
        m.blocks[i].len = (size_t)m.views[got].len;
        m.blocks[i].pieces = &m.pieces[k];
        m.blocks[i].npieces = (size_t)nm;
        got++;
        for (Py_ssize_t j = 0; j < nm; j++, k++) {
            PyOS_snprintf(name, sizeof name, "pieces[%zd][%zd]", i, j);
            if (kvt_get_buffer(PyTuple_GET_ITEM(inner[i], j), &m.views[got], name, 1) < 0)
                goto done;
            m.pieces[k].ptr = m.views[got].buf;
            m.pieces[k].len = (size_t)m.views[got].len;
            m.pieces[k].off = need;
            need += (size_t)m.views[got].len;
            got++;
        }
        if (need > m.blocks[i].len) {
            PyErr_Format(PyExc_ValueError, "srcs[%zd] has %zu bytes, pieces[%zd] need %zu",
                         i, m.blocks[i].len, i, need);
            goto done;
        }
        total += m.blocks[i].len;
    }

    err = kvt_call_run(&m, n, npieces, total, threads, hash, &fault_addr);
    if (err == EFAULT)
        kvt_raise_blocks_fault(fault_addr, m.views, m.blocks, n);
    else if (err == 0)
        result = hash ? kvt_call_hashes(&m, n) : Py_NewRef(Py_None);

done:
    kvt_call_free(&m, got);
    for (i = 0; i < ntuples; i++)
        Py_DECREF(inner[i]);
    PyMem_Free(inner);
    Py_XDECREF(outer);
    Py_XDECREF(srcs);
    return result;
}

PyDoc_STRVAR(py_scatter_hash_at_doc,
"scatter_hash_at($module, srcs, bases, offsets, limit, threads=0, hash=True)\n"
"--\n"
"\n"
"scatter_hash with one piece a source, named by where it starts: srcs[i] is\n"
"copied into bases[i] from byte offsets[i] on (the piece is as long as the\n"
"source), for every i, without a buffer object per piece (a put's blocks\n"
"into their slots; bases may repeat).  Returns (hashes, nbytes): the XXH3-64\n"
"(seed 0) of each source, None with hash=False, and each source's size.\n"
"\n"
"Raises ValueError \"srcs, bases and offsets differ in length (N, M, K)\",\n"
"\"srcs[i] is N bytes (1..limit allowed)\", \"offsets[i] = N is negative\",\n"
"\"bases[i] holds N bytes, srcs[i] needs M at offset O\", and scatter_hash's\n"
"overlap, contiguity and threads errors; TypeError \"bases[i] is read-only\",\n"
"or when an argument is not iterable, an item not a buffer or an offset not\n"
"an integer.  With the fault guard installed, a buffer whose memory is gone\n"
"raises OSError(EFAULT) naming srcs[i] or bases[i] and the byte there.");

/* kvt_raise_fault for a scatter_hash_at: views holds each source, then its base. */
static PyObject *
kvt_raise_at_fault(uintptr_t addr, const Py_buffer *views, Py_ssize_t n)
{
    char name[64];
    Py_ssize_t off;

    for (Py_ssize_t i = 0; i < n; i++) {
        for (int b = 0; b < 2; b++) {
            if ((off = kvt_offset_in(addr, &views[2 * i + b])) >= 0) {
                PyOS_snprintf(name, sizeof name, b ? "bases[%zd]" : "srcs[%zd]", i);
                return kvt_raise_fault(name, off, addr);
            }
        }
    }
    return kvt_raise_fault(NULL, -1, addr);
}

static PyObject *
py_scatter_hash_at(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"srcs", "bases", "offsets", "limit", "threads", "hash", NULL};
    PyObject *srcs_obj, *bases_obj, *offs_obj, *result = NULL;
    PyObject *srcs = NULL, *bases = NULL, *offs = NULL, *hs = NULL, *ns = NULL;
    Py_ssize_t limit, threads = 0, n = 0, got = 0, i;
    int hash = 1, err;
    kvt_call_mem m = {0}; /* views: block after block, its source, then its base */
    size_t total = 0;
    uintptr_t fault_addr = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOn|np:scatter_hash_at", kwlist,
                                     &srcs_obj, &bases_obj, &offs_obj, &limit, &threads,
                                     &hash))
        return NULL;
    if (kvt_check_threads(threads) < 0)
        return NULL;
    /* Tuples: their items stay put (and alive) whatever exporting does. */
    if ((srcs = PySequence_Tuple(srcs_obj)) == NULL
        || (bases = PySequence_Tuple(bases_obj)) == NULL
        || (offs = PySequence_Tuple(offs_obj)) == NULL)
        goto done;
    n = PyTuple_GET_SIZE(srcs);
    if (PyTuple_GET_SIZE(bases) != n || PyTuple_GET_SIZE(offs) != n) {
        PyErr_Format(PyExc_ValueError, "srcs, bases and offsets differ in length (%zd, %zd, %zd)",
                     n, PyTuple_GET_SIZE(bases), PyTuple_GET_SIZE(offs));
        goto done;
    }
    if (kvt_call_alloc(&m, 2 * (size_t)n, (size_t)n, (size_t)n) < 0)
        goto done;
    for (i = 0; i < n; i++) {
        char name[64];
        Py_ssize_t len, off;

        PyOS_snprintf(name, sizeof name, "srcs[%zd]", i);
        if (kvt_get_buffer(PyTuple_GET_ITEM(srcs, i), &m.views[got], name, 0) < 0)
            goto done;
        len = m.views[got++].len;
        if (len < 1 || len > limit) {
            PyErr_Format(PyExc_ValueError, "srcs[%zd] is %zd bytes (1..%zd allowed)", i, len,
                         limit);
            goto done;
        }
        off = PyNumber_AsSsize_t(PyTuple_GET_ITEM(offs, i), PyExc_OverflowError);
        if (off == -1 && PyErr_Occurred())
            goto done;
        if (off < 0) {
            PyErr_Format(PyExc_ValueError, "offsets[%zd] = %zd is negative", i, off);
            goto done;
        }
        PyOS_snprintf(name, sizeof name, "bases[%zd]", i);
        if (kvt_get_buffer(PyTuple_GET_ITEM(bases, i), &m.views[got], name, 1) < 0)
            goto done;
        if (off > m.views[got].len - len) {
            PyErr_Format(PyExc_ValueError, "bases[%zd] holds %zd bytes, srcs[%zd] needs %zd at "
                         "offset %zd", i, m.views[got].len, i, len, off);
            got++;
            goto done;
        }
        m.pieces[i].ptr = (char *)m.views[got++].buf + off;
        m.pieces[i].len = (size_t)len;
        m.pieces[i].off = 0;
        m.blocks[i].src = m.views[got - 2].buf;
        m.blocks[i].len = (size_t)len;
        m.blocks[i].pieces = &m.pieces[i];
        m.blocks[i].npieces = 1;
        total += (size_t)len;
    }

    err = kvt_call_run(&m, n, (size_t)n, total, threads, hash, &fault_addr);
    if (err == EFAULT)
        kvt_raise_at_fault(fault_addr, m.views, n);
    if (err != 0 || (hash && (hs = kvt_call_hashes(&m, n)) == NULL)
        || (ns = PyList_New(n)) == NULL)
        goto done;
    for (i = 0; i < n; i++) {
        PyObject *len = PyLong_FromSize_t(m.blocks[i].len);

        if (len == NULL)
            goto done;
        PyList_SET_ITEM(ns, i, len);
    }
    result = PyTuple_Pack(2, hs != NULL ? hs : Py_None, ns);

done:
    kvt_call_free(&m, got);
    Py_XDECREF(hs);
    Py_XDECREF(ns);
    Py_XDECREF(offs);
    Py_XDECREF(bases);
    Py_XDECREF(srcs);
    return result;
}

static int
kvt_check_offset(Py_ssize_t offset)
{
    if (offset < 0) {
        PyErr_Format(PyExc_ValueError, "offset must be >= 0, got %zd", offset);
        return -1;
    }
    return 0;
}

/* pwrite_full (writing=1) and pread_full (writing=0). */
static PyObject *
kvt_pio_binding(PyObject *args, PyObject *kwargs, int writing)
{
    static char *kwlist[] = {"fd", "buf", "offset", "threads", NULL};
    PyObject *buf_obj;
    Py_ssize_t offset, threads = 0;
    Py_buffer buf;
    size_t done = 0;
    int fd, err;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs,
                                     writing ? "iOn|n:pwrite_full" : "iOn|n:pread_full",
                                     kwlist, &fd, &buf_obj, &offset, &threads))
        return NULL;
    if (kvt_check_threads(threads) < 0 || kvt_check_offset(offset) < 0)
        return NULL;
    if (kvt_get_buffer(buf_obj, &buf, "buf", !writing) < 0)
        return NULL;

    Py_BEGIN_ALLOW_THREADS
    err = kvt_pio(fd, writing, buf.buf, (size_t)buf.len, (off_t)offset, (size_t)threads,
                  &done);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&buf);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSize_t(done);
}

PyDoc_STRVAR(py_pwrite_full_doc,
"pwrite_full($module, fd, buf, offset, threads=0)\n"
"--\n"
"\n"
"Write all of buf to file descriptor fd at file position offset; return the\n"
"number of bytes written (len(buf) in bytes).\n"
"\n"
"buf is any C-contiguous buffer.  Short writes continue where they stopped\n"
"and EINTR is retried; the file position of fd is not used or moved.  Works\n"
"on O_DIRECT descriptors when the address and size of buf and offset are\n"
"aligned as the file system requires (4096 does everywhere); nothing is\n"
"checked here.  Writes of 8 MiB or more are split into chunks of at least\n"
"2 MiB (whole pages) written by up to threads threads at once (0: 4; 1: one\n"
"thread), which keeps several requests in flight.  The GIL is released.\n"
"\n"
"Raises OSError (with its errno) from the first failed write; then some of\n"
"buf may have been written.  ValueError if buf is not C-contiguous, offset\n"
"< 0 or threads < 0; TypeError if buf is not a buffer.");

static PyObject *
py_pwrite_full(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    return kvt_pio_binding(args, kwargs, 1);
}

PyDoc_STRVAR(py_pread_full_doc,
"pread_full($module, fd, buf, offset, threads=0)\n"
"--\n"
"\n"
"Read from file descriptor fd at file position offset into all of buf;\n"
"return the number of bytes read.\n"
"\n"
"That is len(buf) (in bytes) unless the file ends first: then it is the\n"
"bytes up to the end of the file, and the rest of buf is left alone (on an\n"
"O_DIRECT descriptor but for the rest of the last 4096-byte block, which\n"
"the device transfers whole: zeros past the end of a file).  buf is a\n"
"writable, C-contiguous buffer.  Short reads continue where they stopped\n"
"and EINTR is retried; the file position of fd is not used or moved.  Works\n"
"on O_DIRECT descriptors when the address and size of buf and offset are\n"
"aligned as the file system requires (4096 does everywhere); nothing is\n"
"checked here.  Reads of 8 MiB or more are split into chunks of at least\n"
"2 MiB (whole pages) read by up to threads threads at once (0: 4; 1: one\n"
"thread), which keeps several requests in flight.  The GIL is released.\n"
"\n"
"Raises OSError (with its errno) from the first failed read; then buf may\n"
"be partly filled.  ValueError if buf is not C-contiguous, offset < 0 or\n"
"threads < 0; TypeError if buf is read-only or not a buffer.");

static PyObject *
py_pread_full(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    return kvt_pio_binding(args, kwargs, 0);
}

PyDoc_STRVAR(py_hash_rows_doc,
"hash_rows($module, buf, stride, start, stop, seeds)\n"
"--\n"
"\n"
"XXH3-64 of the bytes [start, stop) of each row of buf, row i seeded with\n"
"seeds[i]; return the hashes as bytes, one native-endian uint64 per row.\n"
"\n"
"Rows are stride bytes apart from the start of buf; seeds is a C-contiguous\n"
"buffer of native-endian uint64, one per row (its size in bytes a multiple\n"
"of 8), and buf must hold that many rows.  Meant for tables the caller owns\n"
"(kvtierd's slot tables at a warm start: one call instead of a Python loop);\n"
"not fault-guarded.  The GIL is released.\n"
"\n"
"Raises ValueError if stride < 1, not 0 <= start <= stop <= stride, seeds'\n"
"size is not a multiple of 8, buf holds fewer rows than seeds, or a buffer\n"
"is not C-contiguous; TypeError if an argument is not a buffer.");

static PyObject *
py_hash_rows(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "stride", "start", "stop", "seeds", NULL};
    PyObject *buf_obj, *seeds_obj, *result = NULL;
    Py_ssize_t stride, start, stop, rows;
    Py_buffer buf, seeds;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnO:hash_rows", kwlist, &buf_obj,
                                     &stride, &start, &stop, &seeds_obj))
        return NULL;
    if (stride < 1 || start < 0 || start > stop || stop > stride) {
        PyErr_Format(PyExc_ValueError,
                     "need stride >= 1 and 0 <= start <= stop <= stride, got stride=%zd "
                     "start=%zd stop=%zd", stride, start, stop);
        return NULL;
    }
    if (kvt_get_buffer(buf_obj, &buf, "buf", 0) < 0)
        return NULL;
    if (kvt_get_buffer(seeds_obj, &seeds, "seeds", 0) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    if (seeds.len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "seeds has %zd bytes, not a multiple of 8", seeds.len);
        goto done;
    }
    rows = seeds.len / 8;
    if (rows > 0 && (rows - 1) * stride + stop > buf.len) {
        PyErr_Format(PyExc_ValueError, "buf has %zd bytes, %zd rows of stride %zd need %zd",
                     buf.len, rows, stride, (rows - 1) * stride + stop);
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, rows * 8);
    if (result == NULL)
        goto done;
    {
        const char *base = buf.buf, *seedp = seeds.buf;
        char *out = PyBytes_AS_STRING(result);

        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < rows; i++) {
            XXH64_hash_t seed, hash;

            memcpy(&seed, seedp + 8 * i, 8);
            hash = XXH3_64bits_withSeed(base + i * stride + start, (size_t)(stop - start),
                                        seed);
            memcpy(out + 8 * i, &hash, 8);
        }
        Py_END_ALLOW_THREADS
    }

done:
    PyBuffer_Release(&seeds);
    PyBuffer_Release(&buf);
    return result;
}

/* ------------------------------------------------------------------------- */
/* The SSD tier's key index (kvtierd/spill/ssd_index.py), many keys a call   */
/* ------------------------------------------------------------------------- */

/* The slot-table entry (KVT_SSD_*, csrc/layout.h): the index hashes an entry's
 * KVT_SSD_FIELD bytes of zero-padded key and namespace (XXH3-64, seeded with
 * key_len | ns_len << 8: ssd.key_hash, the hash_rows of a re-adoption). */

/* Below this many keys the call keeps the GIL (a probe is ~0.1 us). */
#define KVT_SSD_NOGIL_KEYS 64

/* One spill file: its slot-table mirror (n_rows whole entries) and its first slot id. */
typedef struct {
    const unsigned char *rows;
    uint64_t n_rows;
    uint64_t base;
} kvt_ssd_file;

/* The slot-table entry a bucket word names, its slot id in *sid; NULL when the word
 * names no slot of a file (slot id 0 - 1, before the first file, past a file's whole
 * rows): whatever the word holds, never a pointer out of the tables. */
static const unsigned char *
kvt_ssd_row(const kvt_ssd_file *files, size_t n_files, uint64_t v, uint64_t *sid)
{
    size_t lo = 0, hi = n_files;
    uint64_t slot;

    if ((v & 0xffffffffu) == 0)
        return NULL;
    *sid = (v & 0xffffffffu) - 1;
    while (lo < hi) { /* the last file whose base <= sid */
        size_t mid = lo + (hi - lo) / 2;

        if (files[mid].base <= *sid)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return NULL;
    slot = *sid - files[lo - 1].base;
    if (slot >= files[lo - 1].n_rows)
        return NULL;
    return files[lo - 1].rows + slot * KVT_SSD_ENTRY;
}

/* Whether an entry holds the key and namespace of field (both lengths, then the padded
 * field in one comparison, as SsdKeyIndex.probe confirms). */
static inline int
kvt_ssd_holds(const unsigned char *row, const unsigned char *field, unsigned klen,
              unsigned nlen)
{
    return row[KVT_SSD_KEY_LEN] == klen && row[KVT_SSD_NS_LEN] == nlen
           && memcmp(row + KVT_SSD_KEY_AT, field, KVT_SSD_FIELD) == 0;
}

/* Linear probing for tag from bucket *at, *probes made so far: the entry of the next
 * word with the tag that names one (*at its bucket, *sid its slot id), or NULL at an
 * empty bucket or once every bucket was probed (a full table still ends). */
static const unsigned char *
kvt_ssd_next(const unsigned char *buckets, uint64_t mask, const kvt_ssd_file *files,
             size_t n_files, uint64_t tag, uint64_t *at, uint64_t *probes, uint64_t *sid)
{
    for (; *probes <= mask; ++*probes, *at = (*at + 1) & mask) {
        const unsigned char *row;
        uint64_t v;

        memcpy(&v, buckets + 8 * *at, 8);
        if (v == 0)
            return NULL;
        if (v >> 32 != tag)
            continue;
        row = kvt_ssd_row(files, n_files, v, sid);
        if (row != NULL)
            return row;
    }
    return NULL;
}

/* Keys per round of kvt_ssd_find_many: their home buckets, then their candidates'
 * entries, are prefetched together, so the cache misses of a round overlap (the
 * buckets and tables are far larger than the caches: a miss each, ~100 ns). */
#define KVT_SSD_ROUND 16

/* The slot id of each key, or -1, into out (one int64 a key).  fields: n records of
 * KVT_SSD_FIELD + 1 bytes, a key's padded field (key + namespace) and then its length
 * (0: not a valid key, a miss).  buckets: n_buckets (a power of two) words, each the
 * key hash's upper half over slot id + 1 (0: empty), linear probing from the upper
 * half's low bits; files: ascending by base. */
static void
kvt_ssd_find_many(const unsigned char *buckets, uint64_t n_buckets, const kvt_ssd_file *files,
                  size_t n_files, const unsigned char *fields, size_t n, unsigned nlen,
                  char *out)
{
    uint64_t mask = n_buckets - 1;

    for (size_t first = 0; first < n; first += KVT_SSD_ROUND) {
        size_t m = n - first < KVT_SSD_ROUND ? n - first : KVT_SSD_ROUND;
        uint64_t tag[KVT_SSD_ROUND], at[KVT_SSD_ROUND], probes[KVT_SSD_ROUND],
            sid[KVT_SSD_ROUND];
        const unsigned char *row[KVT_SSD_ROUND];

        for (size_t j = 0; j < m; j++) { /* hash, prefetch the home bucket */
            const unsigned char *field = fields + (first + j) * (KVT_SSD_FIELD + 1);
            unsigned klen = field[KVT_SSD_FIELD];

            probes[j] = 0;
            at[j] = tag[j] = 0;
            if (klen == 0)
                continue;
            tag[j] = XXH3_64bits_withSeed(field, KVT_SSD_FIELD, klen | nlen << 8) >> 32;
            at[j] = tag[j] & mask;
            __builtin_prefetch(buckets + 8 * at[j]);
        }
        for (size_t j = 0; j < m; j++) { /* the first candidate, prefetch its entry */
            const unsigned char *field = fields + (first + j) * (KVT_SSD_FIELD + 1);

            row[j] = field[KVT_SSD_FIELD] == 0 ? NULL
                     : kvt_ssd_next(buckets, mask, files, n_files, tag[j], &at[j], &probes[j],
                                    &sid[j]);
            if (row[j] != NULL) {
                __builtin_prefetch(row[j]);
                __builtin_prefetch(row[j] + 64);
                __builtin_prefetch(row[j] + 128);
                __builtin_prefetch(row[j] + 192);
            }
        }
        for (size_t j = 0; j < m; j++) { /* confirm, or probe on (tags collided: rare) */
            const unsigned char *field = fields + (first + j) * (KVT_SSD_FIELD + 1);
            unsigned klen = field[KVT_SSD_FIELD];
            const unsigned char *r = row[j];
            int64_t found = -1;

            while (r != NULL) {
                if (kvt_ssd_holds(r, field, klen, nlen)) {
                    found = (int64_t)sid[j];
                    break;
                }
                probes[j]++;
                at[j] = (at[j] + 1) & mask;
                r = kvt_ssd_next(buckets, mask, files, n_files, tag[j], &at[j], &probes[j],
                                 &sid[j]);
            }
            memcpy(out + 8 * (first + j), &found, 8);
        }
    }
}

PyDoc_STRVAR(py_ssd_find_slots_doc,
"ssd_find_slots($module, buckets, tables, bases, keys, namespace)\n"
"--\n"
"\n"
"Look many keys of one namespace up in the SSD tier's key index; return\n"
"bytes, one native-endian int64 per key: the slot id holding it, or -1.\n"
"\n"
"buckets is the index (a C-contiguous buffer of native-endian uint64, a\n"
"power of two of them: each the key hash's upper half over slot id + 1, 0\n"
"empty; linear probing); tables the spill files' slot-table mirrors and\n"
"bases their first slot ids (a sequence of ints, ascending), in the same\n"
"order.  A key is found when a word with its hash's upper half names a slot\n"
"whose entry holds the same key and namespace (lengths and zero-padded\n"
"bytes): the hash is ssd.key_hash's, XXH3-64 of the entry's 192-byte key and\n"
"namespace field seeded with key_len | ns_len << 8.  keys is a sequence of\n"
"bytes-like objects; one not 1..64 bytes long is a miss.  Every access stays\n"
"within the buffers given, whatever they hold; at most len(buckets) probes a\n"
"key.  The keys are copied first, then the GIL is released (from 64 keys).\n"
"\n"
"Raises ValueError if buckets is not a power of two of 8-byte words,\n"
"tables and bases differ in length, bases do not ascend, namespace is over\n"
"128 bytes or a buffer is not C-contiguous; TypeError if a key, table,\n"
"buckets or namespace is not a buffer; OverflowError for a negative base.");

static PyObject *
py_ssd_find_slots(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buckets", "tables", "bases", "keys", "namespace", NULL};
    PyObject *buckets_obj, *tables_obj, *bases_obj, *keys_obj, *ns_obj, *result = NULL;
    PyObject *tables = NULL, *bases = NULL, *keys = NULL;
    Py_buffer bk, ns;
    Py_buffer *views = NULL;
    kvt_ssd_file *files = NULL;
    unsigned char *arena = NULL;
    Py_ssize_t n_files = 0, got = 0, n = 0;
    uint64_t n_buckets;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO:ssd_find_slots", kwlist,
                                     &buckets_obj, &tables_obj, &bases_obj, &keys_obj, &ns_obj))
        return NULL;
    if (kvt_get_buffer(buckets_obj, &bk, "buckets", 0) < 0)
        return NULL;
    if (kvt_get_buffer(ns_obj, &ns, "namespace", 0) < 0) {
        PyBuffer_Release(&bk);
        return NULL;
    }
    n_buckets = (uint64_t)bk.len / 8;
    if (bk.len % 8 != 0 || n_buckets == 0 || (n_buckets & (n_buckets - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "buckets has %zd bytes, not a power of two of "
                     "8-byte words", bk.len);
        goto done;
    }
    if ((size_t)ns.len > KVT_SSD_NAME) {
        PyErr_Format(PyExc_ValueError, "namespace has %zd bytes (at most 128)", ns.len);
        goto done;
    }
    tables = PySequence_Fast(tables_obj, "tables must be a sequence of buffers");
    if (tables == NULL)
        goto done;
    bases = PySequence_Fast(bases_obj, "bases must be a sequence of ints");
    if (bases == NULL)
        goto done;
    n_files = PySequence_Fast_GET_SIZE(tables);
    if (PySequence_Fast_GET_SIZE(bases) != n_files) {
        PyErr_Format(PyExc_ValueError, "tables and bases differ in length (%zd and %zd)",
                     n_files, PySequence_Fast_GET_SIZE(bases));
        goto done;
    }
    views = PyMem_Calloc((size_t)n_files + 1, sizeof *views);
    files = PyMem_Calloc((size_t)n_files + 1, sizeof *files);
    if (views == NULL || files == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n_files; got++) {
        unsigned long long base =
            PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(bases, got));

        if (base == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        if (got > 0 && base <= files[got - 1].base) {
            PyErr_SetString(PyExc_ValueError, "bases must ascend");
            goto done;
        }
        if (kvt_get_buffer(PySequence_Fast_GET_ITEM(tables, got), &views[got], "a table", 0)
            < 0)
            goto done;
        files[got].rows = views[got].buf;
        files[got].n_rows = (uint64_t)views[got].len / KVT_SSD_ENTRY;
        files[got].base = base;
    }
    keys = PySequence_Fast(keys_obj, "keys must be a sequence of bytes");
    if (keys == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(keys);
    /* Each key's field, copied now: the keys may be any buffers, which another thread
     * could change while the GIL is released.  Its first byte after the field: the
     * key's length (0: not 1..64 bytes, a miss). */
    arena = PyMem_Malloc((size_t)(n > 0 ? n : 1) * (KVT_SSD_FIELD + 1));
    if (arena == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char *field = arena + (size_t)i * (KVT_SSD_FIELD + 1);
        Py_buffer key;

        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(keys, i), &key, PyBUF_SIMPLE) < 0)
            goto done;
        memset(field, 0, KVT_SSD_MAX_KEY);
        if (key.len >= 1 && (size_t)key.len <= KVT_SSD_MAX_KEY) {
            memcpy(field, key.buf, (size_t)key.len);
            field[KVT_SSD_FIELD] = (unsigned char)key.len;
        } else {
            field[KVT_SSD_FIELD] = 0;
        }
        PyBuffer_Release(&key);
        memset(field + KVT_SSD_MAX_KEY, 0, KVT_SSD_NAME);
        if (ns.len > 0)
            memcpy(field + KVT_SSD_MAX_KEY, ns.buf, (size_t)ns.len);
    }
    result = PyBytes_FromStringAndSize(NULL, n * 8);
    if (result == NULL)
        goto done;
    {
        PyThreadState *save = n >= KVT_SSD_NOGIL_KEYS ? PyEval_SaveThread() : NULL;

        kvt_ssd_find_many(bk.buf, n_buckets, files, (size_t)n_files, arena, (size_t)n,
                          (unsigned)ns.len, PyBytes_AS_STRING(result));
        if (save != NULL)
            PyEval_RestoreThread(save);
    }

done:
    PyMem_Free(arena);
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(files);
    Py_XDECREF(keys);
    Py_XDECREF(bases);
    Py_XDECREF(tables);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&bk);
    return result;
}

PyDoc_STRVAR(py_install_fault_guard_doc,
"install_fault_guard($module, /)\n"
"--\n"
"\n"
"Turn a SIGBUS in copy, prefault, checksum, gather, scatter and scatter_hash\n"
"into OSError.\n"
"\n"
"Installs a SIGBUS handler for the whole process (once: later calls do\n"
"nothing) and returns True if this call installed it, False if an earlier\n"
"one had.  Then a SIGBUS raised while one of those calls touches a buffer\n"
"(a mapped file truncated under it, say) makes that call raise OSError\n"
"with errno EFAULT and a message starting \"memory fault (SIGBUS)\"; the\n"
"process lives on.  A SIGBUS anywhere else goes on to the handler there\n"
"was before (faulthandler's, say), or kills the process as without the\n"
"guard.  Install it after faulthandler.enable(): a handler installed later\n"
"sees SIGBUS first.  SIGSEGV is left alone.\n"
"\n"
"Raises OSError if sigaction fails.");

static PyObject *
py_install_fault_guard(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    int ret = kvt_guard_install();

    if (ret < 0) {
        errno = -ret;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(ret);
}

PyDoc_STRVAR(py_fault_guard_installed_doc,
"fault_guard_installed($module, /)\n"
"--\n"
"\n"
"Return True if install_fault_guard() has installed the guard.");

static PyObject *
py_fault_guard_installed(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    return PyBool_FromLong(__atomic_load_n(&kvt_guard_on, __ATOMIC_ACQUIRE));
}

PyDoc_STRVAR(py_xxh3_dispatch_doc,
"xxh3_dispatch($module, /)\n--\n\n"
"The path XXH3 takes for inputs over 240 bytes: \"sse2\" or \"avx2\" (xxHash's\n"
"x86 dispatcher, overridden by KVTIER_XXH3 at import), or \"portable\" on a\n"
"build without the dispatcher (not x86).");

static PyObject *
py_xxh3_dispatch(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(arg))
{
#ifdef KVT_XXH_X86_DISPATCH
    return PyUnicode_FromString(kvt_xxh3_dispatch_name());
#else
    return PyUnicode_FromString("portable");
#endif
}

static PyMethodDef native_methods[] = {
    {"xxh3_dispatch", py_xxh3_dispatch, METH_NOARGS, py_xxh3_dispatch_doc},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_VARARGS | METH_KEYWORDS,
     py_copy_doc},
    {"prefault", (PyCFunction)(void (*)(void))py_prefault,
     METH_VARARGS | METH_KEYWORDS, py_prefault_doc},
    {"checksum", (PyCFunction)(void (*)(void))py_checksum,
     METH_VARARGS | METH_KEYWORDS, py_checksum_doc},
    {"gather", (PyCFunction)(void (*)(void))py_gather, METH_VARARGS | METH_KEYWORDS,
     py_gather_doc},
    {"scatter", (PyCFunction)(void (*)(void))py_scatter,
     METH_VARARGS | METH_KEYWORDS, py_scatter_doc},
    {"scatter_hash", (PyCFunction)(void (*)(void))py_scatter_hash,
     METH_VARARGS | METH_KEYWORDS, py_scatter_hash_doc},
    {"scatter_hash_at", (PyCFunction)(void (*)(void))py_scatter_hash_at,
     METH_VARARGS | METH_KEYWORDS, py_scatter_hash_at_doc},
    {"pwrite_full", (PyCFunction)(void (*)(void))py_pwrite_full,
     METH_VARARGS | METH_KEYWORDS, py_pwrite_full_doc},
    {"pread_full", (PyCFunction)(void (*)(void))py_pread_full,
     METH_VARARGS | METH_KEYWORDS, py_pread_full_doc},
    {"slot_usage", kvt_py_slot_usage, METH_O, kvt_slot_usage_doc},
    {"hash_rows", (PyCFunction)(void (*)(void))py_hash_rows,
     METH_VARARGS | METH_KEYWORDS, py_hash_rows_doc},
    {"ssd_find_slots", (PyCFunction)(void (*)(void))py_ssd_find_slots,
     METH_VARARGS | METH_KEYWORDS, py_ssd_find_slots_doc},
    {"install_fault_guard", py_install_fault_guard, METH_NOARGS,
     py_install_fault_guard_doc},
    {"fault_guard_installed", py_fault_guard_installed, METH_NOARGS,
     py_fault_guard_installed_doc},
    /* The shared index (csrc/index.c). */
    {"index_format", kvt_py_index_format, METH_VARARGS,
     "index_format(buf, capacity, seed): lay out an empty shared index in zeroed buf."},
    {"index_set", kvt_py_index_set, METH_VARARGS,
     "index_set(buf, key, tier, ref, loc=None): insert or update; 1, 0 (probe limit) or -1 (full)."},
    {"index_set_many", kvt_py_index_set_many, METH_VARARGS,
     "index_set_many(buf, keys, tier, start): index_set of keys[start:] until the table is full;"
     " (index stopped at, indices skipped at the probe limit)."},
    {"index_remove", kvt_py_index_remove, METH_VARARGS,
     "index_remove(buf, key): remove key; True if it was there."},
    {"index_remove_many", kvt_py_index_remove_many, METH_VARARGS,
     "index_remove_many(buf, keys): remove each key; bytes, 1 per key that was there."},
    {"index_get", kvt_py_index_get, METH_VARARGS,
     "index_get(buf, key): (tier, ref) of key, or None (the writer's view)."},
    {"index_lookup", kvt_py_index_lookup, METH_VARARGS,
     "index_lookup(buf, keys, stats=None): (tiers of the leading hits, final), or None."},
    {"index_locate", kvt_py_index_locate, METH_VARARGS,
     "index_locate(buf, key): (segment, slot, offset, length, checksum) of key, or None."},
    {"index_present_many", kvt_py_index_present_many, METH_VARARGS,
     "index_present_many(buf, keys): bytes, 1 per key the table holds now, else 0 (a reader's "
     "batch test: seqlocked, safe while the daemon writes)."},
    {"index_set_slots", kvt_py_index_set_slots, METH_VARARGS,
     "index_set_slots(buf, table, slots, segment, slot_bytes, start): the keys of COMMITTED "
     "slot-table entries into the table; (index stopped at, [indices left out])."},
    {"index_find_many", kvt_py_index_find_many, METH_VARARGS,
     "index_find_many(buf, keys): bytes of one u64 per key, segment << 32 | slot of its live "
     "entry or 0 (the writer's view)."},
    {"index_acquire", kvt_py_index_acquire, METH_VARARGS,
     "index_acquire(buf, keys, page, at, serial): lease the leading hits without a call (hazards at "
     "page slots at..); [(segment, offset, length, checksum, has_checksum)] or None."},
    {"hazards_clear", kvt_py_hazards_clear, METH_VARARGS,
     "hazards_clear(page, at, n): end the leases of hazards at..at+n; how many had expired."},
    {"hazards_list", kvt_py_hazards_list, METH_O,
     "hazards_list(page): [(index, hazard, serial)] of the page's non-zero hazards."},
    {"hazards_expire", kvt_py_hazards_expire, METH_VARARGS,
     "hazards_expire(page, index, hazard): zero it if it still holds hazard; True if so."},
    {"hazards_collect", kvt_py_hazards_collect, METH_O,
     "hazards_collect(pages): the set of non-zero hazards the pages hold (after a full fence)."},
    {"grants_take", kvt_py_grants_take, METH_VARARGS,
     "grants_take(page, n): [(index, word)] of n grants now taken by this writer, or None."},
    {"grants_take_columns", kvt_py_grants_take_columns, METH_VARARGS,
     "grants_take_columns(page, n, slot_bytes): (entries, words, segment ids, offsets) of n "
     "grants now taken by this writer, or None."},
    {"grants_untake", kvt_py_grants_untake, METH_VARARGS,
     "grants_untake(page, taken): give back grants taken and not committed."},
    {"commits_put", kvt_py_commits_put, METH_VARARGS,
     "commits_put(page, head, records): write [(grant, key, length, checksum|None)] at head; the new head."},
    {"commits_put_columns", kvt_py_commits_put_columns, METH_VARARGS,
     "commits_put_columns(page, head, entries, words, keys, lengths, sums): commits_put from "
     "columns (sums: None, or an int or None per record); the new head."},
    {"done_wait", kvt_py_done_wait, METH_VARARGS,
     "done_wait(page, target, seconds): wait (GIL released) until DONE reaches target; True if so."},
    {"readable_spin", kvt_py_readable_spin, METH_VARARGS,
     "readable_spin(fd, seconds): look for input on fd for up to seconds, yielding the CPU "
     "between looks (GIL released); True if there is some (or end of file, or an error)."},
    {"commits_take", kvt_py_commits_take, METH_VARARGS,
     "commits_take(page, tail, max_length, held=None): (head, batches, keys, columns,\n"
     "flags) of the records from tail, or (head, None, None, None, None) for an\n"
     "impossible head.  batches: [(start, end, refusal: 0, INVALID or LOST against\n"
     "held)]; columns: u64 rows grant, word, slot ref, length, checksum, has checksum."},
    {"commits_done", kvt_py_commits_done, METH_VARARGS,
     "commits_done(page, tail, results): result bytes from tail, then DONE and a futex wake."},
    {"commit_results", kvt_py_commit_results, METH_VARARGS,
     "commit_results(page, at, n): the result bytes of records at..at+n."},
    {"page_cas", kvt_py_page_cas, METH_VARARGS,
     "page_cas(page, offset, old, new): compare-and-swap of the u64 at offset; True if swapped."},
    {"page_store", kvt_py_page_store, METH_VARARGS,
     "page_store(page, offset, value): an atomic store of the u64 at offset."},
    {"grants_store", kvt_py_grants_store, METH_VARARGS,
     "grants_store(page, entries, words): atomic stores of grant entries' u64 words."},
    {"grants_grant", kvt_py_grants_grant, METH_VARARGS,
     "grants_grant(page, held, gens, refs, ref_gens): grant refs in the first free entries."},
    {"index_copy", kvt_py_index_copy, METH_VARARGS,
     "index_copy(dst, src): put src's live entries into dst; (copied, skipped)."},
    {"index_info", kvt_py_index_info, METH_VARARGS,
     "index_info(buf): (capacity, live, used, flags)."},
    {"index_set_flags", kvt_py_index_set_flags, METH_VARARGS,
     "index_set_flags(buf, flags): set the header's flags word."},
    {"keys_check", kvt_py_keys_check, METH_VARARGS,
     "keys_check(keys, max_len, repeats=True): (first key not bytes of 1..max_len, first "
     "repeated key, -1 without repeats), -1: none."},
    {"index_fingerprint", kvt_py_index_fingerprint, METH_O,
     "index_fingerprint(key): the 17 bytes an entry stores for key."},
    {"index_fingerprints", kvt_py_index_fingerprints, METH_VARARGS,
     "index_fingerprints(buf): the fingerprints of every live entry."},
    {"index_rows", kvt_py_index_rows, METH_VARARGS,
     "index_rows(buf): every live entry's fingerprint as a 24-byte row (fp0, fp1, flags)."},
    {"check_keys", kvt_py_check_keys, METH_VARARGS,
     "check_keys(extent_rows, index_rows, unpublished_rows, seed): the key index against "
     "the slot tables' check rows; (keys, dup committed, dup index, [(extent, slot)] "
     "missing, stray, unpublished gone)."},
    {"fingerprint_rows", kvt_py_fingerprint_rows, METH_O,
     "fingerprint_rows(keys): the 24-byte rows of keys' fingerprints."},
    {"varints_field", kvt_py_varints_field, METH_VARARGS,
     "varints_field(field, values): values (a buffer of u8, u32 or u64) encoded as the packed "
     "repeated field number field (b'' for none), to merge into a protobuf message."},
    {"varints_column", kvt_py_varints_column, METH_VARARGS,
     "varints_column(message, field): the u64 values (as bytes) of repeated varint field "
     "number field of a serialized protobuf message; ValueError when it is malformed."},
    {"index_populate", kvt_py_index_populate, METH_VARARGS,
     "index_populate(buf, write=True, touch=True): fault every page of buf in now (madvise POPULATE_WRITE "
     "or _READ), GIL released; whether madvise did it."},
    {NULL, NULL, 0, NULL},
};

/* csrc/layout.c: adds LAYOUT and FIELDS (csrc/layout.h) to the module. */
int kvt_layout_init(PyObject *module);

/* KVTIER_XXH3=sse2|avx2|auto: the XXH3 path of this process (csrc/xxh_dispatch.c), set
 * at import, before anything hashes.  A value it does not know, or avx2 on a CPU
 * without it, fails the import (ValueError, not ImportError: kvtier._accel would take
 * that for a missing build and quietly fall back to Python). */
static int
kvt_xxh3_init(PyObject *Py_UNUSED(module))
{
#ifdef KVT_XXH_X86_DISPATCH
    const char *name = getenv("KVTIER_XXH3");
    int err = kvt_xxh3_dispatch_set(name);

    if (err == -1) {
        PyErr_Format(PyExc_ValueError,
                     "KVTIER_XXH3=%s: expected sse2, avx2 or auto", name);
        return -1;
    }
    if (err == -2) {
        PyErr_SetString(PyExc_ValueError,
                        "KVTIER_XXH3=avx2: this CPU (or its OS) has no AVX2");
        return -1;
    }
#endif
    return 0;
}


/* The module has no per-interpreter state (the fault guard is per process and
 * per thread, not per interpreter), so it is safe in subinterpreters and
 * without a GIL. */
static PyModuleDef_Slot native_slots[] = {
    /* BlockTable and BLOCK_TABLE (csrc/blocks.c) */
    {Py_mod_exec, (void *)kvt_blocks_init},
    /* LAYOUT and FIELDS (csrc/layout.c) */
    {Py_mod_exec, (void *)kvt_layout_init},
    /* KVTIER_XXH3 (csrc/xxh_dispatch.c) */
    {Py_mod_exec, (void *)kvt_xxh3_init},
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
"threads=0) makes every page of a buffer resident and writable; both\n"
"release the GIL and split jobs of 4 MiB or more over a few threads.\n"
"checksum(buf) is XXH3-64 of a buffer; gather(dst, pieces) and\n"
"scatter(src, pieces) copy many buffers to or from one in a single call;\n"
"scatter_hash(srcs, pieces) scatters many and hashes them in the same pass;\n"
"pwrite_full/pread_full(fd, buf, offset) transfer a whole buffer at a file\n"
"position, O_DIRECT included, large ones from several threads at once.\n"
"install_fault_guard() makes a SIGBUS in the memory helpers (a mapped file\n"
"truncated under them) raise OSError(EFAULT) instead of killing the process.");

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
