-- prelude.lua: the Lua side of the user's experience, run at start-up with
-- the mnemo module table as `...`: the pretty printer behind REPL results
-- (mnemo._repl_show, mnemo._pretty), help() and who(), which are also made
-- globals. The help texts themselves are data, in help.lua ("mnemo.help").
local M = ...

local concat, sort, insert = table.concat, table.sort, table.insert
local fmt = string.format
local out = io.stdout

---------------------------------------------------------------- tensors

-- The binding's metatable, looked up when needed (the binding may create it
-- after the prelude runs).
local function tensor_mt()
  return debug.getregistry()["mnemo.Tensor"]
end

local function is_tensor(v)
  local mt = tensor_mt()
  return mt ~= nil and type(v) == "userdata" and debug.getmetatable(v) == mt
end

-- The methods of a tensor, as a {name = function} table.
local function tensor_methods()
  local mt, res = tensor_mt(), {}
  if mt == nil then return res end
  for _, src in ipairs({ rawget(mt, "__index"), rawget(mt, "__methods") }) do
    if type(src) == "table" then
      for k, v in pairs(src) do
        if type(k) == "string" and type(v) == "function" then res[k] = v end
      end
    end
  end
  return res
end

-- A tensor's text ends with its summary line, "[mnemo.Tensor f32 cpu 2x3]".
local function summary_line(s)
  return (s:match("([^\n]*)\n*$"))
end

---------------------------------------------------------- pretty printer

local KEYWORDS = {}
for w in ([[and break do else elseif end false for function goto if in local
  nil not or repeat return then true until while]]):gmatch("%a+") do KEYWORDS[w] = true end

local MAX_DEPTH, MAX_ITEMS, WIDTH = 4, 50, 78

local function quote(s)
  return (fmt("%q", s):gsub("\\\n", "\\n"))
end

local function is_ident(k)
  return type(k) == "string" and k:match("^[%a_][%w_]*$") ~= nil and not KEYWORDS[k]
end

local TYPE_ORDER = { number = 1, string = 2, boolean = 3 }

