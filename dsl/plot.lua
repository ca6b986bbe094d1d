-- plot.lua: plots through gnuplot (mnemo.plot.*):
--   curves{...}    one or more series (tensors or Lua arrays) against steps
--   heatmap{...}   a matrix of values with labelled rows and columns
-- To the terminal (gnuplot's `dumb` terminal for curves; heatmaps are drawn
-- by mnemo, since `dumb` draws no images) or to a file: .png (pngcairo, or
-- png when cairo is missing), .svg, .pdf, .txt (the text plot). Files are
-- written to a temporary name beside the target and renamed over it. Data go
-- to a temporary file that gnuplot reads; gnuplot runs through io.popen.
-- mnemo.plot{...} is mnemo.plot.curves{...}.
local M = ...

local P = {}
local fmt, concat = string.format, table.concat

-- The gnuplot to run (a command name or a path) and the Debian package that
-- has it, named in the error when it is missing.
P.program = "gnuplot"
P.package = "gnuplot-nox"

local function shell_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

-- A gnuplot single-quoted string: no escapes, '' is a quote.
local function gq(s)
  return "'" .. tostring(s):gsub("[\r\n]+", " "):gsub("'", "''") .. "'"
end

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- Facts about P.program, asked once per program: whether it runs, and its
-- terminals.
local probed = {}
local function probe()
  local prog = P.program
  if probed[prog] then return probed[prog] end
  local info = { terminals = {} }
  local h = io.popen(shell_quote(prog) .. " -e 'set terminal' </dev/null 2>&1")
  local listing = h and h:read("a") or ""
  local ok = h and h:close()
  if ok and listing:find("dumb", 1, true) then
    info.ok = true
    for name in listing:gmatch("\n%s*([%w_]+)%s") do info.terminals[name] = true end
  end
  probed[prog] = info
  return info
end

local function need_gnuplot(fname)
  local info = probe()
  if not info.ok then
    error(fmt("mnemo.plot.%s: gnuplot not found (tried '%s'); install the Debian package %s " ..
      "(apt-get install %s, or make deps)", fname, P.program, P.package, P.package), 3)
  end
  return info
end

-- Numbers as gnuplot reads them; anything not finite (or not positive on a
-- log axis) is NaN, which gnuplot leaves out.
local function num(x, positive)
  if type(x) ~= "number" or x ~= x or x == math.huge or x == -math.huge then return "NaN" end
  if positive and x <= 0 then return "NaN" end
  return fmt("%.9g", x)
end

-- A Lua array of numbers from a tensor (1-d, or any shape with one non-1
-- dim) or an array.
local function as_list(fname, what, v)
  if M.is_tensor(v) then
    local n = v:numel()
    if v.ndim > 1 then
      local big = 0
      for _, d in ipairs(v.shape) do if d > 1 then big = big + 1 end end
      if big > 1 then
        error(fmt("mnemo.plot.%s: %s must be 1-d, got %s (reduce it first, e.g. mnemo.metrics.curve)",
          fname, what, concat(v.shape, "x")), 3)
      end
    end
    if n == 0 then return {} end
    return v:contiguous():reshape(n):double():tolist()
  elseif type(v) == "table" then
    for i = 1, #v do
      if type(v[i]) ~= "number" then
        error(fmt("mnemo.plot.%s: %s[%d] is a %s, not a number", fname, what, i, type(v[i])), 3)
      end
    end
    return v
  end
  error(fmt("mnemo.plot.%s: %s must be a tensor or an array of numbers, got %s", fname, what, type(v)), 3)
end

local function tmpname()
  local p = os.tmpname()
  return p
end

-- The terminal line for an output path; nil for the screen.
local function terminal_for(fname, out, info, width, height)
  if out == nil then return nil end
  local ext = tostring(out):match("%.([%w]+)$")
  ext = ext and ext:lower()
  if ext == "png" then
    if info.terminals.pngcairo then
      return fmt("set terminal pngcairo noenhanced size %d,%d font 'sans,10'", width, height)
    end
    return fmt("set terminal png noenhanced size %d,%d", width, height)
  elseif ext == "svg" then
    return fmt("set terminal svg noenhanced size %d,%d dynamic background '#ffffff'", width, height)
  elseif ext == "pdf" then
    return fmt("set terminal pdfcairo noenhanced size %gin,%gin", width / 100, height / 100)
  elseif ext == "txt" then
    return nil, true
  end
  error(fmt("mnemo.plot.%s: out must end in .png, .svg, .pdf or .txt, got '%s'", fname, tostring(out)), 3)
