// SPDX-License-Identifier: Apache-2.0
// Tests of the router's per-choice stream steps (router_stream.c) with no
// network and no threads: TokenChunks built in memory go into a real call
// (common/edge/openai, a small tokenizer from tools/mkmodel). Tokens in slices (a
// chunk longer than one slice, with top logprobs), logprob and top lists of
// the wrong length ignored and over-long top lists cut, a stop string that
// ends the choice (the decode worker is to be cancelled), an EOS finish
// (stop_reason null) and a stop_token_ids one (named), a finish without a reason and an unknown one
// as errors, a refusal before any token as retryable and not after; the liveness verdict (silent,
// restarted only by a report newer than the stream, unknown instances); and whether a call may be
// retried.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core.h"
#include "mkmodel.h"
#include "openai.h"
#include "router_stream.h"
#include "tokenizer.h"

static struct tdm_tokenizer *tok;
static char tok_dir[] = "/tmp/tdm_router_stream_XXXXXX";
static struct tdm_oai_model_info info;
static const struct tdm_generation_config gen; // no generation_config.json eos ids

static int setup(void **state)
{
    (void)state;
    char err[256];
    if (mkdtemp(tok_dir) == NULL)
        return -1;
    if (tdm_mkmodel_write_tokenizer(1000, tok_dir, err, sizeof err) != TDM_OK ||
        tdm_tok_load(&tok, tok_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tokenizer: %s\n", err);
        return -1;
    }
    info.served_name = "tiny";
    info.vocab_size = tdm_tok_vocab_size(tok);
    info.max_model_len = 512;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_tok_free(tok);
    tdm_mkmodel_remove(tok_dir);
    return 0;
}

static void start(struct tdm_oai_call *k, const char *body)
{
    struct tdm_oai_error e;
    assert_int_equal(tdm_oai_call_init(k, TDM_OAI_COMPLETION, body, strlen(body), &info, tok, NULL,
                                       "none", "t", &e),
                     TDM_OK);
}

// A TokenChunk over ids[n] (logprobs and num_top alternatives per token as
// asked) in caller storage.
struct chunk {
    Tandem__TokenChunk m;
    float lps[64];
    Tandem__TopLogprob tops[64 * 8];
    Tandem__TopLogprob *top_ptr[64 * 8];
};

static void make_chunk(struct chunk *c, int32_t *ids, size_t n, size_t n_lps, int num_top)
{
    Tandem__TokenChunk init = TANDEM__TOKEN_CHUNK__INIT;
    c->m = init;
    c->m.tokens = ids;
    c->m.n_tokens = n;
    c->m.stop_token = -1;
    c->m.message = "";
    for (size_t i = 0; i < n_lps; i++)
        c->lps[i] = -0.25f;
    c->m.logprobs = c->lps;
    c->m.n_logprobs = n_lps;
    if (num_top > 0) {
        Tandem__TopLogprob t0 = TANDEM__TOP_LOGPROB__INIT;
        for (size_t i = 0; i < n * (size_t)num_top; i++) {
            c->tops[i] = t0;
            c->tops[i].token = ids[i / (size_t)num_top];
            c->tops[i].logprob = -0.5f;
            c->top_ptr[i] = &c->tops[i];
        }
        c->m.num_top = num_top;
        c->m.n_top = n * (size_t)num_top;
        c->m.top = c->top_ptr;
    }
}

static size_t encode(const char *text, int32_t **ids)
{
    size_t n = 0;
    assert_int_equal(tdm_tok_encode(tok, text, strlen(text), false, ids, &n), TDM_OK);
    return n;
}

// Prompt logprobs from the wire reach the call (the prompt's entries in the
// body); a malformed set is ignored; a first chunk without them when they
// were asked (an older decode worker) fails the choice and cancels upstream.
static void test_prompt_logprobs(void **state)
{
    (void)state;
    int32_t tok1[1] = {7};
    struct tdm_oai_call k;
    start(&k, "{\"prompt\":\"Hello world\",\"max_tokens\":4,\"prompt_logprobs\":1}");
    size_t np = k.prompts[0].n;
    assert_true(np >= 2 && np <= 16);
    float plp[16] = {0};
    int32_t rank[16] = {0};
    Tandem__TopLogprob tops[16], *top_ptr[16];
    for (size_t i = 0; i < np; i++) {
        Tandem__TopLogprob t0 = TANDEM__TOP_LOGPROB__INIT;
        plp[i] = i ? -1.0f : 0.0f;
        rank[i] = i ? 3 : 0;
        tops[i] = t0;
        tops[i].token = 9;
        tops[i].logprob = -0.5f;
        top_ptr[i] = &tops[i];
    }
    struct chunk *c = calloc(1, sizeof *c);
    make_chunk(c, tok1, 1, 0, 0);
    c->m.n_prompt_logprobs = np;
    c->m.prompt_logprobs = plp;
    c->m.n_prompt_ranks = np;
    c->m.prompt_ranks = rank;
    c->m.prompt_num_top = 1;
    c->m.n_prompt_top = np;
    c->m.prompt_top = top_ptr;
    c->m.finished = true;
    c->m.finish = TANDEM__FINISH_REASON__FINISH_LENGTH;
    struct tdm_router_take r;
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_non_null(k.prompts[0].plp);
    assert_int_equal(k.prompts[0].plp_rank[1], 3);
    char *body = tdm_oai_call_body(&k);
    assert_non_null(strstr(body, "\"prompt_logprobs\":[null,{"));
    assert_non_null(strstr(body, "\"rank\":3"));
    free(body);
    tdm_oai_call_fini(&k);

    // Asked, not brought (ranks of another length: ignored as malformed).
    start(&k, "{\"prompt\":\"Hello world\",\"max_tokens\":4,\"prompt_logprobs\":1}");
    c->m.n_prompt_ranks = np - 1;
    c->m.finished = false;
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_true(k.choices[0].done);
    assert_int_equal(k.choices[0].finish, TDM_FINISH_ERROR);
    assert_non_null(strstr(k.choices[0].message, "no prompt logprobs"));
    assert_true(r.stopped); // the decode worker is cancelled
    tdm_oai_call_fini(&k);
    free(c);
}

static void test_tokens_in_slices(void **state)
{
    (void)state;
    const char *text = "The quick brown fox jumps over the lazy dog, and then the quick brown "
                       "fox jumps over the lazy dog again.";
    int32_t *ids = NULL;
    size_t n = encode(text, &ids);
    assert_true(n > 16 && n <= 64); // more than one slice
    struct tdm_oai_call k;
    start(&k, "{\"prompt\":\"Hi\",\"max_tokens\":100,\"logprobs\":2}");
    struct chunk *c = calloc(1, sizeof *c);
    make_chunk(c, ids, n, n, 2);
    c->m.finished = true;
    c->m.finish = TANDEM__FINISH_REASON__FINISH_LENGTH;
    struct tdm_router_take r;
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_false(r.stopped);
    assert_true(r.upstream_done);
    assert_false(r.refused);
    const struct tdm_oai_asm *a = &k.choices[0];
    assert_true(a->done);
    assert_int_equal(a->finish, TDM_FINISH_LENGTH);
    assert_int_equal(a->completion_tokens, (int)n);
    assert_string_equal(a->text.p, text);
    char *body = tdm_oai_call_body(&k);
    assert_non_null(body);
    assert_non_null(strstr(body, "\"top_logprobs\""));
    assert_non_null(strstr(body, "\"finish_reason\":\"length\""));
    free(body);
    tdm_oai_call_fini(&k);

    // Lists of the wrong length are ignored, more alternatives than a request
    // may ask for are cut; the tokens still count.
    start(&k, "{\"prompt\":\"Hi\",\"max_tokens\":100}");
    make_chunk(c, ids, 4, 3, TDM_MAX_LOGPROBS + 3);
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    c->m.n_top = 5; // not num_top per token
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_int_equal(k.choices[0].completion_tokens, 8);
    assert_false(k.choices[0].done);
    assert_false(r.upstream_done);
    tdm_oai_call_fini(&k);
    free(c);
    free(ids);
}

static void test_stop_string_and_eos(void **state)
{
    (void)state;
    int32_t *ids = NULL;
    size_t n = encode("The quick brown fox jumps over the lazy dog.", &ids);
    struct tdm_oai_call k;
    start(&k, "{\"prompt\":\"Hi\",\"max_tokens\":100,\"stop\":[\"fox\"]}");
    struct chunk *c = calloc(1, sizeof *c);
    make_chunk(c, ids, n, 0, 0);
    struct tdm_router_take r;
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_true(r.stopped); // the router cancels the decode worker's request
    assert_false(r.upstream_done);
    assert_true(k.choices[0].done);
    assert_int_equal(k.choices[0].finish, TDM_FINISH_STOP);
    assert_string_equal(k.choices[0].text.p, "The quick brown ");
    tdm_oai_call_fini(&k);

    // The tokenizer's EOS ends the choice: finish stop, stop_reason null (vLLM).
    int32_t eos = tdm_tok_eos_id(tok);
    int32_t with_eos[] = {ids[0], ids[1], eos};
    start(&k, "{\"prompt\":\"Hi\",\"max_tokens\":100}");
    make_chunk(c, with_eos, 3, 0, 0);
    c->m.finished = true;
    c->m.finish = TANDEM__FINISH_REASON__FINISH_STOP;
    c->m.stop_token = eos;
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, eos, &gen, &r), TDM_OK);
    assert_int_equal(k.choices[0].finish, TDM_FINISH_STOP);
    assert_int_equal(k.choices[0].stop_token, -1);
    assert_true(r.upstream_done);
    tdm_oai_call_fini(&k);
    // A stop_token_ids id is named as stop_reason.
    char body[128];
    snprintf(body, sizeof body, "{\"prompt\":\"Hi\",\"max_tokens\":100,\"stop_token_ids\":[%d]}",
             (int)ids[1]);
    start(&k, body);
    make_chunk(c, with_eos, 2, 0, 0);
    c->m.finished = true;
    c->m.finish = TANDEM__FINISH_REASON__FINISH_STOP;
    c->m.stop_token = ids[1];
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, eos, &gen, &r), TDM_OK);
    assert_int_equal(k.choices[0].finish, TDM_FINISH_STOP);
    assert_int_equal(k.choices[0].stop_token, ids[1]);
    tdm_oai_call_fini(&k);
    free(c);
    free(ids);
}

