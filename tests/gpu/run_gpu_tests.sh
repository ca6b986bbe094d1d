#!/bin/sh
# run_gpu_tests.sh: every test that needs a GPU, on a machine with one, from
# a build made elsewhere and carried over (tests/gpu/pack.sh there, then here
# `. tests/gpu/env.sh && sh tests/gpu/run_gpu_tests.sh`):
#   - the unit-test binaries and the Lua tests (the CUDA ones run for real),
#   - the rule engine from Lua on cuda against cpu (run, memory in pieces,
#     read, precision modes, rule:source), and the backward of a cuda run on
#     the GPU against the cpu's (tests/lua/test_grad_cuda.lua: the planned
#     fused, large or general backward, then the general and the large one
#     forced, then tf32 and bf16),
#   - the conformance suite (tests/reference) on cuda in fp32, tf32 and bf16
#     on the path the plan picks (the fused kernel for layers 1 and 2), in
#     fp32 on sequences up to 400 tokens (steps longer than a chunk), and in
#     fp32 with the general and the large path forced (MNEMO_CUDA_PATH; and
#     in tf32 and bf16 on fewer configurations; the large one also in chunks
#     of 64 rows, and with its last bias gradient from our own column launch,
#     MNEMO_LARGE_BGRAD=0), all
#     at once (they share the kernel cache, written atomically); the forced
#     runs' /grads come from the GPU's general and large backward, the
#     others' from the CPU's (MNEMO_CUDA_BACKWARD=cpu); and fewer configurations in each
#     precision whose /grads come from the planned GPU backward (the fused
#     one where the forward is fused, whatever the refresh),
#   - the compile tiers (tests/lua/test_compile_tiers.lua with an empty
#     kernel cache; tests/gpu/same_bits.sh: the fast and the full tier's
#     outputs and gradients equal to the bit on every path),
#   - the experiment knobs (kernels/plan.c: the fused forward's L2 hints and
#     bf16 layouts, the large path's dependent launches): same_bits.sh with
#     each at 0 and at 1, eight runs side by side in the background,
#   - the PyTorch bridge (tests/python/test_bridge.py, tests/gpu/test_bridge_gpu.py),
#   - compute-sanitizer (memcheck; racecheck, initcheck, synccheck on fewer)
#     on a few `mnemo run` calls, seven of them with the backward (fused and
#     general, each also with newton_schulz; general through glu's gated
#     layers; fused with qk_norm; large), and (memcheck, initcheck) on
#     tests/lua/test_large_keep.lua: the large path's kept step graphs,
#   - one mid-size run timed on cuda and cpu, and compared.
# Logs go to $OUT (default: a temporary folder): summary.log (every
# PASS/FAIL/SKIP line), conformance_{fp32,tf32,bf16,long,general,large,general_*,large_*,backward_*,cluster*}.log,
# gpu_logs.tgz
# with the rest (few files: the device tool brings back at most 8). Ends with
# "N passed, N failed" (exit 1 on failure).
# Environment: MNEMO (the binary; env.sh sets it), PYTHON (one with torch and
# h5py; default python3, else /usr/bin/python3), MNEMO_CONFORMANCE_COUNT
# (default 200), CONFORMANCE_TIMEOUT (seconds per precision, default 540),
# CONFORMANCE_SHARDS (processes for each of the three largest conformance
# runs, default 4; the forced-path fp32 runs get half). PARTS: which parts
# run, any of conformance conformance_paths conformance_clusters knobs unit
# lua tiers paths engine bridge cli sanitizer timing (default all). The
# whole is several device calls' work (10 minutes each at most). On an
# H200 with 16 host cores (2026-11-29): the planned path's conformance in
# three precisions (four shards each, without long) took 165 s with the
# machine to itself; PARTS="conformance unit lua" ran out of 575 s in the
# Lua tests (at test_norm.lua); all three conformance parts beside the
# paths, bridge, CLI, sanitizer and timing parts did not finish in 430 s.
# So a part or two a call, say PARTS="conformance unit", "lua",
# "conformance_paths", "conformance_clusters", "knobs tiers", "paths
# engine", "bridge cli sanitizer timing" (not all timed alone yet).
cd "$(dirname "$0")/../.." || exit 2
# want PART: whether PARTS asks for it
want() { case " ${PARTS:-all} " in *" all "* | *" $1 "*) return 0 ;; esac; return 1; }
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
MNEMO=${MNEMO:-$PWD/.carry/bin/mnemo}
export MNEMO
BIN_DIR=$(dirname "$MNEMO")
WORK=$(mktemp -d)
LOGS=$WORK/logs
mkdir -p "$LOGS"
export MNEMO_CACHE=${MNEMO_CACHE:-$WORK/cache}
summary=$OUT/summary.log
: > "$summary"
start=$(date +%s)

PYTHON=${PYTHON:-}
for p in python3 /usr/bin/python3; do
    [ -n "$PYTHON" ] && break
    "$p" -c 'import torch, h5py, numpy' 2>/dev/null && PYTHON=$p
done
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)

# run_one LABEL COMMAND...: run, keep the output in $LOGS/LABEL.log, count its
# lines (a non-zero exit without a FAIL line, or no lines at all, is a FAIL).
run_one() {
    label=$1; shift
    logf=$LOGS/$(echo "$label" | tr '/ ' '__').log
    echo "== $label"
    "$@" > "$logf" 2>&1
    rc=$?
    count "$label" "$logf" "$rc"
}

