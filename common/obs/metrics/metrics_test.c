// SPDX-License-Identifier: Apache-2.0
// Tests for metrics: exact exposition text (escaping, label order, histogram
// lines), number formatting, bucket placement and cumulativity, vLLM bucket
// sets and the 1-2-5 helper, registration errors, the standard vLLM set, exact
// sums under concurrent updates, and rendering while other threads update,
// create children and register families.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "metrics.h"

static struct tdm_metrics_registry *new_registry(const struct tdm_metrics_label *labels, size_t n)
{
    struct tdm_metrics_registry *reg = NULL;
    char err[256] = "";
    int rc = tdm_metrics_registry_new(&reg, labels, n, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("registry_new: %s", err);
    return reg;
}

static char *render(struct tdm_metrics_registry *reg)
{
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_metrics_render(reg, &text, &len), TDM_OK);
    assert_non_null(text);
    assert_int_equal(strlen(text), len);
    return text;
}

// ---- exact text --------------------------------------------------------------------------

static void test_exact_text(void **state)
{
    (void)state;
    const struct tdm_metrics_label reg_labels[] = {{"model_name", "m"}};
    struct tdm_metrics_registry *reg = new_registry(reg_labels, 1);
    char err[256] = "";

    static const char *const reason[] = {"reason"};
    struct tdm_metrics_counter *req = NULL;
    struct tdm_metrics_opts o = {.name = "test:requests_total",
                                 .help = "Requests seen.\nBy reason \\ all.",
                                 .label_names = reason,
                                 .n_label_names = 1};
    assert_int_equal(tdm_metrics_counter_register(&req, reg, &o, err, sizeof err), TDM_OK);
    tdm_metrics_counter_add(tdm_metrics_counter_labels(req, "stop"), 3);
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(req, "q\"\\\nx"));

    struct tdm_metrics_gauge *temp = NULL;
    o = (struct tdm_metrics_opts){.name = "test:temp", .help = "Temp.", .no_registry_labels = true};
    assert_int_equal(tdm_metrics_gauge_register(&temp, reg, &o, err, sizeof err), TDM_OK);
    tdm_metrics_gauge_set(temp, -2.5);

    struct tdm_metrics_histogram *lat = NULL;
    const struct tdm_metrics_label engine[] = {{"engine", "0"}};
    const double bounds[] = {0.125, 1, 2.5};
    o = (struct tdm_metrics_opts){.name = "test:latency_seconds",
                                  .help = "Latency.",
                                  .const_labels = engine,
                                  .n_const_labels = 1};
    assert_int_equal(tdm_metrics_histogram_register(&lat, reg, &o, bounds, 3, err, sizeof err),
                     TDM_OK);
    const double obs[] = {0.0625, 0.125, 0.5, 3, 100};
    for (size_t i = 0; i < 5; i++)
        tdm_metrics_histogram_observe(lat, obs[i]);

    struct tdm_metrics_gauge *empty = NULL;
    o = (struct tdm_metrics_opts){
        .name = "test:by_reason", .help = "", .label_names = reason, .n_label_names = 1};
    assert_int_equal(tdm_metrics_gauge_register(&empty, reg, &o, err, sizeof err), TDM_OK);

    const char *want = "# HELP test:requests_total Requests seen.\\nBy reason \\\\ all.\n"
                       "# TYPE test:requests_total counter\n"
                       "test:requests_total{model_name=\"m\",reason=\"stop\"} 3\n"
                       "test:requests_total{model_name=\"m\",reason=\"q\\\"\\\\\\nx\"} 1\n"
                       "# HELP test:temp Temp.\n"
                       "# TYPE test:temp gauge\n"
                       "test:temp -2.5\n"
                       "# HELP test:latency_seconds Latency.\n"
                       "# TYPE test:latency_seconds histogram\n"
                       "test:latency_seconds_bucket{engine=\"0\",le=\"0.125\",model_name=\"m\"} 2\n"
                       "test:latency_seconds_bucket{engine=\"0\",le=\"1.0\",model_name=\"m\"} 3\n"
                       "test:latency_seconds_bucket{engine=\"0\",le=\"2.5\",model_name=\"m\"} 3\n"
                       "test:latency_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 5\n"
                       "test:latency_seconds_count{engine=\"0\",model_name=\"m\"} 5\n"
                       "test:latency_seconds_sum{engine=\"0\",model_name=\"m\"} 103.6875\n"
                       "# HELP test:by_reason \n"
                       "# TYPE test:by_reason gauge\n";
    char *text = render(reg);
    assert_string_equal(text, want);
    free(text);

    // Repeated lookups return the same cached child; the root of a labelled
    // family is not exported.
    assert_ptr_equal(tdm_metrics_counter_labels(req, "stop"),
                     tdm_metrics_counter_labels(req, "stop"));
    assert_ptr_not_equal(tdm_metrics_counter_labels(req, "stop"),
                         tdm_metrics_counter_labels(req, "stoq"));
    tdm_metrics_counter_inc(req);
    text = render(reg);
    assert_null(strstr(text, "test:requests_total 1"));
    assert_non_null(strstr(text, "test:requests_total{model_name=\"m\",reason=\"stoq\"} 0\n"));
    free(text);

    // render_buf reuses the caller's buffer.
    char *buf = NULL;
    size_t cap = 0, len = 0;
    assert_int_equal(tdm_metrics_render_buf(reg, &buf, &cap, &len), TDM_OK);
    char *first = buf;
    size_t first_len = len;
    assert_int_equal(tdm_metrics_render_buf(reg, &buf, &cap, &len), TDM_OK);
    assert_ptr_equal(buf, first);
    assert_int_equal(len, first_len);
    assert_true(cap > len);
    free(buf);
    tdm_metrics_registry_free(reg);
}

