// SPDX-License-Identifier: Apache-2.0
// Fuzzes the grammar compilers and matcher: the first byte picks JSON Schema,
// regex, GBNF or a choice list (the rest split at NUL bytes), the rest is the
// text. A grammar that compiles is driven through a few probe strings and a
// few steps of masks: every token a mask allows must then be accepted (or
// refused as too ambiguous to follow, TDM_ECAPACITY, which ends a request with
// that error), and EOS must be in the mask exactly when the matcher accepts.
// Each fill gets a sixteenth of the engine's work budget: the same code
// refuses an ambiguous grammar (TDM_ECAPACITY) after 250 k units instead of
// 4 M, which under ASan and the coverage hooks is ~0.9 s instead of ~4.4 s a
// time (fuzzing found whole families of such inputs and spent most of its
// time on them).
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_stack.h"
#include "fuzz_common.h"
#include "grammar.h"
#include "grammar_impl.h" // fill_budget

static struct tdm_tokenizer *tok;
static struct tdm_grammar_vocab *vocab;
static uint32_t *mask;

int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char err[256];
    tok = fuzz_tokenizer();
    if (tdm_grammar_vocab_from_tokenizer(&vocab, tok, -1, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_grammar: %s\n", err);
        abort();
    }
    mask = calloc(tdm_grammar_mask_words(vocab), sizeof *mask);
    return 0;
}

static struct tdm_grammar *compile(const uint8_t *data, size_t size)
{
    char err[256];
    struct tdm_grammar *g = NULL;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    switch (data[0] % 5) {
    case 0:
        tdm_grammar_compile_json_schema(&g, text, len, err, sizeof err);
        break;
    case 1:
        tdm_grammar_compile_regex(&g, text, len, err, sizeof err);
        break;
    case 2:
        tdm_grammar_compile_gbnf(&g, text, len, err, sizeof err);
        break;
    case 3:
        tdm_grammar_compile_json_object(&g, err, sizeof err);
        break;
    default: {
        const char *choices[16];
        size_t lens[16], n = 0, at = 0;
        while (at <= len && n < 16) {
            const char *z = memchr(text + at, 0, len - at);
            size_t l = z ? (size_t)(z - (text + at)) : len - at;
            choices[n] = text + at;
            lens[n++] = l;
            at += l + 1;
        }
        tdm_grammar_compile_choice(&g, choices, lens, n, err, sizeof err);
    }
    }
    return g;
}

// The matcher's part runs where the engine runs it, on a deep stack (its
// expansion recurses per rule reference, within a bound proven there).
static void match(void *arg)
{
    struct tdm_grammar *g = arg;
    static const char *const probes[] = {"", "{", "{\"a\":1}", "a", "abc", "[1,2]", "\"x\"", "0"};
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++) {
        struct tdm_grammar_matcher *m;
        if (tdm_grammar_matcher_new(&m, g, NULL) != 0)
            continue;
        tdm_grammar_matcher_accept_bytes(m, probes[i], strlen(probes[i]));
        tdm_grammar_matcher_accepts_eos(m);
        tdm_grammar_matcher_is_done(m);
        tdm_grammar_matcher_free(m);
    }
    struct tdm_grammar_matcher *m;
    if (tdm_grammar_matcher_new(&m, g, vocab) == 0) {
        m->fill_budget = GR_FILL_MAX_WORK / 16;
        int32_t n = tdm_grammar_vocab_size(vocab), eos = tdm_grammar_vocab_eos_id(vocab);
        for (int step = 0; step < 3 && !tdm_grammar_matcher_is_done(m); step++) {
            if (tdm_grammar_matcher_fill_mask(m, mask, tdm_grammar_mask_words(vocab)) != 0)
                break;
            if (eos >= 0 &&
                (bool)((mask[eos >> 5] >> (eos & 31)) & 1u) != tdm_grammar_matcher_accepts_eos(m))
                abort();
            int32_t pick = -1;
            for (int32_t id = 0; id < n; id++)
                if ((mask[id >> 5] >> (id & 31)) & 1u) {
                    pick = id;
                    if ((unsigned)id % 7 == (unsigned)step)
                        break;
                }
            if (pick < 0)
                break;
            int arc = tdm_grammar_matcher_accept_token(m, pick);
            if (arc == TDM_ECAPACITY)
                break; // too ambiguous to follow: the request would end with that error
            if (arc != 0)
                abort(); // the mask allowed a token the matcher refuses
        }
        tdm_grammar_matcher_free(m);
    }
}

static int fuzz_one(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    struct tdm_grammar *g = compile(data, size);
    if (!g)
        return 0;
    if (tdm_call_deep(match, g) != TDM_OK)
        abort();
    tdm_grammar_unref(g);
    return 0;
}

TDM_FUZZ_ON_HTTP_STACK(fuzz_one)
