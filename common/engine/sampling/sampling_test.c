// SPDX-License-Identifier: Apache-2.0
// sampling_test: the sampler against brute-force references. Filters are checked
// over thousands of seeded draws (never a token outside the top-k / nucleus /
// min-p set, empirical frequencies within a stated bound of the renormalised
// probabilities, a chi-square test on the unfiltered distribution), penalties and
// logprobs against the formulas, seeds for reproducibility and independence, and
// every validation message. Seeds are fixed, so the runs are deterministic; the
// bounds are about 4-5 standard deviations wide.
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "sample_draw.h"
#include "sampling.h"
#include "sampling_impl.h"

// ---- helpers ---------------------------------------------------------------------

static uint64_t test_rng = 12345;
static double test_uniform(void)
{
    uint64_t z = (test_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

static void random_logits(float *l, int n, float scale)
{
    for (int i = 0; i < n; i++)
        l[i] = (float)(test_uniform() * scale);
}

static struct tdm_sampler *make(const struct tdm_sampling_params *p, int vocab)
{
    struct tdm_sampler *s = NULL;
    char err[256] = "";
    if (tdm_sampling_params_validate(p, vocab, err, sizeof err) != TDM_OK)
        fail_msg("validate: %s", err);
    assert_int_equal(tdm_sampler_new(&s, p, vocab, NULL, 0, NULL, 0), TDM_OK);
    return s;
}

// Samples from a fresh copy of master (the sampler modifies logits in place).
static int32_t draw(struct tdm_sampler *s, const float *master, float *work, int vocab)
{
    memcpy(work, master, sizeof(float) * (size_t)vocab);
    int32_t t = tdm_sampler_sample(s, work, NULL);
    assert_true(t >= 0 && t < vocab);
    return t;
}

static int count_greater(const float *l, int n, float v)
{
    int c = 0;
    for (int i = 0; i < n; i++)
        c += l[i] > v;
    return c;
}

// ---- validation --------------------------------------------------------------------

static void expect_invalid(const struct tdm_sampling_params *p, const char *needle)
{
    char err[256] = "";
    assert_int_equal(tdm_sampling_params_validate(p, 100, err, sizeof err), TDM_EINVAL);
    if (!strstr(err, needle))
        fail_msg("'%s' does not contain '%s'", err, needle);
    struct tdm_sampler *s = NULL;
    assert_int_equal(tdm_sampler_new(&s, p, 100, NULL, 0, NULL, 0), TDM_EINVAL);
    assert_null(s);
}

static void test_validate(void **state)
{
    (void)state;
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    assert_true(p.temperature == 1.0f && p.top_p == 1.0f && p.top_k == 0 && p.min_p == 0.0f);
    assert_true(p.repetition_penalty == 1.0f && p.logprobs == -1 && !p.has_seed);
    assert_int_equal(tdm_sampling_params_validate(&p, 100, NULL, 0), TDM_OK);

#define BAD(field, value, needle)                                                                  \
    do {                                                                                           \
        tdm_sampling_params_default(&p);                                                           \
        p.field = value;                                                                           \
        expect_invalid(&p, needle);                                                                \
    } while (0)
    BAD(temperature, -0.1f, "temperature must be in [0, 2], got -0.1");
    BAD(temperature, 2.5f, "temperature must be in [0, 2]");
    BAD(temperature, NAN, "temperature");
    BAD(top_p, 0.0f, "top_p must be in (0, 1], got 0");
    BAD(top_p, 1.01f, "top_p");
    BAD(top_k, -2, "top_k must be 0 or -1 (disabled), or at least 1, got -2");
    BAD(min_p, 1.5f, "min_p must be in [0, 1]");
    BAD(min_p, -0.1f, "min_p");
    BAD(repetition_penalty, 0.0f, "repetition_penalty");
    BAD(repetition_penalty, INFINITY, "repetition_penalty");
    BAD(presence_penalty, 2.5f, "presence_penalty must be in [-2, 2]");
    BAD(frequency_penalty, -3.0f, "frequency_penalty must be in [-2, 2]");
    BAD(min_tokens, -1, "min_tokens");
    BAD(logprobs, 21, "logprobs must be in [0, 20]");
    BAD(logprobs, -2, "logprobs");
    BAD(num_stop_token_ids, TDM_MAX_STOP_IDS + 1, "stop_token_ids");
    BAD(num_logit_bias, -1, "logit_bias");
#undef BAD
    tdm_sampling_params_default(&p);
    p.num_stop_token_ids = 2;
    p.stop_token_ids[0] = 5;
    p.stop_token_ids[1] = 100;
    expect_invalid(&p, "stop_token_ids[1] = 100 is outside the vocabulary [0, 100)");
    tdm_sampling_params_default(&p);
    p.num_logit_bias = 1;
    p.logit_bias[0] = (struct tdm_logit_bias){.token = -1, .bias = 1.0f};
    expect_invalid(&p, "logit_bias token -1");
    p.logit_bias[0] = (struct tdm_logit_bias){.token = 3, .bias = NAN};
    expect_invalid(&p, "logit_bias for token 3");

    // The edges that are allowed.
    tdm_sampling_params_default(&p);
    p.temperature = 2.0f;
    p.top_k = -1;
    p.min_p = 1.0f;
    p.logprobs = TDM_MAX_LOGPROBS;
    p.presence_penalty = -2.0f;
    p.frequency_penalty = 2.0f;
    assert_int_equal(tdm_sampling_params_validate(&p, 100, NULL, 0), TDM_OK);

    // Out-of-vocabulary prompt or EOS ids are refused by tdm_sampler_new.
    struct tdm_sampler *s = NULL;
    int32_t bad = 100, good = 1;
    tdm_sampling_params_default(&p);
    assert_int_equal(tdm_sampler_new(&s, &p, 100, &bad, 1, NULL, 0), TDM_EINVAL);
    assert_int_equal(tdm_sampler_new(&s, &p, 100, &good, 1, &bad, 1), TDM_EINVAL);
    assert_null(s);
}

// ---- greedy ----------------------------------------------------------------------------

static void test_greedy(void **state)
{
    (void)state;
    enum { V = 1000 };
    static float l[V];
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.0f;
    struct tdm_sampler *s = make(&p, V);
    for (int round = 0; round < 20; round++) {
        random_logits(l, V, 10.0f);
        int best = 0;
        for (int i = 1; i < V; i++)
            if (l[i] > l[best])
                best = i;
        assert_int_equal(tdm_sampler_sample(s, l, NULL), best);
    }
    for (int i = 0; i < V; i++)
        l[i] = 0.0f;
    l[700] = l[5] = l[3] = 1.0f; // ties: the lowest id
    assert_int_equal(tdm_sampler_sample(s, l, NULL), 3);
    assert_int_equal(tdm_sampler_num_generated(s), 21);
    tdm_sampler_free(s);
}

// ---- top-k ---------------------------------------------------------------------------

static void test_top_k(void **state)
{
    (void)state;
    enum { V = 1000, K = 5, DRAWS = 5000 };
    static float master[V], work[V];
    random_logits(master, V, 4.0f);
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.top_k = K;
    p.has_seed = true;
    p.seed = 1;
    struct tdm_sampler *s = make(&p, V);
    int hits[V] = {0};
    for (int i = 0; i < DRAWS; i++) {
        int32_t t = draw(s, master, work, V);
        if (count_greater(master, V, master[t]) >= K)
            fail_msg("token %d is not among the %d best", t, K);
        hits[t]++;
    }
    int distinct = 0;
    for (int i = 0; i < V; i++)
        distinct += hits[i] > 0;
    assert_int_equal(distinct, K);
    tdm_sampler_free(s);

    // Ties at the k-th value stay in (vLLM masks only logits < the k-th largest).
    for (int i = 0; i < V; i++)
        master[i] = i < 10 ? 1.0f : 0.0f;
    p.top_k = 3;
    s = make(&p, V);
    memset(hits, 0, sizeof hits);
    for (int i = 0; i < 2000; i++) {
        int32_t t = draw(s, master, work, V);
        assert_true(t < 10);
        hits[t]++;
    }
    for (int i = 0; i < 10; i++)
        assert_true(hits[i] > 0);
    tdm_sampler_free(s);
}

// A k above the insertion-buffer size takes the quickselect path.
static void test_top_k_large_vocab(void **state)
{
    (void)state;
    enum { V = 151936, K = 300 };
    float *master = malloc(sizeof(float) * V), *work = malloc(sizeof(float) * V);
    assert_non_null(master);
    assert_non_null(work);
    random_logits(master, V, 3.0f);
    for (int k = 1; k <= 600; k += 299) {
        float kth = tdm_sampling_kth_largest(master, V, (size_t)k, work);
        assert_true(count_greater(master, V, kth) < k);
        assert_true(count_greater(master, V, kth) + 1 >= k || kth == -INFINITY);
    }
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.top_k = K;
    p.has_seed = true;
    p.seed = 2;
    struct tdm_sampler *s = make(&p, V);
    for (int i = 0; i < 100; i++) {
        int32_t t = draw(s, master, work, V);
        assert_true(count_greater(master, V, master[t]) < K);
    }
    tdm_sampler_free(s);
    free(master);
    free(work);
}

// ---- top-p ---------------------------------------------------------------------------

// Renormalised frequencies over a small vocabulary must match want[] within tol.
static void check_frequencies(struct tdm_sampler *s, const float *master, int v, const double *want,
                              int draws, double tol)
{
    float work[64];
    int hits[64] = {0};
    for (int i = 0; i < draws; i++)
        hits[draw(s, master, work, v)]++;
    for (int i = 0; i < v; i++) {
        double f = (double)hits[i] / draws;
        if (fabs(f - want[i]) > tol)
            fail_msg("token %d: frequency %.4f, expected %.4f (+-%.4f)", i, f, want[i], tol);
    }
}

static void test_top_p_small(void **state)
{
    (void)state;
    static const double prob[8] = {0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01};
    float master[8];
    for (int i = 0; i < 8; i++)
        master[i] = (float)log(prob[i]);
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.top_p = 0.75f; // 0.4 + 0.25 < 0.75 <= 0.4 + 0.25 + 0.15: the nucleus is {0, 1, 2}
    p.has_seed = true;
    p.seed = 3;
    struct tdm_sampler *s = make(&p, 8);
    const double want[8] = {0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0, 0, 0, 0};
    check_frequencies(s, master, 8, want, 20000, 0.015);
    tdm_sampler_free(s);
}

static int cmp_u32_desc(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x < y) - (x > y);
}

// The floor by brute force: sorted descending, the smallest value whose mass
// strictly above it is < bound.
static uint32_t floor_brute(const uint32_t *q, size_t n, double bound, uint32_t *sorted)
{
    memcpy(sorted, q, n * sizeof *q);
    qsort(sorted, n, sizeof *sorted, cmp_u32_desc);
    uint32_t floor_v = UINT32_MAX;
    uint64_t above = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        uint64_t eq = 0;
        while (j < n && sorted[j] == sorted[i])
            eq += sorted[j++];
        if (!((double)above < bound))
            break;
        floor_v = sorted[i];
        above += eq;
        i = j;
    }
    return floor_v;
}

