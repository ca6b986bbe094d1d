#!/usr/bin/env python3
"""test_h5py.py: mnemo's HDF5 files against h5py and h5dump, both directions.

(a) `$MNEMO -e` writes a file with mnemo.save; h5py reads it back and checks
    values, dtypes, shapes and attributes (strings read as str); `h5dump -H`
    parses it.
(b) h5py writes a file with the types numpy users write (float32, float64,
    int32, int64, bool, float16, uint8 datasets; a scalar dataset; attributes
    of int, float, str, bytes, bool and numpy kinds; nested groups); a Lua
    chunk run by `$MNEMO -e` loads it and prints every value; the printout
    must match.

Prints PASS/FAIL/SKIP lines (tests/run.sh counts them). $MNEMO names the
binary (tests/run.sh sets it; default ./mnemo at the repository root); when it
is missing every check is SKIPPED, never passed.
"""
import os
import shutil
import subprocess
import sys
import tempfile

failures = 0


def report(name, ok, detail=""):
    global failures
    if ok:
        print(f"PASS {name}")
    else:
        failures += 1
        print(f"FAIL {name}: {detail}")


def skip(name, why):
    print(f"SKIP {name}: {why}")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MNEMO = os.environ.get("MNEMO") or os.path.join(ROOT, "mnemo")

CHECKS_A = ["mnemo writes a file", "h5py opens it", "h5dump -H parses it"]
CHECKS_B = ["h5py writes a file", "mnemo loads the h5py file"]

try:
    import h5py
    import numpy as np
except ImportError as e:  # pragma: no cover
    for n in CHECKS_A + CHECKS_B:
        skip(n, f"python lacks h5py/numpy ({e})")
    sys.exit(0)

if not (os.path.isfile(MNEMO) and os.access(MNEMO, os.X_OK)):
    for n in CHECKS_A + CHECKS_B:
        skip(n, f"no mnemo binary at {MNEMO} (set MNEMO or build it)")
    sys.exit(0)


