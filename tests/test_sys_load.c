/* The real tables load without crashing whatever the machine lacks: run once with the
 * real libibverbs path and once with HEP_IBVERBS_LIB pointing at nothing (ctest). */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"
#include "hybridep/gpu_mr.h"
#include "sys/sys.h"

static int expect_missing(void)
{
    const char *v = getenv("HEP_TEST_EXPECT_NO_IBVERBS");
    return v && *v == '1';
}

static void ibv_table_missing_library_is_an_error_not_a_crash(void **state)
{
    const hep_ibv_table *t = hep_ibv();
    (void)state;
    assert_int_equal(t->loaded, 0);
#ifdef HEP_NO_VERBS /* built without the headers: nothing is loaded, and it says why */
    assert_non_null(strstr(t->load_error, "libibverbs-dev"));
#else
    assert_non_null(strstr(t->load_error, "cannot load"));
#endif
    assert_null(t->reg_dmabuf_mr);
    assert_int_equal(hep_ibv_require(t->alloc_pd, "ibv_alloc_pd"), HEP_ERR_UNAVAILABLE);
    assert_non_null(strstr(hep_last_error(), "libibverbs"));
}

static void ibv_table_binds_versioned_symbols_when_library_present(void **state)
{
    const hep_ibv_table *t = hep_ibv();
    (void)state;
    if (!t->loaded) {
        print_message("skipped: libibverbs.so.1 is not installed: %s\n", t->load_error);
        skip();
    }
    assert_non_null(t->reg_mr);
    assert_non_null(t->reg_mr_iova2);  /* IBVERBS_1.8 */
    assert_non_null(t->reg_dmabuf_mr); /* IBVERBS_1.12 */
    assert_non_null(t->get_device_list);
    assert_int_equal(hep_ibv_require(t->reg_dmabuf_mr, "ibv_reg_dmabuf_mr"), HEP_OK);
}

static void real_ops_without_verbs_or_driver_fail_with_a_message(void **state)
{
    hep_gpu_mr out;
    static char buf[64];
    int rc;
    (void)state;
    /* a dummy pd: the real reg_mr refuses before touching it when libibverbs is absent */
    rc = hep_gpu_mr_register(NULL, (struct ibv_pd *)(uintptr_t)0x1, 0, buf, sizeof(buf), 0,
                             "combine.attn_output_flags", &out);
    assert_int_not_equal(rc, HEP_OK);
    assert_non_null(strstr(hep_last_error(), "combine.attn_output_flags"));
    assert_non_null(strstr(hep_last_error(), "ibv_reg_mr failed"));
}

static void cuda_table_reports_missing_driver_cleanly(void **state)
{
    const hep_cu_table *t = hep_cu();
    (void)state;
    if (t->loaded) {
        assert_true(t->driver_version > 0);
        assert_non_null(t->device_get_attribute);
        return;
    }
    assert_true(strlen(t->load_error) > 0);
    assert_int_equal(hep_cu_require(t->mem_get_handle_for_address_range, "export"),
                     HEP_ERR_UNAVAILABLE);
}

static char warned[1024];
static void keep(void *ctx, int level, const char *line)
{
    (void)ctx;
    if (level == HEP_LOG_WARN)
        snprintf(warned, sizeof(warned), "%s", line);
}

static void env_bad_values_are_reported_and_defaults_kept(void **state)
{
    const hep_env *e;
    (void)state;
    setenv("HEP_TIMEOUT_MS", "abc", 1);
    setenv("HEP_GPU_MR_MODE", "sometimes", 1);
    hep_log_set_sink(keep, NULL);
    e = hep_env_reload();
    hep_log_set_sink(NULL, NULL);
    assert_int_equal(e->timeout_ms, 30000);
    assert_int_equal(e->mr_mode, HEP_MR_MODE_AUTO);
    assert_non_null(strstr(warned, "HEP_TIMEOUT_MS='abc'"));
    assert_non_null(strstr(warned, "HEP_GPU_MR_MODE='sometimes'"));
    setenv("HEP_TIMEOUT_MS", "1500", 1);
    setenv("HEP_GPU_MR_MODE", "DMABUF", 1);
    e = hep_env_reload();
    assert_int_equal(e->timeout_ms, 1500);
    assert_int_equal(e->mr_mode, HEP_MR_MODE_DMABUF);
    assert_string_equal(e->errors, "");
    unsetenv("HEP_TIMEOUT_MS");
    unsetenv("HEP_GPU_MR_MODE");
    hep_env_reload();
}

int main(void)
{
    /* two ctest entries: one with the real library path, one with HEP_IBVERBS_LIB pointing
     * at nothing; each runs the cases of its situation */
    const struct CMUnitTest present[] = {
        cmocka_unit_test(ibv_table_binds_versioned_symbols_when_library_present),
        cmocka_unit_test(cuda_table_reports_missing_driver_cleanly),
        cmocka_unit_test(env_bad_values_are_reported_and_defaults_kept),
    };
    const struct CMUnitTest missing[] = {
        cmocka_unit_test(ibv_table_missing_library_is_an_error_not_a_crash),
        cmocka_unit_test(real_ops_without_verbs_or_driver_fail_with_a_message),
        cmocka_unit_test(cuda_table_reports_missing_driver_cleanly),
    };
    if (expect_missing())
        return cmocka_run_group_tests_name("sys_load_without_libibverbs", missing, NULL, NULL);
    return cmocka_run_group_tests_name("sys_load", present, NULL, NULL);
}
