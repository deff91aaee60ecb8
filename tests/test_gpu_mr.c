/* Unit tests of the registration helper's contract, through the fake table. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"
#include "fake_mr.h"
#include "hybridep/gpu_mr.h"

static struct ibv_pd *const PD = (struct ibv_pd *)(uintptr_t)0x1000;
static char buffer_storage[8192] __attribute__((aligned(4096)));
#define ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_RELAXED_ORDERING)

static void set_mode(const char *mode)
{
    if (mode)
        setenv("HEP_GPU_MR_MODE", mode, 1);
    else
        unsetenv("HEP_GPU_MR_MODE");
    hep_env_reload();
}

static int setup(void **state)
{
    static fake_mr f;
    fake_mr_init(&f);
    set_mode(NULL);
    *state = &f;
    return 0;
}

static int reg(fake_mr *f, void *addr, size_t len, hep_gpu_mr *out)
{
    return hep_gpu_mr_register(&f->ops, PD, 0, addr, len, ACCESS, "dispatch.attn_input_token", out);
}

static void assert_contains(const char *hay, const char *needle)
{
    if (!strstr(hay, needle))
        fail_msg("expected \"%s\" in \"%s\"", needle, hay);
}

static void mr_rejects_invalid_arguments_before_any_external_call(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    void *wrap = (void *)(uintptr_t)(UINT64_MAX - 10);
    assert_int_equal(hep_gpu_mr_register(&f->ops, NULL, 0, buffer_storage, 64, ACCESS, "b", &out),
                     HEP_ERR_INVALID);
    assert_contains(hep_last_error(), "protection domain is NULL");
    assert_int_equal(hep_gpu_mr_register(&f->ops, PD, 0, NULL, 64, ACCESS, "b", &out),
                     HEP_ERR_INVALID);
    assert_contains(hep_last_error(), "address is NULL");
    assert_int_equal(hep_gpu_mr_register(&f->ops, PD, 0, buffer_storage, 0, ACCESS, "b", &out),
                     HEP_ERR_INVALID);
    assert_contains(hep_last_error(), "length is 0");
    assert_int_equal(hep_gpu_mr_register(&f->ops, PD, 0, wrap, 64, ACCESS, "b", &out),
                     HEP_ERR_INVALID);
    assert_contains(hep_last_error(), "wraps");
    assert_int_equal(hep_gpu_mr_register(&f->ops, PD, 0, buffer_storage, 64, ACCESS, "b", NULL),
                     HEP_ERR_INVALID);
    assert_int_equal(f->calls, 0);
}

static void mr_uses_legacy_keys_and_makes_no_dmabuf_call_when_reg_mr_succeeds(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    assert_int_equal(reg(f, buffer_storage + 16, 3696, &out), HEP_OK);
    assert_int_equal(out.path, HEP_MR_LEGACY);
    assert_int_equal(out.lkey, 0x11);
    assert_int_equal(out.rkey, 0x22);
    assert_int_equal(out.addr, (uint64_t)(uintptr_t)(buffer_storage + 16));
    assert_int_equal(out.length, 3696);
    assert_int_equal(out.export_addr, 0);
    assert_int_equal(out.export_length, 0);
    assert_int_equal(f->reg_mr_calls, 1);
    assert_int_equal(f->calls, 1);
    assert_int_equal(f->reg_mr_access, ACCESS);
    assert_int_equal(hep_gpu_mr_deregister(&out), HEP_OK);
    assert_int_equal(f->dereg_calls, 1);
}

static void mr_falls_back_to_dmabuf_when_legacy_fails(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    char *p = buffer_storage + 0x800; /* 3696 bytes from mid-page: spans one page */
    f->legacy_errno = EFAULT;
    assert_int_equal(reg(f, p, 3696, &out), HEP_OK);
    assert_int_equal(out.path, HEP_MR_DMABUF);
    assert_int_equal(f->export_addr, (uint64_t)(uintptr_t)buffer_storage);
    assert_int_equal(f->export_len, 8192);
    assert_int_equal(out.export_addr, (uint64_t)(uintptr_t)buffer_storage);
    assert_int_equal(out.export_length, 8192);
    /* reg_dmabuf_mr(pd, 0, export_length, export_addr, fd, access) */
    assert_int_equal(f->reg_dmabuf_offset, 0);
    assert_int_equal(f->reg_dmabuf_len, 8192);
    assert_int_equal(f->reg_dmabuf_iova, (uint64_t)(uintptr_t)buffer_storage);
    assert_int_equal(f->reg_dmabuf_fd, 42);
    assert_int_equal(f->reg_dmabuf_access, ACCESS);
    assert_int_equal(out.lkey, 0x33);
    assert_int_equal(out.rkey, 0x44);
    /* the original address is kept; ibv_mr::addr (the offset, 0) is not used */
    assert_int_equal(out.addr, (uint64_t)(uintptr_t)p);
    assert_int_equal(out.length, 3696);
    assert_ptr_equal(out.mr->addr, NULL);
    assert_int_equal(f->close_calls, 1);
    assert_int_equal(f->closed_fd, 42);
    assert_int_equal(hep_gpu_mr_deregister(&out), HEP_OK);
    assert_int_equal(f->dereg_calls, 1);
}