count() { # label logfile rc
    grep -E '^(PASS|FAIL|SKIP) ' "$2" | tee -a "$summary" | grep -v '^PASS ' | head -40
    n_any=$(grep -cE '^(PASS|FAIL|SKIP) ' "$2")
    n_fail=$(grep -c '^FAIL ' "$2")
    echo "   $(grep -c '^PASS ' "$2") passed, $n_fail failed ($2)"
    if [ "$3" -ne 0 ] && [ "$n_fail" -eq 0 ]; then
        echo "FAIL $1: exited with status $3" | tee -a "$summary"
        tail -5 "$2"
    elif [ "$n_any" -eq 0 ]; then
        echo "FAIL $1: printed no test lines" | tee -a "$summary"
        tail -5 "$2"
    fi
}

echo "== device"
nvidia-smi -L 2>&1 | head -4
"$MNEMO" -e 'print(mnemo.device(), mnemo.cuda_available())' 2>&1 | head -3
echo "python: $PYTHON; sanitizer: $SANITIZER; logs: $OUT"

# ---- conformance, in the background: the longest part ----
# conformance NAME SHARDS VAR=VALUE...: tests/reference/test_conformance.py
# with that environment in SHARDS background processes, each a share of the
# configurations (MNEMO_CONFORMANCE_SHARD): a process is CPU-bound on the
# float64 reference, so the shards run side by side on the machine's cores.
# Logs $WORK/conformance_NAME.K.log, joined at the end.
CONFORMANCE_RUNS=
# Each configuration is a process of its own that compiles its kernels once:
# the optimised compile at once (MNEMO_COMPILE=full), which is what
# conformance checks; tiered, every process would compile twice (the fast
# tier, then the full one in a child that no later process uses), doubling
# the compile work of a run where no source repeats (same_bits.sh checks
# that the fast tier's results equal the full one's).
conformance() {
    name_=$1; shards_=$2; shift 2
    CONFORMANCE_RUNS="$CONFORMANCE_RUNS $name_"
    k_=0
    while [ "$k_" -lt "$shards_" ]; do
        ( env MNEMO_COMPILE=full "$@" MNEMO_CONFORMANCE_SHARD="$k_/$shards_" timeout "${CONFORMANCE_TIMEOUT:-540}" \
              "$PYTHON" tests/reference/test_conformance.py > "$WORK/conformance_$name_.$k_.log" 2>&1
          echo $? > "$WORK/conformance_$name_.$k_.rc" ) &
        k_=$((k_ + 1))
    done
}
# Three parts, each started at once and counted at the end: conformance
# (the planned path in three precisions, and long sequences),
# conformance_paths (the general and the large path forced, and the planned
# backward) and conformance_clusters.
SHARDS=${CONFORMANCE_SHARDS:-4}
if want conformance && [ -n "$PYTHON" ]; then
    # The forward on the path the plan picks in each precision, 200 random
    # configurations and the wide ones; their /grads from the CPU's backward
    # (MNEMO_CUDA_BACKWARD=cpu): the GPU's backward is checked below
    for prec in fp32 tf32 bf16; do
        conformance "$prec" "$SHARDS" MNEMO_CUDA_BACKWARD=cpu MNEMO_DEVICE=cuda MNEMO_PRECISION=$prec
    done
    # long sequences: steps of more than 64 tokens take the kernel's chunked path
    conformance long 1 MNEMO_CUDA_BACKWARD=cpu MNEMO_DEVICE=cuda MNEMO_PRECISION=fp32 MNEMO_CONFORMANCE_SEED=7 \
        MNEMO_CONFORMANCE_MAX_T=400 MNEMO_CONFORMANCE_COUNT=${LONG_CONFORMANCE_COUNT:-40}
fi
if want conformance_paths && [ -n "$PYTHON" ]; then
    # the paths the plan did not pick for these small rules, forced
    # (kernels/plan.h): the general kernel, and the cuBLAS + graph path
    # (their /grads from the GPU's backward: the general one, and the large
    # one that the large forward brings with it)
    for path in general large; do
        conformance "$path" $(( (SHARDS + 1) / 2 )) MNEMO_CUDA_PATH=$path MNEMO_DEVICE=cuda MNEMO_PRECISION=fp32 \
            MNEMO_CONFORMANCE_SEED=3 MNEMO_CONFORMANCE_COUNT=${PATH_CONFORMANCE_COUNT:-80}
    done
    # and the same two forced in tf32 and bf16, on fewer configurations
    for path in general large; do
        for prec in tf32 bf16; do
            conformance "${path}_$prec" 1 MNEMO_CUDA_PATH=$path MNEMO_DEVICE=cuda MNEMO_PRECISION=$prec \
                MNEMO_CONFORMANCE_SEED=11 MNEMO_CONFORMANCE_COUNT=${BACKWARD_CONFORMANCE_COUNT:-24}
        done
    done
    # the large path in chunks of 64 rows of all memories
    # (MNEMO_LARGE_CHUNK_ROWS): the reference's steps then run in several
    # chunks, forward and backward, their gradients summed over the chunks
    for prec in fp32 bf16; do
        conformance "large_chunked_$prec" 1 MNEMO_CUDA_PATH=large MNEMO_LARGE_CHUNK_ROWS=64 MNEMO_DEVICE=cuda \
            MNEMO_PRECISION=$prec MNEMO_CONFORMANCE_SEED=3 MNEMO_CONFORMANCE_COUNT=${BACKWARD_CONFORMANCE_COUNT:-24}
    done
    # the large path with the last layer's bias gradient summed by a column
    # launch of its own in every chunk (MNEMO_LARGE_BGRAD=0), where cuBLASLt's
    # epilogue sums a step's first chunk by default
    for prec in fp32 bf16; do
        conformance "large_nobgrad_$prec" 1 MNEMO_CUDA_PATH=large MNEMO_LARGE_BGRAD=0 MNEMO_DEVICE=cuda \
            MNEMO_PRECISION=$prec MNEMO_CONFORMANCE_SEED=7 MNEMO_CONFORMANCE_COUNT=${BACKWARD_CONFORMANCE_COUNT:-24}
    done
    # the planned backward (fused where the rule takes it) against the
    # reference's gradients in each precision, on fewer configurations
    for prec in fp32 tf32 bf16; do
        conformance "backward_$prec" 1 MNEMO_DEVICE=cuda MNEMO_PRECISION=$prec MNEMO_CONFORMANCE_SEED=5 \
            MNEMO_CONFORMANCE_COUNT=${BACKWARD_CONFORMANCE_COUNT:-24}
    done