static void test_counter_name_and_info(void **state)
{
    (void)state;
    struct tdm_metrics_registry *reg = new_registry(NULL, 0);
    char err[256] = "";
    struct tdm_metrics_counter *a = NULL, *b = NULL;
    // With or without _total, the family is exported once with _total.
    struct tdm_metrics_opts o = {.name = "vllm:prompt_tokens", .help = "P."};
    assert_int_equal(tdm_metrics_counter_register(&a, reg, &o, err, sizeof err), TDM_OK);
    o.name = "tandem:kv_bytes_sent_total";
    assert_int_equal(tdm_metrics_counter_register(&b, reg, &o, err, sizeof err), TDM_OK);
    tdm_metrics_counter_add(a, 12345678);
    tdm_metrics_counter_add(b, 0.5);
    tdm_metrics_counter_add(b, -7);  // ignored: counters only go up
    tdm_metrics_counter_add(b, NAN); // ignored
    assert_true(tdm_metrics_counter_value(b) == 0.5);

    struct tdm_metrics_gauge *info = NULL;
    const struct tdm_metrics_label fields[] = {{"version", "0.1.0"}, {"commit", "abc"}};
    o = (struct tdm_metrics_opts){
        .name = "tandem:build_info", .help = "Build.", .const_labels = fields, .n_const_labels = 2};
    assert_int_equal(tdm_metrics_info_register(&info, reg, &o, err, sizeof err), TDM_OK);
    assert_true(tdm_metrics_gauge_value(info) == 1.0);

    char *text = render(reg);
    assert_string_equal(text, "# HELP vllm:prompt_tokens_total P.\n"
                              "# TYPE vllm:prompt_tokens_total counter\n"
                              "vllm:prompt_tokens_total 12345678\n"
                              "# HELP tandem:kv_bytes_sent_total P.\n"
                              "# TYPE tandem:kv_bytes_sent_total counter\n"
                              "tandem:kv_bytes_sent_total 0.5\n"
                              "# HELP tandem:build_info Build.\n"
                              "# TYPE tandem:build_info gauge\n"
                              "tandem:build_info{commit=\"abc\",version=\"0.1.0\"} 1\n");
    free(text);
    tdm_metrics_registry_free(reg);
}

// ---- numbers -------------------------------------------------------------------------------