// The mass quickselect keeps exactly the brute-force nucleus, ties included.
static void test_top_p_select_exact(void **state)
{
    (void)state;
    static const size_t sizes[] = {1, 10, 33, 1000, 151936};
    static const double ps[] = {0.05, 0.5, 0.9, 0.999};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t n = sizes[si];
        uint32_t *q = malloc(n * sizeof *q), *work = malloc(n * sizeof *q),
                 *sorted = malloc(n * sizeof *q);
        assert_true(q && work && sorted);
        for (int ties = 0; ties < 2; ties++) {
            for (size_t pi = 0; pi < sizeof ps / sizeof ps[0]; pi++) {
                uint64_t total = 0;
                for (size_t i = 0; i < n; i++) {
                    double u = test_uniform();
                    // ties: only 8 distinct weights, so the boundary falls inside a tie
                    q[i] = ties ? (uint32_t)(1 + (int)(u * 8)) << 20
                                : (uint32_t)(TDM_DRAW_ONE * exp(-20.0 * u));
                    q[i] += q[i] == 0;
                    total += q[i];
                }
                double bound = ps[pi] * (double)total;
                uint32_t want = floor_brute(q, n, bound, sorted);
                memcpy(work, q, n * sizeof *q);
                uint32_t got = tdm_sampling_top_p_floor(work, n, bound);
                if (got != want)
                    fail_msg("n=%zu p=%g ties=%d: floor %u, expected %u", n, ps[pi], ties, got,
                             want);
                // The kept set reaches the bound, and without its lightest value
                // (a whole tie) it does not.
                uint64_t kept = 0, lightest = 0;
                for (size_t i = 0; i < n; i++) {
                    kept += q[i] >= got ? q[i] : 0;
                    lightest += q[i] == got ? q[i] : 0;
                }
                assert_true((double)kept >= bound || kept == total);
                assert_true((double)(kept - lightest) < bound);
            }
        }
        free(q);
        free(work);
        free(sorted);
    }
}

// When the bound equals a prefix sum exactly, the next token (whose preceding
// mass is then == bound) is dropped: vLLM drops cumsum(ascending) <= 1 - p.
static void test_top_p_exact_boundary(void **state)
{
    (void)state;
    for (size_t n = 8; n <= 4096; n *= 8) {
        uint32_t *q = malloc(n * sizeof *q);
        assert_non_null(q);
        for (size_t cut = 1; cut < n; cut += n / 7 + 1) {
            // Distinct weights n, n-1, ..., 1 in shuffled positions.
            for (size_t i = 0; i < n; i++)
                q[i] = (uint32_t)(n - i);
            for (size_t i = n - 1; i > 0; i--) {
                size_t j = (size_t)(test_uniform() * (double)(i + 1));
                uint32_t t = q[i];
                q[i] = q[j];
                q[j] = t;
            }
            double bound = 0;
            for (size_t i = 0; i < cut; i++)
                bound += (double)(n - i);
            uint32_t got = tdm_sampling_top_p_floor(q, n, bound);
            if (got != (uint32_t)(n - cut + 1))
                fail_msg("n=%zu: bound = mass of the best %zu, floor %u", n, cut, got);
        }
        free(q);
    }
}

static void test_top_p_large_vocab(void **state)
{
    (void)state;
    enum { V = 151936 };
    float *master = malloc(sizeof(float) * V), *work = malloc(sizeof(float) * V);
    uint32_t *q = malloc(sizeof(uint32_t) * V), *sorted = malloc(sizeof(uint32_t) * V);
    unsigned char *in = calloc(V, 1);
    assert_true(master && work && q && sorted && in);
    random_logits(master, V, 12.0f);
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.top_p = 0.8f;
    p.temperature = 0.8f;
    p.has_seed = true;
    p.seed = 4;
    // Brute-force nucleus of the draw's weights of softmax(l / T).
    float lmax = -INFINITY;
    for (int i = 0; i < V; i++)
        lmax = fmaxf(lmax, master[i]);
    uint64_t total = 0;
    for (int i = 0; i < V; i++)
        total += q[i] = tdm_draw_weight(master[i], lmax, 1.0f / 0.8f, 0.0f);
    size_t nz = 0;
    for (int i = 0; i < V; i++)
        if (q[i] > 0)
            work[nz++] = (float)i; // ids of the weighted tokens, exact in a float
    uint32_t *wq = malloc(sizeof(uint32_t) * nz);
    assert_non_null(wq);
    for (size_t j = 0; j < nz; j++)
        wq[j] = q[(int)work[j]];
    uint32_t floor_v = floor_brute(wq, nz, 0.8 * (double)total, sorted);
    free(wq);
    size_t n_in = 0;
    for (int i = 0; i < V; i++)
        n_in += in[i] = q[i] > 0 && q[i] >= floor_v;
    assert_true(n_in > 1 && n_in < (size_t)V);
    struct tdm_sampler *s = make(&p, V);
    for (int i = 0; i < 200; i++) {
        int32_t t = draw(s, master, work, V);
        if (!in[t])
            fail_msg("token %d is outside the top-p set", t);
    }
    tdm_sampler_free(s);
    free(master);
    free(work);
    free(q);
    free(sorted);
    free(in);
}

// ---- the draw (sample_draw.h) ---------------------------------------------------------

// tdm_draw_exp against exp in double: within 4 ulp over [-87, 0], exactly 1 at
// 0, 0 below -87 and for NaN/-inf.
static void test_draw_exp(void **state)
{
    (void)state;
    assert_true(tdm_draw_exp(0.0f) == 1.0f);
    assert_true(tdm_draw_exp(-0.0f) == 1.0f);
    assert_true(tdm_draw_exp(-87.5f) == 0.0f && tdm_draw_exp(-INFINITY) == 0.0f);
    assert_true(tdm_draw_exp(NAN) == 0.0f);
    double worst = 0;
    for (int i = 0; i <= 2000000; i++) {
        float x = (float)(-87.0 * i / 2000000.0);
        double want = exp((double)x), got = tdm_draw_exp(x);
        double ulp = ldexp(1.0, ilogb(want) - 23);
        double e = fabs(got - want) / ulp;
        worst = e > worst ? e : worst;
    }
    printf("tdm_draw_exp: worst error %.2f ulp over [-87, 0]\n", worst);
    assert_true(worst <= 4.0);
}

// The draw by its definition (sample_draw.h's head comment), written plainly.
static int32_t draw_reference(const float *l, int v, const struct tdm_draw_params *d, uint32_t *q,
                              uint32_t *sorted)
{
    int32_t imax = 0;
    float lmax = -INFINITY;
    for (int i = 0; i < v; i++)
        if (l[i] > lmax) {
            lmax = l[i];
            imax = i;
        }
    if (d->inv_t == 0.0f || !isfinite(lmax))
        return imax;
    float thr = -INFINITY;
    if (d->top_k > 0) {
        int m = 0;
        for (int i = 0; i < v; i++)
            if (l[i] > -INFINITY)
                sorted[m++] = (uint32_t)i;
        if (m >= d->top_k) {
            float *vals = malloc(sizeof(float) * (size_t)m);
            assert_non_null(vals);
            for (int i = 0; i < m; i++)
                vals[i] = l[sorted[i]];
            for (int a = 0; a < d->top_k; a++) // partial selection sort, descending
                for (int b = a + 1; b < m; b++)
                    if (vals[b] > vals[a]) {
                        float t = vals[a];
                        vals[a] = vals[b];
                        vals[b] = t;
                    }
            thr = vals[d->top_k - 1];
            free(vals);
        }
    }
    uint64_t total = 0;
    size_t nz = 0;
    for (int i = 0; i < v; i++) {
        q[i] = l[i] >= thr ? tdm_draw_weight(l[i], lmax, d->inv_t, d->min_p) : 0;
        total += q[i];
        if (q[i] > 0)
            sorted[nz++] = q[i];
    }
    uint32_t floor_v = 0;
    if (d->top_p < 1.0f) {
        uint32_t *tmp = malloc(sizeof(uint32_t) * (nz > 0 ? nz : 1));
        assert_non_null(tmp);
        floor_v = floor_brute(sorted, nz, tdm_draw_top_p_mass(d->top_p, total), tmp);
        free(tmp);
    }
    uint64_t kept = 0;
    for (int i = 0; i < v; i++)
        kept += q[i] >= floor_v ? q[i] : 0;
    uint64_t t = tdm_draw_target(d->key, kept), acc = 0;
    for (int i = 0; i < v; i++) {
        if (q[i] == 0 || q[i] < floor_v)
            continue;
        acc += q[i];
        if (acc > t)
            return i;
    }
    fail_msg("reference draw fell off the row");
    return -1;
}

// The sampler's token = the definition's, for rows with ties, -inf and NaN,
// over temperatures, top_k, top_p and min_p, at several output positions; and
// tdm_sampler_draw_params says what the definition needs.
static void test_draw_definition(void **state)
{
    (void)state;
    enum { V = 3000 };
    static float master[V], work[V];
    static uint32_t q[V], sorted[V];
    static const float temps[] = {0.0f, 0.05f, 0.7f, 1.0f, 1.9f};
    static const int ks[] = {0, 1, 5, 40, 2999, 5000};
    static const float ps[] = {1.0f, 0.95f, 0.5f, 0.01f};
    static const float mps[] = {0.0f, 0.05f, 0.9f};
    int checked = 0;
    for (int row = 0; row < 6; row++) {
        random_logits(master, V, row < 3 ? 8.0f : 30.0f);
        if (row % 2)
            for (int i = 0; i < V; i++) // ties: 16 distinct values
                master[i] = floorf(master[i] / 2.0f);
        if (row >= 4)
            for (int i = 0; i < V; i += 7)
                master[i] = i % 2 ? -INFINITY : NAN;
        for (size_t ti = 0; ti < sizeof temps / sizeof *temps; ti++)
            for (size_t ki = 0; ki < sizeof ks / sizeof *ks; ki++)
                for (size_t pi = 0; pi < sizeof ps / sizeof *ps; pi++) {
                    struct tdm_sampling_params p;
                    tdm_sampling_params_default(&p);
                    p.temperature = temps[ti];
                    p.top_k = ks[ki];
                    p.top_p = ps[pi];
                    p.min_p = mps[(ti + ki + pi) % 3];
                    p.has_seed = true;
                    p.seed = 1000u + (uint64_t)row * 77u + ti * 13u + ki * 5u + pi;
                    struct tdm_sampler *s = make(&p, V);
                    for (int pos = 0; pos < 3; pos++) {
                        struct tdm_draw_params d;
                        assert_true(tdm_sampler_draw_params(s, &d));
                        assert_true(d.key == tdm_draw_key(p.seed, (uint64_t)pos));
                        int32_t want = draw_reference(master, V, &d, q, sorted);
                        int32_t got = draw(s, master, work, V);
                        if (got != want)
                            fail_msg("row %d T=%g k=%d p=%g min_p=%g pos %d: %d, definition %d",
                                     row, p.temperature, p.top_k, p.top_p, p.min_p, pos, got, want);
                        checked++;
                    }
                    tdm_sampler_free(s);
                }
    }
    printf("%d draws equal to the definition\n", checked);
}

