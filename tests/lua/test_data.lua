-- test_data.lua: the workloads of mnemo.data (dsl/data.lua): shapes and the
-- documented layout of recall, drift and text; determinism by seed and the
-- one draw each call takes from the global generator; that drift's ground
-- truth really drifts (and does not when rate = 0); that the text stream is
-- the words of the package file; saving every workload; option errors.
-- Run from the repository root: mnemo tests/lua/test_data.lua
local T = dofile("tests/lua/check.lua")
local D = mnemo.data

local function shape(t) return table.concat(t.shape, "x") end
local function same(a, b) return shape(a) == shape(b) and (a:double() - b:double()):abs():max() == 0 end
local function maxdiff(a, b) return (a:double() - b:double()):abs():max() end

T.ok("mnemo.data is a table of functions", type(D) == "table" and type(D.recall) == "function" and
  type(D.drift) == "function" and type(D.text) == "function" and type(D.decode) == "function")

---------------------------------------------------------------- recall
local B, H, P, ND, Q, dk, dv = 3, 2, 5, 4, 7, 6, 3
local r = D.recall{ B = B, H = H, pairs = P, distractors = ND, queries = Q, dk = dk, dv = dv, seed = 42 }
local TT = P + ND + Q
T.eq("recall: T = pairs + distractors + queries", r.T, TT)
T.eq("recall: k is [B,H,T,dk]", shape(r.k), ("%dx%dx%dx%d"):format(B, H, TT, dk))
T.eq("recall: q is [B,H,T,dk]", shape(r.q), shape(r.k))
T.eq("recall: v is [B,H,T,dv]", shape(r.v), ("%dx%dx%dx%d"):format(B, H, TT, dv))
T.eq("recall: target is [B,H,T,dv]", shape(r.target), shape(r.v))
T.eq("recall: target_index is [B,H,T] i64", shape(r.target_index) .. r.target_index.dtype, ("%dx%dx%di64"):format(B, H, TT))
T.eq("recall: masks are [B,H,T]", shape(r.query_mask) .. " " .. shape(r.write_mask), ("%dx%dx%d %dx%dx%d"):format(B, H, TT, B, H, TT))
T.eq("recall: keys [B,H,pairs,dk]", shape(r.keys), ("%dx%dx%dx%d"):format(B, H, P, dk))
T.eq("recall: values [B,H,pairs,dv]", shape(r.values), ("%dx%dx%dx%d"):format(B, H, P, dv))
T.eq("recall: pair_pos [B,H,pairs]", shape(r.pair_pos), ("%dx%dx%d"):format(B, H, P))
T.eq("recall: seed recorded", r.seed, 42)

-- layout, memory by memory
local layout_ok, why = true, ""
local function bad(msg) if layout_ok then layout_ok, why = false, msg end end
for b = 1, B do
  for h = 1, H do
    local qm, wm, ti = r.query_mask[b][h]:tolist(), r.write_mask[b][h]:tolist(), r.target_index[b][h]:tolist()
    local pp = r.pair_pos[b][h]:tolist()
    local seen = {}
    for i = 1, P do
      local t = pp[i]
      if t < 1 or t > P + ND or seen[t] then bad("pair position out of the context or repeated") end
      seen[t] = true
      if maxdiff(r.k[b][h][t], r.keys[b][h][i]) ~= 0 then bad("k at a pair position is not the pair's key") end
      if maxdiff(r.v[b][h][t], r.values[b][h][i]) ~= 0 then bad("v at a pair position is not the pair's value") end
    end
    local asked = {}
    for t = 1, TT do
      local isq = t > P + ND
      if (qm[t] == 1) ~= isq or wm[t] ~= 1 - qm[t] then bad("masks do not mark the last `queries` tokens") end
      if isq then
        local i = ti[t]
        if i < 1 or i > P then bad("target_index out of 1..pairs at a query") end
        asked[i] = (asked[i] or 0) + 1
        if maxdiff(r.q[b][h][t], r.keys[b][h][i]) ~= 0 then bad("q at a query is not the queried key") end
        if maxdiff(r.target[b][h][t], r.values[b][h][i]) ~= 0 then bad("target is not the queried value") end
        if r.k[b][h][t]:abs():max() ~= 0 or r.v[b][h][t]:abs():max() ~= 0 then bad("queries must write nothing (k = v = 0)") end
      else
        if ti[t] ~= 0 then bad("target_index nonzero off the queries") end
        if maxdiff(r.q[b][h][t], r.k[b][h][t]) ~= 0 then bad("q ~= k in the context") end
        if r.target[b][h][t]:abs():max() ~= 0 then bad("target nonzero off the queries") end
      end
    end
    for i = 1, P do if not asked[i] then bad("a pair was never queried though queries >= pairs") end end
  end
