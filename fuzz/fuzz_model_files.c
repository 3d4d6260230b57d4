// SPDX-License-Identifier: Apache-2.0
// Fuzzes the model-folder readers a downloaded (untrusted) checkpoint reaches:
// config.json and generation_config.json parsing, and the safetensors header
// (lengths, offsets, shapes, dtypes, overlaps) through tdm_st_open on a file
// holding the input. The first byte picks which.
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fuzz_stack.h"
#include "hf.h"

static char path[64];

static int fuzz_one(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    char err[256];
    switch (data[0] % 3) {
    case 0: {
        struct tdm_model_config cfg;
        (void)tdm_hf_config_parse(&cfg, body, len, err, sizeof err);
        break;
    }
    case 1: {
        struct tdm_generation_config gen;
        (void)tdm_hf_generation_config_parse(&gen, body, len, err, sizeof err);
        break;
    }
    default: {
        if (!path[0])
            snprintf(path, sizeof path, "/tmp/tandem-fuzz-st-%d.safetensors", (int)getpid());
        FILE *f = fopen(path, "wb");
        if (!f)
            abort();
        if (len && fwrite(body, 1, len, f) != len)
            abort();
        fclose(f);
        struct tdm_safetensors *st = NULL;
        if (tdm_st_open(&st, path, err, sizeof err) == 0) {
            // Touch every tensor's first and last byte: offsets must be inside the file.
            volatile uint8_t sink = 0;
            for (size_t i = 0; i < tdm_st_count(st); i++) {
                const struct tdm_tensor *t = tdm_st_at(st, i);
                if (t->nbytes) {
                    sink ^= ((const uint8_t *)t->data)[0];
                    sink ^= ((const uint8_t *)t->data)[t->nbytes - 1];
                }
            }
            (void)sink;
            tdm_st_free(st);
        }
        break;
    }
    }
    return 0;
}

TDM_FUZZ_ON_HTTP_STACK(fuzz_one)
