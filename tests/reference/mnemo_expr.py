"""mnemo_expr: an independent parser for the expression language of SPEC.md
section 4, producing callables on torch tensors.

The reference lets autograd differentiate expressions, so this module only
builds the forward computation out of ordinary torch functions; there is no
symbolic derivative here on purpose (the C engine has one, and the point of
the reference is to check it against something written differently).

Grammar (SPEC.md section 4):

    expr  := sum (('<' | '<=' | '>' | '>=') sum)?
    sum   := prod (('+' | '-') prod)*
    prod  := unary (('*' | '/') unary)*
    unary := '-' unary | pow
    pow   := atom ('^' unary)?             right-associative; -x^2 = -(x^2)
    atom  := number | name | func '(' expr {',' expr} ')' | '(' expr ')'

Positions in error messages are 1-based character offsets into the source.

Usage:
    e = compile_expr("0.5*r^2", names=("y", "v", "r"), constants={"d": 0.5})
    out = e(y=y_tensor, v=v_tensor, r=r_tensor)   # a tensor, autograd-ready
"""

import re

import torch
import torch.nn.functional as F


class ExprError(ValueError):
    """A syntax error, an unknown name or function, or a wrong call arity."""


def _where(c, a, b):
    return torch.where(c != 0, a, b)


def _sign_nan(x):
    """sign(x) with sign(NaN) = NaN. torch.sign(NaN) is 0, which would make
    the derivative of |r| at a NaN residual 0 and silently drop the token;
    SPEC.md gives d|r|/dr = sign(r), so a NaN residual makes the step's
    gradient NaN and the non-finite guard skips the step."""
    return torch.where(torch.isnan(x), x, torch.sign(x))


