/* Which XXH3 long-input path the x86 dispatcher runs (csrc/xxh_dispatch.c). */
#ifndef KVT_XXH_DISPATCH_H
#define KVT_XXH_DISPATCH_H

/* Make XXH3 run the path name names: "sse2", "avx2", or "auto"/""/NULL (the
 * dispatcher's own pick from CPUID).  Returns 0; -1 for a name it does not
 * know, -2 for "avx2" on a CPU (or OS) without it; nothing changes then.  Not
 * thread-safe: call it before anything hashes (the module's import does). */
int kvt_xxh3_dispatch_set(const char *name);

/* "sse2" or "avx2": the path XXH3 runs now. */
const char *kvt_xxh3_dispatch_name(void);

#endif
