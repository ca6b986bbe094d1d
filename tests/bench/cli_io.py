#!/usr/bin/env python3
"""cli_io.py: the part of a whole `mnemo run EXP.h5 -o RES.h5` process that
grows with the data (issue 14), for one or more mnemo binaries side by side
(a build of main against a branch, say), on P1's file (B=4, H=32, T=4096,
dk=dv=64, MLP 64-256-64 gelu, c=r=64: 285 MB of inputs, 170 MB of outputs).

For each binary, in turns (so that drift hits them alike):
  tiny  a run of the same rule on T=64 tokens (start-up, device init, kernel
        load from the cache, which the first, untimed run filled)
  full  the run on T=4096
Each is the wall time of the process, median of --repeat runs; full - tiny
is what grows with the data (the number issue 14 wants under 150 ms; the
kernel itself is ~5 ms of it on an H100). A binary whose `mnemo run --help`
knows --timing also prints its phases (median of each over the full runs).
The results of the binaries are compared with `mnemo compare` (staging
changes no number: they must agree to 1e-6).

Usage (GPU machine; numpy and h5py):
  python3 tests/bench/cli_io.py --mnemo .carry/bin/mnemo [--mnemo OTHER ...]
      [--device cuda] [--precision fp32] [--repeat 5] [--T 4096]
On the CPU (--device cpu) the run itself takes seconds; --T 1024 keeps it short.
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

B, H, DK, DV, DH, C = 4, 32, 64, 64, 256, 64
PHASE = re.compile(r"^timing: (.+?) +([0-9.]+) ms(?: +([0-9.]+) MB)?")


def write_experiment(path, T, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, DK), dtype=np.float32)
    k *= np.sqrt(DK) / np.linalg.norm(k, axis=-1, keepdims=True)
    with h5py.File(path, "w") as f:
        f.attrs["mnemo_schema"] = 1
        r = f.create_group("rule")
        for key, val in dict(layers=2, hidden=DH, activation="gelu", bias=1, loss="mse", feature_reduce="mean",
                             token_reduce="sum", step=C, refresh=C, retrieve="after", clip="norm", clip_max=1.0,
                             clip_scope="global").items():
            r.attrs[key] = val
        f["inputs/k"] = k
        f["inputs/v"] = (0.5 * k + 0.1 * rng.standard_normal((B, H, T, DV), dtype=np.float32)).astype(np.float32)
        for key, val in (("theta", 0.02), ("eta", 0.9), ("alpha", 0.001)):
            f["gates/" + key] = np.float32(val)
        f["init/W1"] = (rng.standard_normal((B, H, DH, DK), dtype=np.float32) / np.sqrt(DK)).astype(np.float32)
        f["init/b1"] = (0.1 * rng.standard_normal((B, H, DH), dtype=np.float32)).astype(np.float32)
        f["init/W2"] = (rng.standard_normal((B, H, DV, DH), dtype=np.float32) / np.sqrt(DH)).astype(np.float32)
        f["init/b2"] = (0.1 * rng.standard_normal((B, H, DV), dtype=np.float32)).astype(np.float32)


def knows_timing(mnemo):
    p = subprocess.run([mnemo, "run", "--help"], capture_output=True, text=True)
    return "--timing" in p.stdout


def run_once(mnemo, exp, res, args, timing):
    cmd = [mnemo, "run", exp, "-o", res, "--device", args.device, "--precision", args.precision, "-q"]
    if timing:
        cmd.append("--timing")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit("cli_io.py: %s: exit %d: %s" % (" ".join(cmd), p.returncode, p.stderr.strip()[-600:]))
    phases = []
    for line in p.stderr.splitlines():
        m = PHASE.match(line)
        if m:
            phases.append((m.group(1), float(m.group(2)), float(m.group(3)) if m.group(3) else 0.0))
    return wall, phases


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mnemo", action="append", help="a mnemo binary (repeat for several; default $MNEMO)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--T", type=int, default=4096)
    args = ap.parse_args()
    mnemos = [os.path.abspath(m) for m in (args.mnemo or [os.environ.get("MNEMO", "./mnemo")])]
    work = tempfile.mkdtemp(prefix="mnemo-cli-io-")
    try:
        full, tiny = os.path.join(work, "p1.h5"), os.path.join(work, "p1_tiny.h5")
        write_experiment(full, args.T)
        write_experiment(tiny, 64)
        print("P1 file: %.1f MB (T=%d), tiny: T=64; device %s, %s, %d repeats" % (
            os.path.getsize(full) / 1e6, args.T, args.device, args.precision, args.repeat))
        timing = {m: knows_timing(m) for m in mnemos}
        rec = {m: dict(full=[], tiny=[], phases={}) for m in mnemos}
        for i, m in enumerate(mnemos):
            run_once(m, tiny, os.path.join(work, "warm%d.h5" % i), args, False)  # fills the kernel cache
        for _ in range(args.repeat):
            for i, m in enumerate(mnemos):
                res = os.path.join(work, "res%d.h5" % i)
                rec[m]["tiny"].append(run_once(m, tiny, res, args, False)[0])
                wall, phases = run_once(m, full, res, args, timing[m])
                rec[m]["full"].append(wall)
                for name, ms, mb in phases:
                    rec[m]["phases"].setdefault(name, []).append((ms, mb))
        for i, m in enumerate(mnemos):
            r = rec[m]
            f, t = statistics.median(r["full"]), statistics.median(r["tiny"])
            print("\n%s\n  whole process: full %.0f ms, tiny %.0f ms, full - tiny %.0f ms   (full runs: %s)" % (
                m, 1e3 * f, 1e3 * t, 1e3 * (f - t), ", ".join("%.0f" % (1e3 * x) for x in r["full"])))
            if not timing[m]:
                print("  (no --timing in this binary)")
            for name, vals in r["phases"].items():
                ms = statistics.median(v[0] for v in vals)
                mb = vals[0][1]
                rate = "  %7.0f MB/s" % (mb / (ms / 1e3)) if mb and ms > 0 else ""
                print("  %-14s %9.1f ms%s%s" % (name, ms, "  %8.1f MB" % mb if mb else "", rate))
        for i in range(1, len(mnemos)):
            p = subprocess.run([mnemos[0], "compare", os.path.join(work, "res0.h5"), os.path.join(work, "res%d.h5" % i),
                                "--rtol", "1e-6"], capture_output=True, text=True)
            print("\nresults of %s and %s: %s" % (mnemos[0], mnemos[i], "agree (rtol 1e-6)" if p.returncode == 0
                                                   else "DIFFER\n" + p.stdout[-1500:] + p.stderr[-500:]))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
