// SPDX-License-Identifier: Apache-2.0
// Tests of the response assembler (the per-choice text pipeline both servers
// use) with the Qwen2 tokenizer from the shared folder (skipped without it):
// a stop string ends the choice and is reported once, min_tokens defers it,
// the EOS token that ended a request adds no text, stop_reason ids,
// logprobs and token ids are kept until a chunk is sent, text_offset advances,
// an error finish keeps its message, invalid UTF-8 becomes U+FFFD before
// stop matching; /tokenize, /detokenize run end to end (bodies, errors); and
// a request's prompts become token ids (echo text, max_tokens, errors).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test_skip.h"
#include <sys/stat.h>

#include "core.h"
#include "openai.h"
#include "tokenizer.h"

#define TOK_DIR TANDEM_SHARED_DIR "/models/qwen2-tokenizer"

static struct tdm_tokenizer *tok;

static int setup(void **state)
{
    (void)state;
    struct stat st;
    if (stat(TOK_DIR "/tokenizer.json", &st) != 0)
        return 0;
    char err[256];
    if (tdm_tok_load(&tok, TOK_DIR, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tokenizer: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_tok_free(tok);
    return 0;
}

static void request_init(struct tdm_oai_request *rq)
{
    memset(rq, 0, sizeof *rq);
    rq->kind = TDM_OAI_COMPLETION;
    rq->n = 1;
    rq->skip_special_tokens = true;
    rq->sampling.logprobs = -1;
}

// Feeds text's tokens one by one; returns the index of the token at which a
// stop string completed, or -1.
static int feed(struct tdm_oai_asm *a, const char *text)
{
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tdm_tok_encode(tok, text, strlen(text), false, &ids, &n), TDM_OK);
    int hit = -1;
    for (size_t i = 0; i < n; i++) {
        bool stopped = false;
        assert_int_equal(tdm_oai_asm_token(a, ids[i], -0.5f, NULL, 0, false, &stopped), TDM_OK);
        if (stopped) {
            assert_int_equal(hit, -1); // reported once
            hit = (int)i;
        }
    }
    free(ids);
    return hit;
}

static void test_stop_string(void **state)
{
    (void)state;
    if (tok == NULL)
        TDM_SKIP("the Qwen2 tokenizer in ../shared/models is absent");
    struct tdm_oai_request rq;
    request_init(&rq);
    char stop[] = " world";
    rq.stop[0] = stop;
    rq.n_stop = 1;
    struct tdm_oai_asm a;
    assert_int_equal(tdm_oai_asm_init(&a, &rq, tok, 3, 1), TDM_OK);
    assert_true(feed(&a, "Hello world and more") >= 0);
    assert_true(a.done);
    assert_int_equal(a.finish, TDM_FINISH_STOP);
    assert_ptr_equal(a.stop_str, stop);
    assert_string_equal(a.text.p, "Hello");
    int before = a.completion_tokens;
    bool stopped = false;
    assert_int_equal(tdm_oai_asm_token(&a, 11, 0, NULL, 0, false, &stopped), TDM_OK);
    assert_false(stopped);
    assert_int_equal(a.completion_tokens, before); // ignored once done
    struct tdm_oai_choice oc;
    tdm_oai_asm_choice(&a, true, NULL, 0, &oc);
    assert_int_equal(oc.index, 3);
    assert_int_equal(oc.finish, TDM_FINISH_STOP);
    assert_int_equal(oc.stop_token, -1);
    tdm_oai_asm_fini(&a);

    // min_tokens: no match before that many tokens exist; the text flows on.
    rq.sampling.min_tokens = 50;
    assert_int_equal(tdm_oai_asm_init(&a, &rq, tok, 0, 0), TDM_OK);
    assert_int_equal(feed(&a, "Hello world and more"), -1);
    bool s2 = false;
    assert_int_equal(tdm_oai_asm_finish(&a, TDM_FINISH_LENGTH, -1, 0, NULL, &s2), TDM_OK);
    assert_true(a.done);
    assert_int_equal(a.finish, TDM_FINISH_LENGTH);
    assert_string_equal(a.text.p, "Hello world and more");
    // The body's choice: with echo the prompt comes first and offsets follow it.
    struct tdm_strbuf joined = {0};
    struct tdm_oai_choice oc2;
    assert_int_equal(tdm_oai_asm_body_choice(&a, true, "Say: \xC3\xA9", 7, NULL, 0, &joined, &oc2),
                     TDM_OK);
    assert_int_equal(oc2.text_len, 7 + strlen("Hello world and more"));
    assert_memory_equal(oc2.text, "Say: \xC3\xA9Hello world and more", oc2.text_len);
    assert_int_equal(oc2.text_offset, 6); // code points of the prompt
    assert_int_equal(oc2.finish, TDM_FINISH_LENGTH);
    tdm_strbuf_fini(&joined);
    assert_int_equal(tdm_oai_asm_body_choice(&a, false, "x", 1, NULL, 0, &joined, &oc2), TDM_OK);
    assert_string_equal(oc2.text, "Hello world and more");
    assert_int_equal(oc2.text_offset, 0);
    assert_null(joined.p);
    // The whole body: every choice after its prompt (echo), usage as given.
    struct tdm_oai_response resp;
    tdm_oai_response_init(&resp, TDM_OAI_COMPLETION, "m", "x");
    struct tdm_oai_tokenized_prompt prompts[1] = {{.text = (char *)"P:", .text_len = 2}};
    const struct tdm_oai_asm *asms[2] = {&a, &a};
    struct tdm_oai_usage usage = {2, 8};
    char *body = tdm_oai_asm_body(&resp, true, asms, 2, prompts, &usage);
    assert_non_null(body);
    assert_non_null(strstr(body, "\"text\":\"P:Hello world and more\""));
    assert_non_null(strstr(body, "\"completion_tokens\":8"));
    free(body);
    tdm_oai_asm_fini(&a);
}

static void test_stream_chunks(void **state)
{
    (void)state;
    if (tok == NULL)
        TDM_SKIP("the Qwen2 tokenizer in ../shared/models is absent");
    struct tdm_oai_request rq;
    request_init(&rq);
    rq.logprobs = true;
    rq.return_token_ids = true;
    struct tdm_oai_response resp;
    tdm_oai_response_init(&resp, TDM_OAI_COMPLETION, "m", "cmpl-x");
    struct tdm_oai_asm a;
    assert_int_equal(tdm_oai_asm_init(&a, &rq, tok, 0, 0), TDM_OK);
    char *json = NULL;
    bool finish_now = true;
    const int32_t prompt[2] = {9707, 1879};
    // Nothing yet: no chunk.
    assert_int_equal(tdm_oai_asm_stream_chunk(&a, &resp, prompt, 2, NULL, &json, &finish_now),
                     TDM_OK);
    assert_null(json);
    assert_false(finish_now);
    assert_int_equal(feed(&a, "Hi there"), -1);
    assert_true(a.n_lps > 0);
    assert_int_equal(a.n_ids, a.n_lps);
    struct tdm_oai_choice oc;
    tdm_oai_asm_choice(&a, false, prompt, 2, &oc);
    assert_int_equal(oc.n_prompt_token_ids, 2);
    assert_int_equal(oc.n_logprobs, a.n_lps);
    assert_int_equal(tdm_oai_asm_stream_chunk(&a, &resp, prompt, 2, NULL, &json, &finish_now),
                     TDM_OK);
    assert_non_null(json);
    assert_false(finish_now);
    assert_non_null(strstr(json, "\"prompt_token_ids\""));
    free(json);
    size_t len = a.text.len;
    tdm_oai_asm_sent(&a, finish_now);
    assert_int_equal(a.chars_sent, len); // ASCII: bytes = code points
    assert_int_equal(a.text.len, 0);
    assert_int_equal(a.n_lps, 0);
    assert_int_equal(a.n_ids, 0);
    assert_true(a.first_sent);
    // The EOS that ended the request: counted, no text. Then the finish chunk.
    int32_t eos = tdm_tok_eos_id(tok);
    bool stopped = false;
    assert_int_equal(tdm_oai_asm_token(&a, eos, 0, NULL, 0, true, &stopped), TDM_OK);
    assert_int_equal(a.text.len, 0);
    assert_int_equal(tdm_oai_asm_finish(&a, TDM_FINISH_STOP, -1, 0, NULL, &stopped), TDM_OK);
    assert_int_equal(tdm_oai_asm_stream_chunk(&a, &resp, prompt, 2, NULL, &json, &finish_now),
                     TDM_OK);
    assert_non_null(json);
    assert_true(finish_now);
    assert_non_null(strstr(json, "\"finish_reason\":\"stop\""));
    assert_null(strstr(json, "\"prompt_token_ids\""));
    free(json);
    tdm_oai_asm_sent(&a, finish_now);
    assert_true(a.reported);
    assert_int_equal(tdm_oai_asm_stream_chunk(&a, &resp, prompt, 2, NULL, &json, &finish_now),
                     TDM_OK);
    assert_null(json);
    tdm_oai_asm_fini(&a);
}

static void test_errors_and_stop_ids(void **state)
{
    (void)state;
    if (tok == NULL)
        TDM_SKIP("the Qwen2 tokenizer in ../shared/models is absent");
    struct tdm_oai_request rq;
    request_init(&rq);
    struct tdm_oai_asm a;
    assert_int_equal(tdm_oai_asm_init(&a, &rq, tok, 0, 0), TDM_OK);
    bool stopped = false;
    assert_int_equal(
        tdm_oai_asm_finish(&a, TDM_FINISH_ERROR, -1, TDM_ETIMEDOUT, "", &stopped), TDM_OK);
    assert_int_equal(a.error, TDM_ETIMEDOUT);
    assert_string_equal(a.message, tdm_strerror(TDM_ETIMEDOUT));
    char *json = NULL;
    bool finish_now = false;
    // An error finish is the caller's error event, not a chunk.
    assert_int_equal(tdm_oai_asm_stream_chunk(&a, NULL, NULL, 0, NULL, &json, &finish_now),
                     TDM_OK);
    assert_null(json);
    tdm_oai_asm_reset_finish(&a);
    assert_false(a.done);
    tdm_oai_asm_fail(&a, TDM_ETRANSPORT, "worker %s lost", "d0");
    assert_string_equal(a.message, "worker d0 lost");
    assert_int_equal(a.finish, TDM_FINISH_ERROR);
    tdm_oai_asm_fini(&a);

    // Text that came before the error (in the same pump) still goes out, as a
    // chunk without a finish; then nothing: the error is the caller's event.
    struct tdm_oai_response resp;
    tdm_oai_response_init(&resp, TDM_OAI_COMPLETION, "m", "cmpl-e");
    assert_int_equal(tdm_oai_asm_init(&a, &rq, tok, 0, 0), TDM_OK);
    assert_int_equal(feed(&a, "Hi there"), -1);
    tdm_oai_asm_fail(&a, TDM_ETRANSPORT, "tokens were lost");
    finish_now = true;
    assert_int_equal(tdm_oai_asm_stream_chunk(&a, &resp, NULL, 0, NULL, &json, &finish_now),
                     TDM_OK);
    assert_non_null(json);
    assert_false(finish_now);
    assert_non_null(strstr(json, "Hi there"));
    assert_null(strstr(json, "\"finish_reason\":\""));
    free(json);
    tdm_oai_asm_sent(&a, finish_now);
    assert_false(a.reported);
    assert_int_equal(tdm_oai_asm_stream_chunk(&a, &resp, NULL, 0, NULL, &json, &finish_now),
                     TDM_OK);
    assert_null(json);
    assert_true(finish_now);
    tdm_oai_asm_fini(&a);

    struct tdm_sampling_params sp;
    memset(&sp, 0, sizeof sp);
    sp.stop_token_ids[0] = 42;
    sp.num_stop_token_ids = 1;
    struct tdm_generation_config gen;
    memset(&gen, 0, sizeof gen);
    gen.eos_token_ids[0] = 7;
    gen.eos_token_ids[1] = 9;
    gen.num_eos_token_ids = 2;
    assert_true(tdm_oai_is_stop_id(&sp, 9, &gen, 42));
    assert_true(tdm_oai_is_stop_id(&sp, 9, &gen, 7));
    assert_false(tdm_oai_is_stop_id(&sp, 9, &gen, 9)); // the tokenizer's EOS: null
    assert_false(tdm_oai_is_stop_id(&sp, 9, NULL, 7));
    assert_false(tdm_oai_is_stop_id(&sp, 9, &gen, 8));
}

// A lone byte-level token for 0xFF decodes to an invalid byte: the stop string
// "\xEF\xBF\xBD" (U+FFFD) matches it, as it would in vLLM's Python str.
static void test_invalid_utf8_cleaned(void **state)
{
    (void)state;
    if (tok == NULL)
        TDM_SKIP("the Qwen2 tokenizer in ../shared/models is absent");
    int32_t id = tdm_tok_piece_to_id(tok, "\xC3\xBF"); // byte-level piece for 0xFF
    if (id < 0)
        TDM_SKIP("the tokenizer has no byte-level piece for 0xFF");
    struct tdm_oai_request rq;
    request_init(&rq);
    char stop[] = "\xEF\xBF\xBD";
    rq.stop[0] = stop;
    rq.n_stop = 1;
    rq.include_stop_str_in_output = true;
    struct tdm_oai_asm a;
    assert_int_equal(tdm_oai_asm_init(&a, &rq, tok, 0, 0), TDM_OK);
    assert_int_equal(feed(&a, "ab"), -1);
    bool stopped = false;
    assert_int_equal(tdm_oai_asm_token(&a, id, 0, NULL, 0, false, &stopped), TDM_OK);
    if (!stopped) // the detokenizer may hold the byte until the end
        assert_int_equal(tdm_oai_asm_finish(&a, TDM_FINISH_LENGTH, -1, 0, NULL, &stopped),
                         TDM_OK);
    assert_true(stopped);
    assert_int_equal(a.finish, TDM_FINISH_STOP);
    assert_string_equal(a.text.p, "ab\xEF\xBF\xBD");
    tdm_oai_asm_fini(&a);
}

static void test_tokenize_run(void **state)
{
    (void)state;
    if (tok == NULL)
        TDM_SKIP("the Qwen2 tokenizer in ../shared/models is absent");
    struct tdm_oai_model_info info = {.served_name = NULL,
                                      .vocab_size = tdm_tok_vocab_size(tok),
                                      .max_model_len = 4096,
                                      .gen = NULL};
    struct tdm_oai_error e;
    char *body = NULL;
    const char *rq = "{\"prompt\":\"Hello world\",\"return_token_strs\":true}";
    assert_int_equal(tdm_oai_tokenize_run(rq, strlen(rq), &info, tok, NULL, "none", 4096, &body, &e),
                     TDM_OK);
    assert_non_null(body);
    assert_non_null(strstr(body, "\"count\":2"));
    assert_non_null(strstr(body, "\"max_model_len\":4096"));
    assert_non_null(strstr(body, "\"token_strs\":["));
    free(body);
    // The messages form without a chat template: 400 naming why.
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    assert_int_not_equal(
        tdm_oai_tokenize_run(chat, strlen(chat), &info, tok, NULL, "no template", 4096, &body, &e),
        TDM_OK);
    assert_null(body);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "no template"));
    // With a template: chat_template_kwargs reach it, and continue_final_message
    // cuts after the final message (the same rendering as a chat request).
    struct tdm_chat_template *t = NULL;
    char err[256];
    assert_int_equal(tdm_chat_template_new(&t,
                                           "{{ greeting }}{% for m in messages %}|{{ m.content }}#"
                                           "{% endfor %}",
                                           NULL, err, sizeof err),
                     TDM_OK);
    const char *kw =
        "{\"messages\":[{\"role\":\"assistant\",\"content\":\"Hello\"}],"
        "\"add_generation_prompt\":false,\"continue_final_message\":true,"
        "\"chat_template_kwargs\":{\"greeting\":\"Hello world\"},\"return_token_strs\":true}";
    assert_int_equal(tdm_oai_tokenize_run(kw, strlen(kw), &info, tok, t, NULL, 4096, &body, &e),
                     TDM_OK);
    // "Hello world|Hello": 9707 1879 then '|' and 9707, the '#' cut off.
    assert_non_null(strstr(body, "\"count\":4"));
    assert_non_null(strstr(body, "\"tokens\":[9707,1879,"));
    assert_null(strstr(body, "#"));
    free(body);
    tdm_chat_template_free(t);
    // A bad body is the parser's 400.
    assert_int_not_equal(tdm_oai_tokenize_run("{", 1, &info, tok, NULL, "", 4096, &body, &e), TDM_OK);
    assert_int_equal(e.status, 400);

    const char *dt = "{\"tokens\":[9707,1879]}";
    assert_int_equal(tdm_oai_detokenize_run(dt, strlen(dt), &info, tok, &body, &e), TDM_OK);
    assert_string_equal(body, "{\"prompt\":\"Hello world\"}");
    free(body);
    const char *bad = "{\"tokens\":[-5]}";
    assert_int_not_equal(tdm_oai_detokenize_run(bad, strlen(bad), &info, tok, &body, &e), TDM_OK);
    assert_null(body);
    assert_int_equal(e.status, 400);
}

