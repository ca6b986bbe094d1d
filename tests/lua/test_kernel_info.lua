-- test_kernel_info.lua: rule:kernel_info (registers, shared memory, stack,
-- spills, launch bounds of the generated kernels from NVRTC alone; cached in
-- memory and on disk; printed as a table; option errors) and, on a GPU,
-- occupancy and the per-kernel GPU times of mnemo.profile. Without a GPU
-- those parts are SKIP lines; in a build without CUDA the method says so.
-- Run from the repository root: mnemo tests/lua/test_kernel_info.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")
local MNEMO = os.getenv("MNEMO") or arg[-1]

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function run_chunk(code, env)
  local h = io.popen((env or "") .. " " .. sh_quote(MNEMO) .. " -e " .. sh_quote(code) .. " 2>&1")
  local out = h:read("a")
  h:close()
  return out
end

local rule = m.rule { layers = 2, hidden = 32, activation = "gelu", step = 4, clip = "norm", clip_max = 1,
                      theta = 0.1 }

---------------------------------------------------------------- help
local missing = table.concat(m._help_missing(), ", ")
T.ok("help: Rule:kernel_info has help", not missing:find("kernel_info", 1, true), missing)

---------------------------------------------------------------- a build without CUDA
local has_codegen = pcall(rule.source, rule)
if not has_codegen then
  T.raises("kernel_info: a build without CUDA says so", function() rule:kernel_info() end,
    "kernel_info: this build has no CUDA")
  T.skip("kernel_info/all", "this build has no CUDA")
  T.done()
end

---------------------------------------------------------------- NVRTC alone
local gpu = m.cuda_available()
local info = rule:kernel_info { dk = 32, dv = 16, B = 3, H = 4 }
local function int(x) return math.type(x) == "integer" end
T.ok("kernel_info: registers of the step kernel", int(info.registers) and info.registers > 0 and
  info.registers <= 255, tostring(info.registers))
T.ok("kernel_info: shared memory, stack and spills are byte counts", int(info.shared_bytes) and
  info.shared_bytes >= 0 and int(info.stack_bytes) and info.stack_bytes >= 0 and int(info.spill_stores) and
  info.spill_stores >= 0 and int(info.spill_loads) and info.spill_loads >= 0)
T.ok("kernel_info: block size the engine launches, within the launch bounds", int(info.block_threads) and
  info.block_threads >= 32 and info.block_threads % 32 == 0 and info.max_threads == info.block_threads)
-- the kernels of the path rule:plan picks: this rule runs fused
T.eq("kernel_info: the planned path", info.path, rule:plan { dk = 32, dv = 16, B = 3, H = 4 }.path)
T.eq("kernel_info: the step kernel of that path is described at the top", info.name,
  info.path == "fused" and "mn_fused_step_kernel" or "mn_rule_step_kernel")
