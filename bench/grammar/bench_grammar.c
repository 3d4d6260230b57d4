// SPDX-License-Identifier: Apache-2.0
// tandem-bench-grammar: what structured outputs cost on one core, on the real
// Qwen2 vocabulary (151 643 ordinary tokens):
//   - building the vocabulary trie (once per tokenizer);
//   - compiling a 50-property JSON Schema (goal: under 50 ms), as a ratio;
//   - the token mask per decode step at batch 1 for a nested schema, along
//     random walks that pick a random allowed token each step: all steps, the
//     steps the per-state cache served, and the steps that walked the trie.
// A decode step of the Qwen2.5-0.5B shape is not measured here (see
// tandem-bench-engine); the mask figures are absolute microseconds.
//   tandem-bench-grammar [TOKENIZER_DIR]  (default ../shared/models/qwen2-tokenizer)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar.h"
#include "tokenizer.h"

#define COMPILE_GOAL_MS 50.0

static const char nested_schema[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"id\":{\"type\":\"integer\"},"
    "\"name\":{\"type\":\"string\",\"maxLength\":40},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\"},"
    "\"address\":{\"type\":\"object\",\"properties\":{"
    "\"street\":{\"type\":\"string\"},\"city\":{\"type\":\"string\"},"
    "\"zip\":{\"type\":\"string\",\"pattern\":\"[0-9]{5}\"},"
    "\"geo\":{\"type\":\"object\",\"properties\":{\"lat\":{\"type\":\"number\"},"
    "\"lon\":{\"type\":\"number\"}},\"required\":[\"lat\",\"lon\"]}},"
    "\"required\":[\"street\",\"city\",\"zip\",\"geo\"]},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":12},\"maxItems\":5},"
    "\"orders\":{\"type\":\"array\",\"maxItems\":3,\"items\":{\"type\":\"object\",\"properties\":{"
    "\"sku\":{\"type\":\"string\"},\"qty\":{\"type\":\"integer\"},"
    "\"status\":{\"enum\":[\"new\",\"paid\",\"shipped\"]}},\"required\":[\"sku\",\"qty\","
    "\"status\"]}},"
    "\"active\":{\"type\":\"boolean\"}},"
    "\"required\":[\"id\",\"name\",\"email\",\"address\",\"tags\",\"orders\",\"active\"]}";

static char *fifty_property_schema(void)
{
    static const char *const types[] = {
        "{\"type\":\"string\"}",
        "{\"type\":\"integer\"}",
        "{\"type\":\"number\"}",
        "{\"type\":\"boolean\"}",
        "{\"type\":\"array\",\"items\":{\"type\":\"string\"}}",
        "{\"type\":\"string\",\"format\":\"date-time\"}",
        "{\"enum\":[\"red\",\"green\",\"blue\"]}",
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"},\"b\":{\"type\":"
        "\"number\"}},\"required\":[\"a\"]}",
        "{\"type\":\"string\",\"pattern\":\"[A-Z]{3}-[0-9]{4}\"}",
        "{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}"};
    size_t cap = 1 << 16, n = 0;
    char *s = malloc(cap);
    n += (size_t)snprintf(s + n, cap - n, "{\"type\":\"object\",\"properties\":{");
    for (int i = 0; i < 50; i++)
        n +=
            (size_t)snprintf(s + n, cap - n, "%s\"field_%02d\":%s", i ? "," : "", i, types[i % 10]);
    n += (size_t)snprintf(s + n, cap - n, "},\"required\":[");
    for (int i = 0; i < 50; i += 2)
        n += (size_t)snprintf(s + n, cap - n, "%s\"field_%02d\"", i ? "," : "", i);
    snprintf(s + n, cap - n, "]}");
    return s;
}

// A document the nested schema accepts, as a model would write it.
static const char nested_doc[] =
    "{\"id\": 1042, \"name\": \"Ada Lovelace\", \"email\": \"ada@example.org\", "
    "\"address\": {\"street\": \"12 St James's Square\", \"city\": \"London\", "
    "\"zip\": \"10001\", \"geo\": {\"lat\": 51.5074, \"lon\": -0.1278}}, "
    "\"tags\": [\"math\", \"poetry\", \"engines\"], "
    "\"orders\": [{\"sku\": \"AE-1843\", \"qty\": 2, \"status\": \"shipped\"}, "
    "{\"sku\": \"NOTE-G\", \"qty\": 1, \"status\": \"paid\"}], \"active\": true}";

