#!/bin/sh
# sweep_compile.sh: N processes (default 4) start the same new rule at once
# (tests/bench/sweep_compile.lua), with one kernel cache (they share one
# background compile: kernels/compile_later.c) and with a cache each (a
# compile each), two rounds, a new hidden size every time; prints the wall
# and CPU time of each group (GNU time), each process's mnemo.compiles()
# and the marker files left. Needs a GPU and GNU time; not a test.
#   . tests/gpu/env.sh && sh tests/bench/sweep_compile.sh [N]
MNEMO=${MNEMO:-./mnemo}
N=${1:-4}
for round in 1 2; do
    for mode in shared separate; do
        C=$(mktemp -d)
        H=$((200 + round * 8 + $([ $mode = shared ] && echo 0 || echo 4)))
        /usr/bin/time -f "%e s wall, %U s user, %S s sys" sh -c '
            i=0
            while [ $i -lt "$1" ]; do
                if [ "$2" = shared ]; then MNEMO_CACHE=$3 "$4" tests/bench/sweep_compile.lua "$5" &
                else MNEMO_CACHE=$3/$i "$4" tests/bench/sweep_compile.lua "$5" & fi
                i=$((i + 1))
            done
            wait' sh "$N" "$mode" "$C" "$MNEMO" "$H" > "$C.out" 2>&1
        echo "$mode, round $round, hidden $H: $(sort "$C.out" | uniq -c | tr -s ' \n' ' '); markers left: $(find "$C" -name '*.pending' | wc -l)"
        rm -rf "$C" "$C.out"
    done
done
