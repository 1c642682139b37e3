/* The AVX2 build of xxh3_dispatch.c's functions: GCC's target pragma makes this translation
 * unit's code, xxHash's included, AVX2 code (it defines __AVX2__, from which xxHash picks its
 * AVX2 loop); xxh3_dispatch.c calls it only on a CPU that has AVX2. Empty where GCC does not
 * target x86-64 (clang ignores the pragma; other CPUs have no AVX2). */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2")

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "xxh3_dispatch.h"

uint64_t sf_xxh3_avx2(const void *p, size_t n)
{
    return XXH3_64bits(p, n);
}

uint64_t sf_xxh3_seeded_avx2(const void *p, size_t n, uint64_t seed)
{
    return XXH3_64bits_withSeed(p, n, seed);
}

uint64_t sf_xxh3_pair_avx2(const void *a, size_t an, const void *b, size_t bn)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, a, an);
    XXH3_64bits_update(&st, b, bn);
    return XXH3_64bits_digest(&st);
}
#else
typedef int sf_no_avx2_build;  /* (ISO C wants a declaration in every translation unit) */
#endif