// Five plain string fields (a string array among them): their masks share one
// relative result.
static const char strings_schema[] =
    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"},\"b\":{\"type\":"
    "\"string\"},\"c\":{\"type\":\"string\"},\"d\":{\"type\":\"string\"},\"e\":{\"type\":"
    "\"array\",\"items\":{\"type\":\"string\"}}},\"required\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}";
static const char strings_doc[] =
    "{\"a\": \"Ada Lovelace\", \"b\": \"London\", \"c\": \"United Kingdom\", \"d\": "
    "\"mathematician\", \"e\": [\"x\", \"poetry\", \"analytical engine\"]}";

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// Teacher-forced: the tokens of a real document, a fresh matcher per pass;
// each token must be in its step's mask. Prints passes 1 and 3.
static int teacher_forced(struct tdm_tokenizer *tok, const struct tdm_grammar_vocab *v,
                          struct tdm_grammar *g, const char *doc, const char *label)
{
    size_t words = tdm_grammar_mask_words(v);
    uint32_t *mask = malloc(words * sizeof *mask);
    int32_t *ids;
    size_t n_ids;
    tdm_tok_encode(tok, doc, strlen(doc), false, &ids, &n_ids);
    double *t = malloc((n_ids + 1) * sizeof *t);
    for (int pass = 0; pass < 3; pass++) {
        struct tdm_grammar_matcher *m;
        tdm_grammar_matcher_new(&m, g, v);
        double sum = 0;
        for (size_t i = 0; i <= n_ids; i++) {
            double a = tdm_now();
            tdm_grammar_matcher_fill_mask(m, mask, words);
            t[i] = (tdm_now() - a) * 1e6;
            sum += t[i];
            int32_t id = i < n_ids ? ids[i] : tdm_grammar_vocab_eos_id(v);
            if (!(mask[id >> 5] >> (id & 31) & 1u) || tdm_grammar_matcher_accept_token(m, id)) {
                fprintf(stderr, "tandem-bench-grammar: %s: token %zu not allowed\n", label, i);
                return 1;
            }
        }
        qsort(t, n_ids + 1, sizeof *t, cmp_double);
        if (pass == 0 || pass == 2)
            printf("mask, %s, batch 1, a %zu-token document + EOS (fresh matcher, pass %d):\n"
                   "  mean %8.1f us  p50 %8.1f us  p99 %8.1f us  max %8.1f us  "
                   "(batch 8 on one thread: %.2f ms/step)\n",
                   label, n_ids, pass + 1, sum / (double)(n_ids + 1), t[(n_ids + 1) / 2],
                   t[((n_ids + 1) * 99) / 100], t[n_ids], 8 * sum / (double)(n_ids + 1) / 1e3);
        tdm_grammar_matcher_free(m);
    }
    free(t);
    free(ids);
    free(mask);
    return 0;
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : TANDEM_SHARED_DIR "/models/qwen2-tokenizer";
    char err[256];
    struct tdm_tokenizer *tok;
    if (tdm_tok_load(&tok, dir, err, sizeof err)) {
        fprintf(stderr, "tandem-bench-grammar: %s\n", err);
        return 1;
    }
    double t0 = tdm_now();
    struct tdm_grammar_vocab *v;
    if (tdm_grammar_vocab_from_tokenizer(&v, tok, -1, err, sizeof err)) {
        fprintf(stderr, "tandem-bench-grammar: %s\n", err);
        return 1;
    }
    printf("vocab trie: %d tokens built in %.1f ms (once per tokenizer)\n",
           tdm_grammar_vocab_size(v), (tdm_now() - t0) * 1e3);

    char *fifty = fifty_property_schema();
    struct tdm_grammar *g = NULL;
    int reps = 20;
    t0 = tdm_now();
    for (int i = 0; i < reps; i++) {
        tdm_grammar_unref(g);
        if (tdm_grammar_compile_json_schema(&g, fifty, strlen(fifty), err, sizeof err)) {
            fprintf(stderr, "tandem-bench-grammar: 50-property schema: %s\n", err);
            return 1;
        }
    }
    double compile_ms = (tdm_now() - t0) * 1e3 / reps;
    printf("compile 50-property schema (%zu bytes): %.3f ms  goal %.0f ms  ratio %.3f (%s)\n",
           strlen(fifty), compile_ms, COMPILE_GOAL_MS, compile_ms / COMPILE_GOAL_MS,
           compile_ms < COMPILE_GOAL_MS ? "met" : "MISSED");
    tdm_grammar_unref(g);
    free(fifty);

