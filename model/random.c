/* random.c: the seeded generator of random.h: xoshiro256** (Blackman and
 * Vigna) seeded through splitmix64, uniforms from the top 53 bits, normals by
 * Box-Muller with the second value of each pair kept for the next call. The
 * integer stream is identical on every machine; normals also go through
 * log, sqrt, cos and sin, which glibc rounds the same everywhere. */
#include "random.h"

#include <math.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* splitmix64 never gives xoshiro the all-zero state it cannot leave. */
void mn_rng_seed(mn_rng *rng, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&x);
    rng->has_spare = false;
    rng->spare = 0;
}

uint64_t mn_rng_u64(mn_rng *rng)
{
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double mn_rng_uniform(mn_rng *rng) { return (double)(mn_rng_u64(rng) >> 11) * 0x1.0p-53; }

double mn_rng_normal(mn_rng *rng)
{
    if (rng->has_spare) {
        rng->has_spare = false;
        return rng->spare;
    }
    /* 1 - u lies in (0, 1], so the log is finite. */
    double u1 = 1.0 - mn_rng_uniform(rng), u2 = mn_rng_uniform(rng);
    double r = sqrt(-2.0 * log(u1)), angle = 6.283185307179586476925 * u2;
    rng->spare = r * sin(angle);
    rng->has_spare = true;
    return r * cos(angle);
}

static mn_rng global_rng;
static bool global_seeded;

mn_rng *mn_global_rng(void)
{
    if (!global_seeded) {
        mn_rng_seed(&global_rng, 0);
        global_seeded = true;
    }
    return &global_rng;
}

void mn_seed(uint64_t seed)
{
    mn_rng_seed(&global_rng, seed);
    global_seeded = true;
}

/* A value drawn for [lo, hi) can round up to hi once stored in the dtype;
 * step it back inside. */
static void put_uniform(mn_tensor *t, int64_t i, double v, double lo, double hi)
{
    void *p = mn_tensor_data(t);
    switch (t->dtype) {
    case MN_F32: {
        float f = (float)v;
        if (f >= (float)hi && hi > lo) f = nextafterf((float)hi, (float)lo);
        ((float *)p)[i] = f;
        break;
    }
    case MN_F64:
        if (v >= hi && hi > lo) v = nextafter(hi, lo);
        ((double *)p)[i] = v;
        break;
    case MN_I64: ((int64_t *)p)[i] = mn_to_i64(floor(v)); break;
    }
}

/* i64: integers in [lo, hi), floor of the uniform value, like randint. A NULL
 * rng means the global stream. */
mn_status mn_tensor_rand(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                         double lo, double hi, mn_rng *rng)
{
    if (!isfinite(lo) || !isfinite(hi) || hi < lo)
        return mn_fail(MN_ERR_ARG, "rand: bounds [%g, %g) must be finite with lo <= hi", lo, hi);
    if (!rng) rng = mn_global_rng();
    MN_TRY(mn_tensor_empty(out, dt, ndim, shape, MN_CPU));
    int64_t n = mn_tensor_numel(out);
    for (int64_t i = 0; i < n; i++) put_uniform(out, i, lo + (hi - lo) * mn_rng_uniform(rng), lo, hi);
    return MN_OK;
}

mn_status mn_tensor_randn(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                          double mean, double std, mn_rng *rng)
{
    if (dt == MN_I64) return mn_fail(MN_ERR_ARG, "randn: needs a float dtype (f32 or f64), got i64");
    if (!isfinite(mean) || !isfinite(std) || std < 0)
        return mn_fail(MN_ERR_ARG, "randn: mean %g and std %g must be finite, std >= 0", mean, std);
    if (!rng) rng = mn_global_rng();
    MN_TRY(mn_tensor_empty(out, dt, ndim, shape, MN_CPU));
    int64_t n = mn_tensor_numel(out);
    void *p = mn_tensor_data(out);
    for (int64_t i = 0; i < n; i++) {
        double v = mean + std * mn_rng_normal(rng);
        if (dt == MN_F32) ((float *)p)[i] = (float)v;
        else ((double *)p)[i] = v;
    }
    return MN_OK;
}
