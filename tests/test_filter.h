/* tests/test_filter.h: HEP_GPU_TEST_FILTER for the GPU test binaries. One cmocka pattern
 * ("*huge_timeout*"), or several separated by commas ("gpu_sixteen*,gpu_graph*"): the cases
 * any of them names, in the binary's own order, so that a case can be run after the one
 * that precedes it in the whole suite. Unset or empty: every case. */
#ifndef HEP_TEST_FILTER_H
#define HEP_TEST_FILTER_H

#include <fnmatch.h>
#include <stdlib.h>
#include <string.h>

static int hep_test_selected(const char *name, const char *filter)
{
    char pat[256];
    for (const char *p = filter; *p;) {
        size_t n = strcspn(p, ",");
        if (n && n < sizeof(pat)) {
            memcpy(pat, p, n);
            pat[n] = 0;
            if (fnmatch(pat, name, 0) == 0)
                return 1;
        }
        p += n + (p[n] == ',');
    }
    return 0;
}

/* Runs the selected cases of tests[0..n) as cmocka group `group`. */
static int hep_run_filtered(const char *group, struct CMUnitTest *tests, size_t n)
{
    const char *f = getenv("HEP_GPU_TEST_FILTER");
    size_t k = 0;
    if (!f || !*f)
        return _cmocka_run_group_tests(group, tests, n, NULL, NULL);
    for (size_t i = 0; i < n; i++)
        if (hep_test_selected(tests[i].name, f))
            tests[k++] = tests[i];
    if (k == 0) {
        printf("no case matches HEP_GPU_TEST_FILTER=%s\n", f);
        return 1;
    }
    return _cmocka_run_group_tests(group, tests, k, NULL, NULL);
}

#endif