class _AbsNaN(torch.autograd.Function):
    """|x| whose derivative is sign(x) with NaN kept (see _sign_nan)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.abs()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * _sign_nan(x)


def abs_nan(x):
    return _AbsNaN.apply(x)


def gelu(x):
    """Exact gelu, x * Phi(x), written with erf. Not F.gelu: its second
    derivative in float32 (GeluBackwardBackward, torch 1.13 on CPU) returned
    different garbage from one call to the next (measured: gradients of 1e22
    and NaN where float64 gives O(1)); the gradients of a run go through it."""
    return 0.5 * x * (1.0 + torch.erf(x * 0.7071067811865476))


# name -> (number of arguments, torch implementation). min and max take two
# arguments, like the C engine's table; torch.minimum/maximum give autograd a
# subgradient at ties (they split it), which differs from a one-sided choice
# only where both arguments are exactly equal.
FUNCTIONS = {
    "abs": (1, abs_nan),
    "sqrt": (1, torch.sqrt),
    "exp": (1, torch.exp),
    "log": (1, torch.log),
    "tanh": (1, torch.tanh),
    "sigmoid": (1, torch.sigmoid),
    # F.softplus is the stable log(1 + exp(x)) (it returns x past x > 20,
    # where the two differ by less than 1e-8 relative).
    "softplus": (1, F.softplus),
    "sign": (1, _sign_nan),
    "relu": (1, torch.relu),
    "silu": (1, F.silu),
    "gelu": (1, gelu),    # the exact erf form
    "min": (2, torch.minimum),
    "max": (2, torch.maximum),
    "where": (3, _where),
}

_TOKEN = re.compile(
    r"\s*(?:"
    r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op><=|>=|[-+*/^(),<>])"
    r")"
)


def _tokenize(src):
    """Return a list of (kind, text, pos) with pos 0-based; kind is num, name,
    op or end."""
    toks = []
    i = 0
    n = len(src)
    while True:
        while i < n and src[i].isspace():
            i += 1
        if i >= n:
            break
        m = _TOKEN.match(src, i)
        if not m or m.end() == i:
            raise ExprError("expression %r: unexpected character %r at position %d"
                            % (src, src[i], i + 1))
        kind = m.lastgroup
        start = m.start(kind)
        toks.append((kind, m.group(kind), start))
        i = m.end()
    toks.append(("end", "", n))
    return toks


# AST nodes are tuples: ("num", value) ("var", name, pos) ("neg", a)
# ("bin", op, a, b) ("cmp", op, a, b) ("call", fname, [args], pos)


class _Parser:
    def __init__(self, src):
        self.src = src
        self.toks = _tokenize(src)
        self.i = 0

    def peek(self):
        return self.toks[self.i]

    def take(self):
        t = self.toks[self.i]
        self.i += 1
        return t

    def error(self, msg, pos):
        raise ExprError("expression %r: %s at position %d" % (self.src, msg, pos + 1))

    def expect(self, text):
        t = self.peek()
        if t[0] != "op" or t[1] != text:
            what = "end of expression" if t[0] == "end" else repr(t[1])
            self.error("expected %r, found %s" % (text, what), t[2])
        return self.take()

    def parse(self):
        node = self.expr()
        t = self.peek()
        if t[0] != "end":
            self.error("unexpected %r" % t[1], t[2])
        return node

    def expr(self):
        a = self.sum()
        t = self.peek()
        if t[0] == "op" and t[1] in ("<", "<=", ">", ">="):
            self.take()
            b = self.sum()
            a = ("cmp", t[1], a, b)
            t2 = self.peek()
            # The grammar allows one comparison; a < b < c is almost always a
            # mistake, so say so instead of silently chaining 0/1 values.
            if t2[0] == "op" and t2[1] in ("<", "<=", ">", ">="):
                self.error("comparisons do not chain: unexpected %r" % t2[1], t2[2])
        return a

    def sum(self):
        a = self.prod()
        while True:
            t = self.peek()
            if t[0] == "op" and t[1] in ("+", "-"):
                self.take()
                a = ("bin", t[1], a, self.prod())
            else:
                return a

    def prod(self):
        a = self.unary()
        while True:
            t = self.peek()
            if t[0] == "op" and t[1] in ("*", "/"):
                self.take()
                a = ("bin", t[1], a, self.unary())
            else:
                return a

    def unary(self):
        t = self.peek()
        if t[0] == "op" and t[1] == "-":
            self.take()
            return ("neg", self.unary())
        return self.pow()

    def pow(self):
        a = self.atom()
        t = self.peek()
        if t[0] == "op" and t[1] == "^":
            self.take()
            # The exponent is a unary, which itself may be a pow: this is what
            # makes ^ right-associative and allows 2^-x.
            return ("bin", "^", a, self.unary())
        return a

    def atom(self):
        t = self.take()
        kind, text, pos = t
        if kind == "num":
            return ("num", float(text))
        if kind == "name":
            nxt = self.peek()
            if nxt[0] == "op" and nxt[1] == "(":
                if text not in FUNCTIONS:
                    self.error("unknown function %r" % text, pos)
                self.take()
                args = [self.expr()]
                while self.peek()[0] == "op" and self.peek()[1] == ",":
                    self.take()
                    args.append(self.expr())
                self.expect(")")
                want = FUNCTIONS[text][0]
                if len(args) != want:
                    self.error("function %r takes %d argument%s, got %d"
                               % (text, want, "" if want == 1 else "s", len(args)), pos)
                return ("call", text, args, pos)
            return ("var", text, pos)
        if kind == "op" and text == "(":
            node = self.expr()
            self.expect(")")
            return node
        if kind == "end":
            self.error("unexpected end of expression", pos)
        self.error("unexpected %r" % text, pos)


def parse(src):
    """Parse src into an AST (tuples); raises ExprError on syntax errors."""
    if not isinstance(src, str):
        raise ExprError("expression must be a string, got %r" % (src,))
    return _Parser(src).parse()


def _names(node, out):
    """Collect (name, pos) of every variable reference, in source order."""
    kind = node[0]
    if kind == "var":
        out.append((node[1], node[2]))
    elif kind == "neg":
        _names(node[1], out)
    elif kind in ("bin", "cmp"):
        _names(node[2], out)
        _names(node[3], out)
    elif kind == "call":
        for a in node[2]:
            _names(a, out)
    return out


class Expr:
    """A compiled expression: call it with tensors for its variable names."""

    def __init__(self, src, names, constants):
        self.src = src
        self.names = tuple(names)
        self.constants = dict(constants or {})
        for c in self.constants:
            if c in self.names:
                raise ExprError("expression %r: constant %r shadows the variable %r"
                                % (src, c, c))
        self.ast = parse(src)
        allowed = set(self.names) | set(self.constants)
        for name, pos in _names(self.ast, []):
            if name in FUNCTIONS:
                raise ExprError("expression %r: function %r used without '(' at position %d"
                                % (src, name, pos + 1))
            if name not in allowed:
                raise ExprError("expression %r: unknown name %r at position %d (allowed: %s)"
                                % (src, name, pos + 1, ", ".join(sorted(allowed)) or "none"))
        self.uses = {n for n, _ in _names(self.ast, [])}

    def __repr__(self):
        return "Expr(%r)" % self.src

    def __call__(self, **env):
        missing = [n for n in self.names if n not in env]
        if missing:
            raise ExprError("expression %r: no value for %s" % (self.src, ", ".join(missing)))
        tensors = [env[n] for n in self.names]
        ref = tensors[0]
        dtype, device = ref.dtype, ref.device
        shape = torch.broadcast_shapes(*[t.shape for t in tensors])

        def const(x):
            return torch.tensor(x, dtype=dtype, device=device)

        def ev(node):
            kind = node[0]
            if kind == "num":
                return const(node[1])
            if kind == "var":
                name = node[1]
                if name in env and name in self.names:
                    return env[name]
                return const(float(self.constants[name]))
            if kind == "neg":
                return -ev(node[1])
            if kind == "bin":
                op, a, b = node[1], ev(node[2]), ev(node[3])
                if op == "+":
                    return a + b
                if op == "-":
                    return a - b
                if op == "*":
                    return a * b
                if op == "/":
                    return a / b
                return torch.pow(a, b)
            if kind == "cmp":
                op, a, b = node[1], ev(node[2]), ev(node[3])
                if op == "<":
                    c = a < b
                elif op == "<=":
                    c = a <= b
                elif op == ">":
                    c = a > b
                else:
                    c = a >= b
                return c.to(dtype)
            if kind == "call":
                fn = FUNCTIONS[node[1]][1]
                return fn(*[ev(a) for a in node[2]])
            raise AssertionError(node)

        out = ev(self.ast)
        # An expression that ignores its variables (e.g. a constant loss)
        # still has to produce one value per element.
        if tuple(out.shape) != tuple(shape):
            out = torch.broadcast_to(out, shape)
        return out


def compile_expr(src, names, constants=None):
    """Parse and check an expression; names are its variables (e.g. y, v, r),
    constants a dict of named numbers. Raises ExprError before anything runs
    if a name or function is not defined."""
    return Expr(src, names, constants)


def evaluate(src, constants=None, **env):
    """Convenience: compile with the names in env and evaluate once."""
    return compile_expr(src, tuple(env), constants)(**env)


if __name__ == "__main__":  # tiny manual check: python3 mnemo_expr.py "expr" x=1.5
    import sys
    vals = dict(a.split("=") for a in sys.argv[2:])
    env = {k: torch.tensor(float(v), dtype=torch.float64) for k, v in vals.items()}
    try:
        print(float(compile_expr(sys.argv[1], tuple(env))(**env)))
    except ExprError as e:
        print("error:", e)
        sys.exit(2)
