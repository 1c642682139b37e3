/* xxh3-64 on the widest vector unit the CPU has: AVX2 where the CPU and the OS have it, else
 * the baseline (SSE2 on x86-64, NEON on arm64, scalar elsewhere).
 *
 * Why: the package compiles for the baseline, so that one build runs on every x86-64 host,
 * and xxHash picks its vector unit at compile time. Measured on this project's 2-core VM
 * (64 KiB inputs): 10.8 GB/s at -O2, 15.9 at -O3, 19.6 with AVX2. The serving worker hashes
 * every byte it serves (a cached 1 MiB READ's check was 28 % of its CPU at -O2, perf), the
 * spoke every byte it receives, hubd every byte it frames. So xxh3_avx2.c builds the same
 * functions for AVX2 (GCC's target pragma, one translation unit), and this one picks once,
 * when the extension loads. SPOKEFS_XXH3=baseline picks the baseline (the tests compare
 * the two). Both are xxHash's own code from Debian's libxxhash-dev header (XXH_INLINE_ALL). */

#define XXH_INLINE_ALL
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "xxh3_dispatch.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SF_HAVE_AVX2_BUILD 1
#else
#define SF_HAVE_AVX2_BUILD 0
#endif

static int use_avx2;

__attribute__((constructor)) static void choose_unit(void)
{
#if SF_HAVE_AVX2_BUILD
    const char *forced = getenv("SPOKEFS_XXH3");
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && !(forced && strcmp(forced, "baseline") == 0);
#endif
}

const char *sf_xxh3_unit(void)
{
    return use_avx2 ? "avx2" : "baseline";
}

static uint64_t pair(const void *a, size_t an, const void *b, size_t bn)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, a, an);
    XXH3_64bits_update(&st, b, bn);
    return XXH3_64bits_digest(&st);
}

#if SF_HAVE_AVX2_BUILD
uint64_t sf_xxh3(const void *p, size_t n)
{
    return use_avx2 ? sf_xxh3_avx2(p, n) : XXH3_64bits(p, n);
}

uint64_t sf_xxh3_seeded(const void *p, size_t n, uint64_t seed)
{
    return use_avx2 ? sf_xxh3_seeded_avx2(p, n, seed) : XXH3_64bits_withSeed(p, n, seed);
}

uint64_t sf_xxh3_pair(const void *a, size_t an, const void *b, size_t bn)
{
    return use_avx2 ? sf_xxh3_pair_avx2(a, an, b, bn) : pair(a, an, b, bn);
}
#else
uint64_t sf_xxh3(const void *p, size_t n)
{
    return XXH3_64bits(p, n);
}

uint64_t sf_xxh3_seeded(const void *p, size_t n, uint64_t seed)
{
    return XXH3_64bits_withSeed(p, n, seed);
}

uint64_t sf_xxh3_pair(const void *a, size_t an, const void *b, size_t bn)
{
    return pair(a, an, b, bn);
}
#endif
