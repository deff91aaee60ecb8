#include <math.h>

#include <stdio.h>

#include "json.h"

static void put_string(FILE *f, const char *s);

static void sep(hep_json *j, const char *key)
{
    if (!j->first[j->depth])
        fputc(',', j->f);
    j->first[j->depth] = 0;
    if (key) {
        put_string(j->f, key);
        fputc(':', j->f);
    }
}

static void put_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

void json_begin(hep_json *j, FILE *f)
{
    j->f = f;
    j->depth = 0;
    j->first[0] = 1;
}

static void open_(hep_json *j, const char *key, char c)
{
    sep(j, key);
    fputc(c, j->f);
    j->first[++j->depth] = 1;
}

void json_obj(hep_json *j, const char *key)
{
    open_(j, key, '{');
}
void json_arr(hep_json *j, const char *key)
{
    open_(j, key, '[');
}
void json_end_obj(hep_json *j)
{
    j->depth--;
    fputc('}', j->f);
}
void json_end_arr(hep_json *j)
{
    j->depth--;
    fputc(']', j->f);
}
void json_str(hep_json *j, const char *key, const char *v)
{
    sep(j, key);
    if (v)
        put_string(j->f, v);
    else
        fputs("null", j->f);
}
void json_int(hep_json *j, const char *key, long long v)
{
    sep(j, key);
    fprintf(j->f, "%lld", v);
}
void json_num(hep_json *j, const char *key, double v)
{
    sep(j, key);
    if (isfinite(v))
        fprintf(j->f, "%.6g", v);
    else
        fputs("null", j->f);
}
void json_bool(hep_json *j, const char *key, int v)
{
    sep(j, key);
    fputs(v ? "true" : "false", j->f);
}
void json_finish(hep_json *j)
{
    fputc('\n', j->f);
}
