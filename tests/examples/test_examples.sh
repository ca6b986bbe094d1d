#!/bin/sh
# test_examples.sh: every script in examples/ at the small size
# (`mnemo examples/X.lua small OUTDIR`), in a fresh temporary folder: it must
# exit 0, print what it is known to print, and write its output files
# (PNG files must be real pictures). Prints PASS/FAIL/SKIP lines for
# tests/run.sh. Binary: $MNEMO (./mnemo).
cd "$(dirname "$0")/../.." || exit 2
MNEMO=${MNEMO:-./mnemo}
if [ ! -x "$MNEMO" ]; then
    echo "SKIP examples: no binary at $MNEMO (set MNEMO)"
    exit 0
fi
tmp=$(mktemp -d) || exit 2
trap 'rm -rf "$tmp"' EXIT
failures=0
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; failures=$((failures + 1)); }
have_gnuplot=1
command -v gnuplot >/dev/null 2>&1 || have_gnuplot=0

# is_png FILE: PNG signature, an IHDR chunk with width and height > 0, and
# more than a header's worth of bytes.
is_png() {
    [ -f "$1" ] || return 1
    sig=$(od -An -tx1 -N8 "$1" | tr -d ' \n')
    [ "$sig" = "89504e470d0a1a0a" ] || return 1
    ihdr=$(od -An -c -j12 -N4 "$1" | tr -d ' \n')
    [ "$ihdr" = "IHDR" ] || return 1
    w=$(od -An -tu1 -j16 -N4 "$1" | awk '{print $1*16777216 + $2*65536 + $3*256 + $4}')
    h=$(od -An -tu1 -j20 -N4 "$1" | awk '{print $1*16777216 + $2*65536 + $3*256 + $4}')
    size=$(wc -c < "$1")
    [ "$w" -gt 0 ] && [ "$h" -gt 0 ] && [ "$size" -gt 1000 ]
}

# HDF5 signature: \211HDF\r\n\032\n
is_h5() {
    [ -f "$1" ] || return 1
    [ "$(od -An -tx1 -N8 "$1" | tr -d ' \n')" = "894844460d0a1a0a" ]
}

# What each example must print (a grep -E pattern) and write.
expect_out() {
    case "$1" in
        tour) echo '== 6\. a workload and a metric' ;;
        titans_mlp) echo '^huber\+clip( +[01]\.[0-9]+)+$' ;;
        custom_loss) echo 'custom vs built-in huber: the same numbers' ;;
        sweep) echo '^best: eta' ;;
        compare_with_python) echo '(agrees with the PyTorch reference|^skipped: )' ;;
        fit_gates) echo '^held-out recall: .* \(better\)$' ;;
        ttt_ln_l2) echo '^LN-l2, theta 3( +[01]\.[0-9]+)+$' ;;
        lact_swiglu) echo '^swiglu\+ns( +[01]\.[0-9]+ \( *[0-9.]+\))+$' ;;
        ragged_text) printf '%s\n' '^every document equals its lone run .*; the last y differs at ([0-9]+) of the \1 lengths' ;;
        *) echo '' ;;
    esac
}
expect_files() {
    case "$1" in
        tour) echo 'tour_experiment.h5 tour_result.h5' ;;
        titans_mlp) echo 'titans_mlp.h5 titans_mlp.png' ;;
        custom_loss) echo 'custom_loss.h5' ;;
        sweep) echo 'sweep.h5 sweep.png' ;;
        compare_with_python) echo 'compare_experiment.h5' ;;
        fit_gates) echo 'fit_gates.png' ;;
        ttt_ln_l2) echo 'ttt_ln_l2.h5 ttt_ln_l2.png' ;;
        lact_swiglu) echo 'lact_swiglu.h5 lact_swiglu.png' ;;
        ragged_text) echo 'ragged_text.h5 ragged_text.png' ;;
        *) echo '' ;;
    esac
}

n=0
for script in examples/*.lua; do
    [ -f "$script" ] || continue
    n=$((n + 1))
    name=$(basename "$script" .lua)
    out="$tmp/$name"
    mkdir -p "$out"
    start=$(date +%s)
    "$MNEMO" "$script" small "$out" > "$out/stdout" 2> "$out/stderr" < /dev/null
    rc=$?
    secs=$(( $(date +%s) - start ))
    if [ "$rc" -ne 0 ]; then
        fail "example $name runs" "exit status $rc; stderr: $(tail -c 400 "$out/stderr")"
        continue
    fi
    pass "example $name runs (small, ${secs}s)"
    pattern=$(expect_out "$name")
    if [ -n "$pattern" ]; then
        if grep -Eq -- "$pattern" "$out/stdout"; then pass "example $name prints its result"
        else fail "example $name prints its result" "stdout lacks /$pattern/: $(head -c 400 "$out/stdout")"; fi
    fi
    for f in $(expect_files "$name"); do
        case "$f" in
            *.png)
                if [ "$have_gnuplot" -eq 0 ]; then
                    echo "SKIP example $name writes $f: gnuplot is not installed (Debian package gnuplot-nox)"
                elif is_png "$out/$f"; then pass "example $name writes $f (a PNG picture)"
                else fail "example $name writes $f" "missing or not a PNG picture"; fi ;;
            *.h5)
                if is_h5 "$out/$f"; then pass "example $name writes $f"
                else fail "example $name writes $f" "missing or not an HDF5 file"; fi ;;
            *)
                if [ -s "$out/$f" ]; then pass "example $name writes $f"
                else fail "example $name writes $f" "missing or empty"; fi ;;
        esac
    done
    # No stray temporary files left beside the outputs.
    stray=$(find "$out" -name '*.tmp' | head -n 1)
    if [ -z "$stray" ]; then pass "example $name leaves no temporary files"
    else fail "example $name leaves no temporary files" "found $stray"; fi
done
if [ "$n" -ge 5 ]; then pass "examples found ($n)"
else fail "examples found" "only $n scripts in examples/"; fi

# compare_with_python writes the reference's result when python3 has torch
if grep -q 'agrees with the PyTorch reference' "$tmp/compare_with_python/stdout" 2>/dev/null; then
    if is_h5 "$tmp/compare_with_python/compare_reference.h5"; then pass "compare_with_python writes the reference result"
    else fail "compare_with_python writes the reference result" "compare_reference.h5 missing"; fi
else
    echo "SKIP compare_with_python reference result: python3 with torch is not available"
fi
[ "$failures" -eq 0 ]
