#!/usr/bin/env python3
"""test_compare: `mnemo compare` and mnemo.compare end to end, on result
files written here with h5py: exit status 0/1/2, the table, --rtol/--atol,
--all, -q, usage and file errors, and the Lua function.

Prints "PASS name", "FAIL name: detail" or "SKIP name: reason" per check
(tests/run.sh counts them); exits non-zero on failure. The binary is $MNEMO
(default ./mnemo); all is skipped while it is missing or its `compare` still
answers "not built yet".

    /usr/bin/python3 tests/compare/test_compare.py
"""

import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np

MNEMO = os.environ.get("MNEMO", "./mnemo")
FAILED = []


def check(name, cond, detail=""):
    if cond:
        print("PASS %s" % name)
    else:
        print("FAIL %s: %s" % (name, detail or "condition false"))
        FAILED.append(name)


def run(*args):
    p = subprocess.run([MNEMO] + list(args), capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def show(rc, out, err):
    return "rc=%d stdout=%r stderr=%r" % (rc, out[-600:], err[-300:])


def rng_data(seed):
    r = np.random.default_rng(seed)
    B, H, T, S, dk, dv = 2, 2, 8, 4, 4, 4
    return {
        "outputs/y": r.standard_normal((B, H, T, dv)).astype(np.float32),
        "outputs/loss": r.random((B, H, T)).astype(np.float32),
        "outputs/grad_norm": r.random((B, H, S)).astype(np.float32),
        "outputs/clip_scale": np.ones((B, H, S), np.float32),
        "outputs/skipped": np.zeros((B, H, S), np.float32),
        "final/W1": r.standard_normal((B, H, dv, dk)).astype(np.float32),
        "final/S_W1": r.standard_normal((B, H, dv, dk)).astype(np.float32),
    }


def write_result(path, data, engine="mnemo-test", precision="fp32", rule_step=1, extra=None,
                 schema=True):
    with h5py.File(path, "w") as f:
        if schema:
            f.attrs["mnemo_schema"] = 1
        f.attrs["engine"] = engine
        f.attrs["device"] = "cpu"
        f.attrs["precision"] = precision
        rule = f.create_group("rule")
        rule.attrs["layers"] = 1
        rule.attrs["step"] = rule_step
        for name, arr in data.items():
            f.create_dataset(name, data=arr)
        for name, arr in (extra or {}).items():
            f.create_dataset(name, data=arr)


def row_of(out, name):
    """The table line of dataset name, split on whitespace, or None."""
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == name:
            return parts
    return None


def rel_l2(a, b):
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    nb = np.linalg.norm(b)
    d = np.linalg.norm(a - b)
    return d / nb if nb > 0 else d


def main():
    if not os.path.isfile(MNEMO) or not os.access(MNEMO, os.X_OK):
        print("SKIP compare: no binary at %s (set MNEMO)" % MNEMO)
        return 0
    rc, out, err = run("compare", "--help")
    if "not built yet" in out + err:
        print("SKIP compare: %s compare is not built yet" % MNEMO)
        return 0

    tmp = tempfile.mkdtemp(prefix="mnemo-compare-")
    try:
        checks(tmp, rc, out, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if FAILED else 0


def checks(tmp, rc, out, err):
    P = lambda name: os.path.join(tmp, name)  # noqa: E731
    base = rng_data(1)

    # --help
    check("help: exit 0", rc == 0, show(rc, out, err))
    check("help: usage line", "usage: mnemo compare" in out, out)
    check("help: says attributes are not compared", "not compared" in out, out)

    # identical results, though their attributes (engine, rule) differ
    write_result(P("a.h5"), base, engine="mnemo 0.1.0 (cpu)", rule_step=2)
    write_result(P("b.h5"), base, engine="reference", precision="fp64")
    rc, out, err = run("compare", P("a.h5"), P("b.h5"))
    check("same: exit 0", rc == 0, show(rc, out, err))
    lines = out.splitlines()
    check("same: header names the scope and files",
          bool(lines) and lines[0] == "comparing /outputs and /final of %s (A) and %s (B)"
          % (P("a.h5"), P("b.h5")), out)
    check("same: header shows the engines", "engine mnemo 0.1.0 (cpu)" in out
          and "engine reference" in out and "precision fp64" in out, out)
    check("same: column header", any(l.split() == ["dataset", "shape", "max_abs", "rel_l2", "status"]
                                     for l in lines), out)
    r = row_of(out, "/outputs/y")
    check("same: row of y", r is not None and r[1] == "2x2x8x4" and r[-1] == "pass", out)
    check("same: every dataset in scope has a row",
          all(row_of(out, "/" + n) for n in base), out)
    check("same: summary", lines[-1] == "7 datasets: 7 passed, 0 failed (rtol 1e-05)", out)
    check("same: attributes left alone", row_of(out, "/rule") is None, out)

    # y off by a relative 1e-4: fails at the default rtol, passes at 1e-3
    pert = dict(base)
    noise = np.random.default_rng(7).standard_normal(base["outputs/y"].shape)
    y = base["outputs/y"].astype(np.float64)
    pert["outputs/y"] = (y + 1e-4 * noise * np.linalg.norm(y) / np.linalg.norm(noise)).astype(np.float32)
    write_result(P("c.h5"), pert)
    rc, out, err = run("compare", P("c.h5"), P("b.h5"))
    check("rtol: exit 1 past the default rtol", rc == 1, show(rc, out, err))
    r = row_of(out, "/outputs/y")
    check("rtol: y fails", r is not None and r[-1] == "fail", out)
    want = rel_l2(pert["outputs/y"], base["outputs/y"])
    got = float(r[3]) if r else -1
    check("rtol: rel_l2 as numpy computes it", abs(got - want) <= 0.01 * want,
          "got %g want %g" % (got, want))
    want_max = np.abs(pert["outputs/y"].astype(np.float64) - base["outputs/y"]).max()
    got = float(r[2]) if r else -1
    check("rtol: max_abs as numpy computes it", abs(got - want_max) <= 0.01 * want_max,
          "got %g want %g" % (got, want_max))
    check("rtol: the others pass", row_of(out, "/final/W1")[-1] == "pass", out)
    check("rtol: summary counts", out.splitlines()[-1] == "7 datasets: 6 passed, 1 failed (rtol 1e-05)",
          out)
    rc, out, err = run("compare", P("c.h5"), P("b.h5"), "--rtol", "1e-3")
    check("rtol: --rtol 1e-3 passes", rc == 0, show(rc, out, err))
    check("rtol: summary shows it", "(rtol 0.001)" in out, out)
    rc, out, err = run("compare", "--rtol=2e-4", P("c.h5"), P("b.h5"))
    check("rtol: --rtol=X before the files", rc == 0, show(rc, out, err))
    rc, out, err = run("compare", P("c.h5"), P("b.h5"), "--rtol", "5e-5")
    check("rtol: --rtol 5e-5 still fails", rc == 1, show(rc, out, err))
    rc, out, err = run("compare", P("c.h5"), P("b.h5"), "--atol", "1e-2")
    check("atol: --atol past max_abs passes", rc == 0 and "atol 0.01" in out, show(rc, out, err))

    # -q: failed rows and the summary only
    rc, out, err = run("compare", "-q", P("c.h5"), P("b.h5"))
    check("quiet: exit 1", rc == 1, show(rc, out, err))
    check("quiet: no header", "comparing" not in out, out)
    check("quiet: the failed row only", row_of(out, "/outputs/y") is not None
          and row_of(out, "/final/W1") is None, out)
    check("quiet: summary", out.splitlines()[-1].startswith("7 datasets: 6 passed, 1 failed"), out)
    rc, out, err = run("compare", "-q", P("a.h5"), P("b.h5"))
    check("quiet: all passing prints the summary alone",
          rc == 0 and out.strip().splitlines() == ["7 datasets: 7 passed, 0 failed (rtol 1e-05)"], out)

    # NaN and Inf: same places pass; elsewhere they fail
    nb = dict(base)
    loss = base["outputs/loss"].copy()
    loss[0, 0, 1] = np.nan
    loss[1, 1, 2] = np.inf
    nb["outputs/loss"] = loss
    write_result(P("nan_b.h5"), nb)
    write_result(P("nan_a.h5"), nb)
    rc, out, err = run("compare", P("nan_a.h5"), P("nan_b.h5"))
    check("nonfinite: same places pass", rc == 0, show(rc, out, err))
    rc, out, err = run("compare", P("a.h5"), P("nan_b.h5"))
    check("nonfinite: finite A where B is not fails", rc == 1, show(rc, out, err))
    check("nonfinite: says where", "non-finite mismatch at 2 places" in out, out)
    rc, out, err = run("compare", P("nan_b.h5"), P("a.h5"))
    check("nonfinite: NaN or Inf in A where B is finite fails", rc == 1 and "non-finite in A at 2 places" in out,
          show(rc, out, err))

    # missing datasets and shape mismatches
    md = dict(base)
    del md["final/S_W1"]
    md["outputs/skipped"] = np.zeros((2, 2, 5), np.float32)
    write_result(P("m.h5"), md)
    rc, out, err = run("compare", P("m.h5"), P("b.h5"))
    check("missing: exit 1", rc == 1, show(rc, out, err))
    r = row_of(out, "/final/S_W1")
    check("missing: missing in A", r is not None and " ".join(r[-3:]) == "missing in A", out)
    check("missing: shape mismatch", "2x2x5 vs 2x2x4" in out and "shape mismatch" in out, out)
    rc, out, err = run("compare", P("b.h5"), P("m.h5"))
    check("missing: missing in B", "missing in B" in out and rc == 1, out)

    # scope: extra datasets outside /outputs and /final count only with --all
    write_result(P("x1.h5"), base, extra={"inputs/k": np.ones((2, 2, 8, 4), np.float32)})
    write_result(P("x2.h5"), base, extra={"inputs/k": np.zeros((2, 2, 8, 4), np.float32)})
    rc, out, err = run("compare", P("x1.h5"), P("x2.h5"))
    check("scope: result files compare /outputs and /final", rc == 0 and "/inputs/k" not in out,
          show(rc, out, err))
    rc, out, err = run("compare", "--all", P("x1.h5"), P("x2.h5"))
    check("scope: --all compares every dataset", rc == 1 and row_of(out, "/inputs/k") is not None
          and out.startswith("comparing every dataset of"), show(rc, out, err))
    with h5py.File(P("plain1.h5"), "w") as f:
        f.create_dataset("k", data=np.arange(6, dtype=np.float32))
        f.create_dataset("g/i", data=np.arange(3, dtype=np.int64))
    with h5py.File(P("plain2.h5"), "w") as f:
        f.create_dataset("k", data=np.arange(6, dtype=np.float64))
        f.create_dataset("g/i", data=np.arange(3, dtype=np.float32))
    with h5py.File(P("plain3.h5"), "w") as f:
        f.create_dataset("k", data=np.arange(6, dtype=np.float32))
    rc, out, err = run("compare", P("plain1.h5"), P("plain2.h5"))
    check("scope: plain files compare every dataset",
          rc == 0 and out.startswith("comparing every dataset of") and row_of(out, "/g/i") is not None,
          show(rc, out, err))

    # usage errors: exit 2 with one line naming the argument
    for name, args, needle in [
        ("no files", [], "two files"),
        ("one file", [P("a.h5")], "second file"),
        ("three files", [P("a.h5"), P("b.h5"), P("c.h5")], P("c.h5")),
        ("unknown option", [P("a.h5"), P("b.h5"), "--frob"], "--frob"),
        ("bad number", [P("a.h5"), P("b.h5"), "--rtol", "abc"], "abc"),
        ("negative number", [P("a.h5"), P("b.h5"), "--atol=-1"], "--atol"),
        ("missing number", [P("a.h5"), P("b.h5"), "--rtol"], "--rtol"),
    ]:
        rc, out, err = run("compare", *args)
        check("usage: %s exits 2" % name, rc == 2, show(rc, out, err))
        check("usage: %s says so in one line" % name,
              len(err.strip().splitlines()) == 1 and needle in err and out == "", show(rc, out, err))

    # unreadable input: exit 2, one line naming the file
    missing = P("no_such_file.h5")
    for name, args, culprit in [("missing A", [missing, P("b.h5")], missing),
                                ("missing B", [P("a.h5"), missing], missing)]:
        rc, out, err = run("compare", *args)
        check("input: %s exits 2" % name, rc == 2, show(rc, out, err))
        check("input: %s names the file" % name,
              len(err.strip().splitlines()) == 1 and culprit in err, show(rc, out, err))
    with open(P("text.h5"), "w") as f:
        f.write("not hdf5\n")
    rc, out, err = run("compare", P("text.h5"), P("b.h5"))
    check("input: not HDF5 exits 2 naming the file",
          rc == 2 and P("text.h5") in err and len(err.strip().splitlines()) == 1, show(rc, out, err))

    # the Lua function
    lua = ('local m = mnemo or require("mnemo") '
           'local r = m.compare(%r, %r) '
           'print("passed=" .. tostring(r.passed), "rows=" .. #r.rows, "rtol=" .. r.rtol) '
           'for _, row in ipairs(r.rows) do if row.status ~= "pass" then '
           'print("row", row.name, row.status, row.shape, row.rel) end end '
           'print(tostring(r))')
    rc, out, err = run("-e", lua % (P("a.h5"), P("b.h5")))
    check("lua: runs", rc == 0, show(rc, out, err))
    check("lua: passed=true", "passed=true\trows=7\trtol=1e-05" in out, out)
    check("lua: __tostring prints the table",
          "comparing /outputs and /final of" in out and "7 datasets: 7 passed" in out, out)
    rc, out, err = run("-e", lua % (P("c.h5"), P("b.h5")))
    check("lua: passed=false", rc == 0 and "passed=false\trows=7" in out, show(rc, out, err))
    check("lua: the failed row", "row\t/outputs/y\tfail\t2x2x8x4\t" in out, out)
    rc, out, err = run("-e", 'local m = mnemo or require("mnemo") '
                             'local r = m.compare(%r, %r, {rtol = 1e-3}) print(r.passed, r.rtol)'
                       % (P("c.h5"), P("b.h5")))
    check("lua: opts.rtol", rc == 0 and out.strip() == "true\t0.001", show(rc, out, err))
    rc, out, err = run("-e", 'local m = mnemo or require("mnemo") '
                             'local ok, e = pcall(m.compare, %r, %r) print(ok, e)'
                       % (missing, P("b.h5")))
    check("lua: a missing file raises naming it", rc == 0 and out.startswith("false")
          and missing in out, show(rc, out, err))
    rc, out, err = run("-e", 'local m = mnemo or require("mnemo") '
                             'local ok, e = pcall(m.compare, %r, %r, {rtl = 1}) print(ok, e)'
                       % (P("a.h5"), P("b.h5")))
    check("lua: an unknown option raises naming it", rc == 0 and "rtl" in out and
          out.startswith("false"), show(rc, out, err))
    # a table tree against a file, if the tensor constructor is there
    rc, out, err = run("-e", 'local m = mnemo or require("mnemo") '
                             'if not m.tensor then print("no mnemo.tensor") return end '
                             'local t = {k = m.tensor({0, 1, 2, 3, 4, 5})} '
                             'local r = m.compare(t, %r) print(r.passed, #r.rows, r.rows[1].name) '
                             'local u = {k = m.tensor({0, 1, 2, 3, 4, 6})} '
                             'print(m.compare(u, %r).passed)' % (P("plain3.h5"), P("plain3.h5")))
    if "no mnemo.tensor" in out:
        print("SKIP lua: table trees: no mnemo.tensor in this build")
    else:
        check("lua: table tree against a file", rc == 0 and
              out.splitlines()[:2] == ["true\t1\t/k", "false"], show(rc, out, err))


if __name__ == "__main__":
    sys.exit(main())