static void test_format_double(void **state)
{
    (void)state;
    static const struct {
        double v;
        const char *want;
    } cases[] = {
        {0.0, "0"},
        {-0.0, "0"},
        {1.0, "1"},
        {-1.0, "-1"},
        {2560.0, "2560"},
        {16384.0, "16384"},
        {123456789.0, "123456789"},
        {0.001, "0.001"},
        {0.1, "0.1"},
        {0.3, "0.3"},
        {0.075, "0.075"},
        {2.5, "2.5"},
        {-2.5, "-2.5"},
        {0.0001, "0.0001"},
        {1e-05, "1e-05"},
        {1.5e-07, "1.5e-07"},
        {123456.75, "123456.75"},
        {1234567.5, "1.2345675e+06"},
        {1e20, "1e+20"},
        {0.1 + 0.2, "0.30000000000000004"},
        {1.0 / 3.0, "0.3333333333333333"},
        {NAN, "NaN"},
        {INFINITY, "+Inf"},
        {-INFINITY, "-Inf"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[32];
        size_t n = tdm_metrics_format_double(buf, cases[i].v);
        assert_string_equal(buf, cases[i].want);
        assert_int_equal(n, strlen(cases[i].want));
        if (isfinite(cases[i].v))
            assert_true(strtod(buf, NULL) == cases[i].v);
    }
    // Every double round-trips, including the longest ones.
    const double hard[] = {5e-324, 1.7976931348623157e308, 0.1 * 3, 9007199254740993.0, 4.35};
    for (size_t i = 0; i < sizeof hard / sizeof hard[0]; i++) {
        char buf[32];
        tdm_metrics_format_double(buf, hard[i]);
        assert_true(strtod(buf, NULL) == hard[i]);
    }
}

// ---- histograms ----------------------------------------------------------------------------

static void test_histogram_buckets(void **state)
{
    (void)state;
    struct tdm_metrics_registry *reg = new_registry(NULL, 0);
    char err[256] = "";
    struct tdm_metrics_histogram *h = NULL;
    const double bounds[] = {1, 2, 5, INFINITY}; // trailing +Inf is dropped
    struct tdm_metrics_opts o = {.name = "h", .help = "H."};
    assert_int_equal(tdm_metrics_histogram_register(&h, reg, &o, bounds, 4, err, sizeof err),
                     TDM_OK);
    // A value equal to a bound counts in that bucket (le = "less or equal").
    const double obs[] = {-3, 0.5, 1, 1.0000001, 2, 4.99, 5, 5.01, 1e9, NAN};
    for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++)
        tdm_metrics_histogram_observe(h, obs[i]);
    assert_int_equal(tdm_metrics_histogram_bucket(h, 0), 3); // -3, 0.5, 1
    assert_int_equal(tdm_metrics_histogram_bucket(h, 1), 5); // + 1.0000001, 2
    assert_int_equal(tdm_metrics_histogram_bucket(h, 2), 7); // + 4.99, 5
    assert_int_equal(tdm_metrics_histogram_bucket(h, 3), 10);
    assert_int_equal(tdm_metrics_histogram_bucket(h, 4), 0); // out of range
    assert_int_equal(tdm_metrics_histogram_count(h), 10);
    assert_true(isnan(tdm_metrics_histogram_sum(h)));

    char *text = render(reg);
    // Cumulative and non-decreasing, +Inf once, _count equal to +Inf.
    const char *want_lines[] = {"h_bucket{le=\"1.0\"} 3\n",
                                "h_bucket{le=\"2.0\"} 5\n",
                                "h_bucket{le=\"5.0\"} 7\n",
                                "h_bucket{le=\"+Inf\"} 10\n",
                                "h_count 10\n",
                                "h_sum NaN\n"};
    const char *at = text;
    for (size_t i = 0; i < 6; i++) {
        const char *p = strstr(at, want_lines[i]);
        if (!p)
            fail_msg("missing or out of order: %s in\n%s", want_lines[i], text);
        at = p + 1;
    }
    assert_null(strstr(strstr(text, "+Inf") + 1, "+Inf"));
    free(text);

    // `le` as prometheus_client writes it (Python repr, exponent from 1e6 up).
    struct tdm_metrics_histogram *hl = NULL;
    o.name = "hl";
    const double big[] = {1e-05, 0.3, 100000, 1e6, 1234567.5, 1e16};
    assert_int_equal(tdm_metrics_histogram_register(&hl, reg, &o, big, 6, err, sizeof err), TDM_OK);
    text = render(reg);
    assert_non_null(strstr(text, "hl_bucket{le=\"1e-05\"} 0\nhl_bucket{le=\"0.3\"} 0\n"
                                 "hl_bucket{le=\"100000.0\"} 0\nhl_bucket{le=\"1e+06\"} 0\n"
                                 "hl_bucket{le=\"1.2345675e+06\"} 0\nhl_bucket{le=\"1e+16\"} 0\n"
                                 "hl_bucket{le=\"+Inf\"} 0\n"));
    free(text);

    // No bounds at all: only the +Inf bucket.
    struct tdm_metrics_histogram *h0 = NULL;
    o.name = "h0";
    assert_int_equal(tdm_metrics_histogram_register(&h0, reg, &o, NULL, 0, err, sizeof err),
                     TDM_OK);
    tdm_metrics_histogram_observe(h0, 0.25);
    text = render(reg);
    assert_non_null(strstr(text, "h0_bucket{le=\"+Inf\"} 1\nh0_count 1\nh0_sum 0.25\n"));
    free(text);
    tdm_metrics_registry_free(reg);
}