end
T.ok("recall: layout as documented (pairs, distractors, queries, masks, targets)", layout_ok, why)

local norms = r.keys:norm(-1)
T.near("recall: keys have norm sqrt(dk) by default", norms:min(), math.sqrt(dk), 1e-5)
T.near("recall: ... all of them", norms:max(), math.sqrt(dk), 1e-5)
local r1 = D.recall{ pairs = 4, dk = 8, key_norm = 1, seed = 1 }
T.near("recall: key_norm = 1 gives unit keys", r1.keys:norm(-1):max(), 1, 1e-5)
local first = D.recall{ pairs = 6, distractors = 6, order = "pairs_first", seed = 3 }
T.eq("recall: order = pairs_first puts pair i at position i", table.concat(first.pair_pos:view(-1):tolist(), ","), "1,2,3,4,5,6")

-- distractor values are outliers when asked
local big = D.recall{ B = 4, pairs = 8, distractors = 64, dv = 8, distractor_scale = 5, seed = 9, order = "pairs_first" }
local dvals = big.v:narrow(3, 9, 64)
local std = math.sqrt((dvals * dvals):mean())
T.ok("recall: distractor_scale scales distractor values (std ~5)", std > 4 and std < 6, "std " .. std)

-- determinism by seed
local r2 = D.recall{ B = B, H = H, pairs = P, distractors = ND, queries = Q, dk = dk, dv = dv, seed = 42 }
T.ok("recall: same seed, same tensors", same(r.k, r2.k) and same(r.v, r2.v) and same(r.q, r2.q) and
  same(r.target_index, r2.target_index) and same(r.pair_pos, r2.pair_pos))
local r3 = D.recall{ B = B, H = H, pairs = P, distractors = ND, queries = Q, dk = dk, dv = dv, seed = 43 }
T.ok("recall: another seed, other tensors", not same(r.k, r3.k) and not same(r.v, r3.v))
mnemo.seed(123)
local a = D.recall{ pairs = 4 }
mnemo.seed(123)
local b = D.recall{ pairs = 4 }
T.ok("recall: without a seed, mnemo.seed makes it repeat", same(a.k, b.k) and a.seed == b.seed)
T.ok("recall: the drawn seed is recorded and reproduces", same(D.recall{ pairs = 4, seed = a.seed }.k, a.k))
mnemo.seed(7)
D.recall{ B = 4, pairs = 64, distractors = 64, seed = 1 }
local after = mnemo.rand(3)
mnemo.seed(7)
D.text{ T = 8, seed = 2 }
T.ok("the global stream after a seeded call does not depend on its size or seed", same(after, mnemo.rand(3)))
mnemo.seed(7)
local plain = mnemo.rand(3)
T.ok("... yet it moves on (a call is not invisible)", not same(after, plain))

T.raises("recall: unknown option", function() D.recall{ pair = 3 } end, "unknown option 'pair'")
T.raises("recall: bad order", function() D.recall{ order = "sorted" } end, "order must be")
T.raises("recall: pairs must be >= 1", function() D.recall{ pairs = 0 } end, "pairs must be >= 1")
T.raises("recall: integers only", function() D.recall{ dk = 2.5 } end, "dk must be an integer")

---------------------------------------------------------------- drift
local dr = D.drift{ B = 2, H = 3, T = 200, dk = 6, dv = 4, rate = 0.01, noise = 0.2, seed = 5 }
T.eq("drift: k, q are [B,H,T,dk]", shape(dr.k) .. " " .. shape(dr.q), "2x3x200x6 2x3x200x6")
T.eq("drift: v, target, v_clean are [B,H,T,dv]", shape(dr.v) .. " " .. shape(dr.target) .. " " .. shape(dr.v_clean),
  "2x3x200x4 2x3x200x4 2x3x200x4")
