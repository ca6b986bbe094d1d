#!/usr/bin/env python3
"""`mnemo run` on good and bad experiment files (SPEC.md sections 5 and 6):
exit 0 with a result in the schema; exit 2 with one line naming the file,
dataset or attribute at fault; an earlier result file survives a failed run."""
import os
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
