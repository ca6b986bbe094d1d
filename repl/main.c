/* main.c: the `mnemo` executable (SPEC.md section 6): argument handling, the
 * `run` and `compare` subcommands (cli.h), scripts, -e chunks, and the
 * interactive REPL. Modelled on Lua's own lua.c: every chunk runs through
 * docall with a traceback handler; Ctrl-C during a chunk sets a hook that
 * raises "interrupted!" at the next Lua instruction and raises
 * mn_interrupt_requested for C loops; REPL lines are tried as "return
 * <line>" first, and incomplete chunks read continuation lines. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>

#include "../dsl/dsl.h"
#include "../model/h5.h"
#include "../model/mn.h"
#include "cli.h"
#include "lineedit.h"

#define PROMPT1 "mnemo> "
#define PROMPT2 ">> "
#define EOFMARK "<eof>"

static const char *progname = "mnemo";
static lua_State *globalL;          /* the state the SIGINT handler stops */
static int module_ref = LUA_NOREF;  /* the mnemo module, in the registry */
static int exit_status = 0;

/* Argument flags, as in lua.c. */
enum { has_error = 1, has_i = 2, has_e = 4, has_version = 8, has_help = 16, has_quiet = 32 };
static const char *bad_option;      /* for the usage error */
static int bad_needs_arg;

/* ------------------------------------------------------------ messages */

static void print_usage(FILE *f)
{
    fprintf(f,
            "usage: mnemo [options] [FILE.lua [ARGS...]]\n"
            "       mnemo run EXP.h5 -o RES.h5 [--device cpu|cuda] [--precision fp32|tf32|bf16] [--trace] [--timing]\n"
            "       mnemo compare A.h5 B.h5 [--rtol X]\n"
            "       mnemo --version | --help\n"
            "\n"
            "  mnemo                  interactive REPL when stdin is a terminal;\n"
            "                         otherwise run stdin as one chunk\n"
            "  mnemo FILE.lua [ARGS]  run a script: arg[0] = FILE.lua, arg[1..] = ARGS\n"
            "                         (also passed as the chunk's ...)\n"
            "  mnemo -                run stdin as a script\n"
            "  mnemo run ...          run an experiment file, write a result file\n"
            "  mnemo compare A B      per-dataset relative error table; exit 1 past rtol\n"
            "\n"
            "options (before FILE.lua):\n"
            "  -e CODE       run the chunk CODE (may repeat; they run in order)\n"
            "  -l NAME       require library NAME into the global NAME\n"
            "  -i            enter the REPL after the script and -e chunks\n"
            "  -q, --quiet   no banner, no progress output (mnemo.quiet = true)\n"
            "  --version     print the version and build information\n"
            "  --help        print this text\n"
            "  --            stop handling options\n"
            "\n"
            "exit status: 0 success; 1 a script error or a failed comparison;\n"
            "2 bad usage or bad input. History: $MNEMO_HISTORY or ~/.mnemo_history.\n"
            "More: the manual page, man mnemo (docs/mnemo.1 in the source tree),\n"
            "and docs/*.md; inside mnemo, help().\n");
}

static void print_version(void)
{
    printf("mnemo %s\n", MN_VERSION);
#ifdef MN_HAVE_CUDA
    printf("built with %s, CUDA (runtime, cuBLAS, NVRTC; the GPU is looked for at start-up)\n",
           LUA_RELEASE);
#else
    printf("built with %s, CPU only (no CUDA in this build)\n", LUA_RELEASE);
#endif
}

static void l_message(const char *pname, const char *msg)
{
    if (pname) fprintf(stderr, "%s: ", pname);
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
}

/* Report a failed status with the message on top of the stack. */
static int report(lua_State *L, int status)
{
    if (status != LUA_OK) {
        const char *msg = lua_tostring(L, -1);
        l_message(progname, msg ? msg : "(error object is not a string)");
        lua_pop(L, 1);
    }
    return status;
}

