/* tools: the `hybridep` command line. */
#ifndef HEP_TOOLS_CLI_H
#define HEP_TOOLS_CLI_H

#include <stdio.h>

#include "hybridep/hybridep.h"

int hep_cmd_doctor(int argc, char **argv);
int hep_cmd_plan(int argc, char **argv);
int hep_cmd_bench(int argc, char **argv);

/* ---- options (tools/opts.c): getopt_long over a table, one message per bad value */
typedef enum { CLI_FLAG, CLI_INT, CLI_STR, CLI_CHOICE, CLI_INT_LIST } cli_kind;

typedef struct cli_opt {
    const char *name;    /* long name without "--" */
    cli_kind kind;
    void *dst;           /* int * (FLAG, INT, CHOICE: the index), const char ** (STR),
                            cli_int_list * (INT_LIST) */
    long long lo, hi;    /* INT, INT_LIST: allowed range */
    const char *choices; /* CHOICE: "bf16|fp8" */
    const char *arg;     /* the value's name in --help ("N") */
    const char *help;    /* what it does; the default is printed from *dst */
} cli_opt;

#define CLI_LIST_MAX 32
typedef struct cli_int_list {
    int n, v[CLI_LIST_MAX];
} cli_int_list;

typedef struct cli_cmd {
    const char *name;     /* "bench" */
    const char *summary;  /* one line */
    const cli_opt *opts;
    int nopts;
    const char *notes;    /* printed after the options in --help (may be NULL) */
} cli_cmd;

/* Parse argv[1..] (argv[0] is the command's name). 0: go on; -1: --help was printed (exit
 * 0); else the exit code (2) after one message saying which option or value is wrong. */
int cli_parse(const cli_cmd *c, int argc, char **argv);
/* A failure message: "hybridep CMD: ..." on stderr, or with --json one JSON object
 * {"command", "error", "exit_code"} on stdout. Returns `code`. */
int cli_fail(const char *cmd, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* 1 when --json is among the arguments (set by cli_parse, read by cli_fail). */
extern int cli_json;
/* The environment knobs, for every command's --help. */
void cli_print_env(FILE *f);

#endif