static void test_vllm_buckets(void **state)
{
    (void)state;
    size_t n;
    const double *b = tdm_metrics_buckets_ttft(&n);
    assert_int_equal(n, 22);
    assert_true(b[0] == 0.001 && b[7] == 0.1 && b[n - 2] == 640 && b[n - 1] == 2560);
    b = tdm_metrics_buckets_itl(&n);
    assert_int_equal(n, 19);
    assert_true(b[0] == 0.01 && b[3] == 0.075 && b[n - 1] == 80);
    b = tdm_metrics_buckets_request_latency(&n);
    assert_int_equal(n, 21);
    assert_true(b[0] == 0.3 && b[2] == 0.8 && b[n - 2] == 1920 && b[n - 1] == 7680);
    b = tdm_metrics_buckets_params_n(&n);
    assert_int_equal(n, 5);
    assert_true(b[0] == 1 && b[4] == 20);
    b = tdm_metrics_buckets_iteration_tokens(&n);
    assert_int_equal(n, 13);
    assert_true(b[0] == 1 && b[1] == 8 && b[n - 1] == 16384);

    double out[TDM_METRICS_MAX_1_2_5];
    // vLLM's docstring example: build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100].
    n = tdm_metrics_buckets_1_2_5(out, TDM_METRICS_MAX_1_2_5, 100);
    const double want100[] = {1, 2, 5, 10, 20, 50, 100};
    assert_int_equal(n, 7);
    for (size_t i = 0; i < n; i++)
        assert_true(out[i] == want100[i]);
    n = tdm_metrics_buckets_1_2_5(out, TDM_METRICS_MAX_1_2_5, 32768);
    assert_int_equal(n, 14);
    assert_true(out[n - 1] == 20000);
    assert_int_equal(tdm_metrics_buckets_1_2_5(out, TDM_METRICS_MAX_1_2_5, 0), 0);
    assert_int_equal(tdm_metrics_buckets_1_2_5(out, TDM_METRICS_MAX_1_2_5, -5), 0);
    assert_int_equal(tdm_metrics_buckets_1_2_5(out, TDM_METRICS_MAX_1_2_5, 1), 1);
    assert_int_equal(tdm_metrics_buckets_1_2_5(NULL, 0, 4), 2); // count only
    // INT64_MAX ~ 9.2e18: 1, 2, 5 times 10^0 .. 10^18, and no overflow past that.
    n = tdm_metrics_buckets_1_2_5(out, TDM_METRICS_MAX_1_2_5, INT64_MAX);
    assert_int_equal(n, 19 * 3);
    assert_true(n <= TDM_METRICS_MAX_1_2_5);
    assert_true(out[n - 1] == 5e18);
    assert_int_equal(tdm_metrics_buckets_1_2_5(out, TDM_METRICS_MAX_1_2_5, 4999999999999999999),
                     56);
}

// ---- errors --------------------------------------------------------------------------------

