-- prelude.lua: the Lua side of the user's experience, run at start-up with
-- the mnemo module table as `...`: the pretty printer behind REPL results
-- (mnemo._repl_show, mnemo._pretty), help() and who(), which are also made
-- globals; mnemo.profile; the progress line around engine runs; and the
-- Lua-written parts of the module: mnemo.data (data.lua), mnemo.metrics
-- (metrics.lua), mnemo.plot (plot.lua). The help texts themselves are data,
-- in help.lua ("mnemo.help").
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

-- The other classes a researcher meets, by the module field that holds
-- their methods (mnemo.Rule, mnemo.Memory, mnemo.Expr; mnemo.Result holds
-- the methods of rule:run's result tables).
local CLASSES = { "Rule", "Memory", "Expr", "Result" }

local function class_methods(class)
  local t, res = rawget(M, class), {}
  if type(t) == "table" then
    for k, v in pairs(t) do
      if type(k) == "string" and type(v) == "function" and k:sub(1, 1) ~= "_" then res[k] = v end
    end
  end
  return res
end

-- The class of a userdata value, by its metatable's __methods table.
local function class_of(x)
  if type(x) ~= "userdata" then return nil end
  local mt = debug.getmetatable(x)
  local methods = type(mt) == "table" and rawget(mt, "__methods") or nil
  for _, class in ipairs(CLASSES) do
    if methods ~= nil and methods == rawget(M, class) then return class end
  end
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

-- The Lua-written parts of the module: tables of functions, named
-- "mnemo.data.recall" and so on in help.
local SUBMODULES = { "data", "metrics", "plot" }

local function submodule_functions(sub)
  local t, res = rawget(M, sub), {}
  if type(t) ~= "table" then return res end
  for k, v in pairs(t) do
    if type(k) == "string" and k:sub(1, 1) ~= "_" and type(v) == "function" then res[k] = v end
  end
  return res
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
  for _, class in ipairs(CLASSES) do
    for k, v in pairs(class_methods(class)) do add(v, class .. ":" .. k) end
  end
  for _, sub in ipairs(SUBMODULES) do
    for k, v in pairs(submodule_functions(sub)) do add(v, "mnemo." .. sub .. "." .. k) end
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
  local note = H.notes and H.notes[key]
  if type(note) == "function" then note = note(M) end -- built from live data (mnemo.vocabulary)
  if text and note and not without_notes then text = text .. "\n" .. note end
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
  for _, class in ipairs(CLASSES) do
    for k in pairs(class_methods(class)) do add(class .. ":" .. k) end
  end
  for _, sub in ipairs(SUBMODULES) do
    for k in pairs(submodule_functions(sub)) do add("mnemo." .. sub .. "." .. k) end
  end
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

-- One line per function: its name and the start of its help text.
local function summary_lines(lines, prefix, names)
  for _, k in ipairs(names) do
    local e = entry_text(prefix .. k, true) or ""
    -- the text after the signature, on one line, cut to fit: the text
    -- starts at the first line indented by exactly two spaces (signatures
    -- that take several lines continue with deeper indents)
    local lines_of, from = {}, nil
    for l in (e .. "\n"):gmatch("([^\n]*)\n") do
      lines_of[#lines_of + 1] = l
      if not from and #lines_of > 1 and l:find("^  %S") then from = #lines_of end
    end
    local rest = from and concat(lines_of, "\n", from) or ""
    local summary = rest:gsub("%s+", " "):gsub("^ ?%->", ""):gsub("^ ", "")
    if #summary > WIDTH - 17 then summary = summary:sub(1, WIDTH - 20):gsub("%s*%S*$", "") .. " ..." end
    lines[#lines + 1] = fmt("  %-14s %s", k, summary)
  end
end

local function list_module()
  local names = {}
  for k, v in pairs(M) do
    if type(k) == "string" and k:sub(1, 1) ~= "_" and type(v) == "function" then names[#names + 1] = k end
  end
  sort(names)
  local lines = { "mnemo: the module (help(\"mnemo.NAME\") or help(mnemo.NAME) for one)" }
  summary_lines(lines, "mnemo.", names)
  local subs = {}
  for _, sub in ipairs(SUBMODULES) do
    local fns = {}
    for k in pairs(submodule_functions(sub)) do fns[#fns + 1] = k end
    sort(fns)
    if #fns > 0 then subs[#subs + 1] = fmt("  %-14s %s", "mnemo." .. sub, concat(fns, ", ")) end
  end
  if #subs > 0 then
    lines[#lines + 1] = "parts (help(mnemo.data), help(\"mnemo.plot.curves\"), ...):"
    for _, l in ipairs(subs) do lines[#lines + 1] = l end
  end
  say(concat(lines, "\n"))
end

-- help(mnemo.data): the part's text, then its functions.
local function list_submodule(sub)
  local names = {}
  for k in pairs(submodule_functions(sub)) do names[#names + 1] = k end
  sort(names)
  local H = help_data()
  local lines = { (H.topics and H.topics["mnemo." .. sub]) or ("mnemo." .. sub) }
  lines[#lines + 1] = fmt("functions (help(\"mnemo.%s.NAME\") for one):", sub)
  summary_lines(lines, "mnemo." .. sub .. ".", names)
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

local function list_class(class, header)
  local names = {}
  for k in pairs(class_methods(class)) do names[#names + 1] = k end
  sort(names)
  say(header .. class .. " methods (help(\"" .. class .. ":NAME\") for one):\n" .. columns(names))
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
  for _, sub in ipairs(SUBMODULES) do
    if word == "mnemo." .. sub or (word == sub and not (H.topics and H.topics[word])) then
      return list_submodule(sub)
    end
  end
  if word == "Tensor" or word == "tensor" then return list_methods("Tensor: ") end
  for _, class in ipairs(CLASSES) do
    if word == class then return list_class(class, "") end
  end
  if H.topics and H.topics[word] then return say(H.topics[word]) end
  local keys = {}
  local method = word:match("^[%w_]+[:.]([%w_]+)$")
  if word:match("^mnemo%.") then
    keys = { word }
  elseif method then
    local class = word:match("^([%w_]+)[:.]")
    keys = { class .. ":" .. method, "Tensor:" .. method, "Tensor." .. method, "mnemo." .. method }
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
  local class = class_of(x)
  if class then
    say(tostring(x))
    return list_class(class, "")
  end
  for _, c in ipairs(CLASSES) do
    if x ~= nil and x == rawget(M, c) then return list_class(c, "") end
  end
  if type(x) == "table" then
    for _, sub in ipairs(SUBMODULES) do
      if rawget(M, sub) == x then return list_submodule(sub) end
    end
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
  for _, class in ipairs(CLASSES) do
    for k in pairs(class_methods(class)) do
      if not entry_text(class .. ":" .. k) then missing[#missing + 1] = class .. ":" .. k end
    end
  end
  for _, sub in ipairs(SUBMODULES) do
    for k in pairs(submodule_functions(sub)) do
      local key = "mnemo." .. sub .. "." .. k
      if not entry_text(key) then missing[#missing + 1] = key end
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

-- Tables that who() does not look into: the module, Lua's own, package.
local function who_skips()
  local skip = { [M] = true, [_G] = true }
  for _, lib in ipairs(LUA_LIBS) do
    local t = rawget(_G, lib)
    if type(t) == "table" then skip[t] = true end
  end
  if type(rawget(_G, "package")) == "table" then skip[package] = true end
  for _, sub in ipairs(SUBMODULES) do
    if rawget(M, sub) ~= nil then skip[rawget(M, sub)] = true end
  end
  return skip
end

local WHO_DEPTH, WHO_ROWS = 3, 200

--- who(): the tensors held in global variables and in tables held there
--- (d.k, res.outputs.y), with their sizes.
function M.who()
  local rows, total, counted, skip, nrows = {}, 0, {}, who_skips(), 0
  local function visit(name, v, depth, path)
    if is_tensor(v) then
      nrows = nrows + 1
      if nrows > WHO_ROWS then return end
      local info = tensor_info(v)
      info.name = name
      rows[#rows + 1] = info
      if type(info.bytes) == "number" and not counted[v] then
        counted[v] = true
        total = total + info.bytes
      end
    elseif type(v) == "table" and depth < WHO_DEPTH and not skip[v] and not path[v] then
      path[v] = true
      for k, x in next, v do
        if type(k) == "string" then
          visit(is_ident(k) and (name .. "." .. k) or fmt("%s[%q]", name, k), x, depth + 1, path)
        elseif math.type(k) == "integer" then
          visit(fmt("%s[%d]", name, k), x, depth + 1, path)
        end
      end
      path[v] = nil
    end
  end
  for k, v in next, _G do
    if type(k) == "string" then visit(k, v, 0, {}) end
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
    if nrows > WHO_ROWS then lines[#lines + 1] = fmt("... and %d more", nrows - WHO_ROWS) end
    local distinct = 0
    for _ in pairs(counted) do distinct = distinct + 1 end
    lines[#lines + 1] = fmt("%d tensor%s in globals and their tables, %s", distinct,
      distinct == 1 and "" or "s", human_bytes(total))
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

---------------------------------------------------------- workloads, metrics, plots

M.data = require("mnemo.data")
M.metrics = require("mnemo.metrics")
M.plot = require("mnemo.plot")

---------------------------------------------------------- progress line

-- rule:run, mem:write and mem:run draw a progress line on stderr while they
-- run (model/progress.c through mnemo._progress_begin, dsl/l_progress.c): only
-- past a second, only on a terminal, never with mnemo.quiet (mnemo -q). The
-- handle is to-be-closed, so an error or Ctrl-C erases the line too.
local progress_begin = rawget(M, "_progress_begin")

local function step_of(rule)
  local ok, c = pcall(function() return rule.step end)
  return ok and tonumber(c) or 1
end

local function with_progress(methods, name, label, rule_of)
  local raw = type(methods) == "table" and rawget(methods, name)
  if type(raw) ~= "function" or not progress_begin then return end
  methods[name] = function(self, ...)
    local line <close> = (not rawget(M, "quiet")) and progress_begin(label, step_of(rule_of(self))) or nil
    return raw(self, ...)
  end
end

with_progress(rawget(M, "Rule"), "run", "run", function(r) return r end)
with_progress(rawget(M, "Memory"), "write", "mem:write", function(m) return m.rule end)
with_progress(rawget(M, "Memory"), "run", "mem:run", function(m) return m.rule end)

---------------------------------------------------------- profile

-- The hook for per-kernel GPU times, for the CUDA layer to fill in: when
-- mnemo._profile_kernel_hook is a function, mnemo.profile calls it as
-- hook("start") before fn and hook("stop") after (also when fn fails);
-- "stop" returns an array of {name =, calls =, seconds =} (the CUDA layer's
-- also give mean_ms, grid, block, and .launches), which profile prints and
-- returns as report.kernels. Unset (nil) without a GPU (dsl/l_kernel_info.c).
M._profile_kernel_hook = rawget(M, "_profile_kernel_hook")

-- Tokens an engine call handles: B*H*T of its k (or q for mem:read).
local function tokens_of(what, a, b)
  local t
  if type(a) == "table" then t = a.k or a.q
  elseif is_tensor(a) then t = a end
  if not is_tensor(t) then return nil end
  local shape = t.shape
  if #shape < 2 then return nil end
  local n = 1
  for i = 1, #shape - 1 do n = n * shape[i] end
  return n
end

local function fmt_rate(x)
  if not x then return "" end
  if x < 1e3 then return fmt("%.0f", x) end
  if x < 1e6 then return fmt("%.1fk", x / 1e3) end
  if x < 1e9 then return fmt("%.1fM", x / 1e6) end
  return fmt("%.1fG", x / 1e9)
end

local PROFILED = {
  { "Rule", "run", "rule:run" }, { "Memory", "write", "mem:write" },
  { "Memory", "run", "mem:run" }, { "Memory", "read", "mem:read" },
}

--- mnemo.profile(fn [, opts]): time the engine calls fn makes (see help).
function M.profile(fn, opts)
  if type(fn) ~= "function" then
    error("mnemo.profile: expected a function to run, got " .. type(fn), 2)
  end
  opts = opts or {}
  local wall = rawget(M, "_clock")
  local clock = wall or os.clock
  local calls, depth = {}, 0
  -- swap timing wrappers in for the engine entry points, and back on any exit
  local saved = {}
  local restore <close> = setmetatable({}, { __close = function()
    for _, s in ipairs(saved) do s[1][s[2]] = s[3] end
  end })
  for _, p in ipairs(PROFILED) do
    local methods = rawget(M, p[1])
    local raw = type(methods) == "table" and rawget(methods, p[2])
    if type(raw) == "function" then
      saved[#saved + 1] = { methods, p[2], raw }
      methods[p[2]] = function(self, a, ...)
        if depth > 0 then return raw(self, a, ...) end -- engine calls inside a gate function
        depth = depth + 1
        local t0 = clock()
        local rec <close> = setmetatable({}, { __close = function()
          depth = depth - 1
          calls[#calls + 1] = { what = p[3], seconds = clock() - t0, tokens = tokens_of(p[3], a) }
        end })
        return raw(self, a, ...)
      end
    end
  end
  local hook = rawget(M, "_profile_kernel_hook")
  local hooked = type(hook) == "function"
  if hooked then hook("start") end
  local unhook <close> = setmetatable({}, { __close = function()
    if hooked then hooked = false; hook("stop") end -- fn failed: switch the timing off
  end })
  local t0 = clock()
  local results = table.pack(fn())
  local total = clock() - t0
  local kernels = nil
  if hooked then hooked = false; kernels = hook("stop") end

  local by, order, engine = {}, {}, 0
  for _, c in ipairs(calls) do
    local b = by[c.what]
    if not b then
      b = { what = c.what, calls = 0, seconds = 0, tokens = 0 }
      by[c.what] = b
      order[#order + 1] = b
    end
    b.calls, b.seconds = b.calls + 1, b.seconds + c.seconds
    b.tokens = c.tokens and b.tokens + c.tokens or b.tokens
    engine = engine + c.seconds
  end
  local report = {
    total = total, engine = engine, other = total - engine, calls = calls, by = by,
    clock = wall and "wall" or "cpu", kernels = kernels, results = results,
  }
  if not opts.quiet then
    local lines = { fmt("%-10s %6s %10s %10s %10s", "call", "n", "seconds", "mean", "tokens/s") }
    for _, b in ipairs(order) do
      lines[#lines + 1] = fmt("%-10s %6d %10.4f %10.4f %10s", b.what, b.calls, b.seconds,
        b.seconds / b.calls, b.tokens > 0 and b.seconds > 0 and fmt_rate(b.tokens / b.seconds) or "")
    end
    lines[#lines + 1] = fmt("%-10s %6s %10.4f", "(other)", "", total - engine)
    lines[#lines + 1] = fmt("%-10s %6d %10.4f%s", "total", #calls, total,
      wall and "" or "   (cpu seconds: no wall clock in this build)")
    if type(kernels) == "table" and #kernels > 0 then
      local function dims(d) return type(d) == "table" and concat(d, "x"):gsub("x1x1$", ""):gsub("x1$", "") or "" end
      lines[#lines + 1] = fmt("%-32s %6s %10s %10s  %s", "kernel (GPU time)", "n", "seconds", "mean ms", "grid, block")
      for _, k in ipairs(kernels) do
        lines[#lines + 1] = fmt("%-32s %6s %10.4f %10s  %s", tostring(k.name), tostring(k.calls or ""), k.seconds or 0,
          k.mean_ms and fmt("%.3f", k.mean_ms) or "", k.grid and dims(k.grid) .. ", " .. dims(k.block) or "")
      end
    end
    say(concat(lines, "\n"))
  end
  return setmetatable(report, { __tostring = function(r)
    return fmt("mnemo.profile: %.4f s in all, %d engine call%s taking %.4f s", r.total, #r.calls,
      #r.calls == 1 and "" or "s", r.engine)
  end })
end