T.eq("drift: maps [B,H,regimes,dv,dk]; angle [B,H,T]", shape(dr.maps) .. " " .. shape(dr.angle), "2x3x1x4x6 2x3x200")
local noise = dr.v - dr.v_clean
T.near("drift: v = v_clean + noise of std `noise`", math.sqrt((noise * noise):mean()), 0.2, 0.1)
-- at t = 1 nothing has turned yet: v_clean = A k
local A = dr.maps[1][1][1]
local k1 = dr.k[1][1][1]
T.ok("drift: at t = 1, v_clean = A k", maxdiff(dr.v_clean[1][1][1], A:matmul(k1)) < 1e-4)
local ang = dr.angle[1][1]
T.near("drift: the angle grows linearly", ang[3] - ang[2], ang[2] - ang[1], 1e-4)
T.ok("drift: the angle is rate * (0.5 .. 1.5) per token", math.abs(ang[2]) >= 0.005 - 1e-7 and math.abs(ang[2]) <= 0.015 + 1e-7,
  tostring(ang[2]))

-- the ground truth drifts: the same probe key maps elsewhere later
local fx = D.drift{ B = 4, T = 300, dk = 8, rate = 0.01, queries = "fixed", seed = 6 }
local q1, qT = fx.q[{ {}, {}, 1 }], fx.q[{ {}, {}, 300 }]
T.ok("drift: queries = 'fixed' keeps one probe key", maxdiff(q1, qT) == 0)
local t1, tT = fx.target[{ {}, {}, 1 }], fx.target[{ {}, {}, 300 }]
local moved = (tT - t1):norm() / t1:norm()
T.ok("drift: the target of a fixed probe moves (|t_T - t_1| / |t_1| > 0.5)", moved > 0.5, "moved " .. moved)
local still = D.drift{ B = 2, T = 100, dk = 8, rate = 0, queries = "fixed", seed = 6 }
T.ok("drift: rate = 0 leaves the map still", maxdiff(still.target[{ {}, {}, 1 }], still.target[{ {}, {}, 100 }]) < 1e-5)
local sw = D.drift{ T = 100, dk = 4, rate = 0, switch_every = 40, queries = "fixed", seed = 2 }
T.eq("drift: switch_every = 40 over 100 tokens gives 3 regimes", sw.maps.shape[3], 3)
local st = sw.target[1][1]
T.ok("drift: constant within a regime, new at a switch",
  maxdiff(st[1], st[40]) < 1e-5 and maxdiff(st[41], st[80]) < 1e-5 and maxdiff(st[40], st[41]) > 1e-2)
local kq = D.drift{ T = 20, dk = 4, queries = "keys", seed = 3 }
T.ok("drift: queries = 'keys' probes with k (target = v_clean)", same(kq.q, kq.k) and same(kq.target, kq.v_clean))
T.ok("drift: same seed, same stream", same(D.drift{ T = 50, seed = 8 }.v, D.drift{ T = 50, seed = 8 }.v))
T.ok("drift: another seed, another stream", not same(D.drift{ T = 50, seed = 8 }.v, D.drift{ T = 50, seed = 9 }.v))
T.raises("drift: bad queries", function() D.drift{ queries = "some" } end, "queries must be")

---------------------------------------------------------------- text
local path = D.default_text
local f = io.open(path, "rb")
if not f then
  T.skip("text workload", path .. " is missing (Debian package " .. D.default_text_package .. ")")
