// SPDX-License-Identifier: Apache-2.0
// tandem-download: fetches a Hugging Face model into the huggingface_hub cache
// (or finds it there) and prints the local snapshot folder on stdout, so
// scripts can write `dir=$(tandem-download Qwen/Qwen2.5-0.5B-Instruct)`.
// Progress and errors go to stderr; exit status 0 only when the folder holds
// every file the engine needs.
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "hub.h"

struct download_args {
    const char *revision;
    struct tdm_hub_opts hub;
};

static int set_quiet(void *o, const char *v, char *err, size_t errlen)
{
    (void)v;
    (void)err;
    (void)errlen;
    ((struct download_args *)o)->hub.progress = TDM_HUB_PROGRESS_QUIET;
    return TDM_OK;
}

#define OFF(field) offsetof(struct download_args, field)
static const struct tdm_flag download_flags[] = {
    {.name = "revision",
     .kind = TDM_FLAG_PTR,
     .offset = OFF(revision),
     .metavar = "R",
     .help = "branch, tag or commit (default main)"},
    {.name = "cache-dir",
     .kind = TDM_FLAG_PTR,
     .offset = OFF(hub.cache_dir),
     .metavar = "D",
     .help = "hub cache folder (default $HF_HUB_CACHE, else $HF_HOME/hub,\nelse "
             "~/.cache/huggingface/hub)"},
    {.name = "offline",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(hub.offline),
     .help = "use the cache only (as HF_HUB_OFFLINE=1)"},
    {.name = "quiet",
     .kind = TDM_FLAG_FN,
     .fn = set_quiet,
     .no_value = true,
     .help = "no progress output"},
};
static const struct tdm_flags download_table = {
    .usage = "usage: tandem-download MODEL_ID [--revision R] [--cache-dir D] [--offline] "
             "[--quiet]\n"
             "  MODEL_ID                      ORG/NAME on the Hugging Face Hub (or an existing "
             "folder)\n",
    .flags = download_flags,
    .n = sizeof download_flags / sizeof download_flags[0],
    .footer = "Environment: HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE.\n"
              "Prints the snapshot folder on stdout.\n",
};

int main(int argc, char **argv)
{
    struct download_args a = {0};
    tdm_log_set_role("download");
    char *rest[1];
    int n_rest = 0, exit_code = 0;
    if (tdm_flags_main(&download_table, &a, argc, argv, rest, 1, &n_rest, "tandem-download",
                       &exit_code))
        return exit_code;
    if (n_rest == 0) {
        fprintf(stderr, "tandem-download: MODEL_ID is required (see --help)\n");
        return 2;
    }
    const char *model = rest[0], *revision = a.revision;
    struct tdm_hub_opts opts = a.hub;
    char path[4096], err[1024];
    int rc = tdm_hub_resolve_model(model, revision, &opts, path, sizeof path, err, sizeof err);
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem-download: %s: %s\n", tdm_strerror(rc), err);
        return 1;
    }
    printf("%s\n", path);
    return 0;
}
