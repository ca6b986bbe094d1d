#!/bin/sh
# run_fuzz.sh: each libFuzzer target of $FUZZ_BUILD (make fuzz-build) for
# $FUZZ_SECONDS seconds, from the seed corpus tests/fuzz/corpus_<name>/ (read
# only; new inputs go to $FUZZ_BUILD/corpus_<name>/). Prints one PASS or
# FAIL line per target with the executions run; a crash, a sanitizer report
# or a leak is a FAIL and its input is kept in $FUZZ_BUILD/artifacts/ (the
# line names the file, and the log shows it in base64 when it is short).
cd "$(dirname "$0")/../.." || exit 2
FUZZ_BUILD=${FUZZ_BUILD:-build-fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
SAN_SUPP="$PWD/tests/sanitize"
export LSAN_OPTIONS="suppressions=$SAN_SUPP/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
found=0

# h5dump_fails_too LOG: the input of LOG's crash, as fuzz_experiment writes
# it to a file (its first byte even: the rest is the file), makes h5dump
# crash or hang as well. Sets $art.
h5dump_fails_too() {
    art=$(sed -n 's/.*Test unit written to //p' "$1" | tail -1)
    [ -f "$art" ] && command -v h5dump > /dev/null || return 1
    [ $(( $(od -An -tu1 -N1 "$art") % 2 )) -eq 0 ] || return 1
    tail -c +2 "$art" > "$art.h5"
    timeout 20 h5dump -A "$art.h5" > /dev/null 2>&1
    [ $? -ge 124 ]
}
# hdf5_overreads_its_own_block LOG: ASan's report in LOG is a read past a
# block that libhdf5 itself allocated, by libhdf5's H5HG_read (a damaged
# global heap): the library's bug of tests/fuzz/upstream/, which h5dump,
# built without ASan, reads past silently (and mnemo then names the bad
# attribute). Needs $inner, the report's innermost frame.
hdf5_overreads_its_own_block() {
    grep -q 'AddressSanitizer: heap-buffer-overflow' "$1" || return 1
    echo "$inner" | grep -q ' in H5HG_read .*libhdf5' || return 1
    sed -n '/allocated by thread/,/^$/p' "$1" | grep -E '^ +#[0-9]+ ' | grep -vE ' in (malloc|calloc|realloc) ' |
        head -1 | grep -q libhdf5
}
for bin in "$FUZZ_BUILD"/fuzz_*; do
    [ -x "$bin" ] || continue
    name=$(basename "$bin")           # fuzz_expr
    short=${name#fuzz_}               # expr
    seeds=tests/fuzz/corpus_$short
    work=$FUZZ_BUILD/corpus_$short
    arts=$FUZZ_BUILD/artifacts
    mkdir -p "$work" "$arts"
    found=1
    log=$FUZZ_BUILD/$name.log
    # fuzz_experiment runs without leak detection: libhdf5 1.10 (Debian 12)
    # loses metadata-cache and free-list blocks (H5C_protect, H5FL_*) on a
    # corrupt file whatever its caller closes, which the first minute of
    # fuzzing finds. Leaks of our own loader are the sanitizer stage's job
    # (tests/badinput/ loads truncated and corrupt files under LeakSanitizer).
    extra= leaks=1
    [ "$short" = experiment ] && extra=-detect_leaks=0 leaks=0
    # -max_len: long enough for the expression depth limit and for a small
    # experiment file; -rss_limit_mb: a run that asks for more is a finding.
    ASAN_OPTIONS="allocator_may_return_null=1:detect_leaks=$leaks" \
    "$bin" -max_total_time="$FUZZ_SECONDS" -max_len=16384 -rss_limit_mb=4096 -timeout=30 \
        -print_final_stats=1 $extra -artifact_prefix="$arts/$name-" "$work" "$seeds" > "$log" 2>&1
    rc=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    # The innermost frame of ours or a library's (not libFuzzer's, the
    # sanitizers' or libc's) in the report.
    inner=$(grep -E '^ +#[0-9]+ ' "$log" | grep -vE 'fuzzer::|__sanitizer|__interceptor_|__asan_|libc\.so|in (abort|raise|__GI_)' | head -1)
    if [ "$rc" -eq 0 ]; then
        echo "PASS fuzz $short: ${runs:-?} executions in ${FUZZ_SECONDS} s, no crash"
    elif grep -q 'libFuzzer: timeout' "$log" && echo "$inner" | grep -q libhdf5; then
        # libhdf5 1.10 loops forever on some corrupt files (h5dump too, e.g.
        # tests/fuzz/upstream/): not mnemo's code, and nothing it can do short
        # of its own HDF5 reader. Reported, neither passed nor failed.
        art=$(sed -n 's/.*Test unit written to //p' "$log" | tail -1)
        echo "SKIP fuzz $short: libhdf5 hung inside its own code after ${runs:-?} executions (an upstream bug; input kept in ${art:-$arts})"
    elif hdf5_overreads_its_own_block "$log"; then
        art=$(sed -n 's/.*Test unit written to //p' "$log" | tail -1)
        echo "SKIP fuzz $short: libhdf5 read past its own block in H5HG_read after ${runs:-?} executions (a damaged global heap, an upstream bug; input kept in ${art:-$arts})"
    elif echo "$inner" | grep -q libhdf5 && h5dump_fails_too "$log"; then
        # a crash inside libhdf5 that the library's own h5dump has on the
        # same file: Debian's 1.10.8 reading a damaged global heap (mnemo
        # itself exits 2 naming the file: repl/main.c). Reported, neither
        # passed nor failed; see tests/fuzz/upstream/.
        echo "SKIP fuzz $short: libhdf5 crashed inside its own code after ${runs:-?} executions, and h5dump crashes on the same file (an upstream bug; input kept in $art)"
    else
        art=$(sed -n 's/.*Test unit written to //p' "$log" | tail -1)
        grep -E 'ERROR|SUMMARY|runtime error|Base64' "$log" | head -5
        echo "FAIL fuzz $short: exit $rc after ${runs:-?} executions; the input is kept in ${art:-$arts} (log $log)"
    fi
done
[ "$found" -eq 1 ] || echo "SKIP fuzz: no fuzz target in $FUZZ_BUILD (make fuzz-build needs clang)"