// A request with logit bias (a token of the prompt too), all three penalties
// and min_tokens over EOS and a stop id: its adjustments (tdm_sampler_draw_
// prepare) applied to the row with tdm_draw_adjust, then the definition's
// draw, give the sampler's token, step after step as the history grows; a
// short adj array is reported with the count it needs; logprobs refuse.
static void test_draw_prepare(void **state)
{
    (void)state;
    enum { V = 2000, STEPS = 12 };
    static float master[V], work[V], adjusted[V];
    static uint32_t q[V], sorted[V];
    static struct tdm_draw_adj adj[V];
    int32_t prompt[30], eos[2] = {7, 1999};
    for (int i = 0; i < 30; i++)
        prompt[i] = (int32_t)((i * 97) % V);
    for (int variant = 0; variant < 4; variant++) {
        struct tdm_sampling_params p;
        tdm_sampling_params_default(&p);
        p.temperature = variant == 3 ? 0.0f : 0.9f;
        p.top_k = variant == 1 ? 50 : 0;
        p.top_p = variant == 2 ? 0.7f : 1.0f;
        p.repetition_penalty = variant == 2 ? 1.0f : 1.3f;
        p.frequency_penalty = 0.4f;
        p.presence_penalty = variant == 1 ? 0.0f : -0.5f;
        p.min_tokens = 5;
        p.stop_token_ids[0] = 11;
        p.stop_token_ids[1] = 7; // also an EOS id: one entry
        p.num_stop_token_ids = 2;
        p.logit_bias[0] = (struct tdm_logit_bias){.token = prompt[3], .bias = 5.0f};
        p.logit_bias[1] = (struct tdm_logit_bias){.token = 1500, .bias = -3.0f};
        p.num_logit_bias = 2;
        p.has_seed = true;
        p.seed = 99u + (uint64_t)variant;
        struct tdm_sampler *s = NULL;
        assert_int_equal(tdm_sampler_new(&s, &p, V, prompt, 30, eos, 2), TDM_OK);
        for (int step = 0; step < STEPS; step++) {
            random_logits(master, V, 6.0f);
            for (int i = 0; i < V; i += 3)
                master[i] = master[i] * 0.3f - 1.0f; // negative logits too
            struct tdm_draw_params d;
            int need = tdm_sampler_draw_prepare(s, &d, adj, 3);
            assert_true(need > 3);
            assert_int_equal(tdm_sampler_draw_prepare(s, &d, adj, V), need);
            assert_int_equal(d.n_adj, need);
            memcpy(adjusted, master, sizeof master);
            unsigned char hit[V] = {0};
            for (int i = 0; i < need; i++) {
                assert_false(hit[adj[i].token]); // each token once
                hit[adj[i].token] = 1;
                adjusted[adj[i].token] = tdm_draw_adjust(adjusted[adj[i].token], &d, &adj[i]);
            }
            assert_true(hit[prompt[3]] && hit[1500]);
            assert_int_equal(hit[11], step < 5);
            int32_t want = draw_reference(adjusted, V, &d, q, sorted);
            int32_t got = draw(s, master, work, V);
            if (got != want)
                fail_msg("variant %d step %d: sampler %d, adjusted definition %d", variant, step,
                         got, want);
        }
        tdm_sampler_free(s);
    }
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    // Logprobs go with the draw (a device computes them); logprobs 0 asks
    // the token's alone; a bias naming a token twice stays on the host.
    p.logprobs = 2;
    struct tdm_sampler *s = make(&p, V);
    struct tdm_draw_params d;
    assert_int_equal(tdm_sampler_draw_prepare(s, &d, adj, V), 0);
    assert_int_equal(d.logprobs, 1);
    assert_int_equal(d.top_logprobs, 2);
    tdm_sampler_free(s);
    p.logprobs = 0;
    s = make(&p, V);
    assert_int_equal(tdm_sampler_draw_prepare(s, &d, adj, V), 0);
    assert_int_equal(d.logprobs, 1);
    assert_int_equal(d.top_logprobs, 0);
    tdm_sampler_free(s);
    p.logprobs = -1;
    s = make(&p, V);
    assert_int_equal(tdm_sampler_draw_prepare(s, &d, adj, V), 0);
    assert_int_equal(d.logprobs, 0);
    tdm_sampler_free(s);
    p.logit_bias[0] = (struct tdm_logit_bias){.token = 5, .bias = 1.0f};
    p.logit_bias[1] = (struct tdm_logit_bias){.token = 5, .bias = 2.0f};
    p.num_logit_bias = 2;
    s = make(&p, V);
    assert_int_equal(tdm_sampler_draw_prepare(s, &d, adj, V), -1);
    tdm_sampler_free(s);
}

// A speculative step's rows are drawn with the drafts before them ahead of
// the history (tdm_sampler_draw_prepare_ahead): each row's parameters and
// adjustments equal, entry for entry, those of a twin sampler that recorded
// the same tokens, for penalties on and off, ahead tokens new, repeated, in
// the prompt or the output, a bias or min_tokens token, at word boundaries,
// and min_tokens running out among them; a short array reports its count.
static void test_draw_prepare_ahead(void **state)
{
    (void)state;
    enum { V = 2000 };
    static struct tdm_draw_adj got[V], want[V];
    int32_t prompt[30], eos[1] = {1999};
    for (int i = 0; i < 30; i++)
        prompt[i] = (int32_t)((i * 97) % V);
    const int32_t history[6] = {64, 500, 64, 3, 1500, 700};
    const int32_t ahead[TDM_SAMPLER_MAX_AHEAD] = {63,  64, 1999, 63,  11,  prompt[4], 1500, 2,
                                                  700, 0,  1998, 128, 127, 63,        5,    1};
    int checked = 0;
    for (int variant = 0; variant < 5; variant++) {
        struct tdm_sampling_params p;
        tdm_sampling_params_default(&p);
        p.temperature = 0.8f;
        p.repetition_penalty = variant == 0 || variant == 3 ? 1.2f : 1.0f;
        p.frequency_penalty = variant <= 1 ? 0.3f : 0.0f;
        p.presence_penalty = variant == 1 ? 0.5f : 0.0f;
        p.min_tokens = variant == 4 ? 0 : 9;
        p.stop_token_ids[0] = 11;
        p.num_stop_token_ids = 1;
        p.logit_bias[0] = (struct tdm_logit_bias){.token = 1500, .bias = 2.0f};
        p.logit_bias[1] = (struct tdm_logit_bias){.token = 1998, .bias = -1.0f};
        p.num_logit_bias = variant == 2 ? 0 : 2;
        p.has_seed = true;
        p.seed = 7u + (uint64_t)variant;
        struct tdm_sampler *s = NULL;
        assert_int_equal(tdm_sampler_new(&s, &p, V, prompt, 30, eos, 1), TDM_OK);
        tdm_sampler_replay(s, history, 6);
        for (int n = 0; n <= TDM_SAMPLER_MAX_AHEAD; n++) {
            struct tdm_sampler *twin = NULL;
            assert_int_equal(tdm_sampler_new(&twin, &p, V, prompt, 30, eos, 1), TDM_OK);
            tdm_sampler_replay(twin, history, 6);
            tdm_sampler_replay(twin, ahead, (size_t)n);
            struct tdm_draw_params dg, dw;
            int need = tdm_sampler_draw_prepare(twin, &dw, want, V);
            if (need > 1)
                assert_int_equal(tdm_sampler_draw_prepare_ahead(s, &dg, got, 1, ahead, n), need);
            assert_int_equal(tdm_sampler_draw_prepare_ahead(s, &dg, got, V, ahead, n), need);
            assert_memory_equal(&dg, &dw, sizeof dg);
            assert_memory_equal(got, want, (size_t)need * sizeof *got);
            tdm_sampler_free(twin);
            checked++;
        }
        // Past the limit, or a token outside the vocabulary: the host samples.
        int32_t bad[1] = {V};
        struct tdm_draw_params d;
        assert_int_equal(tdm_sampler_draw_prepare_ahead(s, &d, got, V, bad, 1), -1);
        assert_int_equal(
            tdm_sampler_draw_prepare_ahead(s, &d, got, V, ahead, TDM_SAMPLER_MAX_AHEAD + 1), -1);
        tdm_sampler_free(s);
    }
    printf("%d rows ahead equal to a twin's after the replay\n", checked);
}

static int adj_by_token(const void *a, const void *b)
{
    const struct tdm_draw_adj *x = a, *y = b;
    return (x->token > y->token) - (x->token < y->token);
}

