// SPDX-License-Identifier: Apache-2.0
// Tests of one call's state (struct tdm_oai_call), the part the decode worker
// and the router share around their token sources, with a small byte-level BPE
// written by tools/mkmodel (so the tests never skip): a body becomes prompts
// and n choices per prompt with the right index and prompt, ids come from
// request_id, else the header, else random; rejected bodies keep their 4xx;
// echo-only sets up no choices; done / first failure / usage over choices;
// the non-stream body; stream chunks with per-prompt continuous usage; and the
// echoed prompt's first chunk (alone, before tokens the choice already holds,
// text_offset and prompt_token_ids accounted once).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "chat.h"
#include "core.h"
#include "mkmodel.h"
#include "openai.h"
#include "tokenizer.h"

static struct tdm_tokenizer *tok;
static char tok_dir[] = "/tmp/tdm_oai_call_XXXXXX";
static struct tdm_oai_model_info info;

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
    info.max_model_len = 256;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_tok_free(tok);
    tdm_mkmodel_remove(tok_dir);
    return 0;
}

static int start(struct tdm_oai_call *k, enum tdm_oai_kind kind, const char *body,
                 const char *base_id, struct tdm_oai_error *e)
{
    return tdm_oai_call_init(k, kind, body, strlen(body), &info, tok, NULL, "no template here",
                             base_id, e);
}

// Feeds text's tokens into choice i (logprob -0.5 each); returns how many.
static int feed(struct tdm_oai_call *k, size_t i, const char *text)
{
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tdm_tok_encode(tok, text, strlen(text), false, &ids, &n), TDM_OK);
    for (size_t t = 0; t < n; t++) {
        bool stopped = false;
        assert_int_equal(tdm_oai_asm_token(&k->choices[i], ids[t], -0.5f, NULL, 0, false, &stopped),
                         TDM_OK);
    }
    free(ids);
    return (int)n;
}

static void finish(struct tdm_oai_call *k, size_t i)
{
    bool stopped = false;
    assert_int_equal(tdm_oai_asm_finish(&k->choices[i], TDM_FINISH_LENGTH, -1, 0, NULL, &stopped),
                     TDM_OK);
}

static const cJSON *choice0(const cJSON *j)
{
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_non_null(c);
    return c;
}

static int usage_of(const cJSON *j, const char *field)
{
    const cJSON *u = cJSON_GetObjectItem(j, "usage");
    assert_true(cJSON_IsObject(u));
    return cJSON_GetObjectItem(u, field)->valueint;
}

static void test_init_choices_and_ids(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":[\"Hello world\",\"the cat\"],\"n\":3,\"max_tokens\":4,"
                           "\"request_id\":\"abc\"}",
                           "from-header", &e),
                     TDM_OK);
    assert_string_equal(k.resp.id, "cmpl-abc"); // the body's request_id wins
    assert_string_equal(k.resp.model, "tiny");
    assert_int_equal(k.n_prompts, 2);
    assert_int_equal(k.prompt_tokens, (int)(k.prompts[0].n + k.prompts[1].n));
    assert_int_equal(k.n_choices, 6);
    for (size_t i = 0; i < k.n_choices; i++) {
        assert_int_equal(k.choices[i].index, (int)i);
        assert_int_equal(k.choices[i].prompt_idx, (int)(i / 3));
        assert_false(k.choices[i].done);
    }
    tdm_oai_call_fini(&k);
    assert_null(k.choices);
    tdm_oai_call_fini(&k); // twice is fine

    // Else the X-Request-Id (the caller's base id), else 32 random hex digits.
    assert_int_equal(start(&k, TDM_OAI_COMPLETION, "{\"prompt\":\"hi\"}", "from-header", &e),
                     TDM_OK);
    assert_string_equal(k.resp.id, "cmpl-from-header");
    assert_int_equal(k.n_choices, 1);
    tdm_oai_call_fini(&k);
    assert_int_equal(start(&k, TDM_OAI_COMPLETION, "{\"prompt\":\"hi\"}", NULL, &e), TDM_OK);
    assert_int_equal(strlen(k.resp.id), strlen("cmpl-") + TDM_OAI_ID_HEX);
    tdm_oai_call_fini(&k);
}

static void test_init_errors_and_echo_only(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    // The parser's 400 names the field; nothing is set up.
    assert_int_not_equal(
        start(&k, TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"temperature\":7}", NULL, &e), TDM_OK);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "temperature");
    assert_int_equal(k.n_choices, 0);
    tdm_oai_call_fini(&k);
    // Prompts that do not fit the context: 400 from the prompt step.
    assert_int_not_equal(
        start(&k, TDM_OAI_COMPLETION, "{\"prompt\":\"Hello\",\"max_tokens\":256}", NULL, &e),
        TDM_OK);
    assert_int_equal(e.status, 400);
    assert_int_equal(k.n_choices, 0);
    tdm_oai_call_fini(&k);
    // Chat with no template: the server's reason in the message.
    assert_int_not_equal(start(&k, TDM_OAI_CHAT,
                               "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", NULL, &e),
                         TDM_OK);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "no template here"));
    tdm_oai_call_fini(&k);
    // Echo with max_tokens 0: prompts, no choices to generate.
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"Hello world\",\"echo\":true,\"max_tokens\":0,\"n\":2}",
                           NULL, &e),
                     TDM_OK);
    assert_true(k.req.echo_only);
    assert_int_equal(k.n_choices, 0);
    assert_null(k.choices);
    assert_string_equal(k.prompts[0].text, "Hello world");
    tdm_oai_call_fini(&k);
}