/* ---------------------------------------------------- calls and Ctrl-C */

static void setsignal(int sig, void (*handler)(int))
{
    struct sigaction sa;
    sa.sa_handler = handler;
    sa.sa_flags = 0;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
}

static void lstop(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    luaL_error(L, "interrupted!");
}

/* A signal handler may not touch the state, but may set a hook: the hook
 * raises the error at the next Lua instruction. C loops of the engine see
 * the flag instead. A second Ctrl-C gets the default action, as in lua.c,
 * for code stuck where neither can see it. */
static void laction(int sig)
{
    int flag = LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT;
    setsignal(sig, SIG_DFL);
    mn_interrupt_requested = 1;
    lua_sethook(globalL, lstop, flag, 1);
}

/* libhdf5 1.10 (Debian 12) itself crashes on some damaged files (a global
 * heap whose lengths are garbage: h5dump and h5py die on them too). A crash
 * (a fault, or glibc aborting on the heap it damaged) while a file is being
 * loaded becomes a one-line error naming the file and
 * what was being read, and exit status 2; the process cannot go on, since
 * the library's memory may be damaged. Any other crash keeps its default. */
static void say(const char *s) { if (s && write(2, s, strlen(s)) < 0) return; }
static void on_crash(int sig)
{
    const char *file = mn_h5_loading_file();
    if (!file) {
        setsignal(sig, SIG_DFL); /* returning re-runs the fault: the default action */
        return;
    }
    say("mnemo: loading '");
    say(file);
    say("': ");
    say(mn_h5_loading_where());
    say(": the HDF5 library crashed reading it (a damaged file)\n");
    _exit(2);
}

/* The traceback, less the frame of the C call that started the chunk. */
static int msghandler(lua_State *L)
{
    static const char tail[] = "\n\t[C]: in ?";
    const size_t tail_len = sizeof tail - 1;
    const char *msg = lua_tostring(L, 1), *tb;
    size_t len;
    if (msg == NULL) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
        msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    tb = lua_tolstring(L, -1, &len);
    if (len >= tail_len && memcmp(tb + len - tail_len, tail, tail_len) == 0)
        lua_pushlstring(L, tb, len - tail_len);
    return 1;
}

static int docall(lua_State *L, int narg, int nres)
{
    int status, base = lua_gettop(L) - narg;
    lua_pushcfunction(L, msghandler);
    lua_insert(L, base);
    globalL = L;
    mn_interrupt_requested = 0;
    setsignal(SIGINT, laction);
    status = lua_pcall(L, narg, nres, base);
    setsignal(SIGINT, SIG_DFL);
    /* A C loop may have stopped on the flag before the hook ever ran. */
    lua_sethook(L, NULL, 0, 0);
    mn_interrupt_requested = 0;
    lua_remove(L, base);
    return status;
}

/* Push module[name] when it is a function; 0 (nothing pushed) otherwise. */
static int push_module_function(lua_State *L, const char *name)
{
    if (module_ref == LUA_NOREF) return 0;
    if (lua_rawgeti(L, LUA_REGISTRYINDEX, module_ref) != LUA_TTABLE) {
        lua_pop(L, 1);
        return 0;
    }
    if (lua_getfield(L, -1, name) != LUA_TFUNCTION) {
        lua_pop(L, 2);
        return 0;
    }
    lua_remove(L, -2);
    return 1;
}

/* mnemo._after_statement, when defined (the CUDA layer reports pending
 * asynchronous errors there). */
static int after_statement(lua_State *L)
{
    if (!push_module_function(L, "_after_statement")) return LUA_OK;
    return docall(L, 0, 0);
}

static int dochunk(lua_State *L, int status)
{
    if (status == LUA_OK) status = docall(L, 0, 0);
    if (status == LUA_OK) status = after_statement(L);
    return report(L, status);
}

static int dostring(lua_State *L, const char *s, const char *name)
{
    return dochunk(L, luaL_loadbuffer(L, s, strlen(s), name));
}

