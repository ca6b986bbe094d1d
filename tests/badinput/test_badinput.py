"""test_badinput: a catalogue of bad input, each case stating the exit status
and the one-line message it expects from ./mnemo ($MNEMO).

Every case builds its input (HDF5 files made with h5py, raw bytes, Lua
chunks) in a temporary folder, runs the binary, and prints PASS or FAIL.
A case passes when the exit status is the one stated, one line of stderr
holds the stated substring, and no sanitizer reported anything. A crash
(a signal, or an exit status of 128 or more) always fails, whatever was
expected. Exit statuses: `mnemo run` gives 2 for bad usage or bad input
(SPEC section 6); a Lua chunk that raises gives 1.

    python3 tests/badinput/test_badinput.py        (MNEMO=path/to/mnemo)
"""

import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

B, H, T, DK, DV = 1, 2, 8, 4, 4
TIMEOUT = 120
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                   "UndefinedBehaviorSanitizer")

failures = 0


def report(name, ok, detail=""):
    global failures
    if ok:
        print("PASS badinput: %s" % name)
    else:
        failures += 1
        print("FAIL badinput: %s: %s" % (name, detail))


# --------------------------------------------------------------- the files

def write_base(path, layers=1):
    """A small experiment that runs: the starting point of every variant."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.attrs["mnemo_schema"] = 1
        r = f.create_group("rule")
        r.attrs["layers"] = layers
        r.attrs["loss"] = "mse"
        i = f.create_group("inputs")
        for n in "kvq":
            i.create_dataset(n, data=rng.standard_normal((B, H, T, DK)).astype(np.float32))
        g = f.create_group("gates")
        g.create_dataset("theta", data=np.float32(0.1))
        g.create_dataset("eta", data=np.float32(0.9))
        g.create_dataset("alpha", data=np.float32(0.01))
        it = f.create_group("init")
        if layers == 1:
            it.create_dataset("W1", data=np.zeros((DK, DV), np.float32))
        else:
            it.create_dataset("W1", data=(0.1 * rng.standard_normal((DK, 8))).astype(np.float32))
            it.create_dataset("W2", data=(0.1 * rng.standard_normal((8, DV))).astype(np.float32))
    return path


def replace(group, name, data, **kw):
    if name in group:
        del group[name]
    return group.create_dataset(name, data=data, **kw)


def attr(name, value):
    def edit(f):
        f["rule"].attrs[name] = value
    return edit


def attrs(**values):
    def edit(f):
        for k, v in values.items():
            f["rule"].attrs[k] = v
    return edit


def dataset(path, data, **kw):
    group, name = path.rsplit("/", 1)

    def edit(f):
        replace(f[group], name, data, **kw)
    return edit


def delete(path):
    def edit(f):
        del f[path]
    return edit


def chain(*edits):
    def edit(f):
        for e in edits:
            e(f)
    return edit


def huge_k(f):
    """/inputs/k declared with 2^31 tokens and nothing written: reading it
    would need 64 GiB."""
    del f["inputs/k"]
    f["inputs"].create_dataset("k", shape=(B, H, 2 ** 31, DK), dtype=np.float32, chunks=(1, 1, 1024, DK))


def not_a_group(name):
    def edit(f):
        del f[name]
        f.create_dataset(name, data=np.zeros(3, np.float32))
    return edit


def root_attr(name, value):
    def edit(f):
        if value is None:
            del f.attrs[name]
        else:
            f.attrs[name] = value
    return edit


# ------------------------------------------------------------- the catalogue

F32 = np.float32
SHAPE = (B, H, T, DK)

# (name, edit of the base file, expected exit status, message substring)
FILE_CASES = [
    # the file itself and its root
    ("schema attribute missing", root_attr("mnemo_schema", None), 2, "mnemo_schema is missing"),
    ("schema 2", root_attr("mnemo_schema", 2), 2, "mnemo_schema"),
    ("schema a string", root_attr("mnemo_schema", "one"), 2, "mnemo_schema"),
    ("schema NaN", root_attr("mnemo_schema", np.nan), 2, "mnemo_schema"),
    ("schema an array", root_attr("mnemo_schema", np.array([1, 1])), 2, "mnemo_schema"),
    ("/rule missing", delete("rule"), 2, "/rule"),
    ("/rule a dataset", not_a_group("rule"), 2, "/rule"),
    ("/inputs missing", delete("inputs"), 2, "/inputs"),
    ("/inputs a dataset", not_a_group("inputs"), 2, "/inputs"),
    ("/gates missing", delete("gates"), 2, "/gates"),
    ("/init missing", delete("init"), 2, "initial weight W1 is missing"),
    # inputs: dtypes, ranks, sizes
    ("k missing", delete("inputs/k"), 2, "dataset /inputs/k is missing"),
    ("v missing", delete("inputs/v"), 2, "dataset /inputs/v is missing"),
    ("k float64 is converted", dataset("inputs/k", np.zeros(SHAPE, np.float64)), 0, ""),
    ("k int32", dataset("inputs/k", np.zeros(SHAPE, np.int32)), 2, "dataset /inputs/k must hold floats"),
    ("k float16 is converted", dataset("inputs/k", np.zeros(SHAPE, np.float16)), 0, ""),
    ("k strings", dataset("inputs/k", np.array([b"a", b"b"])), 2, "/inputs/k"),
    ("k compound", dataset("inputs/k", np.zeros(4, dtype=[("a", F32), ("b", F32)])), 2, "/inputs/k"),
    ("k big-endian float32 is converted", dataset("inputs/k", np.zeros(SHAPE, ">f4")), 0, ""),
    ("k scalar", dataset("inputs/k", F32(1)), 2, "dataset /inputs/k must be [B,H,T,dk], got scalar"),
    ("k rank 3", dataset("inputs/k", np.zeros((H, T, DK), F32)), 2, "dataset /inputs/k must be [B,H,T,dk], got 2x8x4"),
    ("k rank 5", dataset("inputs/k", np.zeros((1,) + SHAPE, F32)), 2, "/inputs/k"),
    ("k zero tokens runs (empty outputs)", chain(dataset("inputs/k", np.zeros((B, H, 0, DK), F32)),
                            dataset("inputs/v", np.zeros((B, H, 0, DK), F32)),
                            dataset("inputs/q", np.zeros((B, H, 0, DK), F32))), 0, ""),
    ("k zero width", dataset("inputs/k", np.zeros((B, H, T, 0), F32)), 2, "initial W1 has shape 4x4; expected 4x0"),
    ("k zero batch runs (empty outputs)", chain(dataset("inputs/k", np.zeros((0, H, T, DK), F32)),
                           dataset("inputs/v", np.zeros((0, H, T, DK), F32)),
                           dataset("inputs/q", np.zeros((0, H, T, DK), F32))), 0, ""),
    ("k of 2^31 tokens declared", huge_k, 2, "dataset '/inputs/k': out of memory allocating 68719476736 bytes"),
    ("v tokens differ from k", dataset("inputs/v", np.zeros((B, H, T + 1, DK), F32)), 2, "v has shape 1x2x9x4; expected 1x2x8x4"),
    ("q width differs from k", dataset("inputs/q", np.zeros((B, H, T, DK + 1), F32)), 2, "q has shape 1x2x8x5; expected 1x2x8x4"),
    ("k a group", chain(delete("inputs/k"), lambda f: f["inputs"].create_group("k")), 2, "/inputs/k must be a dataset"),
    ("k NaN runs", dataset("inputs/k", np.full(SHAPE, np.nan, F32)), 0, ""),
    # lengths (SPEC v2, ragged batches): [B] integers 0..T
    ("lengths int64 runs", dataset("inputs/lengths", np.array([5], np.int64)), 0, ""),
    ("lengths whole floats run", dataset("inputs/lengths", np.array([8.0], F32)), 0, ""),
    ("lengths of the wrong count", dataset("inputs/lengths", np.array([3, 4], np.int64)), 2,
     "/inputs/lengths has shape [2]; expected [B] = [1]"),
    ("lengths not whole", dataset("inputs/lengths", np.array([2.5], F32)), 2,
     "lengths: sequence 1 of 1 has length 2.5; each must be an integer from 0 to T = 8"),
    ("lengths longer than T", dataset("inputs/lengths", np.array([9], np.int64)), 2, "from 0 to T = 8"),
    ("lengths negative", dataset("inputs/lengths", np.array([-1], np.int64)), 2, "has length -1"),
    ("lengths NaN", dataset("inputs/lengths", np.array([np.nan], F32)), 2, "has length nan"),
    ("lengths a group", lambda f: f["inputs"].create_group("lengths"), 2, "/inputs/lengths must be a dataset"),
    ("precondition unknown", attr("precondition", "muon"), 2, "newton_schulz"),
    ("ns_steps 0", attr("ns_steps", 0), 2, "ns_steps must be between 1 and 100"),
    # gates
    ("theta missing", delete("gates/theta"), 2, "theta"),
    ("theta does not broadcast", dataset("gates/theta", np.ones(999, F32)), 2, "gate theta of shape 999"),
    ("theta rank 5", dataset("gates/theta", np.ones((1, 1, 1, 1, 1), F32)), 2, "theta"),
    ("theta float64 is converted", dataset("gates/theta", np.float64(0.1)), 0, ""),
    ("theta a string", dataset("gates/theta", b"fast"), 2, "theta"),
    ("eta zero-sized", dataset("gates/eta", np.zeros(0, F32)), 2, "eta"),
    # init
    ("W1 missing", delete("init/W1"), 2, "W1"),
    ("W1 the wrong shape", dataset("init/W1", np.ones((3, 99), F32)), 2, "initial W1 has shape 3x99"),
    ("W1 rank 1", dataset("init/W1", np.ones(DK * DV, F32)), 2, "W1"),
    ("W1 int64", dataset("init/W1", np.zeros((DK, DV), np.int64)), 2, "W1"),
    ("W1 zero-sized", dataset("init/W1", np.zeros((0, DV), F32)), 2, "W1"),
    ("W2 without layers = 2", dataset("init/W2", np.zeros((DV, DV), F32)), 2, "dataset /init/W2 is not a parameter of this rule"),
    # rule attributes: types, ranges, NaN
    ("unknown attribute", attr("thetaa", 1), 2, "unknown attribute 'thetaa'"),
    ("layers a string", attr("layers", "two"), 2, "layers"),
    ("layers 0", attr("layers", 0), 2, "layers"),
    ("layers -1", attr("layers", -1), 2, "layers"),
    ("layers 1.5", attr("layers", 1.5), 2, "layers"),
    ("layers 1e12", attr("layers", 1e12), 2, "layers"),
    ("layers NaN", attr("layers", np.nan), 2, "layers"),
    ("layers an array", attr("layers", np.array([1, 2])), 2, "layers"),
    ("residual 2 (a flag is 0 or 1)", attr("residual", 2), 2, "/rule: attribute 'residual' must be 0 or 1 (false or true), got 2"),
    ("step 0", attr("step", 0), 2, "step"),
    ("step -3", attr("step", -3), 2, "step"),
    ("step 2^40", attr("step", 2 ** 40), 2, "step"),
    ("refresh not a multiple of step", attrs(step=4, refresh=6), 2, "refresh 6 is not 0 or a multiple of step 4"),
    ("clip_max NaN", attrs(clip="norm", clip_max=np.nan), 2, "clip_max"),
    ("clip_max Inf", attrs(clip="norm", clip_max=np.inf), 2, "clip_max"),
    ("clip_max negative", attrs(clip="norm", clip_max=-1.0), 2, "clip_max"),
    ("clip_max a string", attrs(clip="norm", clip_max="big"), 2, "clip_max"),
    ("loss_delta NaN", attrs(loss="huber", loss_delta=np.nan), 2, "loss_delta"),
    ("loss_p NaN", attrs(loss="lp", loss_p=np.nan), 2, "loss_p"),
    ("loss_p -Inf", attrs(loss="lp", loss_p=-np.inf), 2, "loss_p"),
    ("loss a number", attr("loss", 5), 2, "loss"),
    ("loss unknown", attr("loss", "hubr"), 2, "unknown loss 'hubr' (one of: mse"),
    ("loss empty", attr("loss", ""), 2, "loss"),
    ("loss not UTF-8", attr("loss", np.bytes_(b"\xff\xfe")), 2, "loss"),
    ("activation unknown", attr("activation", "swish"), 2, "activation"),
    ("clip unknown", attr("clip", "hard"), 2, "unknown clip 'hard' (one of:"),
    ("retrieve unknown", attr("retrieve", "sideways"), 2, "retrieve"),
    ("custom loss without loss_expr", attr("loss", "custom"), 2, "loss_expr"),
    ("loss_expr syntax", attrs(loss="custom", loss_expr="abs(r) $ 2"), 2, "position 8"),
    ("loss_expr unknown name", attrs(loss="custom", loss_expr="abs(q - v)"), 2, "unknown name 'q'"),
    ("loss_expr 300000 terms", attrs(loss="custom", loss_expr="r" + "+r" * 300000), 2, "nested too deeply"),
    ("loss_expr 300 parentheses", attrs(loss="custom", loss_expr="(" * 300 + "r" + ")" * 300), 2,
     "nested too deeply"),
    ("loss_expr a number", attrs(loss="custom", loss_expr=3.0), 2, "loss_expr"),
    ("loss_expr control bytes", attrs(loss="custom", loss_expr="r\x01"), 2, "loss_expr"),
    ("hidden -3 with 2 layers", attrs(layers=2, hidden=-3), 2, "hidden"),
    # glu (SPEC v2): gates of the hidden layers
    ("glu with layers 1", attr("glu", 1), 2, "glu gates the hidden layers and needs layers >= 2"),
    ("glu a string", attrs(layers=2, glu="yes"), 2, "glu"),
    ("glu without /init/U1", chain(attrs(layers=2, glu=1), dataset("init/W2", np.zeros((DV, DV), F32))), 2,
     "initial weight U1 is missing"),
    ("U1 the wrong shape", chain(attrs(layers=2, glu=1), dataset("init/W2", np.zeros((DV, DV), F32)),
                                 dataset("init/U1", np.ones((3, 99), F32))), 2, "initial U1 has shape 3x99"),
    ("U1 without glu", chain(attrs(layers=2), dataset("init/W2", np.zeros((DV, DV), F32)),
                             dataset("init/U1", np.zeros((DV, DK), F32))), 2,
     "dataset /init/U1 is not a parameter of this rule"),
]


# (name, argv after the binary built from the work folder, status, substring)
def cli_cases(work, base, out):
    def raw(name, data):
        p = os.path.join(work, name)
        with open(p, "wb") as fh:
            fh.write(data)
        return p

    good = open(base, "rb").read()
    rng = np.random.default_rng(1)
    link = os.path.join(work, "link.h5")
    os.symlink(base, link)
    hard = os.path.join(work, "hard.h5")
    os.link(base, hard)
    return [
        ("missing file", ["run", os.path.join(work, "nope.h5"), "-o", out], 2, "nope.h5"),
        ("empty file", ["run", raw("empty.h5", b""), "-o", out], 2, "empty.h5"),
        ("random bytes", ["run", raw("random.h5", rng.bytes(4096)), "-o", out], 2, "random.h5"),
        ("a text file", ["run", raw("text.h5", b"hello\n" * 100), "-o", out], 2, "text.h5"),
        ("truncated to half", ["run", raw("half.h5", good[: len(good) // 2]), "-o", out], 2, "half.h5"),
        ("truncated to 800 bytes", ["run", raw("short.h5", good[:800]), "-o", out], 2, "short.h5"),
        ("HDF5 signature then zeros", ["run", raw("sig.h5", good[:8] + bytes(4088)), "-o", out], 2, "sig.h5"),
        ("bytes flipped in the middle", ["run", raw("flip.h5", good[:2000] + bytes(b ^ 0xFF for b in good[2000:2600]) + good[2600:]),
                                         "-o", out], 2, "flip.h5"),
        ("a folder", ["run", work, "-o", out], 2, work),
        ("-o the experiment itself", ["run", base, "-o", base], 2, "is the experiment file"),
        ("-o the experiment through ./", ["run", base, "-o", os.path.join(work, ".", "base.h5")], 2,
         "is the experiment file"),
        ("-o the experiment through a symbolic link", ["run", link, "-o", base], 2, "is the experiment file"),
        ("-o the experiment through a hard link", ["run", base, "-o", hard], 2, "is the experiment file"),
        ("-o in a missing folder", ["run", base, "-o", os.path.join(work, "no", "dir", "r.h5")], 2, "no/dir"),
        ("-o a folder", ["run", base, "-o", work], 2, work),
        ("missing -o", ["run", base], 2, "missing -o"),
        ("-o without a name", ["run", base, "-o"], 2, "-o needs a file name"),
        ("unknown option", ["run", base, "-o", out, "--fast"], 2, "unknown option --fast"),
        ("bad device", ["run", base, "-o", out, "--device", "tpu"], 2, "--device must be cpu or cuda"),
        ("precision on the cpu", ["run", base, "-o", out, "--precision", "tf32"], 2, "fp32 only"),
        ("compare random bytes", ["compare", raw("random2.h5", rng.bytes(2048)), base], 2, "random2.h5"),
        # Lua: a raised error exits 1 with the message on the first line
        ("Lua: loss of 300000 terms", ["-e", 'mnemo.rule{loss = "r" .. string.rep("+r", 300000), theta = 0.1}'], 1,
         "nested too deeply (over 1000 levels"),
        ("Lua: an Expr chain of 5000", ["-e", 'local e = mnemo.var("r"); for i = 1, 5000 do e = e + 1 end'], 1,
         "nested too deeply: 1001 levels, the limit is 1000"),
        ("Lua: nested calls of 5000", ["-e", 'local e = mnemo.var("r"); for i = 1, 5000 do e = mnemo.tanh(e) end'], 1,
         "nested too deeply"),
        ("Lua: e = e * e forty times (shared, 2^41 nodes)",
         ["-e", 'local e = mnemo.var("r"); for i = 1, 40 do e = e * e end; print(e)'], 1,
         "expression too large: over 20000 nodes"),
        ("Lua: a string of 30000 terms", ["-e", 'mnemo.rule{loss = "(r" .. string.rep("+r", 30000) .. ")", theta = 0.1}'], 1,
         "nested too deeply"),
        ("Lua: a wide string of 30000 nodes", ["-e", 'mnemo.rule{loss = string.rep("(r" .. string.rep("+r", 499) .. ")", 30, "*"), theta = 0.1}'],
         1, "too large (over 20000 nodes)"),
        ("Lua: theta NaN is a gate value, data", ["-e", "mnemo.rule{theta = 0/0}"], 0, ""),
        ("Lua: clip_max NaN", ["-e", "mnemo.rule{clip = 'norm', clip_max = 0/0}"], 1, "clip_max"),
        ("Lua: loss a table", ["-e", "mnemo.rule{loss = {}}"], 1, "loss"),
        ("Lua: layers a string", ["-e", "mnemo.rule{layers = 'two'}"], 1, "layers"),
        ("Lua: run with k of rank 2 runs (one batch, one head)", ["-e", "mnemo.rule{theta = 0.1}:run{k = mnemo.randn(3, 4), v = mnemo.randn(3, 4)}"],
         0, ""),
        ("Lua: run with v unlike k", ["-e", "mnemo.rule{theta = 0.1}:run{k = mnemo.randn(1, 1, 4, 4), v = mnemo.randn(1, 1, 5, 4)}"],
         1, "v has shape 1x1x5x4; expected 1x1x4x4"),
        ("Lua: run with k a number", ["-e", "mnemo.rule{theta = 0.1}:run{k = 3, v = 4}"], 1, "input 'k' must be a tensor, got number"),
        ("Lua: run with zero tokens runs (empty outputs)",
         ["-e", "mnemo.rule{theta = 0.1}:run{k = mnemo.zeros(1, 1, 0, 4), v = mnemo.zeros(1, 1, 0, 4)}"], 0, ""),
        ("Lua: memory write of the wrong width", ["-e", "local m = mnemo.rule{theta = 0.1}:memory{B = 1, H = 1, dk = 4}; "
                                                  "m:write(mnemo.randn(1, 1, 2, 5), mnemo.randn(1, 1, 2, 4))"], 1,
         "k has shape 1x1x2x5; the memory expects 1x1xTx4"),
        ("Lua: identity of 2^62 x 0 (its strides overflowed)", ["-e", "mnemo.eye(2^62, 0)"], 1, "eye: empty: shape too large"),
        ("Lua: save tables nested 200000 deep (overflowed the C stack)",
         ["-e", 'local t = {} local c = t for i = 1, 200000 do c.a = {} c = c.a end mnemo.save("deep.h5", t)'], 1,
         "mnemo.save: tables nest more than 128 deep"),
        ("Lua: bias = 2 (a flag is true or false, 0 or 1)", ["-e", "mnemo.rule{layers = 2, bias = 2}"], 1,
         "field 'bias' must be 0 or 1 (false or true), got 2"),
        ("Lua: a NaN constant", ["-e", "mnemo.rule{loss = 'c * r^2', constants = {c = 0/0}}"], 1, "constant 'c' is NaN"),
        ("Lua: ragged tensor", ["-e", "mnemo.tensor({{1, 2}, {3}})"], 1, "ragged nested table"),
        ("Lua: negative size", ["-e", "mnemo.zeros(-1, 3)"], 1, "size must be a non-negative integer, got -1"),
        ("Lua: huge size", ["-e", "mnemo.zeros(1e9, 1e9)"], 1, "zeros: out of memory"),
        ("Lua: matmul shapes", ["-e", "mnemo.matmul(mnemo.randn(2, 3), mnemo.randn(4, 5))"], 1, "matmul: inner sizes differ: 2x3 @ 4x5"),
        ("Lua: load_experiment of random bytes", ["-e", "mnemo.load_experiment(%r)" % raw("random3.h5", rng.bytes(1000))],
         1, "random3.h5"),
        ("Lua: load_experiment of a truncated file", ["-e", "mnemo.load_experiment(%r)" % raw("half2.h5", good[: len(good) // 2])],
         1, "half2.h5"),
    ]


# ------------------------------------------------------------------ running

def run_case(binary, name, argv, want_rc, needle):
    try:
        p = subprocess.run([binary] + argv, capture_output=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        report(name, False, "no answer in %d s" % TIMEOUT)
        return
    err = p.stderr.decode("utf-8", "replace")
    rc = p.returncode
    lines = [l for l in err.splitlines() if l.strip()]
    if rc < 0 or rc >= 128:
        report(name, False, "crashed (status %d): %s" % (rc, " | ".join(lines[-3:])[:300]))
    elif any(m in err for m in SANITIZER_MARKS):
        report(name, False, "a sanitizer reported: %s" % " | ".join(l for l in lines if "ERROR" in l or "runtime error" in l)[:300])
    elif rc != want_rc:
        report(name, False, "exit %d, expected %d; stderr: %s" % (rc, want_rc, err.strip()[:300]))
    elif needle and not any(needle in l for l in lines):
        report(name, False, "no line of stderr holds %r; stderr: %s" % (needle, err.strip()[:300]))
    else:
        report(name, True)
    if os.environ.get("BADINPUT_SHOW"):
        print("#   %s -> %d: %s" % (name, rc, lines[0][:200] if lines else ""))


def main():
    binary = os.environ.get("MNEMO", os.path.join(os.getcwd(), "mnemo"))
    if not os.path.exists(binary):
        print("SKIP badinput: no mnemo binary at %s" % binary)
        return 0
    work = tempfile.mkdtemp(prefix="mnemo-badinput-")
    try:
        base = write_base(os.path.join(work, "base.h5"))
        out = os.path.join(work, "res.h5")
        ncases = 0
        for i, (name, edit, want_rc, needle) in enumerate(FILE_CASES):
            path = os.path.join(work, "case%03d.h5" % i)
            shutil.copy(base, path)
            with h5py.File(path, "r+") as f:
                edit(f)
            run_case(binary, "file: " + name, ["run", path, "-o", out], want_rc, needle)
            os.unlink(path)
            ncases += 1
        before = open(base, "rb").read()
        for name, argv, want_rc, needle in cli_cases(work, base, out):
            run_case(binary, name, argv, want_rc, needle)
            ncases += 1
        # A file whose damage crashes libhdf5 itself (h5dump and h5py too):
        # mnemo names it and exits 2. Under AddressSanitizer the overlapping
        # memcpy inside the library is reported before it can crash, so the
        # sanitizer stage leaves this one case to the plain build.
        upstream = os.path.join(HERE, "..", "fuzz", "upstream")
        for fname, what, needle in (
                ("hdf5_crash_global_heap.h5", "libhdf5 1.10 segfaults reading it",
                 "attribute 'loss' of group '/rule': the HDF5 library crashed reading it (a damaged file)"),
                ("hdf5_abort_global_heap.h5", "libhdf5 1.10 damages the heap, glibc aborts",
                 "the HDF5 library crashed reading it (a damaged file)")):
            name = "file: damaged global heap (%s)" % what
            if "ASAN_OPTIONS" in os.environ:
                print("SKIP badinput: %s: AddressSanitizer reports the library's own memcpy first" % name)
                continue
            run_case(binary, name, ["run", os.path.join(upstream, fname), "-o", out], 2, needle)
            ncases += 1
        report("the experiment file is intact after every case", open(base, "rb").read() == before)
        print("# %d cases, %d failed" % (ncases, failures))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
