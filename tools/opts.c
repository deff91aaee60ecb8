/* tools/opts.c: the option layer of every subcommand: getopt_long over a table, so that
 * `--opt value` and `--opt=value` both work, a missing value is an error wherever the
 * option stands, and each bad value gets one message naming the flag, the value and what
 * is allowed. */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json.h"

int cli_json;

int cli_fail(const char *cmd, int code, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (cli_json) {
        hep_json j;
        json_begin(&j, stdout);
        json_obj(&j, NULL);
        json_str(&j, "command", cmd);
        json_str(&j, "error", msg);
        json_int(&j, "exit_code", code);
        json_end_obj(&j);
        json_finish(&j);
    } else {
        fprintf(stderr, "hybridep %s: %s\n", cmd, msg);
    }
    return code;
}

void cli_print_env(FILE *f)
{
    fprintf(f, "environment (read by the library):\n"
               "  HEP_TIMEOUT_MS    bound of every wait, ms (default 30000)\n"
               "  HEP_LOG_LEVEL     error|warn|info|debug (default info)\n"
               "  HEP_NIC           auto|loopback|verbs: the inter-node transport (default auto)\n"
               "  HEP_NIC_MAP       gpu:device,...: the RDMA device of each GPU (default: nearest)\n"
               "  HEP_GPU_MR_MODE   auto|dmabuf|legacy: GPU memory registration (default auto)\n"
               "  HEP_IB_GID_INDEX  GID index for RoCE (default: a RoCE v2 GID)\n"
               "  HEP_IBVERBS_LIB   which libibverbs to load (default libibverbs.so.1)\n");
}

static void print_default(FILE *f, const cli_opt *o)
{
    switch (o->kind) {
    case CLI_INT:
        fprintf(f, " (default %d; %lld..%lld)", *(const int *)o->dst, o->lo, o->hi);
        break;
    case CLI_STR:
        if (*(const char *const *)o->dst)
            fprintf(f, " (default %s)", *(const char *const *)o->dst);
        break;
    case CLI_CHOICE: {
        const char *c = o->choices;
        int idx = *(const int *)o->dst;
        for (int i = 0; i < idx && c; i++)
            c = strchr(c, '|') ? strchr(c, '|') + 1 : NULL;
        if (c)
            fprintf(f, " (default %.*s)", (int)strcspn(c, "|"), c);
        break;
    }
    case CLI_INT_LIST:
        fprintf(f, " (%lld..%lld each)", o->lo, o->hi);
        break;
    case CLI_FLAG:
        break;
    }
}

static void usage(const cli_cmd *c, FILE *f)
{
    fprintf(f, "usage: hybridep %s [options]\n%s\n\noptions (--opt value or --opt=value):\n",
            c->name, c->summary);
    for (int i = 0; i < c->nopts; i++) {
        const cli_opt *o = &c->opts[i];
        char lhs[64];
        snprintf(lhs, sizeof(lhs), "--%s%s%s", o->name, o->kind == CLI_FLAG ? "" : " ",
                 o->kind == CLI_FLAG ? "" : o->kind == CLI_CHOICE ? o->choices : o->arg);
        fprintf(f, "  %-28s %s", lhs, o->help);
        print_default(f, o);
        fprintf(f, "\n");
    }
    fprintf(f, "  %-28s %s\n", "--help", "this text");
    if (c->notes)
        fprintf(f, "\n%s\n", c->notes);
    fprintf(f, "\n");
    cli_print_env(f);
}

/* One integer in lo..hi. Out of range and not-a-number are different messages. */
static int parse_int(const char *cmd, const cli_opt *o, const char *v, int *out)
{
    char *end = NULL;
    long long x;
    errno = 0;
    x = strtoll(v, &end, 10);
    if (!*v || *end || end == v)
        return cli_fail(cmd, 2, "--%s '%s' is not an integer (allowed: %lld..%lld)", o->name, v,
                        o->lo, o->hi);
    if (errno == ERANGE || x < o->lo || x > o->hi)
        return cli_fail(cmd, 2, "--%s %s is out of range (allowed: %lld..%lld)", o->name, v,
                        o->lo, o->hi);
    *out = (int)x;
    return 0;
}

static int parse_list(const char *cmd, const cli_opt *o, const char *v, cli_int_list *out)
{
    char buf[512];
    char *save = NULL;
    cli_opt one = *o;
    snprintf(buf, sizeof(buf), "%s", v);
    out->n = 0;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int rc;
        if (out->n == CLI_LIST_MAX)
            return cli_fail(cmd, 2, "--%s '%s' has more than %d values", o->name, v, CLI_LIST_MAX);
        if ((rc = parse_int(cmd, &one, t, &out->v[out->n])))
            return rc;
        out->n++;
    }
    if (out->n == 0)
        return cli_fail(cmd, 2, "--%s '%s' is not a comma-separated list of integers", o->name, v);
    return 0;
}

static int parse_choice(const char *cmd, const cli_opt *o, const char *v, int *out)
{
    const char *c = o->choices;
    size_t lv = strlen(v);
    for (int i = 0; c; i++) {
        size_t l = strcspn(c, "|");
        if (l == lv && strncmp(c, v, l) == 0) {
            *out = i;
            return 0;
        }
        c = c[l] ? c + l + 1 : NULL;
    }
    return cli_fail(cmd, 2, "--%s '%s' is not one of %s", o->name, v, o->choices);
}

int cli_parse(const cli_cmd *c, int argc, char **argv)
{
    struct option lo[64];
    int n = c->nopts < 62 ? c->nopts : 62;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--json") == 0)
            cli_json = 1;
    for (int i = 0; i < n; i++)
        lo[i] = (struct option){c->opts[i].name,
                                c->opts[i].kind == CLI_FLAG ? no_argument : required_argument,
                                NULL, 1000 + i};
    lo[n] = (struct option){"help", no_argument, NULL, 'h'};
    lo[n + 1] = (struct option){NULL, 0, NULL, 0};
    opterr = 0;
    optind = 1;
    for (;;) {
        int li = -1, k = getopt_long(argc, argv, ":h", lo, &li), rc = 0;
        const cli_opt *o;
        if (k == -1)
            break;
        if (k == 'h') {
            usage(c, stdout);
            return -1;
        }
        if (k == ':')
            return cli_fail(c->name, 2, "%s needs a value", argv[optind - 1]);
        if (k == '?')
            return cli_fail(c->name, 2, "unknown option '%s' (see hybridep %s --help)",
                            argv[optind - 1], c->name);
        o = &c->opts[k - 1000];
        /* `--json-file --json`: the next option is no value */
        if (o->kind != CLI_FLAG && strncmp(optarg, "--", 2) == 0)
            return cli_fail(c->name, 2, "--%s needs a value (got the option '%s')", o->name,
                            optarg);
        switch (o->kind) {
        case CLI_FLAG: *(int *)o->dst = 1; break;
        case CLI_INT: rc = parse_int(c->name, o, optarg, (int *)o->dst); break;
        case CLI_STR:
            if (!*optarg)
                rc = cli_fail(c->name, 2, "--%s needs a value (got an empty one)", o->name);
            *(const char **)o->dst = optarg;
            break;
        case CLI_CHOICE: rc = parse_choice(c->name, o, optarg, (int *)o->dst); break;
        case CLI_INT_LIST: rc = parse_list(c->name, o, optarg, (cli_int_list *)o->dst); break;
        }
        if (rc)
            return rc;
    }
    if (optind < argc)
        return cli_fail(c->name, 2, "unexpected argument '%s' (see hybridep %s --help)",
                        argv[optind], c->name);
    return 0;
}
