/* tools: the `hybridep` command line. */
#ifndef HEP_TOOLS_CLI_H
#define HEP_TOOLS_CLI_H

int hep_cmd_doctor(int argc, char **argv);
/* Print "hybridep CMD: unknown argument ARG" and return 2. */
int cli_usage_error(const char *cmd, const char *arg);

#endif