static void test_done_failed_usage_body(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"Hello\",\"n\":3,\"max_tokens\":8,\"echo\":true}", NULL,
                           &e),
                     TDM_OK);
    assert_false(tdm_oai_call_done(&k));
    assert_null(tdm_oai_call_failed(&k));
    int t0 = feed(&k, 0, " world");
    int t2 = feed(&k, 2, " the cat sat");
    finish(&k, 0);
    assert_false(tdm_oai_call_done(&k));
    tdm_oai_asm_fail(&k.choices[1], TDM_ETRANSPORT, "worker %s lost", "d1");
    tdm_oai_asm_fail(&k.choices[2], TDM_ETIMEDOUT, "late");
    assert_true(tdm_oai_call_done(&k));
    const struct tdm_oai_asm *bad = tdm_oai_call_failed(&k);
    assert_ptr_equal(bad, &k.choices[1]); // the first failed choice
    assert_string_equal(bad->message, "worker d1 lost");
    struct tdm_oai_usage u;
    tdm_oai_call_usage(&k, &u);
    assert_int_equal(u.prompt_tokens, k.prompt_tokens);
    assert_int_equal(u.completion_tokens, t0 + t2);
    tdm_oai_call_fini(&k);

    // The body of finished choices: echo prepends the prompt, usage sums choices.
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"Hello\",\"n\":2,\"max_tokens\":8,\"echo\":true}", NULL,
                           &e),
                     TDM_OK);
    t0 = feed(&k, 0, " world");
    int t1 = feed(&k, 1, " there");
    finish(&k, 0);
    finish(&k, 1);
    char *body = tdm_oai_call_body(&k);
    assert_non_null(body);
    cJSON *j = cJSON_Parse(body);
    assert_non_null(j);
    assert_string_equal(cJSON_GetObjectItem(j, "id")->valuestring, k.resp.id);
    const cJSON *cs = cJSON_GetObjectItem(j, "choices");
    assert_int_equal(cJSON_GetArraySize(cs), 2);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(cs, 0), "text")->valuestring,
                        "Hello world");
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(cs, 1), "text")->valuestring,
                        "Hello there");
    assert_string_equal(
        cJSON_GetObjectItem(cJSON_GetArrayItem(cs, 1), "finish_reason")->valuestring, "length");
    assert_int_equal(usage_of(j, "prompt_tokens"), k.prompt_tokens);
    assert_int_equal(usage_of(j, "completion_tokens"), t0 + t1);
    cJSON_Delete(j);
    free(body);
    tdm_oai_call_fini(&k);
}

static void test_stream_chunks_usage_per_prompt(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":[\"Hello\",\"the quick brown fox\"],\"max_tokens\":8,"
                           "\"stream\":true,\"stream_options\":{\"include_usage\":true,"
                           "\"continuous_usage_stats\":true}}",
                           NULL, &e),
                     TDM_OK);
    assert_true(k.prompts[0].n != k.prompts[1].n);
    char *json = NULL;
    bool finish_now = true;
    assert_int_equal(tdm_oai_call_chunk(&k, 1, &json, &finish_now), TDM_OK);
    assert_null(json); // nothing to send yet
    assert_false(finish_now);
    int t = feed(&k, 1, " jumps");
    assert_int_equal(tdm_oai_call_chunk(&k, 1, &json, &finish_now), TDM_OK);
    assert_non_null(json);
    cJSON *j = cJSON_Parse(json);
    assert_string_equal(cJSON_GetObjectItem(choice0(j), "text")->valuestring, " jumps");
    assert_int_equal(cJSON_GetObjectItem(choice0(j), "index")->valueint, 1);
    // continuous_usage_stats: this choice's own prompt, its tokens so far.
    assert_int_equal(usage_of(j, "prompt_tokens"), (int)k.prompts[1].n);
    assert_int_equal(usage_of(j, "completion_tokens"), t);
    cJSON_Delete(j);
    free(json);
    tdm_oai_asm_sent(&k.choices[1], finish_now);
    finish(&k, 1);
    assert_int_equal(tdm_oai_call_chunk(&k, 1, &json, &finish_now), TDM_OK);
    assert_true(finish_now);
    j = cJSON_Parse(json);
    assert_string_equal(cJSON_GetObjectItem(choice0(j), "finish_reason")->valuestring, "length");
    cJSON_Delete(j);
    free(json);
    tdm_oai_call_fini(&k);

    // Without continuous_usage_stats chunks carry no usage.
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"Hello\",\"max_tokens\":8,\"stream\":true}", NULL, &e),
                     TDM_OK);
    feed(&k, 0, " world");
    assert_int_equal(tdm_oai_call_chunk(&k, 0, &json, &finish_now), TDM_OK);
    j = cJSON_Parse(json);
    assert_null(cJSON_GetObjectItem(j, "usage"));
    cJSON_Delete(j);
    free(json);
    tdm_oai_call_fini(&k);
}

