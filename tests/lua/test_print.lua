-- test_print.lua: the text of tensors (dsl/l_tensor_print.c, __tostring),
-- compared exactly. Run from the repository root:
--   mnemo tests/lua/test_print.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

local function lines(...) return table.concat({...}, "\n") end

local function same(name, t, want)
  local got = tostring(t)
  if got == want then return T.ok(name, true) end
  T.ok(name, false, ("\n--- got\n%s\n--- want\n%s"):format(got, want))
end

same("2x3 f32 with decimals", m.tensor({{1.5, 2, 3}, {4, 5, 6}}), lines(
  " 1.5000  2.0000  3.0000",
  " 4.0000  5.0000  6.0000",
  "[mnemo.Tensor f32 cpu 2x3]"))

same("2x3 integers", m.arange(6):view(2, 3), lines(
  " 0  1  2",
  " 3  4  5",
  "[mnemo.Tensor f32 cpu 2x3]"))

same("negative values use the sign column", m.tensor({{-1.25, 2}, {3, 4}}, "f64"), lines(
  "-1.2500  2.0000",
  " 3.0000  4.0000",
  "[mnemo.Tensor f64 cpu 2x2]"))

same("1-d is one row", m.tensor({1, 2, 3}), lines(
  " 1  2  3",
  "[mnemo.Tensor f32 cpu 3]"))

same("0-d float", m.tensor(3.5), lines(
  "3.5000",
  "[mnemo.Tensor f32 cpu scalar]"))

same("0-d integer", m.tensor(2), lines(
  "2",
  "[mnemo.Tensor f32 cpu scalar]"))

same("0-d tiny uses e notation", m.tensor(1e-5, "f64"), lines(
  "1.0000e-05",
  "[mnemo.Tensor f64 cpu scalar]"))

same("i64", m.tensor({{1, 2}, {3, 40}}, "i64"), lines(
  "  1   2",
  "  3  40",
  "[mnemo.Tensor i64 cpu 2x2]"))

same("i64 beyond 2^53 prints exactly", m.tensor({9007199254740993}, "i64"), lines(
  " 9007199254740993",
  "[mnemo.Tensor i64 cpu 1]"))

same("small values get a scale line", m.tensor({1e-5, 2e-5, 3.5e-5}, "f64"), lines(
  "1e-05 *",
  " 1.0000  2.0000  3.5000",
  "[mnemo.Tensor f64 cpu 3]"))

same("large values get a scale line", m.tensor({1500, 2500.5}, "f64"), lines(
  "1000 *",
  " 1.5000  2.5005",
  "[mnemo.Tensor f64 cpu 2]"))

same("a wide range uses e notation", m.tensor({1e-8, 1, 1e5}, "f64"), lines(
  " 1.0000e-08  1.0000e+00  1.0000e+05",
  "[mnemo.Tensor f64 cpu 3]"))

same("nan and inf among decimals", m.tensor({0 / 0, 1 / 0, -1 / 0, 1.5}), lines(
  "    nan     inf    -inf  1.5000",
  "[mnemo.Tensor f32 cpu 4]"))

same("nan and inf among integers", m.tensor({0 / 0, 1 / 0, -1 / 0, 1}), lines(
  " nan  inf -inf    1",
  "[mnemo.Tensor f32 cpu 4]"))

same("negative zero prints as 0", m.tensor({-0.0, 1}), lines(
  " 0  1",
  "[mnemo.Tensor f32 cpu 2]"))

same("3-d blocks", m.arange(8):view(2, 2, 2), lines(
  "(1,.,.) =",
  " 0  1",
  " 2  3",
  "",
  "(2,.,.) =",
  " 4  5",
  " 6  7",
  "[mnemo.Tensor f32 cpu 2x2x2]"))

same("empty", m.zeros(0, 3), "[mnemo.Tensor f32 cpu 0x3]")

same("a transposed view prints in its own order", m.arange(6):view(2, 3):t(), lines(
  " 0  3",
  " 1  4",
  " 2  5",
  "[mnemo.Tensor f32 cpu 3x2]"))

same("wide rows split into column blocks", m.ones(2, 12) * 0.5, lines(
  "Columns 1 to 10",
  (" 0.5000"):rep(10, " "),
  (" 0.5000"):rep(10, " "),
  "",
  "Columns 11 to 12",
  " 0.5000  0.5000",
  " 0.5000  0.5000",
  "[mnemo.Tensor f32 cpu 2x12]"))

same("long 1-d rows wrap", m.arange(30), lines(
  "  0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19",
  " 20  21  22  23  24  25  26  27  28  29",
  "[mnemo.Tensor f32 cpu 30]"))

same("a 100x100 is truncated", m.arange(10000):view(100, 100), lines(
  "    0     1     2   ...    97    98    99",
  "  100   101   102   ...   197   198   199",
  "  200   201   202   ...   297   298   299",
  "  ...",
  " 9700  9701  9702   ...  9797  9798  9799",
  " 9800  9801  9802   ...  9897  9898  9899",
  " 9900  9901  9902   ...  9997  9998  9999",
  "[mnemo.Tensor f32 cpu 100x100]"))

T.ok("1000 elements are not truncated", tostring(m.zeros(10, 100)):find("...", 1, true) == nil)
T.ok("1001 elements are truncated", tostring(m.zeros(7, 143)):find("...", 1, true) ~= nil)

same("a long 1-d is truncated", m.arange(2000), lines(
  "    0     1     2   ...  1997  1998  1999",
  "[mnemo.Tensor f32 cpu 2000]"))

same("truncated 3-d blocks", m.arange(4000):view(2, 2, 1000), lines(
  "(1,.,.) =",
  "    0     1     2   ...   997   998   999",
  " 1000  1001  1002   ...  1997  1998  1999",
  "",
  "(2,.,.) =",
  " 2000  2001  2002   ...  2997  2998  2999",
  " 3000  3001  3002   ...  3997  3998  3999",
  "[mnemo.Tensor f32 cpu 2x2x1000]"))

do -- a truncated leading dim shows "..." between blocks
  local s = tostring(m.zeros(8, 2, 100))
  T.ok("truncated leading dim: first block", s:find("(1,.,.) =", 1, true) ~= nil)
  T.ok("truncated leading dim: last block", s:find("(8,.,.) =", 1, true) ~= nil)
  T.ok("truncated leading dim: no middle block", s:find("(4,.,.) =", 1, true) == nil)
  T.ok("truncated leading dim: ellipsis", s:find("\n...\n", 1, true) ~= nil)
end

do -- the scale is taken over the shown elements only, and print goes through __tostring
  local t = m.randn(50, 50)
  local s = tostring(t)
  T.ok("summary line ends the text", s:sub(-#"[mnemo.Tensor f32 cpu 50x50]") == "[mnemo.Tensor f32 cpu 50x50]")
  T.ok("no trailing spaces", s:find(" \n", 1, true) == nil)
end

T.done()