end

local function screen_size()
  local cols = tonumber(os.getenv("COLUMNS") or "") or 80
  local lines = tonumber(os.getenv("LINES") or "") or 25
  return math.max(40, math.min(cols - 1, 160)), math.max(12, math.min(lines - 2, 50))
end

-- Run a gnuplot script; for a file target, write to a temporary name and
-- rename it over out. Returns gnuplot's stdout (the text plot of `dumb`).
local function run_gnuplot(fname, script, out)
  local sfile, efile = tmpname(), tmpname()
  local tmp_out = out and (out .. ".tmp")
  if tmp_out then script = script:gsub("@OUTPUT@", gq(tmp_out)) end
  local f = assert(io.open(sfile, "w"))
  f:write(script)
  f:close()
  local h = io.popen(shell_quote(P.program) .. " " .. shell_quote(sfile) .. " 2>" .. shell_quote(efile))
  local text = h:read("a")
  local ok, how, code = h:close()
  local err = read_file(efile) or ""
  os.remove(sfile)
  os.remove(efile)
  local function fail(msg)
    if tmp_out then os.remove(tmp_out) end
    error(fmt("mnemo.plot.%s: %s", fname, msg), 0)
  end
  if not ok then
    fail(fmt("gnuplot failed (%s %s): %s", tostring(how), tostring(code), err:gsub("%s+$", "")))
  end
  if tmp_out then
    local s = read_file(tmp_out)
    if not s or #s == 0 then fail("gnuplot wrote nothing to " .. tmp_out .. ": " .. err) end
    local renamed, rerr = os.rename(tmp_out, out)
    if not renamed then fail("cannot rename " .. tmp_out .. " to " .. out .. ": " .. tostring(rerr)) end
  end
  return text
end

local function write_text_file(fname, out, text)
  local tmp = out .. ".tmp"
  local f, err = io.open(tmp, "w")
  if not f then error(fmt("mnemo.plot.%s: cannot write %s: %s", fname, tmp, tostring(err)), 3) end
  f:write(text)
  f:close()
  local ok, rerr = os.rename(tmp, out)
  if not ok then
    os.remove(tmp)
    error(fmt("mnemo.plot.%s: cannot rename %s to %s: %s", fname, tmp, out, tostring(rerr)), 3)
  end
end

---------------------------------------------------------------- curves

local CURVE_OPTS = { y = 1, x = 1, label = 1, title = 1, xlabel = 1, ylabel = 1, logy = 1, logx = 1,
  out = 1, width = 1, height = 1, yrange = 1, xrange = 1, style = 1, key = 1 }

