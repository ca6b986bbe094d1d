/* random.h: the seeded generator behind rand/randn and parameter
 * initialisers. xoshiro256** seeded through splitmix64, normals by
 * Box-Muller in double: integer arithmetic plus libm, so mnemo.seed(n)
 * gives the same numbers on every machine. One global stream, like torch's
 * default generator; engine code that needs its own stream makes one. */
#ifndef MN_RANDOM_H
#define MN_RANDOM_H

#include "tensor.h"

typedef struct mn_rng {
    uint64_t s[4];
    bool has_spare;
    double spare;
} mn_rng;

void mn_rng_seed(mn_rng *rng, uint64_t seed);
uint64_t mn_rng_u64(mn_rng *rng);
double mn_rng_uniform(mn_rng *rng); /* [0, 1), 53 random bits */
double mn_rng_normal(mn_rng *rng);

mn_rng *mn_global_rng(void); /* seeded with 0 at start-up */
void mn_seed(uint64_t seed);

/* Fill a new CPU tensor: uniform in [lo, hi) or normal(mean, std). */
mn_status mn_tensor_rand(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                         double lo, double hi, mn_rng *rng);
mn_status mn_tensor_randn(mn_tensor *out, mn_dtype dt, int ndim, const int64_t *shape,
                          double mean, double std, mn_rng *rng);

#endif