fi
if want conformance_clusters && [ -n "$PYTHON" ]; then
    # the configurations a cluster of 2 and of 4 blocks runs, split so
    # (MNEMO_CONFORMANCE_CLUSTER: only those, with MNEMO_FUSED_CLUSTER; about
    # one in twelve of the generator's): the fused kernel's cluster form on
    # the reference's small rules; their backward is the large one
    for cl in 2 4; do
        conformance "cluster$cl" 2 MNEMO_CONFORMANCE_CLUSTER=$cl MNEMO_DEVICE=cuda MNEMO_PRECISION=fp32 \
            MNEMO_CONFORMANCE_SEED=13 MNEMO_CONFORMANCE_COUNT=${CLUSTER_CONFORMANCE_COUNT:-600}
        for prec in tf32 bf16; do
            conformance "cluster${cl}_$prec" 1 MNEMO_CONFORMANCE_CLUSTER=$cl MNEMO_DEVICE=cuda MNEMO_PRECISION=$prec \
                MNEMO_CUDA_BACKWARD=cpu MNEMO_CONFORMANCE_SEED=17 MNEMO_CONFORMANCE_COUNT=${CLUSTER_CONFORMANCE_COUNT:-600}
        done
    done
fi
if [ -z "$PYTHON" ] && { want conformance || want conformance_paths || want conformance_clusters; }; then
    echo "FAIL conformance: no python with torch and h5py (set PYTHON)" | tee -a "$summary"
fi

# ---- the experiment knobs, in the background ----
# Each knob (kernels/plan.c) changes where values sit or how they travel,
# never what they are: tests/gpu/same_bits.sh runs the tier cases with the
# knob at 0 and at 1 and requires every output and gradient equal to the
# bit. A knob's two settings are two sources, so each run is mostly NVRTC's
# compile work on the CPU (about 4 minutes alone); the eight run side by
# side on the machine's cores, sharing the kernel cache as the conformance
# shards do. Logs $LOGS/knob_NAME.log, counted at the end.
KNOB_RUNS=
knob() { # NAME VAR PATHS
    KNOB_RUNS="$KNOB_RUNS $1"
    ( env PYTHON="$PYTHON" MNEMO_COMPILE=full sh tests/gpu/same_bits.sh "$2" 0 1 "$3" > "$LOGS/knob_$1.log" 2>&1
      echo $? > "$WORK/knob_$1.rc" ) &
}
if want knobs && [ -n "$PYTHON" ]; then
    knob l2_hints MNEMO_FUSED_STREAM auto     # the fused forward's evict-first hints
    knob bf16_operands MNEMO_FUSED_H16 auto   # bf16's operands stored as bf16 by their producers
    knob bf16_w_turned MNEMO_FUSED_WROT auto  # bf16's weights' odd rows turned
    knob bf16_z_wider MNEMO_FUSED_ZPAD auto   # bf16's z rows 4 floats wider
    knob bf16_z_turned MNEMO_FUSED_ZROT auto  # bf16's z rows turned
    knob g_discarded MNEMO_FUSED_DISCARD auto # the gradient's L2 lines dropped after the update's read
    knob bf16_w_rows MNEMO_FUSED_W16 auto     # bf16's anchor and current weights as bf16 rows
    knob large_pdl MNEMO_LARGE_PDL large      # the large path's dependent launches
elif want knobs; then
    echo "FAIL knobs: no python with h5py (set PYTHON)" | tee -a "$summary"
fi

# ---- unit and Lua tests ----
want unit && for t in "$BIN_DIR"/test_*; do
    # the kernels' sources run on the CPU as C++: CI's test, minutes of
    # compiling here and nothing the GPU adds
    [ "$(basename "$t")" = test_grad_emulated ] && continue
    [ -x "$t" ] && run_one "unit/$(basename "$t")" "$t"
done
# (test_grad_cuda.lua among them: the backward of cuda runs on the GPU against
# the cpu's; its kernel recomputes the forward itself, whatever path ran it)
want lua && for t in tests/lua/test_*.lua; do
    [ -f "$t" ] && run_one "lua/$(basename "$t")" "$MNEMO" "$t"
