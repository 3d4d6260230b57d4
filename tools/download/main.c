// SPDX-License-Identifier: Apache-2.0
// tandem-download: fetches a Hugging Face model into the huggingface_hub cache
// (or finds it there) and prints the local snapshot folder on stdout, so
// scripts can write `dir=$(tandem-download Qwen/Qwen2.5-0.5B-Instruct)`.
// Progress and errors go to stderr; exit status 0 only when the folder holds
// every file the engine needs.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "hub.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: tandem-download MODEL_ID [--revision R] [--cache-dir D] [--offline] "
               "[--quiet]\n"
               "  MODEL_ID     ORG/NAME on the Hugging Face Hub (or an existing folder)\n"
               "  --revision   branch, tag or commit (default main)\n"
               "  --cache-dir  hub cache folder (default $HF_HUB_CACHE, else $HF_HOME/hub,\n"
               "               else ~/.cache/huggingface/hub)\n"
               "  --offline    use the cache only (as HF_HUB_OFFLINE=1)\n"
               "  --quiet      no progress output\n"
               "Environment: HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE.\n"
               "Prints the snapshot folder on stdout.\n");
}

int main(int argc, char **argv)
{
    const char *model = NULL, *revision = NULL;
    struct tdm_hub_opts opts = {0};
    tdm_log_set_role("download");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--revision") == 0 && i + 1 < argc) {
            revision = argv[++i];
        } else if (strcmp(a, "--cache-dir") == 0 && i + 1 < argc) {
            opts.cache_dir = argv[++i];
        } else if (strcmp(a, "--offline") == 0) {
            opts.offline = true;
        } else if (strcmp(a, "--quiet") == 0) {
            opts.progress = TDM_HUB_PROGRESS_QUIET;
        } else if (a[0] == '-' && a[1] == '-') {
            fprintf(stderr, "tandem-download: unknown or incomplete option %s\n", a);
            usage(stderr);
            return 2;
        } else if (!model) {
            model = a;
        } else {
            fprintf(stderr, "tandem-download: one MODEL_ID only (got %s and %s)\n", model, a);
            return 2;
        }
    }
    if (!model) {
        usage(stderr);
        return 2;
    }
    char path[4096], err[1024];
    int rc = tdm_hub_resolve_model(model, revision, &opts, path, sizeof path, err, sizeof err);
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem-download: %s: %s\n", tdm_strerror(rc), err);
        return 1;
    }
    printf("%s\n", path);
    return 0;
}