static void test_echo_chunk(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"Hello w\xC3\xB6rld\",\"max_tokens\":8,\"echo\":true,"
                           "\"return_token_ids\":true,\"stream\":true,"
                           "\"stream_options\":{\"continuous_usage_stats\":true}}",
                           NULL, &e),
                     TDM_OK);
    // Tokens the choice holds already (the router reads them before the
    // stream starts) stay out of the echo chunk and follow in the next one.
    int t = feed(&k, 0, " again");
    char *json = NULL;
    assert_int_equal(tdm_oai_call_echo_chunk(&k, 0, &json), TDM_OK);
    assert_non_null(json);
    cJSON *j = cJSON_Parse(json);
    const cJSON *c = choice0(j);
    assert_string_equal(cJSON_GetObjectItem(c, "text")->valuestring, "Hello w\xC3\xB6rld");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(c, "finish_reason")));
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(c, "token_ids")), 0);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(c, "prompt_token_ids")),
                     (int)k.prompts[0].n);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(c, "logprobs")));
    assert_int_equal(usage_of(j, "prompt_tokens"), (int)k.prompts[0].n);
    assert_int_equal(usage_of(j, "completion_tokens"), t);
    cJSON_Delete(j);
    free(json);
    assert_int_equal(k.choices[0].chars_sent, 11); // the next text_offset: code points
    assert_true(k.choices[0].first_sent);

    bool finish_now = false;
    assert_int_equal(tdm_oai_call_chunk(&k, 0, &json, &finish_now), TDM_OK);
    j = cJSON_Parse(json);
    c = choice0(j);
    assert_string_equal(cJSON_GetObjectItem(c, "text")->valuestring, " again");
    assert_null(cJSON_GetObjectItem(c, "prompt_token_ids")); // went out once
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(c, "token_ids")), t);
    cJSON_Delete(j);
    free(json);
    tdm_oai_call_fini(&k);

    // An empty prompt text has no echo chunk: ids the tokenizer cannot decode
    // (a model vocabulary padded past the tokenizer's) echo "".
    struct tdm_oai_model_info padded = info;
    padded.vocab_size = info.vocab_size + 64;
    char body[128];
    snprintf(body, sizeof body, "{\"prompt\":[%d],\"max_tokens\":4,\"echo\":true,\"stream\":true}",
             info.vocab_size + 10);
    assert_int_equal(tdm_oai_call_init(&k, TDM_OAI_COMPLETION, body, strlen(body), &padded, tok,
                                       NULL, "", NULL, &e),
                     TDM_OK);
    assert_int_equal(k.prompts[0].text_len, 0);
    assert_int_equal(tdm_oai_call_echo_chunk(&k, 0, &json), TDM_OK);
    assert_null(json);
    assert_int_equal(k.choices[0].chars_sent, 0);
    tdm_oai_call_fini(&k);
}

// A prompt's logprobs as a generator brings them: entry i has logprob
// -0.25 i, rank i, and the alternatives (the token itself, then id 5).
struct plp_fixture {
    float lp[256];
    int32_t rank[256];
    struct tdm_token_logprob top[256 * 2];
    struct tdm_prompt_logprobs pl;
};

static void plp_make(struct plp_fixture *f, const struct tdm_oai_tokenized_prompt *p)
{
    assert_true(p->n <= 256);
    memset(f, 0, sizeof *f);
    for (size_t i = 1; i < p->n; i++) {
        f->lp[i] = -0.25f * (float)i;
        f->rank[i] = (int32_t)i;
        f->top[2 * i] = (struct tdm_token_logprob){p->ids[i], f->lp[i]};
        f->top[2 * i + 1] = (struct tdm_token_logprob){5, -9.0f};
    }
    f->pl = (struct tdm_prompt_logprobs){
        .n = (int)p->n, .num_top = 2, .logprob = f->lp, .rank = f->rank, .top = f->top};
}