static int dolibrary(lua_State *L, const char *name)
{
    int status;
    lua_getglobal(L, "require");
    lua_pushstring(L, name);
    status = docall(L, 1, 1);
    if (status == LUA_OK) lua_setglobal(L, name);
    return report(L, status);
}

/* ---------------------------------------------------------- arguments */

/* Sets *first to the index of the script name (argc when none), as lua.c
 * does; long options are ours. */
static int collectargs(char **argv, int *first)
{
    int args = 0, i;
    for (i = 1; argv[i] != NULL; i++) {
        *first = i;
        if (argv[i][0] != '-') return args;
        if (strcmp(argv[i], "--") == 0) {
            *first = i + 1;
            return args;
        }
        if (strcmp(argv[i], "-") == 0) return args;
        if (strcmp(argv[i], "--version") == 0 || strcmp(argv[i], "-v") == 0) {
            args |= has_version;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            args |= has_help;
        } else if (strcmp(argv[i], "--quiet") == 0 || strcmp(argv[i], "-q") == 0) {
            args |= has_quiet;
        } else if (strcmp(argv[i], "-i") == 0) {
            args |= has_i;
        } else if (argv[i][1] == 'e' || argv[i][1] == 'l') {
            if (argv[i][1] == 'e') args |= has_e;
            if (argv[i][2] == '\0' && argv[++i] == NULL) {
                bad_option = argv[i - 1];
                bad_needs_arg = 1;
                return has_error;
            }
        } else {
            bad_option = argv[i];
            return has_error;
        }
    }
    *first = i;
    return args;
}

/* -e and -l, in order. 0 when one failed. */
static int runargs(lua_State *L, char **argv, int n)
{
    int i;
    for (i = 1; i < n; i++) {
        int option = argv[i][1];
        if (argv[i][0] != '-' || (option != 'e' && option != 'l')) continue;
        {
            const char *extra = argv[i] + 2;
            int status;
            if (*extra == '\0') extra = argv[++i];
            status = option == 'e' ? dostring(L, extra, "=(command line)") : dolibrary(L, extra);
            if (status != LUA_OK) return 0;
        }
    }
    return 1;
}

/* arg[0] = script, arg[1..] its arguments, interpreter arguments below 0. */
static void createargtable(lua_State *L, char **argv, int argc, int script)
{
    int i, narg;
    if (script == argc) script = 0; /* no script: arg[0] is the program */
    narg = argc - (script + 1);
    lua_createtable(L, narg > 0 ? narg : 0, script + 1);
    for (i = 0; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i - script);
    }
    lua_setglobal(L, "arg");
}

static int pushargs(lua_State *L)
{
    int i, n;
    if (lua_getglobal(L, "arg") != LUA_TTABLE) luaL_error(L, "'arg' is not a table");
    n = (int)luaL_len(L, -1);
    luaL_checkstack(L, n + 3, "too many arguments to script");
    for (i = 1; i <= n; i++) lua_rawgeti(L, -i, i);
    lua_remove(L, -i);
    return n;
}

static int handle_script(lua_State *L, char **argv)
{
    int status;
    const char *fname = argv[0];
    if (strcmp(fname, "-") == 0 && strcmp(argv[-1], "--") != 0) {
        fname = NULL; /* stdin */
    } else {
        FILE *f = fopen(fname, "r");
        if (f == NULL) { /* bad input, not a script error: exit 2 */
            fprintf(stderr, "mnemo: cannot open '%s': %s\n", fname, strerror(errno));
            exit_status = 2;
            return LUA_ERRFILE;
        }
        fclose(f);
    }
    status = luaL_loadfile(L, fname);
    if (status == LUA_ERRFILE) {
        exit_status = 2;
        return report(L, status);
    }
    if (status == LUA_OK) {
        int n = pushargs(L);
        status = docall(L, n, 0);
    }
    if (status == LUA_OK) status = after_statement(L);
    return report(L, status);
}

