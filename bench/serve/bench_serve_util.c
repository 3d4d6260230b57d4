// SPDX-License-Identifier: Apache-2.0
// bench_serve utilities: a seeded xoshiro256** generator (so a seed gives the
// same prompts and the same arrival schedule on every machine), gamma-
// distributed arrival gaps as vLLM's bench draws them, numpy-style linear
// percentiles, and the parsers for --percentiles and --goodput terms.
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_serve_impl.h"
#include "core.h"

// ---- random numbers ------------------------------------------------------------------------
static double rng_normal(struct tdm_rng *r)
{
    // Box-Muller; 1 - u keeps the log argument in (0, 1].
    double u1 = 1.0 - tdm_rng_uniform(r);
    double u2 = tdm_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

double bench_rng_gamma(struct tdm_rng *r, double shape, double scale)
{
    if (shape < 1.0) {
        // Gamma(a) = Gamma(a + 1) * U^(1/a) (Marsaglia-Tsang's boost for a < 1).
        double u = 1.0 - tdm_rng_uniform(r);
        return bench_rng_gamma(r, shape + 1.0, scale) * pow(u, 1.0 / shape);
    }
    double d = shape - 1.0 / 3.0;
    double c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = rng_normal(r);
        double v = 1.0 + c * x;
        if (v <= 0.0)
            continue;
        v = v * v * v;
        double u = 1.0 - tdm_rng_uniform(r);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v))
            return d * v * scale;
    }
}

void bench_arrivals_init(struct bench_arrivals *a, double rate, double burstiness, uint64_t seed)
{
    // A different stream from the dataset's, so changing --input-len does not
    // change the arrival schedule.
    tdm_rng_seed(&a->rng, seed ^ 0x5eed0a11a1ULL);
    a->t = 0.0;
    a->rate = rate;
    a->burstiness = burstiness;
}

double bench_arrivals_next(struct bench_arrivals *a)
{
    double t = a->t;
    if (!isinf(a->rate))
        a->t += bench_rng_gamma(&a->rng, a->burstiness, 1.0 / (a->rate * a->burstiness));
    return t;
}

void bench_arrival_times(double *out, size_t n, double rate, double burstiness, uint64_t seed)
{
    struct bench_arrivals a;
    bench_arrivals_init(&a, rate, burstiness, seed);
    for (size_t i = 0; i < n; i++)
        out[i] = bench_arrivals_next(&a);
}

// ---- statistics ------------------------------------------------------------------------------
double bench_percentile(const double *sorted, size_t n, double p)
{
    if (n == 0)
        return 0.0;
    double rank = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(rank);
    if (lo >= n - 1)
        return sorted[n - 1];
    double frac = rank - (double)lo;
    return sorted[lo] + (sorted[lo + 1] - sorted[lo]) * frac;
}

// ---- flag values ---------------------------------------------------------------------------
int bench_parse_percentiles(struct tdm_bench_config *cfg, const char *text, char *err,
                            size_t errlen)
{
    int n = 0;
    const char *p = text;
    while (*p) {
        char *end;
        errno = 0;
        double v = strtod(p, &end);
        if (end == p || errno || !(v > 0.0 && v <= 100.0))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--percentiles: \"%s\" is not a list of numbers in (0, 100]", text);
        if (n == TDM_BENCH_MAX_PERCENTILES)
            return tdm_seterr(err, errlen, TDM_EINVAL, "--percentiles: at most %d values",
                              TDM_BENCH_MAX_PERCENTILES);
        cfg->percentiles[n++] = v;
        p = end;
        if (*p == ',')
            p++;
        else if (*p)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--percentiles: \"%s\" is not a comma-separated list", text);
    }
    if (n == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--percentiles: empty list");
    cfg->n_percentiles = n;
    return TDM_OK;
}

int bench_parse_slo(struct tdm_bench_config *cfg, const char *term, char *err, size_t errlen)
{
    const char *colon = strchr(term, ':');
    if (!colon)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--goodput: \"%s\" is not KEY:MS (keys ttft, tpot, e2el)", term);
    char *end;
    errno = 0;
    double ms = strtod(colon + 1, &end);
    if (end == colon + 1 || *end || errno || !(ms > 0.0) || isinf(ms))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--goodput: \"%s\": the value must be a positive number of ms", term);
    size_t klen = (size_t)(colon - term);
    if (klen == 4 && !strncmp(term, "ttft", 4))
        cfg->slo_ttft_ms = ms;
    else if (klen == 4 && !strncmp(term, "tpot", 4))
        cfg->slo_tpot_ms = ms;
    else if (klen == 4 && !strncmp(term, "e2el", 4))
        cfg->slo_e2el_ms = ms;
    else
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--goodput: unknown metric in \"%s\" (use ttft, tpot or e2el)", term);
    return TDM_OK;
}