done
# Every row of the rule table on each CUDA path forced (the plain run above
# took the planned path); a path that cannot take a case says SKIP.
# the compile tiers: a fresh rule on the fast tier, then the full one, with an
# empty kernel cache (the test fails where it finds its kernels cached); and
# every output and gradient of the two tiers equal to the bit
want tiers && {
    run_one "lua/test_compile_tiers.lua (empty cache)" env MNEMO_CACHE="$(mktemp -d)" MNEMO_TEST_FRESH_CACHE=1 \
        "$MNEMO" tests/lua/test_compile_tiers.lua
    [ -n "$PYTHON" ] && run_one "gpu/same_bits.sh (compile tiers)" env PYTHON="$PYTHON" sh tests/gpu/same_bits.sh
}

want paths && for path in general fused large; do
    run_one "lua/test_rule_table.lua ($path)" env MNEMO_CUDA_PATH=$path "$MNEMO" tests/lua/test_rule_table.lua
    run_one "lua/test_norm.lua ($path)" env MNEMO_CUDA_PATH=$path "$MNEMO" tests/lua/test_norm.lua
    # lengths and newton_schulz: every path runs them
    run_one "lua/test_ragged_precond.lua ($path)" env MNEMO_CUDA_PATH=$path "$MNEMO" tests/lua/test_ragged_precond.lua
    # glu runs on the general and large paths (forced large: every case without out_norm,
    # and hidden-256 memories); forced fused, it is refused by name
    run_one "lua/test_glu.lua ($path)" env MNEMO_CUDA_PATH=$path "$MNEMO" tests/lua/test_glu.lua
    # constants read at run time: one module, three runs with two values
    run_one "lua/test_constants.lua ($path)" env MNEMO_CUDA_PATH=$path "$MNEMO" tests/lua/test_constants.lua
done
# the large path keeping nothing between runs (its default keeps each
# shape's step graph): the same results, nothing kept
want paths && run_one "lua/test_large_keep.lua (keeping off)" env MNEMO_LARGE_KEEP=0 "$MNEMO" tests/lua/test_large_keep.lua
# The fused cases, out_norm's and the constants with every 2-layer memory a
# cluster can run split over 2, 4 and 8 blocks (sm_90)
want paths && for cl in 2 4 8; do
    run_one "lua/test_fused.lua (cluster $cl)" env MNEMO_FUSED_CLUSTER=$cl "$MNEMO" tests/lua/test_fused.lua
    run_one "lua/test_norm.lua (cluster $cl)" env MNEMO_FUSED_CLUSTER=$cl "$MNEMO" tests/lua/test_norm.lua
    run_one "lua/test_constants.lua (cluster $cl)" env MNEMO_FUSED_CLUSTER=$cl "$MNEMO" tests/lua/test_constants.lua
done
# The backward on the GPU against the cpu's: every case on the general
# backward forced, and in tf32 and bf16 (the fused backward where planned)
want paths && {
    run_one "lua/test_grad_cuda.lua (general backward)" env MNEMO_CUDA_BACKWARD=general "$MNEMO" tests/lua/test_grad_cuda.lua
    # the large backward forced: every case without out_norm, glu or newton_schulz
    run_one "lua/test_grad_cuda.lua (large backward)" env MNEMO_CUDA_BACKWARD=large "$MNEMO" tests/lua/test_grad_cuda.lua
    for backward in general large; do
        run_one "lua/test_constants.lua ($backward backward)" env MNEMO_CUDA_BACKWARD=$backward "$MNEMO" tests/lua/test_constants.lua
    done
    for prec in tf32 bf16; do
        run_one "lua/test_grad_cuda.lua ($prec)" env MNEMO_GRAD_PRECISION=$prec "$MNEMO" tests/lua/test_grad_cuda.lua
    done
    # every 2-layer case's forward on a cluster of 2, its backward the large (or general) one
    run_one "lua/test_grad_cuda.lua (cluster 2)" env MNEMO_FUSED_CLUSTER=2 "$MNEMO" tests/lua/test_grad_cuda.lua
}

# ---- the rule engine from Lua: cuda against cpu ----
want engine && cat > "$WORK/engine.lua" <<'EOF'
local T = dofile("tests/lua/check.lua")
local m = mnemo
local function num(x) return type(x) == "number" and x or x:item() end
local function rel(a, b) -- |a - b| / |b|, on the cpu
  a, b = a:cpu(), b:cpu()
  local nb = num(b:norm())
  return num((a - b):norm()) / (nb > 0 and nb or 1)
end
m.seed(11)
local B, H, Tn, dk, dv = 2, 3, 40, 6, 5
local k, v = m.randn(B, H, Tn, dk) * 0.4, m.randn(B, H, Tn, dv) * 0.5
local q = m.randn(B, H, Tn, dk) * 0.4
local rules = {
  linear = m.rule { theta = 0.05, eta = 0.5, alpha = 0.01 },
  mlp = m.rule { layers = 2, hidden = 7, activation = "gelu", step = 4, refresh = 8, theta = 0.05, eta = 0.6,
                 clip = "norm", clip_max = 0.5, retrieve = "before" },
  deep = m.rule { layers = 3, hidden = 9, activation = "z*tanh(softplus(z))", loss = "log(1 + r^2)", step = 70,
                  token_reduce = "mean", clip = "elementwise", clip_expr = "m*tanh(g/m)", constants = { m = 0.01 },
                  theta = 0.3 },
}
for name, r in pairs(rules) do
  local c = r:run { k = k, v = v, q = q, seed = 3 }
  for _, prec in ipairs { "fp32", "tf32", "bf16" } do
    local g = r:run { k = k, v = v, q = q, seed = 3, device = "cuda", precision = prec }
    local tol = ({ fp32 = 1e-5, tf32 = 5e-3, bf16 = 3e-2 })[prec]
    T.ok(("engine/run/%s/%s/y"):format(name, prec), rel(g.outputs.y, c.outputs.y) < tol,
         ("rel %g"):format(rel(g.outputs.y, c.outputs.y)))
    T.ok(("engine/run/%s/%s/W1"):format(name, prec), rel(g.final.W1, c.final.W1) < tol,
         ("rel %g"):format(rel(g.final.W1, c.final.W1)))
    T.ok(("engine/run/%s/%s/loss"):format(name, prec), rel(g.outputs.loss, c.outputs.loss) < tol,
         ("rel %g"):format(rel(g.outputs.loss, c.outputs.loss)))
  end
