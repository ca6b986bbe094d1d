/* test_random.c: the seeded generator: fixed first values from a fixed seed
 * (reference values from an independent implementation), reseeding, and the
 * moments of uniform and normal draws. */
#include "check.h"
#include "engine.h"
#include "random.h"
#include "random_counter.h"

#include <inttypes.h>
#include <stdlib.h>

/* The reference values come from this independent Python implementation of
 * splitmix64 and xoshiro256** (not from random.c):
 *
 *   M = (1 << 64) - 1
 *   def sm(x):
 *       x = (x + 0x9e3779b97f4a7c15) & M; z = x
 *       z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M
 *       z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M
 *       return x, z ^ (z >> 31)
 *   rotl = lambda x, k: ((x << k) | (x >> (64 - k))) & M
 *   def seed(x):
 *       s = []
 *       for _ in range(4): x, v = sm(x); s.append(v)
 *       return s
 *   def nxt(s):
 *       r = (rotl((s[1] * 5) & M, 7) * 9) & M; t = (s[1] << 17) & M
 *       s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t
 *       s[3] = rotl(s[3], 45); return r
 *
 * Its splitmix64 gives 0xe220a8397b1dcdaf first from seed 0, the value the
 * reference C implementation gives. */
static const uint64_t seed42_first[3] = {0x15780b2e0c2ec716ull, 0x6104d9866d113a7eull, 0xae17533239e499a1ull};
/* Draws 4 and 1000: the rotation of s[3] reaches the output only from the
 * 4th draw on, so the first three alone would not catch a mistake there. */
static const uint64_t seed42_4th = 0xecb8ad4703b360a1ull, seed42_1000th = 0x8de5848c61ab8968ull;
static const uint64_t seed0_first[2] = {0x99ec5f36cb75f2b4ull, 0xbf6e1f784956452aull};

static void test_fixed_values(void)
{
    mn_rng r;
    mn_rng_seed(&r, 42);
    for (int i = 0; i < 3; i++) {
        uint64_t got = mn_rng_u64(&r);
        char name[64];
        snprintf(name, sizeof name, "random/seed42_u64_%d", i);
        if (got != seed42_first[i]) printf("  got 0x%016" PRIx64 " want 0x%016" PRIx64 "\n", got, seed42_first[i]);
        CHECK(name, got == seed42_first[i]);
    }
    uint64_t fourth = mn_rng_u64(&r), last = 0;
    for (int i = 4; i < 1000; i++) last = mn_rng_u64(&r);
    CHECK("random/seed42_u64_4th", fourth == seed42_4th);
    CHECK("random/seed42_u64_1000th", last == seed42_1000th);
    mn_rng_seed(&r, 42);
    CHECK("random/uniform_top53_bits", mn_rng_uniform(&r) == (double)(seed42_first[0] >> 11) * 0x1.0p-53);
    CHECK_NEAR("random/uniform_seed42_value", (double)(seed42_first[0] >> 11) * 0x1.0p-53, 0.08386297105988216, 0);

    /* The global stream starts from seed 0 without any call. */
    mn_rng *g = mn_global_rng();
    CHECK("random/global_seeded_with_0", mn_rng_u64(g) == seed0_first[0] && mn_rng_u64(g) == seed0_first[1]);
    mn_seed(42);
    CHECK("random/mn_seed_reseeds_global", mn_rng_u64(mn_global_rng()) == seed42_first[0]);
}

static void test_reseed(void)
{
    mn_rng a, b;
    mn_rng_seed(&a, 7);
    mn_rng_seed(&b, 7);
    bool same = true;
    for (int i = 0; i < 1000; i++) same = same && mn_rng_normal(&a) == mn_rng_normal(&b);
    CHECK("random/same_seed_same_normals", same);
    /* A half-used Box-Muller pair must not leak across a reseed. */
    mn_rng_seed(&a, 9);
    (void)mn_rng_normal(&a);
    mn_rng_seed(&a, 9);
    mn_rng_seed(&b, 9);
    CHECK("random/reseed_drops_spare", mn_rng_normal(&a) == mn_rng_normal(&b));
    mn_rng_seed(&b, 10);
    mn_rng_seed(&a, 9);
    CHECK("random/different_seeds_differ", mn_rng_u64(&a) != mn_rng_u64(&b));
}