static void test_errors(void **state)
{
    (void)state;
    char err[256] = "";
    struct tdm_metrics_registry *reg = NULL;
    const struct tdm_metrics_label dup[] = {{"a", "1"}, {"a", "2"}};
    assert_int_equal(tdm_metrics_registry_new(&reg, dup, 2, err, sizeof err), TDM_EINVAL);
    assert_null(reg);
    const struct tdm_metrics_label bad[] = {{"1a", "1"}};
    assert_int_equal(tdm_metrics_registry_new(&reg, bad, 1, err, sizeof err), TDM_EINVAL);
    const struct tdm_metrics_label reserved[] = {{"__name__", "x"}};
    assert_int_equal(tdm_metrics_registry_new(&reg, reserved, 1, err, sizeof err), TDM_EINVAL);

    const struct tdm_metrics_label model[] = {{"model_name", "m"}};
    reg = new_registry(model, 1);
    struct tdm_metrics_counter *c = NULL;
    struct tdm_metrics_gauge *g = NULL;
    struct tdm_metrics_histogram *h = NULL;
    struct tdm_metrics_opts o = {.name = "bad name", .help = "x"};
    assert_int_equal(tdm_metrics_counter_register(&c, reg, &o, err, sizeof err), TDM_EINVAL);
    assert_null(c);
    assert_non_null(strstr(err, "bad name"));
    o.name = "9lives";
    assert_int_equal(tdm_metrics_gauge_register(&g, reg, &o, err, sizeof err), TDM_EINVAL);
    o.name = NULL;
    assert_int_equal(tdm_metrics_gauge_register(&g, reg, &o, err, sizeof err), TDM_EINVAL);

    // Duplicate label between registry and family; variable label "le" on a histogram.
    static const char *const model_var[] = {"model_name"};
    o = (struct tdm_metrics_opts){
        .name = "x", .help = "x", .label_names = model_var, .n_label_names = 1};
    assert_int_equal(tdm_metrics_counter_register(&c, reg, &o, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "duplicate"));
    o.no_registry_labels = true; // then it is fine
    assert_int_equal(tdm_metrics_counter_register(&c, reg, &o, err, sizeof err), TDM_OK);
    static const char *const le[] = {"le"};
    o = (struct tdm_metrics_opts){
        .name = "hist", .help = "x", .label_names = le, .n_label_names = 1};
    assert_int_equal(tdm_metrics_histogram_register(&h, reg, &o, NULL, 0, err, sizeof err),
                     TDM_EINVAL);

    // Names that collide once suffixes are added.
    o = (struct tdm_metrics_opts){.name = "x_total", .help = "x"};
    assert_int_equal(tdm_metrics_gauge_register(&g, reg, &o, err, sizeof err), TDM_EINVAL);
    o.name = "x";
    assert_int_equal(tdm_metrics_gauge_register(&g, reg, &o, err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_metrics_counter_register(&c, reg, &o, err, sizeof err), TDM_EINVAL);
    o.name = "lat";
    assert_int_equal(tdm_metrics_histogram_register(&h, reg, &o, NULL, 0, err, sizeof err), TDM_OK);
    o.name = "lat_count";
    assert_int_equal(tdm_metrics_counter_register(&c, reg, &o, err, sizeof err), TDM_EINVAL);
    o.name = "lat_bucket";
    assert_int_equal(tdm_metrics_gauge_register(&g, reg, &o, err, sizeof err), TDM_EINVAL);

    // Bounds must be finite and strictly increasing (a trailing +Inf is allowed).
    o.name = "b1";
    const double dec[] = {1, 1};
    assert_int_equal(tdm_metrics_histogram_register(&h, reg, &o, dec, 2, err, sizeof err),
                     TDM_EINVAL);
    const double nan_b[] = {1, NAN};
    assert_int_equal(tdm_metrics_histogram_register(&h, reg, &o, nan_b, 2, err, sizeof err),
                     TDM_EINVAL);
    const double inf_mid[] = {1, INFINITY, 3};
    assert_int_equal(tdm_metrics_histogram_register(&h, reg, &o, inf_mid, 3, err, sizeof err),
                     TDM_EINVAL);
    const double ninf[] = {-INFINITY, 1};
    assert_int_equal(tdm_metrics_histogram_register(&h, reg, &o, ninf, 2, err, sizeof err),
                     TDM_EINVAL);
    assert_int_equal(tdm_metrics_histogram_register(&h, reg, &o, NULL, 2, err, sizeof err),
                     TDM_EINVAL);

    // Info metrics take no variable labels.
    static const char *const var[] = {"v"};
    o = (struct tdm_metrics_opts){
        .name = "i_info", .help = "x", .label_names = var, .n_label_names = 1};
    assert_int_equal(tdm_metrics_info_register(&g, reg, &o, err, sizeof err), TDM_EINVAL);

    // Child lookups: wrong count, NULL value, child of a child, unlabelled family.
    static const char *const two[] = {"a", "b"};
    struct tdm_metrics_counter *fam = NULL;
    o = (struct tdm_metrics_opts){
        .name = "fam", .help = "x", .label_names = two, .n_label_names = 2};
    assert_int_equal(tdm_metrics_counter_register(&fam, reg, &o, err, sizeof err), TDM_OK);
    assert_null(tdm_metrics_counter_labels(fam, "only one"));
    assert_null(tdm_metrics_counter_labels(fam, "1", "2", "3"));
    assert_null(tdm_metrics_counter_labels(fam, "1", NULL));
    struct tdm_metrics_counter *child = tdm_metrics_counter_labels(fam, "1", "2");
    assert_non_null(child);
    assert_null(tdm_metrics_counter_labels(child, "1", "2"));
    assert_null(tdm_metrics_counter_labelsv(NULL, two, 2));
    struct tdm_metrics_gauge *plain = NULL;
    o = (struct tdm_metrics_opts){.name = "plain", .help = "x"};
    assert_int_equal(tdm_metrics_gauge_register(&plain, reg, &o, err, sizeof err), TDM_OK);
    assert_null(tdm_metrics_gauge_labels(plain, "x"));
    // ("ab","") and ("a","b") are different children.
    assert_ptr_not_equal(tdm_metrics_counter_labels(fam, "ab", ""),
                         tdm_metrics_counter_labels(fam, "a", "b"));

    // NULL handles are no-ops, reads of NULL are 0.
    tdm_metrics_counter_inc(NULL);
    tdm_metrics_counter_add(NULL, 1);
    tdm_metrics_gauge_set(NULL, 1);
    tdm_metrics_gauge_inc(NULL);
    tdm_metrics_histogram_observe(NULL, 1);
    assert_true(tdm_metrics_counter_value(NULL) == 0);
    assert_int_equal(tdm_metrics_histogram_count(NULL), 0);

    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_metrics_render(NULL, &text, &len), TDM_EINVAL);
    tdm_metrics_registry_free(reg);
    tdm_metrics_registry_free(NULL);
}

