// SPDX-License-Identifier: Apache-2.0
// tandem-gpu-report: prints bench/gpu/check.sh's summary from the JSON files
// its steps wrote (gpu_report.h has the ratios and goals).
//   tandem-gpu-report --probe FILE [--engine FILE] [--pd FILE]
// A missing --engine or --pd is reported as "not measured". Exit 0 when the
// files parse (goals missed are in the text, so a slow GPU still gets its
// summary), 2 for bad usage or a file that does not parse.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "gpu_report.h"

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
    const char *probe_path = NULL, *engine_path = NULL, *pd_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--probe") == 0 && i + 1 < argc)
            probe_path = argv[++i];
        else if (strcmp(argv[i], "--engine") == 0 && i + 1 < argc)
            engine_path = argv[++i];
        else if (strcmp(argv[i], "--pd") == 0 && i + 1 < argc)
            pd_path = argv[++i];
        else {
            fprintf(stderr, "usage: tandem-gpu-report --probe FILE [--engine FILE] [--pd FILE]\n");
            return 2;
        }
    }
    if (probe_path == NULL) {
        fprintf(stderr, "tandem-gpu-report: --probe is required\n");
        return 2;
    }
    char err[256], *text = NULL;
    struct tdm_gpu_probe probe;
    struct tdm_gpu_engine engine;
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
    if (engine_path != NULL) {
        if (load(engine_path, &text) != 0)
            return 2;
        rc = tdm_gpu_report_parse_engine(&engine, text, err, sizeof err);
        free(text);
        if (rc != TDM_OK) {
            fprintf(stderr, "tandem-gpu-report: %s: %s\n", engine_path, err);
            return 2;
        }
        have_engine = true;
    }
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
    return 0;
}