static void test_moments(void)
{
    const int n = 100000;
    mn_rng r;
    mn_rng_seed(&r, 123);
    double s = 0, s2 = 0, lo = 1, hi = 0;
    for (int i = 0; i < n; i++) {
        double u = mn_rng_uniform(&r);
        s += u;
        s2 += u * u;
        if (u < lo) lo = u;
        if (u > hi) hi = u;
    }
    double mean = s / n, var = s2 / n - mean * mean;
    /* Standard errors: 0.29/sqrt(n) ~ 0.0009 for the mean, ~0.0003 for the
     * variance; bounds of about 5 of them. */
    CHECK_NEAR("random/uniform_mean", mean, 0.5, 0.005);
    CHECK_NEAR("random/uniform_var", var, 1.0 / 12, 0.0015);
    CHECK("random/uniform_in_0_1", lo >= 0 && hi < 1);

    s = s2 = 0;
    double s4 = 0;
    for (int i = 0; i < n; i++) {
        double z = mn_rng_normal(&r);
        s += z;
        s2 += z * z;
        s4 += z * z * z * z;
    }
    mean = s / n;
    var = s2 / n - mean * mean;
    CHECK_NEAR("random/normal_mean", mean, 0.0, 0.016);
    CHECK_NEAR("random/normal_var", var, 1.0, 0.025);
    CHECK_NEAR("random/normal_kurtosis", s4 / n, 3.0, 0.1 / 3.0);
}

static void test_tensors(void)
{
    mn_rng r;
    mn_rng_seed(&r, 5);
    mn_tensor t = {0};
    int64_t shape[2] = {300, 400};
    mn_status st = mn_tensor_rand(&t, MN_F32, 2, shape, -2.0, 3.0, &r);
    CHECK("random/rand_ok", st == MN_OK);
    const float *p = mn_tensor_data(&t);
    double s = 0;
    bool inside = true;
    for (int64_t i = 0; i < 120000; i++) {
        inside = inside && p[i] >= -2.0f && p[i] < 3.0f;
        s += p[i];
    }
    CHECK("random/rand_in_bounds", inside);
    CHECK_NEAR("random/rand_mean", s / 120000, 0.5, 0.02);
    /* The tensor takes the stream's values in row-major order. */
    mn_rng_seed(&r, 5);
    CHECK("random/rand_order", p[0] == (float)(-2.0 + 5.0 * mn_rng_uniform(&r)) &&
                                   p[1] == (float)(-2.0 + 5.0 * mn_rng_uniform(&r)));
    mn_tensor_release(&t);

    st = mn_tensor_randn(&t, MN_F64, 2, shape, 1.0, 2.0, &r);
    CHECK("random/randn_ok", st == MN_OK);
    const double *q = mn_tensor_data(&t);
    double m = 0, v = 0;
    for (int64_t i = 0; i < 120000; i++) m += q[i];
    m /= 120000;
    for (int64_t i = 0; i < 120000; i++) v += (q[i] - m) * (q[i] - m);
    v /= 120000;
    CHECK_NEAR("random/randn_mean", m, 1.0, 0.03);
    CHECK_NEAR("random/randn_std", sqrt(v), 2.0, 0.01);
    mn_tensor_release(&t);

    int64_t n1 = 10000;
    st = mn_tensor_rand(&t, MN_I64, 1, &n1, 0, 10, &r);
    const int64_t *iv = mn_tensor_data(&t);
    int seen[10] = {0};
    bool ints = st == MN_OK;
    for (int64_t i = 0; ints && i < n1; i++) {
        ints = iv[i] >= 0 && iv[i] < 10;
        if (ints) seen[iv[i]]++;
    }
    bool all = true;
    for (int i = 0; i < 10; i++) all = all && seen[i] > 800;
    CHECK("random/rand_i64_range", ints && all);
    mn_tensor_release(&t);

    st = mn_tensor_randn(&t, MN_I64, 1, &n1, 0, 1, &r);
    CHECK("random/randn_i64_refused", st == MN_ERR_ARG && t.storage == NULL);
    CHECK_STR_CONTAINS("random/randn_i64_message", mn_last_error(), "randn: needs a float dtype");
    st = mn_tensor_rand(&t, MN_F32, 1, &n1, 3, 1, &r);
    CHECK("random/rand_bad_bounds", st == MN_ERR_ARG && t.storage == NULL);

    /* NULL rng: the global stream. */
    mn_seed(11);
    st = mn_tensor_rand(&t, MN_F64, 1, &n1, 0, 1, NULL);
    mn_rng_seed(&r, 11);
    CHECK("random/rand_null_rng_is_global", st == MN_OK && ((double *)mn_tensor_data(&t))[0] == mn_rng_uniform(&r));
    mn_tensor_release(&t);
}

