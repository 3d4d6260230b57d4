// SPDX-License-Identifier: Apache-2.0
// Fuzzes the tokenizer with the real Qwen2.5 vocabulary: arbitrary bytes
// (invalid UTF-8 included) through encode with each flag combination, the ids
// back through decode and the streaming detokenizer (whose deltas must add up
// to decode's text), and the input read as raw ids (out-of-vocabulary ones
// must be refused, not read).
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_stack.h"
#include "fuzz_common.h"

static struct tdm_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    tok = fuzz_tokenizer();
    return 0;
}

static void check_stream(const int32_t *ids, size_t n, bool skip)
{
    char *text = NULL;
    size_t len = 0;
    if (tdm_tok_decode(tok, ids, n, skip, &text, &len) != 0)
        return;
    struct tdm_detok *d = NULL;
    if (tdm_detok_new(&d, tok, skip) != 0) {
        free(text);
        return;
    }
    char *acc = malloc(len + 8);
    size_t at = 0;
    bool ok = acc != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        const char *delta;
        size_t dl;
        ok = tdm_detok_push(d, ids[i], &delta, &dl) == 0 && at + dl <= len;
        if (ok) {
            memcpy(acc + at, delta, dl);
            at += dl;
        }
    }
    const char *delta;
    size_t dl;
    if (ok && tdm_detok_flush(d, &delta, &dl) == 0 && at + dl <= len) {
        memcpy(acc + at, delta, dl);
        at += dl;
        if (at != len || memcmp(acc, text, len) != 0)
            abort(); // the streamed deltas must equal decode's text
    } else if (ok) {
        abort();
    }
    free(acc);
    tdm_detok_free(d);
    free(text);
}

static int fuzz_one(const uint8_t *data, size_t size)
{
    for (unsigned flags = 0; flags < 4; flags++) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (tdm_tok_encode_ex(tok, (const char *)data, size, flags, &ids, &n) == 0) {
            check_stream(ids, n, flags & 1);
            free(ids);
        }
    }
    size_t n = size / 4;
    int32_t *raw = malloc(n * sizeof *raw + 1);
    if (raw) {
        memcpy(raw, data, n * sizeof *raw);
        int vocab = tdm_tok_vocab_size(tok);
        // Half the time fold into the vocabulary so decode gets past its id check.
        if (size && (data[0] & 1))
            for (size_t i = 0; i < n; i++)
                raw[i] = (int32_t)((uint32_t)raw[i] % (uint32_t)vocab);
        check_stream(raw, n, size && (data[0] & 2));
        free(raw);
    }
    return 0;
}

TDM_FUZZ_ON_HTTP_STACK(fuzz_one)
