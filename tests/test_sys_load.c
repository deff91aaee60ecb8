/* The real tables load without crashing whatever the machine lacks: run once with the
 * real libibverbs path and once with HEP_IBVERBS_LIB pointing at nothing (ctest). */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
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
    assert_non_null(strstr(t->load_error, "cannot load"));
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

int main(void)
{
    /* two ctest entries: one with the real library path, one with HEP_IBVERBS_LIB pointing
     * at nothing; each runs the cases of its situation */
    const struct CMUnitTest present[] = {
        cmocka_unit_test(ibv_table_binds_versioned_symbols_when_library_present),
        cmocka_unit_test(cuda_table_reports_missing_driver_cleanly),
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