-- The series of a spec: its array part (each a tensor, an array of numbers
-- or {y =, x =, label =, style =}), or spec.y alone.
local function series_of(spec)
  local list = {}
  local n = #spec
  if n == 0 and spec.y ~= nil then
    list[1] = { y = spec.y, x = spec.x, label = spec.label }
  end
  for i = 1, n do
    local s = spec[i]
    if M.is_tensor(s) or (type(s) == "table" and type(s[1]) == "number") then
      list[#list + 1] = { y = s, label = "series " .. i }
    elseif type(s) == "table" and s.y ~= nil then
      list[#list + 1] = { y = s.y, x = s.x or spec.x, label = s.label or s.name or ("series " .. i), style = s.style }
    else
      error(fmt("mnemo.plot.curves: series %d must be a tensor, an array of numbers or {y = ..., label = ...}", i), 3)
    end
  end
  if #list == 0 then error("mnemo.plot.curves: nothing to plot (give series, or y = ...)", 3) end
  return list
end

--- mnemo.plot.curves{...}: one or more curves (see help).
function P.curves(spec)
  -- a bare tensor or array of numbers is one series
  if type(spec) ~= "table" or M.is_tensor(spec) or type(spec[1]) == "number" then spec = { y = spec } end
  for k in pairs(spec) do
    if type(k) == "string" and not CURVE_OPTS[k] then
      error(fmt("mnemo.plot.curves: unknown option '%s'", k), 2)
    end
  end
  local list = series_of(spec)
  local info = need_gnuplot("curves")
  local out = spec.out
  local sw, sh = screen_size()
  local text_file = false
  local term
  local width = spec.width or (out and 800 or sw)
  local height = spec.height or (out and 500 or sh)
  term, text_file = terminal_for("curves", out, info, width, height)
  if not term then term = fmt("set terminal dumb noenhanced size %d,%d", width, height) end

  local data = {}
  for i, s in ipairs(list) do
    local y = as_list("curves", "y of series " .. i, s.y)
    local x = s.x and as_list("curves", "x of series " .. i, s.x) or nil
    if x and #x ~= #y then
      error(fmt("mnemo.plot.curves: series %d has %d x values and %d y values", i, #x, #y), 2)
    end
    data[i] = { x = x, y = y }
  end
  local dfile = tmpname()
  local f = assert(io.open(dfile, "w"))
  local plots = {}
  for i, s in ipairs(list) do
    local x, y = data[i].x, data[i].y
    f:write(fmt("# %s\n", (tostring(s.label or ""):gsub("\n", " "))))
    for j = 1, #y do
      f:write(num(x and x[j] or j, spec.logx), " ", num(y[j], spec.logy), "\n")
    end
    f:write("\n\n")
    local style = s.style or spec.style or (#y <= 40 and "linespoints" or "lines")
    plots[#plots + 1] = fmt("%s index %d using 1:2 with %s lw 2 %s",
      i == 1 and gq(dfile) or "''", i - 1, style, s.label and ("title " .. gq(s.label)) or "notitle")
  end
  f:close()

  local lines = { term }
  if out and not text_file then lines[#lines + 1] = "set output @OUTPUT@" end
  lines[#lines + 1] = "set datafile missing 'NaN'"
  if spec.title then lines[#lines + 1] = "set title " .. gq(spec.title) end
  if spec.xlabel then lines[#lines + 1] = "set xlabel " .. gq(spec.xlabel) end
  if spec.ylabel then lines[#lines + 1] = "set ylabel " .. gq(spec.ylabel) end
  -- logx = true (base 10) or a base, e.g. logx = 2 for loads 4, 8, 16, ...
  for _, ax in ipairs({ "x", "y" }) do
    local lg = spec["log" .. ax]
    if lg then
      lines[#lines + 1] = "set logscale " .. ax .. (type(lg) == "number" and fmt(" %g", lg) or "")
    end
  end
  if out and not text_file then lines[#lines + 1] = "set grid" end
  if spec.key then lines[#lines + 1] = "set key " .. tostring(spec.key) end
  for _, ax in ipairs({ "x", "y" }) do
    local r = spec[ax .. "range"]
    if type(r) == "table" then
      lines[#lines + 1] = fmt("set %srange [%s:%s]", ax, r[1] and num(r[1]) or "*", r[2] and num(r[2]) or "*")
    end
  end
  lines[#lines + 1] = "plot " .. concat(plots, ", \\\n     ")
  if out and not text_file then lines[#lines + 1] = "unset output" end
  local ok, text = pcall(run_gnuplot, "curves", concat(lines, "\n") .. "\n", (out and not text_file) and out or nil)
  os.remove(dfile)
  if not ok then error(text, 2) end
  if text_file then
    write_text_file("curves", out, text)
    return out
  elseif out then
    return out
  end
  io.stdout:write(text)
end

---------------------------------------------------------------- heatmap

local HEAT_OPTS = { z = 1, x = 1, y = 1, title = 1, xlabel = 1, ylabel = 1, cblabel = 1, out = 1,
  width = 1, height = 1, values = 1, logz = 1 }

-- Rows of numbers from a [R,C] tensor or a nested table.
local function matrix_of(z)
  if M.is_tensor(z) then
    if z.ndim ~= 2 then
      error(fmt("mnemo.plot.heatmap: z must be a 2-d tensor [rows, cols], got %s", concat(z.shape, "x")), 3)
    end
    return z:double():tolist()
  elseif type(z) == "table" and type(z[1]) == "table" then
    local c = #z[1]
    for i, row in ipairs(z) do
      if #row ~= c then error(fmt("mnemo.plot.heatmap: row %d of z has %d values, row 1 has %d", i, #row, c), 3) end
      for j = 1, c do
        if type(row[j]) ~= "number" then error(fmt("mnemo.plot.heatmap: z[%d][%d] is not a number", i, j), 3) end
      end
    end
    return z
  end
  error("mnemo.plot.heatmap: z must be a 2-d tensor or a table of rows", 3)
end

local function labels_of(v, n, what)
  if v == nil then
    local l = {}
    for i = 1, n do l[i] = tostring(i) end
    return l
  end
  if M.is_tensor(v) then v = v:double():reshape(v:numel()):tolist() end
  if type(v) ~= "table" or #v ~= n then
    error(fmt("mnemo.plot.heatmap: %s must give %d labels", what, n), 3)
  end
  local l = {}
  for i = 1, n do l[i] = type(v[i]) == "number" and fmt("%.4g", v[i]) or tostring(v[i]) end
  return l
end

local SHADES = ".:-=+*#%@"

-- The heatmap as text: each cell a shade (low '.' to high '@') and its value.
local function text_heatmap(spec, z, xl, yl)
  local R, C = #z, #z[1]
  local lo, hi = math.huge, -math.huge
  for i = 1, R do
    for j = 1, C do
      local v = z[i][j]
      if spec.logz then v = v > 0 and math.log(v, 10) or nil end
      if v and v == v and v > -math.huge and v < math.huge then
        lo, hi = math.min(lo, v), math.max(hi, v)
      end
    end
  end
  local function shade(v)
    if spec.logz then v = v > 0 and math.log(v, 10) or nil end
    if not v or v ~= v or lo > hi then return "?" end
    local f = hi > lo and (v - lo) / (hi - lo) or 0.5
    if f ~= f then f = 0.5 end
    local i = math.floor(f * (#SHADES - 1) + 0.5) + 1
    return SHADES:sub(i, i)
  end
  local cells, w = {}, 0
  for i = 1, R do
    cells[i] = {}
    for j = 1, C do
      local s = fmt("%.3g", z[i][j])
      cells[i][j] = s
      w = math.max(w, #s)
    end
  end
  for j = 1, C do w = math.max(w, #xl[j] - 3) end
  local lw = #(spec.ylabel or "")
  for i = 1, R do lw = math.max(lw, #yl[i]) end
  local out = {}
  if spec.title then out[#out + 1] = spec.title end
  local head = { string.rep(" ", lw) }
  for j = 1, C do head[#head + 1] = fmt("%" .. (w + 3) .. "s", xl[j]) end
  if spec.xlabel then out[#out + 1] = string.rep(" ", lw) .. "   " .. spec.xlabel .. " ->" end
  if spec.ylabel then out[#out + 1] = fmt("%-" .. lw .. "s", spec.ylabel) end
  out[#out + 1] = concat(head, " ")
  for i = 1, R do
    local row = { fmt("%" .. lw .. "s", yl[i]) }
    for j = 1, C do
      local sh = shade(z[i][j])
      row[#row + 1] = sh .. sh .. fmt(" %" .. w .. "s", cells[i][j])
    end
    out[#out + 1] = concat(row, " ")
  end
  out[#out + 1] = fmt("shades: '%s' low to high%s%s", SHADES,
    spec.logz and " (log scale)" or "", spec.cblabel and (", " .. spec.cblabel) or "")
  return concat(out, "\n") .. "\n"
end

--- mnemo.plot.heatmap{z = ..., ...}: a matrix as a picture (see help).
function P.heatmap(spec)
  if M.is_tensor(spec) then spec = { z = spec } end
  if type(spec) ~= "table" then error("mnemo.plot.heatmap: expected a table {z = ..., ...}", 2) end
  for k in pairs(spec) do
    if not HEAT_OPTS[k] then error(fmt("mnemo.plot.heatmap: unknown option '%s'", tostring(k)), 2) end
  end
  if spec.z == nil then error("mnemo.plot.heatmap: z (the matrix) is missing", 2) end
  local z = matrix_of(spec.z)
  local R = #z
  local C = R > 0 and #z[1] or 0
  if R == 0 or C == 0 then error("mnemo.plot.heatmap: z is empty", 2) end
  local xl, yl = labels_of(spec.x, C, "x"), labels_of(spec.y, R, "y")
  local out = spec.out
  local ext = out and tostring(out):match("%.([%w]+)$")
  if out == nil or (ext and ext:lower() == "txt") then
    local text = text_heatmap(spec, z, xl, yl)
    if out then
      write_text_file("heatmap", out, text)
      return out
    end
    io.stdout:write(text)
    return
  end
  local info = need_gnuplot("heatmap")
  local term = terminal_for("heatmap", out, info, spec.width or 700, spec.height or 560)

  local dfile = tmpname()
  local f = assert(io.open(dfile, "w"))
  for i = 1, R do
    local row = {}
    for j = 1, C do row[j] = num(z[i][j], spec.logz) end
    f:write(concat(row, " "), "\n")
  end
  f:close()
  local function tics(labels)
    local t = {}
    for i, l in ipairs(labels) do t[i] = fmt("%s %d", gq(l), i - 1) end
    return "(" .. concat(t, ", ") .. ")"
  end
  local lines = {
    term, "set output @OUTPUT@", "set datafile missing 'NaN'",
    "set palette defined (0 '#440154', 1 '#3b528b', 2 '#21918c', 3 '#5ec962', 4 '#fde725')",
    fmt("set xrange [-0.5:%g]", C - 0.5), fmt("set yrange [%g:-0.5]", R - 0.5),
    "set xtics " .. tics(xl) .. " out nomirror", "set ytics " .. tics(yl) .. " out nomirror",
    "set tics scale 0", "set size ratio -1",
  }
  if spec.title then lines[#lines + 1] = "set title " .. gq(spec.title) end
  if spec.xlabel then lines[#lines + 1] = "set xlabel " .. gq(spec.xlabel) end
  if spec.ylabel then lines[#lines + 1] = "set ylabel " .. gq(spec.ylabel) end
  if spec.cblabel then lines[#lines + 1] = "set cblabel " .. gq(spec.cblabel) end
  if spec.logz then
    lines[#lines + 1] = "set logscale cb"
    -- gnuplot puts log tics at powers of ten only: too few on a narrow range
    local lo, hi = math.huge, -math.huge
    for i = 1, R do
      for j = 1, C do
        local v = z[i][j]
        if v > 0 and v < math.huge then lo, hi = math.min(lo, v), math.max(hi, v) end
      end
    end
    if lo < hi then
      local t = {}
      for i = 0, 4 do
        local v = lo * (hi / lo) ^ (i / 4)
        t[#t + 1] = fmt("'%.2g' %.9g", v, v)
      end
      lines[#lines + 1] = "set cbtics (" .. concat(t, ", ") .. ")"
    end
  end
  local plot = fmt("plot %s matrix with image notitle", gq(dfile))
  local values = spec.values
  if values == nil then values = R * C <= 144 end
  if values then
    -- white numbers on the dark half of the palette, black on the light half
    local lo, hi = math.huge, -math.huge
    for i = 1, R do
      for j = 1, C do
        local v = z[i][j]
        if spec.logz then v = v > 0 and math.log(v) or nil end
        if v and v == v and math.abs(v) < math.huge then lo, hi = math.min(lo, v), math.max(hi, v) end
      end
    end
    local mid = lo <= hi and (lo + hi) / 2 or 0
    local val = spec.logz and "(log($3))" or "($3)"
    for _, side in ipairs({ { "<", "#ffffff" }, { ">=", "#000000" } }) do
      plot = plot .. fmt(", %s matrix using 1:2:(%s %s %s ? sprintf('%%.3g', $3) : '') " ..
        "with labels font ',9' textcolor rgb '%s' notitle", gq(dfile), val, side[1], num(mid), side[2])
    end
  end
  lines[#lines + 1] = plot
  lines[#lines + 1] = "unset output"
  local ok, err = pcall(run_gnuplot, "heatmap", concat(lines, "\n") .. "\n", out)
  os.remove(dfile)
  if not ok then error(err, 2) end
  return out
end

--- mnemo.plot.available() -> true when gnuplot runs, and the file types it can write
function P.available()
  local info = probe()
  if not info.ok then return false end
  local types = { "txt" }
  if info.terminals.pngcairo or info.terminals.png then types[#types + 1] = "png" end
  if info.terminals.svg then types[#types + 1] = "svg" end
  if info.terminals.pdfcairo then types[#types + 1] = "pdf" end
  return true, types
end

return setmetatable(P, { __call = function(_, spec) return P.curves(spec) end })
