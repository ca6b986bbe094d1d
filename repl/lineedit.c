/* lineedit.c: the REPL's line input (lineedit.h): readline glue, the history
 * file, Ctrl-C at the prompt, and completion of Lua names (globals and
 * keywords; fields after "a.b."; methods after "x:", found through tables,
 * __index chains and the __methods / __fields tables that userdata
 * metatables such as the tensor's carry). */
#include "lineedit.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <lauxlib.h>
#include <readline/history.h>
#include <readline/readline.h>

#define MN_HISTORY_MAX 1000
#define MN_MAX_COMPLETIONS 4096

static lua_State *le_L;
static int le_tty;               /* readline in use */
static char *le_history_path;    /* NULL: no history file */
static int le_history_warned;
static const char *le_primary = "> ";
static volatile sig_atomic_t le_interrupted;

/* ---------------------------------------------------------------- Ctrl-C */

/* Readline catches SIGINT itself and, at a safe point of its input loop,
 * re-raises it with this handler in place; so the readline calls below run
 * from readline's own context, not at an arbitrary instruction. Without
 * readline the signal just makes the read fail with EINTR. */
static void on_sigint(int sig)
{
    (void)sig;
    le_interrupted = 1;
    if (le_tty) {
        rl_crlf();
        rl_replace_line("", 0);
        rl_set_prompt(le_primary); /* a pending multi-line chunk is dropped */
        rl_on_new_line();
        rl_redisplay();
    }
}

static void set_sigint(void (*handler)(int))
{
    struct sigaction sa;
    sa.sa_handler = handler;
    sa.sa_flags = 0; /* no SA_RESTART: a plain read must return EINTR */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

int mn_le_take_interrupt(void)
{
    int was = le_interrupted;
    le_interrupted = 0;
    return was;
}

/* ------------------------------------------------------------- history */

static void history_warn(const char *what, int err)
{
    if (le_history_warned) return;
    le_history_warned = 1;
    fprintf(stderr, "mnemo: cannot %s history file '%s': %s\n", what, le_history_path,
            strerror(err));
}

static void history_open(void)
{
    const char *env = getenv("MNEMO_HISTORY");
    const char *home = getenv("HOME");
    if (env != NULL) {
        if (env[0] == '\0') return; /* MNEMO_HISTORY= turns the file off */
        le_history_path = strdup(env);
    } else if (home != NULL && home[0] != '\0') {
        size_t n = strlen(home) + sizeof "/.mnemo_history";
        le_history_path = malloc(n);
        if (le_history_path) snprintf(le_history_path, n, "%s/.mnemo_history", home);
    }
    using_history();
    stifle_history(MN_HISTORY_MAX);
    /* Each entry is preceded by a "#<time>" line, which lets readline keep
     * multi-line chunks as one entry in the file. */
    history_comment_char = '#';
    history_write_timestamps = 1;
    history_multiline_entries = 1;
    if (le_history_path) {
        int err = read_history(le_history_path);
        if (err != 0 && err != ENOENT) history_warn("read", err);
    }
}

void mn_le_remember(const char *chunk)
{
    const char *p;
    HIST_ENTRY *last;
    int err;
    if (!le_tty || chunk == NULL) return;
    for (p = chunk; *p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'; p++) {}
    if (*p == '\0') return;
    last = history_length > 0 ? history_get(history_base + history_length - 1) : NULL;
    if (last != NULL && strcmp(last->line, chunk) == 0) return;
    add_history(chunk);
    if (le_history_path == NULL) return;
    /* Append as we go, so a session that dies keeps what it typed.
     * append_history does not create the file; write_history does. */
    if (access(le_history_path, F_OK) == 0) err = append_history(1, le_history_path);
    else err = write_history(le_history_path);
    if (err != 0) history_warn("write", err);
}

static int is_entry_start(const char *line, int timestamps)
{
    if (!timestamps) return 1;
    return line[0] == '#' && line[1] >= '0' && line[1] <= '9';
}

/* Keep the newest MN_HISTORY_MAX entries of the file (an entry is a
 * timestamp line and the lines after it; a file without timestamps has one
 * entry a line). Written beside the file, then renamed over it. */
static void history_cap_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL, *p, *cut = NULL, *tmp;
    long len;
    int timestamps, entries = 0, skip;
    size_t n;
    if (f == NULL) return;
    if (fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) <= 0 || fseek(f, 0, SEEK_SET) != 0 ||
        (buf = malloc((size_t)len + 1)) == NULL || fread(buf, 1, (size_t)len, f) != (size_t)len) {
        fclose(f);
        free(buf);
        return;
    }
    fclose(f);
    buf[len] = '\0';
    timestamps = is_entry_start(buf, 1);
    for (p = buf; p < buf + len; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : buf + len)
        entries += is_entry_start(p, timestamps);
    if (entries <= MN_HISTORY_MAX) {
        free(buf);
        return;
    }
    skip = entries - MN_HISTORY_MAX;
    for (p = buf; p < buf + len; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : buf + len) {
        if (is_entry_start(p, timestamps) && skip-- == 0) {
            cut = p;
            break;
        }
    }
    n = strlen(path) + 32;
    tmp = malloc(n);
    if (cut != NULL && tmp != NULL) {
        snprintf(tmp, n, "%s.tmp-%ld", path, (long)getpid());
        f = fopen(tmp, "wb");
        if (f != NULL) {
            size_t want = (size_t)(buf + len - cut);
            int ok = fwrite(cut, 1, want, f) == want;
            if (fclose(f) != 0) ok = 0;
            if (!ok || rename(tmp, path) != 0) remove(tmp);
        }
    }
    free(tmp);
    free(buf);
}