/* ---------------------------------------------------------------- REPL */

/* Reads a line and pushes it; 0 at end of input. */
static int pushline(lua_State *L, int firstline)
{
    char *b = mn_le_read(firstline ? PROMPT1 : PROMPT2);
    if (b == NULL) return 0;
    lua_pushstring(L, b);
    free(b);
    return 1;
}

/* "=x" is "return x", a Lua 5.1 habit. Replaces the line at index 1. */
static void fix_equals(lua_State *L)
{
    const char *line = lua_tostring(L, 1);
    if (line[0] == '=') {
        lua_pushfstring(L, "return %s", line + 1);
        lua_replace(L, 1);
    }
}

static int incomplete(lua_State *L, int status)
{
    if (status == LUA_ERRSYNTAX) {
        size_t lmsg, lmark = sizeof(EOFMARK) - 1;
        const char *msg = lua_tolstring(L, -1, &lmsg);
        if (lmsg >= lmark && strcmp(msg + lmsg - lmark, EOFMARK) == 0) {
            lua_pop(L, 1);
            return 1;
        }
    }
    return 0;
}

/* Try "return <chunk>" for the chunk at index 1: on success the function
 * is pushed and LUA_OK returned; else the stack is as it was. */
static int addreturn(lua_State *L)
{
    const char *chunk = lua_tostring(L, 1);
    const char *retline = lua_pushfstring(L, "return %s;", chunk);
    int status = luaL_loadbuffer(L, retline, strlen(retline), "=stdin");
    if (status == LUA_OK) lua_remove(L, -2);
    else lua_pop(L, 2);
    return status;
}

/* Reads a chunk: one line, or more while it is incomplete; each attempt is
 * tried as an expression first. Leaves the compiled function (or the
 * syntax error message) alone on the stack; -1 at end of input. */
static int loadline(lua_State *L)
{
    int status;
    lua_settop(L, 0);
    if (!pushline(L, 1)) return -1;
    mn_le_take_interrupt();
    fix_equals(L);
    for (;;) {
        size_t len;
        const char *chunk;
        if ((status = addreturn(L)) == LUA_OK) break;
        chunk = lua_tolstring(L, 1, &len);
        status = luaL_loadbuffer(L, chunk, len, "=stdin");
        if (!incomplete(L, status)) break;
        if (!pushline(L, 0)) { /* end of input inside a chunk: say why */
            status = luaL_loadbuffer(L, chunk, len, "=stdin");
            break;
        }
        if (mn_le_take_interrupt()) { /* Ctrl-C dropped the lines held so far */
            lua_remove(L, 1);
            fix_equals(L);
            continue;
        }
        lua_pushliteral(L, "\n");
        lua_insert(L, -2);
        lua_concat(L, 3);
    }
    mn_le_remember(lua_tostring(L, 1));
    lua_remove(L, 1);
    return status;
}

/* Print the values on the stack with mnemo._repl_show (nil prints
 * nothing, tables pretty-printed), or with print when it is missing. */
static void l_print(lua_State *L)
{
    int n = lua_gettop(L);
    if (n == 0) return;
    luaL_checkstack(L, LUA_MINSTACK, "too many results to print");
    if (!push_module_function(L, "_repl_show")) lua_getglobal(L, "print");
    lua_insert(L, 1);
    if (docall(L, n, 0) != LUA_OK)
        l_message(progname, lua_pushfstring(L, "error printing the result (%s)",
                                            lua_tostring(L, -1)));
}

static void print_banner(lua_State *L)
{
    const char *device = "cpu";
    int top = lua_gettop(L);
    if (push_module_function(L, "device") && lua_pcall(L, 0, 1, 0) == LUA_OK &&
        luaL_tolstring(L, -1, NULL) != NULL)
        device = lua_tostring(L, -1);
    printf("mnemo %s (%s, %s) \xe2\x80\x94 help() for a tour, Ctrl-D to quit\n", MN_VERSION,
           LUA_VERSION, device);
    fflush(stdout);
    lua_settop(L, top);
}

