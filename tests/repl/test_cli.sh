#!/bin/sh
# test_cli.sh: the mnemo command line (SPEC.md section 6) without a
# terminal: --version, --help, bad options, -e, scripts and their arg table,
# errors and exit statuses, stdin as a script, -i with piped input, -q, the
# help coverage of every mnemo function, and the run/compare subcommands.
# Prints PASS/FAIL/SKIP lines for tests/run.sh. Binary: $MNEMO (./mnemo).
MNEMO=${MNEMO:-./mnemo}
if [ ! -x "$MNEMO" ]; then
    echo "SKIP cli: no binary at $MNEMO (set MNEMO)"
    exit 0
fi
tmp=$(mktemp -d) || exit 2
trap 'rm -rf "$tmp"' EXIT
HOME=$tmp MNEMO_HISTORY=$tmp/history
export HOME MNEMO_HISTORY
failures=0

pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; failures=$((failures + 1)); }

# run ARGS...: runs mnemo with stdin from $tmp/in (empty unless written),
# leaving stdout in $out, stderr in $err and the status in $rc.
: > "$tmp/in"
run() {
    "$MNEMO" "$@" < "$tmp/in" > "$tmp/out" 2> "$tmp/err"
    rc=$?
    out=$(cat "$tmp/out")
    err=$(cat "$tmp/err")
}
# expect NAME WANT_RC [grep -E pattern on stdout] [pattern on stderr]
expect() {
    name=$1 want=$2 pout=${3:-} perr=${4:-}
    if [ "$rc" -ne "$want" ]; then
        fail "$name" "exit status $rc, want $want; stderr: $(head -c 300 "$tmp/err")"
    elif [ -n "$pout" ] && ! grep -Eq -- "$pout" "$tmp/out"; then
        fail "$name" "stdout lacks /$pout/: $(head -c 300 "$tmp/out")"
    elif [ -n "$perr" ] && ! grep -Eq -- "$perr" "$tmp/err"; then
        fail "$name" "stderr lacks /$perr/: $(head -c 300 "$tmp/err")"
    else
        pass "$name"
    fi
}
lines() { if [ -s "$1" ]; then wc -l < "$1" | tr -d ' '; else echo 0; fi; }

# ---- --version, --help, bad usage
run --version
expect "--version exits 0 with the version" 0 '^mnemo [0-9]+\.[0-9]+\.[0-9]+$'
expect "--version names the build (CUDA or CPU only)" 0 'CUDA|CPU only'
run --help
expect "--help exits 0" 0 'usage: mnemo'
missing=""
for form in 'mnemo FILE.lua' '-e CODE' '-i ' '--quiet' '--version' '--help' 'mnemo run' \
    'mnemo compare' 'mnemo -  '; do
    grep -qF -- "$form" "$tmp/out" || missing="$missing [$form]"
done
if [ -z "$missing" ]; then pass "--help lists every form"; else fail "--help lists every form" "missing$missing"; fi

run -Z
expect "unknown option exits 2" 2 '' "unknown option '-Z'"
if [ "$(lines "$tmp/err")" = 1 ] && [ ! -s "$tmp/out" ]; then pass "unknown option: one line on stderr"
else fail "unknown option: one line on stderr" "stderr: $err / stdout: $out"; fi
run --frobnicate
expect "unknown long option exits 2" 2 '' "--frobnicate"
run -e
expect "-e without code exits 2" 2 '' "needs an argument"

# ---- -e
run -e 'print(1+1)'
expect "-e 'print(1+1)' prints 2" 0 '^2$'
run -e 'x = 1' -e 'x = x * 10' -e 'print(x + 2)'
expect "-e chunks run in order" 0 '^12$'
run -e 'error("bad chunk")' -e 'print("not reached")'
expect "-e error exits 1 with a traceback" 1 '' 'bad chunk'
if grep -q "not reached" "$tmp/out"; then fail "-e stops at the first error" "$out"; else pass "-e stops at the first error"; fi
run -e 'os.exit(3)'
expect "os.exit status passes through" 3
run -e 'error({})'
expect "non-string error object is reported" 1 '' 'error object is a table value'
run -e 'print(type(mnemo), type(help), type(who), mnemo.quiet)'
expect "mnemo, help and who are globals; not quiet by default" 0 '^table	function	function	(nil|false)$'
run -q -e 'print(mnemo.quiet)'
expect "-q sets mnemo.quiet" 0 '^true$'
run --quiet -e 'print(mnemo.quiet)'
expect "--quiet sets mnemo.quiet" 0 '^true$'

printf 'return {v = 7}\n' > "$tmp/mymod.lua"
LUA_PATH="$tmp/?.lua" run -l mymod -e 'print(mymod.v)'
expect "-l NAME requires a module into a global" 0 '^7$'