end
-- a memory fed in pieces on cuda equals one run on cpu; read at the end
local r = rules.mlp
local whole = r:run { k = k, v = v, seed = 5 }
local mem = r:memory { B = B, H = H, dk = dk, dv = dv, seed = 5, device = "cuda" }
local o1 = mem:run(k[{ {}, {}, { 1, 16 } }], v[{ {}, {}, { 1, 16 } }])
local o2 = mem:run(k[{ {}, {}, { 17, Tn } }], v[{ {}, {}, { 17, Tn } }])
local y = m.cat({ o1.y:cpu(), o2.y:cpu() }, 3)
T.ok("engine/memory_pieces/y", rel(y, whole.outputs.y) < 1e-5, ("rel %g"):format(rel(y, whole.outputs.y)))
T.ok("engine/memory_pieces/W2", rel(mem:state().W2, whole.final.W2) < 1e-5)
local cm = r:memory { B = B, H = H, dk = dk, dv = dv, seed = 5 }
cm:run(k, v)
T.ok("engine/read", rel(mem:read(q), cm:read(q)) < 1e-5, ("rel %g"):format(rel(mem:read(q), cm:read(q))))
local src = r:source { dk = dk, dv = dv }
T.ok("engine/source", src:find("mn_rule_step_kernel", 1, true) ~= nil and src:find("mn_hook_act_grad", 1, true) ~= nil)
T.done()
EOF
want engine && run_one "engine/lua" "$MNEMO" "$WORK/engine.lua"

# ---- the PyTorch bridge (python/mnemo_torch): its CPU tests under this
# machine's torch (2.x: the custom-op path), then cuda, compile and graphs ----
if want bridge && [ -n "$PYTHON" ]; then
    run_one "py/test_bridge.py" "$PYTHON" tests/python/test_bridge.py
    run_one "gpu/test_bridge_gpu.py" "$PYTHON" tests/gpu/test_bridge_gpu.py
    # the bridge compiles full by default; tiered, its CUDA-graph checks
    # capture while the full tier still compiles (the graph keeps the fast kernels)
    run_one "gpu/test_bridge_gpu.py (tiered compile)" env MNEMO_COMPILE=tiered MNEMO_CACHE="$(mktemp -d)" \
        "$PYTHON" tests/gpu/test_bridge_gpu.py
    # its rules (hidden 16) split over a cluster of 2: the CUDA-graph capture of a cluster launch
    run_one "gpu/test_bridge_gpu.py (cluster 2)" env MNEMO_FUSED_CLUSTER=2 "$PYTHON" tests/gpu/test_bridge_gpu.py
fi

# ---- mnemo run on cuda: --timing's phases, and big inputs and outputs
# staged through page-locked buffers (model/h5.h), against the cpu ----
if want cli && [ -n "$PYTHON" ]; then
    run_one "py/test_run_cli.py (cuda)" env MNEMO_DEVICE=cuda "$PYTHON" tests/reference/test_run_cli.py
fi

# ---- compute-sanitizer on a few runs ----
if ! want sanitizer; then
    :
elif [ -n "$PYTHON" ] && [ -x "$SANITIZER" ]; then
    # --v1: files without the SPEC v2 options (a ragged and a glu file follow)
    "$PYTHON" tests/reference/gen_experiments.py --seed 4 --count 9 --v1 --out "$WORK/san" > /dev/null 2>&1
    # a ragged batch (lengths 0, inside a step, T) on the general kernel
    "$MNEMO" -e "local m = mnemo; m.seed(3)
      local r = m.rule { layers = 2, hidden = 6, step = 4, refresh = 8, retrieve = 'after', token_reduce = 'mean',
                         theta = 0.2, eta = 0.5 }
      m.save('$WORK/san/ragged.h5', r:experiment { k = m.randn(3, 2, 22, 5), v = m.randn(3, 2, 22, 4),
                                                  lengths = { 0, 9, 22 } })" > /dev/null 2>&1
    # and one glu file (the general path's gated layers, newton_schulz on U_i)
    cat > "$WORK/glu_exp.lua" <<'EOF'
mnemo.seed(4)
local dk, dh, dv = 5, 7, 5
local rule = mnemo.rule{layers = 3, glu = true, activation = "silu", hidden = dh, step = 3, refresh = 6,
                        precondition = "newton_schulz", residual = true}
local init = {W1 = mnemo.randn(dh, dk) * 0.4, U1 = mnemo.randn(dh, dk) * 0.4, W2 = mnemo.randn(dh, dh) * 0.3,
              U2 = mnemo.randn(dh, dh) * 0.3, W3 = mnemo.randn(dv, dh) * 0.3}
mnemo.save(os.getenv("GLU_EXP"), rule:experiment{k = mnemo.randn(2, 2, 20, dk) * 0.5,
                                                 v = mnemo.randn(2, 2, 20, dv), theta = 0.05, init = init})
