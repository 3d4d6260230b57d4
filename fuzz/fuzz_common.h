// SPDX-License-Identifier: Apache-2.0
// Shared setup of the fuzzers: the tokenizer folder they load once. The real
// Qwen2.5 tokenizer in ../shared/models when present (the vocabulary and chat
// template production serves), else a small byte-level BPE written by
// tandem-mkmodel's library into a temporary folder. TANDEM_FUZZ_VOCAB=small
// picks the small one even where the real one exists: the grammar fuzzer
// fills a mask over every token per step (~6 ms an input with 151 643
// tokens), so long runs that aim at an exec count use it (docs/testing.md).
#ifndef TDM_FUZZ_COMMON_H
#define TDM_FUZZ_COMMON_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mkmodel.h"
#include "tokenizer.h"

static inline struct tdm_tokenizer *fuzz_tokenizer(void)
{
    char err[256];
    struct tdm_tokenizer *tok = NULL;
    const char *shared = TANDEM_SHARED_DIR "/models/qwen2-tokenizer";
    const char *pick = getenv("TANDEM_FUZZ_VOCAB");
    bool small = pick && strcmp(pick, "small") == 0;
    if (!small && access(shared, R_OK) == 0 && tdm_tok_load(&tok, shared, err, sizeof err) == 0)
        return tok;
    static char dir[] = "/tmp/tandem-fuzz-tok-XXXXXX";
    if (!mkdtemp(dir) || tdm_mkmodel_write_tokenizer(2048, dir, err, sizeof err) != 0 ||
        tdm_tok_load(&tok, dir, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz: cannot make a tokenizer: %s\n", err);
        abort();
    }
    return tok;
}

#endif