// Token ids of text (no special tokens), into ids[]; their count.
static size_t encode(const char *text, int32_t *ids)
{
    int32_t *got = NULL;
    size_t n = 0;
    assert_int_equal(tdm_tok_encode(tok, text, strlen(text), false, &got, &n), TDM_OK);
    memcpy(ids, got, n * sizeof *ids);
    free(got);
    return n;
}

// bad_words become vLLM's token sequences: each word without its leading
// whitespace, then with one space when that is another first token of the
// same length; the sampling params point at them. A word of whitespace
// alone, and too many sequences, are vLLM's 400s.
static void test_bad_words_build(void **state)
{
    (void)state;
    if (tok == NULL)
        TDM_SKIP("the Qwen2 tokenizer in ../shared/models is absent");
    struct tdm_oai_model_info info = {.vocab_size = tdm_tok_vocab_size(tok), .max_model_len = 64};
    struct tdm_oai_error e;
    struct tdm_oai_request rq;
    const char *body = "{\"prompt\":\"x\",\"bad_words\":[\"Hello\",\"  world\",\"Hello world\"]}";
    assert_int_equal(tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, body, strlen(body), &info, &e),
                     TDM_OK);
    assert_int_equal(rq.n_bad_words, 3);
    assert_int_equal(rq.sampling.num_bad_words, 0); // until the tokenizer made them sequences
    assert_int_equal(tdm_oai_bad_words_build(&rq, &info, tok, &e), TDM_OK);
    const char *forms[6] = {"Hello", " Hello", "world", " world", "Hello world", " Hello world"};
    int32_t want[32], lens[6];
    size_t total = 0;
    for (int i = 0; i < 6; i++) {
        lens[i] = (int32_t)encode(forms[i], want + total);
        total += (size_t)lens[i];
    }
    // Each spaced form here is another first token of the same length.
    assert_int_equal(lens[0], lens[1]);
    assert_int_not_equal(want[0], want[1]);
    assert_int_equal(rq.sampling.num_bad_words, 6);
    assert_ptr_equal(rq.sampling.bad_word_ids, rq.bad_word_ids);
    assert_memory_equal(rq.sampling.bad_word_lens, lens, sizeof lens);
    assert_memory_equal(rq.sampling.bad_word_ids, want, total * sizeof *want);
    char err[256];
    assert_int_equal(tdm_sampling_params_validate(&rq.sampling, info.vocab_size, err, sizeof err),
                     TDM_OK);
    tdm_oai_request_fini(&rq);

    body = "{\"prompt\":\"x\",\"bad_words\":[\"ok\",\" \\n \"]}";
    assert_int_equal(tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, body, strlen(body), &info, &e),
                     TDM_OK);
    assert_int_equal(tdm_oai_bad_words_build(&rq, &info, tok, &e), TDM_EINVAL);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "bad_words");
    assert_string_equal(e.message, "bad_words entries must tokenize to at least one token.");
    tdm_oai_request_fini(&rq);

    // 100 words of two sequences each: past vLLM's 128.
    char big[2048] = "{\"prompt\":\"x\",\"bad_words\":[";
    for (int i = 0; i < 100; i++)
        snprintf(big + strlen(big), sizeof big - strlen(big), "%s\"w%d\"", i ? "," : "", i);
    strcat(big, "]}");
    assert_int_equal(tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, big, strlen(big), &info, &e),
                     TDM_OK);
    assert_int_equal(tdm_oai_bad_words_build(&rq, &info, tok, &e), TDM_EINVAL);
    assert_non_null(strstr(e.message, "Too many bad words after tokenization: 129. The max number "
                                      "is 128."));
    tdm_oai_request_fini(&rq);
}