/* ---------------------------------------------------------- completion */

static const char *const lua_keywords[] = {
    "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if",
    "in", "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while",
    NULL};

static char **le_cands;
static int le_ncands;

static int is_ident(const char *s, size_t n)
{
    size_t i;
    if (n == 0 || (s[0] >= '0' && s[0] <= '9')) return 0;
    for (i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!(c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9')))
            return 0;
    }
    return 1;
}

static int is_keyword(const char *s)
{
    int i;
    for (i = 0; lua_keywords[i]; i++)
        if (strcmp(s, lua_keywords[i]) == 0) return 1;
    return 0;
}

typedef struct {
    const char *base;   /* text up to and including the separator */
    size_t base_len;
    const char *prefix; /* the part being completed */
    int sep;            /* '.', ':' or 0 for globals */
    int set;            /* stack index of the result set {completion = true} */
} le_query;

static void offer(lua_State *L, const le_query *q, const char *name)
{
    size_t plen = strlen(q->prefix);
    if (!is_ident(name, strlen(name)) || is_keyword(name)) return;
    if (strncmp(name, q->prefix, plen) != 0) return;
    if (name[0] == '_' && q->prefix[0] != '_') return; /* private unless asked for */
    lua_pushlstring(L, q->base, q->base_len);
    lua_pushstring(L, name);
    lua_concat(L, 2);
    lua_pushboolean(L, 1);
    lua_rawset(L, q->set);
}

/* String keys of the table at idx; functions only when only_functions. */
static void offer_keys(lua_State *L, const le_query *q, int idx, int only_functions)
{
    idx = lua_absindex(L, idx);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        if (lua_type(L, -2) == LUA_TSTRING && (!only_functions || lua_isfunction(L, -1)))
            offer(L, q, lua_tostring(L, -2));
        lua_pop(L, 1);
    }
}

/* t[k] for the table at idx without metamethods; pushes it, returns its type. */
static int raw_field(lua_State *L, int idx, const char *k)
{
    idx = lua_absindex(L, idx);
    lua_pushstring(L, k);
    return lua_rawget(L, idx);
}

/* String values of the list at idx (a __fields table). */
static void offer_list(lua_State *L, const le_query *q, int idx)
{
    lua_Integer i, n = (lua_Integer)lua_rawlen(L, idx);
    for (i = 1; i <= n && i <= 1000; i++) {
        if (lua_rawgeti(L, idx, i) == LUA_TSTRING) offer(L, q, lua_tostring(L, -1));
        lua_pop(L, 1);
    }
}

/* Names reachable from the value at idx without running Lua code: its own
 * keys when it is a table, then its metatable's __methods, __fields and
 * (recursively) __index when that is a table. */