EOF
    GLU_EXP="$WORK/san/exp_glu.h5" "$MNEMO" "$WORK/glu_exp.lua" > /dev/null 2>&1
    # and one for the large path (hidden 256: planned there): 3 gated layers, an anchor
    "$MNEMO" -e "local m = mnemo; m.seed(6)
      local r = m.rule { layers = 3, glu = true, activation = 'gelu', hidden = 256, step = 4, refresh = 8,
                         residual = true, theta = 0.01, eta = 0.5 }
      m.save('$WORK/san/glu_large.h5', r:experiment { k = m.randn(1, 2, 14, 8) * 0.5, v = m.randn(1, 2, 14, 8) })" \
        > /dev/null 2>&1
    # and one whose k, v and y (2 MiB each) are staged (model/h5.h)
    "$MNEMO" -e "local m = mnemo; m.seed(8)
      local r = m.rule { layers = 2, hidden = 32, step = 64, refresh = 64, theta = 0.01 }
      m.save('$WORK/san/staged.h5', r:experiment { k = m.randn(1, 2, 4096, 64) * 0.2, v = m.randn(1, 2, 4096, 64) })" \
        > /dev/null 2>&1
    # attach_upstream TAG NAME...: the datasets NAME... of up_TAG.h5 into
    # grad_TAG.h5's /upstream group (the backward's input), then up_TAG.h5 goes
    attach_upstream() {
        tag_=$1
        shift
        "$PYTHON" -c "
import h5py, sys
with h5py.File(sys.argv[1], 'r') as src, h5py.File(sys.argv[2], 'a') as f:
    for name in sys.argv[3:]:
        f['upstream/' + name] = src[name][()]
" "$WORK/san/up_$tag_.h5" "$WORK/san/grad_$tag_.h5" "$@" > /dev/null 2>&1
        rm -f "$WORK/san/up_$tag_.h5"
    }
    # and three with /upstream: the backward on the GPU, fused with refresh =
    # step and with refresh 0 (the anchor in the slots), the latter on the
    # general backward forced too; widths past one tile, q, several chunks a
    # step; and fused with qk_norm (the keys normalised and their gradients
    # taken back through it by ops.cu's row kernels around the backward kernel)
    # (large: hidden 256, the large forward and the large backward: cuBLAS
    # products, the update's adjoint per slice, the anchor at refresh 2c;
    # 13 steps in blocks of 4, so that one block's reverse is captured in a
    # CUDA graph and replayed)
    for tag in r8 r0 qk large; do
        hidden=40
        T=50
        case $tag in
        r8) opts="refresh = 8" ;;
        r0) opts="refresh = 0" ;;
        qk) opts="refresh = 8, qk_norm = 'rms'" ;;
        large) opts="refresh = 16"; hidden=256; T=100 ;;
        esac
        "$MNEMO" -e "local m = mnemo; m.seed(9)
          local r = m.rule { layers = 2, hidden = $hidden, activation = 'gelu', step = 8, $opts, clip = 'norm',
                             clip_max = 0.5, theta = 0.02, eta = 0.5 }
          m.save('$WORK/san/grad_$tag.h5', r:experiment { k = m.randn(2, 2, $T, 20) * 0.5,
                 v = m.randn(2, 2, $T, 18) * 0.5, q = m.randn(2, 2, $T, 20) * 0.5 })
          m.save('$WORK/san/up_$tag.h5', { dy = m.randn(2, 2, $T, 18), dloss = m.randn(2, 2, $T),
                                           dW1 = m.randn(2, 2, $hidden, 20) })" > /dev/null 2>&1
        attach_upstream $tag dy dloss dW1
    done
    # and one glu file with /upstream: the general backward through 3 gated
    # layers with bias (the gates' tangents and adjoints in the workspace)
    "$MNEMO" -e "local m = mnemo; m.seed(10)
      local r = m.rule { layers = 3, glu = true, bias = true, hidden = 7, activation = 'silu', step = 4, refresh = 8,
                         clip = 'norm', clip_max = 0.5, theta = 0.05, eta = 0.5 }
      m.save('$WORK/san/grad_glu.h5', r:experiment { k = m.randn(2, 2, 30, 6) * 0.5, v = m.randn(2, 2, 30, 5) * 0.5 })
      m.save('$WORK/san/up_glu.h5', { dy = m.randn(2, 2, 30, 5), dloss = m.randn(2, 2, 30),
                                      dU2 = m.randn(2, 2, 7, 7) })" > /dev/null 2>&1
    attach_upstream glu dy dloss dU2
    # and two more with /upstream: newton_schulz's adjoint on the fused
    # (refresh = step) and the general backward (its iterates in the
    # workspace's double scratch), a tall W1 and a wide W2
    for refresh in 6 12; do
        "$MNEMO" -e "local m = mnemo; m.seed(10)
          local r = m.rule { layers = 2, hidden = 12, activation = 'silu', bias = true, step = 6, refresh = $refresh,
                             precondition = 'newton_schulz', ns_steps = 3, theta = 0.05, eta = 0.5 }
          m.save('$WORK/san/grad_ns_r$refresh.h5', r:experiment { k = m.randn(2, 2, 24, 6) * 0.5,
                 v = m.randn(2, 2, 24, 5) * 0.5 })
          m.save('$WORK/san/up_ns_r$refresh.h5', { dy = m.randn(2, 2, 24, 5), dloss = m.randn(2, 2, 24) })" \
            > /dev/null 2>&1
        attach_upstream ns_r$refresh dy dloss
    done
    cp "$WORK/san/grad_r0.h5" "$WORK/san/grad_r0_general.h5"
    # san_verdict NAME LOG RC: PASS when the tool exited 0 and summed up
    # clean (racecheck as "RACECHECK SUMMARY: 0 hazards displayed (0 errors,
    # ..."), else FAIL with the log's telling lines
    san_verdict() {
        if [ "$3" -eq 0 ] && grep -qE '(ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards displayed \(0 errors)' "$2"; then
            echo "PASS $1"
        else
            echo "FAIL $1: exit $3"
            grep -E 'ERROR SUMMARY|Invalid|Uninitialized|hazard|Barrier|mnemo run|^FAIL' "$2" | head -8
        fi
    }
    san() { # tool file
        tool=$1; f=$2; log=$LOGS/san_${tool}_$(basename "$f" .h5).log
        "$SANITIZER" --tool "$tool" --error-exitcode 9 "$MNEMO" run "$f" -o "$WORK/san_$tool.h5" --device cuda \
            > "$log" 2>&1
        rc=$?
        # a file with /upstream must have had its backward run: /grads in the result
        case "$(basename "$f")" in
        grad_*) "$PYTHON" -c "import h5py, sys; sys.exit(0 if 'grads' in h5py.File(sys.argv[1], 'r') else 1)" \
                    "$WORK/san_$tool.h5" || rc=8 ;;
        esac
        san_verdict "sanitizer/$tool/$(basename "$f" .h5)" "$log" $rc
    }
    # san_lua TOOL SCRIPT: a Lua test under the tool; its own checks must pass
    # too (it exits non-zero on a FAIL line)
    san_lua() {
        tool=$1; f=$2; log=$LOGS/san_${tool}_$(basename "$f" .lua).log
        "$SANITIZER" --tool "$tool" --error-exitcode 9 "$MNEMO" "$f" > "$log" 2>&1
        san_verdict "sanitizer/$tool/$(basename "$f" .lua)" "$log" $?
    }
    {
        # the large path's kept step graphs: captured, replayed on new
        # inputs, evicted, given back (arguments read from device memory)
        # (memcheck on its own shapes; initcheck, slower, on width 16 with the path forced.
        # 2026-11-27: initcheck FAILs there, uninitialized reads of G in the norm kernel in
        # the two-pieces section, on 5b5270b too; tests/bench/RESULTS.md has what is known)
        san_lua memcheck tests/lua/test_large_keep.lua
        ( MNEMO_CUDA_PATH=large MNEMO_TEST_KEEP_WIDTH=16 && export MNEMO_CUDA_PATH MNEMO_TEST_KEEP_WIDTH &&
          san_lua initcheck tests/lua/test_large_keep.lua )
        for f in "$WORK"/san/exp_0000[0-5].h5; do san memcheck "$f"; done
        for f in "$WORK"/san/exp_0000[67].h5; do san racecheck "$f"; done
        for f in "$WORK"/san/exp_0000[78].h5; do san initcheck "$f"; done
        san synccheck "$WORK/san/exp_00008.h5"
        for tool in memcheck racecheck initcheck; do san $tool "$WORK/san/ragged.h5"; done
        san memcheck "$WORK/san/exp_glu.h5"
        san initcheck "$WORK/san/exp_glu.h5"
        san racecheck "$WORK/san/exp_glu.h5"
        san memcheck "$WORK/san/glu_large.h5"
        san memcheck "$WORK/san/staged.h5"
        san initcheck "$WORK/san/staged.h5"
        san synccheck "$WORK/san/staged.h5"
        for tool in memcheck racecheck initcheck synccheck; do san $tool "$WORK/san/grad_r8.h5"; done
        for tool in memcheck racecheck initcheck synccheck; do san $tool "$WORK/san/grad_r0.h5"; done
        ( MNEMO_CUDA_BACKWARD=general && export MNEMO_CUDA_BACKWARD && san memcheck "$WORK/san/grad_r0_general.h5" )
        for tool in memcheck racecheck initcheck; do san $tool "$WORK/san/grad_glu.h5"; done
        for tool in memcheck initcheck; do san $tool "$WORK/san/grad_qk.h5"; done
        for tool in memcheck racecheck initcheck synccheck; do san $tool "$WORK/san/grad_large.h5"; done
        for tool in memcheck racecheck initcheck; do
            for refresh in 6 12; do san $tool "$WORK/san/grad_ns_r$refresh.h5"; done
        done
    } > "$LOGS/sanitizer.log" 2>&1
    count sanitizer "$LOGS/sanitizer.log" 0
