/* tools/json.h: a minimal streaming JSON writer for the CLI's --json output. */
#ifndef HEP_TOOLS_JSON_H
#define HEP_TOOLS_JSON_H

#include <stdio.h>

typedef struct hep_json {
    FILE *f;
    int depth;
    int first[32]; /* per level: no element written yet */
} hep_json;

void json_begin(hep_json *j, FILE *f);
void json_obj(hep_json *j, const char *key); /* key NULL inside arrays / at top */
void json_arr(hep_json *j, const char *key);
void json_end_obj(hep_json *j);
void json_end_arr(hep_json *j);
void json_str(hep_json *j, const char *key, const char *v); /* v NULL -> null */
void json_int(hep_json *j, const char *key, long long v);
void json_num(hep_json *j, const char *key, double v);
void json_bool(hep_json *j, const char *key, int v);
void json_finish(hep_json *j);

#endif