// ---- the standard vLLM set ------------------------------------------------------------------

static void test_vllm_set(void **state)
{
    (void)state;
    struct tdm_metrics_registry *reg = new_registry(NULL, 0);
    char err[256] = "";
    struct tdm_metrics_vllm v;
    const struct tdm_metrics_label extra[] = {{"swap_space", "4"}};
    struct tdm_metrics_vllm_config cfg = {
        .model_name = "Qwen/Qwen2.5-0.5B-Instruct",
        .max_model_len = 32768,
        .cache = {.block_size = 16,
                  .num_gpu_blocks = 1024,
                  .num_cpu_blocks = -1,
                  .gpu_memory_utilization = 0.9,
                  .enable_prefix_caching = true,
                  .extra = extra,
                  .n_extra = 1},
    };
    int rc = tdm_metrics_vllm_register(&v, reg, &cfg, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("vllm_register: %s", err);
    for (int r = TDM_FINISH_STOP; r < TDM_FINISH_COUNT; r++)
        assert_non_null(v.request_success_by_reason[r]);
    assert_ptr_equal(tdm_metrics_counter_labels(v.request_success, "stop"),
                     v.request_success_by_reason[TDM_FINISH_STOP]);
    assert_null(tdm_finish_name(TDM_FINISH_COUNT));

    tdm_metrics_gauge_set(v.num_requests_running, 2);
    tdm_metrics_gauge_set(v.kv_cache_usage_perc, 0.25);
    tdm_metrics_counter_add(v.prompt_tokens, 7);
    tdm_metrics_counter_inc(v.request_success_by_reason[TDM_FINISH_LENGTH]);
    tdm_metrics_histogram_observe(v.time_to_first_token_seconds, 0.03);
    tdm_metrics_histogram_observe(v.request_prompt_tokens, 7);

    char *text = render(reg);
#define L "{engine=\"0\",model_name=\"Qwen/Qwen2.5-0.5B-Instruct\"}"
#define LE(x) "{engine=\"0\",le=\"" x "\",model_name=\"Qwen/Qwen2.5-0.5B-Instruct\"}"
    const char *want[] = {
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running" L " 2\n",
        "vllm:num_requests_waiting" L " 0\n",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n",
        "vllm:kv_cache_usage_perc" L " 0.25\n",
        "# TYPE vllm:prefix_cache_queries_total counter\n",
        "vllm:prefix_cache_hits_total" L " 0\n",
        "vllm:num_preemptions_total" L " 0\n",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        "vllm:prompt_tokens_total" L " 7\n",
        "vllm:generation_tokens_total" L " 0\n",
        "vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"Qwen/"
        "Qwen2.5-0.5B-Instruct\"} 0\n"
        "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"Qwen/"
        "Qwen2.5-0.5B-Instruct\"} 1\n"
        "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\",model_name=\"Qwen/"
        "Qwen2.5-0.5B-Instruct\"} 0\n"
        "vllm:request_success_total{engine=\"0\",finished_reason=\"error\",model_name=\"Qwen/"
        "Qwen2.5-0.5B-Instruct\"} 0\n",
        "vllm:request_prompt_tokens_bucket" LE("5.0") " 0\n"
                                                      "vllm:request_prompt_tokens_bucket" LE(
                                                          "10.0") " 1\n",
        "vllm:request_prompt_tokens_bucket" LE(
            "20000.0") " 1\n"
                       "vllm:request_prompt_tokens_bucket" LE(
                           "+Inf") " 1\n"
                                   "vllm:request_prompt_tokens_count" L " 1\n"
                                   "vllm:request_prompt_tokens_sum" L " 7\n",
        "# TYPE vllm:request_generation_tokens histogram\n",
        "# TYPE vllm:iteration_tokens_total histogram\n"
        "vllm:iteration_tokens_total_bucket" LE("1.0") " 0\n"
                                                       "vllm:iteration_tokens_total_bucket" LE(
                                                           "8.0") " 0\n",
        "vllm:request_max_num_generation_tokens_count" L " 0\n",
        "vllm:request_params_n_bucket" LE("20.0") " 0\n",
        "vllm:request_params_max_tokens_bucket" LE("20000.0") " 0\n",
        "vllm:time_to_first_token_seconds_bucket" LE(
            "0.02") " 0\n"
                    "vllm:time_to_first_token_seconds_bucket" LE("0.04") " 1\n",
        "vllm:time_to_first_token_seconds_bucket" LE("2560.0") " 1\n",
        "vllm:time_to_first_token_seconds_sum" L " 0.03\n",
        "vllm:inter_token_latency_seconds_bucket" LE("0.075") " 0\n",
        "# TYPE vllm:request_time_per_output_token_seconds histogram\n",
        "vllm:e2e_request_latency_seconds_bucket" LE("7680.0") " 0\n",
        "# TYPE vllm:request_queue_time_seconds histogram\n",
        "# TYPE vllm:request_inference_time_seconds histogram\n",
        "# TYPE vllm:request_prefill_time_seconds histogram\n",
        "# TYPE vllm:request_decode_time_seconds histogram\n",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching="
        "\"True\","
        "engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks="
        "\"1024\","
        "swap_space=\"4\"} 1\n",
    };
#undef L
#undef LE
    // In this order (vLLM's registration order).
    const char *at = text;
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const char *p = strstr(at, want[i]);
        if (!p)
            fail_msg("missing or out of order:\n%s", want[i]);
        at = p + strlen(want[i]);
    }
    assert_string_equal(at, ""); // cache_config_info is last
    assert_null(strstr(text, "le=\"50000.0\""));
    free(text);

    // Registering the set twice collides; a missing model name is rejected.
    struct tdm_metrics_vllm v2;
    assert_int_equal(tdm_metrics_vllm_register(&v2, reg, &cfg, err, sizeof err), TDM_EINVAL);
    cfg.model_name = NULL;
    assert_int_equal(tdm_metrics_vllm_register(&v2, reg, &cfg, err, sizeof err), TDM_EINVAL);
    tdm_metrics_registry_free(reg);
}