// Async scheduling prepares a row before the token before it is known
// (tdm_sampler_draw_prepare_pending): with that token resolved into the
// pending entry by sample_draw.h's rule (tdm_draw_resolve_pending, the one
// the device runs), the row's parameters and entries (as a set) are those
// prepared after the token's replay, for repetition 1.05 alone (Qwen2.5's
// default), presence, frequency, all three and none (no pending entry), the
// token new, in the prompt, in the output, a bias token and a min_tokens-
// masked one, step after step while min_tokens runs out; a short array
// reports its count; a negative row is refused.
static void test_draw_prepare_pending(void **state)
{
    (void)state;
    enum { V = 300, CAP = 64 };
    const int32_t prompt[5] = {3, 9, 9, 41, 7}, eos = 2, history[3] = {9, 120, 64};
    // New, in the prompt, in the output (twice), a bias token, the EOS id
    // (masked while min_tokens lasts), a stop id.
    const int32_t real[7] = {200, 41, 120, 64, 5, 2, 11};
    int resolved_merged = 0, resolved_new = 0;
    for (int k = 0; k < 5; k++) {
        struct tdm_sampling_params p;
        tdm_sampling_params_default(&p);
        p.temperature = 0.7f;
        p.has_seed = true;
        p.seed = 11;
        p.min_tokens = 6;
        p.stop_token_ids[0] = 11;
        p.num_stop_token_ids = 1;
        p.logit_bias[0] = (struct tdm_logit_bias){.token = 5, .bias = 1.5f};
        p.num_logit_bias = 1;
        p.repetition_penalty = k == 0 || k == 3 ? 1.05f : 1.0f;
        p.presence_penalty = k == 1 || k == 3 ? 0.5f : 0.0f;
        p.frequency_penalty = k == 2 || k == 3 ? -0.5f : 0.0f;
        for (int n = 0; n < 7; n++) {
            // n more tokens of output first: min_tokens runs out on the way.
            struct tdm_sampler *s = NULL;
            assert_int_equal(tdm_sampler_new(&s, &p, V, prompt, 5, &eos, 1), TDM_OK);
            for (int i = 0; i < n; i++)
                tdm_sampler_replay(s, &history[i % 3], 1);
            struct tdm_draw_params dp, dw;
            struct tdm_draw_adj pend[CAP], want[CAP];
            int np = tdm_sampler_draw_prepare_pending(s, &dp, pend, CAP, 4);
            assert_true(np >= 0 && np < CAP);
            assert_int_equal(dp.n_adj, np);
            if (np > 1)
                assert_int_equal(tdm_sampler_draw_prepare_pending(s, &dp, pend, 1, 4), np);
            assert_int_equal(tdm_sampler_draw_prepare_pending(s, &dp, pend, CAP, 4), np);
            bool penalised = k != 4;
            if (penalised) {
                const struct tdm_draw_adj *last = &pend[np - 1];
                assert_int_equal(last->token, 4); // the previous forward's row
                assert_int_equal(last->flags,
                                 TDM_DRAW_ADJ_PENDING | (p.repetition_penalty != 1.0f ? 2u : 0u));
                assert_int_equal(last->count, k != 0);
            }
            for (int i = 0; i + 1 < np; i++)
                assert_false(pend[i].flags & TDM_DRAW_ADJ_PENDING);
            for (int r = 0; r < 7; r++) {
                struct tdm_sampler *after = NULL;
                assert_int_equal(tdm_sampler_new(&after, &p, V, prompt, 5, &eos, 1), TDM_OK);
                for (int i = 0; i < n; i++)
                    tdm_sampler_replay(after, &history[i % 3], 1);
                tdm_sampler_replay(after, &real[r], 1);
                int nw = tdm_sampler_draw_prepare(after, &dw, want, CAP);
                struct tdm_draw_adj got[CAP];
                memcpy(got, pend, (size_t)np * sizeof *got);
                struct tdm_draw_params dg = dp;
                tdm_draw_resolve_pending(got, &dg.n_adj, real[r]);
                if (penalised && dg.n_adj < np)
                    resolved_merged++;
                else if (penalised)
                    resolved_new++;
                assert_int_equal(dg.n_adj, nw);
                assert_memory_equal(&dg, &dw, sizeof dg);
                qsort(got, (size_t)nw, sizeof *got, adj_by_token);
                qsort(want, (size_t)nw, sizeof *want, adj_by_token);
                for (int i = 0; i < nw; i++)
                    if (memcmp(&got[i], &want[i], sizeof got[i]) != 0)
                        fail_msg("k %d n %d token %d: entry %d: token %d flags %u count %u, "
                                 "after the replay token %d flags %u count %u",
                                 k, n, real[r], i, got[i].token, got[i].flags, got[i].count,
                                 want[i].token, want[i].flags, want[i].count);
                // A device list's rule: the entries before the token with it
                // recorded (tdm_draw_record) are the entries after it, but
                // where min_tokens runs out between them (the masks go: a
                // list is loaded again there).
                struct tdm_draw_params d0, dl;
                if (n + 1 != p.min_tokens) {
                    int32_t nl = tdm_sampler_draw_prepare(s, &d0, got, CAP), found = -1;
                    for (int i = 0; i < nl; i++)
                        found = got[i].token == real[r] ? i : found;
                    tdm_draw_record(got, &nl, real[r], d0.rec_flags, d0.rec_count, found);
                    assert_int_equal(nl, nw);
                    qsort(got, (size_t)nw, sizeof *got, adj_by_token);
                    assert_memory_equal(got, want, (size_t)nw * sizeof *got);
                    assert_int_equal(tdm_sampler_draw_list_params(s, &dl, 1), 0);
                    dl.adj_off = dp.adj_off;
                    dl.n_adj = dp.n_adj;
                    assert_memory_equal(&dl, &dp, sizeof dl);
                }
                tdm_sampler_free(after);
            }
            tdm_sampler_free(s);
        }
    }
    // Both ways of the rule ran.
    assert_true(resolved_merged > 0 && resolved_new > 0);
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.repetition_penalty = 1.05f;
    struct tdm_sampler *s = make(&p, V);
    struct tdm_draw_params d;
    struct tdm_draw_adj adj[4];
    assert_int_equal(tdm_sampler_draw_prepare_pending(s, &d, adj, 4, -1), -1);
    assert_int_equal(tdm_sampler_draw_list_params(s, &d, 2), -1);
    tdm_sampler_free(s);
}

// The outputs of one seed are pinned: a change of the draw (or of its key)
// changes every seeded request's output, across versions and between the CPU
// and a device; it must be deliberate (docs/sampling.md) and change this list.
static void test_draw_golden(void **state)
{
    (void)state;
    enum { V = 1000, N = 12 };
    static float master[V], work[V];
    for (int i = 0; i < V; i++)
        master[i] = (float)((i * 37) % 101) / 10.0f; // 0.0 .. 10.0, ties
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.8f;
    p.top_k = 200;
    p.top_p = 0.9f;
    p.has_seed = true;
    p.seed = 20261206;
    struct tdm_sampler *s = make(&p, V);
    static const int32_t want[N] = {595, 565, 464, 221, 704, 232, 999, 352, 218, 292, 120, 906};
    for (int i = 0; i < N; i++) {
        int32_t t = draw(s, master, work, V);
        printf("%d%s", t, i + 1 < N ? ", " : "\n");
        assert_int_equal(t, want[i]);
    }
    tdm_sampler_free(s);
}

// ---- min-p ------------------------------------------------------------------------------

static void test_min_p(void **state)
{
    (void)state;
    static const double prob[6] = {0.5, 0.2, 0.1, 0.1, 0.06, 0.04};
    float master[6];
    for (int i = 0; i < 6; i++)
        master[i] = (float)log(prob[i]);
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.min_p = 0.25f; // keeps p >= 0.125: tokens 0 and 1
    p.has_seed = true;
    p.seed = 5;
    struct tdm_sampler *s = make(&p, 6);
    const double want[6] = {0.5 / 0.7, 0.2 / 0.7, 0, 0, 0, 0};
    check_frequencies(s, master, 6, want, 20000, 0.015);
    tdm_sampler_free(s);

    // vLLM (v1) applies min_p before top_p, so top_p sees the renormalised {0.714,
    // 0.286}: with p = 0.65 only token 0 remains. (Top-p first would keep {0, 1}.)
    p.top_p = 0.65f;
    s = make(&p, 6);
    const double only0[6] = {1, 0, 0, 0, 0, 0};
    check_frequencies(s, master, 6, only0, 2000, 0.0);
    tdm_sampler_free(s);
}

// ---- temperature and the full distribution --------------------------------------------------

static void test_temperature_limit(void **state)
{
    (void)state;
    enum { V = 1000 };
    static float master[V], work[V];
    random_logits(master, V, 10.0f);
    int best = 0;
    for (int i = 1; i < V; i++)
        if (master[i] > master[best])
            best = i;
    master[best] += 1.0f; // a gap of 1 at T = 0.01 leaves the others < e^-100
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.has_seed = true;
    p.seed = 6;
    static const float temps[] = {0.01f, 1e-4f, 1e-7f}; // below 0.01 is raised to 0.01
    for (size_t k = 0; k < 3; k++) {
        p.temperature = temps[k];
        struct tdm_sampler *s = make(&p, V);
        for (int i = 0; i < 1000; i++)
            assert_int_equal(draw(s, master, work, V), best);
        tdm_sampler_free(s);
    }
}

static void test_unfiltered_chi_square(void **state)
{
    (void)state;
    enum { V = 10, DRAWS = 50000 };
    float master[V], work[V];
    random_logits(master, V, 3.0f);
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.7f;
    p.has_seed = true;
    p.seed = 7;
    double prob[V], sum = 0;
    for (int i = 0; i < V; i++)
        sum += prob[i] = exp(master[i] / 0.7);
    struct tdm_sampler *s = make(&p, V);
    int hits[V] = {0};
    for (int i = 0; i < DRAWS; i++)
        hits[draw(s, master, work, V)]++;
    double chi2 = 0;
    for (int i = 0; i < V; i++) {
        double e = DRAWS * prob[i] / sum;
        chi2 += (hits[i] - e) * (hits[i] - e) / e;
    }
    // 9 degrees of freedom: P(chi2 > 40) is about 7e-6.
    if (chi2 > 40.0)
        fail_msg("chi-square %.1f over 9 degrees of freedom", chi2);
    tdm_sampler_free(s);
}

// ---- speculative verification --------------------------------------------------------------

// chi-square of hits[] against probabilities prob[] (summing to 1) over the
// categories with prob > 0.
static double chi_square(const int *hits, const double *prob, int n, int total)
{
    double chi2 = 0;
    for (int i = 0; i < n; i++) {
        if (prob[i] <= 0) {
            assert_int_equal(hits[i], 0); // filtered out: never drawn
            continue;
        }
        double e = total * prob[i];
        chi2 += (hits[i] - e) * (hits[i] - e) / e;
    }
    return chi2;
}

