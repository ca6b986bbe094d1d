-- help.lua: the help texts, as data (require "mnemo.help"; prelude.lua's
-- help() shows them). Each function's one-line doc lives beside its C code
-- (mnemo._docs, and mnemo._opdocs for the ops of ops.def); this file holds
-- the tour, the topics, the texts of functions that have no doc there
-- (`entries`), and longer notes and examples shown after a doc (`notes`).
-- Keys: "mnemo.zeros" for module functions, "Tensor:sum" for methods.
local H = {}

H.tour = [[
mnemo: a lab bench for neural-memory update rules (Titans-style fast
weights, a fused GPU kernel per update). This is Lua 5.4 with the `mnemo`
module loaded: Lua's tables, loops and functions, plus tensors.

Tensors (f32 on the cpu unless asked; dims and indices start at 1, as in
torch7; -1 is the last)
  t = mnemo.zeros(2, 3)            also ones, full, rand, randn, eye, arange
  x = mnemo.tensor({{1, 2}, {3, 4}})
  t.shape, t.dtype, t.device       fields; t:size(1), t:numel(), #t
  x[1], x[{{}, 2}], x[{1, {1, 2}}] views: a row, a column, a range
  x[1][2] = 5                      writes through the view
  x:sum(), x:mean(2), x:t(), x:matmul(x), x * 2 + 1, x:exp()
  mnemo.seed(0)                    rand and randn repeat after this

Printing
  x                                the REPL prints what a line returns
  print(x)                         a tensor's values (tables: mnemo._pretty)
  who()                            the tensors held in global variables

Files (HDF5, readable by h5py)
  mnemo.save("out.h5", {k = k, info = {steps = 8}})
  d = mnemo.load("out.h5")         the same tree back, tensors and all

Devices
  mnemo.device()                   the device in use ("cpu" or "cuda")
  x:cuda(), x:cpu(), x:to("f64")

Update rules and runs                 (this part of the tour is growing)
  rule = mnemo.rule{loss = "huber", delta = 1, step = 4, theta = 0.1}
  res = rule:run{k = k, v = v}       k, v: [B,H,T,d]; res.outputs.y, res.final
  help("rules") for more; `mnemo run EXP.h5 -o RES.h5` runs a file

More help
  help(mnemo)                      every function, one line each
  help("Tensor")                   every tensor method
  help(mnemo.zeros), help("Tensor:sum"), help(t)
  help("indexing"), help("files"), help("repl")
  examples/*.lua                   scripts to copy and edit
]]

H.topics = {}

H.topics.indexing = [[
Indexing a tensor (1-based; negative counts from the end)
  x[i]                  the i-th slice along dim 1 (a view; a 0-d tensor for 1-d x)
  x[{i, j}]             fix dims 1 and 2
  x[{{}, 2}]            all of dim 1, index 2 of dim 2 (a column)
  x[{{2, 4}}]           rows 2 to 4, inclusive (torch7)
  x[{{1, -1, 2}}]       every second row
  x[...] = v            copy v (number, tensor, nested table) into the view
  x:narrow(d, start, len), x:slice(d, a, b, step), x:select(d, i)
Views share storage: writing to one changes the other; :clone() copies.]]

H.topics.files = [[
Files are HDF5, plain enough for h5py and h5dump.
  mnemo.save(path, tree)    tree: nested tables of tensors (datasets),
                            numbers and strings (attributes)
  mnemo.load(path)          the tree back as nested tables
Writes go to a temporary file renamed over path, so a failed write leaves
the old file intact. An experiment file holds /rule, /inputs, /gates and
/init; `mnemo run EXP.h5 -o RES.h5` runs one from the shell, and `mnemo
compare A.h5 B.h5` prints per-dataset relative errors.]]

H.topics.repl = [[
The REPL
  1 + 1                 a line that is an expression prints its value
  =x                    the same as `return x` (Lua 5.1 habit)
  for i = 1, 3 do       an unfinished statement continues on ">> " lines
  Tab                   completes names: globals, mnemo.ze<Tab>, t:res<Tab>
  Ctrl-C                clears the line, or stops the running one
  Ctrl-D                quits; history is kept in ~/.mnemo_history
                        (or $MNEMO_HISTORY)
  help(x), who()        help on anything; the tensors you hold
Errors print a message and a traceback; the session goes on.]]

H.topics.rules = [[
Update rules (SPEC.md sections 1-4)
  rule = mnemo.rule{
    layers = 1, hidden = 0, activation = "silu",  -- memory model M(x; W)
    loss = "mse",             -- mse l1 huber(delta) lp(p) dot, an expression
                              -- string "abs(r)^1.5", or function(y, v, r)
    step = 4, refresh = 4,    -- tokens per step; gradient point
    clip = "norm", clip_max = 1,                  -- none norm softnorm value
    theta = 0.1, eta = 0.9, alpha = 0.01,         -- numbers, tensors, functions
  }
  res = rule:run{k = k, v = v [, q =, init =, seed =, device =]}
    res.outputs: y, loss, grad_norm, clip_scale, skipped; res.final: W1, S_W1
  mem = rule:memory{...}      a stateful memory: mem:write, mem:read, mem:run
  exp = rule:experiment{k = k, v = v}; mnemo.save("exp.h5", exp)
  rule, data = mnemo.load_experiment("exp.h5")
  mnemo.compare(res, "ref.h5")  per-dataset relative errors
(This page grows as the rule API settles; help(mnemo.rule) for the fields.)]]

H.topics.run = [[
`mnemo run EXP.h5 -o RES.h5 [--device cpu|cuda] [--precision fp32|tf32|bf16]`
runs an experiment file; `mnemo compare A.h5 B.h5 [--rtol X]` compares two
result files. (Both fill in as they land.)]]

-- Texts for functions with no doc beside their code.
H.entries = {
  ["mnemo.help"] = [[
help([x])
  With no argument, a short tour. help(f) for a mnemo function or tensor
  method, help("zeros") or help("Tensor:sum") by name, help(t) for a
  tensor (its summary and methods), help(mnemo) for the whole module,
  help("indexing"), help("files"), help("repl") for topics.]],
  ["mnemo.who"] = [[
who()
  Lists the global variables that hold tensors: name, shape, dtype,
  device and size, with the total; then how many tensors are alive in all
  (including those held only in locals and tables).]],
  ["mnemo.save"] = [[
mnemo.save(path, tree)
  Writes tree (nested tables of tensors, numbers and strings) to the HDF5
  file path: tables become groups, tensors datasets, numbers and strings
  attributes. Written to a temporary file, then renamed over path.]],
  ["mnemo.load"] = [[
mnemo.load(path) -> tree
  Reads the HDF5 file path back as nested tables: groups become tables,
  datasets tensors, attributes numbers and strings.]],
  ["mnemo.seed"] = [[
mnemo.seed(n)
  Seeds the global generator behind rand, randn and parameter
  initialisers; the same n gives the same numbers on every machine.]],
  ["mnemo.rule"] = [[
mnemo.rule{...} -> a Rule
  An update rule from a table of fields (SPEC.md sections 1-4): layers,
  hidden, activation, bias, residual (the memory model); loss, delta, p,
  feature_reduce, token_reduce (the loss); step, refresh, retrieve (the
  step loop); clip, clip_max, clip_scope, clip_scale (clipping); theta,
  eta, alpha (gates: numbers, tensors or functions of the inputs);
  constants (named numbers for expressions). Custom parts are expression
  strings or Lua functions of symbolic arguments. Unknown fields are
  errors. Methods: rule:run{k=, v=, ...}, rule:memory{...},
  rule:experiment{...}, rule:attrs(), rule:expressions(), rule:with{...}.
  See help("rules").]],
  ["mnemo.load_experiment"] = [[
mnemo.load_experiment(path) -> rule, data
  Reads an experiment file (SPEC.md section 5): the Rule, and a table of
  its inputs and gates (k, v, q, theta, eta, alpha) and initial
  parameters.]],
  ["mnemo.expr"] = [[
mnemo.expr(source) -> an Expr
  A symbolic expression (SPEC.md section 4) from a string such as
  "abs(r)^1.5" or a number. Exprs combine with + - * / ^ and the math
  functions of the module (mnemo.abs(e), mnemo.tanh(e), ...). Methods:
  e:diff("r") the derivative, e:simplify(), e:eval{r = 0.5}, e:c() the C
  source.]],
  ["mnemo.var"] = [[
mnemo.var(name) -> an Expr
  The variable name ("y", "v", "r", "z", "g", "n" or a rule constant) as
  an expression, to build custom parts in Lua: mnemo.abs(mnemo.var("r"))^1.5]],
  ["mnemo.compare"] = [[
mnemo.compare(a, b [, {rtol =, atol =, all =, quiet =}]) -> a report
  Compares two results (file paths or tables; b is the reference) dataset
  by dataset with the relative L2 error of SPEC.md section 3. The report
  prints as a table; report.passed, report.nfailed and report.rows hold
  the numbers. The shell form is `mnemo compare A.h5 B.h5`.]],
  ["mnemo.device"] = [[
mnemo.device() -> "cpu" or "cuda"
  The device used by default for new tensors and runs.]],
}

-- Notes and examples shown after a function's doc.
H.notes = {
  ["mnemo.zeros"] = [[
  e.g. mnemo.zeros(2, 3), mnemo.zeros({2, 3}, "f64"),
       mnemo.zeros(4, {device = "cuda"})]],
  ["mnemo.tensor"] = [[
  e.g. mnemo.tensor(3.5), mnemo.tensor({1, 2, 3}, "i64"),
       mnemo.tensor({{1, 2}, {3, 4}})]],
  ["mnemo.rand"] = [[
  e.g. mnemo.seed(0); mnemo.rand(2, 3)]],
  ["mnemo.randn"] = [[
  e.g. mnemo.seed(0); mnemo.randn(4, 8) * 0.02]],
  ["mnemo.arange"] = [[
  e.g. mnemo.arange(5) is 0 1 2 3 4; mnemo.arange(1, 2, 0.25) is 1 1.25 1.5 1.75]],
  ["mnemo.matmul"] = [[
  e.g. mnemo.matmul(W, x), or W:matmul(x); batched: [B,n,k] x [B,k,m] gives [B,n,m]
]],
  ["Tensor:sum"] = [[
  e.g. x:sum() is a number; x:sum(2) sums along dim 2; x:sum(-1, true) keeps it]],
  ["Tensor:mean"] = [[
  e.g. x:mean() is a number; x:mean(1) averages the rows]],
  ["Tensor:view"] = [[
  e.g. mnemo.arange(6):view(2, 3), x:view(-1) flattens]],
  ["Tensor:slice"] = [[
  See help("indexing") for x[{...}], which does the same with a table.]],
  ["mnemo.save"] = [[
  e.g. mnemo.save("run1.h5", {k = k, v = v, rule = {step = 4, loss = "mse"}})
  See help("files").]],
  ["mnemo.load"] = [[
  e.g. d = mnemo.load("run1.h5"); d.k:size()]],
}

return H