static void test_prompts_build(void **state)
{
    (void)state;
    if (tok == NULL)
        TDM_SKIP("the Qwen2 tokenizer in ../shared/models is absent");
    struct tdm_oai_model_info info = {.served_name = NULL,
                                      .vocab_size = tdm_tok_vocab_size(tok),
                                      .max_model_len = 64,
                                      .gen = NULL};
    struct tdm_oai_error e;
    struct tdm_oai_request rq;
    const char *body = "{\"prompt\":[[9707,1879],[9707]],\"echo\":true,\"max_tokens\":5}";
    assert_int_equal(tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, body, strlen(body), &info, &e),
                     TDM_OK);
    struct tdm_oai_tokenized_prompt *p = NULL;
    size_t n = 0;
    int total = 0;
    assert_int_equal(tdm_oai_prompts_build(&rq, &info, tok, NULL, "", &p, &n, &total, &e), TDM_OK);
    assert_int_equal(n, 2);
    assert_int_equal(total, 3);
    assert_int_equal(p[0].n, 2);
    assert_string_equal(p[0].text, "Hello world"); // echo of an id prompt: its text
    assert_int_equal(p[0].max_tokens, 5);
    assert_string_equal(p[1].text, "Hello");
    tdm_oai_prompts_free(p, n);
    tdm_oai_request_fini(&rq);

    // truncate_prompt_tokens keeps the last N tokens (vLLM's left
    // truncation); an echo shows the kept tokens' text.
    body = "{\"prompt\":[\"Hello world\",\"Hello\"],\"echo\":true,\"max_tokens\":5,"
           "\"truncate_prompt_tokens\":1}";
    assert_int_equal(tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, body, strlen(body), &info, &e),
                     TDM_OK);
    assert_int_equal(tdm_oai_prompts_build(&rq, &info, tok, NULL, "", &p, &n, &total, &e), TDM_OK);
    assert_int_equal(n, 2);
    assert_int_equal(total, 2);
    assert_int_equal(p[0].n, 1);
    assert_int_equal(p[0].ids[0], 1879);
    assert_string_equal(p[0].text, " world");
    assert_int_equal(p[1].n, 1);
    assert_int_equal(p[1].ids[0], 9707);
    assert_string_equal(p[1].text, "Hello");
    tdm_oai_prompts_free(p, n);
    tdm_oai_request_fini(&rq);
    body = "{\"prompt\":[9707,1879,9707],\"echo\":true,\"truncate_prompt_tokens\":2}";
    assert_int_equal(tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, body, strlen(body), &info, &e),
                     TDM_OK);
    assert_int_equal(tdm_oai_prompts_build(&rq, &info, tok, NULL, "", &p, &n, &total, &e), TDM_OK);
    assert_int_equal(p[0].n, 2);
    assert_string_equal(p[0].text, " worldHello");
    tdm_oai_prompts_free(p, n);
    tdm_oai_request_fini(&rq);
    // A prompt longer than the context fits once truncated; shorter ones are
    // untouched; -1 truncates to the context, which leaves no room to generate.
    {
        char big[1024], *w = big;
        w += sprintf(w, "{\"prompt\":[[");
        for (int i = 0; i < 80; i++)
            w += sprintf(w, "%s%d", i ? "," : "", 100 + i);
        sprintf(w, "],[7,8]],\"max_tokens\":4,\"truncate_prompt_tokens\":60}");
        assert_int_equal(
            tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, big, strlen(big), &info, &e), TDM_OK);
        assert_int_equal(tdm_oai_prompts_build(&rq, &info, tok, NULL, "", &p, &n, &total, &e),
                         TDM_OK);
        assert_int_equal(p[0].n, 60);
        assert_int_equal(p[0].ids[0], 120);
        assert_int_equal(p[0].ids[59], 179);
        assert_int_equal(p[1].n, 2);
        assert_int_equal(total, 62);
        tdm_oai_prompts_free(p, n);
        tdm_oai_request_fini(&rq);
        char *t = strstr(big, "60}");
        memcpy(t, "-1}", 3);
        assert_int_equal(
            tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, big, strlen(big), &info, &e), TDM_OK);
        assert_int_equal(rq.truncate_prompt_tokens, 64);
        assert_int_not_equal(tdm_oai_prompts_build(&rq, &info, tok, NULL, "", &p, &n, &total, &e),
                             TDM_OK);
        assert_int_equal(e.status, 400);
        assert_non_null(strstr(e.message, "your request has 64 input tokens"));
        tdm_oai_prompts_free(p, n);
        tdm_oai_request_fini(&rq);
    }

    // Too long for the context: the max_tokens check's 400.
    body = "{\"prompt\":\"Hello\",\"max_tokens\":64}";
    assert_int_equal(tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, body, strlen(body), &info, &e),
                     TDM_OK);
    assert_int_not_equal(tdm_oai_prompts_build(&rq, &info, tok, NULL, "", &p, &n, &total, &e),
                         TDM_OK);
    assert_int_equal(e.status, 400);
    tdm_oai_prompts_free(p, n);
    tdm_oai_request_fini(&rq);

    // Chat without a template.
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    assert_int_equal(tdm_oai_request_parse(&rq, TDM_OAI_CHAT, body, strlen(body), &info, &e),
                     TDM_OK);
    assert_int_not_equal(
        tdm_oai_prompts_build(&rq, &info, tok, NULL, "no template here", &p, &n, &total, &e),
        TDM_OK);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "no template here"));
    tdm_oai_prompts_free(p, n);
    tdm_oai_request_fini(&rq);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stop_string),         cmocka_unit_test(test_stream_chunks),
        cmocka_unit_test(test_errors_and_stop_ids), cmocka_unit_test(test_invalid_utf8_cleaned),
        cmocka_unit_test(test_tokenize_run),        cmocka_unit_test(test_prompts_build),
        cmocka_unit_test(test_bad_words_build),
    };
    return tdm_test_exit(cmocka_run_group_tests(tests, setup, teardown));
}
