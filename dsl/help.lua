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
  mnemo.device()                   "cuda" when a GPU is usable, else "cpu"
  x:cuda(), x:cpu(), x:to("f64")

Update rules and runs                 (this part of the tour is growing)
  rule = mnemo.rule{loss = "huber", delta = 1, step = 4, theta = 0.1}
  res = rule:run{k = k, v = v}       k, v: [B,H,T,d]; res.outputs.y, res.final
  help("rules") for more; `mnemo run EXP.h5 -o RES.h5` runs a file

Workloads, metrics, plots
  d = mnemo.data.recall{pairs = 32, distractors = 16, dk = 16}
  res = rule:run{k = d.k, v = d.v, q = d.q, theta = d.write_mask * 0.5}
  acc = mnemo.metrics.recall(res.outputs.y, d.values, d.target_index)
  mnemo.plot.curves{mnemo.metrics.curve(res.trace.step_loss), logy = true}
  mnemo.profile(function() rule:run{k = d.k, v = d.v} end)
  help(mnemo.data), help(mnemo.metrics), help(mnemo.plot)

More help
  help(mnemo)                      every function, one line each
  help("Tensor")                   every tensor method
  help(mnemo.zeros), help("Tensor:sum"), help(t)
  help("indexing"), help("files"), help("repl")
  examples/*.lua                   scripts to copy and edit (tour.lua,
                                   titans_mlp.lua, sweep.lua, ...)
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
Update rules (docs/rules.md)
  rule = mnemo.rule{
    layers = 1, hidden = 0, activation = "silu",  -- memory model M(x; W)
    loss = "mse",             -- mse l1 huber(delta) lp(p) dot logcosh, an expression
                              -- string "abs(r)^1.5", or function(y, v, r)
    step = 4, refresh = 4,    -- tokens per step; gradient point
    clip = "norm", clip_max = 1,                  -- none norm softnorm value softvalue
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
result files. An experiment with an /upstream group (dy, dloss, dW1, ...,
dS_W1, ...: any subset) also gets the run's gradients in /grads
(docs/gradients.md; help("Result:backward")). (Both fill in as they land.)]]

H.topics["mnemo.data"] = [[
mnemo.data: workloads as Lua functions returning tensors
Every result is a table of [B,H,T,d] tensors (masks and ids [B,H,T]), sizes
and strings, ready for rule:run and for mnemo.save. Each call is seeded:
the same seed gives the same tensors on every machine; without one, a seed
is drawn from the global generator (mnemo.seed(n) makes it repeat) and kept
in d.seed. Afterwards the global generator is reseeded from a number drawn
before the call, so what follows does not depend on the call's sizes.]]

H.topics["mnemo.metrics"] = [[
mnemo.metrics: what a memory retrieved, measured
  recall(y, candidates, target)   the nearest candidate is the right one
  error(y, target)                relative L2 error per token, and its mean
  curve(x)                        a [B,H,T] or [B,H,S] tensor as a curve
e.g. acc, info = mnemo.metrics.recall(res.outputs.y, d.values, d.target_index)
     c, x = mnemo.metrics.curve(info.correct, {mask = info.mask, bins = 16})
     mnemo.plot.curves{x = x, y = c, ylabel = "recall"}]]

H.topics["mnemo.plot"] = [[
mnemo.plot: plots through gnuplot (Debian package gnuplot-nox)
Without out = ..., plots draw in the terminal; with out = "f.png" (also
.svg, .pdf, .txt) they go to that file, written to a temporary name and
renamed. mnemo.plot{...} is mnemo.plot.curves{...}. mnemo.plot.program
names the gnuplot to run.]]

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
  ["mnemo.vocabulary"] = [[
mnemo.vocabulary() -> {fields = {...}, parts = {loss = {...}, clip = {...}, ...}}
  The rule's vocabulary as data: every field (name, type, default, doc,
  alias, min/max, v2) and every part list (activation, loss, clip,
  clip_scope, reduction, retrieve, out_norm, qk_norm, precondition), each
  part with its name, built-in expression, variables, doc and flags
  (custom, kink, scale, elementwise, planned, cpu_only). help(mnemo.rule) is made
  from it; so are the tests that run every part.]],
  ["mnemo.rule"] = [[
mnemo.rule{...} -> a Rule
  An update rule from a table of fields (the list below comes from the
  rule table itself, mnemo.vocabulary()); also theta, eta, alpha (gates:
  numbers, tensors or functions of the inputs), constants (named numbers
  for expressions) and clip_scale (a custom scale clip in n). Custom parts
  (activation, loss, clip) are expression strings or Lua functions of
  symbolic arguments. Unknown fields are errors. Methods:
  rule:run{k=, v=, ...}, rule:memory{...}, rule:experiment{...},
  rule:attrs(), rule:save(path), rule:expressions(), rule:with{...}. See help("rules").]],
  ["Rule:run"] = [[
rule:run{k =, v = [, q =] [, lengths =] [, theta =, eta =, alpha =] [, init =] [, seed =] [, device =] [, precision =]} -> result
  One run over k [B,H,T,dk] and v [B,H,T,dv] ([T,d] or [H,T,d] also do)
  from the initial state: init is "xavier" (default), "normal", "zeros", a
  table {W1 =, b1 =, ..., S_W1 =, ...} (with glu also U1 =, c1 =, ...;
  with an out_norm also ln_g =, ln_b =: [dv], [H,dv] or [B,H,dv], default
  1 and 0) or an .h5 path (its /init or /final);
  seed fixes the initialiser. Gates given here override the rule's. The
  result is a table in the result schema of docs/files.md: outputs (y,
  loss, grad_norm, clip_scale, skipped), final (W1, ..., S_W1, ...), trace
  (step_loss, weight_norm per step), rule; mnemo.save writes it.
  lengths = {l_1, ..., l_B} (or a [B] tensor, integers 0..T): ragged
  batches; tokens at and after l_b of sequence b are padding (no gradient,
  not counted, y = 0, loss = 0; a step that starts there changes nothing).
  device = "cuda" runs on the GPU, precision = "tf32" or "bf16" there
  (every SPEC v2 option too: qk_norm, precondition and lengths on every
  path, out_norm on its fused and general paths, glu on its general and
  large paths).
  grad = true keeps what res:backward{...} needs (help("Result:backward")).]],
  ["Result:backward"] = [[
res:backward{[dy =] [, dloss =] [, dW1 =, db1 =, ...] [, dS_W1 =, ...] [, block =]} -> gradients
  The gradients of a run (docs/gradients.md) from rule:run{..., grad =
  true}: given upstream gradients of its outputs (any subset, the rest
  zero: dy like res.outputs.y [B,H,T,dv], dloss like res.outputs.loss,
  dW1 ... and dS_W1 ... like res.final's tensors), the gradient of <dy,
  y> + <dloss, loss> + sum <dP, P_final> with respect to the inputs:
  g.k, g.v, g.q (only when the run had q; without it k's gradient holds
  both uses), g.theta, g.eta, g.alpha, and g.init.W1, ..., g.init.S_W1,
  ... (initial weights and momenta), and with an out_norm g.init.ln_g,
  g.init.ln_b (its gain and shift). Each is summed back to the shape
  the call gave: a scalar gate gets a scalar, [H,T] gets [H,T], W1 given
  as [dh,dk] gets [dh,dk]; what the call did not give comes at full
  shape [B,H,...]. The backward runs where the run ran: a cuda run's on
  the GPU (the fused backward kernel, in the run's precision, where the
  forward is fused, whatever the refresh; else the general one, fp32,
  which runs out_norm and glu; newton_schulz on either) and its gradients
  stay there (cuda tensors; one summed to a smaller given shape lands on
  that tensor's device; with qk_norm the keys are normalised and their
  gradients taken back through it on the GPU); a cpu run's on the cpu.
  Either way it recomputes the
  forward from checkpoints every block steps (default about sqrt(steps);
  a cpu run with grad = true keeps them as it goes); g.memory reports
  block, backward_bytes (checkpoints and scratch) and forward_bytes (the
  forward's state). Second derivatives of custom losses and activations
  come from the expression system. The result keeps the call's tensors,
  not copies: leave k, v, q, the gates and init unchanged until
  backward. In a file, an /upstream group does the same for `mnemo run`
  (help("run")).]],
  ["Rule:memory"] = [[
rule:memory{dk = [, dv =] [, B = 1, H = 1] [, init =] [, seed =] [, device =] [, precision =]} -> a Memory
  A stateful memory that keeps its weights and momenta between calls:
  mem:write(k, v), mem:run(k, v [, q]), mem:read(q), mem:reset(),
  mem:state(), mem.steps. Feeding a sequence in pieces that are multiples
  of the step gives the same result as one rule:run.]],
  ["Rule:experiment"] = [[
rule:experiment{k =, v =, ...} -> table
  The same arguments as rule:run, returned as a table in the experiment
  schema (docs/files.md) with gates resolved and the initial state
  drawn: mnemo.save("exp.h5", rule:experiment{...}) then `mnemo run` or the
  Python reference reads it.]],
  ["Rule:save"] = [[
rule:save(path)
  The rule alone in a file (its /rule group, as in an experiment file), for
  the PyTorch bridge: mnemo_torch.Rule("rule.h5").]],
  ["Rule:attrs"] = [[
rule:attrs() -> table
  The rule's /rule attributes (every field, defaults included), as written
  to files; rule.NAME reads one of them, e.g. rule.step.]],
  ["Rule:expressions"] = [[
rule:expressions() -> table
  Every part of the rule as an expression string, built-in parts too: loss
  f(y, v, r), loss_grad (df/dy), activation phi(z), activation_grad, and
  clip (the scale in n, or the elementwise map of g). These are what the
  engines evaluate and what the GPU code is generated from.]],
  ["Rule:with"] = [[
rule:with{field = value, ...} -> a new Rule
  A copy with some fields replaced, e.g. for a sweep:
  for _, eta in ipairs{0, 0.5, 0.9} do rule:with{eta = eta}:run{...} end]],
  ["Rule:source"] = [[
rule:source([{dk = 64, dv = dk, hidden =, precision = "fp32", backward = false,
             q = false, lengths = false}]) -> string
  The CUDA source generated for this rule at those sizes (hooks from its
  expressions plus the kernel template of the path rule:plan picks: fused,
  large or general), as NVRTC compiles it for a run without q and lengths
  (q = true, lengths = true: a run that gives them; the fused path
  compiles the code that reads them only then); with backward = true, the source
  of the backward that rule:plan names (fused, large or general). The
  rule's constants (delta, p, clip_max, named constants) are not in it:
  the kernels read them at run time (MN_KF(slot), MN_KD(slot)), so a sweep
  over their values compiles once. Needs no GPU.]],
  ["Rule:kernel_info"] = [[
rule:kernel_info([{dk = 64, dv = dk, hidden =, B = 1, H = 1, precision = "fp32", arch =}])
    -> info
  What the GPU kernels of this rule use, as ptxas reports them when NVRTC
  compiles them (no GPU needed; sm_90 unless arch = or a GPU says
  otherwise): info.registers (per thread), shared_bytes (static, per
  block), stack_bytes, spill_stores, spill_loads (bytes per thread; spills
  mean too many registers), barriers, max_threads (launch bounds),
  block_threads (what the engine launches) of the step kernel, where runs
  spend their time; info.kernels lists every kernel, step first. Also arch,
  key (the kernel cache key), compile_ms (NVRTC's time), cached (true when
  this call compiled nothing), grid (B*H blocks, one per memory), dk, dv,
  precision. On a GPU of that arch, occupancy = {blocks_per_sm, warps_per_sm,
  max_warps_per_sm, fraction, sms, waves} and gpu = {registers,
  shared_bytes, local_bytes, max_threads} (the driver's view); nil without
  one. Prints as a table.
  e.g. rule:kernel_info{dk = 128, precision = "bf16"}]],
  ["Rule:plan"] = [[
rule:plan([{dk = 64, dv = dk, hidden =, B = 1, H = 1, precision = "fp32", arch =, lengths =}]) -> a plan
  Which CUDA path would run the rule at those sizes, and why:
    fused    one thread block per memory keeps the weights in shared
             memory for the whole sequence, products on tensor cores
             (layers 1-2, dk, dv <= 128, hidden <= 4 d, when they fit)
    large    a dimension >= 256: cuBLAS products, each step from a graph
             (glu too: the fused path never takes it)
    general  everything else (one thread block per memory, plain loops):
             glu below 256 (never fused); out_norm where the fused path
             does not fit (never large)
  Every path runs precondition = "newton_schulz" and lengths.
  For the GPU here, else for arch (e.g. 80 for sm_80; default sm_90).
  Fields: path, why, forced, rows (token rows per chunk), threads,
  smem_bytes, grad_in_shared (the step's gradient kept in shared memory
  beside the weights, where it fits), grad_swizzled (its rows' float
  groups permuted against bank conflicts: tf32 and bf16), z_pad (bf16:
  the hidden layer's z rows 4 floats wider, where they fit), w16 (bf16,
  refresh > step: the anchor's and the current weights kept as bf16 in
  shared memory for the products), k_unroll (how
  far the tensor-core products' K loops unroll), kernel, memories,
  precision, arch,
  device; backward and
  backward_why: where a cuda run's res:backward runs and why ("fused
  (cuda)" where the forward is fused, with
  backward_rows, backward_smem_bytes, backward_kernel; "large (cuda)"
  where the forward is large: cuBLAS products over all memories at once,
  except newton_schulz and glu; "general (cuda)", out_norm's and glu's
  always, and a large run's with lengths or non-finite inputs; "cpu" only
  with MNEMO_CUDA_BACKWARD=cpu). MNEMO_CUDA_BACKWARD=cpu keeps every
  backward on the cpu; =general, =fused or =large forces a GPU backward.
  MNEMO_CUDA_PATH=general, fused or large forces a path (for tests and
  benchmarks). lengths = true: the plan of a run with lengths (ragged
  batches), which is the rule's: every path runs them. Needs no GPU.
  e.g. print(rule:plan{dk = 64, hidden = 256, B = 4, H = 32})]],
  ["Memory:write"] = [[
mem:write(k, v [, gates]) or mem:write{k =, v =, theta =, ...} -> per-step table
  Feeds a block of tokens: one step per `step` tokens (a shorter block ends
  with a short step). Returns loss [B,H,n] and, per step, grad_norm,
  clip_scale, skipped, step_loss, weight_norm. lengths = {...} counts the
  real tokens of each sequence from this block's first token.]],
  ["Memory:run"] = [[
mem:run(k, v [, q] [, gates]) -> per-step table with y
  As mem:write, and also retrieves y for each token (q defaults to k) with
  the rule's retrieve mode.]],
  ["Memory:read"] = [[
mem:read(q) -> y
  Retrieval only, with the current weights: y = M(q; W).]],
  ["Memory:reset"] = [[
mem:reset()
  Back to the initial weights, zero momenta, step 0.]],
  ["Memory:state"] = [[
mem:state() -> {W1 =, b1 =, ..., S_W1 =, ...}
  Copies of the current weights and momenta ([B,H,...] tensors).]],
  ["Memory:close"] = [[
mem:close()
  Frees the memory's buffers now (also done by the garbage collector).]],
  ["Expr:diff"] = [[
e:diff(name) -> an Expr
  The symbolic derivative in the variable name, simplified:
  (mnemo.var("r")^2):diff("r") is 2 * r.]],
  ["Expr:simplify"] = [[
e:simplify() -> an Expr
  Constant folding and the algebraic identities (x*1, x+0, --x, ...).]],
  ["Expr:eval"] = [[
e:eval{name = number, ...} -> number
  Evaluates in double precision; every name must be given.]],
  ["Expr:c"] = [[
e:c([{names...}] [, single]) -> string
  The expression as one C/CUDA expression over mn_f_* functions, as the
  code generator emits it (single = true for float).]],
  ["Expr:lt"] = [[
e:lt(x) -> an Expr
  1 where e < x, else 0 (also le, gt, ge; Lua's < cannot build expressions).]],
  ["Expr:le"] = [[
e:le(x) -> an Expr
  1 where e <= x, else 0.]],
  ["Expr:gt"] = [[
e:gt(x) -> an Expr
  1 where e > x, else 0.]],
  ["Expr:ge"] = [[
e:ge(x) -> an Expr
  1 where e >= x, else 0.]],
  ["mnemo.load_experiment"] = [[
mnemo.load_experiment(path) -> rule, data
  Reads an experiment file (docs/files.md): the Rule, and a table of
  its inputs and gates (k, v, q, theta, eta, alpha) and initial
  parameters.]],
  ["mnemo.expr"] = [[
mnemo.expr(source) -> an Expr
  A symbolic expression (docs/rules.md) from a string such as
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
  by dataset with the relative L2 error of docs/rules.md#precision. The report
  prints as a table; report.passed, report.nfailed and report.rows hold
  the numbers. The shell form is `mnemo compare A.h5 B.h5`.]],
  ["mnemo.device"] = [[
mnemo.device() -> "cpu" or "cuda"
  "cuda" when a CUDA device is usable, else "cpu". New tensors and runs stay
  on the cpu unless asked: t:cuda(), mnemo.zeros(n, {device = "cuda"}),
  rule:run{..., device = "cuda"}.]],
  ["mnemo.profile"] = [[
mnemo.profile(fn [, {quiet = false}]) -> a report
  Runs fn() and times the engine calls it makes (rule:run, mem:write,
  mem:run, mem:read: wall seconds of each, tokens/s) and the whole; prints
  a small table (unless quiet) and returns {total =, engine =, other =,
  calls = {{what =, seconds =, tokens =}, ...}, by = {["rule:run"] = {calls
  =, seconds =, tokens =}}, kernels =, results = fn's results (packed)}.
  With a GPU, runs on cuda also report the GPU time of each kernel
  launched (report.kernels = {{name =, calls =, seconds =, mean_ms =, grid
  =, block =}, ...}, most time first; .launches the last 64 one by one),
  timed with CUDA events only while profile runs (through
  mnemo._profile_kernel_hook).
  e.g. mnemo.profile(function() rule:run{k = d.k, v = d.v} end)]],

  ["mnemo.data.recall"] = [[
mnemo.data.recall{B=1, H=1, pairs=16, distractors=0, queries=pairs, dk=16,
                  dv=dk, seed=, distractor_scale=1, order="random",
                  key_norm=sqrt(dk)} -> d
  Multi-query associative recall. Each of the B x H sequences holds T =
  pairs + distractors + queries tokens:
    1 .. pairs+distractors   the context: the key-value pairs and the
                             distractor tokens, shuffled (order =
                             "pairs_first" keeps pairs first); each writes
                             k = its key, v = its value
    the last `queries`       queries: k = v = 0 (nothing to write), q = the
                             key of a stored pair (distinct pairs while they
                             last), target = that pair's value
  Keys have L2 norm sqrt(dk), i.e. RMS 1 per feature (key_norm = 1 gives
  unit keys, as Titans normalises them); values and distractor values are
  N(0, 1) per feature (distractors times distractor_scale).
  Fields: k, q [B,H,T,dk]; v, target [B,H,T,dv]; target_index [B,H,T]
  (i64: the queried pair, 1-based, 0 off the queries); query_mask,
  write_mask [B,H,T] (1/0); keys [B,H,pairs,dk], values [B,H,pairs,dv]
  (the candidates for recall); pair_pos [B,H,pairs] (where each pair
  sits); T, seed and the options.
  Run with theta masked so the queries write nothing:
    res = rule:run{k = d.k, v = d.v, q = d.q, theta = d.write_mask * 0.5}
    acc = mnemo.metrics.recall(res.outputs.y, d.values, d.target_index)
  Chance is 1/pairs; an exact lookup scores 1.]],
  ["mnemo.data.drift"] = [[
mnemo.data.drift{B=1, H=1, T=256, dk=16, dv=dk, rate=0.005, noise=0.1,
                 switch_every=nil, queries="fresh", seed=, key_norm=sqrt(dk)}
    -> d
  A noisy linear regression stream whose true map drifts: v_t = A_t k_t +
  noise, A_t = A R_t, with R_t turning each coordinate plane (1,2), (3,4),
  ... of the key space by an angle omega * (t-1), |omega| = rate * (0.5 ..
  1.5) radians per token, either way. switch_every = n also draws a new A
  every n tokens (abrupt changes). Old associations go stale, so forgetting
  (alpha > 0) pays. Keys have norm sqrt(dk) (key_norm); A is N(0, 1/dk),
  so values have RMS about 1; noise is the std of the value noise.
  queries: "fresh" (new random keys), "keys" (q = k) or "fixed" (one probe
  key for all t, to watch the target move).
  Fields: k, q [B,H,T,dk]; v (noisy), v_clean = A_t k_t, target = A_t q_t
  (the ground truth for the queries) [B,H,T,dv]; maps [B,H,R,dv,dk] (the A
  of each regime); angle [B,H,T] (the first plane's angle at t); seed, sizes.
    res = rule:run{k = d.k, v = d.v, q = d.q}
    err = mnemo.metrics.error(res.outputs.y, d.target)]],
  ["mnemo.data.text"] = [[
mnemo.data.text{path=, B=1, H=1, T=256, dk=32, dv=dk, seed=, offset=,
                lowercase=true, vocab_size=, target="next", key_norm=sqrt(dk)}
    -> d
  A real-text token stream. The text (default
  /usr/share/common-licenses/GPL-3 from Debian's base-files, about 5,600
  words) is split into words (runs of letters, digits and '), lowercased;
  the vocabulary is ordered by frequency (vocab_size cuts it, the rest
  become "<unk>"). A seeded embedding table maps words to k =
  embed_k[w_t] (norm sqrt(dk)) and v = embed_v[w_{t+1}] (N(0, 1); target =
  "same" uses w_t): next-word association. Each of the B x H streams
  reads T consecutive words from its own place (random, or offset +
  (stream-1) * T).
  Fields: k, q (= k) [B,H,T,dk]; v [B,H,T,dv]; tokens, next [B,H,T] (i64
  word ids, 1-based); embed_k [V,dk], embed_v [V,dv]; offset [B,H]; vocab
  (the words, one a line, in id order); V, path, words_total, seed.
    acc = mnemo.metrics.recall(res.outputs.y, d.embed_v, d.next)
    print(mnemo.data.decode(d, d.tokens[1][1]))]],
  ["mnemo.data.decode"] = [[
mnemo.data.decode(d, ids) -> a string
  The words of the token ids (a tensor, a number or a table; 1-based) of
  the text workload d, joined by spaces; "<?>" for an id out of range.
  e.g. mnemo.data.decode(d, info.pred[1][1]) shows what a memory recalled]],

  ["mnemo.metrics.recall"] = [[
mnemo.metrics.recall(y, candidates, target [, {metric = "cosine", mask =}])
    -> accuracy, info
  For each scored token, the candidate nearest to y (by cosine, "l2"
  distance or "dot" product) is the prediction; accuracy is the fraction
  of scored tokens whose prediction is target. y [B,H,T,dv]; candidates
  [N,dv] (shared) or [B,H,N,dv]; target [B,H,T]: 1-based candidate index,
  0 = not scored (or give mask [B,H,T]). A row of y with NaN or Inf counts
  as wrong. info: correct [B,H,T] (1/0), pred [B,H,T] (i64), mask, n (scored
  tokens), candidates (N), chance (1/N), metric.]],
  ["mnemo.metrics.error"] = [[
mnemo.metrics.error(y, target [, {mask =, relative = true, eps = 1e-12}])
    -> mean, err
  Retrieval error per token: err = |y - target| / |target| (L2 over the
  last dim; relative = false gives |y - target|), [B,H,T] for [B,H,T,d]
  inputs; mean over the tokens where mask is nonzero (all by default).]],
  ["mnemo.metrics.retrieval_error"] = [[
mnemo.metrics.retrieval_error(y, target [, opts]) -> mean, err
  The same as mnemo.metrics.error.]],
  ["mnemo.metrics.curve"] = [[
mnemo.metrics.curve(x [, {mask =, bins =, window =}]) -> curve, steps
  Reduces x, [B,H,T] or [B,H,S] (any shape, steps last), to a curve over
  steps: the mean over all the other dims (over the entries where mask is
  nonzero when given; NaN where none is). bins = n (or window = w steps)
  averages the curve over equal windows. Returns the curve and the step of
  each point (1-based; window centres), both 1-d tensors, for mnemo.plot:
    y, x = mnemo.metrics.curve(res.trace.step_loss, {bins = 50})
    mnemo.plot.curves{{x = x, y = y, label = "loss"}, logy = true}]],

  ["mnemo.plot.curves"] = [[
mnemo.plot.curves{series..., title=, xlabel=, ylabel=, logy=, logx=, out=,
                  width=, height=, xrange={lo, hi}, yrange=, style=, key=}
    -> out (the file), or nothing (drawn in the terminal)
  Each series is a 1-d tensor or an array of numbers (y against 1, 2, ...),
  or {y =, x =, label =, style =}; or give y = (and x =) for one series.
  Without out, gnuplot draws in the terminal (its dumb terminal, sized to
  $COLUMNS x $LINES); out = "f.png" (pngcairo), .svg, .pdf or .txt writes a
  file. Points that are not finite (or not positive with logy) are left
  out. style: "lines", "linespoints" or "points".
  e.g. mnemo.plot.curves{{y = a, label = "gd"}, {y = b, label = "momentum"},
         xlabel = "pairs", ylabel = "recall", out = "recall.png"}]],
  ["mnemo.plot.heatmap"] = [[
mnemo.plot.heatmap{z = [R,C], x = {C labels}, y = {R labels}, title=,
                   xlabel=, ylabel=, cblabel=, logz=, values=, out=}
    -> out, or nothing
  A matrix as a picture: row 1 at the top, columns left to right, labelled
  by x and y (numbers or strings). To a file (.png, .svg, .pdf through
  gnuplot, with the values written in the cells when there are at most 144,
  or values = true/false), or in the terminal as a table of shaded cells
  ('.:-=+*#%@' low to high) with their values (also out = "f.txt").]],
  ["mnemo.plot.available"] = [[
mnemo.plot.available() -> ok, types
  true and the file types gnuplot can write here ({"txt", "png", "svg",
  "pdf"}), or false when gnuplot is missing (Debian package gnuplot-nox).]],
}

-- Notes and examples shown after a function's doc.
-- help(mnemo.rule)'s field list, from the rule table (model/rule.def).
local function rule_fields_note(M)
  local ok, voc = pcall(M.vocabulary)
  if not ok then return nil end
  local lines = { "  Fields (name, default: meaning):" }
  for _, f in ipairs(voc.fields) do
    local extra = f.alias and (" (or " .. f.alias .. ")") or ""
    lines[#lines + 1] = string.format("    %-15s %s: %s%s", f.name, tostring(f.default), f.doc, extra)
    if f.parts then
      local names = {}
      for _, p in ipairs(voc.parts[f.parts]) do
        names[#names + 1] = p.name .. (p.flags.planned and " (v2, not yet run)" or "")
      end
      lines[#lines + 1] = "        one of: " .. table.concat(names, ", ")
    end
  end
  return table.concat(lines, "\n")
end

H.notes = {
  ["mnemo.rule"] = rule_fields_note,
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
