"""ncu_top.py: the instructions where a kernel's warps stall most, from an
Nsight Compute report's source page (SASS), for tuning the fused kernel.
  ncu --section SourceCounters --section WarpStateStats -o REP <program>
  ncu --import REP.ncu-rep --page source --csv --print-source sass > SRC.csv
  python3 tests/bench/ncu_top.py SRC.csv [N]
Prints the N instructions with the most stall samples, with their share,
and the totals per opcode. sass_rows and opcode are ncu_lines.py's too."""
import collections
import csv
import sys


def sass_rows(path):
    """(stall samples, address, instruction text, instructions executed) of
    each instruction of ncu's SASS source page in csv (executed: 0 where the
    page has no such column)."""
    rows = list(csv.reader(open(path, newline="")))
    head_i = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
    head = rows[head_i]
    src = head.index("Source")
    samp = next(i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All"))
    addr = head.index("Address") if "Address" in head else 0
    ex = head.index("Instructions Executed") if "Instructions Executed" in head else None
    items = []
    for r in rows[head_i + 1:]:
        if len(r) <= max(src, samp):
            continue
        try:
            s = float(r[samp].replace(",", ""))
            e = float(r[ex].replace(",", "") or 0) if ex is not None and ex < len(r) else 0.0
        except ValueError:
            continue
        items.append((s, r[addr], r[src].strip(), e))
    return items


def opcode(text):
    """The opcode of an instruction's text, its predicate (@P0) skipped."""
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else "?"


def main():
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    items = sass_rows(sys.argv[1])
    total = sum(s for s, _, _, _ in items) or 1.0
    print("total stall samples %d over %d instructions" % (total, len(items)))
    for s, a, t, _ in sorted(items, reverse=True)[:n]:
        print("%6.2f%%  %s  %s" % (100 * s / total, a, t[:110]))
    ops = collections.Counter()
    for s, _, t, _ in items:
        ops[opcode(t).split(".")[0]] += s
    print("by opcode:")
    for op, s in ops.most_common(20):
        print("%6.2f%%  %s" % (100 * s / total, op))


if __name__ == "__main__":
    main()
