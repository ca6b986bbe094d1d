-- test_plot.lua: mnemo.plot (dsl/plot.lua) through gnuplot: curves and
-- heatmaps to PNG (a real picture: signature, IHDR with the asked width and
-- height, a plausible size), SVG and text files; curves drawn in the
-- terminal; files written to a temporary name and renamed (an old file
-- survives a failed plot); the error that names the Debian package when
-- gnuplot is missing; bad input.
-- Run from the repository root: mnemo tests/lua/test_plot.lua
local T = dofile("tests/lua/check.lua")
local P = mnemo.plot

local base = os.tmpname()
local made = { base }
local function path(name) local p = base .. "-" .. name; made[#made + 1] = p; return p end
local function read(p)
  local f = io.open(p, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end
local function exists(p) return read(p) ~= nil end

-- PNG: 8-byte signature, then the IHDR chunk (length 13) with width and
-- height as big-endian 32-bit numbers.
local function png_info(p)
  local s = read(p)
  if not s or #s < 33 then return nil, "missing or too short" end
  if s:sub(1, 8) ~= "\137PNG\r\n\26\n" then return nil, "no PNG signature" end
  if s:sub(13, 16) ~= "IHDR" then return nil, "no IHDR chunk first" end
  local w, h = string.unpack(">I4I4", s, 17)
  return { width = w, height = h, size = #s, iend = s:sub(-8, -5) == "IEND" }
end

T.ok("mnemo.plot has curves and heatmap", type(P.curves) == "function" and type(P.heatmap) == "function")
local ok_gp, types = P.available()
if not ok_gp then
  T.skip("plots through gnuplot", "gnuplot is not installed (Debian package gnuplot-nox)")
else
  T.ok("available(): gnuplot writes png and svg here", table.concat(types, ","):find("png") and
    table.concat(types, ","):find("svg"), table.concat(types, ","))

  local y1, y2 = {}, mnemo.linspace(0, 1, 50)
  for i = 1, 50 do y1[i] = math.exp(-i / 10) end

  -- curves to PNG
  local png = path("curves.png")
  local ret = P.curves{ { y = y1, label = "decay" }, { y = y2, label = "ramp" }, title = "two curves",
    xlabel = "step", ylabel = "value", out = png, width = 640, height = 400 }
  T.eq("curves: returns the path written", ret, png)
  local info, why = png_info(png)
  T.ok("curves: a PNG file", info ~= nil, why)
  info = info or {}
  T.ok("curves: IHDR width and height as asked (640x400)", info.width == 640 and info.height == 400,
    tostring(info.width) .. "x" .. tostring(info.height))
  T.ok("curves: more than an empty canvas (> 5 KB) and complete (IEND)", (info.size or 0) > 5000 and info.iend,
    tostring(info.size))
  T.ok("curves: no temporary file left", not exists(png .. ".tmp"))

  -- an overwrite replaces the old file
  local before = read(png)
  P.curves{ y = y1, out = png, width = 320, height = 200, logy = true }
  local info2 = png_info(png) or {}
  T.ok("curves: a second plot replaces the file", info2.width == 320 and read(png) ~= before)

  -- SVG and text
  local svg = path("curves.svg")
  P.curves{ y = y2, x = mnemo.arange(50) * 2, title = "svg <curve>", out = svg }
  local s = read(svg) or ""
  T.ok("curves: an SVG file", s:find("<svg", 1, true) ~= nil and s:find("</svg>", 1, true) ~= nil)
  local txt = path("curves.txt")
  P.curves{ y = y1, title = "text title", out = txt, width = 70, height = 20 }
  local t = read(txt) or ""
  T.ok("curves: a text plot file with its title and a frame", t:find("text title", 1, true) and t:find("+---", 1, true),
    t:sub(1, 200))

  -- curves in the terminal: written to io.stdout
  local captured = {}
  local real = io.stdout
  io.stdout = { write = function(_, ...) for _, x in ipairs({ ... }) do captured[#captured + 1] = x end end }
  local okterm, errterm = pcall(P.curves, { y = y1, title = "on screen", width = 60, height = 16 })
  io.stdout = real
  local screen = table.concat(captured)
  T.ok("curves: drawn in the terminal (dumb) when no out is given", okterm and screen:find("on screen", 1, true) and
    #screen > 200, tostring(errterm) .. screen:sub(1, 100))
  captured = {}
  io.stdout = { write = function(_, ...) for _, x in ipairs({ ... }) do captured[#captured + 1] = x end end }
  local okcall = pcall(P, { y = y1, title = "called", width = 50, height = 12 })
  io.stdout = real
  T.ok("mnemo.plot{...} is mnemo.plot.curves{...}", okcall and table.concat(captured):find("called", 1, true))

  -- non-finite and non-positive values on a log axis are left out, not fatal
  local holes = path("holes.png")
  local okh, errh = pcall(P.curves, { y = { 1, 0 / 0, 3, -1, 5, math.huge, 0.5 }, logy = true, out = holes })
  T.ok("curves: NaN, Inf and non-positive values (logy) are skipped", okh and png_info(holes) ~= nil, tostring(errh))

  -- heatmaps
  mnemo.seed(1)
  local z = mnemo.rand(4, 5)
  local hpng = path("heat.png")
  P.heatmap{ z = z, x = { 0, 0.001, 0.01, 0.1, 1 }, y = { "a", "b", "c", "d" }, title = "heat", xlabel = "alpha",
    ylabel = "eta", out = hpng, width = 500, height = 400 }
  local hi, hwhy = png_info(hpng)
  T.ok("heatmap: a PNG picture of the asked size", hi and hi.width == 500 and hi.height == 400 and hi.size > 5000,
    hwhy or (hi and (hi.width .. "x" .. hi.height .. " " .. hi.size)))
  local hlog = path("heatlog.png")
  T.ok("heatmap: logz to a file", pcall(P.heatmap, { z = z + 0.1, logz = true, out = hlog }) and png_info(hlog) ~= nil)
  local htxt = path("heat.txt")
  P.heatmap{ z = { { 1, 2 }, { 3, 4 } }, x = { "lo", "hi" }, y = { 10, 20 }, title = "grid", out = htxt }
  local ht = read(htxt) or ""
  T.ok("heatmap: text form with labels, values and shades",
    ht:find("grid", 1, true) and ht:find("lo", 1, true) and ht:find("20", 1, true) and ht:find("@@ ", 1, true) and
    ht:find(".. ", 1, true) and ht:find("low to high", 1, true), ht)

  T.raises("heatmap: z must be 2-d", function() P.heatmap{ z = mnemo.zeros(2, 2, 2) } end, "2-d")
  T.raises("heatmap: labels must fit", function() P.heatmap{ z = mnemo.zeros(2, 3), x = { 1, 2 }, out = hpng } end,
    "x must give 3 labels")
  T.raises("curves: y must be 1-d", function() P.curves{ y = mnemo.zeros(3, 4) } end, "must be 1-d")
  T.raises("curves: x and y lengths", function() P.curves{ y = { 1, 2, 3 }, x = { 1, 2 } } end, "2 x values and 3 y values")
  T.raises("curves: unknown file type", function() P.curves{ y = { 1, 2 }, out = path("p.bmp") } end, "must end in .png")
  T.raises("curves: unknown option", function() P.curves{ y = { 1, 2 }, colour = "red" } end, "unknown option 'colour'")

  -- a gnuplot that fails: the error carries its message, the old file stays
  local fake = path("fake-gnuplot.sh")
  local f = io.open(fake, "w")
  f:write("#!/bin/sh\nif [ \"$1\" = -e ]; then echo '  dumb  ascii art'; echo '  png  PNG images'; exit 0; fi\n",
    "echo 'fake gnuplot: plotting failed' >&2\nexit 1\n")
  f:close()
  os.execute("chmod +x '" .. fake .. "'")
  local keep = read(png)
  P.program = fake
  local okf, errf = pcall(P.curves, { y = y1, out = png })
  P.program = "gnuplot"
  T.ok("a failed plot raises gnuplot's message", not okf and tostring(errf):find("plotting failed", 1, true), tostring(errf))
  T.ok("a failed plot leaves the old file as it was", read(png) == keep and not exists(png .. ".tmp"))
end

-- gnuplot missing: a clear error naming the package
P.program = "/nonexistent/bin/gnuplot"
T.raises("missing gnuplot: the error names the Debian package", function() P.curves{ y = { 1, 2, 3 } } end, "gnuplot-nox")
T.raises("missing gnuplot: heatmaps to files too", function() P.heatmap{ z = { { 1 } }, out = path("x.png") } end,
  "gnuplot not found")
T.ok("missing gnuplot: available() says so", P.available() == false)
P.program = "gnuplot"

for _, p in ipairs(made) do os.remove(p) end
T.done()
