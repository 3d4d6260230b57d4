#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <string.h>
#include "core.h"
#include "grammar.h"
static void test_smoke(void **state)
{
    (void)state;
    char err[256];
    struct tdm_grammar *g;
    assert_int_equal(tdm_grammar_compile_regex(&g, "ab+c", 4, err, sizeof err), TDM_OK);
    struct tdm_grammar_matcher *m;
    assert_int_equal(tdm_grammar_matcher_new(&m, g, NULL), TDM_OK);
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "abbb", 4), TDM_OK);
    assert_false(tdm_grammar_matcher_accepts_eos(m));
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "c", 1), TDM_OK);
    assert_true(tdm_grammar_matcher_accepts_eos(m));
    tdm_grammar_matcher_free(m);
    tdm_grammar_unref(g);
}
int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_smoke)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
