"""ncu_lines.py: a generated kernel's stall samples by line of its source
(and by the function that line is in), for tuning the fused kernels. Nsight
Compute's CUDA source view of an NVRTC kernel has no metrics, so this joins
its SASS view with nvdisasm's line table of the same CUBIN:
  mnemo -e 'io.write(RULE:source{...})' > mnemo_rule.cu    (the kernel's source)
  build the CUBIN of that source with the engine's options (-lineinfo)
  nvdisasm -g -c KERNEL.cubin > KERNEL.sass
  ncu --section SourceCounters -k regex:KERNEL -o REP <program>
  ncu --import REP.ncu-rep --page source --csv --print-source sass > SASS.csv
  python3 tests/bench/ncu_lines.py SASS.csv KERNEL.sass mnemo_rule.cu [N]
The SASS of the CUBIN and of the profiled kernel must be the same (same
source, options and NVRTC): the script counts the instructions whose
opcodes differ and says so. Prints stall samples and instructions
executed, in % of the kernel's, by function and by line (N lines, 30)."""
import bisect
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_top import opcode, sass_rows  # noqa: E402  (ncu's SASS csv, read once)


def line_table(path):
    """offset -> (source line, opcode) from nvdisasm -g -c output."""
    table, line = {}, None
    for text in open(path):
        m = re.search(r'//## File ".*", line (\d+)', text)
        if m:
            line = int(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", text)
        if m:
            table[int(m.group(1), 16)] = (line, opcode(m.group(2)))
    return table


def blanked(text):
    """text with comments and string literals replaced by spaces (newlines
    kept), so that braces and parentheses in them do not count."""
    def keep_lines(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"', keep_lines, text, flags=re.S)


NOT_FUNCTIONS = {"if", "for", "while", "switch", "return", "sizeof", "defined", "static_assert", "asm"}


def function_starts(text):
    """(line, name) of every function body and struct in a source, sorted
    by line: a name, its parameter list (headers over several lines too,
    as the step kernel's) and an opening brace; a struct's members named
    Struct::member. Lines are attributed to the last start above them."""
    text = blanked(text)
    line_of = lambda pos: text.count("\n", 0, pos) + 1
    structs = []  # (open brace, close brace, name)
    for m in re.finditer(r"\bstruct\s+(\w+)\s*(?::[^{;]*)?\{", text):
        depth, i = 0, m.end() - 1
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        structs.append((m.end() - 1, i, m.group(1)))
    found = [(line_of(m.start(1)), "struct " + m.group(1))
             for m in re.finditer(r"\bstruct\s+(\w+)\s*(?::[^{;]*)?\{", text)]
    params = r"\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)"
    for m in re.finditer(r"\b(operator\s*\(\s*\)|\w+)\s*" + params + r"\s*(?:const\s*)?\{", text):
        name = re.sub(r"\s+", "", m.group(1))
        if name in NOT_FUNCTIONS:
            continue
        inner = [st for st in structs if st[0] < m.start() < st[1]]
        if inner:  # the innermost struct
            name = max(inner, key=lambda st: st[0])[2] + "::" + name
        found.append((line_of(m.start(1)), name))
    return sorted(found)


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    table = line_table(sys.argv[2])
    data = [(int(a, 16), opcode(t), s, e) for s, a, t, e in sass_rows(sys.argv[1])]
    src = open(sys.argv[3]).read().split("\n")
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    if not data or not table:
        sys.exit("ncu_lines: no instructions in %s or %s" % (sys.argv[1], sys.argv[2]))
    base = min(a for a, _, _, _ in data)
    differ = sum(1 for a, op, _, _ in data if a - base in table and table[a - base][1].split(".")[0] != op.split(".")[0])
    if differ:
        print("ncu_lines: %d of %d instructions differ from the CUBIN's: not the same kernel?" % (differ, len(data)))
    stall, done = collections.Counter(), collections.Counter()
    for a, _, s, e in data:
        line = table.get(a - base, (None, ""))[0]
        stall[line] += s
        done[line] += e
    total_s, total_e = sum(stall.values()) or 1.0, sum(done.values()) or 1.0
    funcs = function_starts("\n".join(src))
    starts = [f[0] for f in funcs]
    fs, fe = collections.Counter(), collections.Counter()
    for line, s in stall.items():
        j = bisect.bisect_right(starts, line) - 1 if line else -1
        name = funcs[j][1] if j >= 0 else "?"
        fs[name] += s
        fe[name] += done[line]
    print("stall samples %d, instructions executed %d (warp level)" % (total_s, total_e))
    print("stall%   exec%   function")
    for name, s in fs.most_common(20):
        print("%6.2f%% %6.2f%%  %s" % (100 * s / total_s, 100 * fe[name] / total_e, name))
    print("stall%   exec%   line  source")
    for line, s in stall.most_common(n):
        text = src[line - 1].strip() if line and line <= len(src) else ""
        print("%6.2f%% %6.2f%% %5s  %s" % (100 * s / total_s, 100 * done[line] / total_e, line, text[:110]))


if __name__ == "__main__":
    main()
