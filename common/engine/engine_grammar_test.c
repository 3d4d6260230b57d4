// SPDX-License-Identifier: Apache-2.0
// Structured outputs through the engine, on a tiny random model written by
// mkmodel with its own byte-level tokenizer: constrained requests (a nested
// JSON Schema with arrays, an enum and a nested object; a regex; a choice; any
// JSON object) sampled at temperature 1 from random weights always produce
// output that parses and validates (grammar_validate, independent of the
// grammar engine), batched (one matcher per sequence), finish "stop" when the
// grammar is complete and "length" at max_tokens mid-object; a P/D request
// (PREFILL_ONLY samples the first token under the mask, IMPORT_KV continues)
// gives exactly the tokens of a local one; bad constraints are refused at
// submit; unconstrained requests compute no mask at all.
#include <math.h>
#include <regex.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "core.h"
#include "engine.h"
#include "engine_test_util.h"
#include "test_skip.h"
#include "grammar.h"
#include "grammar_validate.h"
#include "mkmodel.h"
#include "model.h"
#include "tokenizer.h"

#define WAIT_S 120.0
#define MAXT 160 // max_tokens of the validating runs

static char model_dir[64];
static struct tdm_model *model;
static struct tdm_tokenizer *tok;
static struct tdm_grammar_vocab *gvocab;