def run_mnemo(code, timeout=60):
    p = subprocess.run([MNEMO, "-e", code], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    return p.returncode, p.stdout, p.stderr


def lua_str(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


tmp = tempfile.mkdtemp(prefix="mnemo-test-h5py-")

# ---------------------------------------------------------------- (a) mnemo -> h5py
path_a = os.path.join(tmp, "from_mnemo.h5")
code_a = f"""
local P = {lua_str(path_a)}
mnemo.save(P, {{
  mnemo_schema = 1,
  engine = "mnemo h\\u{{e9}}",
  lr = 0.5,
  steps = 12,
  flag = true,
  off = false,
  inputs = {{
    k = mnemo.tensor({{{{1, 2, 3}}, {{4, 5, 6.5}}}}),
    v = mnemo.tensor({{1.5, -2.5, 1e300}}, "f64"),
    idx = mnemo.tensor({{1, -2, 1099511627776}}, "i64"),
  }},
  gates = {{ theta = mnemo.tensor(0.125), empty = mnemo.zeros(0), none = mnemo.zeros(2, 0, "i64") }},
  final = {{ W1 = mnemo.arange(6):view(2, 3):t(), deep = {{ deeper = {{ x = mnemo.tensor(7, "i64") }} }} }},
  rule = {{ loss = "mse", clip_max = 1.0 }},
}})
print("saved")
"""
rc, out, err = run_mnemo(code_a)
report("mnemo writes a file", rc == 0 and "saved" in out and os.path.exists(path_a),
       f"rc={rc} out={out!r} err={err!r}")

if os.path.exists(path_a):
    try:
        f = h5py.File(path_a, "r")
        report("h5py opens it", True)
    except Exception as e:  # noqa: BLE001
        report("h5py opens it", False, repr(e))
        f = None
    if f is not None:
        with f:
            a = f.attrs
            report("root int attr", a.get("mnemo_schema") == 1 and isinstance(a["mnemo_schema"], np.int64),
                   repr(a.get("mnemo_schema")))
            report("string attr reads as str", isinstance(a.get("engine"), str) and a["engine"] == "mnemo h\u00e9",
                   repr(a.get("engine")))
            report("float attr", isinstance(a.get("lr"), np.float64) and a["lr"] == 0.5, repr(a.get("lr")))
            report("integer attr", isinstance(a.get("steps"), np.int64) and a["steps"] == 12, repr(a.get("steps")))
            report("booleans as integers 1/0", a.get("flag") == 1 and a.get("off") == 0
                   and isinstance(a.get("flag"), np.int64), f"{a.get('flag')!r} {a.get('off')!r}")
            k = f["inputs/k"]
            report("f32 dataset dtype", k.dtype == np.dtype("<f4"), str(k.dtype))
            report("f32 dataset shape", k.shape == (2, 3), str(k.shape))
            report("f32 dataset values", np.array_equal(k[()], np.array([[1, 2, 3], [4, 5, 6.5]], "f4")),
                   repr(k[()]))
            v = f["inputs/v"]
            report("f64 dataset", v.dtype == np.dtype("<f8") and np.array_equal(v[()], [1.5, -2.5, 1e300]),
                   f"{v.dtype} {v[()]!r}")
            idx = f["inputs/idx"]
            report("i64 dataset", idx.dtype == np.dtype("<i8")
                   and np.array_equal(idx[()], np.array([1, -2, 1099511627776], "i8")),
                   f"{idx.dtype} {idx[()]!r}")
            th = f["gates/theta"]
            report("0-d tensor is a scalar dataset", th.shape == () and th[()] == np.float32(0.125)
                   and th.dtype == np.dtype("<f4"), f"{th.shape} {th[()]!r}")
            report("empty dataset", f["gates/empty"].shape == (0,) and f["gates/empty"].dtype == np.dtype("<f4"),
                   str(f["gates/empty"].shape))
            report("empty 2x0 i64 dataset", f["gates/none"].shape == (2, 0)
                   and f["gates/none"].dtype == np.dtype("<i8"), str(f["gates/none"].shape))
            w = f["final/W1"]
            report("non-contiguous view written row-major", w.shape == (3, 2)
                   and np.array_equal(w[()], np.array([[0, 3], [1, 4], [2, 5]], "f4")), repr(w[()]))
            x = f["final/deep/deeper/x"]
            report("deeply nested group", x.shape == () and x[()] == 7 and x.dtype == np.dtype("<i8"),
                   repr(x[()]))
            r = f["rule"].attrs
            report("group attrs", r.get("loss") == "mse" and r.get("clip_max") == 1.0
                   and isinstance(r.get("clip_max"), np.float64), repr(dict(r)))
            report("groups are groups", isinstance(f["rule"], h5py.Group) and isinstance(f["final/deep"], h5py.Group))
            report("no stray members", sorted(f.keys()) == ["final", "gates", "inputs", "rule"], repr(list(f.keys())))
    report("no temporary file left", [n for n in os.listdir(tmp) if ".tmp-" in n] == [], repr(os.listdir(tmp)))

    h5dump = shutil.which("h5dump")
    if h5dump:
        p = subprocess.run([h5dump, "-H", path_a], capture_output=True, text=True, timeout=60)
        report("h5dump -H parses it", p.returncode == 0 and 'DATASET "W1"' in p.stdout
               and "H5T_IEEE_F32LE" in p.stdout and "H5T_STD_I64LE" in p.stdout,
               f"rc={p.returncode} {p.stderr[:300]!r}")
    else:
        skip("h5dump -H parses it", "h5dump not installed (hdf5-tools)")
else:
    for n in ["h5py opens it", "h5dump -H parses it"]:
        report(n, False, "mnemo wrote no file")

# ---------------------------------------------------------------- (b) h5py -> mnemo
path_b = os.path.join(tmp, "from_h5py.h5")
try:
    with h5py.File(path_b, "w") as f:
        f.attrs["mnemo_schema"] = 1
        f.attrs["pyint"] = 7
        f.attrs["pyfloat"] = 0.1
        f.attrs["pystr"] = "h\u00e9llo"
        f.attrs["pybytes"] = b"raw bytes"
        f.attrs["pybool"] = True
        f.attrs["npf32"] = np.float32(0.25)
        f.attrs["npi16"] = np.int16(-3)
        f.attrs["npu64"] = np.uint64(2**40)
        f.attrs["arr"] = np.array([1, 2, 3], dtype="i4")
        f.attrs["strlist"] = ["a", "b"]
        f.create_dataset("f32", data=np.array([[1.5, -2], [3, 4.25]], "f4"))
        f.create_dataset("f64", data=np.array([0.1, 1e-300, -7], "f8"))
        f.create_dataset("i32", data=np.array([-1, 2, 2**31 - 1], "i4"))
        f.create_dataset("i64", data=np.array([2**62, -(2**62)], "i8"))
        f.create_dataset("u8", data=np.array([0, 255], "u1"))
        f.create_dataset("bool", data=np.array([True, False, True]))
        f.create_dataset("f16", data=np.array([0.5, -2, 65504], "f2"))
        f.create_dataset("scalar", data=np.float64(2.5))
        f.create_dataset("empty", shape=(0, 3), dtype="f4")
        f.create_dataset("f32be", data=np.array([1.25, 2], ">f4"))
        f.create_dataset("gz", data=np.arange(1000, dtype="f8").reshape(10, 100), compression="gzip",
                         chunks=(5, 10))
        g = f.create_group("rule")
        g.attrs["loss"] = "mse"
        g.attrs["layers"] = np.int64(2)
        g.create_group("inner/deeper").create_dataset("w", data=np.arange(6, dtype="f4").reshape(2, 3))
        f.create_dataset("label", data="relu")
    report("h5py writes a file", True)
except Exception as e:  # noqa: BLE001
    report("h5py writes a file", False, repr(e))

# The Lua side prints one line per leaf: path, kind, then the value.
code_b = f"""
local d = mnemo.load({lua_str(path_b)})
local function flat(v, out)
  if type(v) == "table" then for _, x in ipairs(v) do flat(x, out) end
  else out[#out + 1] = math.type(v) == "integer" and string.format("%d", v) or string.format("%.17g", v) end
  return out
end
local function walk(t, prefix)
  local keys = {{}}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v, p = t[k], prefix .. "/" .. k
    if mnemo.is_tensor(v) then
      local vals = v:numel() > 0 and flat(v.ndim == 0 and {{v:item()}} or v:tolist(), {{}}) or {{}}
      print(p, "tensor", v.dtype, table.concat(v.shape, "x"), table.concat(vals, ","))
    elseif type(v) == "table" then
      print(p, "group")
      walk(v, p)
    elseif type(v) == "number" then
      print(p, math.type(v), math.type(v) == "integer" and string.format("%d", v) or string.format("%.17g", v))
    else
      print(p, type(v), v)
    end
  end
end
walk(d, "")
"""
rc, out, err = run_mnemo(code_b)
report("mnemo loads the h5py file", rc == 0, f"rc={rc} err={err!r}")
got = {}
for line in out.splitlines():
    parts = line.split("\t")
    if len(parts) >= 2:
        got[parts[0]] = parts[1:]


def tensor_is(name, dtype, shape, values, exact=True):
    g = got.get(name)
    if not g or g[0] != "tensor":
        report(f"load {name}", False, f"got {g!r}")
        return
    _, dt, shp, vals = (g + ["", "", ""])[:4]
    vals = [float(x) if dtype != "i64" else int(x) for x in vals.split(",")] if vals else []
    want_shape = "x".join(str(s) for s in shape)
    ok = dt == dtype and shp == want_shape and len(vals) == len(values)
    if ok:
        for a, b in zip(vals, values):
            if exact and a != b:
                ok = False
    report(f"load {name} ({dtype} {want_shape or 'scalar'})", ok, f"got {g!r}, want {dtype} {want_shape} {values}")


def leaf_is(name, kind, value):
    g = got.get(name)
    want = [kind, value]
    report(f"load {name} ({kind})", g == want, f"got {g!r}, want {want!r}")


tensor_is("/f32", "f32", (2, 2), [1.5, -2, 3, 4.25])
tensor_is("/f64", "f64", (3,), [0.1, 1e-300, -7])
tensor_is("/i32", "i64", (3,), [-1, 2, 2**31 - 1])
tensor_is("/i64", "i64", (2,), [2**62, -(2**62)])
tensor_is("/u8", "i64", (2,), [0, 255])
tensor_is("/bool", "i64", (3,), [1, 0, 1])
tensor_is("/f16", "f32", (3,), [0.5, -2, 65504])
tensor_is("/scalar", "f64", (), [2.5])
tensor_is("/empty", "f32", (0, 3), [])
tensor_is("/f32be", "f32", (2,), [1.25, 2])
tensor_is("/gz", "f64", (10, 100), list(range(1000)))  # chunked, gzip-compressed
tensor_is("/rule/inner/deeper/w", "f32", (2, 3), [0, 1, 2, 3, 4, 5])
tensor_is("/arr", "i64", (3,), [1, 2, 3])  # numeric attribute array: a tensor leaf
leaf_is("/mnemo_schema", "integer", "1")
leaf_is("/pyint", "integer", "7")
leaf_is("/pyfloat", "float", "0.10000000000000001")
leaf_is("/pystr", "string", "h\u00e9llo")
leaf_is("/pybytes", "string", "raw bytes")
leaf_is("/pybool", "integer", "1")
leaf_is("/npf32", "float", "0.25")
leaf_is("/npi16", "integer", "-3")
leaf_is("/npu64", "integer", str(2**40))
leaf_is("/label", "string", "relu")
leaf_is("/rule/loss", "string", "mse")
leaf_is("/rule/layers", "integer", "2")
report("groups come back as tables", got.get("/rule") == ["group"] and got.get("/rule/inner/deeper") == ["group"],
       repr({k: v for k, v in got.items() if k.startswith("/rule")}))
report("string array attribute skipped", "/strlist" not in got, repr(got.get("/strlist")))

# (b') a file mnemo cannot read: the error names the file and the dataset
path_c = os.path.join(tmp, "compound.h5")
with h5py.File(path_c, "w") as f:
    f.create_group("g").create_dataset("table", data=np.zeros(3, dtype=[("a", "f8"), ("b", "i4")]))
rc, out, err = run_mnemo(f"local ok, e = pcall(mnemo.load, {lua_str(path_c)}); print(ok, e)")
report("compound dataset: error names file and dataset",
       rc == 0 and "false" in out and "compound.h5" in out and "dataset '/g/table'" in out and "compound" in out,
       f"rc={rc} out={out!r} err={err!r}")

# (a') a round trip through both: h5py's file loaded and saved by mnemo reads the same in h5py
path_d = os.path.join(tmp, "resaved.h5")
rc, out, err = run_mnemo(f"mnemo.save({lua_str(path_d)}, mnemo.load({lua_str(path_b)})) print('ok')")
if rc == 0 and os.path.exists(path_d):
    with h5py.File(path_b, "r") as fb, h5py.File(path_d, "r") as fd:
        same = (np.array_equal(fd["f32"][()], fb["f32"][()]) and np.array_equal(fd["i32"][()], fb["i32"][()])
                and fd["i32"].dtype == np.dtype("<i8") and fd.attrs["pystr"] == "h\u00e9llo"
                and fd.attrs["pybytes"] == "raw bytes"
                and np.array_equal(fd["rule/inner/deeper/w"][()], fb["rule/inner/deeper/w"][()]))
    report("h5py file re-saved by mnemo reads the same", same)
else:
    report("h5py file re-saved by mnemo reads the same", False, f"rc={rc} err={err!r}")

shutil.rmtree(tmp, ignore_errors=True)
sys.exit(1 if failures else 0)
