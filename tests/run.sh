#!/bin/sh
# run.sh: every test this machine can run, counted from the lines the tests
# print ("PASS name", "FAIL name: why", "SKIP name: why"). A test program that
# exits non-zero without printing a FAIL line, or prints nothing at all,
# counts as one failure. Ends with "N passed, N failed, N skipped".
# Usage: sh tests/run.sh [PATTERN]   (PATTERN filters test file names)
cd "$(dirname "$0")/.." || exit 2
pattern=${1:-}
log=$(mktemp -d)/tests.log
: > "$log"
PYTHON=${PYTHON:-/usr/bin/python3}
export PYTHONUNBUFFERED=1 MNEMO=${MNEMO:-$PWD/mnemo}

run_one() { # label, command...
    label=$1; shift
    case "$label" in *"$pattern"*) ;; *) return ;; esac
    echo "== $label"
    out=$(mktemp)
    "$@" > "$out" 2>&1
    rc=$?
    cat "$out"
    n_fail=$(grep -c '^FAIL ' "$out")
    n_any=$(grep -cE '^(PASS|FAIL|SKIP) ' "$out")
    grep -E '^(PASS|FAIL|SKIP) ' "$out" >> "$log"
    if [ "$rc" -ne 0 ] && [ "$n_fail" -eq 0 ]; then
        echo "FAIL $label: exited with status $rc" | tee -a "$log"
    elif [ "$n_any" -eq 0 ]; then
        echo "FAIL $label: printed no test lines" | tee -a "$log"
    fi
    rm -f "$out"
}

for t in ${BUILD:-build}/tests/test_*; do
    [ -x "$t" ] && run_one "unit/$(basename "$t")" "$t"
done
for t in tests/lua/test_*.lua; do
    [ -f "$t" ] && run_one "lua/$(basename "$t")" "$MNEMO" "$t"
done
for t in tests/*/test_*.py; do
    [ -f "$t" ] && run_one "py/${t#tests/}" "$PYTHON" "$t"
done
for t in tests/*/test_*.sh; do
    [ -f "$t" ] && run_one "sh/${t#tests/}" sh "$t"
done

# The sanitizer build (`make test` sets SAN_BUILD): the unit tests, the Lua
# tests and the bad-input catalogue once more under ASan and UBSan; options
# and suppressions (each with its reason) in tests/sanitize/.
if [ -n "${SAN_BUILD:-}" ] && [ -x "$SAN_BUILD/mnemo" ]; then
    . tests/sanitize/env.sh
    for t in "$SAN_BUILD"/tests/test_*; do
        [ -x "$t" ] && case "$t" in *.d) ;; *) run_one "san/unit/$(basename "$t")" "$t" ;; esac
    done
    for t in tests/lua/test_*.lua; do
        [ -f "$t" ] && MNEMO="$PWD/$SAN_BUILD/mnemo" run_one "san/lua/$(basename "$t")" "$PWD/$SAN_BUILD/mnemo" "$t"
    done
    MNEMO="$PWD/$SAN_BUILD/mnemo" run_one "san/badinput/test_badinput.py" "$PYTHON" tests/badinput/test_badinput.py
fi
# The fuzzers (`make test` sets FUZZ_BUILD): each runs FUZZ_SECONDS.
if [ -n "${FUZZ_BUILD:-}" ] && [ -d "$FUZZ_BUILD" ]; then
    run_one "fuzz/run_fuzz.sh" sh tests/fuzz/run_fuzz.sh
fi

passed=$(grep -c '^PASS ' "$log")
failed=$(grep -c '^FAIL ' "$log")
skipped=$(grep -c '^SKIP ' "$log")
echo
if [ "$failed" -gt 0 ]; then echo "Failures:"; grep '^FAIL ' "$log"; echo; fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