else
    echo "SKIP sanitizer: no python with h5py or no compute-sanitizer" | tee -a "$summary"
fi

# ---- one mid-size run, timed ----
if want timing && [ -n "$PYTHON" ]; then
    "$PYTHON" - "$WORK/mid.h5" <<'EOF' > "$LOGS/mid.log" 2>&1
import sys
import numpy as np
sys.path.insert(0, "tests/reference")
import gen_experiments
B, H, T, dk, dv, dh, c = 8, 16, 1024, 64, 64, 128, 16
rng = np.random.default_rng(5)
f32 = np.float32
cfg = {"rule": {"layers": 2, "hidden": dh, "activation": "silu", "step": c, "loss": "mse"},
       "constants": {}, "strings": "vlen", "seed": 0, "index": 0,
       "desc": "mid-size: B=%d H=%d T=%d dk=%d dv=%d L=2 dh=%d c=%d" % (B, H, T, dk, dv, dh, c),
       "inputs": {"k": (rng.standard_normal((B, H, T, dk)) / np.sqrt(dk)).astype(f32),
                  "v": rng.standard_normal((B, H, T, dv)).astype(f32)},
       "gates": {"theta": np.array(0.02 / c, f32), "eta": np.array(0.9, f32), "alpha": np.array(0.001, f32)},
       "init": {"W1": (rng.standard_normal((H, dh, dk)) / np.sqrt(dk)).astype(f32),
                "b1": np.zeros((dh,), f32),
                "W2": (rng.standard_normal((H, dv, dh)) / np.sqrt(dh)).astype(f32),
                "b2": np.zeros((dv,), f32)}}
