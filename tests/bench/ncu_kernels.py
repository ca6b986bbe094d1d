"""ncu_kernels.py: GPU time per kernel name from an Nsight Compute run that
measured only the duration, for seeing where a path's time goes (the large
path's cuBLAS products against its own kernels, say).
  ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
      --csv --print-units base <program> > RUN.csv
(--cache-control none: ncu's default flushes the L2 before every kernel, and
a kernel that reads what the one before it left in L2 then reads DRAM.)
  python3 tests/bench/ncu_kernels.py RUN.csv [SKIP] [LAST]
SKIP: leave out the first SKIP launches (the warm-up). Prints each kernel
name's launches, total and mean microseconds and share, largest first;
with LAST, then the last LAST launches one by one, in order (a step's)."""
import collections
import csv
import sys


def durations(path):
    """(kernel name, seconds) of each launch, in order."""
    lines = open(path, newline="").read().splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    out = []
    for row in csv.DictReader(lines[head:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "ns")
        scale = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3}.get(unit, 1e-9)
        out.append((row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * scale))
    return out


def main():
    runs = durations(sys.argv[1])[int(sys.argv[2]) if len(sys.argv) > 2 else 0:]
    last = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, s in runs:
        short = name.split("(")[0][:60]
        by[short][0] += 1
        by[short][1] += s
    total = sum(v[1] for v in by.values())
    print(f"{len(runs)} launches, {total * 1e3:.3f} ms of GPU time")
    for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:6d} {s * 1e6:10.1f} us {s * 1e6 / n:8.1f} us/launch {100 * s / total:5.1f}%  {name}")
    for name, s in runs[len(runs) - last:] if last else []:
        print(f"  {s * 1e6:8.1f} us  {name.split('(')[0][:70]}")


if __name__ == "__main__":
    main()