// Prompt logprobs: asked of each prompt's first choice only, with the larger
// top count; brought once, they give every choice of the prompt its echoed
// entries (first null, offsets from 0 through the output, top cut to the
// request's logprobs) and the prompt_logprobs field (ranks; the token, then
// its alternatives); the streamed echo chunk waits for them and carries them.
static void test_prompt_logprobs_out(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"Hello world\",\"max_tokens\":2,\"echo\":true,"
                           "\"logprobs\":1,\"prompt_logprobs\":2,\"n\":2,\"temperature\":1}",
                           NULL, &e),
                     TDM_OK);
    assert_int_equal(tdm_oai_call_prompt_lp(&k, 0), 2);
    assert_int_equal(tdm_oai_call_prompt_lp(&k, 1), -1);
    const struct tdm_oai_tokenized_prompt *p = &k.prompts[0];
    size_t np = p->n;
    assert_true(np >= 2);
    struct plp_fixture f;
    plp_make(&f, p);
    int32_t tok7 = 7;
    float lp7 = -1.5f;
    struct tdm_oai_gen_chunk g = {.tokens = &tok7,
                                  .n = 1,
                                  .logprobs = &lp7,
                                  .prompt_logprobs = &f.pl,
                                  .finished = true,
                                  .reason = TDM_FINISH_LENGTH,
                                  .stop_token = -1};
    bool stopped = false;
    assert_int_equal(tdm_oai_call_take(&k, 1,
                                       &(struct tdm_oai_gen_chunk){.tokens = &tok7,
                                                                   .n = 1,
                                                                   .logprobs = &lp7,
                                                                   .finished = true,
                                                                   .reason = TDM_FINISH_LENGTH,
                                                                   .stop_token = -1},
                                       2, NULL, &stopped),
                     TDM_OK);
    assert_int_equal(tdm_oai_call_take(&k, 0, &g, 2, NULL, &stopped), TDM_OK);
    char *body = tdm_oai_call_body(&k);
    assert_non_null(body);
    cJSON *j = cJSON_Parse(body);
    free(body);
    for (int c = 0; c < 2; c++) {
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), c);
        const cJSON *lps = cJSON_GetObjectItem(ch, "logprobs");
        const cJSON *tl = cJSON_GetObjectItem(lps, "token_logprobs");
        const cJSON *tops = cJSON_GetObjectItem(lps, "top_logprobs");
        const cJSON *off = cJSON_GetObjectItem(lps, "text_offset");
        assert_int_equal(cJSON_GetArraySize(tl), (int)np + 1);
        assert_true(cJSON_IsNull(cJSON_GetArrayItem(tl, 0)));
        assert_true(cJSON_IsNull(cJSON_GetArrayItem(tops, 0)));
        assert_true(cJSON_GetArrayItem(tl, 1)->valuedouble == -0.25);
        assert_true(cJSON_GetArrayItem(tl, (int)np)->valuedouble == -1.5);
        assert_int_equal(cJSON_GetArrayItem(off, 0)->valueint, 0);
        // top cut to logprobs 1: the token itself is the one alternative kept
        assert_int_equal(cJSON_GetArraySize(cJSON_GetArrayItem(tops, 1)), 1);
        int last = 0;
        for (int i = 0; i < cJSON_GetArraySize(off); i++) {
            assert_true(cJSON_GetArrayItem(off, i)->valueint >= last);
            last = cJSON_GetArrayItem(off, i)->valueint;
        }
        assert_int_equal(last, 11); // "Hello world": the output's offset follows the prompt's
        const cJSON *pl = cJSON_GetObjectItem(ch, "prompt_logprobs");
        assert_int_equal(cJSON_GetArraySize(pl), (int)np);
        assert_true(cJSON_IsNull(cJSON_GetArrayItem(pl, 0)));
        char key[16];
        snprintf(key, sizeof key, "%d", (int)p->ids[1]);
        const cJSON *e1 = cJSON_GetObjectItem(cJSON_GetArrayItem(pl, 1), key);
        assert_non_null(e1);
        assert_int_equal(cJSON_GetObjectItem(e1, "rank")->valueint, 1);
        assert_true(cJSON_GetObjectItem(e1, "logprob")->valuedouble == -0.25);
        assert_true(cJSON_IsString(cJSON_GetObjectItem(e1, "decoded_token")));
        const cJSON *e5 = cJSON_GetObjectItem(cJSON_GetArrayItem(pl, 1), "5");
        assert_int_equal(cJSON_GetObjectItem(e5, "rank")->valueint, 2);
    }
    cJSON_Delete(j);
    tdm_oai_call_fini(&k);

    // Streamed echo with logprobs: the prompt's chunk waits for them.
    assert_int_equal(start(&k, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"Hello world\",\"max_tokens\":2,\"echo\":true,"
                           "\"logprobs\":0,\"stream\":true}",
                           NULL, &e),
                     TDM_OK);
    assert_int_equal(tdm_oai_call_prompt_lp(&k, 0), 0);
    assert_false(tdm_oai_call_echo_ready(&k, 0));
    plp_make(&f, &k.prompts[0]);
    g.finished = false;
    assert_int_equal(tdm_oai_call_take(&k, 0, &g, 2, NULL, &stopped), TDM_OK);
    assert_true(tdm_oai_call_echo_ready(&k, 0));
    char *json = NULL;
    assert_int_equal(tdm_oai_call_echo_chunk(&k, 0, &json), TDM_OK);
    j = cJSON_Parse(json);
    free(json);
    const cJSON *lps = cJSON_GetObjectItem(choice0(j), "logprobs");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lps, "tokens")), (int)np);
    assert_true(cJSON_IsNull(cJSON_GetArrayItem(cJSON_GetObjectItem(lps, "token_logprobs"), 0)));
    assert_int_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(lps, "text_offset"), 0)->valueint, 0);
    assert_null(cJSON_GetObjectItem(choice0(j), "prompt_logprobs"));
    cJSON_Delete(j);
    assert_true(k.choices[0].echo_sent);
    tdm_oai_call_fini(&k);

    // Chat (vLLM's chat prompt_logprobs): asked of the first choice, they go
    // in the response's top-level prompt_logprobs, not in a choice.
    struct tdm_chat_template *t = NULL;
    char err[256];
    assert_int_equal(tdm_chat_template_new(&t, NULL, "qwen2", err, sizeof err), TDM_OK);
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1,"
                       "\"prompt_logprobs\":1,\"n\":2,\"temperature\":1}";
    assert_int_equal(
        tdm_oai_call_init(&k, TDM_OAI_CHAT, chat, strlen(chat), &info, tok, t, NULL, NULL, &e),
        TDM_OK);
    tdm_chat_template_free(t);
    assert_int_equal(tdm_oai_call_prompt_lp(&k, 0), 1);
    assert_int_equal(tdm_oai_call_prompt_lp(&k, 1), -1);
    plp_make(&f, &k.prompts[0]);
    g.finished = true;
    assert_int_equal(tdm_oai_call_take(&k, 0, &g, 2, NULL, &stopped), TDM_OK);
    assert_int_equal(tdm_oai_call_take(&k, 1,
                                       &(struct tdm_oai_gen_chunk){.tokens = &tok7,
                                                                   .n = 1,
                                                                   .finished = true,
                                                                   .reason = TDM_FINISH_LENGTH,
                                                                   .stop_token = -1},
                                       2, NULL, &stopped),
                     TDM_OK);
    body = tdm_oai_call_body(&k);
    j = cJSON_Parse(body);
    free(body);
    assert_null(cJSON_GetObjectItem(choice0(j), "prompt_logprobs"));
    const cJSON *pl = cJSON_GetObjectItem(j, "prompt_logprobs");
    assert_int_equal(cJSON_GetArraySize(pl), (int)k.prompts[0].n);
    assert_true(cJSON_IsNull(cJSON_GetArrayItem(pl, 0)));
    char key[16];
    snprintf(key, sizeof key, "%d", (int)k.prompts[0].ids[1]);
    const cJSON *e1 = cJSON_GetObjectItem(cJSON_GetArrayItem(pl, 1), key);
    assert_int_equal(cJSON_GetObjectItem(e1, "rank")->valueint, 1);
    assert_true(cJSON_GetObjectItem(e1, "logprob")->valuedouble == -0.25);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetArrayItem(pl, 1)), 1); // top 1 is the token
    cJSON_Delete(j);
    tdm_oai_call_fini(&k);
}

