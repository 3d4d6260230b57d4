// SPDX-License-Identifier: Apache-2.0
// Visible skips for the cmocka tests. cmocka's skip() marks a test skipped but
// its group still returns 0, so ctest counted the binary as passed: a golden
// test whose ../shared folder was missing passed silently. A test skips with
// TDM_SKIP("why"), which prints "SKIPPED: <test>: why" and counts it; main
// ends with tdm_test_exit(failed): 1 when a test failed, else 77 when any was
// skipped (ctest's SKIP_RETURN_CODE, set for every tdm_test), else 0.
// tdm_test_filters(argc, argv) takes "--only PATTERN" / "--skip PATTERN" (cmocka's
// filters, '*' and '?' wildcards), so that CMake can register a test that
// depends on the host (an ISA's kernels) as a ctest of its own, leaving the
// rest of its binary to pass or fail on every host (tdm_test(... SPLIT name)).
// cmocka keeps one skip pattern: a binary given several --skip (several
// SPLIT names) runs its group with tdm_run_group_tests, which leaves out every
// test a --skip names; tdm_test_exit fails a binary that was given several and
// ran cmocka_run_group_tests instead (the earlier patterns would have run).
// Header-only, for tests.
#ifndef TDM_TEST_SKIP_H
#define TDM_TEST_SKIP_H

#include <fnmatch.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static int tdm_test_skipped_;
#define TDM_TEST_MAX_SKIPS 16
static const char *tdm_test_skips_[TDM_TEST_MAX_SKIPS];
static int tdm_test_n_skips_;
static int tdm_test_filtered_; // tdm_run_group_tests applied every --skip

static __attribute__((format(printf, 2, 3), unused)) void tdm_skip_note_(const char *test,
                                                                         const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("SKIPPED: %s: ", test);
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    tdm_test_skipped_++;
}

#define TDM_SKIP(...)                                                                              \
    do {                                                                                           \
        tdm_skip_note_(__func__, __VA_ARGS__);                                                     \
        skip();                                                                                    \
    } while (0)

static __attribute__((unused)) void tdm_test_filters(int argc, char **argv)
{
    for (int i = 1; i + 1 < argc; i++) {
        if (strcmp(argv[i], "--only") == 0) {
            cmocka_set_test_filter(argv[++i]);
        } else if (strcmp(argv[i], "--skip") == 0) {
            cmocka_set_skip_filter(argv[++i]);
            if (tdm_test_n_skips_ < TDM_TEST_MAX_SKIPS)
                tdm_test_skips_[tdm_test_n_skips_] = argv[i];
            tdm_test_n_skips_++;
        }
    }
}

// cmocka_run_group_tests without the tests any --skip names.
#define tdm_run_group_tests(tests, setup, teardown)                                                \
    tdm_run_filtered_(#tests, tests, sizeof(tests) / sizeof((tests)[0]), setup, teardown)

static __attribute__((unused)) int tdm_run_filtered_(const char *name,
                                                     const struct CMUnitTest *tests, size_t n,
                                                     CMFixtureFunction setup,
                                                     CMFixtureFunction teardown)
{
    struct CMUnitTest kept[n > 0 ? n : 1];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int skip_it = 0;
        for (int j = 0; j < tdm_test_n_skips_ && j < TDM_TEST_MAX_SKIPS; j++)
            skip_it |= fnmatch(tdm_test_skips_[j], tests[i].name, 0) == 0;
        if (!skip_it)
            kept[k++] = tests[i];
    }
    tdm_test_filtered_ = 1;
    return _cmocka_run_group_tests(name, kept, k, setup, teardown);
}

static __attribute__((unused)) int tdm_test_exit(int failed)
{
    if (tdm_test_n_skips_ > TDM_TEST_MAX_SKIPS || (tdm_test_n_skips_ > 1 && !tdm_test_filtered_)) {
        printf("FAILED: %d --skip patterns, and this binary applies only one (run its group "
               "with tdm_run_group_tests, at most %d)\n",
               tdm_test_n_skips_, TDM_TEST_MAX_SKIPS);
        return 1;
    }
    if (failed)
        return 1;
    if (tdm_test_skipped_) {
        printf("SKIPPED: %d test(s) of this binary did not run (reasons above)\n",
               tdm_test_skipped_);
        return 77;
    }
    return 0;
}

#endif
