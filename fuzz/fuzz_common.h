// SPDX-License-Identifier: Apache-2.0
// Shared setup of the fuzzers: the tokenizer folder they load once. The real
// Qwen2.5 tokenizer in ../shared/models when present (the vocabulary and chat
// template production serves), else a small byte-level BPE written by
// tandem-mkmodel's library into a temporary folder.
#ifndef TDM_FUZZ_COMMON_H
#define TDM_FUZZ_COMMON_H

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
    if (access(shared, R_OK) == 0 && tdm_tok_load(&tok, shared, err, sizeof err) == 0)
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
