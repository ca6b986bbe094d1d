"""ncu_top.py: the instructions where a kernel's warps stall most, from an
Nsight Compute report's source page (SASS), for tuning the fused kernel.
  ncu --section SourceCounters --section WarpStateStats -o REP <program>
  ncu --import REP.ncu-rep --page source --csv --print-source sass > SRC.csv
  python3 tests/bench/ncu_top.py SRC.csv [N]
Prints the N instructions with the most stall samples, with their share,
and the totals per opcode."""
import csv, sys, collections

path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
rows = list(csv.reader(open(path, newline="")))
head_i = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
head = rows[head_i]
src = head.index("Source")
samp = next(i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All"))
addr = head.index("Address") if "Address" in head else 0
items = []
for r in rows[head_i + 1:]:
    if len(r) <= max(src, samp):
        continue
    try:
        s = float(r[samp].replace(",", ""))
    except ValueError:
        continue
    items.append((s, r[addr], r[src].strip()))
total = sum(s for s, _, _ in items) or 1.0
print("total stall samples %d over %d instructions" % (total, len(items)))
for s, a, t in sorted(items, reverse=True)[:n]:
    print("%6.2f%%  %s  %s" % (100 * s / total, a, t[:110]))
ops = collections.Counter()
for s, _, t in items:
    op = t.split()[0] if t else "?"
    if op.startswith("@"):
        op = t.split()[1] if len(t.split()) > 1 else op
    ops[op.split(".")[0]] += s
print("by opcode:")
for op, s in ops.most_common(20):
    print("%6.2f%%  %s" % (100 * s / total, op))
