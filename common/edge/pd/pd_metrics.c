// SPDX-License-Identifier: Apache-2.0
// pd_metrics: the transfer metrics both P/D worker roles keep, each under its
// own names (see pd.h): bytes, blocks, requests, failures by reason and a
// histogram of seconds per transfer with fixed buckets.
#include <string.h>

#include "core.h"
#include "metrics.h"
#include "pd.h"

int tdm_pd_metrics_register(struct tdm_pd_metrics *m, struct tdm_metrics_registry *reg,
                            const struct tdm_pd_metric_names *names, char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    struct tdm_metrics_opts o;
    memset(&o, 0, sizeof o);
    o.name = names->bytes.name;
    o.help = names->bytes.help;
    int rc = tdm_metrics_counter_register(&m->bytes, reg, &o, err, errlen);
    o.name = names->blocks.name;
    o.help = names->blocks.help;
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&m->blocks, reg, &o, err, errlen);
    o.name = names->requests.name;
    o.help = names->requests.help;
    o.label_names = names->requests_label ? &names->requests_label : NULL;
    o.n_label_names = names->requests_label ? 1 : 0;
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&m->requests, reg, &o, err, errlen);
    static const char *const reason[] = {"reason"};
    o.name = names->failures.name;
    o.help = names->failures.help;
    o.label_names = reason;
    o.n_label_names = 1;
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&m->failures, reg, &o, err, errlen);
    o.label_names = NULL;
    o.n_label_names = 0;
    static const double bounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                    0.1,    0.25,  0.5,    1,     2.5,  5,     10};
    o.name = names->seconds.name;
    o.help = names->seconds.help;
    if (rc == TDM_OK)
        rc = tdm_metrics_histogram_register(&m->seconds, reg, &o, bounds,
                                            sizeof bounds / sizeof bounds[0], err, errlen);
    return rc;
}

void tdm_pd_metrics_fail(const struct tdm_pd_metrics *m, const char *reason)
{
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(m->failures, reason));
}