// Bounded everywhere (a random model repeats a token forever where it may:
// unbounded digits or strings would end at max_tokens, not at the grammar's end).
static const char nested_schema[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"maxLength\":6},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",\"blue\"]},"
    "\"minItems\":1,\"maxItems\":3},"
    "\"pos\":{\"type\":\"object\",\"properties\":{\"x\":{\"enum\":[1,20,300]},"
    "\"ok\":{\"type\":\"boolean\"},\"day\":{\"type\":\"string\",\"format\":\"date\"}},"
    "\"required\":[\"x\",\"ok\"]},"
    "\"kind\":{\"enum\":[\"a\",\"b\",null,3]}},"
    "\"required\":[\"name\",\"tags\",\"pos\",\"kind\"]}";

static int setup(void **state)
{
    (void)state;
    char err[256];
    struct tdm_mkmodel_spec s;
    strcpy(model_dir, "/tmp/tdm_engine_grammarXXXXXX");
    if (mkdtemp(model_dir) == NULL)
        return -1;
    tdm_mkmodel_preset(&s, "tiny");
    s.seed = 23;
    if (tdm_mkmodel_write(&s, model_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    struct tdm_model_opts o;
    tdm_model_opts_default(&o);
    o.num_threads = 1;
    o.max_batch_tokens = 256;
    o.max_batch_seqs = 16;
    if (tdm_model_load(&model, model_dir, &o, err, sizeof err) != TDM_OK ||
        tdm_tok_load(&tok, model_dir, err, sizeof err) != TDM_OK ||
        tdm_grammar_vocab_from_tokenizer(&gvocab, tok, -1, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "load: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_grammar_vocab_free(gvocab);
    tdm_tok_free(tok);
    tdm_model_free(model);
    tdm_mkmodel_remove(model_dir);
    return 0;
}

static int mask_threads; // 0: the engine's default

static struct tdm_engine *engine_make(bool with_vocab)
{
    struct tdm_engine_config c;
    struct tdm_engine *e = NULL;
    char err[256];
    tdm_engine_config_default(&c);
    c.num_blocks = 256;
    c.max_num_batched_tokens = 256;
    c.max_num_seqs = 16;
    c.grammar_vocab = with_vocab ? gvocab : NULL;
    c.mask_threads = mask_threads;
    int rc = tdm_engine_new(&e, model, &c, err, sizeof err);
    if (rc != TDM_OK)
        fprintf(stderr, "engine: %s\n", err);
    assert_int_equal(rc, TDM_OK);
    return e;
}

static void prompt_of(const char *text, int32_t *ids, int *n)
{
    size_t got = 0;
    int32_t *p = NULL;
    assert_int_equal(tdm_tok_encode(tok, text, strlen(text), false, &p, &got), TDM_OK);
    assert_true(got > 0 && got < 64);
    memcpy(ids, p, got * sizeof *ids);
    free(p);
    *n = (int)got;
}

static void constrained(struct tdm_sampling_params *sp, enum tdm_constraint_kind kind,
                        const char *text, uint64_t seed)
{
    tdm_sampling_params_default(sp);
    sp->temperature = 1.0f;
    sp->has_seed = true;
    sp->seed = seed;
    sp->constraint = kind;
    sp->constraint_text = text;
    sp->constraint_len = text ? strlen(text) : 0;
}

struct out {
    int32_t ids[MAXT + 1];
    int n;
    enum tdm_finish reason;
    int32_t stop_token;
    int error;
    char message[160];
};

static void collect(struct tdm_engine_request *r, struct out *o)
{
    struct tdm_engine_chunk ch;
    memset(o, 0, sizeof *o);
    for (;;) {
        assert_int_equal(tdm_engine_stream_next(r, WAIT_S, &ch), TDM_OK);
        for (int i = 0; i < ch.n; i++) {
            assert_true(o->n <= MAXT);
            o->ids[o->n++] = ch.tokens[i];
        }
        if (ch.finished) {
            o->reason = ch.reason;
            o->stop_token = ch.stop_token;
            o->error = ch.error;
            snprintf(o->message, sizeof o->message, "%s", ch.message ? ch.message : "");
            return;
        }
    }
}

// The generated text (special tokens, i.e. a final EOS, skipped). Heap.
static char *text_of(const struct out *o, size_t *len)
{
    char *t = NULL;
    assert_int_equal(tdm_tok_decode(tok, o->ids, (size_t)o->n, true, &t, len), TDM_OK);
    return t;
}

// Runs `count` seeded requests with one constraint as one batch; returns how
// many finished "stop"; calls check on each such output.
static int run_batch(struct tdm_engine *e, enum tdm_constraint_kind kind, const char *text,
                     int count, uint64_t seed0, bool (*check)(const char *, size_t, char *, size_t))
{
    int32_t prompt[64];
    int np;
    prompt_of("Answer in JSON: the colour of", prompt, &np);
    struct tdm_engine_request *r[16];
    assert_true(count <= 16);
    for (int i = 0; i < count; i++) {
        struct tdm_sampling_params sp;
        constrained(&sp, kind, text, seed0 + (uint64_t)i);
        r[i] = tdm_test_submit(e, prompt, np, &sp, MAXT, TDM_ENGINE_REQ_GENERATE);
    }
    int stops = 0;
    for (int i = 0; i < count; i++) {
        struct out o;
        collect(r[i], &o);
        tdm_engine_request_release(r[i]);
        size_t len;
        char *t = text_of(&o, &len);
        if (o.reason == TDM_FINISH_STOP) {
            stops++;
            char why[256] = "";
            if (!check(t, len, why, sizeof why))
                fail_msg("%s %d: output %s (%d tokens) is invalid: %s",
                         tdm_constraint_kind_name(kind), i, t, o.n, why);
        } else {
            // Only the length limit may cut a constrained output short.
            if (o.reason != TDM_FINISH_LENGTH || o.n != MAXT)
                fail_msg("%s %d: finished %s after %d tokens: %s", tdm_constraint_kind_name(kind),
                         i, tdm_finish_name(o.reason), o.n, o.message);
        }
        free(t);
    }
    return stops;
}

static bool check_nested(const char *t, size_t len, char *why, size_t wl)
{
    return tdm_grammar_validate_text(t, len, nested_schema, why, wl);
}

static bool check_object(const char *t, size_t len, char *why, size_t wl)
{
    cJSON *v = cJSON_ParseWithLength(t, len);
    bool ok = cJSON_IsObject(v);
    if (!ok)
        snprintf(why, wl, "not a JSON object");
    cJSON_Delete(v);
    return ok;
}

static const char regex_text[] = "(cat|dog)-[0-9]{2,4}( [a-z]{1,5})?";
static bool check_regex(const char *t, size_t len, char *why, size_t wl)
{
    regex_t re;
    assert_int_equal(regcomp(&re, "^(cat|dog)-[0-9]{2,4}( [a-z]{1,5})?$", REG_EXTENDED | REG_NOSUB),
                     0);
    char *z = strndup(t, len);
    bool ok = regexec(&re, z, 0, NULL, 0) == 0;
    free(z);
    regfree(&re);
    if (!ok)
        snprintf(why, wl, "does not match %s", regex_text);
    return ok;
}

static bool check_choice(const char *t, size_t len, char *why, size_t wl)
{
    static const char *const c[] = {"alpha", "beta", "gamma delta", "\xc3\xa9t\xc3\xa9"};
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
        if (len == strlen(c[i]) && memcmp(t, c[i], len) == 0)
            return true;
    snprintf(why, wl, "not one of the choices");
    return false;
}

// ---- tests -----------------------------------------------------------------------------------
static void test_schema_outputs_validate(void **state)
{
    (void)state;
    // Three mask threads share each step's 8 masks (the default on this host may be 1).
    mask_threads = 3;
    struct tdm_engine *e = engine_make(true);
    mask_threads = 0;
    int stops = run_batch(e, TDM_CONSTRAINT_JSON_SCHEMA, nested_schema, 8, 100, check_nested);
    print_message("nested schema: %d of 8 finished stop (all validate)\n", stops);
    assert_true(stops >= 6);
    struct tdm_engine_stats s;
    tdm_engine_get_stats(e, &s);
    assert_true(s.num_masks > 0);
    print_message("masks %llu, %.1f us each\n", (unsigned long long)s.num_masks,
                  1e6 * s.mask_seconds / (double)s.num_masks);
    tdm_engine_free(e);
}

static void test_regex_choice_object(void **state)
{
    (void)state;
    struct tdm_engine *e = engine_make(true);
    assert_int_equal(run_batch(e, TDM_CONSTRAINT_REGEX, regex_text, 8, 200, check_regex), 8);
    assert_int_equal(run_batch(e, TDM_CONSTRAINT_CHOICE,
                               "[\"alpha\",\"beta\",\"gamma delta\",\"\\u00e9t\\u00e9\"]", 8, 300,
                               check_choice),
                     8);
    int stops = run_batch(e, TDM_CONSTRAINT_JSON_OBJECT, NULL, 6, 400, check_object);
    print_message("json_object: %d of 6 finished stop (all objects)\n", stops);
    assert_true(stops >= 1);
    tdm_engine_free(e);
}

static bool check_gbnf_list(const char *t, size_t len, char *why, size_t wl)
{
    regex_t re;
    assert_int_equal(
        regcomp(&re, "^\\[[1-9][0-9]?(,[1-9][0-9]?)*\\]$", REG_EXTENDED | REG_NOSUB), 0);
    char *z = strndup(t, len);
    bool ok = regexec(&re, z, 0, NULL, 0) == 0;
    free(z);
    regfree(&re);
    if (!ok)
        snprintf(why, wl, "not a list of 1-2 digit numbers");
    return ok;
}

static void test_gbnf(void **state)
{
    (void)state;
    struct tdm_engine *e = engine_make(true);
    const char *gbnf = "root ::= \"[\" num (\",\" num)* \"]\"\nnum ::= [1-9] [0-9]?";
    int stops = run_batch(e, TDM_CONSTRAINT_GRAMMAR, gbnf, 6, 600, check_gbnf_list);
    print_message("gbnf: %d of 6 finished stop\n", stops);
    assert_true(stops >= 3);
    tdm_engine_free(e);
}

// A grammar too ambiguous for one token's mask (fuzz_grammar's regex of
// nested empty alternatives, as in grammar_test: the fill spends
// GR_FILL_MAX_WORK and is refused) ends its own request at its first token
// with an error naming why; an unconstrained request in the same batch runs
// to its length. Before the budget that one mask held the whole batch for
// minutes and the request then sampled unconstrained.
static void test_mask_budget_error(void **state)
{
    (void)state;
    static const char hostile[] =
        "(((y||||||.y....||t.||||.|.|||||.|y||||..|y|||||.||||60.9x9||y||xx!x)*)*||||........|||||"
        ".|||..xxxxxxxxxTTTxx|||..xx...|||TTxT|Td)+||...............{||||.x.";
    struct tdm_engine *e = engine_make(true);
    int32_t prompt[64];
    int np;
    prompt_of("Say something:", prompt, &np);
    struct tdm_sampling_params sp, plain;
    constrained(&sp, TDM_CONSTRAINT_REGEX, hostile, 7);
    sp.constraint_len = sizeof hostile - 1;
    constrained(&plain, TDM_CONSTRAINT_NONE, NULL, 8);
    struct tdm_engine_request *a = tdm_test_submit(e, prompt, np, &sp, 8, TDM_ENGINE_REQ_GENERATE);
    struct tdm_engine_request *b =
        tdm_test_submit(e, prompt, np, &plain, 8, TDM_ENGINE_REQ_GENERATE);
    struct out oa, ob;
    collect(a, &oa);
    collect(b, &ob);
    assert_int_equal(oa.reason, TDM_FINISH_ERROR);
    assert_int_equal(oa.error, TDM_EINVAL); // the request's fault: a 400, not retried
    assert_int_equal(oa.n, 0);
    if (!strstr(oa.message, "too ambiguous"))
        fail_msg("message: %s", oa.message);
    assert_int_equal(ob.reason, TDM_FINISH_LENGTH);
    assert_int_equal(ob.n, 8);
    tdm_engine_request_release(a);
    tdm_engine_request_release(b);
    tdm_engine_free(e);
}

// A resumed stream whose tokens the grammar can follow only with more work
// than one step may take (grammar_test's test_accept_capacity regex, found by
// fuzz_grammar: its fifth NUL byte) is refused at submit as too ambiguous, a
// 400, not as output the constraint does not allow; the same holds for a token
// sampled in a step (one code path, tdm_grammar_mask_error).
static void test_resume_capacity(void **state)
{
    (void)state;
    static const char rx[] =
        "((((((((\0\0\0\0\0(((((((((((((iiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiii(((((((((a)*)*)."
        ")*)*)ppertie*)*)*)*)*)*ties\":\"mn)*)*)\024*)*)*)*)*)*)*)*)*)*)*)*)*)*)*)*)*";
    struct tdm_engine *e = engine_make(true);
    int32_t prompt[64 + 5];
    int np;
    prompt_of("Say something:", prompt, &np);
    int32_t *nul = NULL;
    size_t got = 0;
    assert_int_equal(tdm_tok_encode(tok, "\0", 1, false, &nul, &got), TDM_OK);
    assert_int_equal(got, 1);
    for (int i = 0; i < 5; i++)
        prompt[np + i] = nul[0]; // the five NULs a client already has
    free(nul);
    struct tdm_engine_request_params p;
    tdm_engine_request_params_default(&p);
    p.id = "resume";
    p.prompt = prompt;
    p.n_prompt = np + 5;
    p.n_resume = 5;
    constrained(&p.sampling, TDM_CONSTRAINT_REGEX, rx, 7);
    p.sampling.constraint_len = sizeof rx - 1;
    p.max_tokens = 16;
    struct tdm_engine_request *r = NULL;
    char err[256] = "";
    assert_int_equal(tdm_engine_submit(e, &p, &r, err, sizeof err), TDM_EINVAL);
    assert_null(r);
    if (!strstr(err, "too ambiguous"))
        fail_msg("submit: %s", err);
    p.n_prompt = np + 4; // four NULs are followed
    p.n_resume = 4;
    assert_int_equal(tdm_engine_submit(e, &p, &r, err, sizeof err), TDM_OK);
    tdm_engine_abort(e, r, TDM_FINISH_ABORT);
    struct out o;
    collect(r, &o);
    tdm_engine_request_release(r);
    tdm_engine_free(e);
}

// The grammar is complete: as in vLLM, the next step can only sample an ending
// id, so the request ends on a generated EOS that counts as a token (the choice
// "beta" then EOS); at max_tokens == the grammar's own tokens it is "length"
// (vLLM checks the length first); greedy runs are reproducible.
static void test_stop_when_done_and_length(void **state)
{
    (void)state;
    struct tdm_engine *e = engine_make(true);
    int32_t prompt[64];
    int np;
    prompt_of("pick one", prompt, &np);
    struct tdm_sampling_params sp;
    constrained(&sp, TDM_CONSTRAINT_CHOICE, "[\"beta\"]", 1);
    sp.temperature = 0.0f;
    struct out o;
    struct tdm_engine_request *r = tdm_test_submit(e, prompt, np, &sp, 50, TDM_ENGINE_REQ_GENERATE);
    collect(r, &o);
    tdm_engine_request_release(r);
    assert_int_equal(o.reason, TDM_FINISH_STOP);
    assert_true(o.n >= 2);
    assert_int_equal(o.ids[o.n - 1], tdm_tok_eos_id(tok)); // generated, counted
    assert_int_equal(o.stop_token, tdm_tok_eos_id(tok));
    size_t len;
    char *t = text_of(&o, &len);
    assert_string_equal(t, "beta");
    free(t);
    for (int i = 0; i < o.n - 1; i++)
        assert_false(tdm_tok_is_special(tok, o.ids[i]));
    int grammar_tokens = o.n - 1;

    // Reproducible: the same ids again.
    struct out o2;
    r = tdm_test_submit(e, prompt, np, &sp, 50, TDM_ENGINE_REQ_GENERATE);
    collect(r, &o2);
    tdm_engine_request_release(r);
    assert_int_equal(o2.n, o.n);
    assert_memory_equal(o2.ids, o.ids, (size_t)o.n * sizeof o.ids[0]);

    // max_tokens ends exactly where the grammar does: "length", no EOS.
    r = tdm_test_submit(e, prompt, np, &sp, grammar_tokens, TDM_ENGINE_REQ_GENERATE);
    collect(r, &o2);
    tdm_engine_request_release(r);
    assert_int_equal(o2.reason, TDM_FINISH_LENGTH);
    assert_int_equal(o2.n, grammar_tokens);
    assert_memory_equal(o2.ids, o.ids, (size_t)grammar_tokens * sizeof o.ids[0]);

    // min_tokens hiding the ending ids: the output is complete, so the request
    // stops at once without one (an EOS could not be drawn).
    sp.min_tokens = grammar_tokens + 5;
    r = tdm_test_submit(e, prompt, np, &sp, 50, TDM_ENGINE_REQ_GENERATE);
    collect(r, &o2);
    tdm_engine_request_release(r);
    assert_int_equal(o2.reason, TDM_FINISH_STOP);
    assert_int_equal(o2.stop_token, -1);
    assert_int_equal(o2.n, grammar_tokens);
    sp.min_tokens = 0;

    // max_tokens reached mid-object: "length", the text a prefix of a valid one.
    constrained(&sp, TDM_CONSTRAINT_JSON_SCHEMA, nested_schema, 5);
    r = tdm_test_submit(e, prompt, np, &sp, 4, TDM_ENGINE_REQ_GENERATE);
    collect(r, &o);
    tdm_engine_request_release(r);
    assert_int_equal(o.reason, TDM_FINISH_LENGTH);
    assert_int_equal(o.n, 4);
    t = text_of(&o, &len);
    assert_true(len > 0 && t[0] == '{');
    cJSON *v = cJSON_Parse(t);
    assert_null(v); // incomplete
    free(t);

    // ignore_eos and min_tokens do not break the grammar: still a stop at the end.
    constrained(&sp, TDM_CONSTRAINT_REGEX, "x{3}", 9);
    sp.ignore_eos = true;
    sp.min_tokens = 10;
    r = tdm_test_submit(e, prompt, np, &sp, 20, TDM_ENGINE_REQ_GENERATE);
    collect(r, &o);
    tdm_engine_request_release(r);
    assert_int_equal(o.reason, TDM_FINISH_STOP);
    t = text_of(&o, &len);
    assert_string_equal(t, "xxx");
    free(t);
    tdm_engine_free(e);
}

// Constrained rows drawn on a device (the emulated CUDA module): their masks,
// computed by the mask threads while the layers run, go to the device with
// the row (the choose hook) and the tokens equal those of the same engine
// sampling every row on the host from the same logits, seed for seed: a
// schema, a regex, a choice, greedy and with penalties, in one batch; and
// two requests of the regex [ab]{6} and one seed with allowed_token_ids
// (every token without a 'b', every token without an 'a'), whose bitmaps are
// ANDed into the grammar's: "aaaaaa" and "bbbbbb", on the device as on the
// host (without the AND both would draw the same text).
static void test_device_masks(void **state)
{
    (void)state;
    char err[256];
    struct tdm_model *dm = tdm_test_emu_model(model_dir, 16);
    assert_true(tdm_model_device_sampling(dm));
    enum { N = 8 };
    static const struct {
        enum tdm_constraint_kind kind;
        const char *text;
        float temperature, repetition;
    } reqs[N] = {
        {TDM_CONSTRAINT_JSON_SCHEMA, nested_schema, 1.0f, 1.0f},
        {TDM_CONSTRAINT_REGEX, regex_text, 1.0f, 1.0f},
        {TDM_CONSTRAINT_CHOICE, "[\"alpha\",\"beta\",\"gamma delta\"]", 0.8f, 1.0f},
        {TDM_CONSTRAINT_REGEX, regex_text, 0.0f, 1.0f},
        {TDM_CONSTRAINT_JSON_SCHEMA, nested_schema, 0.7f, 1.1f},
        {TDM_CONSTRAINT_NONE, NULL, 0.9f, 1.0f},
        {TDM_CONSTRAINT_REGEX, "[ab]{6}", 0.9f, 1.0f},
        {TDM_CONSTRAINT_REGEX, "[ab]{6}", 0.9f, 1.0f},
    };
    // Requests 6 and 7's allowed_token_ids: the tokens without a 'b', without an 'a'.
    static const char *const want[2] = {"aaaaaa", "bbbbbb"};
    int nv = tdm_tok_vocab_size(tok);
    int32_t *only[2];
    int n_only[2] = {0, 0};
    for (int c = 0; c < 2; c++) {
        only[c] = malloc((size_t)nv * sizeof *only[c]);
        assert_non_null(only[c]);
        for (int32_t t = 0; t < nv; t++) {
            char *s = NULL;
            size_t sl = 0;
            if (tdm_tok_decode(tok, &t, 1, false, &s, &sl) != TDM_OK)
                continue;
            if (!memchr(s, c ? 'a' : 'b', sl))
                only[c][n_only[c]++] = t;
            free(s);
        }
    }
    int32_t prompt[64];
    int np;
    prompt_of("Answer in JSON: the colour of", prompt, &np);
    struct out got[2][N];
    uint64_t drawn[2], ahead = 0;
    for (int host = 0; host < 2; host++) {
        struct tdm_engine_config c;
        tdm_engine_config_default(&c);
        c.num_blocks = 256;
        c.max_num_batched_tokens = 256;
        c.max_num_seqs = 16;
        c.grammar_vocab = gvocab;
        c.mask_threads = 2;
        c.host_sampling = host;
        struct tdm_engine *e = NULL;
        assert_int_equal(tdm_engine_new(&e, dm, &c, err, sizeof err), TDM_OK);
        struct tdm_engine_request *r[N];
        // The unconstrained request first: on the device its steps go
        // ahead (async scheduling), and the constrained ones arrive while
        // they do, admitted into a step built ahead, their first token drawn
        // there under its mask.
        static const int order[N] = {5, 0, 1, 2, 3, 4, 6, 7};
        for (int k = 0; k < N; k++) {
            int i = order[k];
            struct tdm_sampling_params sp;
            constrained(&sp, reqs[i].kind, reqs[i].text, i >= 6 ? 906u : 900u + (uint64_t)i);
            sp.temperature = reqs[i].temperature;
            sp.repetition_penalty = reqs[i].repetition;
            if (i >= 6) {
                sp.allowed_token_ids = only[i - 6];
                sp.num_allowed_token_ids = n_only[i - 6];
            }
            r[i] = tdm_test_submit(e, prompt, np, &sp, 40, TDM_ENGINE_REQ_GENERATE);
            struct tdm_engine_stats s0;
            for (int w = 0; k == 0 && w < 5000; w++) { // its first steps
                tdm_engine_get_stats(e, &s0);
                if (s0.num_steps >= 4)
                    break;
                usleep(1000);
            }
        }
        for (int i = 0; i < N; i++) {
            collect(r[i], &got[host][i]);
            tdm_engine_request_release(r[i]);
        }
        struct tdm_engine_stats s;
        do {
            usleep(1000);
            tdm_engine_get_stats(e, &s);
        } while (s.num_running > 0);
        drawn[host] = s.num_device_drawn_tokens;
        ahead += host ? 0 : s.num_async_steps;
        tdm_engine_free(e);
    }
    for (int i = 0; i < N; i++) {
        const struct out *d = &got[0][i], *h = &got[1][i];
        if (d->n != h->n || memcmp(d->ids, h->ids, (size_t)d->n * sizeof *d->ids) != 0 ||
            d->reason != h->reason)
            fail_msg("request %d: %d tokens (%s) drawn on the device, %d (%s) on the host", i, d->n,
                     tdm_finish_name(d->reason), h->n, tdm_finish_name(h->reason));
        assert_true(d->n > 0);
    }
    for (int c = 0; c < 2; c++) {
        size_t len = 0;
        char *t = text_of(&got[0][6 + c], &len);
        assert_string_equal(t, want[c]);
        free(t);
        free(only[c]);
    }
    print_message("device masks: %llu tokens drawn on the device (%llu steps issued ahead), %llu "
                  "with host sampling\n",
                  (unsigned long long)drawn[0], (unsigned long long)ahead,
                  (unsigned long long)drawn[1]);
    assert_true(drawn[0] > 0);
    assert_int_equal(drawn[1], 0);
    // Constrained rows go ahead too (their masks follow the step in flight's
    // tokens, computed in the choose hook): 45-68 steps here, 5-7 when a
    // constrained row kept its step synchronous.
    assert_true(ahead >= 20);
    tdm_model_free(dm);
}

// P/D: the prefill side samples the first token under the mask, the decode
// side continues the grammar from it; the tokens equal a local run's.
static void test_pd_equivalence(void **state)
{
    (void)state;
    int32_t prompt[64];
    int np;
    prompt_of("Answer in JSON: the colour of the sky", prompt, &np);
    int stops = 0;
    for (uint64_t seed = 7; seed < 10; seed++) {
        struct tdm_sampling_params sp;
        constrained(&sp, TDM_CONSTRAINT_JSON_SCHEMA, nested_schema, seed);
        struct tdm_engine *le = engine_make(true);
        struct tdm_engine_request *r =
            tdm_test_submit(le, prompt, np, &sp, MAXT, TDM_ENGINE_REQ_GENERATE);
        struct out local;
        collect(r, &local);
        tdm_engine_request_release(r);
        tdm_engine_free(le);

        struct tdm_engine *pe = engine_make(true);
        r = tdm_test_submit(pe, prompt, np, &sp, 0, TDM_ENGINE_REQ_PREFILL_ONLY);
        struct out first;
        collect(r, &first);
        assert_int_equal(first.n, 1);
        assert_int_equal(first.ids[0], local.ids[0]);
        struct tdm_kv_header h;
        assert_int_equal(tdm_engine_kv_header(pe, r, "tiny", &h), TDM_OK);
        int layers = tdm_model_config(model)->num_hidden_layers;
        struct tdm_kv_config kc;
        memset(&kc, 0, sizeof kc);
        tdm_model_kv_config(model, &kc);
        kc.block_size = 16;
        size_t layer_len = tdm_kv_block_bytes(&kc) / (size_t)layers * (size_t)h.num_blocks;
        void **payload = calloc((size_t)layers, sizeof *payload);
        for (int l = 0; l < layers; l++) {
            payload[l] = malloc(layer_len);
            assert_int_equal(
                tdm_engine_export_layer(pe, r, l, 0, h.num_blocks, payload[l], layer_len), TDM_OK);
        }
        assert_int_equal(tdm_engine_release_kv(pe, r), TDM_OK);
        tdm_engine_request_release(r);
        tdm_engine_free(pe);

        struct tdm_engine *de = engine_make(true);
        r = tdm_test_submit(de, prompt, np, &sp, MAXT, TDM_ENGINE_REQ_IMPORT_KV);
        int fb, nb;
        assert_int_equal(tdm_engine_import_wait(r, WAIT_S, &fb, &nb), TDM_OK);
        for (int l = 0; l < layers; l++)
            assert_int_equal(tdm_engine_import_layer(de, r, l, 0, nb, payload[l], layer_len),
                             TDM_OK);
        assert_int_equal(tdm_engine_import_done(de, r, first.ids[0], true), TDM_OK);
        struct out pd;
        collect(r, &pd);
        tdm_engine_request_release(r);
        tdm_engine_free(de);
        for (int l = 0; l < layers; l++)
            free(payload[l]);
        free(payload);
        assert_int_equal(pd.reason, local.reason);
        assert_int_equal(pd.n, local.n);
        assert_memory_equal(pd.ids, local.ids, (size_t)local.n * sizeof(int32_t));
        if (local.reason == TDM_FINISH_STOP) {
            stops++;
            size_t len;
            char *t = text_of(&pd, &len);
            char why[256];
            if (!check_nested(t, len, why, sizeof why))
                fail_msg("P/D output %s invalid: %s", t, why);
            free(t);
        }
    }
    assert_true(stops >= 2);
}

static void test_refusals_and_no_cost(void **state)
{
    (void)state;
    int32_t prompt[64];
    int np;
    prompt_of("hello", prompt, &np);
    char err[256];
    struct tdm_engine_request_params p;
    struct tdm_engine_request *r = NULL;

    // Without the tokenizer's vocabulary the engine refuses constraints.
    struct tdm_engine *e = engine_make(false);
    tdm_engine_request_params_default(&p);
    p.prompt = prompt;
    p.n_prompt = np;
    constrained(&p.sampling, TDM_CONSTRAINT_REGEX, "a+", 1);
    assert_int_equal(tdm_engine_submit(e, &p, &r, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "structured outputs need the tokenizer"));
    tdm_engine_free(e);

    e = engine_make(true);
    // A bad constraint: the grammar engine's message.
    constrained(&p.sampling, TDM_CONSTRAINT_REGEX, "(a", 1);
    assert_int_equal(tdm_engine_submit(e, &p, &r, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "regex"));
    constrained(&p.sampling, TDM_CONSTRAINT_JSON_SCHEMA, "{\"type\":\"integer\",\"allOf\":[]}", 1);
    assert_int_equal(tdm_engine_submit(e, &p, &r, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "allOf"));
    p.sampling.constraint = (enum tdm_constraint_kind)77;
    assert_int_equal(tdm_engine_submit(e, &p, &r, err, sizeof err), TDM_EINVAL);

    // Unconstrained requests compute no mask.
    struct tdm_sampling_params sp;
    tdm_sampling_params_default(&sp);
    sp.has_seed = true;
    sp.ignore_eos = true;
    r = tdm_test_submit(e, prompt, np, &sp, 12, TDM_ENGINE_REQ_GENERATE);
    struct out o;
    collect(r, &o);
    tdm_engine_request_release(r);
    assert_int_equal(o.n, 12);
    struct tdm_engine_stats s;
    tdm_engine_get_stats(e, &s);
    assert_int_equal(s.num_masks, 0);

    // A precompiled grammar attached to the params wins over the text.
    struct tdm_grammar *g = NULL;
    assert_int_equal(tdm_grammar_compile_regex(&g, "zz", 2, err, sizeof err), TDM_OK);
    tdm_engine_request_params_default(&p);
    p.prompt = prompt;
    p.n_prompt = np;
    p.grammar = g;
    p.max_tokens = 10;
    assert_int_equal(tdm_engine_submit(e, &p, &r, err, sizeof err), TDM_OK);
    tdm_grammar_unref(g); // the engine holds its own
    collect(r, &o);
    tdm_engine_request_release(r);
    size_t len;
    char *t = text_of(&o, &len);
    assert_string_equal(t, "zz");
    free(t);
    assert_int_equal(o.reason, TDM_FINISH_STOP);
    double end = tdm_now() + WAIT_S;
    do // stats settle at the engine's next loop
        tdm_engine_get_stats(e, &s);
    while (s.num_masks != (uint64_t)o.n && tdm_now() < end && usleep(1000) == 0);
    assert_int_equal(s.num_masks, (uint64_t)o.n);
    tdm_engine_free(e);
}

int main(int argc, char **argv)
{
    tdm_test_filters(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_schema_outputs_validate),
        cmocka_unit_test(test_regex_choice_object),
        cmocka_unit_test(test_gbnf),
        cmocka_unit_test(test_mask_budget_error),
        cmocka_unit_test(test_resume_capacity),
        cmocka_unit_test(test_stop_when_done_and_length),
        cmocka_unit_test(test_pd_equivalence),
        cmocka_unit_test(test_device_masks),
        cmocka_unit_test(test_refusals_and_no_cost),
    };
    return tdm_test_exit(cmocka_run_group_tests(tests, setup, teardown));
}
