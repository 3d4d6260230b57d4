// SPDX-License-Identifier: Apache-2.0
// Tests for the bf16/f16 <-> f32 conversions against known bit patterns:
// rounding to nearest even (ties both ways), NaN kept as NaN with its sign,
// infinities, signed zeros, f16 subnormals and overflow to inf. Plus an
// exhaustive f16 -> f32 -> f16 and bf16 -> f32 -> bf16 identity check.
#include "hf.h"

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <string.h>

#include <cmocka.h>

static float f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static void test_dtype_names(void **state)
{
    (void)state;
    assert_int_equal(tdm_dtype_size(TDM_DTYPE_F32), 4);
    assert_int_equal(tdm_dtype_size(TDM_DTYPE_F16), 2);
    assert_int_equal(tdm_dtype_size(TDM_DTYPE_BF16), 2);
    assert_string_equal(tdm_dtype_name(TDM_DTYPE_F32), "F32");
    assert_string_equal(tdm_dtype_name(TDM_DTYPE_F16), "F16");
    assert_string_equal(tdm_dtype_name(TDM_DTYPE_BF16), "BF16");
}

static void test_bf16(void **state)
{
    (void)state;
    assert_int_equal(bits(tdm_bf16_to_f32(0x3f80)), 0x3f800000u); // 1.0
    assert_int_equal(bits(tdm_bf16_to_f32(0xc049)), 0xc0490000u);
    assert_int_equal(tdm_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(tdm_f32_to_bf16(-2.0f), 0xc000);
    assert_int_equal(tdm_f32_to_bf16(0.0f), 0x0000);
    assert_int_equal(tdm_f32_to_bf16(-0.0f), 0x8000);
    // pi = 0x40490fdb -> 0x4049 (below half)
    assert_int_equal(tdm_f32_to_bf16(f32(0x40490fdbu)), 0x4049);
    // above half rounds up
    assert_int_equal(tdm_f32_to_bf16(f32(0x3f808001u)), 0x3f81);
    // exact ties: to even
    assert_int_equal(tdm_f32_to_bf16(f32(0x3f808000u)), 0x3f80); // 0x3f80 even: stays
    assert_int_equal(tdm_f32_to_bf16(f32(0x3f818000u)), 0x3f82); // 0x3f81 odd: up
    assert_int_equal(tdm_f32_to_bf16(f32(0xbf818000u)), 0xbf82);
    // max finite f32 rounds to inf; inf stays inf
    assert_int_equal(tdm_f32_to_bf16(f32(0x7f7fffffu)), 0x7f80);
    assert_int_equal(tdm_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(tdm_f32_to_bf16(-INFINITY), 0xff80);
    // largest bf16 below inf stays
    assert_int_equal(tdm_f32_to_bf16(f32(0x7f7f0000u)), 0x7f7f);
    // NaN with payload only in the low 16 bits must not become inf
    uint16_t n = tdm_f32_to_bf16(f32(0x7f800001u));
    assert_int_equal(n & 0x7f80, 0x7f80);
    assert_true((n & 0x7f) != 0);
    assert_true(isnan(tdm_bf16_to_f32(n)));
    n = tdm_f32_to_bf16(f32(0xffc00000u)); // negative quiet NaN
    assert_int_equal(n, 0xffc0);
    assert_true(isnan(tdm_bf16_to_f32(0x7fc0)));
    // f32 subnormals keep their top bits
    assert_int_equal(tdm_f32_to_bf16(f32(0x00010000u)), 0x0001);
    // every bf16 survives the round trip
    for (uint32_t h = 0; h < 0x10000; h++) {
        uint16_t back = tdm_f32_to_bf16(tdm_bf16_to_f32((uint16_t)h));
        if ((h & 0x7f80) == 0x7f80 && (h & 0x7f))
            assert_true((back & 0x7f80) == 0x7f80 && (back & 0x7f) &&
                        (back & 0x8000) == (h & 0x8000));
        else
            assert_int_equal(back, h);
    }
}

static void test_f16(void **state)
{
    (void)state;
    assert_true(tdm_f16_to_f32(0x3c00) == 1.0f);
    assert_true(tdm_f16_to_f32(0xc000) == -2.0f);
    assert_true(tdm_f16_to_f32(0x7bff) == 65504.0f);          // max normal
    assert_true(tdm_f16_to_f32(0x0400) == ldexpf(1, -14));    // min normal
    assert_true(tdm_f16_to_f32(0x0001) == ldexpf(1, -24));    // min subnormal
    assert_true(tdm_f16_to_f32(0x03ff) == ldexpf(1023, -24)); // max subnormal
    assert_true(tdm_f16_to_f32(0x8001) == -ldexpf(1, -24));
    assert_true(tdm_f16_to_f32(0x0200) == ldexpf(1, -15));
    assert_int_equal(bits(tdm_f16_to_f32(0x0000)), 0x00000000u);
    assert_int_equal(bits(tdm_f16_to_f32(0x8000)), 0x80000000u);
    assert_true(isinf(tdm_f16_to_f32(0x7c00)) && tdm_f16_to_f32(0x7c00) > 0);
    assert_true(isinf(tdm_f16_to_f32(0xfc00)) && tdm_f16_to_f32(0xfc00) < 0);
    assert_true(isnan(tdm_f16_to_f32(0x7e00)));
    assert_true(isnan(tdm_f16_to_f32(0x7c01))); // signalling NaN payload kept
    assert_int_equal(bits(tdm_f16_to_f32(0x7c01)), 0x7f802000u);

    assert_int_equal(tdm_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(tdm_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(tdm_f32_to_f16(0.0f), 0x0000);
    assert_int_equal(tdm_f32_to_f16(-0.0f), 0x8000);
    assert_int_equal(tdm_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(tdm_f32_to_f16(65519.99f), 0x7bff); // below the midpoint to inf
    assert_int_equal(tdm_f32_to_f16(65520.0f), 0x7c00);  // tie with inf: rounds to even (inf)
    assert_int_equal(tdm_f32_to_f16(1e10f), 0x7c00);
    assert_int_equal(tdm_f32_to_f16(-1e10f), 0xfc00);
    assert_int_equal(tdm_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(tdm_f32_to_f16(-INFINITY), 0xfc00);
    // 1 + 2^-11 is a tie between 0x3c00 and 0x3c01: even wins
    assert_int_equal(tdm_f32_to_f16(1.0f + ldexpf(1, -11)), 0x3c00);
    assert_int_equal(tdm_f32_to_f16(1.0f + 3 * ldexpf(1, -11)), 0x3c02);
    assert_int_equal(tdm_f32_to_f16(1.0f + ldexpf(1, -11) + ldexpf(1, -20)), 0x3c01);
    // subnormals
    assert_int_equal(tdm_f32_to_f16(ldexpf(1, -24)), 0x0001);
    assert_int_equal(tdm_f32_to_f16(ldexpf(1023, -24)), 0x03ff);
    assert_int_equal(tdm_f32_to_f16(ldexpf(1, -25)), 0x0000);           // tie to even (0)
    assert_int_equal(tdm_f32_to_f16(ldexpf(3, -25)), 0x0002);           // 1.5 -> 2 (even)
    assert_int_equal(tdm_f32_to_f16(ldexpf(5, -26)), 0x0001);           // 1.25 -> 1
    assert_int_equal(tdm_f32_to_f16(ldexpf(1, -25) * 1.0001f), 0x0001); // above half
    assert_int_equal(tdm_f32_to_f16(-ldexpf(1, -24)), 0x8001);
    assert_int_equal(tdm_f32_to_f16(ldexpf(1, -30)), 0x0000);
    assert_int_equal(tdm_f32_to_f16(-ldexpf(1, -30)), 0x8000);
    assert_int_equal(tdm_f32_to_f16(f32(0x00000001u)), 0x0000); // f32 subnormal
    // rounding from the largest subnormal up into the smallest normal
    assert_int_equal(tdm_f32_to_f16(ldexpf(2047, -25)), 0x0400);
    assert_int_equal(tdm_f32_to_f16(ldexpf(1, -14)), 0x0400);
    // NaN stays NaN, sign kept, payload top bits kept
    assert_int_equal(tdm_f32_to_f16(f32(0x7fc00000u)), 0x7e00);
    assert_int_equal(tdm_f32_to_f16(f32(0xffc00000u)), 0xfe00);
    uint16_t n = tdm_f32_to_f16(f32(0x7f800001u));
    assert_int_equal(n & 0x7c00, 0x7c00);
    assert_true((n & 0x3ff) != 0);
    // every f16 survives the round trip (NaNs stay NaN with the same sign)
    for (uint32_t h = 0; h < 0x10000; h++) {
        uint16_t back = tdm_f32_to_f16(tdm_f16_to_f32((uint16_t)h));
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff))
            assert_true((back & 0x7c00) == 0x7c00 && (back & 0x3ff) &&
                        (back & 0x8000) == (h & 0x8000));
        else
            assert_int_equal(back, h);
    }
}

// f32 -> f16 must agree with the nearest representable value (checked by
// measuring distances in double) over a sweep of f32 bit patterns.
static void test_f16_nearest_sweep(void **state)
{
    (void)state;
    for (uint32_t u = 0; u < 0x7f800000u; u += 0x1f3d) {
        float x = f32(u);
        uint16_t h = tdm_f32_to_f16(x);
        double got = tdm_f16_to_f32(h);
        if (isinf(got)) {
            assert_true((double)x >= 65520.0);
            continue;
        }
        double err = fabs(got - (double)x);
        // neighbours of h must not be strictly closer
        if (h < 0x7bff) {
            double up = tdm_f16_to_f32((uint16_t)(h + 1));
            assert_true(fabs(up - (double)x) >= err);
        }
        if (h > 0) {
            double down = tdm_f16_to_f32((uint16_t)(h - 1));
            assert_true(fabs(down - (double)x) >= err);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_names),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_f16_nearest_sweep),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
