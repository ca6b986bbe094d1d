/* lineedit.h: line input for the REPL. On a terminal: GNU readline, with
 * history kept in $MNEMO_HISTORY (or ~/.mnemo_history), completion of Lua
 * names through tables and metatables, and Ctrl-C clearing the line being
 * typed. Otherwise plain stdio, the prompt written to stdout, no history. */
#ifndef MN_LINEEDIT_H
#define MN_LINEEDIT_H

#include <lua.h>

/* Start line editing; completion looks names up in L. primary_prompt is the
 * prompt a Ctrl-C goes back to. */
void mn_le_open(lua_State *L, const char *primary_prompt);
/* One line without its newline, malloc'ed (the caller frees it); NULL at end
 * of input. */
char *mn_le_read(const char *prompt);
/* 1 once after a Ctrl-C at a prompt (the caller drops the lines it holds
 * for an unfinished chunk); 0 otherwise. */
int mn_le_take_interrupt(void);
/* Add a chunk (possibly several lines) to the history as one entry: empty
 * chunks and repeats of the previous entry are skipped. */
void mn_le_remember(const char *chunk);
/* Save and cap the history file; end line editing. */
void mn_le_close(void);

#endif