// ---- threads -------------------------------------------------------------------------------

enum { N_THREADS = 4, N_ITERS = 20000 };

struct shared {
    struct tdm_metrics_counter *counter;
    struct tdm_metrics_counter *family;
    struct tdm_metrics_gauge *gauge;
    struct tdm_metrics_histogram *hist;
    struct tdm_metrics_registry *reg;
    int index;
    _Atomic int *stop; // render test only
};

static void *update_thread(void *arg)
{
    struct shared *s = arg;
    char label[16];
    for (int i = 0; i < N_ITERS; i++) {
        tdm_metrics_counter_inc(s->counter);
        tdm_metrics_counter_add(s->counter, 0.5);
        tdm_metrics_gauge_add(s->gauge, 0.25);
        tdm_metrics_histogram_observe(s->hist, (double)(i % 10));
        // A few shared children, looked up from every thread.
        snprintf(label, sizeof label, "r%d", i % 3);
        tdm_metrics_counter_inc(tdm_metrics_counter_labels(s->family, label));
    }
    return NULL;
}

static void test_concurrent_exact(void **state)
{
    (void)state;
    struct tdm_metrics_registry *reg = new_registry(NULL, 0);
    char err[256] = "";
    struct shared sh = {.reg = reg};
    static const char *const reason[] = {"reason"};
    struct tdm_metrics_opts o = {.name = "c", .help = "c"};
    assert_int_equal(tdm_metrics_counter_register(&sh.counter, reg, &o, err, sizeof err), TDM_OK);
    o = (struct tdm_metrics_opts){
        .name = "fam", .help = "f", .label_names = reason, .n_label_names = 1};
    assert_int_equal(tdm_metrics_counter_register(&sh.family, reg, &o, err, sizeof err), TDM_OK);
    o = (struct tdm_metrics_opts){.name = "g", .help = "g"};
    assert_int_equal(tdm_metrics_gauge_register(&sh.gauge, reg, &o, err, sizeof err), TDM_OK);
    o.name = "h";
    const double bounds[] = {0.5, 2.5, 4.5};
    assert_int_equal(tdm_metrics_histogram_register(&sh.hist, reg, &o, bounds, 3, err, sizeof err),
                     TDM_OK);

    pthread_t t[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, update_thread, &sh), 0);
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(t[i], NULL);

    const double n = (double)N_THREADS * N_ITERS;
    assert_true(tdm_metrics_counter_value(sh.counter) == 1.5 * n);
    assert_true(tdm_metrics_gauge_value(sh.gauge) == 0.25 * n);
    assert_int_equal(tdm_metrics_histogram_count(sh.hist), (uint64_t)n);
    // i % 10 in 0..9: <=0.5 is {0}, <=2.5 adds {1,2}, <=4.5 adds {3,4}.
    assert_int_equal(tdm_metrics_histogram_bucket(sh.hist, 0), (uint64_t)n / 10);
    assert_int_equal(tdm_metrics_histogram_bucket(sh.hist, 1), (uint64_t)n * 3 / 10);
    assert_int_equal(tdm_metrics_histogram_bucket(sh.hist, 2), (uint64_t)n * 5 / 10);
    assert_true(tdm_metrics_histogram_sum(sh.hist) == 4.5 * n);
    double children = 0;
    for (int r = 0; r < 3; r++) {
        char label[8];
        snprintf(label, sizeof label, "r%d", r);
        children += tdm_metrics_counter_value(tdm_metrics_counter_labels(sh.family, label));
    }
    assert_true(children == n);
    // Exactly three children were made despite the races on first lookup.
    char *text = render(reg);
    int lines = 0;
    for (const char *p = text; (p = strstr(p, "fam_total{")); p++)
        lines++;
    assert_int_equal(lines, 3);
    free(text);
    tdm_metrics_registry_free(reg);
}