static void mr_exports_enclosing_pages_of_an_interior_pointer(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    f->legacy_errno = EINVAL;
    assert_int_equal(reg(f, buffer_storage + 4096 + 1, 1, &out), HEP_OK);
    assert_int_equal(out.export_addr, (uint64_t)(uintptr_t)(buffer_storage + 4096));
    assert_int_equal(out.export_length, 4096);
    assert_int_equal(out.addr, (uint64_t)(uintptr_t)(buffer_storage + 4097));
    hep_gpu_mr_deregister(&out);
}

static void mr_reports_saved_legacy_errno_even_when_later_calls_change_errno(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    f->legacy_errno = EFAULT;
    f->clobber_errno = EINVAL;
    f->dmabuf_support = 0;
    assert_int_equal(reg(f, buffer_storage, 100, &out), HEP_ERR_UNAVAILABLE);
    assert_contains(hep_last_error(), "dispatch.attn_input_token");
    assert_contains(hep_last_error(), strerror(EFAULT));
    assert_contains(hep_last_error(), "(errno 14)");
    assert_contains(hep_last_error(), "does not support DMA-BUF");
    assert_null(strstr(hep_last_error(), strerror(EINVAL)));
    assert_int_equal(f->export_calls, 0);
}

static void mr_fails_clearly_when_dmabuf_query_fails(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    memset(&out, 0xab, sizeof(out));
    f->legacy_errno = EOPNOTSUPP;
    f->dmabuf_support = -1;
    assert_int_equal(reg(f, buffer_storage, 100, &out), HEP_ERR_UNAVAILABLE);
    assert_contains(hep_last_error(), "could not be queried for DMA-BUF");
    assert_contains(hep_last_error(), strerror(EOPNOTSUPP));
    assert_null(out.mr);
    assert_int_equal(f->export_calls, 0);
    assert_int_equal(f->close_calls, 0);
}

static void mr_rejects_page_size_that_is_not_a_power_of_two(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    long bad[] = {0, -1, 3000, 4097};
    f->legacy_errno = EFAULT;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        f->page = bad[i];
        assert_int_equal(reg(f, buffer_storage, 100, &out), HEP_ERR_INVALID);
        assert_contains(hep_last_error(), "not a power of two");
    }
    assert_int_equal(f->export_calls, 0);
}

static void mr_rejects_aligned_end_that_would_overflow_without_exporting(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    void *addr = (void *)(uintptr_t)0xFFFFFFFFFFFFF001ull; /* addr + len does not wrap... */
    f->legacy_errno = EFAULT;
    assert_int_equal(reg(f, addr, 0xFFE, &out), HEP_ERR_INVALID); /* ...its page end does */
    assert_contains(hep_last_error(), "overflows");
    assert_int_equal(f->export_calls, 0);
    assert_int_equal(f->close_calls, 0);
}

static void mr_export_failure_names_buffer_cuda_error_and_legacy_error(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    f->legacy_errno = EFAULT;
    f->export_rc = 1;
    assert_int_equal(reg(f, buffer_storage, 3696, &out), HEP_ERR_CUDA);
    assert_contains(hep_last_error(), "dispatch.attn_input_token");
    assert_contains(hep_last_error(), "CUDA_ERROR_INVALID_VALUE");
    assert_contains(hep_last_error(), "invalid argument");
    assert_contains(hep_last_error(), "ibv_reg_mr failed: Bad address (errno 14)");
    assert_int_equal(f->reg_dmabuf_calls, 0);
    assert_int_equal(f->close_calls, 0); /* no fd: nothing to close */
}

static void mr_dmabuf_registration_failure_closes_fd_once_and_reports(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    f->legacy_errno = EFAULT;
    f->dmabuf_errno = EINVAL;
    f->export_fd = 7;
    assert_int_equal(reg(f, buffer_storage, 64, &out), HEP_ERR_VERBS);
    assert_contains(hep_last_error(), "ibv_reg_dmabuf_mr failed: Invalid argument (errno 22)");
    assert_contains(hep_last_error(), "ibv_reg_mr failed: Bad address");
    assert_int_equal(f->close_calls, 1);
    assert_int_equal(f->closed_fd, 7);
    assert_null(out.mr);
}

static void mr_fd_zero_is_a_valid_fd_and_is_closed(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    f->legacy_errno = EFAULT;
    f->export_fd = 0;
    assert_int_equal(reg(f, buffer_storage, 64, &out), HEP_OK);
    assert_int_equal(f->reg_dmabuf_fd, 0);
    assert_int_equal(f->close_calls, 1);
    assert_int_equal(f->closed_fd, 0);
    hep_gpu_mr_deregister(&out);
}

static void mr_enomem_mentions_ulimit(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    f->legacy_errno = ENOMEM;
    f->dmabuf_errno = ENOMEM;
    assert_int_equal(reg(f, buffer_storage, 64, &out), HEP_ERR_VERBS);
    assert_contains(hep_last_error(), "ulimit -l");
    set_mode("legacy");
    assert_int_equal(reg(f, buffer_storage, 64, &out), HEP_ERR_VERBS);
    assert_contains(hep_last_error(), "ulimit -l");
    assert_contains(hep_last_error(), "RLIMIT_MEMLOCK");
}