/* The counter-based generator of initial weights (random_counter.h). The
 * reference values come from this independent Python:
 *   M = (1 << 64) - 1
 *   def mix(z):
 *       z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M
 *       z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M
 *       return z ^ (z >> 31)
 *   def u64(seed, stream, i):
 *       k = mix((seed + 0x9e3779b97f4a7c15) & M)
 *       k = mix(k ^ ((stream * 0xd1b54a32d192ed03 + 0x632be59bd9b4e019) & M))
 *       return mix(k ^ ((i * 0x9e3779b97f4a7c15 + 0x8cb92ba72f3d8dd7) & M)) */
static void test_counter(void)
{
    CHECK("counter/fixed_42_0_0", mn_rc_u64(42, 0, 0) == 0x951b29f9437dc58bull);
    CHECK("counter/fixed_42_3_1000", mn_rc_u64(42, 3, 1000) == 0x61592c8393da7a0eull);
    CHECK("counter/fixed_0_1_7", mn_rc_u64(0, 1, 7) == 0xef7482287cf36ed0ull);
    CHECK("counter/fixed_big_seed", mn_rc_u64(9223372036854775813ull, 2, 123456789) == 0x4c6c84b95cf94dc6ull);
    /* moments of 200000 draws, and two streams of one seed uncorrelated */
    const int n = 200000;
    double su = 0, suu = 0, sn = 0, snn = 0, cross = 0;
    for (int i = 0; i < n; i++) {
        double u = mn_rc_uniform(7, 0, (uint64_t)i), z = mn_rc_normal(7, 0, (uint64_t)i), w = mn_rc_normal(7, 1, (uint64_t)i);
        su += u;
        suu += u * u;
        sn += z;
        snn += z * z;
        cross += z * w;
    }
    CHECK_NEAR("counter/uniform_mean", su / n, 0.5, 0.005);
    CHECK_NEAR("counter/uniform_var", suu / n - (su / n) * (su / n), 1.0 / 12, 0.002);
    CHECK_NEAR("counter/normal_mean", sn / n, 0.0, 0.01);
    CHECK_NEAR("counter/normal_var", snn / n, 1.0, 0.02);
    CHECK_NEAR("counter/streams_uncorrelated", cross / n, 0.0, 0.01);
    /* mn_init_params: xavier within its bound, memories distinct, shared = memory 0 everywhere, biases 0 */
    mn_rule r;
    mn_rule_init(&r);
    r.layers = 2;
    r.bias = true;
    mn_dims d = {.B = 2, .H = 3, .T = 1, .dk = 5, .dv = 4, .dh = 7, .S = 1};
    mn_tensor own[MN_MAX_PARAMS] = {{0}}, shared[MN_MAX_PARAMS] = {{0}};
    bool made = mn_init_params(&r, &d, "xavier", 11, false, own, MN_CPU) == MN_OK &&
                mn_init_params(&r, &d, "xavier", 11, true, shared, MN_CPU) == MN_OK;
    CHECK("counter/init_made", made);
    if (made) {
        const float *w = mn_tensor_data(&own[0]), *ws = mn_tensor_data(&shared[0]), *b = mn_tensor_data(&own[1]);
        double bound = sqrt(6.0 / (7 + 5)), worst = 0;
        bool distinct = false, same = true;
        for (int e = 0; e < 6 * 35; e++) worst = fmax(worst, fabs(w[e]));
        for (int e = 0; e < 35; e++) {
            distinct = distinct || w[e] != w[35 + e];
            same = same && ws[e] == ws[5 * 35 + e] && ws[e] == w[e];
        }
        CHECK("counter/init_xavier_bound", worst <= bound && worst > 0.5 * bound);
        CHECK("counter/init_memories_distinct", distinct);
        CHECK("counter/init_shared_is_memory0", same);
        CHECK("counter/init_value_is_the_counter_draw",
              w[35 + 3] == mn_rc_init_value(MN_RC_UNIFORM, bound, 11, 0, 35 + 3));
        CHECK("counter/init_bias_zero", b[0] == 0.0f && b[6 * 7 - 1] == 0.0f);
    }
    for (int p = 0; p < MN_MAX_PARAMS; p++) {
        mn_tensor_release(&own[p]);
        mn_tensor_release(&shared[p]);
    }
    mn_rule_free(&r);
}

int main(void)
{
    test_counter();
    test_fixed_values();
    test_reseed();
    test_moments();
    test_tensors();
    return CHECK_DONE();
}