local function key_less(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return (TYPE_ORDER[ta] or 9) < (TYPE_ORDER[tb] or 9) or
    ((TYPE_ORDER[ta] or 9) == (TYPE_ORDER[tb] or 9) and ta < tb) end
  if ta == "number" or ta == "string" then return a < b end
  return tostring(a) < tostring(b)
end

-- 1..n first (the sequence), then the other keys sorted.
local function ordered_keys(t)
  local n = 0
  while rawget(t, n + 1) ~= nil do n = n + 1 end
  local rest = {}
  for k in next, t do
    if not (math.type(k) == "integer" and k >= 1 and k <= n) then rest[#rest + 1] = k end
  end
  sort(rest, key_less)
  return n, rest
end

local render

local function render_table(t, depth, indent, path)
  if path[t] then return "<cycle: " .. tostring(t) .. ">" end
  local n, rest = ordered_keys(t)
  local total = n + #rest
  if total == 0 then return "{}" end
  if depth >= MAX_DEPTH then return fmt("{...%d}", total) end
  path[t] = true
  local items, shown = {}, 0
  local function add(s)
    shown = shown + 1
    items[#items + 1] = s
  end
  local inner = indent .. "  "
  for i = 1, n do
    if shown >= MAX_ITEMS then break end
    add(render(rawget(t, i), depth + 1, inner, path, true))
  end
  for _, k in ipairs(rest) do
    if shown >= MAX_ITEMS then break end
    local ks = is_ident(k) and k or "[" .. render(k, depth + 1, inner, path, true) .. "]"
    add(ks .. " = " .. render(rawget(t, k), depth + 1, inner, path, true))
  end
  path[t] = nil
  if total > shown then items[#items + 1] = fmt("... (%d more)", total - shown) end
  local one = "{" .. concat(items, ", ") .. "}"
  if #one + #indent <= WIDTH and not one:find("\n", 1, true) then return one end
  return "{\n" .. inner .. concat(items, ",\n" .. inner) .. "\n" .. indent .. "}"
end

-- nested: inside a table (strings quoted, tensors on one line).
render = function(v, depth, indent, path, nested)
  local tv = type(v)
  if tv == "string" then return nested and quote(v) or v end
  if is_tensor(v) then
    local s = tostring(v)
    return nested and summary_line(s) or s
  end
  if tv == "table" then
    local mt = debug.getmetatable(v)
    if not (mt and rawget(mt, "__tostring")) then return render_table(v, depth, indent, path) end
  end
  local s = tostring(v)
  -- inside a table, an object that prints on several lines shows its first
  if nested and s:find("\n", 1, true) then s = s:match("^[^\n]*") .. " ..." end
  return s
end

--- mnemo._pretty(v): the text the REPL shows for v.
function M._pretty(v)
  return render(v, 0, "", {}, false)
end

--- mnemo._repl_show(...): print the results of a REPL line. All nil: nothing.
function M._repl_show(...)
  local n, any, parts, multi = select("#", ...), false, {}, false
  for i = 1, n do
    local v = select(i, ...)
    if v ~= nil then any = true end
    parts[i] = M._pretty(v)
    if parts[i]:find("\n", 1, true) then multi = true end
  end
  if any then out:write(concat(parts, multi and "\n" or "\t"), "\n") end
end

---------------------------------------------------------------- help

local function help_data()
  local ok, H = pcall(require, "mnemo.help")
  if ok and type(H) == "table" then return H end
  return { tour = "(help texts missing from this build)\n", entries = {} }
end

-- Write s, then a newline unless s ends with one.
local function say(s)
  out:write(s)
  if s:sub(-1) ~= "\n" then out:write("\n") end
end

-- Function -> its names ("mnemo.zeros", "Tensor:sum"), mnemo's first.
local function function_names()
  local names = {}
  local function add(f, name)
    names[f] = names[f] or {}
    insert(names[f], name)
  end
  for k, v in pairs(M) do
    if type(v) == "function" and type(k) == "string" and k:sub(1, 1) ~= "_" then
      add(v, "mnemo." .. k)
    end
  end
  for k, v in pairs(tensor_methods()) do
    if k:sub(1, 1) ~= "_" then add(v, "Tensor:" .. k) end
  end
  for _, list in pairs(names) do sort(list) end
  return names
end

local function opdoc(name)
  local docs = rawget(M, "_opdocs")
  local d = type(docs) == "table" and docs[name] or nil
  if type(d) == "table" then d = d.doc end
  return type(d) == "string" and d or nil
end

-- Break s into lines of at most width: the first starts with first, the
-- others with indent.
local function wrap(s, width, first, indent)
  local lines, line = {}, first
  for word in s:gmatch("%S+") do
    if #line + 1 + #word > width and line:find("%S") then
      lines[#lines + 1] = line
      line = indent .. word
    else
      line = (line:find("%S") and not line:find("%s$")) and line .. " " .. word or line .. word
    end
  end
  if line:find("%S") then lines[#lines + 1] = line end
  return concat(lines, "\n")
end

-- A one-line doc "sig -> what" as the signature, then the rest wrapped.
local function format_doc(doc)
  local sig, rest = doc:match("^(.-)%s+%->%s+(.*)$")
  if not sig then return wrap(doc, WIDTH, "", "  ") end
  return wrap(sig, WIDTH, "", "    ") .. "\n" .. wrap(rest, WIDTH, "  -> ", "     ")
end

-- The text for "mnemo.x" or "Tensor:x": the doc beside the code
-- (mnemo._docs), else help.lua's entry, else the op list; then the notes.
local function entry_text(key, without_notes)
  local H = help_data()
  local docs = rawget(M, "_docs")
  local d = type(docs) == "table" and docs[key] or nil
  local text = type(d) == "string" and format_doc(d) or H.entries[key]
  if not text then
    local name = key:match("^mnemo%.([%w_]+)$") or key:match("^Tensor:([%w_]+)$")
    local od = name and opdoc(name)
    if od then text = format_doc(key .. "(...) -> " .. od) end
  end
  if text and H.notes and H.notes[key] and not without_notes then text = text .. "\n" .. H.notes[key] end
  return text
end

-- Every name help knows.
local function all_keys()
  local keys, seen = {}, {}
  local function add(k) if not seen[k] then seen[k] = true; keys[#keys + 1] = k end end
  for k in pairs(help_data().entries) do add(k) end
  local docs = rawget(M, "_docs")
  if type(docs) == "table" then
    for k in pairs(docs) do if type(k) == "string" then add(k) end end
  end
  for k, v in pairs(M) do
    if type(k) == "string" and k:sub(1, 1) ~= "_" and type(v) == "function" then add("mnemo." .. k) end
  end
  for k in pairs(tensor_methods()) do if k:sub(1, 1) ~= "_" then add("Tensor:" .. k) end end
  for k in pairs(help_data().topics or {}) do add(k) end
  sort(keys)
  return keys
end

local function distance(a, b)
  if #a > #b then a, b = b, a end
  local prev = {}
  for j = 0, #a do prev[j] = j end
  for i = 1, #b do
    local cur = { [0] = i }
    for j = 1, #a do
      local cost = a:byte(j) == b:byte(i) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#a]
end

local function close_names(word)
  local bare = word:gsub("^.*[.:]", ""):lower()
  local scored = {}
  for _, k in ipairs(all_keys()) do
    local kb = k:gsub("^.*[.:]", ""):lower()
    local d = distance(bare, kb)
    if #bare >= 3 and kb:find(bare, 1, true) then d = math.min(d, 1) end
    if d <= math.max(1, math.min(2, #bare // 3)) then scored[#scored + 1] = { k, d } end
  end
  sort(scored, function(x, y) return x[2] < y[2] or (x[2] == y[2] and x[1] < y[1]) end)
  local res = {}
  for i = 1, math.min(6, #scored) do res[i] = scored[i][1] end
  return res
end

local function no_help(what)
  local msg = "no help for " .. what
  local close = close_names(what)
  if #close > 0 then msg = msg .. "; did you mean " .. concat(close, ", ") .. "?" end
  say(msg)
end

-- Columns of names, as ls prints them.
local function columns(names, width)
  width = width or WIDTH
  local w = 0
  for _, n in ipairs(names) do w = math.max(w, #n) end
  w = w + 2
  local per = math.max(1, width // w)
  local lines, line = {}, {}
  for i, n in ipairs(names) do
    line[#line + 1] = n .. string.rep(" ", w - #n)
    if #line == per or i == #names then
      lines[#lines + 1] = "  " .. concat(line):gsub("%s+$", "")
      line = {}
    end
  end
  return concat(lines, "\n")
end

local function list_module()
  local names = {}
  for k, v in pairs(M) do
    if type(k) == "string" and k:sub(1, 1) ~= "_" and type(v) == "function" then names[#names + 1] = k end
  end
  sort(names)
  local lines = { "mnemo: the module (help(\"mnemo.NAME\") or help(mnemo.NAME) for one)" }
  for _, k in ipairs(names) do
    local e = entry_text("mnemo." .. k, true) or ""
    -- the text after the signature, on one line, cut to fit
    local summary = e:gsub("^[^\n]*\n", ""):gsub("%s+", " "):gsub("^ ?%->", ""):gsub("^ ", "")
    if #summary > WIDTH - 17 then summary = summary:sub(1, WIDTH - 20):gsub("%s*%S*$", "") .. " ..." end
    lines[#lines + 1] = fmt("  %-14s %s", k, summary)
  end
  say(concat(lines, "\n"))
end

local function list_methods(header)
  local names = {}
  for k in pairs(tensor_methods()) do if k:sub(1, 1) ~= "_" then names[#names + 1] = k end end
  sort(names)
  if #names == 0 then return say(header .. "(no tensor methods in this build)") end
  say(header .. "methods (help(\"Tensor:NAME\") for one):\n" .. columns(names) ..
    "\nfields: t.shape, t.dtype, t.device, t.ndim")
end

local LUA_LIBS = { "string", "table", "math", "io", "os", "coroutine", "utf8", "debug" }

-- "print" or "string.format" when f is one of Lua's own functions.
local function lua_name(f)
  for k, v in pairs(_G) do
    if v == f and type(k) == "string" then return k end
  end
  for _, lib in ipairs(LUA_LIBS) do
    local t = rawget(_G, lib)
    if type(t) == "table" then
      for k, v in pairs(t) do if v == f then return lib .. "." .. k end end
    end
  end
end

local function help_function(f)
  local names = function_names()[f]
  if names then
    local shown = {}
    for _, n in ipairs(names) do
      local e = entry_text(n)
      if e and not shown[e] then shown[e] = true; say(e) end
    end
    if next(shown) == nil then say("no help for " .. concat(names, ", ") .. " yet") end
    return
  end
  local ln = lua_name(f)
  if ln then
    return say(fmt("%s is Lua's own; see https://www.lua.org/manual/5.4/manual.html#pdf-%s", ln, ln))
  end
  local info = debug.getinfo(f, "S")
  if info and info.what == "Lua" then
    return say(fmt("no help for this function: it is Lua code defined at %s:%d",
      info.short_src, info.linedefined))
  end
  say("no help for " .. tostring(f))
end

local function help_name(s)
  local H = help_data()
  local word = s:gsub("^%s+", ""):gsub("%s+$", ""):gsub("%(%)$", "")
  if word == "" or word == "tour" then return say(H.tour) end
  if word == "mnemo" then return list_module() end
  if word == "Tensor" or word == "tensor" then return list_methods("Tensor: ") end
  if H.topics and H.topics[word] then return say(H.topics[word]) end
  local keys = {}
  local method = word:match("^[%w_]+[:.]([%w_]+)$")
  if word:match("^mnemo%.") then
    keys = { word }
  elseif method then
    keys = { "Tensor:" .. method, "Tensor." .. method, "mnemo." .. method }
  else
    keys = { "mnemo." .. word, "Tensor:" .. word, "Tensor." .. word }
  end
  local shown = {}
  for _, k in ipairs(keys) do
    local e = entry_text(k)
    if e and not shown[e] then shown[e] = true; say(e) end
  end
  if next(shown) == nil then no_help(word) end
end

--- help([x]): the tour; or the help for a function, method name or tensor.
function M.help(...)
  if select("#", ...) == 0 then return say(help_data().tour) end
  local x = ...
  if type(x) == "string" then return help_name(x) end
  if x == M then return list_module() end
  if x ~= nil and x == rawget(M, "Tensor") then return list_methods("Tensor: ") end
  if type(x) == "function" then return help_function(x) end
  if is_tensor(x) then
    say(summary_line(tostring(x)))
    return list_methods("")
  end
  if type(x) == "table" then
    for _, lib in ipairs(LUA_LIBS) do
      if rawget(_G, lib) == x then
        return say(fmt("%s is Lua's own library; see https://www.lua.org/manual/5.4/manual.html#6", lib))
      end
    end
    local keys = {}
    for k in pairs(x) do keys[#keys + 1] = tostring(k) end
    sort(keys)
    return say(fmt("a table of %d keys:\n%s", #keys, columns(keys)))
  end
  no_help(tostring(x))
end

--- mnemo._help_missing(): sorted names of mnemo functions and tensor methods
--- that have no help text (the tests fail on any).
function M._help_missing()
  local missing = {}
  for k, v in pairs(M) do
    if type(k) == "string" and k:sub(1, 1) ~= "_" and type(v) == "function" and
        not entry_text("mnemo." .. k) then
      missing[#missing + 1] = "mnemo." .. k
    end
  end
  for k in pairs(tensor_methods()) do
    if k:sub(1, 1) ~= "_" and not entry_text("Tensor:" .. k) then
      missing[#missing + 1] = "Tensor:" .. k
    end
  end
  sort(missing)
  return missing
end

---------------------------------------------------------------- who

local function human_bytes(n)
  if n < 1024 then return fmt("%d B", n) end
  local units, i = { "KiB", "MiB", "GiB", "TiB" }, 0
  repeat n = n / 1024; i = i + 1 until n < 1024 or i == #units
  return fmt("%.1f %s", n, units[i])
end

-- Ask the tensor through its own methods/fields; each may be missing.
local function try(f, ...)
  local ok, v = pcall(f, ...)
  if ok then return v end
end

local function tensor_info(t)
  local shape = try(function() return t.shape end)
  if type(shape) == "function" then shape = try(shape, t) end
  if type(shape) == "table" then
    local dims = {}
    for i, d in ipairs(shape) do dims[i] = tostring(d) end
    shape = #dims == 0 and "scalar" or concat(dims, "x")
  end
  local function field(name)
    local v = try(function() return t[name] end)
    if type(v) == "function" then v = try(v, t) end
    return v
  end
  local bytes = rawget(M, "tensor_bytes") and try(M.tensor_bytes, t) or field("nbytes")
  return {
    shape = shape and tostring(shape) or "?",
    dtype = tostring(field("dtype") or "?"),
    device = tostring(field("device") or "?"),
    bytes = math.tointeger(bytes) or bytes,
  }
end

--- who(): the global variables that hold tensors, with their sizes.
function M.who()
  local rows, total = {}, 0
  for k, v in pairs(_G) do
    if type(k) == "string" and is_tensor(v) then
      local info = tensor_info(v)
      info.name = k
      rows[#rows + 1] = info
      if type(info.bytes) == "number" then total = total + info.bytes end
    end
  end
  if #rows == 0 then
    say("no global variables hold tensors")
  else
    sort(rows, function(a, b) return a.name < b.name end)
    local w = { name = 4, shape = 5, dtype = 5, device = 6 }
    for _, r in ipairs(rows) do
      for c in pairs(w) do w[c] = math.max(w[c], #r[c]) end
    end
    local line = "%-" .. w.name .. "s  %-" .. w.shape .. "s  %-" .. w.dtype .. "s  %-" .. w.device .. "s  %s"
    local lines = { fmt(line, "name", "shape", "dtype", "device", "size") }
    for _, r in ipairs(rows) do
      local size = type(r.bytes) == "number" and human_bytes(r.bytes) or "?"
      lines[#lines + 1] = fmt(line, r.name, r.shape, r.dtype, r.device, size)
    end
    lines[#lines + 1] = fmt("%d tensor%s in globals, %s", #rows, #rows == 1 and "" or "s",
      human_bytes(total))
    say(concat(lines, "\n"))
  end
  local live = rawget(M, "_live_tensors")
  if type(live) == "function" then
    local ok, all = pcall(live)
    local n = ok and (type(all) == "table" and #all or math.type(all) == "integer" and all)
    if n then
      say(fmt("%d tensor%s alive in all (globals, locals, tables and views)", n,
        n == 1 and "" or "s"))
    end
  end
end

help, who = M.help, M.who