T.ok("kernel_info: kernels lists the step kernel first", #info.kernels >= 1 and info.kernels[1].name == info.name)
local three = m.rule { layers = 3, hidden = 16, step = 4, theta = 0.1 }:kernel_info { dk = 8 }
T.ok("kernel_info: the general path lists step then read", three.path == "general" and #three.kernels == 2 and
  three.kernels[1].name == "mn_rule_step_kernel" and three.kernels[2].name == "mn_rule_read_kernel" and
  three.kernels[2].registers > 0)
T.ok("kernel_info: arch is the GPU's, else sm_90", info.arch == (gpu and info.arch or 90) and info.arch >= 50)
T.ok("kernel_info: compile time and cache flag", type(info.compile_ms) == "number" and info.compile_ms > 0 and
  type(info.cached) == "boolean")
T.ok("kernel_info: the cache key", type(info.key) == "string" and info.key:match("^%x+$") and #info.key == 32)
T.ok("kernel_info: sizes echoed", info.grid == 12 and info.dk == 32 and info.dv == 16 and info.hidden == 32 and
  info.precision == "fp32")
local again = rule:kernel_info { dk = 32, dv = 16, B = 3, H = 4 }
T.ok("kernel_info: asked again, it comes from the cache", again.cached == true and again.key == info.key and
  again.registers == info.registers)
local bf = rule:kernel_info { dk = 32, dv = 16, precision = "bf16" }
T.ok("kernel_info: precision makes other kernels", bf.key ~= info.key and bf.precision == "bf16")
T.eq("kernel_info: B and H do not change the kernels", rule:kernel_info { dk = 32, dv = 16 }.key, info.key)
local sm100 = rule:kernel_info { dk = 32, dv = 16, arch = 100 }
T.ok("kernel_info: another arch", sm100.arch == 100 and sm100.key ~= info.key and sm100.registers > 0 and
  sm100.occupancy == nil)
T.ok("kernel_info: defaults (dk 64)", m.rule {}:kernel_info().dk == 64)

local text = tostring(info)
T.ok("kernel_info: prints as a table", text:find("sm_%d+") and text:find("regs", 1, true) and
  text:find(info.name .. "%s+" .. info.registers), text)
T.ok("kernel_info: the REPL printer uses that table", m._pretty == nil or
  tostring(m._pretty(info)):find(info.name, 1, true) ~= nil)

T.raises("kernel_info: unknown option", function() rule:kernel_info { dk = 8, T = 3 } end, "unknown option 'T'")
T.raises("kernel_info: bad precision", function() rule:kernel_info { precision = "fp8" } end, "kernel_info:")
T.raises("kernel_info: B >= 1", function() rule:kernel_info { B = 0 } end, "B and H must be >= 1")
T.raises("kernel_info: not an option table", function() rule:kernel_info(3) end, "table expected")
T.raises("kernel_info: the code generator's errors", function()
  m.rule { residual = true }:kernel_info { dk = 8, dv = 4 }
end, "residual needs dk = dv")

-- in a fresh cache: compiled (not cached), then from memory, then from disk in another process
local tmp = io.popen("mktemp -d"):read("l")
local chunk = [[
local r = mnemo.rule{loss = "huber", delta = 0.25, step = 2}
local a = r:kernel_info{dk = 24}
local b = r:kernel_info{dk = 24}
print(("cached %s %s regs %d"):format(tostring(a.cached), tostring(b.cached), a.registers))]]
local first = run_chunk(chunk, "MNEMO_CACHE=" .. sh_quote(tmp))
local second = run_chunk(chunk, "MNEMO_CACHE=" .. sh_quote(tmp))
local regs = first:match("regs (%d+)")
T.ok("kernel_info: a fresh cache compiles, then remembers", first:find("cached false true", 1, true), first)
T.ok("kernel_info: another process reads the disk cache", second:find("cached true true regs " .. tostring(regs),
  1, true), second)
local listing = io.popen("ls " .. sh_quote(tmp .. "/kernels")):read("a")
T.ok("kernel_info: .info and .cubin files beside each other", listing:find("%x+%.info") and
  listing:find("%x+%.cubin"), listing)
os.execute("rm -rf " .. sh_quote(tmp))

-- rule:plan's z_pad: bf16's z rows widened where they fit (P1-c16's
-- shape: 16-row chunks), not in tf32, not where the rows fill the SM (P1)
do
  local c16 = mnemo.rule { layers = 2, hidden = 256, activation = "gelu", step = 16, refresh = 64 }
  local b = c16:plan { B = 4, H = 32, dk = 64, precision = "bf16", arch = 90 }
  local t = c16:plan { B = 4, H = 32, dk = 64, precision = "tf32", arch = 90 }
  -- (and w16: the weights' bf16 rows, 16 bytes a row more than P's floats: 256 + 64 rows)
  T.ok("rule:plan: z_pad in bf16 where it fits", b.path == "fused" and b.z_pad == true and t.z_pad == false and
    b.rows == t.rows and b.smem_bytes == t.smem_bytes + 16 * b.rows + 16 * (256 + 64),
    ("%s %s %s"):format(b.z_pad, b.rows, b.smem_bytes))
  T.ok("rule:plan: w16 in bf16 where W lives in the workspace", b.w16 == true and t.w16 == false,
    ("%s %s"):format(b.w16, t.w16))
  local p1 = mnemo.rule { layers = 2, hidden = 256, activation = "gelu", step = 64 }
  local bp = p1:plan { B = 4, H = 32, dk = 64, precision = "bf16", arch = 90 }
  T.ok("rule:plan: no z_pad where the rows fill the SM", bp.path == "fused" and bp.z_pad == false and bp.rows == 32,
    ("%s %s"):format(bp.z_pad, bp.rows))
  T.ok("rule:plan: no w16 where the gradient point is W", bp.w16 == false, tostring(bp.w16))
end
---------------------------------------------------------------- on a GPU
if not gpu then
  T.eq("kernel_info: no occupancy without a GPU", info.occupancy == nil and info.gpu == nil, true)
  T.eq("profile: no kernel hook without a GPU", rawget(m, "_profile_kernel_hook"), nil)
  T.skip("kernel_info/occupancy", "no GPU")
  T.skip("profile/kernel_times", "no GPU")
  T.done()
end

local occ = info.occupancy
T.ok("kernel_info: occupancy on the GPU", type(occ) == "table" and occ.blocks_per_sm > 0 and occ.fraction > 0 and
  occ.fraction <= 1 and occ.warps_per_sm == occ.blocks_per_sm * info.block_threads // 32 and occ.sms > 0 and
  occ.waves >= 1, occ and ("%s blocks/SM, %s"):format(occ.blocks_per_sm, occ.fraction))
T.ok("kernel_info: the driver agrees with ptxas", info.gpu and info.gpu.registers == info.registers and
  info.gpu.max_threads >= info.block_threads, info.gpu and ("driver %s, ptxas %s registers"):format(
  info.gpu.registers, info.registers))
T.ok("kernel_info: the general path's read kernel has occupancy too", three.kernels[2].occupancy and
  three.kernels[2].occupancy.fraction > 0)
print(info)

m.seed(3)
local B, H, Tn = 3, 4, 24
local k, v = m.randn(B, H, Tn, 32) * 0.3, m.randn(B, H, Tn, 16) * 0.3
local rep = m.profile(function()
  rule:run { k = k, v = v, device = "cuda" }
  local mem = rule:memory { B = B, H = H, dk = 32, dv = 16, device = "cuda" }
  mem:write(k, v)
  mem:read(k)
end, { quiet = true })
local ks = rep.kernels or {}
local step, read
for _, e in ipairs(ks) do
  if e.name:find(info.name, 1, true) then step = e end
  if e.name:find("mn_rule_read_kernel", 1, true) then read = e end
end
T.ok("profile: lists the kernels launched, with GPU time", #ks >= 1 and step and step.seconds > 0 and
  step.calls == 2 and read and read.calls == 1, ("%d kernels"):format(#ks))
T.ok("profile: kernel names carry the cache key", step and step.name:find(info.key:sub(1, 8), 1, true) ~= nil,
  step and step.name)
T.ok("profile: grid and block of the launch", step and step.grid[1] == B * H and step.block[1] ==
  info.block_threads and step.mean_ms > 0)
T.ok("profile: the launches one by one", type(ks.launches) == "table" and #ks.launches == 3 and ks.launched == 3 and
  ks.launches[1].ms > 0)
local inner
local outer = m.profile(function()
  rule:run { k = k, v = v, device = "cuda" }
  inner = m.profile(function() rule:run { k = k, v = v, device = "cuda" } end, { quiet = true })
end, { quiet = true })
T.ok("profile: nested profiles each count their own launches", outer.kernels[1].calls == 2 and
  inner.kernels[1].calls == 1)
local before = m.profile(function() end, { quiet = true }).kernels
T.ok("profile: nothing launched, nothing listed", #before == 0 and before.launched == 0)
local okb = pcall(m.profile, function() rule:run { k = k, v = v, device = "cuda" }; error("boom") end, { quiet = true })
rule:run { k = k, v = v, device = "cuda" } -- not profiled: not timed when timing is off again
local after = m.profile(function() end, { quiet = true }).kernels
T.ok("profile: timing stops after an error in fn", not okb and after.recorded == before.recorded + 1,
  ("recorded %s then %s"):format(before.recorded, after.recorded))
local printed = run_chunk([[
local r = mnemo.rule{theta = 0.1}
local k = mnemo.randn(2, 2, 8, 8)
mnemo.profile(function() r:run{k = k, v = k, device = "cuda"} end)]])
T.ok("profile: prints the kernel table", printed:find("kernel (GPU time)", 1, true) and
  printed:find("_step_kernel [", 1, true), printed)
T.done()
