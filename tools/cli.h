/* tools: the `hybridep` command line. */
#ifndef HEP_TOOLS_CLI_H
#define HEP_TOOLS_CLI_H

#include "hybridep/hybridep.h"

int hep_cmd_doctor(int argc, char **argv);
int hep_cmd_plan(int argc, char **argv);
int hep_cmd_bench(int argc, char **argv);
int cli_parse_int(const char *cmd, const char *opt, const char *v, int *out);
int cli_parse_dtype(const char *cmd, const char *v, hep_dtype *out);
/* Print "hybridep CMD: unknown argument ARG" and return 2. */
int cli_usage_error(const char *cmd, const char *arg);

#endif
