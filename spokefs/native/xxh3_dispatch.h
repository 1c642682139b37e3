/* xxh3-64 on the widest vector unit the CPU has (xxh3_dispatch.c), for the package's C parts.
 *
 * The same hashes as python-xxhash's xxh3_64 (seed 0 unless said), whichever unit computes
 * them. Built into each extension that hashes (pyproject.toml lists these sources there). */

#ifndef SPOKEFS_XXH3_DISPATCH_H
#define SPOKEFS_XXH3_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#define SF_HIDDEN __attribute__((visibility("hidden")))

/* xxh3-64 of p[0..n) */
SF_HIDDEN uint64_t sf_xxh3(const void *p, size_t n);
/* xxh3-64 of p[0..n) with a seed */
SF_HIDDEN uint64_t sf_xxh3_seeded(const void *p, size_t n, uint64_t seed);
/* xxh3-64 of a[0..an) followed by b[0..bn) */
SF_HIDDEN uint64_t sf_xxh3_pair(const void *a, size_t an, const void *b, size_t bn);
/* "avx2" or "baseline": the unit in use (SPOKEFS_XXH3=baseline picks the baseline) */
SF_HIDDEN const char *sf_xxh3_unit(void);

/* the AVX2 builds, in xxh3_avx2.c (present only where GCC targets x86-64) */
SF_HIDDEN uint64_t sf_xxh3_avx2(const void *p, size_t n);
SF_HIDDEN uint64_t sf_xxh3_seeded_avx2(const void *p, size_t n, uint64_t seed);
SF_HIDDEN uint64_t sf_xxh3_pair_avx2(const void *a, size_t an, const void *b, size_t bn);

#endif