// ---- chat: continue_final_message, echo, the answer's role
// --------------------------------------- A chat call on template text (NULL: the built-in qwen2).
static int start_chat_on(struct tdm_oai_call *k, const char *tmpl, const char *body,
                         struct tdm_oai_error *e)
{
    struct tdm_chat_template *t = NULL;
    char err[256];
    assert_int_equal(tdm_chat_template_new(&t, tmpl, tmpl ? NULL : "qwen2", err, sizeof err),
                     TDM_OK);
    memset(e, 0, sizeof *e);
    int rc = tdm_oai_call_init(k, TDM_OAI_CHAT, body, strlen(body), &info, tok, t, NULL, NULL, e);
    tdm_chat_template_free(t);
    return rc;
}

static bool ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), m = strlen(tail);
    return n >= m && strcmp(s + n - m, tail) == 0;
}

// continue_final_message cuts the prompt after the final message's content
// (HF's rule: its last occurrence, else stripped, else 400); chat echo puts
// the final message's content before the answer's when its role is the
// answer's (vLLM), in the body and as the stream's first content delta; the
// answer's role continues the final message without add_generation_prompt.
static void test_chat_continue_and_echo(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
#define ASSIST(content, extra)                                                                     \
    "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\","               \
    "\"content\":" content "}],\"max_tokens\":4" extra "}"
    assert_int_equal(start_chat_on(&k, NULL, ASSIST("\"The answer is\"", ""), &e), TDM_OK);
    assert_true(ends_with(k.prompts[0].text, "The answer is<|im_end|>\n<|im_start|>assistant\n"));
    tdm_oai_call_fini(&k);
    const char *cont = ",\"add_generation_prompt\":false,\"continue_final_message\":true";
    char body[512];
    snprintf(body, sizeof body, ASSIST("\"The answer is\"", "%s"), cont);
    assert_int_equal(start_chat_on(&k, NULL, body, &e), TDM_OK);
    assert_true(ends_with(k.prompts[0].text, "<|im_start|>assistant\nThe answer is"));
    // Its ids are those of that text.
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(
        tdm_tok_encode(tok, k.prompts[0].text, strlen(k.prompts[0].text), false, &ids, &n), TDM_OK);
    assert_int_equal(n, k.prompts[0].n);
    assert_memory_equal(ids, k.prompts[0].ids, n * sizeof *ids);
    free(ids);
    tdm_oai_call_fini(&k);
    // A template that strips the content: the stripped content's end.
    const char *trim = "{% for m in messages %}{{ m.content | trim }}|{% endfor %}";
    snprintf(body, sizeof body, ASSIST("\"  x y  \"", "%s"), cont);
    assert_int_equal(start_chat_on(&k, trim, body, &e), TDM_OK);
    assert_string_equal(k.prompts[0].text, "hi|x y");
    tdm_oai_call_fini(&k);
    // A template that drops it: HF's 400.
    assert_int_equal(start_chat_on(&k, "{% for m in messages %}{{ m.role }}{% endfor %}", body, &e),
                     TDM_EINVAL);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "continue_final_message is set but the final message does "
                                      "not appear in the chat"));
    tdm_oai_call_fini(&k);

    // Echo, continuing the assistant's message: its content, then the answer.
    snprintf(body, sizeof body, ASSIST("\"Once\"", "%s,\"echo\":true"), cont);
    assert_int_equal(start_chat_on(&k, NULL, body, &e), TDM_OK);
    assert_int_equal(tdm_oai_call_prompt_lp(&k, 0), -1); // no prompt logprobs for a chat echo
    char *json = NULL;
    assert_int_equal(tdm_oai_call_echo_chunk(&k, 0, &json), TDM_OK);
    cJSON *j = cJSON_Parse(json);
    free(json);
    const cJSON *delta = cJSON_GetObjectItem(choice0(j), "delta");
    assert_string_equal(cJSON_GetObjectItem(delta, "content")->valuestring, "Once");
    assert_null(cJSON_GetObjectItem(delta, "role"));
    cJSON_Delete(j);
    feed(&k, 0, " upon");
    finish(&k, 0);
    char *out = tdm_oai_call_body(&k);
    j = cJSON_Parse(out);
    free(out);
    const cJSON *msg = cJSON_GetObjectItem(choice0(j), "message");
    assert_string_equal(cJSON_GetObjectItem(msg, "content")->valuestring, "Once upon");
    assert_string_equal(cJSON_GetObjectItem(msg, "role")->valuestring, "assistant");
    cJSON_Delete(j);
    tdm_oai_call_fini(&k);
    // A list of parts is echoed joined by newlines; a new assistant message
    // after a user's echoes nothing.
    assert_int_equal(start_chat_on(&k, NULL,
                                   ASSIST("[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\","
                                          "\"text\":\"b\"}]",
                                          ",\"add_generation_prompt\":false,\"echo\":true"),
                                   &e),
                     TDM_OK);
    assert_string_equal(k.prompts[0].text, "a\nb");
    tdm_oai_call_fini(&k);
    assert_int_equal(
        start_chat_on(&k, NULL,
                      "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"echo\":true}", &e),
        TDM_OK);
    assert_string_equal(k.prompts[0].text, "");
    tdm_oai_call_fini(&k);
    // Without add_generation_prompt the answer continues the final message's
    // role (vLLM's get_chat_request_role): "user" here, in the body and the
    // stream's role chunk.
    assert_int_equal(start_chat_on(&k, NULL,
                                   "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                                   "\"add_generation_prompt\":false,\"echo\":true}",
                                   &e),
                     TDM_OK);
    assert_string_equal(k.prompts[0].text, "hi");
    json = tdm_oai_chat_role_chunk(&k.resp, 0);
    assert_non_null(strstr(json, "\"role\":\"user\""));
    free(json);
    feed(&k, 0, " there");
    finish(&k, 0);
    out = tdm_oai_call_body(&k);
    j = cJSON_Parse(out);
    free(out);
    msg = cJSON_GetObjectItem(choice0(j), "message");
    assert_string_equal(cJSON_GetObjectItem(msg, "role")->valuestring, "user");
    assert_string_equal(cJSON_GetObjectItem(msg, "content")->valuestring, "hi there");
    cJSON_Delete(j);
    tdm_oai_call_fini(&k);
