#!/usr/bin/python3
"""test_repl.py: the interactive REPL, driven through a pseudo-terminal as a
user would drive it: results, multi-line chunks, errors, Ctrl-C (while a
chunk runs and at the prompt), history across sessions, tab completion,
help() and who(). Prints PASS/FAIL/SKIP lines for tests/run.sh.
The binary is $MNEMO (default ./mnemo); everything SKIPs without it."""
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MNEMO = os.path.abspath(os.environ.get("MNEMO", "./mnemo"))
PROMPT = b"mnemo> "
TIMEOUT = 10.0  # per wait; generous for slow CI machines
failures = 0


def report(ok, name, detail=""):
    global failures
    if ok:
        print("PASS " + name)
    else:
        failures += 1
        print("FAIL %s: %s" % (name, detail))
    sys.stdout.flush()


def show(b):
    """Printable tail of terminal output for a FAIL line."""
    return repr(b[-300:].decode("utf-8", "replace"))


class Repl:
    """One mnemo session on a pty; `out` holds everything it printed."""

    def __init__(self, env, args=()):
        pid, fd = pty.fork()
        if pid == 0:  # child: the pty is stdin, stdout, stderr and controlling tty
            try:
                os.execve(MNEMO, [MNEMO] + list(args), env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.out, self.mark = pid, fd, b"", 0
        self.status = None

    def _read(self, until):
        r, _, _ = select.select([self.fd], [], [], max(0.0, until - time.time()))
        if not r:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        if not data:
            return None
        self.out += data
        return True

    def expect(self, pattern, timeout=TIMEOUT):
        """Wait until the output since the mark matches pattern (bytes regex);
        move the mark past the match. Returns the match or None."""
        rx = re.compile(pattern, re.S)
        until = time.time() + timeout
        while True:
            m = rx.search(self.out, self.mark)
            if m:
                self.mark = m.end()
                return m
            got = self._read(until)
            if not got:  # timeout or end of output
                return None

    def prompt(self, timeout=TIMEOUT):
        return self.expect(re.escape(PROMPT), timeout)

    def send(self, data):
        if isinstance(data, str):
            data = data.encode()
        os.write(self.fd, data)

    def line(self, text):
        """Type a line and wait for the next prompt; returns the output in
        between (the echo included), or None on timeout."""
        start = len(self.out)
        self.mark = start
        self.send(text + "\r")
        m = self.prompt()
        return self.out[start:m.start()] if m else None

    def keys(self, data, pattern):
        """Send keystrokes (which may redraw the prompt) and wait for pattern
        in what follows, then for the prompt after it. Returns the output
        from the keystrokes to that prompt, or None when pattern never came."""
        start = len(self.out)
        self.mark = start
        self.send(data)
        if self.expect(pattern) is None:
            return None
        m = self.prompt()
        return self.out[start:m.start() if m else len(self.out)]

    def close(self, timeout=TIMEOUT):
        """Ctrl-D, then wait for the exit (kill it after timeout)."""
        try:
            self.send(b"\x04")
        except OSError:
            pass
        until = time.time() + timeout
        while time.time() < until:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
                break
            self._read(time.time() + 0.1)
        else:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        try:
            while self._read(time.time() + 0.2):
                pass
        except OSError:
            pass
        os.close(self.fd)
        return self.status is not None and os.WIFEXITED(self.status) and \
            os.WEXITSTATUS(self.status) == 0


def lines_of(b):
    return [l.strip() for l in b.replace(b"\r", b"").split(b"\n")]


def main():
    if not os.access(MNEMO, os.X_OK):
        print("SKIP repl: no binary at %s (set MNEMO)" % MNEMO)
        return 0
    tmp = tempfile.mkdtemp(prefix="mnemo-repl-")
    hist = os.path.join(tmp, "history")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TERM": "dumb",
           "INPUTRC": "/dev/null", "MNEMO_HISTORY": hist, "LANG": "C.UTF-8"}
    try:
        session_one(env)
        session_history(env, hist)
        session_completion(env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failures else 0


def session_one(env):
    r = Repl(env)
    m = r.prompt()
    report(m is not None and b"help() for a tour" in r.out, "banner and prompt", show(r.out))
    if m is None:
        r.close()
        return

    out = r.line("1+1")
    report(out is not None and b"2" in lines_of(out), "expression result 1+1", show(out or r.out))

    # The summary line the REPL shows must be the tensor's own text.
    want = subprocess.run([MNEMO, "-e", "io.write(tostring(mnemo.zeros(2,2)))"],
                          capture_output=True, timeout=30).stdout.splitlines()
    out = r.line("mnemo.zeros(2,2)")
    report(out is not None and want and want[-1].strip() in lines_of(out),
           "tensor result shows its summary", "want %r in %s" % (want[-1:] , show(out or r.out)))

    out = r.line("nil")
    report(out is not None and lines_of(out)[1:] in ([], [b""]), "nil prints nothing",
           show(out or r.out))

    out = r.line("{b = 2, a = {1, 'x'}}")
    report(out is not None and b'{a = {1, "x"}, b = 2}' in out, "table pretty-printed",
           show(out or r.out))

    # multi-line: continuation prompts, then the loop runs
    r.mark = len(r.out)
    r.send("for i = 1, 3 do\r")
    ok = r.expect(re.escape(b">> ")) is not None
    r.send("print('row' .. i * 10)\r")
    ok = ok and r.expect(re.escape(b">> ")) is not None
    start = len(r.out)
    r.send("end\r")
    m = r.prompt()
    out = r.out[start:m.start()] if m else r.out[start:]
    report(ok and m is not None and b"row10" in out and b"row30" in out, "multi-line for loop",
           show(r.out))

    r.mark = len(r.out)
    r.send("function twice(x)\r")
    r.expect(re.escape(b">> "))
    r.send("  return 2 * x\r")
    r.expect(re.escape(b">> "))
    r.send("end\r")
    r.prompt()
    out = r.line("twice(21)")
    report(out is not None and b"42" in lines_of(out), "multi-line function definition",
           show(out or r.out))

    out = r.line("error('boom here')")
    report(out is not None and b"boom here" in out and b"stack traceback" in out,
           "error shows message and traceback", show(out or r.out))
    out = r.line("2+3")
    report(out is not None and b"5" in lines_of(out), "session goes on after an error",
           show(out or r.out))

    r.mark = len(r.out)
    r.send("x = \r")
    ok = r.expect(re.escape(b">> ")) is not None
    r.send("7\r")
    ok = ok and r.prompt() is not None
    out = r.line("x")
    report(ok and out is not None and b"7" in lines_of(out), "unfinished statement continues",
           show(out or r.out))

    # Ctrl-C while a chunk runs
    start = len(r.out)
    r.mark = start
    r.send("while true do end\r")
    time.sleep(0.5)
    r.send(b"\x03")
    m = r.prompt()
    out = r.out[start:m.start()] if m else r.out[start:]
    report(m is not None and b"interrupted" in out, "Ctrl-C interrupts a running loop",
           show(r.out))
    out = r.line("40+2")
    report(out is not None and b"42" in lines_of(out), "prompt works after Ctrl-C",
           show(out or r.out))

    # Ctrl-C inside a long C loop of the engine (a batched i64 matmul that
    # polls mn_interrupt_requested between batches; seconds uninterrupted)
    r.line("a = mnemo.ones({200, 300, 300}, 'i64')")
    start = len(r.out)
    r.mark = start
    r.send("b = a:matmul(a)\r")
    time.sleep(0.3)
    t0 = time.time()
    r.send(b"\x03")
    m = r.prompt()
    took = time.time() - t0
    out = r.out[start:m.start()] if m else r.out[start:]
    report(m is not None and b"interrupted" in out and took < 1.0,
           "Ctrl-C stops a long C loop", "%.2f s; %s" % (took, show(r.out)))
    out = r.line("a, b = nil; collectgarbage(); print(1+2)")
    report(out is not None and b"3" in lines_of(out), "prompt works after a stopped C loop",
           show(out or r.out))

    # Ctrl-C while typing: the line is dropped, a fresh prompt comes
    r.mark = len(r.out)
    r.send("half a line")
    time.sleep(0.3)
    r.send(b"\x03")
    m = r.prompt()
    out = r.line("6*7")
    report(m is not None and out is not None and b"42" in lines_of(out),
           "Ctrl-C at the prompt clears the line", show(r.out))

    # Ctrl-C in a continuation drops the whole unfinished chunk
    r.mark = len(r.out)
    r.send("for i = 1, 2 do\r")
    r.expect(re.escape(b">> "))
    r.send(b"\x03")
    m = r.prompt()
    out = r.line("'fresh'")
    report(m is not None and out is not None and b"fresh" in lines_of(out),
           "Ctrl-C drops an unfinished chunk", show(r.out))

    out = r.line("help()")
    report(out is not None and b"lab bench" in out and b"mnemo.zeros" in out,
           "help() prints the tour", show(out or r.out))
    out = r.line("help(mnemo.zeros)")
    report(out is not None and b"mnemo.zeros(" in out and b"zeros" in out.split(b"\n", 2)[-1],
           "help(mnemo.zeros) prints its description", show(out or r.out))
    out = r.line("help('Tensor:sum')")
    report(out is not None and b"sum" in out and b"no help" not in out, "help by method name",
           show(out or r.out))
    out = r.line("help('zeroes')")
    report(out is not None and b"no help for zeroes" in out and b"mnemo.zeros" in out,
           "help on an unknown name suggests close ones", show(out or r.out))

    r.line("w = mnemo.zeros(3, 4)")
    out = r.line("who()")
    report(out is not None and re.search(rb"\bw\s+3x4\s+f32\s+cpu\s+48 B", out) is not None,
           "who() lists a global tensor", show(out or r.out))

    report(r.close(), "Ctrl-D exits with status 0", "status %r" % (r.status,))


def session_history(env, hist):
    if os.path.exists(hist):
        os.remove(hist)
    r = Repl(env)
    ok = r.prompt() is not None
    r.mark = len(r.out)
    r.send("for i = 1, 2 do\r")
    r.expect(re.escape(b">> "))
    r.send("print('loop' .. i)\r")
    r.expect(re.escape(b">> "))
    r.send("end\r")
    ok = ok and r.prompt() is not None
    ok = ok and r.line("'hist' .. 'ory'") is not None
    ok = ok and r.line("'hist' .. 'ory'") is not None  # a repeat is not stored twice
    r.close()
    text = open(hist, encoding="utf-8", errors="replace").read() if os.path.exists(hist) else ""
    report(ok and "'hist' .. 'ory'" in text and "print('loop' .. i)" in text,
           "history file holds the session's lines", repr(text[-300:]))
    report(text.count("'hist' .. 'ory'") == 1, "repeated line stored once", repr(text[-300:]))

    r = Repl(env)
    r.prompt()
    out = r.keys(b"\x1b[A\r", rb"\r\nhistory\r\n")
    report(out is not None, "up-arrow recalls the previous line", show(r.out))
    # two entries back (the repeat above is one entry): the whole loop, as one
    out = r.keys(b"\x1b[A\x1b[A\r", rb"\r\nloop1\r\nloop2\r\n")
    report(out is not None, "a multi-line chunk comes back as one entry", show(r.out))
    r.close()

    # the file keeps the newest 1000 entries
    with open(hist, "a") as f:
        for i in range(1005):
            f.write("#%d\nfiller_%d = %d\n" % (1700000000 + i, i, i))
    r = Repl(env)
    r.prompt()
    r.line("'hist' .. 'ory'")
    r.close()
    text = open(hist, encoding="utf-8", errors="replace").read()
    entries = len(re.findall(r"^#\d+$", text, re.M))
    report(entries == 1000 and "filler_1004" in text and "filler_3 " not in text and
           text.rstrip().endswith("'hist' .. 'ory'"), "history file capped at 1000 entries",
           "%d entries" % entries)


def session_completion(env):
    r = Repl(env)
    r.prompt()
    out = r.keys("mnemo.zer\t(2, 5)\r", rb"2x5")
    report(out is not None and b"mnemo.zeros(2, 5)" in out,
           "Tab completes mnemo.zer to mnemo.zeros", show(r.out))

    r.line("t = mnemo.zeros(2)")
    out = r.keys("t:nume\t()\r", rb"\r\n2\r\n")
    report(out is not None and b"t:numel()" in out, "Tab completes t:nume to t:numel",
           show(r.out))

    out = r.keys("t.sh\t\r", rb"\r\n\{2\}\r\n")
    report(out is not None, "Tab completes tensor fields (t.sh -> t.shape)", show(r.out))

    # "su" is ambiguous (sub, sum): a second Tab lists both, by their short names
    start = len(r.out)
    r.mark = start
    r.send("t:su\t\t")
    listed = r.expect(rb"\r\nsub +sum *\r\n", timeout=5) is not None
    out = r.keys("m()\r", rb"\r\n0\.0\r\n")
    report(listed and out is not None, "double Tab lists the methods sub and sum", show(r.out))

    out = r.keys("hel\t()\r", rb"lab bench")
    report(out is not None, "Tab completes globals (hel -> help)", show(r.out))

    r.line("g = {alpha = {beta = 1}}")
    out = r.keys("g.alpha.be\t\r", rb"\r\n1\r\n")
    report(out is not None, "Tab follows a chain of tables (g.alpha.be)", show(r.out))

    out = r.keys("s = 'abc'\r", re.escape(PROMPT))
    out = r.keys("s:up\t()\r", rb"\r\nABC\r\n")
    report(out is not None, "Tab completes string methods through __index", show(r.out))

    r.line("s = 'mnemo.zer\t'")
    out = r.line("s")
    report(out is not None and b"mnemo.zer" in lines_of(out), "no completion inside strings",
           show(out or r.out))
    r.close()


if __name__ == "__main__":
    sys.exit(main())
