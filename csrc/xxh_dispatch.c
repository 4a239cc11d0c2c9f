/* xxHash's x86 runtime dispatcher (csrc/third_party/xxhash/xxh_x86dispatch.c,
 * unchanged), compiled in this file so the choice it makes can be overridden:
 * its tables are static, and a file that includes it may reach them.
 *
 * The dispatcher picks XXH3's long-input loop once, at load (a constructor):
 * AVX2 when the CPU and the OS support it, else SSE2 (setup.py leaves AVX-512
 * out).  Hosts differ in exactly that, so the tests and benchmarks must be
 * able to run both paths on one host: KVTIER_XXH3 (read when kvtier._native is
 * imported, csrc/native.c) names the path, "sse2" or "avx2"; unset, empty or
 * "auto" keeps the dispatcher's choice.  Every path computes the same hash;
 * only the speed differs (inputs of 240 bytes or less never reach it). */
#include "xxh_x86dispatch.c"

#include <string.h>

#include "xxh_dispatch.h"

int
kvt_xxh3_dispatch_set(const char *name)
{
    int want;

    if (name == NULL || name[0] == '\0' || strcmp(name, "auto") == 0)
        want = XXH_featureTest();
    else if (strcmp(name, "sse2") == 0)
        want = XXH_SSE2;
    else if (strcmp(name, "avx2") == 0)
        want = XXH_AVX2;
    else
        return -1;
    if (want == XXH_AVX2 && XXH_featureTest() < XXH_AVX2)
        return -2;
    if (want > XXH_AVX2) /* (not built: setup.py's XXH_DISPATCH_AVX512=0) */
        want = XXH_AVX2;
    XXH_g_dispatch = XXH_kDispatch[want];
    XXH_g_dispatch128 = XXH_kDispatch128[want];
    return 0;
}

const char *
kvt_xxh3_dispatch_name(void)
{
    if (XXH_g_dispatch.hashLong64_default == XXH_kDispatch[XXH_AVX2].hashLong64_default)
        return "avx2";
    if (XXH_g_dispatch.hashLong64_default == XXH_kDispatch[XXH_SSE2].hashLong64_default)
        return "sse2";
    return "unknown";
}