// tdm_sampler_verify with a point-mass draft is speculative sampling's
// rejection rule: the draft is accepted with probability p(draft), a
// rejection's token follows norm(max(0, p - q)) = p without the draft,
// renormalized, and after an acceptance the next row is sampled as usual.
// Checked by chi-square over 60000 verifications on a 6-token vocabulary with
// top-k and temperature applied to p, and token-for-token against sampling the
// rows one at a time with the same seed.
static void test_verify_rejection(void **state)
{
    (void)state;
    enum { V = 6, DRAWS = 60000 };
    const float l0[V] = {1.0f, 0.2f, 2.0f, -1.0f, 0.5f, 1.5f};
    const float l1[V] = {0.1f, 1.7f, -0.5f, 0.9f, 2.2f, 0.0f};
    const int32_t draft[2] = {2, 4};
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.8f;
    p.top_k = 4;
    p.has_seed = true;
    p.seed = 99;
    // p0, p1 after temperature and top-k (the 4 largest logits kept).
    double p0[V] = {0}, p1[V] = {0}, s0 = 0, s1 = 0;
    const int keep0[4] = {0, 2, 4, 5}, keep1[4] = {0, 1, 3, 4};
    for (int i = 0; i < 4; i++) {
        s0 += p0[keep0[i]] = exp(l0[keep0[i]] / 0.8);
        s1 += p1[keep1[i]] = exp(l1[keep1[i]] / 0.8);
    }
    for (int i = 0; i < V; i++) {
        p0[i] /= s0;
        p1[i] /= s1;
    }
    struct tdm_sampler *s = make(&p, V);
    int first[V] = {0}, rejected[V] = {0}, second[V] = {0}, third[V] = {0};
    int n_acc = 0, n_rej = 0, n_acc2 = 0;
    float rows[3 * V];
    for (int d = 0; d < DRAWS; d++) {
        memcpy(rows, l0, sizeof l0);
        memcpy(rows + V, l1, sizeof l1);
        memcpy(rows + 2 * V, l0, sizeof l0); // the bonus row after both drafts
        int32_t out[3];
        int n = tdm_sampler_verify(s, rows, draft, 2, out, NULL);
        assert_true(n >= 1 && n <= 3);
        first[out[0]]++;
        if (out[0] != draft[0]) {
            assert_int_equal(n, 1);
            rejected[out[0]]++;
            n_rej++;
            continue;
        }
        assert_true(n >= 2);
        n_acc++;
        second[out[1]]++;
        if (out[1] == draft[1]) {
            assert_int_equal(n, 3);
            third[out[2]]++;
            n_acc2++;
        } else {
            assert_int_equal(n, 2);
        }
    }
    tdm_sampler_free(s);
    // Acceptance of draft 0 within 5 standard deviations of p0(draft).
    double sd = sqrt(DRAWS * p0[draft[0]] * (1 - p0[draft[0]]));
    assert_true(fabs(n_acc - DRAWS * p0[draft[0]]) < 5 * sd);
    double resid[V];
    for (int i = 0; i < V; i++)
        resid[i] = i == draft[0] ? 0.0 : p0[i] / (1 - p0[draft[0]]);
    // 3 degrees of freedom (4 tokens kept): P(chi2 > 25) ~ 1.6e-5; the residual
    // and the conditional rows have 2 and 3.
    double c1 = chi_square(first, p0, V, DRAWS);
    double c2 = chi_square(rejected, resid, V, n_rej);
    double c3 = chi_square(second, p1, V, n_acc);
    double c4 = chi_square(third, p0, V, n_acc2);
    if (c1 > 25 || c2 > 25 || c3 > 25 || c4 > 25)
        fail_msg("chi-square first %.1f residual %.1f second %.1f bonus %.1f", c1, c2, c3, c4);

    // Token for token what sampling the rows one step at a time draws.
    struct tdm_sampler *a = make(&p, V), *b = make(&p, V);
    for (int d = 0; d < 2000; d++) {
        memcpy(rows, l0, sizeof l0);
        memcpy(rows + V, l1, sizeof l1);
        memcpy(rows + 2 * V, l0, sizeof l0);
        int32_t out[3];
        int n = tdm_sampler_verify(a, rows, draft, 2, out, NULL);
        float work[V];
        for (int j = 0; j < n; j++)
            assert_int_equal(draw(b, j == 1 ? l1 : l0, work, V), out[j]);
    }
    tdm_sampler_free(a);
    tdm_sampler_free(b);
}

// A stop token ends the verification even when it equals the draft; greedy
// verification accepts exactly the argmax run.
static void test_verify_stop_and_greedy(void **state)
{
    (void)state;
    enum { V = 5 };
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.0f;
    p.stop_token_ids[0] = 3;
    p.num_stop_token_ids = 1;
    struct tdm_sampler *s = make(&p, V);
    float rows[4 * V] = {0};
    rows[0 * V + 1] = 5; // argmax 1
    rows[1 * V + 3] = 5; // argmax 3: the stop id
    rows[2 * V + 2] = 5;
    rows[3 * V + 0] = 5;
    int32_t out[4];
    const int32_t d1[3] = {1, 3, 2};
    assert_int_equal(tdm_sampler_verify(s, rows, d1, 3, out, NULL), 2);
    assert_int_equal(out[0], 1);
    assert_int_equal(out[1], 3);
    memset(rows, 0, sizeof rows);
    rows[0 * V + 1] = 5;
    rows[1 * V + 2] = 5;
    rows[2 * V + 4] = 5;
    rows[3 * V + 0] = 5;
    const int32_t d2[3] = {1, 2, 0}; // third draft wrong: the target's 4 replaces it
    assert_int_equal(tdm_sampler_verify(s, rows, d2, 3, out, NULL), 3);
    assert_int_equal(out[2], 4);
    memset(rows, 0, sizeof rows);
    rows[0 * V + 1] = 5;
    rows[1 * V + 2] = 5;
    rows[2 * V + 4] = 5;
    rows[3 * V + 0] = 5;
    const int32_t d3[3] = {1, 2, 4}; // all accepted: the bonus row's token follows
    assert_int_equal(tdm_sampler_verify(s, rows, d3, 3, out, NULL), 4);
    assert_int_equal(out[3], 0);
    assert_int_equal(tdm_sampler_num_generated(s), 2 + 3 + 4);
    tdm_sampler_free(s);
}

// ---- seeds -----------------------------------------------------------------------------------

static void sequence(uint64_t seed, int32_t *out, int n, const float *master, float *work)
{
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.has_seed = true;
    p.seed = seed;
    struct tdm_sampler *s = make(&p, 1000);
    for (int i = 0; i < n; i++)
        out[i] = draw(s, master, work, 1000);
    tdm_sampler_free(s);
}

static void test_seeds(void **state)
{
    (void)state;
    enum { N = 200 };
    static float master[1000], work[1000];
    random_logits(master, 1000, 2.0f);
    int32_t a[N], a2[N], b[2 * N];
    sequence(42, a, N, master, work);
    sequence(42, a2, N, master, work);
    sequence(43, b, 2 * N, master, work);
    assert_memory_equal(a, a2, sizeof a);
    int differ = 0;
    for (int i = 0; i < N; i++)
        differ += a[i] != b[i];
    assert_true(differ > N / 2);

    // Interleaving two samplers, one drawing twice as often, changes neither stream.
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.has_seed = true;
    p.seed = 42;
    struct tdm_sampler *sa = make(&p, 1000);
    p.seed = 43;
    struct tdm_sampler *sb = make(&p, 1000);
    for (int i = 0; i < N; i++) {
        assert_int_equal(draw(sb, master, work, 1000), b[2 * i]);
        assert_int_equal(draw(sa, master, work, 1000), a[i]);
        assert_int_equal(draw(sb, master, work, 1000), b[2 * i + 1]);
    }
    tdm_sampler_free(sa);
    tdm_sampler_free(sb);

    // Unseeded samplers get different streams.
    tdm_sampling_params_default(&p);
    struct tdm_sampler *u1 = make(&p, 1000), *u2 = make(&p, 1000);
    differ = 0;
    for (int i = 0; i < N; i++)
        differ += draw(u1, master, work, 1000) != draw(u2, master, work, 1000);
    assert_true(differ > N / 2);
    tdm_sampler_free(u1);
    tdm_sampler_free(u2);
}

// --seed (vLLM's): unseeded samplers take successive seeds of the process's
// stream, so the same requests in the same order sample the same outputs after
// a restart (the stream started again); a request's own seed still wins. Last
// in the list: it leaves the process seeded.
static void test_process_seed(void **state)
{
    (void)state;
    enum { N = 200 };
    static float master[1000], work[1000];
    random_logits(master, 1000, 2.0f);
    int32_t d[4][N], a[N], a2[N];
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    for (int run = 0; run < 2; run++) {
        tdm_sampling_set_process_seed(7);
        struct tdm_sampler *u1 = make(&p, 1000), *u2 = make(&p, 1000);
        for (int i = 0; i < N; i++) {
            d[2 * run][i] = draw(u1, master, work, 1000);
            d[2 * run + 1][i] = draw(u2, master, work, 1000);
        }
        tdm_sampler_free(u1);
        tdm_sampler_free(u2);
    }
    assert_memory_equal(d[0], d[2], sizeof d[0]);
    assert_memory_equal(d[1], d[3], sizeof d[1]);
    int differ = 0;
    for (int i = 0; i < N; i++)
        differ += d[0][i] != d[1][i];
    assert_true(differ > N / 2);
    tdm_sampling_set_process_seed(8);
    struct tdm_sampler *u = make(&p, 1000);
    differ = 0;
    for (int i = 0; i < N; i++)
        differ += draw(u, master, work, 1000) != d[0][i];
    assert_true(differ > N / 2);
    tdm_sampler_free(u);
    sequence(42, a, N, master, work);
    tdm_sampling_set_process_seed(7);
    sequence(42, a2, N, master, work);
    assert_memory_equal(a, a2, sizeof a);
}

// A sampler that replays the first k tokens of another's stream (a migrated
// stream, issue 11 part 6) continues it exactly: the RNG draws and the output
// history (presence/frequency penalties) are where the original's were.
static void test_replay(void **state)
{
    (void)state;
    enum { N = 120, K = 37 };
    static float master[1000], work[1000];
    random_logits(master, 1000, 2.0f);
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.has_seed = true;
    p.seed = 99;
    p.frequency_penalty = 0.7f;
    p.presence_penalty = 0.3f;
    struct tdm_sampler *orig = make(&p, 1000);
    int32_t a[N];
    for (int i = 0; i < N; i++)
        a[i] = draw(orig, master, work, 1000);
    struct tdm_sampler *resumed = make(&p, 1000);
    tdm_sampler_replay(resumed, a, K);
    assert_int_equal(tdm_sampler_num_generated(resumed), K);
    for (int i = K; i < N; i++)
        assert_int_equal(draw(resumed, master, work, 1000), a[i]);
    // Without the replay the continuation is another stream.
    struct tdm_sampler *fresh = make(&p, 1000);
    int differ = 0;
    for (int i = K; i < N; i++)
        differ += draw(fresh, master, work, 1000) != a[i];
    assert_true(differ > (N - K) / 2);
    tdm_sampler_free(orig);
    tdm_sampler_free(resumed);
    tdm_sampler_free(fresh);
}

// ---- penalties and bias -------------------------------------------------------------------

static void force(struct tdm_sampler *s, int32_t token, int vocab)
{
    float l[16];
    for (int i = 0; i < vocab; i++)
        l[i] = 0.0f;
    l[token] = 50.0f;
    assert_int_equal(tdm_sampler_sample(s, l, NULL), token);
}

static void test_penalties_exact(void **state)
{
    (void)state;
    enum { V = 16 };
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.0f;
    p.repetition_penalty = 1.5f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    p.logit_bias[0] = (struct tdm_logit_bias){.token = 5, .bias = 4.0f};
    const int32_t prompt[] = {3, 3, 5};
    struct tdm_sampler *s = NULL;
    p.num_logit_bias = 1;
    assert_int_equal(tdm_sampler_new(&s, &p, V, prompt, 3, NULL, 0), TDM_OK);
    force(s, 7, V);
    force(s, 7, V);
    force(s, 3, V);
    float l[V] = {0};
    l[3] = 2.0f;
    l[5] = -1.0f;
    l[7] = 4.0f;
    l[9] = 1.0f;
    l[10] = -2.0f;
    (void)tdm_sampler_sample(s, l, NULL);
    // token 3: prompt and output (count 1); 5: prompt only, biased +4 first;
    // 7: output twice; 9, 10: untouched.
    assert_float_equal(l[3], 2.0f / 1.5f - (0.25f * 1.0f + 0.5f), 1e-6);
    assert_float_equal(l[5], (-1.0f + 4.0f) / 1.5f, 1e-6);
    assert_float_equal(l[7], 4.0f / 1.5f - (0.25f * 2.0f + 0.5f), 1e-6);
    assert_float_equal(l[9], 1.0f, 0.0);
    assert_float_equal(l[10], -2.0f, 0.0);
    assert_float_equal(l[0], 0.0f, 0.0);
    tdm_sampler_free(s);

    // A negative logit of a repeated token is multiplied; the bias is clamped to 100.
    p.num_logit_bias = 1;
    p.logit_bias[0] = (struct tdm_logit_bias){.token = 2, .bias = 300.0f};
    p.presence_penalty = p.frequency_penalty = 0.0f;
    assert_int_equal(tdm_sampler_new(&s, &p, V, prompt, 3, NULL, 0), TDM_OK);
    float m[V] = {0};
    m[3] = -2.0f;
    assert_int_equal(tdm_sampler_sample(s, m, NULL), 2);
    assert_float_equal(m[3], -3.0f, 1e-6);
    assert_float_equal(m[2], 100.0f, 0.0);
    tdm_sampler_free(s);
}

