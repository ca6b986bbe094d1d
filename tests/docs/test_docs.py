#!/usr/bin/env python3
"""test_docs.py: the documentation says what the code does.

- Every fenced example in docs/*.md whose info string is `lua run`, `sh run`
  or `python run` (optionally followed by `exit=N`, the status it must end
  with; 0 by default) is run, in the order it appears, in one temporary
  directory per document (so a later example can read what an earlier one
  wrote). `mnemo` and `python3` on PATH there are $MNEMO and
  /usr/bin/python3. One PASS/FAIL line per example, named file:line.
- The man page renders without warnings (groff -man -ww -z, and man -l),
  `mnemo --help` points at it, and `make install` is told to install it.
- docs/rules.md names every row of the rule table (mnemo.vocabulary()),
  docs/cli.md and the man page name every environment variable the sources
  read, and neither README.md nor docs/ points at ../shared.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = os.path.join(ROOT, "docs")
MNEMO = os.path.abspath(os.environ.get("MNEMO", os.path.join(ROOT, "mnemo")))
PYTHON = os.environ.get("PYTHON", "/usr/bin/python3")
TIMEOUT = 300

failures = 0


def report(ok, name, why=""):
    global failures
    if ok:
        print(f"PASS {name}")
    else:
        failures += 1
        print(f"FAIL {name}: {why}")


FENCE = re.compile(r"^```(\w+)\s+run(?:\s+exit=(\d+))?\s*$")


def examples(path):
    """(line, lang, expected exit, source) of each runnable block in path."""
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i + 1
        body = []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise SystemExit(f"FAIL {os.path.basename(path)}:{start}: unterminated fence")
        out.append((start, m.group(1), int(m.group(2) or 0), "\n".join(body) + "\n"))
        i += 1
    return out


def run_example(workdir, bindir, lang, src, n):
    env = dict(os.environ)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["MNEMO"] = MNEMO
    env.pop("MNEMO_CUDA_PATH", None)
    name = f"example{n}"
    if lang == "lua":
        script = os.path.join(workdir, name + ".lua")
        cmd = [MNEMO, "-q", script]
    elif lang == "sh":
        script = os.path.join(workdir, name + ".sh")
        cmd = ["sh", "-e", script]
    elif lang == "python":
        script = os.path.join(workdir, name + ".py")
        cmd = [PYTHON, script]
    else:
        return None, f"unknown language '{lang}'"
    with open(script, "w", encoding="utf-8") as f:
        f.write(src)
    try:
        p = subprocess.run(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIMEOUT} s"
    return p.returncode, p.stdout.decode("utf-8", "replace")


def check_examples():
    docs = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
    total = 0
    for doc in docs:
        exs = examples(os.path.join(DOCS, doc))
        if not exs:
            continue
        workdir = tempfile.mkdtemp(prefix="mnemo_docs_")
        bindir = os.path.join(workdir, ".bin")
        os.mkdir(bindir)
        os.symlink(MNEMO, os.path.join(bindir, "mnemo"))
        os.symlink(PYTHON, os.path.join(bindir, "python3"))
        for n, (line, lang, want, src) in enumerate(exs, 1):
            total += 1
            rc, out = run_example(workdir, bindir, lang, src, n)
            name = f"docs/{doc}:{line} ({lang})"
            if rc is None:
                report(False, name, out)
            elif rc != want:
                tail = " | ".join(out.strip().splitlines()[-6:])
                report(False, name, f"exit {rc}, expected {want}: {tail}")
            else:
                report(True, name)
        shutil.rmtree(workdir, ignore_errors=True)
    report(total >= 10, "runnable examples found", f"only {total}")


def check_man_page():
    page = os.path.join(DOCS, "mnemo.1")
    if shutil.which("groff"):
        p = subprocess.run(["groff", "-man", "-ww", "-z", page], capture_output=True, text=True)
        report(p.returncode == 0 and not p.stderr.strip(), "groff -man -ww -z docs/mnemo.1",
               p.stderr.strip() or f"exit {p.returncode}")
    else:
        print("SKIP groff -man -ww -z docs/mnemo.1: no groff")
    if shutil.which("man"):
        env = dict(os.environ, MANWIDTH="80", MAN_KEEP_STDERR="1")
        p = subprocess.run(["man", "--warnings", "-l", page], capture_output=True, text=True, env=env)
        ok = p.returncode == 0 and not p.stderr.strip() and "mnemo compare" in p.stdout
        report(ok, "man -l docs/mnemo.1", p.stderr.strip() or f"exit {p.returncode}")
    else:
        print("SKIP man -l docs/mnemo.1: no man")
    p = subprocess.run([MNEMO, "--help"], capture_output=True, text=True)
    report(p.returncode == 0 and "man mnemo" in p.stdout and "docs/mnemo.1" in p.stdout,
           "mnemo --help points at the man page", p.stdout[-200:])
    # What `make install` would do (-n: nothing is built or copied).
    dest = tempfile.mkdtemp(prefix="mnemo_docs_install_")
    p = subprocess.run(["make", "-n", "-C", ROOT, "install", "DESTDIR=" + dest, "PREFIX=/opt/mn"],
                       capture_output=True, text=True)
    want = f"docs/mnemo.1 {dest}/opt/mn/share/man/man1/mnemo.1"
    report(p.returncode == 0 and any(l.strip().startswith("install") and l.strip().endswith(want)
                                     for l in p.stdout.splitlines()),
           "make install installs the man page to $(PREFIX)/share/man/man1",
           p.stderr.strip()[-200:] or "no install of " + want)
    shutil.rmtree(dest, ignore_errors=True)


def read_doc(name):
    path = os.path.join(DOCS, name)
    if not os.path.exists(path):
        report(False, f"docs/{name} exists", "missing")
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def check_coverage():
    rules = read_doc("rules.md")
    code = ("for set, rows in pairs(mnemo.vocabulary().parts) do "
            "for _, p in ipairs(rows) do print(set .. ' ' .. p.name) end end "
            "for _, f in ipairs(mnemo.vocabulary().fields) do print('field ' .. f.name) end")
    p = subprocess.run([MNEMO, "-q", "-e", code], capture_output=True, text=True)
    rows = [l.split() for l in p.stdout.splitlines() if l.strip()]
    report(p.returncode == 0 and len(rows) > 30, "mnemo.vocabulary() lists the rule table",
           p.stderr.strip() or f"{len(rows)} rows")
    missing = []
    for kind, name in rows:
        # A part's row is documented as `name` in a table or list of rules.md,
        # a field as `name` too.
        if f"`{name}`" not in rules:
            missing.append(f"{kind} {name}")
    report(not missing, "docs/rules.md names every row of the rule table", ", ".join(missing))

    names = set()
    for sub in ("model", "dsl", "kernels", "repl"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, sub)):
            for fn in files:
                if not fn.endswith((".c", ".h", ".cu", ".cuh", ".lua")):
                    continue
                with open(os.path.join(dirpath, fn), encoding="utf-8", errors="replace") as f:
                    for m in re.finditer(r'getenv\("([A-Z_][A-Z0-9_]*)"\)', f.read()):
                        names.add(m.group(1))
    names.discard("HOME")
    cli = read_doc("cli.md")
    man = read_doc("mnemo.1")
    report(len(names) >= 3, "the sources read environment variables", f"found {sorted(names)}")
    miss = sorted(n for n in names if n not in cli)
    report(not miss, "docs/cli.md names every environment variable read", ", ".join(miss))
    miss = sorted(n for n in names if n not in man)
    report(not miss, "docs/mnemo.1 names every environment variable read", ", ".join(miss))

    bad = []
    for path in [os.path.join(ROOT, "README.md")] + [
            os.path.join(DOCS, f) for f in sorted(os.listdir(DOCS))]:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if "../shared" in line or "/work/shared" in line:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{n}")
    report(not bad, "README.md and docs/ never point at ../shared", ", ".join(bad))
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    miss = [d for d in ("docs/rules.md", "docs/gradients.md", "docs/files.md", "docs/cli.md", "docs/design.md")
            if d not in readme]
    report(not miss, "README.md links every document of docs/", ", ".join(miss))


def main():
    if not os.access(MNEMO, os.X_OK):
        print(f"FAIL docs: no executable mnemo at {MNEMO} (build first)")
        return 1
    check_man_page()
    check_coverage()
    check_examples()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
