-- compare_with_python.lua: check mnemo's engine against the PyTorch reference
-- (tests/reference/mnemo_ref.py: float64, torch.autograd) on one experiment:
--   1. build a rule and a workload, dump them with rule:experiment + mnemo.save
--   2. run the reference on that file (python3 with torch and h5py)
--   3. run the same experiment here and mnemo.compare the two results
-- Skips politely when python3, torch or h5py is missing.
--
-- usage: mnemo examples/compare_with_python.lua [small|full] [OUTDIR]
local size = arg and arg[1] or "full"
local outdir = arg and arg[2] or os.getenv("MNEMO_OUT") or "."
local small = size == "small"
local python = os.getenv("PYTHON") or "/usr/bin/python3"

-- the reference sits beside this script's folder: examples/../tests/reference
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local ref = here .. "/../tests/reference/mnemo_ref.py"

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function exists(p) local f = io.open(p, "r"); if f then f:close() end; return f ~= nil end

-- 1. the experiment: an MLP memory with Huber loss, momentum, decay and a
-- norm clip, on associative recall, 4 tokens per step
local rule = mnemo.rule{ layers = 2, hidden = 32, loss = "huber", delta = 1, clip = "norm", clip_max = 2,
                         step = 4, eta = 0.5, alpha = 0.01 }
local d = mnemo.data.recall{ B = small and 1 or 4, H = 2, pairs = 16, distractors = 16, dk = 16, seed = 11 }
local exp = rule:experiment{ k = d.k, v = d.v, q = d.q, theta = d.write_mask * 0.5, seed = 3 }
local exp_path, ref_path = outdir .. "/compare_experiment.h5", outdir .. "/compare_reference.h5"
mnemo.save(exp_path, exp)
print(string.format("experiment: %s (%d x %d memories, %d tokens, %d steps)", exp_path,
  d.B, d.H, d.T, (d.T + 3) // 4))

-- 2. the reference
if not exists(ref) then
  print("skipped: the Python reference is not at " .. ref)
  return
end
if not os.execute(sh_quote(python) .. " -c 'import torch, h5py, numpy' >/dev/null 2>&1") then
  print("skipped: " .. python .. " with torch, h5py and numpy is needed " ..
    "(Debian: python3-torch python3-h5py python3-numpy, or make deps)")
  return
end
local cmd = string.format("%s %s %s -o %s", sh_quote(python), sh_quote(ref), sh_quote(exp_path), sh_quote(ref_path))
print("reference: " .. cmd)
local t0 = os.time()
if not os.execute(cmd) then
  error("the Python reference failed (command above)")
end
print(string.format("reference done in about %d s", os.time() - t0))

-- 3. the same experiment here, and the comparison (SPEC.md section 3:
-- fp32 against float64 agrees to 1e-5 for runs of up to 64 steps)
local rule2, inputs = mnemo.load_experiment(exp_path)
local res = rule2:run(inputs)
mnemo.save(outdir .. "/compare_mnemo.h5", res)
local report = mnemo.compare(res, ref_path, { rtol = 1e-5 })
print(report)
print(report.passed and "mnemo agrees with the PyTorch reference" or "mnemo DISAGREES with the PyTorch reference")
if not report.passed then os.exit(1) end