static void offer_members(lua_State *L, const le_query *q, int idx, int depth)
{
    int methods = q->sep == ':';
    idx = lua_absindex(L, idx);
    if (depth > 8) return;
    if (lua_istable(L, idx)) offer_keys(L, q, idx, methods);
    if (!lua_getmetatable(L, idx)) return;
    if (raw_field(L, -1, "__methods") == LUA_TTABLE) offer_keys(L, q, -1, 0);
    lua_pop(L, 1);
    if (!methods) {
        if (raw_field(L, -1, "__fields") == LUA_TTABLE) offer_list(L, q, lua_gettop(L));
        lua_pop(L, 1);
    }
    if (raw_field(L, -1, "__index") == LUA_TTABLE && !lua_rawequal(L, -1, idx))
        offer_members(L, q, -1, depth + 1);
    lua_pop(L, 2);
}

/* [obj key] -> [value or nil], following only tables: raw fields, then the
 * metatable's __methods, then __index when it is a table. */
static void lookup(lua_State *L)
{
    int depth, key = lua_gettop(L), obj = key - 1;
    for (depth = 0; depth < 16; depth++) {
        if (lua_istable(L, obj)) {
            lua_pushvalue(L, key);
            if (lua_rawget(L, obj) != LUA_TNIL) goto found;
            lua_pop(L, 1);
        }
        if (!lua_getmetatable(L, obj)) break;
        if (raw_field(L, -1, "__methods") == LUA_TTABLE) {
            lua_pushvalue(L, key);
            if (lua_rawget(L, -2) != LUA_TNIL) goto found;
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
        if (raw_field(L, -1, "__index") != LUA_TTABLE) break;
        lua_replace(L, obj); /* walk on along the __index chain */
        lua_settop(L, key);
    }
    lua_pushnil(L);
found:
    lua_replace(L, obj);
    lua_settop(L, obj);
}

/* Protected: fills a set of completions for the text at upvalue-free arg 1
 * (a light userdata) and returns it. */
static int collect(lua_State *L)
{
    const char *text = (const char *)lua_touserdata(L, 1);
    const char *sep = NULL, *p;
    le_query q;
    int i;
    lua_newtable(L);
    q.set = lua_gettop(L);
    for (p = text; *p; p++)
        if (*p == '.' || *p == ':') sep = p;
    if (sep == NULL) {
        q.base = text;
        q.base_len = 0;
        q.prefix = text;
        q.sep = 0;
        lua_pushglobaltable(L);
        offer_members(L, &q, -1, 0);
        lua_pop(L, 1);
        for (i = 0; lua_keywords[i]; i++) {
            if (strncmp(lua_keywords[i], text, strlen(text)) != 0) continue;
            lua_pushstring(L, lua_keywords[i]);
            lua_pushboolean(L, 1);
            lua_rawset(L, q.set);
        }
        return 1;
    }
    lua_pushglobaltable(L);
    for (p = text; p < sep;) {
        const char *e = p;
        while (e < sep && *e != '.' && *e != ':') e++;
        if (!is_ident(p, (size_t)(e - p)) || (*e == ':' && e != sep)) { /* a.b:c.d cannot be followed */
            lua_settop(L, q.set);
            return 1;
        }
        lua_pushlstring(L, p, (size_t)(e - p));
        lookup(L);
        if (lua_isnil(L, -1)) {
            lua_settop(L, q.set);
            return 1;
        }
        p = e + 1;
    }
    q.base = text;
    q.base_len = (size_t)(sep - text) + 1;
    q.prefix = sep + 1;
    q.sep = *sep;
    offer_members(L, &q, -1, 0);
    lua_settop(L, q.set);
    return 1;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void free_cands(void)
{
    int i;
    for (i = 0; i < le_ncands; i++) free(le_cands[i]);
    free(le_cands);
    le_cands = NULL;
    le_ncands = 0;
}

static void find_cands(const char *text)
{
    lua_State *L = le_L;
    int top = lua_gettop(L), n = 0;
    free_cands();
    if (!lua_checkstack(L, 10)) return;
    lua_pushcfunction(L, collect);
    lua_pushlightuserdata(L, (void *)text);
    if (lua_pcall(L, 1, 1, 0) == LUA_OK && lua_istable(L, -1)) {
        lua_pushnil(L);
        while (lua_next(L, -2)) n++, lua_pop(L, 1);
        if (n > MN_MAX_COMPLETIONS) n = MN_MAX_COMPLETIONS;
        le_cands = calloc((size_t)n + 1, sizeof *le_cands);
        if (le_cands != NULL) {
            lua_pushnil(L);
            while (le_ncands < n && lua_next(L, -2)) {
                char *s = strdup(lua_tostring(L, -2));
                if (s) le_cands[le_ncands++] = s;
                lua_pop(L, 1);
            }
            qsort(le_cands, (size_t)le_ncands, sizeof *le_cands, cmp_str);
        }
    }
    lua_settop(L, top);
}

static char *next_cand(const char *text, int state)
{
    static int i;
    (void)text;
    if (state == 0) i = 0;
    return i < le_ncands ? strdup(le_cands[i++]) : NULL;
}

/* 1 when position end of the line lies inside a short string literal. */
static int inside_string(const char *line, int end)
{
    int i, quote = 0;
    for (i = 0; i < end && line[i]; i++) {
        if (quote) {
            if (line[i] == '\\' && i + 1 < end) i++;
            else if (line[i] == quote) quote = 0;
        } else if (line[i] == '"' || line[i] == '\'') {
            quote = line[i];
        } else if (line[i] == '-' && line[i + 1] == '-') {
            return 0; /* a comment: nothing after it is code */
        }
    }
    return quote != 0;
}

static char **complete(const char *text, int start, int end)
{
    (void)end;
    rl_attempted_completion_over = 1; /* never fall back to file names */
    rl_completion_append_character = '\0';
    rl_completion_suppress_append = 1;
    if (le_L == NULL || inside_string(rl_line_buffer, start)) return NULL;
    find_cands(text);
    if (le_ncands == 0) return NULL;
    return rl_completion_matches(text, next_cand);
}

/* Lists show the last component only: "sub  sum", not "t:sub  t:sum". */
static void show_matches(char **matches, int num, int max_length)
{
    char **shown = calloc((size_t)num + 2, sizeof *shown);
    int i, longest = 0;
    (void)max_length;
    if (shown == NULL) return;
    for (i = 0; i <= num; i++) {
        const char *m = matches[i], *s = m ? m + strlen(m) : NULL;
        while (s != NULL && s > m && s[-1] != '.' && s[-1] != ':') s--;
        shown[i] = (char *)s;
        if (i > 0 && s != NULL && (int)strlen(s) > longest) longest = (int)strlen(s);
    }
    rl_display_match_list(shown, num, longest);
    rl_forced_update_display();
    free(shown);
}

/* Tab on a line that holds only blanks so far indents; anywhere else it
 * completes (a second Tab lists, as readline's own complete does). */
static int tab_key(int count, int key)
{
    int i;
    for (i = 0; i < rl_point; i++)
        if (rl_line_buffer[i] != ' ' && rl_line_buffer[i] != '\t') break;
    if (i == rl_point) return rl_insert_text("  ") >= 0 ? 0 : 1;
    if (rl_last_func == tab_key) rl_last_func = rl_complete;
    return rl_complete(count, key);
}

/* --------------------------------------------------------------- public */

void mn_le_open(lua_State *L, const char *primary_prompt)
{
    le_L = L;
    le_primary = primary_prompt;
    le_tty = isatty(STDIN_FILENO);
    if (!le_tty) return;
    rl_readline_name = "mnemo"; /* for $if mnemo in ~/.inputrc */
    rl_attempted_completion_function = complete;
    rl_completion_display_matches_hook = show_matches;
    /* '.' and ':' are not breaks: "mnemo.ze" and "t:su" are one word. */
    rl_basic_word_break_characters = " \t\n\"\\'`@$><=;|&{}()[],+-*/%^~#";
    rl_completer_word_break_characters = rl_basic_word_break_characters;
    rl_bind_key('\t', tab_key);
    history_open();
}

char *mn_le_read(const char *prompt)
{
    char *line = NULL;
    set_sigint(on_sigint);
    if (le_tty) {
        line = readline(prompt);
    } else {
        size_t cap = 0;
        ssize_t n;
        fputs(prompt, stdout);
        fflush(stdout);
        errno = 0;
        n = getline(&line, &cap, stdin);
        if (n < 0) {
            free(line);
            line = NULL;
            if (le_interrupted && errno == EINTR) { /* Ctrl-C: an empty line */
                clearerr(stdin);
                fputc('\n', stdout);
                line = strdup("");
            }
        } else if (n > 0 && line[n - 1] == '\n') {
            line[n - 1] = '\0';
        }
    }
    set_sigint(SIG_DFL);
    return line;
}

void mn_le_close(void)
{
    free_cands();
    if (le_tty && le_history_path) history_cap_file(le_history_path);
    free(le_history_path);
    le_history_path = NULL;
    le_L = NULL;
}