#undef ASSIST
}

// A request's own chat_template (--trust-request-chat-template) renders the
// chat with the server template's special tokens, also where the server has
// no template; one that does not compile is a 400 naming chat_template.
static void test_chat_own_template(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    info.trust_request_chat_template = true;
    struct tdm_chat_template *t = NULL;
    char err[256];
    assert_int_equal(tdm_chat_template_new(&t, "{{ bos_token }}server", NULL, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_chat_template_set_tokens(t, "<B>", NULL, NULL), TDM_OK);
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,"
                       "\"chat_template\":\"{{ bos_token }}|{% for m in messages %}{{ m.content }}"
                       "{% endfor %}\"}";
    memset(&e, 0, sizeof e);
    assert_int_equal(
        tdm_oai_call_init(&k, TDM_OAI_CHAT, body, strlen(body), &info, tok, t, NULL, NULL, &e),
        TDM_OK);
    assert_string_equal(k.prompts[0].text, "<B>|hi");
    tdm_oai_call_fini(&k);
    // No server template: the request's alone (no special tokens to lend).
    const char *plain =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,"
        "\"chat_template\":\"{% for m in messages %}{{ m.content }}!{% endfor %}\"}";
    assert_int_equal(tdm_oai_call_init(&k, TDM_OAI_CHAT, plain, strlen(plain), &info, tok, NULL,
                                       "none", NULL, &e),
                     TDM_OK);
    assert_string_equal(k.prompts[0].text, "hi!");
    tdm_oai_call_fini(&k);
    const char *bad = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                      "\"chat_template\":\"{% for %}\"}";
    assert_int_equal(
        tdm_oai_call_init(&k, TDM_OAI_CHAT, bad, strlen(bad), &info, tok, t, NULL, NULL, &e),
        TDM_EINVAL);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "chat_template");
    tdm_oai_call_fini(&k);
    tdm_chat_template_free(t);
    info.trust_request_chat_template = false;
}