    if (tdm_grammar_compile_json_schema(&g, nested_schema, strlen(nested_schema), err,
                                        sizeof err)) {
        fprintf(stderr, "tandem-bench-grammar: nested schema: %s\n", err);
        return 1;
    }
    struct tdm_grammar *strings = NULL;
    if (tdm_grammar_compile_json_schema(&strings, strings_schema, strlen(strings_schema), err,
                                        sizeof err)) {
        fprintf(stderr, "tandem-bench-grammar: strings schema: %s\n", err);
        return 1;
    }
    size_t words = tdm_grammar_mask_words(v);
    uint32_t *mask = malloc(words * sizeof *mask);

    if (teacher_forced(tok, v, g, nested_doc, "nested schema") ||
        teacher_forced(tok, v, strings, strings_doc, "plain-string schema"))
        return 1;
    int32_t n = tdm_grammar_vocab_size(v), eos = tdm_grammar_vocab_eos_id(v);
    enum { MAX_STEPS = 1 << 16 };
    double *all = malloc(MAX_STEPS * sizeof *all);
    double sum_hit = 0, sum_miss = 0, sum_all = 0;
    long n_hit = 0, n_miss = 0, steps = 0, done_walks = 0;
    unsigned seed = 7;
    for (int w = 0; w < 5; w++) {
        struct tdm_grammar_matcher *m;
        tdm_grammar_matcher_new(&m, g, v);
        for (int s = 0; s < 600 && !tdm_grammar_matcher_is_done(m) && steps < MAX_STEPS; s++) {
            uint64_t h0, m0, h1, m1;
            tdm_grammar_matcher_cache_stats(m, &h0, &m0);
            double a = tdm_now();
            tdm_grammar_matcher_fill_mask(m, mask, words);
            double dt = (tdm_now() - a) * 1e6;
            tdm_grammar_matcher_cache_stats(m, &h1, &m1);
            all[steps++] = dt;
            sum_all += dt;
            if (h1 > h0)
                sum_hit += dt, n_hit++;
            else
                sum_miss += dt, n_miss++;
            // Random allowed token; EOS as soon as allowed; a closing quote or
            // bracket is taken when allowed one step in four, so walks finish.
            int32_t count = 0, pick = -1;
            if (eos >= 0 && (mask[eos >> 5] >> (eos & 31) & 1u)) {
                pick = eos;
            } else {
                for (int32_t id = 0; id < n; id++)
                    count += mask[id >> 5] >> (id & 31) & 1u;
                int32_t k = (int32_t)(rand_r(&seed) % (unsigned)(count ? count : 1));
                for (int32_t id = 0; id < n && pick < 0; id++)
                    if ((mask[id >> 5] >> (id & 31) & 1u) && k-- == 0)
                        pick = id;
                if (rand_r(&seed) % 4 == 0) {
                    const char *closers[] = {"\"", "\",", "]", "}", "\"}", "\"]"};
                    for (size_t c = 0; c < 6; c++) {
                        int32_t id = tdm_tok_piece_to_id(tok, closers[c]);
                        if (id >= 0 && (mask[id >> 5] >> (id & 31) & 1u)) {
                            pick = id;
                            break;
                        }
                    }
                }
            }
            if (pick < 0 || tdm_grammar_matcher_accept_token(m, pick))
                break;
            if (pick == eos) {
                done_walks++;
                break;
            }
        }
        tdm_grammar_matcher_free(m);
    }
    qsort(all, (size_t)steps, sizeof *all, cmp_double);
    printf("mask, nested schema, batch 1, %ld steps over 5 random walks (%ld ended by EOS):\n",
           steps, done_walks);
    printf("  all steps   mean %8.1f us  p50 %8.1f us  p99 %8.1f us  max %8.1f us\n",
           sum_all / (double)steps, all[steps / 2], all[(steps * 99) / 100], all[steps - 1]);
    printf("  cache hits  %5ld steps (%4.1f%%)  mean %8.1f us\n", n_hit,
           100.0 * (double)n_hit / (double)steps, n_hit ? sum_hit / (double)n_hit : 0);
    printf("  trie walks  %5ld steps (%4.1f%%)  mean %8.1f us\n", n_miss,
           100.0 * (double)n_miss / (double)steps, n_miss ? sum_miss / (double)n_miss : 0);
    free(all);
    free(mask);
    tdm_grammar_unref(strings);
    tdm_grammar_unref(g);
    tdm_grammar_vocab_free(v);
    tdm_tok_free(tok);
    return 0;
}