gen_experiments.write_config(sys.argv[1], cfg)
print(cfg["desc"])
EOF
    secs() { # command...: wall seconds
        t0=$(date +%s.%N); "$@" > /dev/null 2>&1; rc=$?; t1=$(date +%s.%N)
        echo "$t0 $t1" | awk '{printf "%.3f", $2 - $1}'; return $rc
    }
    {
        cat "$LOGS/mid.log"
        rm -rf "$WORK/midcache"
        t_first=$(MNEMO_CACHE=$WORK/midcache secs "$MNEMO" run "$WORK/mid.h5" -o "$WORK/mid_gpu.h5" --device cuda)
        t_warm=$(MNEMO_CACHE=$WORK/midcache secs "$MNEMO" run "$WORK/mid.h5" -o "$WORK/mid_gpu.h5" --device cuda)
        t_tf32=$(secs "$MNEMO" run "$WORK/mid.h5" -o "$WORK/mid_tf32.h5" --device cuda --precision tf32)
        t_cpu=$(secs "$MNEMO" run "$WORK/mid.h5" -o "$WORK/mid_cpu.h5" --device cpu)
        echo "timing mid-size (whole mnemo run, wall s): cuda first $t_first (compile), cuda cached $t_warm, cuda tf32 $t_tf32, cpu $t_cpu"
        # the step kernel alone, as Nsight Compute measures it
        NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
        if [ -x "$NCU" ]; then
            for prec in fp32 tf32; do
                d=$("$NCU" --kernel-name mn_rule_step_kernel --metrics gpu__time_duration.sum --csv \
                    "$MNEMO" run "$WORK/mid.h5" -o "$WORK/mid_ncu.h5" --device cuda --precision $prec 2>&1 |
                    grep gpu__time_duration | awk -F'","' '{print $NF, $(NF-1)}' | tr -d '"' | head -1)
                echo "timing mid-size step kernel ($prec, ncu): ${d:-not measured}"
            done
        fi
        if "$MNEMO" compare "$WORK/mid_gpu.h5" "$WORK/mid_cpu.h5" --rtol 1e-4; then echo "PASS timing/mid_cuda_vs_cpu"
        else echo "FAIL timing/mid_cuda_vs_cpu: differs (table above)"; fi
        if "$MNEMO" compare -q "$WORK/mid_tf32.h5" "$WORK/mid_cpu.h5" --rtol 5e-3; then echo "PASS timing/mid_tf32_vs_cpu"
        else echo "FAIL timing/mid_tf32_vs_cpu: differs"; fi
    } > "$LOGS/timing.log" 2>&1
    grep -E '^timing|mid-size' "$LOGS/timing.log"
    count timing "$LOGS/timing.log" 0
fi

# ---- collect the knobs' runs ----
if [ -n "$KNOB_RUNS" ]; then
    wait
    for name in $KNOB_RUNS; do
        echo "== gpu/same_bits.sh ($name)"
        count "knobs/$name" "$LOGS/knob_$name.log" "$(cat "$WORK/knob_$name.rc" 2>/dev/null || echo 99)"
    done
fi

# ---- collect the conformance runs ----
if [ -n "$CONFORMANCE_RUNS" ]; then
    wait
    for prec in $CONFORMANCE_RUNS; do
        echo "== conformance/cuda-$prec"
        # the shards' logs one after the other; the first failing shard's status
        cat "$WORK/conformance_$prec".*.log > "$OUT/conformance_$prec.log"
        grep -h '^conformance: [0-9]' "$WORK/conformance_$prec".*.log
        rc=0
        for f in "$WORK/conformance_$prec".*.rc; do
            r=$(cat "$f" 2>/dev/null || echo 99)
            [ "$rc" = 0 ] && rc=$r
        done
        [ "$rc" = 124 ] && echo "FAIL conformance/cuda-$prec: a shard stopped after ${CONFORMANCE_TIMEOUT:-540} s" | tee -a "$summary"
        count "conformance/cuda-$prec" "$OUT/conformance_$prec.log" "$rc"
        grep -A3 '^FAIL ' "$OUT/conformance_$prec.log" | head -40
    done
fi

tar -czf "$OUT/gpu_logs.tgz" -C "$LOGS" . 2>/dev/null
rm -rf "$WORK"
passed=$(grep -c '^PASS ' "$summary")
failed=$(grep -c '^FAIL ' "$summary")
skipped=$(grep -c '^SKIP ' "$summary")
echo
if [ "$failed" -gt 0 ]; then echo "Failures:"; grep '^FAIL ' "$summary" | head -60; echo; fi
echo "elapsed $(( $(date +%s) - start )) s; logs in $OUT"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
