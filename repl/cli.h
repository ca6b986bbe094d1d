/* cli.h: the `mnemo run` and `mnemo compare` subcommands (SPEC.md section 6).
 * main.c hands over its arguments from the subcommand on: argv[0] is "run"
 * or "compare". Each returns the process exit status: 0 success, 1 a failed
 * comparison, 2 bad usage or bad input (after a one-line message on stderr
 * that names the file, dataset or attribute at fault). */
#ifndef MN_CLI_H
#define MN_CLI_H

int mn_cli_run(int argc, char **argv);
int mn_cli_compare(int argc, char **argv);

#endif