// ---- tool calls ---------------------------------------------------------------------------------
#define TOOL_BODY(extra)                                                                           \
    "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],\"tools\":[{\"type\":"  \
    "\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","     \
    "\"properties\":{\"city\":{\"type\":\"string\"}}}}}],\"max_tokens\":64" extra "}"
#define TOOL_OUT                                                                                   \
    "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"      \
    "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "            \
    "\"Oslo\"}}\n"                                                                                 \
    "</tool_call>"

static int start_chat(struct tdm_oai_call *k, const char *body, struct tdm_oai_error *e)
{
    struct tdm_chat_template *t = NULL;
    char err[256];
    assert_int_equal(tdm_chat_template_new(&t, NULL, "qwen2", err, sizeof err), TDM_OK);
    int rc = tdm_oai_call_init(k, TDM_OAI_CHAT, body, strlen(body), &info, tok, t, NULL, NULL, e);
    // The prompt is rendered with the tools (Qwen2.5's system block).
    if (rc == TDM_OK)
        assert_non_null(strstr(k->prompts[0].text, "get_weather"));
    tdm_chat_template_free(t);
    return rc;
}

static void test_tool_calls_body(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    info.tool_parser = TDM_OAI_TOOL_PARSER_HERMES;
    info.max_model_len = 4096; // the tools block makes a long prompt
    assert_int_equal(start_chat(&k, TOOL_BODY(""), &e), TDM_OK);
    feed(&k, 0, TOOL_OUT);
    bool stopped = false;
    assert_int_equal(tdm_oai_asm_finish(&k.choices[0], TDM_FINISH_STOP, -1, 0, NULL, &stopped),
                     TDM_OK);
    char *body = tdm_oai_call_body(&k);
    cJSON *j = cJSON_Parse(body);
    const cJSON *c = choice0(j), *msg = cJSON_GetObjectItem(c, "message");
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "tool_calls");
    assert_string_equal(cJSON_GetObjectItem(msg, "content")->valuestring, "Sure.\n");
    const cJSON *calls = cJSON_GetObjectItem(msg, "tool_calls");
    assert_int_equal(cJSON_GetArraySize(calls), 2);
    const cJSON *c1 = cJSON_GetArrayItem(calls, 1), *fn = cJSON_GetObjectItem(c1, "function");
    assert_string_equal(cJSON_GetObjectItem(c1, "type")->valuestring, "function");
    assert_memory_equal(cJSON_GetObjectItem(c1, "id")->valuestring, "chatcmpl-tool-", 14);
    assert_string_equal(cJSON_GetObjectItem(fn, "name")->valuestring, "get_weather");
    assert_string_equal(cJSON_GetObjectItem(fn, "arguments")->valuestring, "{\"city\": \"Oslo\"}");
    cJSON_Delete(j);
    free(body);
    tdm_oai_call_fini(&k);

    // tool_choice "none": the same text is content, finish as generated.
    assert_int_equal(start_chat(&k, TOOL_BODY(",\"tool_choice\":\"none\""), &e), TDM_OK);
    feed(&k, 0, TOOL_OUT);
    finish(&k, 0);
    body = tdm_oai_call_body(&k);
    j = cJSON_Parse(body);
    c = choice0(j);
    msg = cJSON_GetObjectItem(c, "message");
    assert_string_equal(cJSON_GetObjectItem(msg, "content")->valuestring, TOOL_OUT);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(msg, "tool_calls")), 0);
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "length");
    cJSON_Delete(j);
    free(body);
    tdm_oai_call_fini(&k);

    // "required": the sampler gets the forcing schema; the output (what it
    // allows) becomes the calls, content null, finish as generated.
    assert_int_equal(start_chat(&k, TOOL_BODY(",\"tool_choice\":\"required\""), &e), TDM_OK);
    assert_int_equal(k.req.sampling.constraint, TDM_CONSTRAINT_JSON_SCHEMA);
    assert_non_null(strstr(k.req.sampling.constraint_text, "\"minItems\":1"));
    feed(&k, 0, "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}]");
    assert_int_equal(tdm_oai_asm_finish(&k.choices[0], TDM_FINISH_STOP, -1, 0, NULL, &stopped),
                     TDM_OK);
    body = tdm_oai_call_body(&k);
    j = cJSON_Parse(body);
    c = choice0(j);
    msg = cJSON_GetObjectItem(c, "message");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(msg, "content")));
    fn = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(msg, "tool_calls"), 0),
                             "function");
    assert_string_equal(cJSON_GetObjectItem(fn, "arguments")->valuestring, "{\"city\": \"Rome\"}");
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "stop");
    cJSON_Delete(j);
    free(body);
    tdm_oai_call_fini(&k);
    info.tool_parser = TDM_OAI_TOOL_PARSER_NONE;
    info.max_model_len = 256;
}