// ---- min_tokens and stopping ------------------------------------------------------------------

static void test_min_tokens(void **state)
{
    (void)state;
    enum { V = 20 };
    for (int ignore = 0; ignore < 2; ignore++) {
        struct tdm_sampling_params p;
        tdm_sampling_params_default(&p);
        p.temperature = 0.0f;
        p.min_tokens = 3;
        p.ignore_eos = ignore;
        p.num_stop_token_ids = 1;
        p.stop_token_ids[0] = 8;
        const int32_t eos = 9;
        struct tdm_sampler *s = NULL;
        assert_int_equal(tdm_sampler_new(&s, &p, V, NULL, 0, &eos, 1), TDM_OK);
        assert_false(tdm_sampler_is_stop(s, 8)); // before min_tokens nothing stops
        for (int i = 0; i < 4; i++) {
            float l[V] = {0};
            l[9] = 10.0f;
            l[8] = 9.0f;
            l[4] = 5.0f;
            int32_t t = tdm_sampler_sample(s, l, NULL);
            if (i < 3) {
                // EOS and the stop id are masked, even with ignore_eos (as vLLM).
                assert_int_equal(t, 4);
                assert_true(isinf(l[9]) && l[9] < 0);
                assert_false(tdm_sampler_is_stop(s, t));
            } else {
                assert_int_equal(t, 9);
                assert_int_equal(tdm_sampler_is_stop(s, t), !ignore);
                assert_true(tdm_sampler_is_stop(s, 8));
            }
        }
        tdm_sampler_free(s);
    }
}

// ---- logprobs ---------------------------------------------------------------------------------

static void test_logprobs(void **state)
{
    (void)state;
    enum { V = 50, N = 5 };
    float master[V], l[V];
    random_logits(master, V, 6.0f);
    master[17] = master[30] = 7.0f; // a tie at the top: the lower id first
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.0f;
    p.logprobs = N;
    p.num_logit_bias = 1;
    p.logit_bias[0] = (struct tdm_logit_bias){.token = 2, .bias = 50.0f}; // picks 2
    struct tdm_sampler *s = make(&p, V);
    memcpy(l, master, sizeof l);
    struct tdm_sample_result res;
    assert_int_equal(tdm_sampler_sample(s, l, &res), 2);
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < V; i++)
        mx = fmax(mx, master[i]);
    for (int i = 0; i < V; i++)
        sum += exp(master[i] - mx);
    double lse = mx + log(sum);
    assert_int_equal(res.token, 2);
    // From the RAW logits: the bias does not show.
    assert_float_equal(res.logprob, master[2] - lse, 1e-5);
    assert_int_equal(res.num_top, N);
    assert_int_equal(res.top[0].token, 17);
    assert_int_equal(res.top[1].token, 30);
    for (int j = 0; j < N; j++) {
        int t = res.top[j].token;
        assert_float_equal(res.top[j].logprob, master[t] - lse, 1e-5);
        assert_int_equal(count_greater(master, V, master[t]), j < 2 ? 0 : j);
        if (j > 0)
            assert_true(res.top[j].logprob <= res.top[j - 1].logprob);
    }
    tdm_sampler_free(s);

    p.logprobs = 0;
    p.num_logit_bias = 0;
    s = make(&p, V);
    memcpy(l, master, sizeof l);
    assert_int_equal(tdm_sampler_sample(s, l, &res), 17);
    assert_int_equal(res.num_top, 0);
    assert_float_equal(res.logprob, 7.0 - lse, 1e-5);
    tdm_sampler_free(s);
}

// ---- degenerate logits -------------------------------------------------------------------------

static void test_degenerate_logits(void **state)
{
    (void)state;
    enum { V = 64 };
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.top_k = 5;
    p.top_p = 0.5f;
    p.has_seed = true;
    p.seed = 8;
    struct tdm_sampler *s = make(&p, V);
    float l[V];
    for (int i = 0; i < V; i++)
        l[i] = -INFINITY;
    int32_t t = tdm_sampler_sample(s, l, NULL);
    assert_true(t >= 0 && t < V);
    for (int i = 0; i < V; i++)
        l[i] = NAN;
    l[9] = 1.0f;
    assert_int_equal(tdm_sampler_sample(s, l, NULL), 9);
    tdm_sampler_free(s);
}

// ---- the full-row passes: AVX2 and portable C against brute force ------------------

// Brute-force references, written apart from sampling_simd.c.
static int32_t ref_argmax(const float *x, size_t n, float *max_out)
{
    size_t best = 0;
    bool found = false;
    for (size_t i = 0; i < n; i++)
        if (!isnan(x[i]) && x[i] != -INFINITY && (!found || x[i] > x[best])) {
            best = i;
            found = true;
        }
    *max_out = found ? x[best] : -INFINITY;
    return (int32_t)best;
}

static size_t ref_next_above(const float *x, size_t i, size_t n, float f)
{
    for (; i < n; i++)
        if (x[i] > f)
            return i;
    return n;
}

// Fills a row that stresses the passes: few distinct values (ties everywhere),
// NaN, +-inf, +-0, a maximum repeated in several lanes, or all -inf / NaN.
static void tricky_row(float *x, size_t n, int kind)
{
    for (size_t i = 0; i < n; i++) {
        double u = test_uniform();
        switch (kind) {
        case 0: x[i] = (float)(int)(u * 5); break;                 // 5 values: ties
        case 1: x[i] = u < 0.1 ? NAN : (float)(u * 3 - 1); break;  // NaN sprinkled
        case 2: x[i] = u < 0.5 ? -INFINITY : (float)(int)(u * 3); break;
        case 3: x[i] = u < 0.5 ? 0.0f : -0.0f; break;               // signed zeros
        case 4: x[i] = u < 0.5 ? -INFINITY : NAN; break;            // nothing valid
        case 5: x[i] = u < 0.01 ? INFINITY : (float)u; break;
        default: x[i] = (float)(u * 20 - 10); break;                // random
        }
    }
}

static void check_passes(const float *x, size_t n, int32_t *ids, int32_t *ids2)
{
    float rmax;
    int32_t rarg = ref_argmax(x, n, &rmax);
    float m = 0.0f;
    int32_t a = tdm_sampling_argmax(x, n, &m);
    assert_int_equal(a, rarg);
    assert_memory_equal(&m, &rmax, sizeof m); // bitwise: the sign of a zero included
    // Thresholds: the maximum, a middle value, -FLT_MAX (everything finite), -inf, NaN.
    float thr[5] = {rmax, 1.0f, -3.4e38f, -INFINITY, NAN};
    for (int t = 0; t < 5; t++) {
        size_t want = 0;
        for (size_t i = 0; i < n; i++)
            if (x[i] >= thr[t])
                ids2[want++] = (int32_t)i;
        size_t got = tdm_sampling_collect_ge(x, n, thr[t], ids);
        assert_int_equal(got, want);
        if (want > 0)
            assert_memory_equal(ids, ids2, want * sizeof *ids);
        for (size_t i = 0; i <= n; i += 1 + n / 37)
            assert_int_equal(tdm_sampling_next_above(x, i, n, thr[t]),
                             ref_next_above(x, i, n, thr[t]));
    }
    // The log-softmax's sum: its definition's bits (tdm_draw_exp's terms in
    // 8 partial sums by index mod 8, added in a fixed tree) on either path,
    // and within 1e-6 of the sum of exponentials where every value is finite.
    // NaN where a term's argument is (a NaN logit, +inf - +inf, -inf - -inf).
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, exact = 0.0;
    bool finite = true, nan = false;
    for (size_t i = 0; i < n; i++) {
        part[i % 8] += (double)tdm_draw_exp(x[i] - rmax);
        finite = finite && isfinite(x[i]);
        nan = nan || isnan(x[i] - rmax);
        exact += exp((double)x[i] - (double)rmax);
    }
    double want = nan ? (double)NAN
                      : ((part[0] + part[1]) + (part[2] + part[3])) +
                            ((part[4] + part[5]) + (part[6] + part[7]));
    double got = tdm_sampling_sum_exp(x, n, rmax);
    assert_memory_equal(&got, &want, sizeof got);
    if (finite && n > 0)
        assert_true(fabs(got - exact) <= 1e-6 * exact);
}

static void test_simd_passes(void **state)
{
    (void)state;
    enum tdm_sampling_simd saved = tdm_sampling_simd_get();
    enum tdm_sampling_simd paths[2] = {TDM_SAMPLING_SIMD_PORTABLE, TDM_SAMPLING_SIMD_AVX2};
    size_t sizes[] = {0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 100, 1000, 1031, 151936};
    float *x = malloc(151936 * sizeof *x);
    int32_t *ids = malloc(151936 * sizeof *ids), *ids2 = malloc(151936 * sizeof *ids2);
    assert_non_null(x);
    assert_non_null(ids);
    assert_non_null(ids2);
    for (int p = 0; p < 2; p++) {
        if (tdm_sampling_simd_set(paths[p]) != 0) {
            printf("(AVX2 not supported here: portable path only)\n");
            continue;
        }
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            for (int kind = 0; kind < 7; kind++) {
                test_rng = 777 + (uint64_t)(si * 7 + (size_t)kind);
                tricky_row(x, sizes[si], kind);
                check_passes(x, sizes[si], ids, ids2);
            }
            // The maximum at every position of a 32-lane block and the tail,
            // then tied at two positions (the lower wins).
            size_t n = sizes[si];
            for (size_t at = 0; at < n && at < 70; at++) {
                for (size_t i = 0; i < n; i++)
                    x[i] = -1.0f;
                x[at] = 2.0f;
                check_passes(x, n, ids, ids2);
                if (at + 33 < n) {
                    x[at + 33] = 2.0f;
                    check_passes(x, n, ids, ids2);
                }
            }
            if (n > 0) { // the maximum last, a tie of it first
                for (size_t i = 0; i < n; i++)
                    x[i] = (float)(i % 3);
                x[n - 1] = 5.0f;
                check_passes(x, n, ids, ids2);
                x[0] = 5.0f;
                check_passes(x, n, ids, ids2);
            }
        }
    }
    tdm_sampling_simd_set(saved);
    free(x);
    free(ids);
    free(ids2);
}

