-- check.lua: the assertion kit of the Lua tests (load with
-- `local T = dofile("tests/lua/check.lua")`). Each check prints one line,
-- "PASS name" or "FAIL name: detail", which tests/run.sh counts; T.done()
-- exits non-zero when anything failed.
local T = { failures = 0 }

local function fail(name, detail)
  T.failures = T.failures + 1
  print(("FAIL %s: %s"):format(name, detail))
end

function T.ok(name, cond, detail)
  if cond then print("PASS " .. name) else fail(name, detail or "condition false") end
end

-- |got - want| <= tol * max(1, |want|); numbers only
function T.near(name, got, want, tol)
  tol = tol or 1e-6
  if type(got) ~= "number" or type(want) ~= "number" then
    return fail(name, ("not numbers: %s, %s"):format(tostring(got), tostring(want)))
  end
  if math.abs(got - want) <= tol * math.max(1, math.abs(want)) then print("PASS " .. name)
  else fail(name, ("got %.17g want %.17g"):format(got, want)) end
end

function T.eq(name, got, want)
  if got == want then print("PASS " .. name)
  else fail(name, ("got %s want %s"):format(tostring(got), tostring(want))) end
end

-- fn must raise an error whose message contains pattern (plain text)
function T.raises(name, fn, pattern)
  local ok, err = pcall(fn)
  if ok then return fail(name, "no error raised") end
  err = tostring(err)
  if pattern and not err:find(pattern, 1, true) then
    return fail(name, ("error '%s' lacks '%s'"):format(err, pattern))
  end
  print("PASS " .. name)
end

-- |a - b| / |b| of two tensors (L2 norms, in double on the CPU; |a - b| when
-- b is 0); math.huge where a NaN makes it undefined, so that no comparison
-- or math.max lets it through
function T.rel(a, b)
  a, b = a:cpu():double(), b:cpu():double()
  local d, n = (a - b):norm(), b:norm()
  if d ~= d then return math.huge end
  return n > 0 and d / n or d
end

-- Every output of res against ref (mnemo.compare: the same NaN places,
-- relative L2 error per dataset, at rtol tol): nil when all pass, else the
-- failing rows in one line.
function T.failing(res, ref, tol)
  local rep = mnemo.compare(res, ref, { rtol = tol, quiet = true })
  if rep.passed then return nil end
  local bad = {}
  for _, row in ipairs(rep.rows) do
    if row.status ~= "pass" then
      bad[#bad + 1] = ("%s %s rel %.3g"):format(row.name, tostring(row.detail), tonumber(row.rel) or -1)
    end
  end
  return table.concat(bad, "; ")
end

-- The per-step outputs (outputs and trace) that T.two_writes joins.
local STEP_OUTPUTS = { "grad_norm", "clip_scale", "skipped", "step_loss", "weight_norm" }

-- The rule on cuda over k and v ([B, H, T, d]) twice from the same seed: a
-- memory fed the first `first` tokens and then the rest in two writes, and
-- one run of all; returns the memory's state, the run's result and the two
-- writes' per-step outputs joined (STEP_OUTPUTS: [B, H, steps] each, on the
-- CPU).
function T.two_writes(rule, k, v, first, seed)
  local m = mnemo
  local n = k.shape[3]
  m.seed(seed)
  local one = rule:run { k = k, v = v, device = "cuda" }
  m.seed(seed)
  local mem = rule:memory { B = k.shape[1], H = k.shape[2], dk = k.shape[4], dv = v.shape[4], device = "cuda" }
  local a = mem:write { k = k:narrow(3, 1, first), v = v:narrow(3, 1, first) }
  local b = mem:write { k = k:narrow(3, first + 1, n - first), v = v:narrow(3, first + 1, n - first) }
  local steps = {}
  for _, name in ipairs(STEP_OUTPUTS) do
    steps[name] = m.cat({ a[name]:cpu(), b[name]:cpu() }, 3)
  end
  return mem:state(), one, steps
end

-- The names of the per-step outputs of `steps` (as T.two_writes returns
-- them) that differ from one run's in any bit, joined; "" when none.
function T.steps_differ(steps, one)
  local bad = {}
  for _, name in ipairs(STEP_OUTPUTS) do
    local whole = (one.outputs[name] or one.trace[name]):cpu()
    if (whole - steps[name]):abs():max() ~= 0 then bad[#bad + 1] = name end
  end
  return table.concat(bad, ", ")
end

function T.skip(name, reason) print(("SKIP %s: %s"):format(name, reason)) end

function T.done() os.exit(T.failures == 0 and 0 or 1) end

return T
