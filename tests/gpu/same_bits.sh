#!/bin/sh
# same_bits.sh: two settings of one environment variable that must give the
# same bits, on a GPU. Each experiment of tests/gpu/tier_cases.lua (and each
# with /upstream, so that the backward runs too) goes through `mnemo run
# --device cuda` with VAR=A and VAR=B, in fp32, tf32 and bf16 on the planned
# path, and in fp32 and bf16 with the general and the large path forced on
# a few (PATHS: which of auto, general and large); `mnemo compare --rtol 0
# --atol 0` then requires every output, final weight and gradient to be
# equal to the bit. Uses:
#   MNEMO_COMPILE full fast (the default): the compile tiers compile the same
#     float operations, so a run may move from one to the other between two
#     calls. Also: a bad MNEMO_COMPILE is a one-line error naming it.
#   MNEMO_FUSED_STREAM 0 1 auto: the fused forward with and without its
#     evict-first L2 hints (kernels/fused_kernel.cuh): hints only.
#   MNEMO_FUSED_H16 0 1 auto: the fused forward's bf16 operands kept in
#     floats or stored as bf16 where they are made (kernels/fused_gemm.cuh):
#     the tensor cores get the same values.
#   MNEMO_FUSED_WROT 0 1 auto: bf16's weights in shared memory in plain
#     rows or with their odd rows turned (kernels/fused_gemm.cuh's MN_WROT):
#     where the values sit, not what they are.
#   MNEMO_FUSED_ZPAD 0 1 auto, MNEMO_FUSED_ZROT 0 1 auto: bf16's z rows
#     wider or with their odd rows turned, or neither
#     (kernels/fused_kernel.cuh's MN_ZPAD, MN_ZROT): likewise.
#   MNEMO_FUSED_DISCARD 0 1 auto: the update's read of G drops its L2
#     lines or leaves them (kernels/fused_kernel.cuh's MN_DISCARD).
#   MNEMO_FUSED_W16 0 1 auto: bf16's anchor and current weights kept in
#     shared memory as bf16 rows, or as floats and in global memory
#     (kernels/fused_kernel.cuh's MN_W16): the products' rounded values.
#   MNEMO_LARGE_PDL 0 1 large: the large path's captured steps with and
#     without programmatic dependent launches (kernels/engine_large.c): the
#     same kernels, only launched earlier, each waiting for the one ahead.
# One PASS/FAIL line each. Needs MNEMO and a python with h5py (PYTHON).
#   . tests/gpu/env.sh && sh tests/gpu/same_bits.sh [VAR A B [PATHS]]
MNEMO=${MNEMO:-./mnemo}
PYTHON=${PYTHON:-python3}
VAR=${1:-MNEMO_COMPILE}
A=${2:-full}
B=${3:-fast}
PATHS=${4:-auto general large}
TAG=$([ "$VAR" = MNEMO_COMPILE ] && echo tiers || echo "$VAR=$A/$B")
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
export MNEMO_CACHE=${MNEMO_CACHE:-$W/cache}
"$MNEMO" tests/gpu/tier_cases.lua "$W" || { echo "FAIL $TAG/cases: tier_cases.lua did not run"; exit 1; }
for c in p1 h1 lin huber refresh ln glu ns; do
    cp "$W/$c.h5" "$W/g_$c.h5"
    "$PYTHON" -c "import h5py; s = h5py.File('$W/dy_$c.h5', 'r'); f = h5py.File('$W/g_$c.h5', 'a'); f['upstream/dy'] = s['dy'][()]" ||
        { echo "FAIL $TAG/upstream $c: h5py could not add /upstream"; exit 1; }
done
for path in $PATHS; do
    for prec in fp32 tf32 bf16; do
        for c in p1 h1 lin huber refresh ln glu ns g_p1 g_h1 g_lin g_huber g_ln g_glu g_ns; do
            if [ $path != auto ]; then # the forced paths: a few cases, fp32 and bf16
                case $c in p1 | g_p1 | lin | g_lin | huber) ;; *) continue ;; esac
                [ $prec = tf32 ] && continue
                [ $prec = bf16 ] && case $c in p1 | g_p1) ;; *) continue ;; esac
            fi
            name="$TAG/$c $path $prec"
            for side in a b; do
                value=$([ $side = a ] && echo "$A" || echo "$B")
                if ! env "$VAR=$value" MNEMO_CUDA_PATH=$path "$MNEMO" run "$W/$c.h5" -o "$W/$side.h5" --device cuda \
                    --precision $prec -q > "$W/log" 2>&1; then
                    echo "FAIL $name: the run with $VAR=$value failed: $(tail -1 "$W/log")"
                    continue 2
                fi
            done
            if "$MNEMO" compare "$W/b.h5" "$W/a.h5" --rtol 0 --atol 0 -q > "$W/log" 2>&1; then
                echo "PASS $name: $(tail -1 "$W/log")"
            else
                echo "FAIL $name: $(grep -v '^ *$' "$W/log" | head -3 | tr '\n' ' ')"
            fi
        done
    done
done
[ "$VAR" = MNEMO_COMPILE ] || exit 0
if MNEMO_COMPILE=quick "$MNEMO" run "$W/p1.h5" -o "$W/bad.h5" --device cuda -q 2> "$W/err"; then
    echo "FAIL tiers/bad MNEMO_COMPILE: the run succeeded"
elif grep -q "MNEMO_COMPILE=quick: expected tiered, full or fast" "$W/err"; then
    echo "PASS tiers/bad MNEMO_COMPILE: $(tail -1 "$W/err")"
else
    echo "FAIL tiers/bad MNEMO_COMPILE: $(tail -1 "$W/err")"
fi
