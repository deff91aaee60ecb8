/* kernels/divmagic.h, the multiply-high division of the dispatch layout's MASK_MAGIC form,
 * checked on the host against the division it replaces: every divisor the layout's shared
 * memory allows, at both edges of every quotient (the largest remainder is where the
 * factor's excess shows first), every numerator for the small divisors of real models, and
 * the bound itself (where it is not met the shortcut is wrong, so the bound is needed), and
 * that the dispatch kernel's shared memory keeps every layout inside it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cmocka.h>

#include "kernels/divmagic.h"
#include "kernels/ep_kernels.h"

/* R * E_l stays below this: group creation refuses a dispatch kernel of more than 200 KB
 * of shared memory (src/group/ep.c), and the last case checks that this bound follows */
#define LAYOUT_KEYS 51200u

static void divmagic_factor_is_the_ceiling_of_two_to_the_32_over_d(void **state)
{
    (void)state;
    for (uint64_t d = 1; d <= LAYOUT_KEYS; d++)
        assert_int_equal(hep_div_magic((unsigned)d), ((1ull << 32) + d - 1) / d);
    assert_int_equal(hep_div_magic(1), 1ull << 32);
    assert_int_equal(hep_div_magic(0xffffffffu), 2);
}

static void divmagic_is_exact_for_every_layout_key_at_both_edges_of_each_quotient(void **state)
{
    (void)state;
    uint64_t checked = 0;
    for (unsigned d = 1; d <= LAYOUT_KEYS; d++) {
        const unsigned long long m = hep_div_magic(d);
        for (unsigned q = 0; (unsigned long long)q * d < LAYOUT_KEYS; q++) {
            const unsigned lo = q * d, hi = lo + d - 1 < LAYOUT_KEYS ? lo + d - 1 : LAYOUT_KEYS - 1;
            assert_int_equal(hep_div_by_magic(lo, m), q);
            assert_int_equal(hep_div_by_magic(hi, m), hi / d);
            checked += 2;
        }
    }
    assert_true(checked > 1000000);
}

static void divmagic_is_exact_for_every_key_of_small_divisors(void **state)
{
    (void)state;
    for (unsigned d = 1; d <= 288; d++) {
        const unsigned long long m = hep_div_magic(d);
        for (unsigned n = 0; n < LAYOUT_KEYS; n++)
            assert_int_equal(hep_div_by_magic(n, m), n / d);
    }
}

static void divmagic_bound_is_needed(void **state)
{
    (void)state;
    /* d = 3: m = 0x55555556 (excess 2), so n m / 2^32 = n / 3 + n / (3 * 2^31): one too
     * many first at n = 2^31 (= 3q + 2), where n (d - 1) reaches 2^32 ... */
    const unsigned long long m = hep_div_magic(3);
    assert_int_not_equal(hep_div_by_magic(0x80000000u, m), 0x80000000u / 3);
    /* ... and never below it (n (d - 1) < 2^32 is n < 2^31 here) */
    for (unsigned n = 0x7fffff00u; n < 0x80000000u; n++)
        assert_int_equal(hep_div_by_magic(n, m), n / 3);
}

static void divmagic_keys_of_every_layout_group_creation_accepts_are_below_the_bound(void **state)
{
    (void)state;
    if (hep_dispatch_smem(1, 1) == 0) {
        printf("skipped: this build has no CUDA kernels (hep_dispatch_smem is the stub's 0)\n");
        skip();
    }
    /* the smallest E_l at which R * E_l reaches the bound is refused at every R */
    for (int R = 1; R <= HEP_GPU_MAX_LOCAL; R++)
        assert_true(hep_dispatch_smem(R, (int)((LAYOUT_KEYS + (unsigned)R - 1) / (unsigned)R)) >
                    200 * 1024);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(divmagic_factor_is_the_ceiling_of_two_to_the_32_over_d),
        cmocka_unit_test(divmagic_is_exact_for_every_layout_key_at_both_edges_of_each_quotient),
        cmocka_unit_test(divmagic_is_exact_for_every_key_of_small_divisors),
        cmocka_unit_test(divmagic_bound_is_needed),
        cmocka_unit_test(divmagic_keys_of_every_layout_group_creation_accepts_are_below_the_bound),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
