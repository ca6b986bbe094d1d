#!/usr/bin/env python3
"""`mnemo run` on good and bad experiment files (SPEC.md sections 5 and 6):
exit 0 with a result in the schema; exit 2 with one line naming the file,
dataset or attribute at fault; an earlier result file survives a failed run."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_experiments  # noqa: E402

failures = 0


def check(name, cond, detail=""):
    global failures
    if cond:
        print("PASS run-cli: " + name)
    else:
        failures += 1
        print("FAIL run-cli: %s: %s" % (name, detail))


def main():
    binary = os.environ.get("MNEMO", os.path.join(os.getcwd(), "mnemo"))
    if not os.path.exists(binary):
        print("SKIP run-cli: no mnemo binary at %s" % binary)
        return 0
    work = tempfile.mkdtemp(prefix="mnemo-run-cli-")
    try:
        return run_checks(binary, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(binary, *args):
    p = subprocess.run([binary, "run", *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr.strip()


def variant(base, path, edit):
    """A copy of the base experiment with edit(f) applied."""
    shutil.copy(base, path)
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


TIMING_LINE = re.compile(r"^timing: (.+?) +(-?[0-9.]+) ms(?: +([0-9.]+) MB(?: +([0-9]+) MB/s)?)?(?:  \((.*)\))?$")


def dataset_bytes(path):
    """Bytes of every dataset in an HDF5 file, as the datasets hold them."""
    total = [0]

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            total[0] += obj.size * obj.dtype.itemsize
    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return total[0]


def check_timing(binary, exp, out, device):
    """`mnemo run --timing`: one line per phase on stderr, in order, with
    numbers that add up; the bytes read and written are the files'."""
    rc, so, se = run(binary, exp, "-o", out, "--device", device, "--timing", "-q")
    what = "--timing on %s (%s)" % (device, os.path.basename(exp))
    check(what + ": the run succeeds", rc == 0, se)
    if rc != 0:
        return
    phases, others = [], []
    for line in se.splitlines():
        m = TIMING_LINE.match(line)
        if m:
            phases.append((m.group(1), float(m.group(2)), m.group(3) and float(m.group(3)),
                           m.group(4) and float(m.group(4)), m.group(5) or ""))
        else:
            others.append(line)
    check(what + ": every stderr line is a phase line", not others, repr(others))
    names = [p[0] for p in phases]
    with h5py.File(exp, "r") as f:
        backward = ["backward"] if "upstream" in f else []
    want = ["read inputs", "run"] + backward + ["write outputs", "sync, rename", "clean up", "total"]
    if device == "cuda":
        want = ["device init", "read inputs", "upload"] + want[1:]
    check(what + ": the phases in order", names == want, "%r, want %r" % (names, want))
    if names != want:
        return
    ms = {p[0]: p[1] for p in phases}
    mb = {p[0]: p[2] for p in phases}
    check(what + ": no phase takes negative time", all(t >= 0 for t in ms.values()), repr(ms))
    parts = sum(t for n, t in ms.items() if n != "total")
    check(what + ": the total holds the phases", parts <= ms["total"] + 0.1 * len(ms), "%r" % ms)
    check(what + ": run is a real share of the total", 0 < ms["run"] < ms["total"], "%r" % ms)
    got_in, want_in = mb["read inputs"], dataset_bytes(exp) / 1e6
    check(what + ": read inputs counts the file's datasets", got_in is not None and abs(got_in - want_in) < 0.051,
          "%r MB, the file holds %.3f MB" % (got_in, want_in))
    got_out, want_out = mb["write outputs"], dataset_bytes(out) / 1e6
    check(what + ": write outputs counts the result's datasets", got_out is not None and abs(got_out - want_out) < 0.051,
          "%r MB, the result holds %.3f MB" % (got_out, want_out))
    for p in phases:
        if p[2] and p[3] is not None and p[1] >= 1.0:
            rate = p[2] / (p[1] / 1e3)
            rounding = 0.05 / p[2] + 0.05 / p[1] + 0.01  # both printed to 0.1
            check(what + ": %s MB/s is MB over seconds" % p[0], abs(rate - p[3]) <= rounding * rate + 1,
                  "%r MB in %r ms, %r MB/s" % (p[2], p[1], p[3]))
    if device == "cuda":
        # k and v of the staged experiment (>= 1 MiB each) go straight to the device and y comes back so
        note = {p[0]: p[4] for p in phases}
        check(what + ": k and v uploaded while reading", "uploaded while reading" in note["read inputs"], repr(note))
        check(what + ": y downloaded while writing", "downloaded while writing" in note["write outputs"], repr(note))
    rc, so, se = run(binary, exp, "-o", out, "--device", device, "-q")
    check(what + ": no timing lines without --timing", rc == 0 and "timing:" not in se, se)