static void test_finish_errors_and_refusal(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct chunk *c = calloc(1, sizeof *c);
    struct tdm_router_take r;
    int32_t id = 70;
    // Finished without a reason, and with a reason this build does not know:
    // error finishes; no code means a transport failure.
    for (int v = 0; v < 2; v++) {
        start(&k, "{\"prompt\":\"Hi\",\"max_tokens\":100}");
        make_chunk(c, &id, 1, 0, 0);
        c->m.finished = true;
        c->m.finish = v == 0 ? TANDEM__FINISH_REASON__FINISH_NONE : (Tandem__FinishReason)42;
        c->m.message = "odd peer";
        assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r),
                         TDM_OK);
        assert_int_equal(k.choices[0].finish, TDM_FINISH_ERROR);
        assert_int_equal(k.choices[0].error, TDM_ETRANSPORT);
        assert_string_equal(k.choices[0].message, "odd peer");
        assert_false(r.refused); // a token was produced
        tdm_oai_call_fini(&k);
    }
    // Loading or draining: refused before any token, so another worker may take it.
    start(&k, "{\"prompt\":\"Hi\",\"max_tokens\":100,\"n\":2}");
    make_chunk(c, NULL, 0, 0, 0);
    c->m.finished = true;
    c->m.finish = TANDEM__FINISH_REASON__FINISH_ERROR;
    c->m.error = TDM_ECLOSED;
    c->m.message = "draining";
    assert_int_equal(tdm_router_take_chunk(&k, 1, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_true(r.refused);
    assert_true(r.upstream_done);
    assert_true(tdm_router_call_retryable(&k));
    // The same refusal once the choice is done is not news.
    assert_int_equal(tdm_router_take_chunk(&k, 1, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_false(r.refused);
    tdm_oai_call_fini(&k);
    // A full waiting queue (or no thread) before any token: busy, not refused.
    start(&k, "{\"prompt\":\"Hi\",\"max_tokens\":100}");
    c->m.error = TDM_EBUSY;
    c->m.message = "the waiting queue is full (--max-waiting 1)";
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_true(r.busy);
    assert_false(r.refused);
    assert_true(tdm_router_call_retryable(&k));
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_false(r.busy); // once the choice is done it is not news
    tdm_oai_call_fini(&k);
    start(&k, "{\"prompt\":\"Hi\",\"max_tokens\":100,\"n\":2}");
    // After a token the call is no longer retryable, and a refusal is just an error.
    make_chunk(c, &id, 1, 0, 0);
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_false(tdm_router_call_retryable(&k));
    make_chunk(c, NULL, 0, 0, 0);
    c->m.finished = true;
    c->m.finish = TANDEM__FINISH_REASON__FINISH_ERROR;
    c->m.error = TDM_ECLOSED;
    assert_int_equal(tdm_router_take_chunk(&k, 0, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_false(r.refused);
    assert_int_equal(k.choices[0].finish, TDM_FINISH_ERROR);
    make_chunk(c, NULL, 0, 0, 0);
    c->m.finished = true;
    c->m.finish = TANDEM__FINISH_REASON__FINISH_ERROR;
    c->m.error = TDM_EBUSY;
    assert_int_equal(tdm_router_take_chunk(&k, 1, &c->m, tdm_tok_eos_id(tok), &gen, &r), TDM_OK);
    assert_true(r.busy);                         // this choice made no token, but
    assert_false(tdm_router_call_retryable(&k)); // its sibling did: no retry
    tdm_oai_call_fini(&k);
    free(c);
}

static void test_upstream_check(void **state)
{
    (void)state;
    // Heard from 0.5 s ago, timeout 1 s: alive.
    assert_int_equal(tdm_router_upstream_check(10.0, 5.0, 9.5, 1.0, 7, 7, 0, 0),
                     TDM_ROUTER_UPSTREAM_ALIVE);
    // Silent for longer than the timeout.
    assert_int_equal(tdm_router_upstream_check(10.0, 5.0, 8.5, 1.0, 7, 7, 0, 8.7),
                     TDM_ROUTER_UPSTREAM_SILENT);
    // Never heard of, but the stream started only now: counted from its start.
    assert_int_equal(tdm_router_upstream_check(10.0, 9.5, 0, 1.0, 0, 0, 0, 0),
                     TDM_ROUTER_UPSTREAM_ALIVE);
    assert_int_equal(tdm_router_upstream_check(10.0, 8.0, 0, 1.0, 0, 0, 0, 8.2),
                     TDM_ROUTER_UPSTREAM_SILENT);
    // Another instance in a report newer than the stream: restarted.
    assert_int_equal(tdm_router_upstream_check(10.0, 9.0, 9.8, 1.0, 8, 7, 0, 0),
                     TDM_ROUTER_UPSTREAM_RESTARTED);
    // A report older than the stream may predate the restart the stream talks to.
    assert_int_equal(tdm_router_upstream_check(10.0, 9.9, 9.8, 1.0, 8, 7, 0, 0),
                     TDM_ROUTER_UPSTREAM_ALIVE);
    // Unknown instances say nothing.
    assert_int_equal(tdm_router_upstream_check(10.0, 9.0, 9.8, 1.0, 0, 7, 0, 0),
                     TDM_ROUTER_UPSTREAM_ALIVE);
    assert_int_equal(tdm_router_upstream_check(10.0, 9.0, 9.8, 1.0, 8, 0, 0, 0),
                     TDM_ROUTER_UPSTREAM_ALIVE);
    // The router itself was stopped until 9.6 (its last read report is from
    // before the stop): the worker's silence counts from 9.6, not from 0.5.
    assert_int_equal(tdm_router_upstream_check(10.0, 0.2, 0.5, 1.0, 7, 7, 9.6, 0.7),
                     TDM_ROUTER_UPSTREAM_ALIVE);
    // ... and a worker still silent a timeout after the router came back is silent.
    assert_int_equal(tdm_router_upstream_check(10.0, 0.2, 0.5, 1.0, 7, 7, 8.9, 8.95),
                     TDM_ROUTER_UPSTREAM_SILENT);
    // A stall shorter than the stall detector (no resume noted): the last
    // report read is 1.1 s old, but the router's second unanswered query went
    // out only after it came back (9.7): not silent yet (issue 29 part 6).
    assert_int_equal(tdm_router_upstream_check(10.0, 5.0, 8.9, 1.0, 7, 7, 0, 9.7),
                     TDM_ROUTER_UPSTREAM_ALIVE);
    // Fewer than two queries unanswered: no verdict, however old the report.
    assert_int_equal(tdm_router_upstream_check(10.0, 5.0, 3.0, 1.0, 7, 7, 0, 0),
                     TDM_ROUTER_UPSTREAM_ALIVE);
    // Both old: silent.
    assert_int_equal(tdm_router_upstream_check(10.0, 5.0, 8.9, 1.0, 7, 7, 0, 8.95),
                     TDM_ROUTER_UPSTREAM_SILENT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokens_in_slices),
        cmocka_unit_test(test_prompt_logprobs),
        cmocka_unit_test(test_stop_string_and_eos),
        cmocka_unit_test(test_finish_errors_and_refusal),
        cmocka_unit_test(test_upstream_check),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