// Whole sampler runs (greedy, top-k, top-p, unfiltered, logprobs, penalties)
// give the same tokens, logprobs and RNG stream on either path.
static void test_simd_sampler_equal(void **state)
{
    (void)state;
    enum tdm_sampling_simd saved = tdm_sampling_simd_get();
    if (tdm_sampling_simd_set(TDM_SAMPLING_SIMD_AVX2) != 0) {
        printf("(AVX2 not supported here: nothing to compare)\n");
        return;
    }
    enum { V = 1031, STEPS = 40 };
    float *row = malloc(V * sizeof *row), *copy = malloc(V * sizeof *copy);
    assert_non_null(row);
    assert_non_null(copy);
    for (int cfg = 0; cfg < 6; cfg++) {
        struct tdm_sampling_params p;
        tdm_sampling_params_default(&p);
        p.has_seed = true;
        p.seed = 42 + (uint64_t)cfg;
        p.temperature = cfg == 0 ? 0.0f : 0.8f;
        p.top_k = cfg == 1 ? 20 : cfg == 4 ? 300 : 0;
        p.top_p = cfg == 2 ? 0.7f : 1.0f;
        p.logprobs = cfg >= 3 ? 5 : -1;
        p.repetition_penalty = cfg == 5 ? 1.3f : 1.0f;
        p.frequency_penalty = cfg == 5 ? 0.5f : 0.0f;
        int32_t prompt[3] = {1, 2, 3};
        struct tdm_sampler *s[2];
        for (int k = 0; k < 2; k++)
            assert_int_equal(tdm_sampler_new(&s[k], &p, V, prompt, 3, NULL, 0), TDM_OK);
        for (int step = 0; step < STEPS; step++) {
            test_rng = 1000 + (uint64_t)(cfg * STEPS + step);
            tricky_row(row, V, step % 7 == 4 ? 6 : step % 7); // all-invalid rows too
            struct tdm_sample_result r[2];
            memset(r, 0, sizeof r);
            for (int k = 0; k < 2; k++) {
                tdm_sampling_simd_set(k == 0 ? TDM_SAMPLING_SIMD_PORTABLE
                                             : TDM_SAMPLING_SIMD_AVX2);
                memcpy(copy, row, V * sizeof *row);
                tdm_sampler_sample(s[k], copy, &r[k]);
            }
            assert_int_equal(r[0].token, r[1].token);
            assert_memory_equal(&r[0].logprob, &r[1].logprob, sizeof(float));
            assert_int_equal(r[0].num_top, r[1].num_top);
            for (int j = 0; j < r[0].num_top; j++) {
                assert_int_equal(r[0].top[j].token, r[1].top[j].token);
                assert_memory_equal(&r[0].top[j].logprob, &r[1].top[j].logprob, sizeof(float));
            }
        }
        for (int k = 0; k < 2; k++)
            tdm_sampler_free(s[k]);
    }
    tdm_sampling_simd_set(saved);
    free(row);
    free(copy);
}

// tdm_sampler_plain_greedy: true exactly when the next token is the raw
// argmax (the engine then takes it from the model's fused LM head and records
// it with tdm_sampler_replay); min_tokens keeps it false while EOS is masked.
static void test_plain_greedy(void **state)
{
    (void)state;
    struct tdm_sampling_params p;
    struct tdm_sampler *s;
    int32_t eos = 7;
    const struct {
        const char *what;
        float temperature, rep, presence, freq;
        int logprobs, bias, min_tokens;
        bool plain;
    } cases[] = {
        {"greedy", 0, 1, 0, 0, -1, 0, 0, true},
        {"temperature", 0.7f, 1, 0, 0, -1, 0, 0, false},
        {"repetition", 0, 1.1f, 0, 0, -1, 0, 0, false},
        {"presence", 0, 1, 0.5f, 0, -1, 0, 0, false},
        {"frequency", 0, 1, 0, 0.5f, -1, 0, 0, false},
        {"logprobs", 0, 1, 0, 0, 0, 0, 0, false},
        {"logit_bias", 0, 1, 0, 0, -1, 1, 0, false},
        {"min_tokens", 0, 1, 0, 0, -1, 0, 2, false},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        tdm_sampling_params_default(&p);
        p.temperature = cases[c].temperature;
        p.repetition_penalty = cases[c].rep;
        p.presence_penalty = cases[c].presence;
        p.frequency_penalty = cases[c].freq;
        p.logprobs = cases[c].logprobs;
        p.num_logit_bias = cases[c].bias;
        p.logit_bias[0].token = 3;
        p.logit_bias[0].bias = 1.0f;
        p.min_tokens = cases[c].min_tokens;
        assert_int_equal(tdm_sampler_new(&s, &p, 100, NULL, 0, &eos, 1), TDM_OK);
        if (tdm_sampler_plain_greedy(s) != cases[c].plain)
            fail_msg("%s: plain_greedy %d", cases[c].what, !cases[c].plain);
        if (cases[c].min_tokens > 0) {
            // Plain once min_tokens are out: the EOS mask is off from then on.
            int32_t t = 5;
            tdm_sampler_replay(s, &t, 1);
            assert_false(tdm_sampler_plain_greedy(s));
            tdm_sampler_replay(s, &t, 1);
            assert_true(tdm_sampler_plain_greedy(s));
        }
        tdm_sampler_free(s);
    }
    // A replayed argmax leaves a plain greedy sampler as sampling would.
    tdm_sampling_params_default(&p);
    p.temperature = 0;
    struct tdm_sampler *a, *b;
    assert_int_equal(tdm_sampler_new(&a, &p, 100, NULL, 0, &eos, 1), TDM_OK);
    assert_int_equal(tdm_sampler_new(&b, &p, 100, NULL, 0, &eos, 1), TDM_OK);
    float l[100];
    for (int step = 0; step < 5; step++) {
        for (int v = 0; v < 100; v++)
            l[v] = (float)((v * 37 + step * 11) % 100);
        int32_t best = 0;
        for (int v = 1; v < 100; v++)
            best = l[v] > l[best] ? v : best;
        assert_int_equal(tdm_sampler_sample(a, l, NULL), best);
        tdm_sampler_replay(b, &best, 1);
        assert_int_equal(tdm_sampler_num_generated(a), tdm_sampler_num_generated(b));
        assert_int_equal(tdm_sampler_is_stop(a, eos), tdm_sampler_is_stop(b, eos));
    }
    tdm_sampler_free(a);
    tdm_sampler_free(b);
}

// allowed_token_ids: greedy takes the best allowed token, a draw never leaves
// the set (over many seeds, with the set's mass checked against its
// renormalised probabilities), the logprobs stay those of the raw row, the
// fast paths are refused (not plain, no device draw), and bad lists are
// refused with vLLM's message.
static void test_allowed_token_ids(void **state)
{
    (void)state;
    enum { V = 300, DRAWS = 4000 };
    static float master[V], work[V];
    const int32_t allowed[5] = {5, 77, 299, 5, 130}; // a duplicate is fine
    random_logits(master, V, 4.0f);
    master[200] = 50.0f; // the row's best, not allowed
    master[130] = 3.0f, master[77] = 2.0f, master[5] = 1.0f, master[299] = 2.5f;
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.0f;
    p.allowed_token_ids = allowed;
    p.num_allowed_token_ids = 5;
    p.logprobs = 2;
    struct tdm_sampler *s = make(&p, V);
    assert_false(tdm_sampler_plain_greedy(s));
    struct tdm_draw_params d;
    struct tdm_draw_adj adj[8];
    assert_int_equal(tdm_sampler_draw_prepare(s, &d, adj, 8), -1);
    assert_false(tdm_sampler_draw_params(s, &d));
    struct tdm_sample_result res;
    memcpy(work, master, sizeof master);
    assert_int_equal(tdm_sampler_sample(s, work, &res), 130);
    // Logprobs of the raw row: the top one is 200, which was not drawable.
    assert_int_equal(res.num_top, 2);
    assert_int_equal(res.top[0].token, 200);
    tdm_sampler_free(s);

    p.temperature = 1.0f;
    p.logprobs = -1;
    int count[V] = {0};
    for (int i = 0; i < DRAWS; i++) {
        p.has_seed = true;
        p.seed = 1000u + (uint64_t)i;
        s = make(&p, V);
        count[draw(s, master, work, V)]++;
        tdm_sampler_free(s);
    }
    double z = exp(1.0) + exp(2.0) + exp(2.5) + exp(3.0);
    const int32_t set[4] = {5, 77, 130, 299};
    int in_set = 0;
    for (int k = 0; k < 4; k++) {
        double pk = exp((double)master[set[k]]) / z;
        double sd = sqrt(DRAWS * pk * (1 - pk));
        if (fabs(count[set[k]] - DRAWS * pk) > 5 * sd)
            fail_msg("token %d drawn %d times, expected %.0f", set[k], count[set[k]], DRAWS * pk);
        in_set += count[set[k]];
    }
    assert_int_equal(in_set, DRAWS);

    const int32_t outside[2] = {3, V};
    p.allowed_token_ids = outside;
    p.num_allowed_token_ids = 2;
    expect_invalid(&p, "allowed_token_ids contains out-of-vocab token id 300");
    p.num_allowed_token_ids = -1;
    expect_invalid(&p, "allowed_token_ids");
}