def run_checks(binary, work):
    # A 2-layer config without non-finite inputs, so every output is finite.
    i = 0
    while True:
        cfg = gen_experiments.make_config(3, i, 16)
        if cfg["rule"]["layers"] == 2 and "nonfinite=none" in cfg["desc"]:
            break
        i += 1
    base = os.path.join(work, "exp.h5")
    gen_experiments.write_config(base, cfg)
    out = os.path.join(work, "res.h5")

    rc, so, se = run(binary, base, "-o", out)
    check("a good file runs", rc == 0, se)
    with h5py.File(out, "r") as f:
        check("result: schema attribute", int(f.attrs["mnemo_schema"]) == 1)
        check("result: every output", all(n in f["outputs"] for n in ("y", "loss", "grad_norm", "clip_scale", "skipped")))
        check("result: final weights and momenta", "W1" in f["final"] and "S_W1" in f["final"])
        check("result: float32 datasets", f["outputs/y"].dtype == np.float32)
        loss = f["rule"].attrs["loss"]
        loss = loss.decode() if isinstance(loss, bytes) else loss
        check("result: /rule copied", loss == cfg["rule"]["loss"], "%r vs %r" % (loss, cfg["rule"]["loss"]))
        check("result: no /trace unless asked", "trace" not in f)
        before = open(out, "rb").read()
    rc, so, se = run(binary, base, "-o", out, "--trace")
    with h5py.File(out, "r") as f:
        check("--trace adds /trace", rc == 0 and "step_loss" in f["trace"] and "weight_norm" in f["trace"], se)
    shutil.copy(base, os.path.join(work, "keep.h5"))
    with open(out, "wb") as fh:
        fh.write(before)

    check_timing(binary, base, out, "cpu")
    # big enough that k, v (2 MiB each) and y are staged on cuda (model/h5.h)
    staged = os.path.join(work, "staged.h5")
    rng = np.random.default_rng(3)
    B, H, T, d = 1, 4, 2048, 64
    with h5py.File(staged, "w") as f:
        f.attrs["mnemo_schema"] = 1
        r = f.create_group("rule")
        for key, val in dict(layers=2, hidden=32, activation="gelu", step=16, refresh=16, loss="mse").items():
            r.attrs[key] = val
        f["inputs/k"] = (rng.standard_normal((B, H, T, d)) / 8).astype(np.float32)
        f["inputs/v"] = rng.standard_normal((B, H, T, d)).astype(np.float32)
        f["gates/theta"] = np.float32(0.01)
        f["gates/eta"] = np.float32(0.5)
        f["init/W1"] = (rng.standard_normal((H, 32, d)) / 8).astype(np.float32)
        f["init/W2"] = (rng.standard_normal((H, d, 32)) / 6).astype(np.float32)
    check_timing(binary, staged, out, "cpu")
    if os.environ.get("MNEMO_DEVICE") == "cuda":
        cpu_out = os.path.join(work, "staged_cpu.h5")
        shutil.copy(out, cpu_out)
        check_timing(binary, staged, out, "cuda")
        p = subprocess.run([binary, "compare", out, cpu_out, "--rtol", "1e-4"], capture_output=True, text=True)
        check("staged cuda run agrees with the cpu", p.returncode == 0, p.stdout[-800:] + p.stderr[-400:])
    else:
        print("SKIP run-cli: --timing on cuda: set MNEMO_DEVICE=cuda on a GPU machine (tests/gpu/run_gpu_tests.sh)")
    with open(out, "wb") as fh:
        fh.write(before)

    cases = [
        ("missing file", [os.path.join(work, "nope.h5"), "-o", out], "nope.h5"),
        ("missing dataset /inputs/v",
         [variant(base, os.path.join(work, "e1.h5"), lambda f: f["inputs"].__delitem__("v")), "-o", out],
         "dataset /inputs/v is missing"),
        ("unknown loss names the choices",
         [variant(base, os.path.join(work, "e2.h5"), lambda f: f["rule"].attrs.__setitem__("loss", "hubr")), "-o", out],
         "unknown loss 'hubr' (one of: mse"),
        ("unknown attribute",
         [variant(base, os.path.join(work, "e3.h5"), lambda f: f["rule"].attrs.__setitem__("thetaa", 1)), "-o", out],
         "unknown attribute 'thetaa'"),
        ("bad expression says where",
         [variant(base, os.path.join(work, "e4.h5"), lambda f: (f["rule"].attrs.__setitem__("loss", "custom"),
                                                                f["rule"].attrs.__setitem__("loss_expr", "abs(r) $ 2"))),
          "-o", out],
         "position 8"),
        ("refresh not a multiple of step",
         [variant(base, os.path.join(work, "e5.h5"), lambda f: (f["rule"].attrs.__setitem__("step", 4),
                                                                f["rule"].attrs.__setitem__("refresh", 6))),
          "-o", out],
         "refresh 6 is not 0 or a multiple of step 4"),
        ("gate that does not broadcast",
         [variant(base, os.path.join(work, "e6.h5"), lambda f: (f["gates"].__delitem__("theta"),
                                                                f["gates"].create_dataset("theta", data=np.ones(999, np.float32)))),
          "-o", out],
         "gate theta of shape 999"),
        ("weight of the wrong shape",
         [variant(base, os.path.join(work, "e7.h5"), lambda f: (f["init"].__delitem__("W1"),
                                                                f["init"].create_dataset("W1", data=np.ones((3, 99), np.float32)))),
          "-o", out],
         "initial W1 has shape 3x99"),
        ("not a mnemo file",
         [variant(base, os.path.join(work, "e8.h5"), lambda f: f.attrs.__delitem__("mnemo_schema")), "-o", out],
         "mnemo_schema is missing"),
        ("output directory missing", [base, "-o", os.path.join(work, "no", "dir", "r.h5")], "no/dir"),
        ("precision on the cpu", [base, "-o", out, "--precision", "tf32"], "fp32 only"),
        ("bad option", [base, "-o", out, "--fast"], "unknown option --fast"),
        ("missing -o", [base], "missing -o"),
    ]
    for name, args, needle in cases:
        rc, so, se = run(binary, *args)
        lines = se.splitlines()
        check(name + ": exit 2", rc == 2, "exit %d, stderr %r" % (rc, se))
        check(name + ": says what", needle in se, "stderr %r lacks %r" % (se, needle))
        check(name + ": first line names the problem alone", len(lines) >= 1 and needle in lines[0] or needle in se,
              "stderr %r" % se)
        if "-o" in args and args[args.index("-o") + 1] == out:
            check(name + ": the earlier result is intact", open(out, "rb").read() == before)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