static void doREPL(lua_State *L, int quiet)
{
    int status;
    const char *oldprogname = progname;
    progname = NULL; /* errors in the REPL carry no "mnemo:" prefix */
    if (!quiet) print_banner(L);
    mn_le_open(L, PROMPT1);
    while ((status = loadline(L)) != -1) {
        if (status == LUA_OK) status = docall(L, 0, LUA_MULTRET);
        if (status == LUA_OK) l_print(L);
        else report(L, status);
        lua_settop(L, 0);
        report(L, after_statement(L));
        fflush(stdout);
    }
    lua_settop(L, 0);
    fputs("\n", stdout);
    fflush(stdout);
    mn_le_close();
    progname = oldprogname;
}

/* ----------------------------------------------------------- start-up */

static int open_mnemo(lua_State *L)
{
    luaL_requiref(L, "mnemo", luaopen_mnemo, 1);
    return 1;
}

static int g_argc, g_script, g_args;
static char **g_argv;

static int pmain(lua_State *L)
{
    char **argv = g_argv;
    int script = g_script, args = g_args;
    luaL_checkversion(L);
    luaL_openlibs(L);
    createargtable(L, argv, g_argc, script);
    lua_gc(L, LUA_GCRESTART);
    lua_gc(L, LUA_GCGEN, 0, 0);
    lua_pushcfunction(L, open_mnemo);
    if (report(L, docall(L, 0, 1)) != LUA_OK) {
        exit_status = 1;
        return 0;
    }
    module_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    if (args & has_quiet) {
        lua_rawgeti(L, LUA_REGISTRYINDEX, module_ref);
        lua_pushboolean(L, 1);
        lua_setfield(L, -2, "quiet");
        lua_pop(L, 1);
    }
    if (!runargs(L, argv, script)) {
        exit_status = 1;
        return 0;
    }
    if (script < g_argc && handle_script(L, argv + script) != LUA_OK) {
        if (exit_status == 0) exit_status = 1;
        return 0;
    }
    if (args & has_i) {
        doREPL(L, args & has_quiet);
    } else if (script == g_argc && !(args & has_e)) {
        if (isatty(STDIN_FILENO)) {
            doREPL(L, args & has_quiet);
        } else if (dochunk(L, luaL_loadfile(L, NULL)) != LUA_OK) {
            exit_status = 1;
            return 0;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    lua_State *L;
    int status, script = argc, args;
    setsignal(SIGSEGV, on_crash);
    setsignal(SIGBUS, on_crash);
    setsignal(SIGABRT, on_crash); /* glibc's heap checks, after libhdf5 wrote past a block */
    if (argc >= 2 && strcmp(argv[1], "run") == 0) return mn_cli_run(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "compare") == 0) return mn_cli_compare(argc - 1, argv + 1);
    args = collectargs(argv, &script);
    if (args & has_error) {
        if (bad_needs_arg)
            fprintf(stderr, "mnemo: '%s' needs an argument (try 'mnemo --help')\n", bad_option);
        else
            fprintf(stderr, "mnemo: unknown option '%s' (try 'mnemo --help')\n", bad_option);
        return 2;
    }
    if (args & has_help) {
        print_usage(stdout);
        return 0;
    }
    if (args & has_version) {
        print_version();
        return 0;
    }
    L = luaL_newstate();
    if (L == NULL) {
        l_message(progname, "cannot create the Lua state: not enough memory");
        return 1;
    }
    lua_gc(L, LUA_GCSTOP);
    g_argc = argc;
    g_argv = argv;
    g_script = script;
    g_args = args;
    lua_pushcfunction(L, pmain);
    status = lua_pcall(L, 0, 0, 0);
    if (status != LUA_OK) {
        report(L, status);
        exit_status = 1;
    }
    lua_close(L);
    return exit_status;
}
