// SPDX-License-Identifier: Apache-2.0
// tandem-gpu-report: prints bench/gpu/check.sh's summary from the JSON files
// its steps wrote (gpu_report.h has the ratios and goals).
//   tandem-gpu-report --probe FILE [--engine FILE] [--engine-fast FILE] [--pd FILE]
// A missing --engine or --pd is reported as "not measured". --engine-fast is
// the engine bench run with --no-batch-invariant: with it (and --engine, a
// batch-invariant run) the summary ends with the cost of batch invariance and
// issue 26 item 3's rule for the default. Exit 0 when the files parse (goals
// missed are in the text, so a slow GPU still gets its summary), 2 for bad
// usage, a file that does not parse, or engine runs of the wrong mode.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "gpu_report.h"

// An engine document at path into e; its batch_invariant must not be
// `wrong` (0 or 1). 0, or -1 with the reason on stderr.
static int load_engine(const char *path, struct tdm_gpu_engine *e, int wrong)
{
    char err[256], *text = NULL;
    size_t len;
    if (tdm_read_file(path, &text, &len, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-gpu-report: %s\n", err);
        return -1;
    }
    int rc = tdm_gpu_report_parse_engine(e, text, err, sizeof err);
    free(text);
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem-gpu-report: %s: %s\n", path, err);
        return -1;
    }
    if (e->batch_invariant == wrong) {
        fprintf(stderr, "tandem-gpu-report: %s: batch_invariant is %s, expected %s\n", path,
                wrong ? "true" : "false", wrong ? "false" : "true");
        return -1;
    }
    return 0;
}

static int load(const char *path, char **text)
{
    char err[256];
    size_t len;
    if (tdm_read_file(path, text, &len, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-gpu-report: %s\n", err);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *probe_path = NULL, *engine_path = NULL, *fast_path = NULL, *pd_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--probe") == 0 && i + 1 < argc)
            probe_path = argv[++i];
        else if (strcmp(argv[i], "--engine") == 0 && i + 1 < argc)
            engine_path = argv[++i];
        else if (strcmp(argv[i], "--engine-fast") == 0 && i + 1 < argc)
            fast_path = argv[++i];
        else if (strcmp(argv[i], "--pd") == 0 && i + 1 < argc)
            pd_path = argv[++i];
        else {
            fprintf(stderr, "usage: tandem-gpu-report --probe FILE [--engine FILE] "
                            "[--engine-fast FILE] [--pd FILE]\n");
            return 2;
        }
    }
    if (probe_path == NULL) {
        fprintf(stderr, "tandem-gpu-report: --probe is required\n");
        return 2;
    }
    char err[256], *text = NULL;
    struct tdm_gpu_probe probe;
    struct tdm_gpu_engine engine, fast;
    struct tdm_gpu_pd pd;
    bool have_engine = false, have_pd = false;
    if (load(probe_path, &text) != 0)
        return 2;
    int rc = tdm_gpu_report_parse_probe(&probe, text, err, sizeof err);
    free(text);
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem-gpu-report: %s: %s\n", probe_path, err);
        return 2;
    }
    // With --engine-fast, --engine is the batch-invariant run (without it,
    // whichever mode the bench ran in).
    if (engine_path != NULL) {
        if (load_engine(engine_path, &engine, fast_path != NULL ? 0 : 2) != 0)
            return 2;
        have_engine = true;
    }
    if (fast_path != NULL && load_engine(fast_path, &fast, 1) != 0)
        return 2;
    if (pd_path != NULL) {
        if (load(pd_path, &text) != 0)
            return 2;
        rc = tdm_gpu_report_parse_pd(&pd, text, err, sizeof err);
        free(text);
        if (rc != TDM_OK) {
            fprintf(stderr, "tandem-gpu-report: %s: %s\n", pd_path, err);
            return 2;
        }
        have_pd = true;
    }
    static char summary[16384];
    tdm_gpu_report_format(&probe, have_engine ? &engine : NULL, have_pd ? &pd : NULL, summary,
                          sizeof summary);
    fputs(summary, stdout);
    if (fast_path != NULL) {
        tdm_gpu_report_format_invariance(have_engine ? &engine : NULL, &fast, summary,
                                         sizeof summary);
        fputs(summary, stdout);
    }
    return 0;
}