static void test_tool_calls_stream(void **state)
{
    (void)state;
    struct tdm_oai_call k;
    struct tdm_oai_error e;
    info.tool_parser = TDM_OAI_TOOL_PARSER_HERMES;
    info.max_model_len = 4096; // the tools block makes a long prompt
    assert_int_equal(start_chat(&k, TOOL_BODY(",\"stream\":true"), &e), TDM_OK);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tdm_tok_encode(tok, TOOL_OUT, strlen(TOOL_OUT), false, &ids, &n), TDM_OK);
    char content[512] = "", args[2][128] = {"", ""}, names[2][32] = {"", ""};
    char ids_seen[2][64] = {"", ""};
    const char *finish_reason = NULL;
    cJSON *last = NULL;
    for (size_t t = 0; t <= n; t++) {
        bool stopped = false;
        if (t < n)
            assert_int_equal(
                tdm_oai_asm_token(&k.choices[0], ids[t], -0.5f, NULL, 0, false, &stopped), TDM_OK);
        else
            assert_int_equal(
                tdm_oai_asm_finish(&k.choices[0], TDM_FINISH_STOP, -1, 0, NULL, &stopped), TDM_OK);
        char *json = NULL;
        bool finish_now = false;
        assert_int_equal(tdm_oai_call_chunk(&k, 0, &json, &finish_now), TDM_OK);
        if (json == NULL)
            continue;
        tdm_oai_asm_sent(&k.choices[0], finish_now);
        cJSON *j = cJSON_Parse(json);
        free(json);
        const cJSON *delta = cJSON_GetObjectItem(choice0(j), "delta");
        const cJSON *ct = cJSON_GetObjectItem(delta, "content");
        if (ct) {
            assert_null(strstr(ct->valuestring, "<")); // no half marker as content
            strcat(content, ct->valuestring);
        }
        const cJSON *tc;
        cJSON_ArrayForEach(tc, cJSON_GetObjectItem(delta, "tool_calls"))
        {
            int idx = cJSON_GetObjectItem(tc, "index")->valueint;
            assert_true(idx == 0 || idx == 1);
            const cJSON *fn = cJSON_GetObjectItem(tc, "function");
            const cJSON *id = cJSON_GetObjectItem(tc, "id");
            if (id) {
                assert_string_equal(ids_seen[idx], ""); // once per call
                snprintf(ids_seen[idx], sizeof ids_seen[idx], "%s", id->valuestring);
                assert_string_equal(cJSON_GetObjectItem(tc, "type")->valuestring, "function");
                snprintf(names[idx], sizeof names[idx], "%s",
                         cJSON_GetObjectItem(fn, "name")->valuestring);
            } else {
                assert_string_not_equal(ids_seen[idx], ""); // arguments after the header
                assert_null(cJSON_GetObjectItem(fn, "name"));
            }
            strcat(args[idx], cJSON_GetObjectItem(fn, "arguments")->valuestring);
        }
        cJSON_Delete(last);
        last = j;
    }
    free(ids);
    finish_reason = cJSON_GetObjectItem(choice0(last), "finish_reason")->valuestring;
    assert_string_equal(finish_reason, "tool_calls");
    assert_string_equal(content, "Sure.\n");
    assert_string_equal(names[0], "get_weather");
    assert_string_equal(names[1], "get_weather");
    assert_string_equal(args[0], "{\"city\": \"Paris\"}");
    assert_string_equal(args[1], "{\"city\": \"Oslo\"}");
    assert_string_not_equal(ids_seen[0], ids_seen[1]);
    cJSON_Delete(last);
    tdm_oai_call_fini(&k);
    info.tool_parser = TDM_OAI_TOOL_PARSER_NONE;
    info.max_model_len = 256;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_init_choices_and_ids),
        cmocka_unit_test(test_init_errors_and_echo_only),
        cmocka_unit_test(test_done_failed_usage_body),
        cmocka_unit_test(test_stream_chunks_usage_per_prompt),
        cmocka_unit_test(test_echo_chunk),
        cmocka_unit_test(test_prompt_logprobs_out),
        cmocka_unit_test(test_chat_continue_and_echo),
        cmocka_unit_test(test_chat_own_template),
        cmocka_unit_test(test_tool_calls_body),
        cmocka_unit_test(test_tool_calls_stream),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
