/* random_counter.h: a counter-based generator for initial weights: value i
 * of stream s under seed n is a pure function of (n, s, i), so every element
 * can be drawn on its own, in any order, by a CPU loop or a GPU thread, and
 * both give the same numbers (integer hashing; a normal goes through log,
 * sqrt and cos in double, where the device's and glibc's last bits may differ
 * before the value is rounded to float). The hash is splitmix64's finaliser
 * applied to the seed, the stream and the index in turn. Plain C that nvcc
 * also compiles (kernels/ops.cu). */
#ifndef MN_RANDOM_COUNTER_H
#define MN_RANDOM_COUNTER_H

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define MN_RC_FN __host__ __device__ __forceinline__
#else
#define MN_RC_FN static inline
#endif

MN_RC_FN uint64_t mn_rc_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

MN_RC_FN uint64_t mn_rc_u64(uint64_t seed, uint64_t stream, uint64_t i)
{
    uint64_t k = mn_rc_mix(seed + 0x9e3779b97f4a7c15ull);
    k = mn_rc_mix(k ^ (stream * 0xd1b54a32d192ed03ull + 0x632be59bd9b4e019ull));
    return mn_rc_mix(k ^ (i * 0x9e3779b97f4a7c15ull + 0x8cb92ba72f3d8dd7ull));
}

/* [0, 1), 53 bits */
MN_RC_FN double mn_rc_uniform(uint64_t seed, uint64_t stream, uint64_t i)
{
    return (double)(mn_rc_u64(seed, stream, i) >> 11) * (1.0 / 9007199254740992.0);
}

/* N(0, 1) by Box-Muller from draws 2i and 2i + 1 (1 - u in (0, 1]: finite log) */
MN_RC_FN double mn_rc_normal(uint64_t seed, uint64_t stream, uint64_t i)
{
    double u1 = 1.0 - mn_rc_uniform(seed, stream, 2 * i), u2 = mn_rc_uniform(seed, stream, 2 * i + 1);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

/* The initialisers (mn_init_params): kind 0 uniform in [-scale, scale)
 * (xavier's bound), 1 normal with standard deviation scale. */
enum { MN_RC_UNIFORM = 0, MN_RC_NORMAL = 1 };
MN_RC_FN float mn_rc_init_value(int kind, double scale, uint64_t seed, uint64_t stream, uint64_t i)
{
    return (float)(kind == MN_RC_NORMAL ? scale * mn_rc_normal(seed, stream, i)
                                        : scale * (2.0 * mn_rc_uniform(seed, stream, i) - 1.0));
}

#endif