static void *churn_thread(void *arg)
{
    struct shared *s = arg;
    char name[32], label[32];
    int i = 0;
    while (!atomic_load(s->stop)) {
        tdm_metrics_histogram_observe(s->hist, (double)(i % 7));
        tdm_metrics_counter_inc(s->counter);
        // New children and new families appear while the renderer walks the lists.
        if (i < 200) {
            snprintf(label, sizeof label, "t%d_%d", s->index, i);
            tdm_metrics_counter_inc(tdm_metrics_counter_labels(s->family, label));
        }
        if (i < 50) {
            struct tdm_metrics_gauge *g = NULL;
            snprintf(name, sizeof name, "late_%d_%d", s->index, i);
            struct tdm_metrics_opts o = {.name = name, .help = "late"};
            if (tdm_metrics_gauge_register(&g, s->reg, &o, NULL, 0) == TDM_OK)
                tdm_metrics_gauge_set(g, i);
        }
        i++;
    }
    return NULL;
}

// Sum of a histogram's +Inf bucket and _count must agree in every rendering.
static void check_consistent(const char *text)
{
    const char *inf = strstr(text, "hr_bucket{le=\"+Inf\"} ");
    const char *cnt = strstr(text, "hr_count ");
    assert_non_null(inf);
    assert_non_null(cnt);
    unsigned long long a = strtoull(inf + strlen("hr_bucket{le=\"+Inf\"} "), NULL, 10);
    unsigned long long b = strtoull(cnt + strlen("hr_count "), NULL, 10);
    assert_int_equal(a, b);
    unsigned long long prev = 0;
    for (const char *p = text; (p = strstr(p, "hr_bucket{")); p++) {
        unsigned long long v = strtoull(strchr(p, '}') + 2, NULL, 10);
        assert_true(v >= prev);
        prev = v;
    }
}

static void test_render_while_updating(void **state)
{
    (void)state;
    struct tdm_metrics_registry *reg = new_registry(NULL, 0);
    char err[256] = "";
    _Atomic int stop = 0;
    static const char *const who[] = {"who"};
    struct tdm_metrics_counter *counter = NULL, *family = NULL;
    struct tdm_metrics_histogram *hist = NULL;
    struct tdm_metrics_opts o = {.name = "cr", .help = "c"};
    assert_int_equal(tdm_metrics_counter_register(&counter, reg, &o, err, sizeof err), TDM_OK);
    o = (struct tdm_metrics_opts){
        .name = "fr", .help = "f", .label_names = who, .n_label_names = 1};
    assert_int_equal(tdm_metrics_counter_register(&family, reg, &o, err, sizeof err), TDM_OK);
    o = (struct tdm_metrics_opts){.name = "hr", .help = "h"};
    const double bounds[] = {1, 2, 3, 4, 5};
    assert_int_equal(tdm_metrics_histogram_register(&hist, reg, &o, bounds, 5, err, sizeof err),
                     TDM_OK);

    struct shared sh[N_THREADS];
    pthread_t t[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
        sh[i] = (struct shared){.counter = counter,
                                .family = family,
                                .hist = hist,
                                .reg = reg,
                                .index = i,
                                .stop = &stop};
        assert_int_equal(pthread_create(&t[i], NULL, churn_thread, &sh[i]), 0);
    }
    char *buf = NULL;
    size_t cap = 0, len = 0;
    for (int r = 0; r < 200; r++) {
        assert_int_equal(tdm_metrics_render_buf(reg, &buf, &cap, &len), TDM_OK);
        assert_int_equal(strlen(buf), len);
        check_consistent(buf);
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(t[i], NULL);
    assert_int_equal(tdm_metrics_render_buf(reg, &buf, &cap, &len), TDM_OK);
    check_consistent(buf);
    free(buf);
    tdm_metrics_registry_free(reg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_text),
        cmocka_unit_test(test_counter_name_and_info),
        cmocka_unit_test(test_format_double),
        cmocka_unit_test(test_histogram_buckets),
        cmocka_unit_test(test_vllm_buckets),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_vllm_set),
        cmocka_unit_test(test_concurrent_exact),
        cmocka_unit_test(test_render_while_updating),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