else
  local text = f:read("a")
  f:close()
  local words = {}
  for w in text:gmatch("[%a%d']+") do words[#words + 1] = w:lower() end
  T.eq("text: the default is the GPL-3 of base-files", path, "/usr/share/common-licenses/GPL-3")
  local tx = D.text{ B = 2, H = 2, T = 40, dk = 8, dv = 5, seed = 4 }
  T.eq("text: k [B,H,T,dk], v [B,H,T,dv]", shape(tx.k) .. " " .. shape(tx.v), "2x2x40x8 2x2x40x5")
  T.eq("text: tokens, next [B,H,T] i64", shape(tx.tokens) .. tx.tokens.dtype .. " " .. shape(tx.next), "2x2x40i64 2x2x40")
  T.eq("text: embed_k [V,dk], embed_v [V,dv]", shape(tx.embed_k) .. " " .. shape(tx.embed_v), tx.V .. "x8 " .. tx.V .. "x5")
  T.eq("text: words_total counts the file's words", tx.words_total, #words)
  T.ok("text: a vocabulary of hundreds of words", tx.V > 500 and tx.V < #words, "V = " .. tx.V)
  -- every stream is the file's words from its offset
  local from_file = true
  local offs = tx.offset:view(-1):tolist()
  for m = 1, 4 do
    local b, h = (m - 1) // 2 + 1, (m - 1) % 2 + 1
    local o = offs[m]
    local want = table.concat(words, " ", o, o + 39)
    local want_next = table.concat(words, " ", o + 1, o + 40)
    if D.decode(tx, tx.tokens[b][h]) ~= want or D.decode(tx, tx.next[b][h]) ~= want_next then from_file = false end
  end
  T.ok("text: each stream is the package file's words at its offset", from_file)
  local start = D.text{ T = 12, offset = 1, seed = 1 }
  T.eq("text: offset = 1 reads the licence's first words", D.decode(start, start.tokens[1][1]),
    "gnu general public license version 3 29 june 2007 copyright c 2007")
  -- k and v are embedding rows of the current and the next word
  local ek, ev = tx.embed_k, tx.embed_v
  local rows_ok = true
  for _, t in ipairs({ 1, 17, 40 }) do
    local id, nx = tx.tokens[1][2][t], tx.next[1][2][t]
    if maxdiff(tx.k[1][2][t], ek[id]) ~= 0 or maxdiff(tx.v[1][2][t], ev[nx]) ~= 0 then rows_ok = false end
  end
  T.ok("text: k = embed_k[w_t], v = embed_v[w_{t+1}]", rows_ok)
  local nx = tx.next[1][1]:tolist()
  local tk = tx.tokens[1][1]:tolist()
  local shifted = true
  for t = 1, 39 do if nx[t] ~= tk[t + 1] then shifted = false end end
  T.ok("text: next is tokens shifted by one", shifted)
  local same_mode = D.text{ T = 10, target = "same", seed = 4, offset = 5 }
  T.ok("text: target = 'same' stores the word itself", maxdiff(same_mode.v[1][1][3], same_mode.embed_v[same_mode.tokens[1][1][3]]) == 0)
  T.near("text: keys have norm sqrt(dk)", tx.embed_k:norm(-1):max(), math.sqrt(8), 1e-5)
  T.ok("text: same seed, same tensors", same(D.text{ T = 30, seed = 4 }.k, D.text{ T = 30, seed = 4 }.k))
  T.ok("text: another seed, other embeddings", not same(D.text{ T = 30, seed = 4 }.embed_k, D.text{ T = 30, seed = 5 }.embed_k))
  local small = D.text{ T = 30, vocab_size = 50, seed = 1 }
  T.eq("text: vocab_size cuts the vocabulary (last id <unk>)", small.V .. " " .. D.decode(small, 50), "50 <unk>")
  T.eq("text: the most frequent word has id 1", D.decode(tx, 1), "the")
  T.raises("text: a missing file is named", function() D.text{ path = "/nonexistent/words.txt" } end, "/nonexistent/words.txt")
  T.raises("text: T larger than the text", function() D.text{ T = #words + 5 } end, "too few for T")
end
-- a text of our own
local own = os.tmpname()
local fo = io.open(own, "w")
fo:write("Red fish, blue fish. Red fish; blue fish!\nOne fish two fish.")
fo:close()
local ot = D.text{ path = own, T = 5, offset = 1, seed = 1, dk = 4 }
T.eq("text: any file, split into lowercased words", D.decode(ot, ot.tokens[1][1]), "red fish blue fish red")
T.eq("text: vocabulary by frequency", D.decode(ot, { 1, 2, 3 }), "fish blue red")
os.remove(own)

---------------------------------------------------------------- saving
local base = os.tmpname()
local ok_all, detail = true, ""
for name, w in pairs({ recall = r, drift = dr, text = D.text{ T = 20, seed = 1 } }) do
  local p = base .. "-" .. name .. ".h5"
  local ok, err = pcall(mnemo.save, p, w)
  if not ok then ok_all, detail = false, name .. ": " .. tostring(err)
  else
    local back = mnemo.load(p)
    if not (back.k and same(back.k, w.k) and back.kind == name and back.seed == w.seed) then
      ok_all, detail = false, name .. ": the loaded tree differs"
    end
    os.remove(p)
  end
end
os.remove(base)
T.ok("every workload saves with mnemo.save and loads back", ok_all, detail)

T.done()