# ---- scripts
cat > "$tmp/args.lua" <<'EOF'
print("n", #arg, select("#", ...))
print("0", arg[0])
print("1", arg[1], ...)
print("neg", arg[-1] ~= nil)
EOF
run "$tmp/args.lua" first "second arg"
expect "script runs with exit 0" 0 "^n	2	2$"
expect "script sees arg[0]" 0 "^0	$tmp/args.lua$"
expect "script sees arg[1] and ..." 0 "^1	first	first	second arg$"
expect "interpreter args at negative indices" 0 "^neg	true$"
run -q -- "$tmp/args.lua" x
expect "-- ends the options" 0 "^1	x	x$"

cat > "$tmp/boom.lua" <<'EOF'
local function inner() error("boom in script") end
local function outer() inner() end
outer()
EOF
run "$tmp/boom.lua"
expect "script error exits 1" 1 '' 'boom\.lua:1: boom in script'
expect "script error has a traceback" 1 '' 'stack traceback'
expect "traceback names the calling function" 1 '' "in (local|upvalue|function) 'outer'"
if [ ! -s "$tmp/out" ]; then pass "script error writes nothing on stdout"; else fail "script error writes nothing on stdout" "$out"; fi

printf 'x = = 1\n' > "$tmp/syntax.lua"
run "$tmp/syntax.lua"
expect "script syntax error exits 1" 1 '' 'syntax\.lua:1:'

run "$tmp/no-such-file.lua"
expect "missing script exits 2" 2 '' "cannot open '$tmp/no-such-file.lua'"
if [ "$(lines "$tmp/err")" = 1 ]; then pass "missing script: one line"; else fail "missing script: one line" "$err"; fi

# ---- stdin
printf 'print(6 * 7)\nprint(...)\n' > "$tmp/in"
run
expect "stdin that is not a terminal runs as a chunk" 0 '^42$'
if grep -q 'mnemo>' "$tmp/out"; then fail "piped stdin shows no prompt" "$out"; else pass "piped stdin shows no prompt"; fi
printf 'local t = {}\nt.x.y = 1\n' > "$tmp/in"
run
expect "piped chunk error exits 1" 1 '' 'stdin:2:'
printf 'print("dash", ...)\n' > "$tmp/in"
run - a b
expect "'-' runs stdin with arguments" 0 '^dash	a	b$'

# ---- -i with piped input: the REPL's evaluation without a terminal
printf '1 + 1\n{b = 2, a = {1, "s"}}\nnil\nfor i = 1, 2 do\nprint("row" .. i)\nend\nerror("oops")\n=y * 2\nprint("n=" .. n)\n' > "$tmp/in"
run -q -e 'y = 21; n = 0; mnemo._after_statement = function() n = n + 1 end' -i
expect "-i: expressions print their value" 0 '^mnemo> 2$'
expect "-i: tables are pretty-printed" 0 '\{a = \{1, "s"\}, b = 2\}'
expect "-i: multi-line chunks run" 0 'row2'
expect "-i: an error is reported and the session goes on" 0 '42' 'oops'
expect "-i: _after_statement runs after each statement" 0 'n=7'
if grep -q 'help() for a tour' "$tmp/out"; then fail "-q: no banner" "$out"; else pass "-q: no banner"; fi
if grep -q 'nil' "$tmp/out"; then fail "-i: nil prints nothing" "$out"; else pass "-i: nil prints nothing"; fi
printf '' > "$tmp/in"
run -i
expect "-i: banner names the version and device" 0 '^mnemo [0-9.]+ \(Lua 5\.4, [a-z]+.*help\(\) for a tour'
if [ -e "$tmp/history" ]; then fail "no history without a terminal" "$(cat "$tmp/history")"; else pass "no history without a terminal"; fi

# ---- help
: > "$tmp/in"
run -e 'local m = mnemo._help_missing(); print(#m .. " missing: " .. table.concat(m, " "))'
expect "every mnemo function and Tensor method has help" 0 '^0 missing: $'
run -e 'help()'
expect "help() prints the tour" 0 'lab bench'
run -e 'help(mnemo.zeros)'
expect "help(mnemo.zeros) prints its description" 0 '^mnemo\.zeros\('
run -e 'help("Tensor:sum")'
expect "help('Tensor:sum')" 0 '^t:sum\('
run -e 'help(mnemo.zeros(2))'
expect "help(t) lists methods" 0 'matmul'
run -e 'help("matmull")'
expect "help of an unknown name suggests close ones" 0 'no help for matmull; did you mean .*matmul'

# ---- Ctrl-C (SIGINT) while a script runs: "interrupted!", exit 1
"$MNEMO" -e 'while true do end' > "$tmp/out" 2> "$tmp/err" &
pid=$!
sleep 1
kill -INT "$pid" 2> /dev/null
wait "$pid"
rc=$?
expect "SIGINT stops a running chunk with exit 1" 1 '' 'interrupted!'

# ---- run / compare: the subcommands reach their own code (cli.h); with no
# arguments each is bad usage (exit 2, a message on stderr).
run run
expect "mnemo run with no arguments exits 2" 2 '' 'mnemo run'
run compare
expect "mnemo compare with no arguments exits 2" 2 '' 'compare'
# ---- end of run / compare

[ "$failures" -eq 0 ]
