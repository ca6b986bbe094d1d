-- data.lua: workloads as Lua functions returning tensors (mnemo.data.*):
--   recall{...}   multi-query associative recall among distractors
--   drift{...}    a noisy linear map that rotates over time (rewards forgetting)
--   text{...}     a real-text word stream from a file a Debian package ships
--   decode(d, ids) the words of token ids of a text workload
-- Every tensor is [B,H,T,d] (or [B,H,T] for per-token masks and ids), the
-- layout rule:run takes. Each workload is seeded: the same seed gives the
-- same tensors on every machine; without a seed one is drawn from the global
-- generator (so mnemo.seed(n) makes it repeat) and recorded as d.seed. A
-- call reseeds the global generator from a number drawn before it, so what
-- follows is repeatable and does not depend on the call's sizes or seed.
-- Each result is a table of tensors, numbers and strings: mnemo.save writes it.
local M = ...

local D = {}
local fmt = string.format
local floor, sqrt, cos, sin, pi = math.floor, math.sqrt, math.cos, math.sin, math.pi

---------------------------------------------------------------- helpers

-- Check opts against the known keys; name the function in every error.
local function options(fname, opts, known)
  if opts == nil then opts = {} end
  if type(opts) ~= "table" then
    error(fmt("mnemo.data.%s: expected a table of options, got %s", fname, type(opts)), 3)
  end
  for k in pairs(opts) do
    if not known[k] then
      local names = {}
      for n in pairs(known) do names[#names + 1] = n end
      table.sort(names)
      error(fmt("mnemo.data.%s: unknown option '%s' (known: %s)", fname, tostring(k),
        table.concat(names, ", ")), 3)
    end
  end
  return opts
end

local function int_opt(fname, opts, key, dflt, min)
  local v = opts[key]
  if v == nil then v = dflt end
  if math.type(v) ~= "integer" then
    if type(v) == "number" and v == floor(v) then v = floor(v)
    else error(fmt("mnemo.data.%s: %s must be an integer, got %s", fname, key, tostring(v)), 3) end
  end
  if min and v < min then
    error(fmt("mnemo.data.%s: %s must be >= %d, got %d", fname, key, min, v), 3)
  end
  return v
end

local function num_opt(fname, opts, key, dflt)
  local v = opts[key]
  if v == nil then return dflt end
  if type(v) ~= "number" then
    error(fmt("mnemo.data.%s: %s must be a number, got %s", fname, key, type(v)), 3)
  end
  return v
end

-- Run f with the global generator seeded by seed, then reseed the global
-- generator from a number drawn before, so the caller's stream goes on
-- repeatably whatever f drew. Returns the seed used (drawn when seed is nil).
local function seeded(fname, seed, f)
  local resume = M.randint(0, 2147483647, 1):item()
  if seed == nil then seed = M.randint(0, 2147483647, 1):item() end
  if math.type(seed) ~= "integer" then
    if type(seed) == "number" and seed == floor(seed) then seed = floor(seed)
    else error(fmt("mnemo.data.%s: seed must be an integer, got %s", fname, tostring(seed)), 3) end
  end
  local guard <close> = setmetatable({}, { __close = function() M.seed(resume) end })
  M.seed(seed)
  f()
  return seed
end

-- A flat Lua array of n numbers drawn from a tensor constructor.
local function draws(ctor, n)
  if n == 0 then return {} end
  return ctor(n):tolist()
end

-- Fisher-Yates permutation of 1..n from the uniforms u[at+1 ..]; returns
-- the permutation and the next free index of u.
local function permutation(n, u, at)
  local p = {}
  for i = 1, n do p[i] = i end
  for i = n, 2, -1 do
    at = at + 1
    local j = floor(u[at] * i) + 1
    if j > i then j = i end
    p[i], p[j] = p[j], p[i]
  end
  return p, at
end

-- Rows with L2 norm `norm` (default 1): [.., n, d] -> the same shape.
local function unit_rows(t, norm)
  return t / t:norm(-1, true):maximum(1e-12) * (norm or 1)
end

-- Keys: L2 norm sqrt(dk) by default (RMS 1 per feature, the scale of the
-- values); key_norm = 1 gives unit keys, as Titans normalises them.
local function key_norm_opt(fname, opts, dk)
  local n = opts.key_norm
  if n == nil then return sqrt(dk) end
  if type(n) ~= "number" or not (n > 0) then
    error(fmt("mnemo.data.%s: key_norm must be a positive number, got %s", fname, tostring(n)), 3)
  end
  return n
end

-- A [dims..., d] tensor from a flat Lua array.
local function from_flat(flat, shape, dtype)
  if #flat == 0 then return dtype and M.zeros(shape, dtype) or M.zeros(shape) end
  return (dtype and M.tensor(flat, dtype) or M.tensor(flat)):view(shape)
end

---------------------------------------------------------------- recall

local RECALL_OPTS = { B = 1, H = 1, pairs = 1, distractors = 1, queries = 1, dk = 1, dv = 1,
  seed = 1, distractor_scale = 1, order = 1, key_norm = 1 }

--- mnemo.data.recall{...}: multi-query associative recall (see help).
function D.recall(opts)
  opts = options("recall", opts, RECALL_OPTS)
  local B = int_opt("recall", opts, "B", 1, 1)
  local H = int_opt("recall", opts, "H", 1, 1)
  local P = int_opt("recall", opts, "pairs", 16, 1)
  local ND = int_opt("recall", opts, "distractors", 0, 0)
  local Q = int_opt("recall", opts, "queries", P, 1)
  local dk = int_opt("recall", opts, "dk", 16, 1)
  local dv = int_opt("recall", opts, "dv", dk, 1)
  local dscale = num_opt("recall", opts, "distractor_scale", 1)
  local knorm = key_norm_opt("recall", opts, dk)
  local order = opts.order or "random"
  if order ~= "random" and order ~= "pairs_first" then
    error("mnemo.data.recall: order must be 'random' or 'pairs_first', got " .. tostring(order), 2)
  end
  local C = P + ND
  local T = C + Q
  local nm = B * H
  local keys, values, dkeys, dvals, u
  local seed = seeded("recall", opts.seed, function()
    keys = unit_rows(M.randn(B, H, P, dk), knorm)
    values = M.randn(B, H, P, dv)
    dkeys = ND > 0 and unit_rows(M.randn(B, H, ND, dk), knorm) or nil
    dvals = ND > 0 and M.randn(B, H, ND, dv) * dscale or nil
    u = draws(M.rand, nm * (C + P + Q))
  end)
  local K = keys:view(-1):tolist()
  local V = values:view(-1):tolist()
  local DK = dkeys and dkeys:view(-1):tolist() or {}
  local DV = dvals and dvals:view(-1):tolist() or {}

  local k, v, q, tg = {}, {}, {}, {}
  local tidx, qmask, wmask, ppos = {}, {}, {}, {}
  local at = 0
  for m = 0, nm - 1 do
    -- the context: pairs and distractors, shuffled (or pairs first)
    local ctx
    if order == "random" then ctx, at = permutation(C, u, at)
    else
      ctx = {}
      for i = 1, C do ctx[i] = i end
      at = at + C - 1
    end
    local kb, vb = m * T * dk, m * T * dv
    for t = 1, C do
      local src = ctx[t]
      local ko, vo = (t - 1) * dk + kb, (t - 1) * dv + vb
      if src <= P then
        local ks, vs = (m * P + src - 1) * dk, (m * P + src - 1) * dv
        for j = 1, dk do k[ko + j] = K[ks + j]; q[ko + j] = K[ks + j] end
        for j = 1, dv do v[vo + j] = V[vs + j]; tg[vo + j] = 0 end
        ppos[m * P + src] = t
      else
        local ks, vs = (m * ND + src - P - 1) * dk, (m * ND + src - P - 1) * dv
        for j = 1, dk do k[ko + j] = DK[ks + j]; q[ko + j] = DK[ks + j] end
        for j = 1, dv do v[vo + j] = DV[vs + j]; tg[vo + j] = 0 end
      end
      tidx[m * T + t], qmask[m * T + t], wmask[m * T + t] = 0, 0, 1
    end
    -- the queries: distinct pairs while they last, then pairs again
    local asked
    asked, at = permutation(P, u, at)
    for i = 1, Q do
      local t = C + i
      local pair
      if i <= P then pair = asked[i]
      else
        at = at + 1
        pair = floor(u[at] * P) + 1
        if pair > P then pair = P end
      end
      local ko, vo = (t - 1) * dk + kb, (t - 1) * dv + vb
      local ks, vs = (m * P + pair - 1) * dk, (m * P + pair - 1) * dv
      for j = 1, dk do k[ko + j] = 0; q[ko + j] = K[ks + j] end
      for j = 1, dv do v[vo + j] = 0; tg[vo + j] = V[vs + j] end
      tidx[m * T + t], qmask[m * T + t], wmask[m * T + t] = pair, 1, 0
    end
    at = m * (C + P + Q) + C + P + Q -- each memory uses its own block of draws
  end
  return {
    kind = "recall", seed = seed,
    B = B, H = H, T = T, pairs = P, distractors = ND, queries = Q, dk = dk, dv = dv,
    distractor_scale = dscale, order = order, key_norm = knorm,
    k = from_flat(k, { B, H, T, dk }), v = from_flat(v, { B, H, T, dv }),
    q = from_flat(q, { B, H, T, dk }), target = from_flat(tg, { B, H, T, dv }),
    target_index = from_flat(tidx, { B, H, T }, "i64"),
    query_mask = from_flat(qmask, { B, H, T }), write_mask = from_flat(wmask, { B, H, T }),
    keys = keys, values = values, pair_pos = from_flat(ppos, { B, H, P }, "i64"),
  }
end

---------------------------------------------------------------- drift

local DRIFT_OPTS = { B = 1, H = 1, T = 1, dk = 1, dv = 1, rate = 1, noise = 1, switch_every = 1,
  queries = 1, seed = 1, key_norm = 1 }

--- mnemo.data.drift{...}: a rotating noisy linear regression stream (see help).
function D.drift(opts)
  opts = options("drift", opts, DRIFT_OPTS)
  local B = int_opt("drift", opts, "B", 1, 1)
  local H = int_opt("drift", opts, "H", 1, 1)
  local T = int_opt("drift", opts, "T", 256, 1)
  local dk = int_opt("drift", opts, "dk", 16, 1)
  local dv = int_opt("drift", opts, "dv", dk, 1)
  local rate = num_opt("drift", opts, "rate", 0.005)
  local noise = num_opt("drift", opts, "noise", 0.1)
  local knorm = key_norm_opt("drift", opts, dk)
  local every = opts.switch_every and int_opt("drift", opts, "switch_every", 0, 1) or 0
  local qmode = opts.queries or "fresh"
  if qmode ~= "fresh" and qmode ~= "keys" and qmode ~= "fixed" then
    error("mnemo.data.drift: queries must be 'fresh', 'keys' or 'fixed', got " .. tostring(qmode), 2)
  end
  local nm, half = B * H, dk // 2
  local regimes = every > 0 and (T + every - 1) // every or 1
  local x, qx, maps, eps, omega
  local seed = seeded("drift", opts.seed, function()
    x = unit_rows(M.randn(B, H, T, dk), knorm)
    if qmode == "fresh" then qx = unit_rows(M.randn(B, H, T, dk), knorm)
    elseif qmode == "fixed" then qx = unit_rows(M.randn(B, H, 1, dk), knorm):expand(B, H, T, dk):contiguous() end
    -- entries N(0, 1/dk): a key of norm sqrt(dk) maps to values of RMS 1
    maps = M.randn(B, H, regimes, dv, dk) / sqrt(dk)
    eps = M.randn(B, H, T, dv) * noise
    -- each coordinate plane turns at rate * (0.5 .. 1.5), either way
    local w = draws(M.rand, nm * half * 2)
    omega = {}
    for i = 1, nm * half do
      local s = w[2 * i] < 0.5 and -1 or 1
      omega[i] = s * rate * (0.5 + w[2 * i - 1])
    end
  end)
  qx = qx or x

  -- Rotate x_t in the planes (1,2), (3,4), ... by omega * (t - 1): the map
  -- at t is A_t = A_r R_t with A_r the map of t's regime.
  local function rotate(t4)
    local f = t4:view(-1):tolist()
    for m = 0, nm - 1 do
      for t = 1, T do
        local base = (m * T + t - 1) * dk
        for i = 1, half do
          local a = omega[m * half + i] * (t - 1)
          local c, s = cos(a), sin(a)
          local j = base + 2 * i - 1
          local x1, x2 = f[j], f[j + 1]
          f[j], f[j + 1] = c * x1 - s * x2, s * x1 + c * x2
        end
      end
    end
    return from_flat(f, { B, H, T, dk })
  end
  local function apply(rot)
    if regimes == 1 then
      return rot:matmul(maps:select(3, 1):transpose(3, 4)):contiguous()
    end
    local out = M.zeros(B, H, T, dv)
    for r = 1, regimes do
      local t0, len = (r - 1) * every + 1, math.min(every, T - (r - 1) * every)
      out:narrow(3, t0, len):copy(rot:narrow(3, t0, len):matmul(maps:select(3, r):transpose(3, 4)))
    end
    return out
  end
  local clean = apply(rotate(x))
  local target = qmode == "keys" and clean or apply(rotate(qx))
  -- the map's drift: the angle each memory's first plane has turned by t
  local angle = {}
  for m = 0, nm - 1 do
    for t = 1, T do angle[m * T + t] = half > 0 and omega[m * half + 1] * (t - 1) or 0 end
  end
  return {
    kind = "drift", seed = seed,
    B = B, H = H, T = T, dk = dk, dv = dv, rate = rate, noise = noise, switch_every = every,
    queries = qmode, key_norm = knorm,
    k = x, v = clean + eps, q = qx, target = target, v_clean = clean,
    maps = maps, angle = from_flat(angle, { B, H, T }),
  }
end

---------------------------------------------------------------- text

-- The default text: the GNU GPL version 3 that base-files ships on every
-- Debian system (an essential package), about 5,600 words.
D.default_text = "/usr/share/common-licenses/GPL-3"
D.default_text_package = "base-files"

-- Words of a text: runs of letters, digits and apostrophes, lowercased.
local function words_of(text, lower)
  local w = {}
  for word in text:gmatch("[%w']+") do
    w[#w + 1] = lower and word:lower() or word
  end
  return w
end

local TEXT_OPTS = { path = 1, B = 1, H = 1, T = 1, dk = 1, dv = 1, seed = 1, offset = 1,
  lowercase = 1, vocab_size = 1, target = 1, key_norm = 1 }

--- mnemo.data.text{...}: a real-text token stream (see help).
function D.text(opts)
  opts = options("text", opts, TEXT_OPTS)
  local path = opts.path or D.default_text
  local f, err = io.open(path, "rb")
  if not f then
    local hint = path == D.default_text and
      fmt(" (it comes with the Debian package %s)", D.default_text_package) or ""
    error(fmt("mnemo.data.text: cannot read '%s': %s%s", path, tostring(err), hint), 2)
  end
  local text = f:read("a")
  f:close()
  local lower = opts.lowercase ~= false
  local words = words_of(text, lower)
  local N = #words
  local B = int_opt("text", opts, "B", 1, 1)
  local H = int_opt("text", opts, "H", 1, 1)
  local T = int_opt("text", opts, "T", math.min(256, math.max(N - 1, 1)), 1)
  local dk = int_opt("text", opts, "dk", 32, 1)
  local dv = int_opt("text", opts, "dv", dk, 1)
  local knorm = key_norm_opt("text", opts, dk)
  local mode = opts.target or "next"
  if mode ~= "next" and mode ~= "same" then
    error("mnemo.data.text: target must be 'next' or 'same', got " .. tostring(mode), 2)
  end
  if T + 1 > N then
    error(fmt("mnemo.data.text: '%s' has %d words, too few for T = %d (at most %d)", path, N, T, N - 1), 2)
  end

  -- The vocabulary: by frequency (ties alphabetical), optionally cut to
  -- vocab_size words with the rest mapped to "<unk>" (the last id).
  local count = {}
  for _, w in ipairs(words) do count[w] = (count[w] or 0) + 1 end
  local vocab = {}
  for w in pairs(count) do vocab[#vocab + 1] = w end
  table.sort(vocab, function(a, b)
    if count[a] ~= count[b] then return count[a] > count[b] end
    return a < b
  end)
  local vmax = opts.vocab_size and int_opt("text", opts, "vocab_size", 0, 2) or nil
  if vmax and #vocab > vmax then
    for i = #vocab, vmax, -1 do vocab[i] = nil end
    vocab[vmax] = "<unk>"
  end
  local id = {}
  for i, w in ipairs(vocab) do id[w] = i end
  local unk = id["<unk>"]
  local V = #vocab

  local offset = opts.offset
  local ek, ev, u
  local seed = seeded("text", opts.seed, function()
    ek = unit_rows(M.randn(V, dk), knorm)
    ev = M.randn(V, dv)
    u = draws(M.rand, B * H)
  end)
  local EK, EV = ek:view(-1):tolist(), ev:view(-1):tolist()
  local k, v, tok, nxt, offs = {}, {}, {}, {}, {}
  for m = 0, B * H - 1 do
    -- stream m reads words o .. o + T (1-based), one more for the next word
    local o
    if offset then
      o = int_opt("text", opts, "offset", 1, 1) + m * T
      o = (o - 1) % (N - T) + 1
    else
      o = floor(u[m + 1] * (N - T)) + 1
      if o > N - T then o = N - T end
    end
    offs[m + 1] = o
    for t = 1, T do
      local a = id[words[o + t - 1]] or unk
      local b = id[words[o + t]] or unk
      local out = mode == "next" and b or a
      tok[m * T + t], nxt[m * T + t] = a, b
      local ko, vo = (m * T + t - 1) * dk, (m * T + t - 1) * dv
      local ks, vs = (a - 1) * dk, (out - 1) * dv
      for j = 1, dk do k[ko + j] = EK[ks + j] end
      for j = 1, dv do v[vo + j] = EV[vs + j] end
    end
  end
  local kt = from_flat(k, { B, H, T, dk })
  return {
    kind = "text", seed = seed, path = path, words_total = N,
    B = B, H = H, T = T, dk = dk, dv = dv, V = V, target = mode, key_norm = knorm,
    lowercase = lower,
    k = kt, v = from_flat(v, { B, H, T, dv }), q = kt,
    tokens = from_flat(tok, { B, H, T }, "i64"), next = from_flat(nxt, { B, H, T }, "i64"),
    offset = from_flat(offs, { B, H }, "i64"),
    embed_k = ek, embed_v = ev,
    vocab = table.concat(vocab, "\n"),
  }
end

--- mnemo.data.decode(d, ids): the words of token ids (1-based) as a string.
function D.decode(d, ids)
  if type(d) ~= "table" or type(d.vocab) ~= "string" then
    error("mnemo.data.decode: the first argument must be a mnemo.data.text result (it has .vocab)", 2)
  end
  local vocab = {}
  for w in (d.vocab .. "\n"):gmatch("([^\n]*)\n") do vocab[#vocab + 1] = w end
  local list = ids
  if M.is_tensor(ids) then list = ids:contiguous():view(-1):tolist()
  elseif type(ids) == "number" then list = { ids } end
  if type(list) ~= "table" then
    error("mnemo.data.decode: ids must be a tensor, a number or a table of numbers", 2)
  end
  local out = {}
  for i, n in ipairs(list) do
    out[i] = vocab[math.tointeger(n) or -1] or "<?>"
  end
  return table.concat(out, " ")
end

return D