// logprob_token_ids: each token's top list is the chosen token, then the ids
// once each in request order, with the raw row's log-softmax (what the top-N
// path gives the same ids), one length for every token (the chosen token is
// listed again when it is an id); such rows are not drawn on a device; and
// vLLM's bounds and messages.
static void test_logprob_token_ids(void **state)
{
    (void)state;
    enum { V = 300 };
    static float master[V], work[V];
    const int32_t ids[5] = {77, 5, 77, 299, 130};
    random_logits(master, V, 4.0f);
    master[130] = 40.0f; // greedy picks 130, an id
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.0f;
    p.repetition_penalty = 1.3f; // the logprobs stay those of the raw row
    p.logprobs = 0;
    p.logprob_token_ids = ids;
    p.num_logprob_token_ids = 5;
    assert_int_equal(tdm_sampling_top_entries(&p), 5); // 1 + {77, 5, 299, 130}
    struct tdm_sampler *s = make(&p, V);
    struct tdm_draw_params d;
    struct tdm_draw_adj adj[8];
    assert_int_equal(tdm_sampler_draw_prepare(s, &d, adj, 8), -1); // host-sampled
    assert_false(tdm_sampler_draw_ahead_ok(s));
    // The reference: every token's raw log-softmax, through the top-N path.
    struct tdm_sample_result ref;
    tdm_logprobs_of_row(master, V, 0, 0, &ref, NULL);
    double lse = (double)master[0] - (double)ref.logprob;
    for (int step = 0; step < 2; step++) {
        struct tdm_sample_result res;
        memcpy(work, master, sizeof master);
        int32_t tok = tdm_sampler_sample(s, work, &res);
        assert_int_equal(res.num_top, 5);
        assert_int_equal(res.top[0].token, tok);
        assert_true(res.top[0].logprob == res.logprob);
        const int32_t want[4] = {77, 5, 299, 130};
        for (int i = 0; i < 4; i++) {
            assert_int_equal(res.top[1 + i].token, want[i]);
            double lp = (double)master[want[i]] - lse;
            if (fabs(res.top[1 + i].logprob - lp) > 1e-4)
                fail_msg("id %d: logprob %g, want %g", want[i], res.top[1 + i].logprob, lp);
        }
        assert_true(fabs(res.logprob - ((double)master[tok] - lse)) < 1e-4);
        if (step == 0)
            assert_int_equal(tok, 130); // an id: listed first and again last
    }
    tdm_sampler_free(s);

    // Without ids: the top-N count as before.
    p.num_logprob_token_ids = 0;
    p.logprobs = 3;
    assert_int_equal(tdm_sampling_top_entries(&p), 3);
    p.logprobs = -1;
    assert_int_equal(tdm_sampling_top_entries(&p), 0);

    int32_t many[TDM_MAX_LOGPROB_TOKEN_IDS + 1];
    for (int i = 0; i <= TDM_MAX_LOGPROB_TOKEN_IDS; i++)
        many[i] = i;
    p.logprobs = 0;
    p.logprob_token_ids = many;
    p.num_logprob_token_ids = TDM_MAX_LOGPROB_TOKEN_IDS;
    s = make(&p, V); // 128: taken
    tdm_sampler_free(s);
    p.num_logprob_token_ids = TDM_MAX_LOGPROB_TOKEN_IDS + 1;
    expect_invalid(&p, "Requested logprob_token_ids of length 129, which is greater than max "
                       "allowed: 128");
    const int32_t outside[2] = {3, V};
    p.logprob_token_ids = outside;
    p.num_logprob_token_ids = 2;
    expect_invalid(&p, "token_id(s) [300] in logprob_token_ids contain out-of-vocab token ids. "
                       "Vocabulary size: 100"); // expect_invalid's vocabulary
    p.logprob_token_ids = ids;
    p.logprobs = -1;
    expect_invalid(&p, "with logprobs off");
}

// vLLM's bad-words rule over the whole output, for the reference: the set of
// last tokens of the words whose other tokens end out[0 .. n).
static bool bad_banned(const int32_t *ids, const int32_t *lens, int n_words, const int32_t *out,
                       int n, int32_t t)
{
    for (int i = 0, off = 0; i < n_words; off += lens[i++]) {
        int pre = lens[i] - 1;
        if (ids[off + pre] != t || pre > n)
            continue;
        if (memcmp(out + n - pre, ids + off, (size_t)pre * sizeof *out) == 0)
            return true;
    }
    return false;
}

// bad_words: step after step, a greedy sampler takes the best token the rule
// leaves, over an output steered into the words' prefixes (one-token words,
// two- and three-token words sharing a prefix, a repeated token, a word
// longer than the ring's need, words longer than the output so far); the
// device entries mask exactly the banned tokens (beside a bias and the
// min_tokens masks), rows ahead of the history equal a twin's after the
// replay, and a row after a pending token is refused while a word of two
// tokens or more could follow it (allowed with one-token words only, whose
// list the device may keep).
static void test_bad_words(void **state)
{
    (void)state;
    enum { V = 64, STEPS = 120, CAP = 64 };
    const int32_t ids[] = {9, 4, 5, 4, 5, 6, 7, 7, 1, 2, 3, 4, 5, 6, 8, 40};
    const int32_t lens[] = {1, 2, 3, 2, 6, 1, 1};
    const int n_words = 7;
    static float master[V], work[V], masked[V];
    static int32_t out[STEPS];
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.0f;
    p.has_seed = true; // the twin's key equal
    p.seed = 5;
    p.bad_word_ids = ids;
    p.bad_word_lens = lens;
    p.num_bad_words = n_words;
    p.min_tokens = 3;
    p.stop_token_ids[0] = 8; // also a bad word: one entry
    p.num_stop_token_ids = 1;
    p.logit_bias[0] = (struct tdm_logit_bias){.token = 6, .bias = 0.5f};
    p.num_logit_bias = 1;
    int32_t eos = 63;
    struct tdm_sampler *s = NULL;
    assert_int_equal(tdm_sampler_new(&s, &p, V, NULL, 0, &eos, 1), TDM_OK);
    assert_false(tdm_sampler_plain_greedy(s));
    int bans_seen = 0;
    for (int step = 0; step < STEPS; step++) {
        random_logits(master, V, 1.0f);
        // Steer toward the words: the next token of some word is the best.
        const int32_t lead[] = {9, 4, 5, 6, 7, 1, 2, 3, 40};
        master[lead[(step * 7 + step / 3) % 9]] = 5.0f;
        master[lead[(step * 5 + 1) % 9]] = 4.0f;
        memcpy(masked, master, sizeof master);
        masked[6] += 0.5f;
        int n_banned = 0;
        for (int t = 0; t < V; t++)
            if (bad_banned(ids, lens, n_words, out, step, t) || (step < 3 && (t == 8 || t == 63))) {
                masked[t] = -INFINITY;
                n_banned += t != 8 && t != 63;
            }
        bans_seen += n_banned;
        int32_t want = 0;
        for (int t = 1; t < V; t++)
            want = masked[t] > masked[want] ? t : want;
        struct tdm_draw_params d;
        struct tdm_draw_adj adj[CAP];
        int n = tdm_sampler_draw_prepare(s, &d, adj, CAP);
        assert_true(n >= 0 && n <= CAP);
        float viaadj[V];
        memcpy(viaadj, master, sizeof master);
        for (int i = 0; i < n; i++)
            viaadj[adj[i].token] = tdm_draw_adjust(viaadj[adj[i].token], &d, &adj[i]);
        assert_memory_equal(viaadj, masked, sizeof masked);
        // A row two tokens ahead equals a twin's after their replay.
        const int32_t two[2] = {4, 5};
        struct tdm_sampler *twin = NULL;
        assert_int_equal(tdm_sampler_new(&twin, &p, V, NULL, 0, &eos, 1), TDM_OK);
        tdm_sampler_replay(twin, out, (size_t)step);
        tdm_sampler_replay(twin, two, 2);
        struct tdm_draw_params dg, dw;
        struct tdm_draw_adj got[CAP], wantadj[CAP];
        int need = tdm_sampler_draw_prepare(twin, &dw, wantadj, CAP);
        assert_int_equal(tdm_sampler_draw_prepare_ahead(s, &dg, got, CAP, two, 2), need);
        assert_memory_equal(&dg, &dw, sizeof dg);
        assert_memory_equal(got, wantadj, (size_t)need * sizeof *got);
        tdm_sampler_free(twin);
        // Which tokens a two- or three-token word bans depends on the token
        // before: not known for a pending row, nor kept in a list.
        assert_int_equal(tdm_sampler_draw_prepare_pending(s, &d, adj, CAP, 0), -1);
        assert_int_equal(tdm_sampler_draw_list_params(s, &d, 0), -1);
        assert_false(tdm_sampler_draw_ahead_ok(s)); // the engine asks before a step ahead
        memcpy(work, master, sizeof master);
        int32_t got_tok = tdm_sampler_sample(s, work, NULL);
        if (got_tok != want)
            fail_msg("step %d: sampler %d, reference %d", step, got_tok, want);
        out[step] = got_tok;
    }
    printf("%d bans over %d steps\n", bans_seen, STEPS);
    assert_true(bans_seen > STEPS / 4);
    for (int step = 0; step < STEPS; step++)
        assert_false(bad_banned(ids, lens, n_words, out, step, out[step]));
    tdm_sampler_free(s);

    // One-token words only: static bans, fine for a pending row and a list.
    const int32_t one_ids[2] = {9, 12}, one_lens[2] = {1, 1};
    tdm_sampling_params_default(&p);
    p.temperature = 0.7f;
    p.repetition_penalty = 1.1f;
    p.bad_word_ids = one_ids;
    p.bad_word_lens = one_lens;
    p.num_bad_words = 2;
    s = make(&p, V);
    struct tdm_draw_params d;
    struct tdm_draw_adj adj[CAP];
    int n = tdm_sampler_draw_prepare_pending(s, &d, adj, CAP, 3);
    assert_int_equal(n, 3); // two bans, then the pending entry
    assert_int_equal(adj[0].token, 9);
    assert_int_equal(adj[0].flags, TDM_DRAW_ADJ_MASKED);
    assert_int_equal(adj[1].token, 12);
    assert_true(adj[2].flags & TDM_DRAW_ADJ_PENDING);
    assert_int_equal(tdm_sampler_draw_list_params(s, &d, 1), 0);
    assert_true(tdm_sampler_draw_ahead_ok(s));
    tdm_sampler_free(s);

    // Validation: vLLM's messages.
    const int32_t zero_len[1] = {0}, big[1] = {100}, long_len[1] = {TDM_MAX_BAD_WORD_TOKENS + 1};
    p.bad_word_lens = zero_len;
    p.num_bad_words = 1;
    expect_invalid(&p, "bad_words entries must tokenize to at least one token.");
    p.bad_word_ids = big;
    p.bad_word_lens = one_lens;
    expect_invalid(&p, "The model vocabulary size is 100, but the following tokens were "
                       "specified as bad: [100]");
    p.bad_word_lens = long_len;
    expect_invalid(&p, "more than 1024 tokens");
    p.num_bad_words = TDM_MAX_BAD_WORDS + 1;
    expect_invalid(&p, "Too many bad words after tokenization: 129. The max number is 128.");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_validate),
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_top_k),
        cmocka_unit_test(test_top_k_large_vocab),
        cmocka_unit_test(test_top_p_small),
        cmocka_unit_test(test_top_p_select_exact),
        cmocka_unit_test(test_top_p_exact_boundary),
        cmocka_unit_test(test_top_p_large_vocab),
        cmocka_unit_test(test_draw_exp),
        cmocka_unit_test(test_draw_definition),
        cmocka_unit_test(test_draw_golden),
        cmocka_unit_test(test_draw_prepare),
        cmocka_unit_test(test_draw_prepare_ahead),
        cmocka_unit_test(test_draw_prepare_pending),
        cmocka_unit_test(test_min_p),
        cmocka_unit_test(test_temperature_limit),
        cmocka_unit_test(test_unfiltered_chi_square),
        cmocka_unit_test(test_seeds),
        cmocka_unit_test(test_replay),
        cmocka_unit_test(test_penalties_exact),
        cmocka_unit_test(test_min_tokens),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_degenerate_logits),
        cmocka_unit_test(test_verify_rejection),
        cmocka_unit_test(test_verify_stop_and_greedy),
        cmocka_unit_test(test_simd_passes),
        cmocka_unit_test(test_simd_sampler_equal),
        cmocka_unit_test(test_plain_greedy),
        cmocka_unit_test(test_allowed_token_ids),
        cmocka_unit_test(test_logprob_token_ids),
        cmocka_unit_test(test_bad_words),
        cmocka_unit_test(test_process_seed), // last: it leaves the process seeded
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