static void mr_deregister_calls_dereg_once_and_reports_failure(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    assert_int_equal(reg(f, buffer_storage, 64, &out), HEP_OK);
    f->dereg_rc = EBUSY;
    assert_int_equal(hep_gpu_mr_deregister(&out), HEP_ERR_VERBS);
    assert_contains(hep_last_error(), strerror(EBUSY));
    assert_int_equal(f->dereg_calls, 1);
    assert_int_equal(hep_gpu_mr_deregister(&out), HEP_OK); /* cleared: no second call */
    assert_int_equal(f->dereg_calls, 1);
    assert_int_equal(hep_gpu_mr_deregister(NULL), HEP_OK);
}

static void mr_mode_dmabuf_skips_legacy_attempt(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    set_mode("dmabuf");
    assert_int_equal(reg(f, buffer_storage, 64, &out), HEP_OK);
    assert_int_equal(out.path, HEP_MR_DMABUF);
    assert_int_equal(f->reg_mr_calls, 0);
    hep_gpu_mr_deregister(&out);
    f->dmabuf_support = 0;
    assert_int_equal(reg(f, buffer_storage, 64, &out), HEP_ERR_UNAVAILABLE);
    assert_contains(hep_last_error(), "not attempted (HEP_GPU_MR_MODE=dmabuf)");
}

static void mr_mode_legacy_never_falls_back(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    set_mode("legacy");
    f->legacy_errno = EFAULT;
    assert_int_equal(reg(f, buffer_storage, 64, &out), HEP_ERR_VERBS);
    assert_contains(hep_last_error(), "fallback disabled");
    assert_int_equal(f->calls, 1);
}

static void mr_null_name_is_accepted(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    f->legacy_errno = EFAULT;
    f->dmabuf_support = 0;
    assert_int_equal(hep_gpu_mr_register(&f->ops, PD, 0, buffer_storage, 8, ACCESS, NULL, &out),
                     HEP_ERR_UNAVAILABLE);
    assert_contains(hep_last_error(), "(unnamed)");
}

static void mr_logs_chosen_path_at_debug_level(void **state)
{
    fake_mr *f = *state;
    hep_gpu_mr out;
    char seen[1024] = "";
    void sink(void *ctx, int level, const char *line);
    setenv("HEP_LOG_LEVEL", "debug", 1);
    hep_env_reload();
    hep_log_set_sink(sink, seen);
    f->legacy_errno = EFAULT;
    assert_int_equal(reg(f, buffer_storage + 0x10, 64, &out), HEP_OK);
    hep_log_set_sink(NULL, NULL);
    unsetenv("HEP_LOG_LEVEL");
    hep_env_reload();
    assert_contains(seen, "dispatch.attn_input_token");
    assert_contains(seen, "dmabuf path");
    assert_contains(seen, "exported 0x");
    hep_gpu_mr_deregister(&out);
}

void sink(void *ctx, int level, const char *line)
{
    (void)level;
    if (strstr(line, "registered GPU buffer"))
        strncpy(ctx, line, 1023);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(mr_rejects_invalid_arguments_before_any_external_call, setup),
        cmocka_unit_test_setup(mr_uses_legacy_keys_and_makes_no_dmabuf_call_when_reg_mr_succeeds,
                               setup),
        cmocka_unit_test_setup(mr_falls_back_to_dmabuf_when_legacy_fails, setup),
        cmocka_unit_test_setup(mr_exports_enclosing_pages_of_an_interior_pointer, setup),
        cmocka_unit_test_setup(mr_reports_saved_legacy_errno_even_when_later_calls_change_errno,
                               setup),
        cmocka_unit_test_setup(mr_fails_clearly_when_dmabuf_query_fails, setup),
        cmocka_unit_test_setup(mr_rejects_page_size_that_is_not_a_power_of_two, setup),
        cmocka_unit_test_setup(mr_rejects_aligned_end_that_would_overflow_without_exporting, setup),
        cmocka_unit_test_setup(mr_export_failure_names_buffer_cuda_error_and_legacy_error, setup),
        cmocka_unit_test_setup(mr_dmabuf_registration_failure_closes_fd_once_and_reports, setup),
        cmocka_unit_test_setup(mr_fd_zero_is_a_valid_fd_and_is_closed, setup),
        cmocka_unit_test_setup(mr_enomem_mentions_ulimit, setup),
        cmocka_unit_test_setup(mr_deregister_calls_dereg_once_and_reports_failure, setup),
        cmocka_unit_test_setup(mr_mode_dmabuf_skips_legacy_attempt, setup),
        cmocka_unit_test_setup(mr_mode_legacy_never_falls_back, setup),
        cmocka_unit_test_setup(mr_null_name_is_accepted, setup),
        cmocka_unit_test_setup(mr_logs_chosen_path_at_debug_level, setup),
    };
    return cmocka_run_group_tests_name("gpu_mr", tests, NULL, NULL);
}
