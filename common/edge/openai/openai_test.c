// SPDX-License-Identifier: Apache-2.0
// Tests of the openai request parser (every field, defaults, generation_config
// resolution, vLLM-worded errors), max_tokens resolution against the context,
// and every response builder (parsed back with cJSON and checked field by
// field, including logprobs in both formats and UTF-8 repair).
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "core.h"
#include "openai.h"
#include "openai_impl.h"

static const struct tdm_oai_model_info model = {
    .served_name = "qwen", .vocab_size = 1000, .max_model_len = 100, .gen = NULL};

static int parse(struct tdm_oai_request *r, enum tdm_oai_kind kind, const char *json,
                 struct tdm_oai_error *e)
{
    memset(e, 0, sizeof *e);
    return tdm_oai_request_parse(r, kind, json, strlen(json), &model, e);
}

// Parses json expecting failure with this status, param ("" = none) and message.
static void expect_error(enum tdm_oai_kind kind, const char *json, int status, const char *param,
                         const char *message)
{
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    int rc = parse(&r, kind, json, &e);
    if (rc == TDM_OK || e.status != status || strcmp(e.param, param) != 0 ||
        !strstr(e.message, message)) {
        print_error("body %s\n  got rc=%d status=%d param='%s' message='%s'\n  want status=%d "
                    "param='%s' message containing '%s'\n",
                    json, rc, e.status, e.param, e.message, status, param, message);
        if (rc == TDM_OK)
            tdm_oai_request_fini(&r);
        fail();
    }
    assert_int_equal(rc, status >= 500 ? TDM_ENOMEM : TDM_EINVAL);
    assert_null(r.prompts);
    assert_null(r.model);
}

// ---- requests ----------------------------------------------------------------------------------
static void test_completion_defaults(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION, "{\"model\":\"qwen\",\"prompt\":\"Hello\"}", &e),
                     TDM_OK);
    assert_string_equal(r.model, "qwen");
    assert_int_equal(r.n_prompts, 1);
    assert_string_equal(r.prompts[0].text, "Hello");
    assert_int_equal(r.prompts[0].text_len, 5);
    assert_null(r.prompts[0].ids);
    assert_int_equal(r.max_tokens, 16);
    assert_int_equal(r.n, 1);
    assert_false(r.stream);
    assert_false(r.echo);
    assert_false(r.logprobs);
    assert_true(r.skip_special_tokens);
    assert_true(r.spaces_between_special_tokens);
    assert_true(r.add_special_tokens);
    assert_int_equal(r.n_stop, 0);
    assert_true(r.sampling.temperature == 1.0f);
    assert_true(r.sampling.top_p == 1.0f);
    assert_int_equal(r.sampling.top_k, 0);
    assert_true(r.sampling.repetition_penalty == 1.0f);
    assert_int_equal(r.sampling.logprobs, -1);
    assert_false(r.sampling.has_seed);
    tdm_oai_request_fini(&r);

    // "model" may be absent; null counts as absent; unknown fields are ignored.
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"x\",\"temperature\":null,\"foo\":{\"bar\":[1]},"
                           "\"kv_transfer_params\":{\"a\":1},\"suffix\":\"\",\"tools\":[]}",
                           &e),
                     TDM_OK);
    assert_null(r.model);
    assert_true(r.sampling.temperature == 1.0f);
    tdm_oai_request_fini(&r);
}

static void test_completion_all_fields(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    const char *json =
        "{\"model\":\"qwen\",\"prompt\":[\"a\",\"b\"],\"max_tokens\":7,\"temperature\":0.5,"
        "\"top_p\":0.9,\"top_k\":40,\"min_p\":0.05,\"repetition_penalty\":1.2,"
        "\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,\"logit_bias\":{\"5\":200,\"7\":-3},"
        "\"seed\":-42,\"stop\":[\"\\n\",\"END\"],\"stop_token_ids\":[1,2],"
        "\"include_stop_str_in_output\":true,\"skip_special_tokens\":false,"
        "\"spaces_between_special_tokens\":false,\"n\":2,\"best_of\":2,\"stream\":true,"
        "\"stream_options\":{\"include_usage\":true,\"continuous_usage_stats\":true},"
        "\"logprobs\":3,\"echo\":false,\"ignore_eos\":true,\"min_tokens\":2,\"user\":\"u1\","
        "\"add_special_tokens\":false,\"return_token_ids\":true,\"request_id\":\"abc\","
        "\"priority\":3,\"use_beam_search\":false,\"length_penalty\":1.0}";
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION, json, &e), TDM_OK);
    assert_int_equal(r.n_prompts, 2);
    assert_string_equal(r.prompts[1].text, "b");
    assert_int_equal(r.max_tokens, 7);
    assert_true(r.sampling.temperature == 0.5f);
    assert_true(r.sampling.top_p == 0.9f);
    assert_int_equal(r.sampling.top_k, 40);
    assert_true(r.sampling.min_p == 0.05f);
    assert_true(r.sampling.repetition_penalty == 1.2f);
    assert_true(r.sampling.presence_penalty == 0.5f);
    assert_true(r.sampling.frequency_penalty == -0.5f);
    assert_int_equal(r.sampling.num_logit_bias, 2);
    assert_int_equal(r.sampling.logit_bias[0].token, 5);
    assert_true(r.sampling.logit_bias[0].bias == 100.0f); // clamped as vLLM does
    assert_true(r.sampling.logit_bias[1].bias == -3.0f);
    assert_true(r.sampling.has_seed);
    assert_true((int64_t)r.sampling.seed == -42);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[0], "\n");
    assert_string_equal(r.stop[1], "END");
    assert_int_equal(r.sampling.num_stop_token_ids, 2);
    assert_int_equal(r.sampling.stop_token_ids[1], 2);
    assert_true(r.include_stop_str_in_output);
    assert_false(r.skip_special_tokens);
    assert_false(r.spaces_between_special_tokens);
    assert_int_equal(r.n, 2);
    assert_true(r.stream && r.include_usage && r.continuous_usage_stats);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 3);
    assert_int_equal(r.sampling.logprobs, 3);
    assert_true(r.sampling.ignore_eos);
    assert_int_equal(r.sampling.min_tokens, 2);
    assert_string_equal(r.user, "u1");
    assert_false(r.add_special_tokens);
    assert_true(r.return_token_ids);
    assert_string_equal(r.request_id, "abc");
    assert_int_equal(r.priority, 3);
    tdm_oai_request_fini(&r);

    // A single stop string; logprobs 0 still turns logprobs on.
    assert_int_equal(
        parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"stop\":\"###\",\"logprobs\":0}", &e),
        TDM_OK);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "###");
    assert_true(r.logprobs);
    assert_int_equal(r.sampling.logprobs, 0);
    tdm_oai_request_fini(&r);
}

static void test_prompt_forms(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":[1,2,999]}", &e), TDM_OK);
    assert_int_equal(r.n_prompts, 1);
    assert_null(r.prompts[0].text);
    assert_int_equal(r.prompts[0].n_ids, 3);
    assert_int_equal(r.prompts[0].ids[2], 999);
    tdm_oai_request_fini(&r);
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":[[1],[2,3]]}", &e), TDM_OK);
    assert_int_equal(r.n_prompts, 2);
    assert_int_equal(r.prompts[1].n_ids, 2);
    assert_int_equal(r.prompts[1].ids[1], 3);
    tdm_oai_request_fini(&r);

    expect_error(TDM_OAI_COMPLETION, "{}", 400, "prompt",
                 "Either prompt or prompt_embeds must be provided and non-empty.");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":[]}", 400, "prompt",
                 "Either prompt or prompt_embeds");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":\"\"}", 400, "prompt",
                 "The decoder prompt cannot be empty");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":[[1],[]]}", 400, "prompt",
                 "The decoder prompt cannot be empty");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":[1,1000]}", 400, "prompt",
                 "Token id 1000 is out of vocabulary");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":[1,-1]}", 400, "prompt",
                 "Token id -1 is out of vocabulary");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":[1,2.5]}", 400, "prompt",
                 "token ids must be integers");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":[\"a\",[1]]}", 400, "prompt",
                 "Input should be a valid string");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":5}", 400, "prompt",
                 "Input should be a valid string");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":{\"a\":1}}", 400, "prompt",
                 "Input should be a valid string");
}

static void test_validation_errors(void **state)
{
    (void)state;
    const enum tdm_oai_kind C = TDM_OAI_COMPLETION;
    expect_error(C, "not json", 400, "", "not valid JSON (near byte 0)");
    expect_error(C, "{\"prompt\": \"x\",, \"n\": 1}", 400, "", "not valid JSON (near byte 16)");
    expect_error(C, "[1,2]", 400, "", "must be a JSON object");
    expect_error(C, "{\"prompt\":\"x\"} {\"prompt\":\"y\"}", 400, "",
                 "not valid JSON: trailing data at byte 15");
    expect_error(C, "{\"prompt\":\"x\"}GET / HTTP/1.1", 400, "", "trailing data");
    expect_error(C, "{\"model\":\"foo\",\"prompt\":\"x\"}", 404, "model",
                 "The model `foo` does not exist. This server serves `qwen`");
    expect_error(C, "{\"model\":7,\"prompt\":\"x\"}", 400, "model",
                 "Input should be a valid string");
    expect_error(C, "{\"prompt\":\"x\",\"temperature\":3}", 400, "temperature",
                 "temperature must be in [0, 2], got 3.0.");
    expect_error(C, "{\"prompt\":\"x\",\"temperature\":-0.5}", 400, "temperature",
                 "temperature must be non-negative, got -0.5.");
    expect_error(C, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "temperature",
                 "temperature: Input should be a valid number");
    expect_error(C, "{\"prompt\":\"x\",\"temperature\":true}", 400, "temperature",
                 "Input should be a valid number");
    expect_error(C, "{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p",
                 "top_p must be in (0, 1], got 0.0.");
    expect_error(C, "{\"prompt\":\"x\",\"top_p\":1.5}", 400, "top_p", "got 1.5.");
    expect_error(C, "{\"prompt\":\"x\",\"top_k\":-5}", 400, "top_k",
                 "top_k must be 0 (disable), or at least 1, got -5.");
    expect_error(C, "{\"prompt\":\"x\",\"top_k\":1.5}", 400, "top_k",
                 "top_k: Input should be a valid integer");
    expect_error(C, "{\"prompt\":\"x\",\"min_p\":1.1}", 400, "min_p",
                 "min_p must be in [0, 1], got 1.1.");
    expect_error(C, "{\"prompt\":\"x\",\"repetition_penalty\":0}", 400, "repetition_penalty",
                 "repetition_penalty must be greater than zero, got 0.0.");
    expect_error(C, "{\"prompt\":\"x\",\"presence_penalty\":2.5}", 400, "presence_penalty",
                 "presence_penalty must be in [-2, 2], got 2.5.");
    expect_error(C, "{\"prompt\":\"x\",\"frequency_penalty\":-3}", 400, "frequency_penalty",
                 "frequency_penalty must be in [-2, 2], got -3.0.");
    expect_error(C, "{\"prompt\":\"x\",\"n\":0}", 400, "n", "n must be at least 1, got 0.");
    expect_error(C, "{\"prompt\":\"x\",\"truncate_prompt_tokens\":0}", 400,
                 "truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1, got 0");
    expect_error(C, "{\"prompt\":\"x\",\"truncate_prompt_tokens\":-2}", 400,
                 "truncate_prompt_tokens", "Input should be greater than or equal to -1");
    expect_error(C, "{\"prompt\":\"x\",\"truncate_prompt_tokens\":101}", 400,
                 "truncate_prompt_tokens",
                 "truncate_prompt_tokens value (101) is greater than max_model_len (100). Please, "
                 "select a smaller truncation size.");
    expect_error(C, "{\"prompt\":\"x\",\"truncate_prompt_tokens\":\"5\"}", 400,
                 "truncate_prompt_tokens", "Input should be a valid integer");
    // n x prompts bounded while parsing, before anything is copied or tokenized.
    {
        size_t cap = 16 + 5 * (TDM_OAI_MAX_SEQUENCES + 1) + 32;
        char *many = malloc(cap), *w = many;
        assert_non_null(many);
        w += sprintf(w, "{\"prompt\":[");
        for (int i = 0; i <= TDM_OAI_MAX_SEQUENCES; i++)
            w += sprintf(w, "%s\"a\"", i ? "," : "");
        sprintf(w, "]}");
        expect_error(C, many, 400, "prompt", "at most 4096 prompts per request");
        // Exactly the bound parses; with n = 2 it is twice too many.
        char *last = strrchr(many, ',');
        sprintf(last, "]}");
        struct tdm_oai_request r;
        struct tdm_oai_error e;
        assert_int_equal(parse(&r, C, many, &e), TDM_OK);
        assert_int_equal(r.n_prompts, TDM_OAI_MAX_SEQUENCES);
        tdm_oai_request_fini(&r);
        sprintf(last, "],\"n\":2}");
        expect_error(C, many, 400, "n", "n x prompts must be at most 4096 sequences");
        free(many);
    }
    // The parse tree bounded by the body's size before it is built: a dense
    // array of one-digit ids (2 body bytes a value) is refused at 200 000
    // values; 100 000 three-digit ids ("123, ": 5 bytes a value) parse;
    // so do 20 000 one-digit ids (within the 1 MiB slack).
    {
        size_t cap = 16 + 8 * 200000 + 32;
        char *dense = malloc(cap), *w = dense;
        assert_non_null(dense);
        w += sprintf(w, "{\"prompt\":[");
        for (int i = 0; i < 200000; i++)
            w += sprintf(w, "%s1", i ? "," : "");
        sprintf(w, "]}");
        expect_error(C, dense, 400, "", "JSON values would take 15.3 MiB to parse, over 20 x");
        struct tdm_oai_request r;
        struct tdm_oai_error e;
        w = dense + sprintf(dense, "{\"prompt\":[");
        for (int i = 0; i < 20000; i++)
            w += sprintf(w, "%s1", i ? "," : "");
        sprintf(w, "]}");
        assert_int_equal(parse(&r, C, dense, &e), TDM_OK);
        assert_int_equal(r.n_prompts, 1);
        tdm_oai_request_fini(&r);
        w = dense + sprintf(dense, "{\"prompt\":[");
        for (int i = 0; i < 100000; i++)
            w += sprintf(w, "%s%d", i ? ", " : "", 100 + i % 900);
        sprintf(w, "]}");
        if (parse(&r, C, dense, &e) != TDM_OK)
            fail_msg("100 000 ids: %d %s", e.status, e.message);
        tdm_oai_request_fini(&r);
        free(dense);
        // The count: root, elements, members.
        const char *j = "{\"a\":[1,[2,3],{},\"x,]\"],\"b\":{\"c\":[]}}";
        size_t v = 0;
        assert_int_equal(tdm_json_check_depth_count(j, strlen(j), TDM_JSON_MAX_DEPTH, &v, NULL, 0),
                         TDM_OK);
        assert_int_equal(v, 10);
        assert_int_equal(tdm_json_check_depth_count("[]", 2, TDM_JSON_MAX_DEPTH, &v, NULL, 0),
                         TDM_OK);
        assert_int_equal(v, 1);
        assert_int_equal(tdm_json_check_depth_count(" [ 1 ] ", 7, TDM_JSON_MAX_DEPTH, &v, NULL, 0),
                         TDM_OK);
        assert_int_equal(v, 2);
    }
    expect_error(C, "{\"prompt\":\"x\",\"n\":100000}", 400, "n", "n must be at most 128");
    expect_error(C, "{\"prompt\":\"x\",\"n\":2,\"temperature\":0}", 400, "n",
                 "n must be 1 when using greedy sampling, got 2.");
    expect_error(C, "{\"prompt\":\"x\",\"n\":2,\"best_of\":1}", 400, "best_of",
                 "best_of must be greater than or equal to n, got n=2 and best_of=1.");
    expect_error(C, "{\"prompt\":\"x\",\"best_of\":3}", 400, "best_of", "not supported");
    expect_error(C, "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens",
                 "max_tokens must be at least 1, got 0.");
    expect_error(C, "{\"prompt\":\"x\",\"max_tokens\":-3}", 400, "max_tokens",
                 "max_tokens must be at least 1, got -3.");
    expect_error(C, "{\"prompt\":\"x\",\"max_tokens\":\"5\"}", 400, "max_tokens",
                 "max_tokens: Input should be a valid integer");
    expect_error(C, "{\"prompt\":\"x\",\"min_tokens\":-1}", 400, "min_tokens",
                 "min_tokens must be greater than or equal to 0, got -1.");
    expect_error(C, "{\"prompt\":\"x\",\"min_tokens\":20,\"max_tokens\":10}", 400, "min_tokens",
                 "min_tokens must be less than or equal to max_tokens=10, got 20.");
    // Integers beyond 32 bits mean nothing for any field (issue 11: top_k and
    // priority of 1e30 used to be clamped and accepted).
    expect_error(C, "{\"prompt\":\"x\",\"top_k\":1e30}", 400, "top_k",
                 "top_k must be between -2147483648 and 2147483647, got 1e+30.");
    expect_error(C, "{\"prompt\":\"x\",\"priority\":-1e30}", 400, "priority",
                 "priority must be between");
    expect_error(C, "{\"prompt\":\"x\",\"max_tokens\":4294967296}", 400, "max_tokens",
                 "max_tokens must be between");
    // A NUL would cut the prompt short; a control character in request_id
    // would forge log lines.
    expect_error(C, "{\"prompt\":\"a\\u0000bbbb\"}", 400, "", "NUL characters");
    expect_error(C, "{\"prompt\":\"x\",\"request_id\":\"a\\nlevel=ERR\"}", 400, "request_id",
                 "request_id must not contain control characters.");
    expect_error(C, "{\"prompt\":\"x\",\"seed\":1.5}", 400, "seed",
                 "seed: Input should be a valid integer");
    expect_error(C, "{\"prompt\":\"x\",\"seed\":1e20}", 400, "seed",
                 "less than or equal to 9223372036854775807");
    expect_error(C, "{\"prompt\":\"x\",\"stream\":1}", 400, "stream",
                 "stream: Input should be a valid boolean");
    expect_error(C, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", 400,
                 "stream_options", "Stream options can only be defined when `stream=True`.");
    expect_error(C, "{\"prompt\":\"x\",\"logprobs\":-1}", 400, "logprobs",
                 "`logprobs` must be a positive value.");
    expect_error(C, "{\"prompt\":\"x\",\"logprobs\":21}", 400, "logprobs",
                 "Requested sample logprobs of 21, which is greater than max allowed: 20");
    expect_error(C, "{\"prompt\":\"x\",\"logprobs\":true}", 400, "logprobs",
                 "Input should be a valid integer");
    expect_error(C, "{\"prompt\":\"x\",\"stop\":[\"a\",\"\"]}", 400, "stop",
                 "stop cannot contain an empty string.");
    expect_error(C, "{\"prompt\":\"x\",\"stop\":\"\"}", 400, "stop",
                 "stop cannot contain an empty string.");
    expect_error(C, "{\"prompt\":\"x\",\"stop\":[1]}", 400, "stop",
                 "Input should be a valid string");
    expect_error(
        C,
        "{\"prompt\":\"x\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\","
        "\"10\",\"11\",\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]}",
        400, "stop", "at most 16");
    expect_error(C, "{\"prompt\":\"x\",\"stop_token_ids\":[5000]}", 400, "stop_token_ids",
                 "token_id(s) [5000] in stop_token_ids contain out-of-vocab token ids. Vocabulary "
                 "size: 1000");
    expect_error(C, "{\"prompt\":\"x\",\"stop_token_ids\":[\"a\"]}", 400, "stop_token_ids",
                 "stop_token_ids must contain only integers");
    expect_error(C, "{\"prompt\":\"x\",\"logit_bias\":{\"abc\":1}}", 400, "logit_bias",
                 "Found token_id `abc` in logit_bias but token_id must be an integer or string "
                 "representing an integer");
    expect_error(
        C, "{\"prompt\":\"x\",\"logit_bias\":{\"1000\":1}}", 400, "logit_bias",
        "token_id(s) [1000] in logit_bias contain out-of-vocab token ids. Vocabulary size: "
        "1000");
    expect_error(C, "{\"prompt\":\"x\",\"logit_bias\":{\"1\":\"x\"}}", 400, "logit_bias",
                 "Input should be a valid number");
    expect_error(C, "{\"prompt\":\"x\",\"logit_bias\":[1]}", 400, "logit_bias",
                 "Input should be a valid dictionary");
    // Prompt logprobs as vLLM checks them; echo without generation has none.
    expect_error(C, "{\"prompt\":\"x\",\"prompt_logprobs\":1,\"stream\":true}", 400,
                 "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.");
    expect_error(C, "{\"prompt\":\"x\",\"prompt_logprobs\":-2}", 400, "prompt_logprobs",
                 "`prompt_logprobs` must be a positive value or -1.");
    expect_error(C, "{\"prompt\":\"x\",\"prompt_logprobs\":21}", 400, "prompt_logprobs",
                 "Requested prompt logprobs of 21, which is greater than max allowed: 20");
    expect_error(C, "{\"prompt\":\"x\",\"prompt_logprobs\":-1}", 400, "prompt_logprobs",
                 "Requested prompt logprobs of 1000, which is greater than max allowed: 20");
    expect_error(C, "{\"prompt\":\"x\",\"prompt_logprobs\":\"2\"}", 400, "prompt_logprobs",
                 "integer");
    // Features vLLM has and Tandem does not: refused, not ignored.
    expect_error(C, "{\"prompt\":\"x\",\"suffix\":\"end\"}", 400, "suffix",
                 "suffix is not supported");
    expect_error(C, "{\"prompt\":\"x\",\"use_beam_search\":true}", 400, "use_beam_search",
                 "not supported");
}

// chat_template_kwargs (vLLM's): the server's defaults under the request's,
// add_generation_prompt and continue_final_message taken out as the fields
// they override, vLLM's 400s for chat_template and tokenize; the answer's
// role (vLLM's get_chat_request_role); the flag's check.
static void test_chat_template_kwargs(void **state)
{
    (void)state;
    const enum tdm_oai_kind K = TDM_OAI_CHAT;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    struct tdm_oai_model_info m = model;
    m.default_chat_template_kwargs = "{\"enable_thinking\":true,\"x\":[1,2]}";
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                       "\"chat_template_kwargs\":{\"enable_thinking\":false,\"lang\":\"fr\"}}";
    memset(&e, 0, sizeof e);
    assert_int_equal(tdm_oai_request_parse(&r, K, body, strlen(body), &m, &e), TDM_OK);
    assert_string_equal(r.chat_template_kwargs,
                        "{\"enable_thinking\":false,\"x\":[1,2],\"lang\":\"fr\"}");
    assert_string_equal(tdm_oai_response_role(&r), "assistant");
    tdm_oai_request_fini(&r);
    // No kwargs anywhere: none.
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}";
    assert_int_equal(parse(&r, K, body, &e), TDM_OK);
    assert_null(r.chat_template_kwargs);
    tdm_oai_request_fini(&r);
    // Its add_generation_prompt wins over the field; the answer then
    // continues the final message's role.
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
           "\"content\":\"b\"}],\"chat_template_kwargs\":{\"add_generation_prompt\":false,"
           "\"continue_final_message\":true}}";
    assert_int_equal(parse(&r, K, body, &e), TDM_OK);
    assert_false(r.add_generation_prompt);
    assert_true(r.continue_final_message);
    assert_null(r.chat_template_kwargs);
    assert_string_equal(tdm_oai_response_role(&r), "assistant");
    tdm_oai_request_fini(&r);
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"add_generation_prompt\":false}";
    assert_int_equal(parse(&r, K, body, &e), TDM_OK);
    assert_string_equal(tdm_oai_response_role(&r), "user");
    tdm_oai_request_fini(&r);
    // A request's own chat_template: refused in vLLM's words unless the
    // server trusts them (also inside chat_template_kwargs).
    const char *untrusted = "Chat template is passed with request, but "
                            "--trust-request-chat-template is not set. Refused request with "
                            "untrusted chat template.";
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"chat_template\":\"x\"}",
                 400, "", untrusted);
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                 "\"chat_template_kwargs\":{\"chat_template\":\"x\"}}",
                 400, "", untrusted);
    m = model;
    m.trust_request_chat_template = true;
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"chat_template\":\"{{ 1 }}\"}";
    assert_int_equal(tdm_oai_request_parse(&r, K, body, strlen(body), &m, &e), TDM_OK);
    assert_string_equal(r.chat_template, "{{ 1 }}");
    tdm_oai_request_fini(&r);
    // documents (RAG templates) go to the template as `documents`.
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"documents\":[{\"title\":\"T\","
           "\"text\":\"x\"}]}";
    assert_int_equal(parse(&r, K, body, &e), TDM_OK);
    assert_string_equal(r.chat_template_kwargs,
                        "{\"documents\":[{\"title\":\"T\",\"text\":\"x\"}]}");
    tdm_oai_request_fini(&r);
    expect_error(K, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"documents\":{}}", 400,
                 "documents", "documents: Input should be a valid list");
    expect_error(K, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"documents\":[1]}", 400,
                 "documents", "documents.0: Input should be a valid dictionary");
    expect_error(
        K,
        "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"documents\":[{\"a\":\"b\"},"
        "{\"n\":1}]}",
        400, "documents", "documents.1.n: Input should be a valid string");
    // Completions ignore it, as vLLM's completion request has no such field.
    assert_int_equal(
        parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"chat_template_kwargs\":{\"a\":1}}", &e),
        TDM_OK);
    assert_null(r.chat_template_kwargs);
    tdm_oai_request_fini(&r);

    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                 "\"chat_template_kwargs\":{\"tokenize\":true}}",
                 400, "chat_template_kwargs",
                 "Found unexpected chat template kwargs from request: {'tokenize'}");
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                 "\"chat_template_kwargs\":{\"messages\":[]}}",
                 400, "chat_template_kwargs", "the request's own messages field sets it");
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                 "\"chat_template_kwargs\":[1]}",
                 400, "chat_template_kwargs", "valid dictionary");
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                 "\"chat_template_kwargs\":{\"add_generation_prompt\":1}}",
                 400, "chat_template_kwargs", "valid boolean");
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                 "\"chat_template_kwargs\":{\"continue_final_message\":true}}",
                 400, "continue_final_message", "Cannot set both");

    char err[256];
    assert_int_equal(
        tdm_oai_check_chat_template_kwargs("{\"enable_thinking\":false}", err, sizeof err), TDM_OK);
    assert_int_equal(tdm_oai_check_chat_template_kwargs("[1]", err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_oai_check_chat_template_kwargs("{\"tokenize\":1}", err, sizeof err),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "tokenize"));
    assert_int_equal(tdm_oai_check_chat_template_kwargs("{x", err, sizeof err), TDM_EINVAL);
}

// --max-logprobs lowers the cap of logprobs, top_logprobs and prompt_logprobs
// (vLLM's words with its value).
static void test_max_logprobs(void **state)
{
    (void)state;
    struct tdm_oai_model_info m = model;
    m.limit_logprobs = true;
    m.max_logprobs = 3;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    const struct {
        enum tdm_oai_kind kind;
        const char *body, *param, *message; // message NULL: accepted
    } cases[] = {
        {TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"logprobs\":3}", NULL, NULL},
        {TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"logprobs\":4}", "logprobs",
         "Requested sample logprobs of 4, which is greater than max allowed: 3"},
        {TDM_OAI_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"logprobs\":true,\"top_logprobs\":"
         "4}",
         "logprobs", "Requested sample logprobs of 4, which is greater than max allowed: 3"},
        {TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"prompt_logprobs\":3}", NULL, NULL},
        {TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"prompt_logprobs\":4}", "prompt_logprobs",
         "Requested prompt logprobs of 4, which is greater than max allowed: 3"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memset(&e, 0, sizeof e);
        int rc =
            tdm_oai_request_parse(&r, cases[i].kind, cases[i].body, strlen(cases[i].body), &m, &e);
        if (cases[i].message == NULL) {
            assert_int_equal(rc, TDM_OK);
            tdm_oai_request_fini(&r);
            continue;
        }
        assert_int_equal(rc, TDM_EINVAL);
        assert_string_equal(e.param, cases[i].param);
        assert_string_equal(e.message, cases[i].message);
    }
}

// allowed_token_ids and bad_words (vLLM's): kept and lent to the sampling
// params; malformed values are vLLM's 400s.
static void test_allowed_ids_and_bad_words(void **state)
{
    (void)state;
    const enum tdm_oai_kind C = TDM_OAI_COMPLETION;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    const char *ok =
        "{\"prompt\":\"x\",\"allowed_token_ids\":[5,999,5],\"bad_words\":[\"a\",\" b\"]}";
    assert_int_equal(parse(&r, C, ok, &e), TDM_OK);
    assert_int_equal(r.n_allowed_token_ids, 3);
    assert_int_equal(r.sampling.num_allowed_token_ids, 3);
    assert_ptr_equal(r.sampling.allowed_token_ids, r.allowed_token_ids);
    assert_int_equal(r.allowed_token_ids[1], 999);
    assert_int_equal(r.n_bad_words, 2);
    assert_string_equal(r.bad_words[1], " b");
    tdm_oai_request_fini(&r);
    ok = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"allowed_token_ids\":[1],"
         "\"bad_words\":[]}";
    assert_int_equal(parse(&r, TDM_OAI_CHAT, ok, &e), TDM_OK);
    assert_int_equal(r.sampling.num_allowed_token_ids, 1);
    assert_int_equal(r.n_bad_words, 0);
    tdm_oai_request_fini(&r);

    expect_error(C, "{\"prompt\":\"x\",\"allowed_token_ids\":[]}", 400, "allowed_token_ids",
                 "allowed_token_ids is not None and empty!");
    expect_error(C, "{\"prompt\":\"x\",\"allowed_token_ids\":[1,1000]}", 400, "allowed_token_ids",
                 "allowed_token_ids contains out-of-vocab token id!");
    expect_error(C, "{\"prompt\":\"x\",\"allowed_token_ids\":[-1]}", 400, "allowed_token_ids",
                 "out-of-vocab");
    expect_error(C, "{\"prompt\":\"x\",\"allowed_token_ids\":[1.5]}", 400, "allowed_token_ids",
                 "only integers");
    expect_error(C, "{\"prompt\":\"x\",\"allowed_token_ids\":3}", 400, "allowed_token_ids",
                 "valid list");
    expect_error(C, "{\"prompt\":\"x\",\"bad_words\":\"a\"}", 400, "bad_words", "valid list");
    expect_error(C, "{\"prompt\":\"x\",\"bad_words\":[\"a\",\"\"]}", 400, "bad_words",
                 "bad_words cannot contain an empty string.");
    expect_error(C, "{\"prompt\":\"x\",\"bad_words\":[1]}", 400, "bad_words", "only strings");
    char big[2048] = "{\"prompt\":\"x\",\"bad_words\":[";
    for (int i = 0; i < TDM_MAX_BAD_WORDS + 30; i++) // 158 words: vLLM stops at 129
        strcat(big, i ? ",\"w\"" : "\"w\"");
    strcat(big, "]}");
    expect_error(C, big, 400, "bad_words",
                 "Too many bad words after tokenization: 129. The max number is 128.");
}

// logprob_token_ids: the ids lent to the sampling params, which then ask the
// chosen token's logprob (0) whatever top_logprobs/logprobs said; vLLM's
// checks and messages.
static void test_logprob_token_ids(void **state)
{
    (void)state;
    const enum tdm_oai_kind C = TDM_OAI_COMPLETION, H = TDM_OAI_CHAT;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    assert_int_equal(
        parse(&r, C, "{\"prompt\":\"x\",\"logprobs\":5,\"logprob_token_ids\":[7,999,7]}", &e),
        TDM_OK);
    assert_int_equal(r.sampling.num_logprob_token_ids, 3);
    assert_ptr_equal(r.sampling.logprob_token_ids, r.logprob_token_ids);
    assert_int_equal(r.logprob_token_ids[1], 999);
    assert_int_equal(r.sampling.logprobs, 0);
    assert_int_equal(tdm_sampling_top_entries(&r.sampling), 3);
    tdm_oai_request_fini(&r);
    assert_int_equal(
        parse(&r, C, "{\"prompt\":\"x\",\"logprobs\":0,\"logprob_token_ids\":[1]}", &e), TDM_OK);
    tdm_oai_request_fini(&r);
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
                       "\"logprob_token_ids\":[3]}";
    assert_int_equal(parse(&r, H, chat, &e), TDM_OK);
    assert_int_equal(r.sampling.num_logprob_token_ids, 1);
    assert_int_equal(r.sampling.logprobs, 0);
    tdm_oai_request_fini(&r);

    expect_error(
        H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprob_token_ids\":[3]}", 400,
        "logprob_token_ids", "when using `logprob_token_ids`, `logprobs` must be set to true.");
    expect_error(C, "{\"prompt\":\"x\",\"logprob_token_ids\":[3]}", 400, "logprob_token_ids",
                 "when using `logprob_token_ids`, `logprobs` must be set.");
    expect_error(C, "{\"prompt\":\"x\",\"logprobs\":1,\"logprob_token_ids\":[]}", 400,
                 "logprob_token_ids", "`logprob_token_ids` must not be an empty list.");
    expect_error(C, "{\"prompt\":\"x\",\"logprobs\":1,\"logprob_token_ids\":[1,1000]}", 400,
                 "logprob_token_ids",
                 "token_id(s) [1000] in logprob_token_ids contain out-of-vocab token ids. "
                 "Vocabulary size: 1000");
    expect_error(C, "{\"prompt\":\"x\",\"logprobs\":1,\"logprob_token_ids\":[\"a\"]}", 400,
                 "logprob_token_ids", "only integers");
    expect_error(C, "{\"prompt\":\"x\",\"logprobs\":1,\"logprob_token_ids\":5}", 400,
                 "logprob_token_ids", "valid list");
    expect_error(C,
                 "{\"prompt\":\"x\",\"echo\":true,\"max_tokens\":0,\"logprobs\":1,"
                 "\"logprob_token_ids\":[2]}",
                 400, "logprob_token_ids",
                 "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
                 "no output tokens are generated.");
    char big[1024] = "{\"prompt\":\"x\",\"logprobs\":1,\"logprob_token_ids\":[";
    for (int i = 0; i <= TDM_MAX_LOGPROB_TOKEN_IDS; i++)
        strcat(big, i ? ",1" : "1");
    strcat(big, "]}");
    expect_error(C, big, 400, "logprob_token_ids",
                 "Requested logprob_token_ids of length 129, which is greater than max allowed: "
                 "128");
}

static void test_unsupported_noop_values_accepted(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    const char *ok[] = {
        "{\"prompt\":\"x\",\"response_format\":{\"type\":\"text\"}}",
        "{\"prompt\":\"x\",\"use_beam_search\":false,\"prompt_logprobs\":null,\"suffix\":null}",
        "{\"prompt\":\"x\",\"tool_choice\":\"none\",\"tools\":null,\"bad_words\":[]}",
        "{\"prompt\":\"x\",\"n\":2,\"best_of\":2}",
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        if (parse(&r, TDM_OAI_COMPLETION, ok[i], &e) != TDM_OK) {
            print_error("%s: %s\n", ok[i], e.message);
            fail();
        }
        tdm_oai_request_fini(&r);
    }
}

// prompt_logprobs and echo with logprobs are accepted (completions): the
// request keeps the count; echo with logprobs keeps its logprobs.
static void test_prompt_logprobs_accepted(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":\"x\"}", &e), TDM_OK);
    assert_int_equal(r.prompt_logprobs, -1);
    tdm_oai_request_fini(&r);
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"prompt_logprobs\":3}", &e),
                     TDM_OK);
    assert_int_equal(r.prompt_logprobs, 3);
    tdm_oai_request_fini(&r);
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"x\",\"prompt_logprobs\":0,\"stream\":true}", &e),
                     TDM_OK);
    assert_int_equal(r.prompt_logprobs, 0);
    tdm_oai_request_fini(&r);
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"x\",\"echo\":true,\"logprobs\":2,\"max_tokens\":1}", &e),
                     TDM_OK);
    assert_true(r.echo && r.logprobs);
    assert_int_equal(r.top_logprobs, 2);
    assert_int_equal(r.prompt_logprobs, -1);
    assert_false(r.echo_prompt_only);
    tdm_oai_request_fini(&r);
    // echo with max_tokens 0: the prompt alone, or with its logprobs one
    // token generated for them (vLLM).
    assert_int_equal(
        parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"echo\":true,\"max_tokens\":0}", &e),
        TDM_OK);
    assert_true(r.echo_only && !r.echo_prompt_only);
    tdm_oai_request_fini(&r);
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"x\",\"echo\":true,\"max_tokens\":0,\"logprobs\":1}", &e),
                     TDM_OK);
    assert_true(!r.echo_only && r.echo_prompt_only);
    assert_int_equal(r.max_tokens, 1);
    tdm_oai_request_fini(&r);
}

// ---- structured outputs ------------------------------------------------------------------
// Parses json (must succeed) and checks the constraint it carries.
static void expect_constraint(enum tdm_oai_kind kind, const char *json,
                              enum tdm_constraint_kind want_kind, const char *want_text,
                              const char *want_param)
{
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    if (parse(&r, kind, json, &e) != TDM_OK) {
        print_error("body %s: %s\n", json, e.message);
        fail();
    }
    assert_int_equal(r.sampling.constraint, want_kind);
    if (want_kind == TDM_CONSTRAINT_NONE) {
        assert_null(r.constraint_text);
        assert_null(r.sampling.constraint_text);
    } else {
        assert_non_null(r.constraint_text);
        assert_ptr_equal(r.sampling.constraint_text, r.constraint_text);
        assert_int_equal(r.sampling.constraint_len, strlen(want_text));
        assert_string_equal(r.constraint_text, want_text);
        assert_string_equal(r.constraint_param, want_param);
    }
    tdm_oai_request_fini(&r);
}

static void test_structured_output_shapes(void **state)
{
    (void)state;
    const enum tdm_oai_kind C = TDM_OAI_COMPLETION, H = TDM_OAI_CHAT;
#define MSGS "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"
    const char *schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
                         "\"required\":[\"a\"]}";
    char body[1024];
    // OpenAI response_format, on chat and completions.
    expect_constraint(H, "{" MSGS ",\"response_format\":{\"type\":\"text\"}}", TDM_CONSTRAINT_NONE,
                      NULL, NULL);
    expect_constraint(H, "{" MSGS ",\"response_format\":{\"type\":\"json_object\"}}",
                      TDM_CONSTRAINT_JSON_OBJECT, "", "response_format");
    expect_constraint(C, "{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_object\"}}",
                      TDM_CONSTRAINT_JSON_OBJECT, "", "response_format");
    snprintf(body, sizeof body,
             "{" MSGS ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
             "{\"name\":\"n\",\"strict\":true,\"schema\":%s}}}",
             schema);
    expect_constraint(H, body, TDM_CONSTRAINT_JSON_SCHEMA, schema, "response_format");
    snprintf(body, sizeof body,
             "{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
             "{\"name\":\"n\",\"schema\":%s}}}",
             schema);
    expect_constraint(C, body, TDM_CONSTRAINT_JSON_SCHEMA, schema, "response_format");
    // vLLM's structured_outputs object.
    snprintf(body, sizeof body, "{" MSGS ",\"structured_outputs\":{\"json\":%s}}", schema);
    expect_constraint(H, body, TDM_CONSTRAINT_JSON_SCHEMA, schema, "structured_outputs.json");
    expect_constraint(H, "{" MSGS ",\"structured_outputs\":{\"json\":\"{\\\"type\\\":\\\"string\\\"}\"}}",
                      TDM_CONSTRAINT_JSON_SCHEMA, "{\"type\":\"string\"}",
                      "structured_outputs.json");
    expect_constraint(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"regex\":\"[a-c]{2}\"}}",
                      TDM_CONSTRAINT_REGEX, "[a-c]{2}", "structured_outputs.regex");
    expect_constraint(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"choice\":[\"yes\", \"no\"]}}",
                      TDM_CONSTRAINT_CHOICE, "[\"yes\",\"no\"]", "structured_outputs.choice");
    expect_constraint(H, "{" MSGS ",\"structured_outputs\":{\"grammar\":\"root ::= \\\"a\\\"+\"}}",
                      TDM_CONSTRAINT_GRAMMAR, "root ::= \"a\"+", "structured_outputs.grammar");
    expect_constraint(H, "{" MSGS ",\"structured_outputs\":{\"json_object\":true}}",
                      TDM_CONSTRAINT_JSON_OBJECT, "", "structured_outputs.json_object");
    expect_constraint(H, "{" MSGS ",\"structured_outputs\":{\"json_object\":false,"
                         "\"disable_fallback\":true}}",
                      TDM_CONSTRAINT_NONE, NULL, NULL);
    // The older guided_* fields.
    snprintf(body, sizeof body, "{\"prompt\":\"x\",\"guided_json\":%s}", schema);
    expect_constraint(C, body, TDM_CONSTRAINT_JSON_SCHEMA, schema, "guided_json");
    expect_constraint(H, "{" MSGS ",\"guided_regex\":\"\\\\d+\",\"guided_decoding_backend\":"
                         "\"xgrammar\"}",
                      TDM_CONSTRAINT_REGEX, "\\d+", "guided_regex");
    expect_constraint(H, "{" MSGS ",\"guided_choice\":[\"a\",\"b\",\"\\u00e9\"]}",
                      TDM_CONSTRAINT_CHOICE, "[\"a\",\"b\",\"\xc3\xa9\"]", "guided_choice");
    expect_constraint(C, "{\"prompt\":\"x\",\"guided_grammar\":\"root ::= [0-9]+\"}",
                      TDM_CONSTRAINT_GRAMMAR, "root ::= [0-9]+", "guided_grammar");
    expect_constraint(C, "{\"prompt\":\"x\",\"guided_json\":null,\"structured_outputs\":null}",
                      TDM_CONSTRAINT_NONE, NULL, NULL);
#undef MSGS
}

static void test_structured_output_errors(void **state)
{
    (void)state;
    const enum tdm_oai_kind C = TDM_OAI_COMPLETION, H = TDM_OAI_CHAT;
#define MSGS "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"
    // More than one constraint, in any combination.
    expect_error(C, "{\"prompt\":\"x\",\"guided_regex\":\"a\",\"guided_choice\":[\"a\"]}", 400,
                 "guided_choice",
                 "You can only use one kind of structured outputs constraint but multiple are "
                 "specified: guided_regex and guided_choice");
    expect_error(H, "{" MSGS ",\"response_format\":{\"type\":\"json_object\"},"
                    "\"guided_json\":{\"type\":\"object\"}}",
                 400, "guided_json", "response_format and guided_json");
    expect_error(H, "{" MSGS ",\"structured_outputs\":{\"regex\":\"a\",\"choice\":[\"a\"]}}", 400,
                 "structured_outputs.choice", "only use one kind");
    expect_error(H, "{" MSGS ",\"structured_outputs\":{\"json_object\":true,\"grammar\":"
                    "\"root ::= \\\"a\\\"\"}}",
                 400, "structured_outputs.json_object", "only use one kind");
    // Shapes.
    expect_error(H, "{" MSGS ",\"response_format\":\"json\"}", 400, "response_format",
                 "valid dictionary");
    expect_error(H, "{" MSGS ",\"response_format\":{}}", 400, "response_format",
                 "response_format.type: Field required");
    expect_error(H, "{" MSGS ",\"response_format\":{\"type\":\"yaml\"}}", 400, "response_format",
                 "got 'yaml'");
    expect_error(H, "{" MSGS ",\"response_format\":{\"type\":\"json_schema\"}}", 400,
                 "response_format", "json_schema: Field required");
    expect_error(H, "{" MSGS ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
                    "{\"name\":\"x\"}}}",
                 400, "response_format", "json_schema.schema: Field required");
    expect_error(H, "{" MSGS ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
                    "{\"name\":1,\"schema\":{}}}}",
                 400, "response_format", "name: Input should be a valid string");
    expect_error(H, "{" MSGS ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
                    "{\"schema\":[1]}}}",
                 400, "response_format", "schema: Input should be a valid dictionary");
    expect_error(H, "{" MSGS ",\"response_format\":{\"type\":\"structural_tag\"}}", 400,
                 "response_format", "not supported");
    expect_error(H, "{" MSGS ",\"structured_outputs\":[1]}", 400, "structured_outputs",
                 "valid dictionary");
    expect_error(H, "{" MSGS ",\"structured_outputs\":{\"structural_tag\":\"x\"}}", 400,
                 "structured_outputs.structural_tag", "not supported");
    expect_error(H, "{" MSGS ",\"guided_whitespace_pattern\":\" *\"}", 400,
                 "guided_whitespace_pattern", "not supported");
    expect_error(C, "{\"prompt\":\"x\",\"guided_regex\":5}", 400, "guided_regex",
                 "Input should be a valid string");
    expect_error(C, "{\"prompt\":\"x\",\"guided_choice\":\"a\"}", 400, "guided_choice",
                 "valid list");
    expect_error(C, "{\"prompt\":\"x\",\"guided_choice\":[]}", 400, "guided_choice", "empty");
    expect_error(C, "{\"prompt\":\"x\",\"guided_choice\":[\"a\",1]}", 400, "guided_choice",
                 "list of strings");
    expect_error(C, "{\"prompt\":\"x\",\"guided_json\":5}", 400, "guided_json",
                 "valid dictionary");
    expect_error(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"json_object\":1}}", 400,
                 "json_object", "valid boolean");
    expect_error(C, "{\"prompt\":\"x\",\"guided_decoding_backend\":7}", 400,
                 "guided_decoding_backend", "valid string");
    // The grammar engine's own messages, as 400s naming the field.
    expect_error(C, "{\"prompt\":\"x\",\"guided_json\":{\"type\":\"integer\",\"allOf\":[]}}", 400,
                 "guided_json", "keyword \"allOf\" is not supported");
    expect_error(C, "{\"prompt\":\"x\",\"guided_json\":\"{not json\"}", 400, "guided_json",
                 "not valid JSON");
    expect_error(C, "{\"prompt\":\"x\",\"guided_regex\":\"(a\"}", 400, "guided_regex", "regex");
    expect_error(C, "{\"prompt\":\"x\",\"guided_regex\":\"(a)\\\\1\"}", 400, "guided_regex",
                 "backreference");
    expect_error(C, "{\"prompt\":\"x\",\"guided_regex\":\"a**\"}", 400, "guided_regex",
                 "multiple repeat");
    expect_error(C, "{\"prompt\":\"x\",\"guided_grammar\":\"root ::= foo\"}", 400,
                 "guided_grammar", "foo");
    expect_error(C, "{\"prompt\":\"x\",\"guided_grammar\":\"root ::= root \\\"a\\\"\"}", 400,
                 "guided_grammar", "left-recursive");
    expect_error(C, "{\"prompt\":\"x\",\"guided_regex\":\"[^\\\\x00-\\\\xff]\"}", 400, "guided_regex",
                 "");
#undef MSGS
}

// Hostile constraints fail fast with a 400 and leave nothing behind.
static void test_structured_output_hostile(void **state)
{
    (void)state;
    // A schema 10 000 deep, as a JSON string (the body's own depth check would
    // stop it as an object) and as an object.
    size_t depth = 10000;
    size_t cap = depth * 40 + 256;
    char *body = malloc(cap), *p = body;
    assert_non_null(body);
    p += sprintf(p, "{\"prompt\":\"x\",\"guided_json\":\"");
    for (size_t i = 0; i < depth; i++)
        p += sprintf(p, "{\\\"items\\\":");
    p += sprintf(p, "{}");
    for (size_t i = 0; i < depth; i++)
        *p++ = '}';
    p += sprintf(p, "\"}");
    double t0 = tdm_now();
    expect_error(TDM_OAI_COMPLETION, body, 400, "guided_json", "nests deeper than 128");
    p = body;
    p += sprintf(p, "{\"prompt\":\"x\",\"guided_json\":");
    for (size_t i = 0; i < depth; i++)
        p += sprintf(p, "{\"items\":");
    p += sprintf(p, "{}");
    for (size_t i = 0; i < depth; i++)
        *p++ = '}';
    p += sprintf(p, "}");
    expect_error(TDM_OAI_COMPLETION, body, 400, "", "nests deeper than 128");
    free(body);
    // A 10 MB schema (a huge enum) as a string.
    size_t big = 10u << 20;
    body = malloc(big + 256);
    assert_non_null(body);
    p = body;
    p += sprintf(p, "{\"prompt\":\"x\",\"guided_json\":\"{\\\"enum\\\":[");
    while ((size_t)(p - body) < big)
        p += sprintf(p, "%s1", p[-1] == '[' ? "" : ",");
    p += sprintf(p, "]}\"}");
    expect_error(TDM_OAI_COMPLETION, body, 400, "guided_json", "at most");
    free(body);
    // Catastrophic-backtracking patterns compile (no backtracking engine) or
    // fail, quickly; a grammar accepting nothing is refused.
    expect_constraint(TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"guided_regex\":\"(a|a)*b\"}",
                      TDM_CONSTRAINT_REGEX, "(a|a)*b", "guided_regex");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"guided_grammar\":\"root ::= [^\\\\x00-\\\\U0010FFFF]\"}",
                 400, "guided_grammar", "");
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"guided_grammar\":\"root ::= \\\"a\\\" root\"}",
                 400, "guided_grammar", "accepts no string");
    assert_true(tdm_now() - t0 < 10.0);
}

// The entry point other features use to force a shape.
static void test_set_constraint(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":\"x\"}", &e), TDM_OK);
    assert_int_equal(r.sampling.constraint, TDM_CONSTRAINT_NONE);
    assert_int_equal(tdm_oai_request_set_constraint(&r, TDM_CONSTRAINT_REGEX, "(", 1, "tools", &e),
                     TDM_EINVAL);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "tools");
    assert_int_equal(r.sampling.constraint, TDM_CONSTRAINT_NONE);
    assert_int_equal(tdm_oai_request_set_constraint(&r, TDM_CONSTRAINT_CHOICE, "[\"a\"]", 5,
                                                    "tool_choice", &e),
                     TDM_OK);
    assert_int_equal(r.sampling.constraint, TDM_CONSTRAINT_CHOICE);
    assert_string_equal(r.sampling.constraint_text, "[\"a\"]");
    assert_int_equal(tdm_oai_request_set_constraint(&r, TDM_CONSTRAINT_JSON_OBJECT, NULL, 0,
                                                    "response_format", &e),
                     TDM_EINVAL);
    assert_true(strstr(e.message, "tool_choice and response_format") != NULL);
    assert_int_equal(tdm_oai_request_set_constraint(&r, TDM_CONSTRAINT_NONE, NULL, 0, "x", &e),
                     TDM_EINVAL);
    tdm_oai_request_fini(&r);
}

static void test_echo_without_generation(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    assert_int_equal(
        parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"echo\":true,\"max_tokens\":0}", &e),
        TDM_OK);
    assert_true(r.echo && r.echo_only);
    assert_int_equal(r.max_tokens, 0);
    int mt = -1;
    assert_int_equal(tdm_oai_request_max_tokens(&r, &model, 5, &mt, &e), TDM_OK);
    assert_int_equal(mt, 0);
    tdm_oai_request_fini(&r);
}

static void test_generation_config_defaults(void **state)
{
    (void)state;
    struct tdm_generation_config gc = {0};
    gc.has_temperature = true;
    gc.temperature = 0.7f;
    gc.has_top_p = true;
    gc.top_p = 0.8f;
    gc.has_top_k = true;
    gc.top_k = 20;
    gc.has_repetition_penalty = true;
    gc.repetition_penalty = 1.1f;
    gc.has_max_new_tokens = true;
    gc.max_new_tokens = 8;
    gc.pad_token_id = gc.bos_token_id = -1;
    struct tdm_oai_model_info m = model;
    m.gen = &gc;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    const char *json = "{\"prompt\":\"x\",\"top_p\":0.5}";
    assert_int_equal(tdm_oai_request_parse(&r, TDM_OAI_COMPLETION, json, strlen(json), &m, &e),
                     TDM_OK);
    assert_true(r.sampling.temperature == 0.7f);
    assert_true(r.sampling.top_p == 0.5f); // the request wins
    assert_int_equal(r.sampling.top_k, 20);
    assert_true(r.sampling.repetition_penalty == 1.1f);
    int mt;
    assert_int_equal(tdm_oai_request_max_tokens(&r, &m, 10, &mt, &e), TDM_OK);
    assert_int_equal(mt, 8); // min(16 requested, 8 max_new_tokens, 90 room)
    tdm_oai_request_fini(&r);
}

static void test_max_tokens_resolution(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    int mt;
    assert_int_equal(parse(&r, TDM_OAI_COMPLETION, "{\"prompt\":\"x\"}", &e), TDM_OK);
    assert_int_equal(tdm_oai_request_max_tokens(&r, &model, 84, &mt, &e), TDM_OK);
    assert_int_equal(mt, 16);
    assert_int_equal(tdm_oai_request_max_tokens(&r, &model, 90, &mt, &e), TDM_EINVAL);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "max_tokens");
    assert_string_equal(e.message, "'max_tokens' or 'max_completion_tokens' is too large: 16. This "
                                   "model's maximum context length is 100 tokens and your request "
                                   "has 90 input tokens (16 > 100 - 90).");
    assert_int_equal(tdm_oai_request_max_tokens(&r, &model, 100, &mt, &e), TDM_EINVAL);
    assert_string_equal(e.message, "This model's maximum context length is 100 tokens. However, "
                                   "your request has 100 input tokens. Please reduce the length "
                                   "of the input messages.");
    tdm_oai_request_fini(&r);

    // Chat without max_tokens: the room left in the context.
    assert_int_equal(
        parse(&r, TDM_OAI_CHAT,
              "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"min_tokens\":20}", &e),
        TDM_OK);
    assert_int_equal(r.max_tokens, -1);
    assert_int_equal(tdm_oai_request_max_tokens(&r, &model, 70, &mt, &e), TDM_OK);
    assert_int_equal(mt, 30);
    assert_int_equal(tdm_oai_request_max_tokens(&r, &model, 90, &mt, &e), TDM_EINVAL);
    assert_string_equal(e.param, "min_tokens");
    tdm_oai_request_fini(&r);
}

static void test_chat_request(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    const char *json =
        "{\"model\":\"qwen\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hi\"}]}],"
        "\"max_tokens\":9,\"max_completion_tokens\":12,\"logprobs\":true,\"top_logprobs\":2,"
        "\"tool_choice\":\"none\",\"parallel_tool_calls\":false}";
    assert_int_equal(parse(&r, TDM_OAI_CHAT, json, &e), TDM_OK);
    assert_int_equal(r.n_messages, 2);
    assert_string_equal(r.messages[0].role, "system");
    assert_string_equal(r.messages[1].content, "Hi");
    assert_non_null(strstr(r.messages_json, "Be brief."));
    assert_int_equal(r.max_tokens, 12); // max_completion_tokens wins
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 2);
    assert_int_equal(r.sampling.logprobs, 2);
    assert_true(r.add_generation_prompt);
    assert_false(r.continue_final_message);
    assert_false(r.add_special_tokens);
    tdm_oai_request_fini(&r);

    assert_int_equal(parse(&r, TDM_OAI_CHAT,
                           "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":"
                           "\"assistant\",\"content\":\"b\"}],\"add_generation_prompt\":false,"
                           "\"continue_final_message\":true,\"logprobs\":false}",
                           &e),
                     TDM_OK);
    assert_true(r.continue_final_message);
    assert_false(r.logprobs);
    assert_int_equal(r.sampling.logprobs, -1);
    tdm_oai_request_fini(&r);

    const enum tdm_oai_kind K = TDM_OAI_CHAT;
    expect_error(K, "{\"model\":\"qwen\"}", 400, "messages", "messages: Field required");
    expect_error(K, "{\"messages\":[]}", 400, "messages", "at least one message");
    expect_error(K, "{\"messages\":\"hi\"}", 400, "messages", "Input should be a valid list");
    expect_error(K, "{\"messages\":[{\"content\":\"hi\"}]}", 400, "messages", "role");
    expect_error(K, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"top_logprobs\":2}",
                 400, "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.");
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"logprobs\":true,"
                 "\"top_logprobs\":-1}",
                 400, "top_logprobs", "`top_logprobs` must be a positive value.");
    expect_error(K, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"logprobs\":3}", 400,
                 "logprobs", "Input should be a valid boolean");
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                 "\"continue_final_message\":true}",
                 400, "continue_final_message",
                 "Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"tools\":[{\"type\":"
                 "\"function\",\"function\":{\"name\":\"f\"}}]}",
                 400, "tool_choice",
                 "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser "
                 "to be set");
    expect_error(
        K, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"tool_choice\":\"required\"}",
        400, "tool_choice", "When using `tool_choice`, `tools` must be set.");
    expect_error(K,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"prompt_logprobs\":1,"
                 "\"stream\":true}",
                 400, "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.");
    expect_error(K, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"prompt_logprobs\":21}",
                 400, "prompt_logprobs", "greater than max allowed: 20");
    expect_error(
        K, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"max_completion_tokens\":0}",
        400, "max_completion_tokens", "max_tokens must be at least 1, got 0.");
}

static void test_tokenize_detokenize_requests(void **state)
{
    (void)state;
    struct tdm_oai_tokenize_request t;
    struct tdm_oai_error e;
    const char *j1 = "{\"model\":\"qwen\",\"prompt\":\"Hello\",\"return_token_strs\":true}";
    assert_int_equal(tdm_oai_tokenize_parse(&t, j1, strlen(j1), &model, &e), TDM_OK);
    assert_string_equal(t.prompt, "Hello");
    assert_null(t.messages);
    assert_true(t.add_special_tokens);
    assert_true(t.return_token_strs);
    tdm_oai_tokenize_fini(&t);
    const char *j2 = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}";
    assert_int_equal(tdm_oai_tokenize_parse(&t, j2, strlen(j2), &model, &e), TDM_OK);
    assert_null(t.prompt);
    assert_int_equal(t.n_messages, 1);
    assert_false(t.add_special_tokens);
    assert_true(t.add_generation_prompt);
    tdm_oai_tokenize_fini(&t);
    const char *j3 = "{\"model\":\"other\",\"prompt\":\"x\"}";
    assert_int_equal(tdm_oai_tokenize_parse(&t, j3, strlen(j3), &model, &e), TDM_EINVAL);
    assert_int_equal(e.status, 404);
    const char *j4 = "{}";
    assert_int_equal(tdm_oai_tokenize_parse(&t, j4, strlen(j4), &model, &e), TDM_EINVAL);
    assert_string_equal(e.param, "prompt");

    struct tdm_oai_detokenize_request d;
    const char *j5 = "{\"tokens\":[1,2,3]}";
    assert_int_equal(tdm_oai_detokenize_parse(&d, j5, strlen(j5), &model, &e), TDM_OK);
    assert_int_equal(d.n_tokens, 3);
    assert_int_equal(d.tokens[2], 3);
    tdm_oai_detokenize_fini(&d);
    const char *j6 = "{\"tokens\":[1,5000]}";
    assert_int_equal(tdm_oai_detokenize_parse(&d, j6, strlen(j6), &model, &e), TDM_EINVAL);
    assert_string_equal(e.param, "tokens");
    assert_non_null(strstr(e.message, "5000"));
    const char *j7 = "{\"tokens\":[]}";
    assert_int_equal(tdm_oai_detokenize_parse(&d, j7, strlen(j7), &model, &e), TDM_OK);
    assert_int_equal(d.n_tokens, 0);
    tdm_oai_detokenize_fini(&d);
    const char *j8 = "{\"tokens\":\"1 2\"}";
    assert_int_equal(tdm_oai_detokenize_parse(&d, j8, strlen(j8), &model, &e), TDM_EINVAL);
}

// ---- responses ---------------------------------------------------------------------------------
static cJSON *parse_json(char *text)
{
    assert_non_null(text);
    cJSON *j = cJSON_Parse(text);
    if (!j)
        print_error("not JSON: %s\n", text);
    assert_non_null(j);
    free(text);
    return j;
}

static const cJSON *get(const cJSON *o, const char *path)
{
    // path: "a.b.0.c" (numbers index arrays)
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    const cJSON *cur = o;
    for (char *tok = strtok(buf, "."); tok && cur; tok = strtok(NULL, ".")) {
        if (*tok >= '0' && *tok <= '9')
            cur = cJSON_GetArrayItem(cur, atoi(tok));
        else
            cur = cJSON_GetObjectItemCaseSensitive(cur, tok);
    }
    if (!cur)
        print_error("missing %s\n", path);
    assert_non_null(cur);
    return cur;
}

static void assert_str(const cJSON *o, const char *path, const char *want)
{
    const cJSON *it = get(o, path);
    assert_true(cJSON_IsString(it));
    assert_string_equal(it->valuestring, want);
}

static void assert_num(const cJSON *o, const char *path, double want)
{
    const cJSON *it = get(o, path);
    assert_true(cJSON_IsNumber(it));
    assert_true(fabs(it->valuedouble - want) < 1e-6);
}

static void assert_null_at(const cJSON *o, const char *path)
{
    assert_true(cJSON_IsNull(get(o, path)));
}

static void test_response_ids(void **state)
{
    (void)state;
    char a[TDM_OAI_ID_HEX + 1], b[TDM_OAI_ID_HEX + 1];
    tdm_oai_random_hex(a);
    tdm_oai_random_hex(b);
    assert_int_equal(strlen(a), 32);
    assert_int_equal(strspn(a, "0123456789abcdef"), 32);
    assert_string_not_equal(a, b);
    struct tdm_oai_response r;
    tdm_oai_response_init(&r, TDM_OAI_COMPLETION, "qwen", NULL);
    assert_int_equal(strncmp(r.id, "cmpl-", 5), 0);
    assert_int_equal(strlen(r.id), 5 + 32);
    assert_true(r.created > 1700000000);
    tdm_oai_response_init(&r, TDM_OAI_CHAT, "qwen", "req-1");
    assert_string_equal(r.id, "chatcmpl-req-1");
}

static void test_completion_body(void **state)
{
    (void)state;
    struct tdm_oai_response r;
    tdm_oai_response_init(&r, TDM_OAI_COMPLETION, "qwen", "x1");
    int32_t ids[] = {11, 12};
    struct tdm_oai_choice c[2] = {
        {.index = 0,
         .text = " Paris",
         .text_len = 6,
         .finish = TDM_FINISH_STOP,
         .stop_str = NULL,
         .stop_token = -1,
         .token_ids = ids,
         .n_token_ids = 2},
        {.index = 1,
         .text = "bad\xC3",
         .text_len = 4,
         .finish = TDM_FINISH_LENGTH,
         .stop_str = "\n\n",
         .stop_token = -1},
    };
    struct tdm_oai_usage u = {7, 2};
    cJSON *j = parse_json(tdm_oai_body(&r, c, 2, &u));
    assert_str(j, "id", "cmpl-x1");
    assert_str(j, "object", "text_completion");
    assert_str(j, "model", "qwen");
    assert_num(j, "created", (double)r.created);
    assert_num(j, "choices.0.index", 0);
    assert_str(j, "choices.0.text", " Paris");
    assert_null_at(j, "choices.0.logprobs");
    assert_str(j, "choices.0.finish_reason", "stop");
    assert_null_at(j, "choices.0.stop_reason");
    assert_num(j, "choices.0.token_ids.1", 12);
    assert_str(j, "choices.1.text", "bad\xEF\xBF\xBD"); // repaired
    assert_str(j, "choices.1.finish_reason", "length");
    assert_str(j, "choices.1.stop_reason", "\n\n");
    assert_num(j, "usage.prompt_tokens", 7);
    assert_num(j, "usage.completion_tokens", 2);
    assert_num(j, "usage.total_tokens", 9);
    assert_null_at(j, "usage.prompt_tokens_details");
    assert_null_at(j, "system_fingerprint");
    cJSON_Delete(j);

    // A stop token id as stop_reason.
    struct tdm_oai_choice s = {
        .index = 0, .text = "", .finish = TDM_FINISH_STOP, .stop_token = 151643};
    j = parse_json(tdm_oai_body(&r, &s, 1, &u));
    assert_num(j, "choices.0.stop_reason", 151643);
    cJSON_Delete(j);
}

static void test_chat_body_and_chunks(void **state)
{
    (void)state;
    struct tdm_oai_response r;
    tdm_oai_response_init(&r, TDM_OAI_CHAT, "qwen", NULL);
    struct tdm_oai_choice c = {
        .index = 0, .text = "Hi!", .text_len = 3, .finish = TDM_FINISH_STOP, .stop_token = -1};
    struct tdm_oai_usage u = {5, 3};
    cJSON *j = parse_json(tdm_oai_body(&r, &c, 1, &u));
    assert_str(j, "object", "chat.completion");
    assert_int_equal(strncmp(get(j, "id")->valuestring, "chatcmpl-", 9), 0);
    assert_str(j, "choices.0.message.role", "assistant");
    assert_str(j, "choices.0.message.content", "Hi!");
    assert_true(cJSON_IsArray(get(j, "choices.0.message.tool_calls")));
    assert_str(j, "choices.0.finish_reason", "stop");
    assert_num(j, "usage.total_tokens", 8);
    cJSON_Delete(j);

    j = parse_json(tdm_oai_chat_role_chunk(&r, 1));
    assert_str(j, "object", "chat.completion.chunk");
    assert_str(j, "id", r.id);
    assert_num(j, "choices.0.index", 1);
    assert_str(j, "choices.0.delta.role", "assistant");
    assert_str(j, "choices.0.delta.content", "");
    assert_null_at(j, "choices.0.logprobs");
    assert_null_at(j, "choices.0.finish_reason");
    assert_null(cJSON_GetObjectItem(j, "usage"));
    cJSON_Delete(j);

    struct tdm_oai_choice d = {.index = 0, .text = " there", .text_len = 6, .stop_token = -1};
    j = parse_json(tdm_oai_chunk(&r, &d, 1, NULL));
    assert_str(j, "choices.0.delta.content", " there");
    assert_null(cJSON_GetObjectItem(get(j, "choices.0.delta"), "role"));
    assert_null_at(j, "choices.0.finish_reason");
    assert_null(cJSON_GetObjectItem(j, "usage"));
    cJSON_Delete(j);

    // continuous_usage_stats: usage on a content chunk.
    j = parse_json(tdm_oai_chunk(&r, &d, 1, &u));
    assert_num(j, "usage.completion_tokens", 3);
    cJSON_Delete(j);

    j = parse_json(tdm_oai_usage_chunk(&r, &u));
    assert_int_equal(cJSON_GetArraySize(get(j, "choices")), 0);
    assert_num(j, "usage.prompt_tokens", 5);
    assert_str(j, "object", "chat.completion.chunk");
    cJSON_Delete(j);

    // Completions stream chunk.
    tdm_oai_response_init(&r, TDM_OAI_COMPLETION, "qwen", NULL);
    struct tdm_oai_choice f = {
        .index = 0, .text = ".", .text_len = 1, .finish = TDM_FINISH_ABORT, .stop_token = -1};
    j = parse_json(tdm_oai_chunk(&r, &f, 1, NULL));
    assert_str(j, "object", "text_completion");
    assert_str(j, "choices.0.text", ".");
    assert_str(j, "choices.0.finish_reason", "abort");
    assert_null_at(j, "choices.0.stop_reason");
    cJSON_Delete(j);
}

// Plain stream chunks (text or content only) are written directly; they must
// be, byte for byte, what the cJSON tree prints, for every byte a text can
// hold (controls, quotes, backslashes, invalid UTF-8, NULs), both kinds,
// several choices, every finish and stop_reason form, with and without usage.
static void test_chunk_direct_equals_tree(void **state)
{
    (void)state;
    srand(7);
    static const enum tdm_finish fins[] = {TDM_FINISH_NONE, TDM_FINISH_STOP, TDM_FINISH_LENGTH,
                                           TDM_FINISH_ABORT};
    char text[3][64], stop[3][16];
    int checked = 0;
    for (int iter = 0; iter < 4000; iter++) {
        struct tdm_oai_response r;
        tdm_oai_response_init(&r, iter % 2 ? TDM_OAI_CHAT : TDM_OAI_COMPLETION,
                              iter % 3 ? "Qwen/Qwen2.5-0.5B-Instruct" : "m\"o\\d\x01el",
                              iter % 5 ? NULL : "req-\"x\"\n");
        if (iter % 7 == 0)
            r.created = 4102444800LL; // past INT_MAX: cJSON's %1.15g branch
        struct tdm_oai_choice c[3];
        size_t n = 1 + (size_t)(iter % 3);
        for (size_t i = 0; i < n; i++) {
            memset(&c[i], 0, sizeof c[i]);
            c[i].index = (int)i + (iter % 11 == 0 ? 1000000 : 0);
            size_t len = (size_t)(rand() % 64);
            for (size_t k = 0; k < len; k++)
                text[i][k] = (char)(rand() % 4 ? 0x20 + rand() % 95 : rand() % 256);
            c[i].text = text[i];
            c[i].text_len = len;
            c[i].finish = fins[rand() % 4];
            c[i].stop_token = -1;
            int sr = rand() % 3;
            if (sr == 1) {
                size_t sl = (size_t)(rand() % 15);
                for (size_t k = 0; k < sl; k++)
                    stop[i][k] = (char)(1 + rand() % 255);
                stop[i][sl] = '\0';
                c[i].stop_str = stop[i];
            } else if (sr == 2) {
                c[i].stop_token = rand() % 151643;
            }
            c[i].finish_tool_calls = r.kind == TDM_OAI_CHAT && rand() % 4 == 0;
        }
        struct tdm_oai_usage u = {rand() % 100000, rand() % 100000};
        const struct tdm_oai_usage *up = iter % 4 == 0 ? &u : NULL;
        char *direct = tdm_oai_chunk(&r, c, n, up);
        char *tree = tdm_oai_chunk_tree(&r, c, n, up);
        assert_non_null(direct);
        assert_non_null(tree);
        if (strcmp(direct, tree) != 0)
            fail_msg("iteration %d:\n direct %s\n tree   %s", iter, direct, tree);
        free(direct);
        free(tree);
        checked++;
    }
    assert_int_equal(checked, 4000);
}

static void test_logprobs_formats(void **state)
{
    (void)state;
    struct tdm_oai_top_logprob top0[2] = {
        {.id = 1, .token = "Hi", .token_len = 2, .logprob = -0.25f},
        {.id = 2, .token = "Hey", .token_len = 3, .logprob = -2.0f},
    };
    struct tdm_oai_top_logprob top1[2] = {
        {.id = 3, .token = "\xC3\xA9t\xC3\xA9", .token_len = 5, .logprob = -0.5f},
        {.id = 4, .token = "\xE2\x82", .token_len = 2, .logprob = -INFINITY}, // split char
    };
    struct tdm_oai_token_logprob lps[2] = {
        {.id = 1, .token = "Hi", .token_len = 2, .logprob = -0.25f, .num_top = 2, .top = top0},
        {.id = 3,
         .token = "\xC3\xA9t\xC3\xA9",
         .token_len = 5,
         .logprob = -0.5f,
         .num_top = 2,
         .top = top1},
    };
    struct tdm_oai_choice c = {.index = 0,
                               .text = "Hi\xC3\xA9t\xC3\xA9",
                               .text_len = 7,
                               .stop_token = -1,
                               .has_logprobs = true,
                               .logprobs = lps,
                               .n_logprobs = 2,
                               .text_offset = 4};
    struct tdm_oai_response r;
    tdm_oai_response_init(&r, TDM_OAI_COMPLETION, "qwen", NULL);
    cJSON *j = parse_json(tdm_oai_chunk(&r, &c, 1, NULL));
    assert_str(j, "choices.0.logprobs.tokens.0", "Hi");
    assert_str(j, "choices.0.logprobs.tokens.1", "\xC3\xA9t\xC3\xA9");
    assert_num(j, "choices.0.logprobs.token_logprobs.0", -0.25);
    assert_num(j, "choices.0.logprobs.text_offset.0", 4);
    assert_num(j, "choices.0.logprobs.text_offset.1", 6); // code points: 4 + len("Hi")
    const cJSON *t0 = get(j, "choices.0.logprobs.top_logprobs.0");
    assert_int_equal(cJSON_GetArraySize(t0), 2); // the sampled token is one of the two
    assert_num(t0, "Hey", -2.0);
    const cJSON *t1 = get(j, "choices.0.logprobs.top_logprobs.1");
    assert_num(t1, "\xEF\xBF\xBD", -9999.0); // invalid UTF-8 repaired, -inf floored
    cJSON_Delete(j);

    tdm_oai_response_init(&r, TDM_OAI_CHAT, "qwen", NULL);
    j = parse_json(tdm_oai_body(&r, &c, 1, NULL));
    assert_str(j, "choices.0.logprobs.content.0.token", "Hi");
    assert_num(j, "choices.0.logprobs.content.0.logprob", -0.25);
    assert_num(j, "choices.0.logprobs.content.0.bytes.0", 'H');
    assert_int_equal(cJSON_GetArraySize(get(j, "choices.0.logprobs.content.1.bytes")), 5);
    assert_num(j, "choices.0.logprobs.content.1.bytes.0", 0xC3);
    assert_int_equal(cJSON_GetArraySize(get(j, "choices.0.logprobs.content.0.top_logprobs")), 2);
    assert_str(j, "choices.0.logprobs.content.0.top_logprobs.1.token", "Hey");
    assert_str(j, "choices.0.logprobs.content.1.top_logprobs.1.token", "\xEF\xBF\xBD");
    assert_num(j, "choices.0.logprobs.content.1.top_logprobs.1.logprob", -9999.0);
    assert_num(j, "choices.0.logprobs.content.1.top_logprobs.1.bytes.0", 0xEF);
    cJSON_Delete(j);

    // return_tokens_as_token_ids: every token named "token_id:<id>" (the
    // split character too), its bytes those of the name; completions'
    // offsets run over the names, as vLLM's len() of them.
    c.tokens_as_ids = true;
    j = parse_json(tdm_oai_body(&r, &c, 1, NULL));
    assert_str(j, "choices.0.logprobs.content.0.token", "token_id:1");
    assert_str(j, "choices.0.logprobs.content.1.top_logprobs.1.token", "token_id:4");
    assert_int_equal(cJSON_GetArraySize(get(j, "choices.0.logprobs.content.1.bytes")), 10);
    assert_num(j, "choices.0.logprobs.content.1.bytes.9", '3');
    cJSON_Delete(j);
    tdm_oai_response_init(&r, TDM_OAI_COMPLETION, "qwen", NULL);
    j = parse_json(tdm_oai_chunk(&r, &c, 1, NULL));
    assert_str(j, "choices.0.logprobs.tokens.0", "token_id:1");
    assert_str(j, "choices.0.logprobs.tokens.1", "token_id:3");
    assert_num(j, "choices.0.logprobs.text_offset.1", 14);
    t1 = get(j, "choices.0.logprobs.top_logprobs.1");
    assert_int_equal(cJSON_GetArraySize(t1), 2);
    assert_num(t1, "token_id:3", -0.5);
    assert_num(t1, "token_id:4", -9999.0);
    cJSON_Delete(j);

    // The request's field, or the server's default.
    struct tdm_oai_request rq;
    struct tdm_oai_error e;
    assert_int_equal(parse(&rq, TDM_OAI_COMPLETION,
                           "{\"prompt\":\"x\",\"logprobs\":1,\"return_tokens_as_token_ids\":true}",
                           &e),
                     TDM_OK);
    assert_true(rq.return_tokens_as_token_ids);
    tdm_oai_request_fini(&rq);
    assert_int_equal(parse(&rq, TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"logprobs\":1}", &e),
                     TDM_OK);
    assert_false(rq.return_tokens_as_token_ids);
    tdm_oai_request_fini(&rq);
    struct tdm_oai_model_info as_ids = model;
    as_ids.return_tokens_as_token_ids = true;
    const char *body = "{\"prompt\":\"x\"}";
    assert_int_equal(
        tdm_oai_request_parse(&rq, TDM_OAI_COMPLETION, body, strlen(body), &as_ids, &e), TDM_OK);
    assert_true(rq.return_tokens_as_token_ids);
    tdm_oai_request_fini(&rq);
    expect_error(TDM_OAI_COMPLETION, "{\"prompt\":\"x\",\"return_tokens_as_token_ids\":1}", 400,
                 "return_tokens_as_token_ids", "valid boolean");
}

static void test_error_bodies(void **state)
{
    (void)state;
    struct tdm_oai_error e;
    assert_int_equal(tdm_oai_seterr(&e, 400, "temperature", "bad %d", 3), TDM_EINVAL);
    cJSON *j = parse_json(tdm_oai_error_body(&e));
    assert_str(j, "error.message", "bad 3");
    assert_str(j, "error.type", "BadRequestError");
    assert_str(j, "error.param", "temperature");
    assert_num(j, "error.code", 400);
    cJSON_Delete(j);
    assert_int_equal(tdm_oai_seterr(&e, 500, NULL, "boom"), TDM_EPROTO);
    j = parse_json(tdm_oai_error_body(&e));
    assert_str(j, "error.type", "InternalServerError");
    assert_null_at(j, "error.param");
    assert_num(j, "error.code", 500);
    cJSON_Delete(j);
    j = parse_json(tdm_oai_error_body_from(404, NULL, "model", "The model `x` does not exist."));
    assert_str(j, "error.type", "NotFoundError");
    cJSON_Delete(j);
    assert_string_equal(tdm_oai_error_type(401), "AuthenticationError");
    assert_string_equal(tdm_oai_error_type(413), "RequestTooLargeError");
    assert_string_equal(tdm_oai_error_type(418), "BadRequestError");
    assert_string_equal(tdm_oai_error_type(503), "ServiceUnavailableError");
    assert_string_equal(tdm_oai_error_type(502), "InternalServerError");
}

static void test_models_tokenize_version(void **state)
{
    (void)state;
    struct tdm_oai_model_card card = {
        .id = "qwen", .root = "/models/qwen", .max_model_len = 4096, .created = 1730000000};
    cJSON *j = parse_json(tdm_oai_models_body(&card, 1));
    assert_str(j, "object", "list");
    assert_str(j, "data.0.id", "qwen");
    assert_str(j, "data.0.object", "model");
    assert_num(j, "data.0.created", 1730000000);
    assert_str(j, "data.0.owned_by", "vllm");
    assert_str(j, "data.0.root", "/models/qwen");
    assert_null_at(j, "data.0.parent");
    assert_num(j, "data.0.max_model_len", 4096);
    assert_str(j, "data.0.permission.0.object", "model_permission");
    assert_int_equal(strncmp(get(j, "data.0.permission.0.id")->valuestring, "modelperm-", 10), 0);
    cJSON_Delete(j);

    int32_t ids[] = {9707, 1879};
    const char *strs[] = {"Hello", "\xC4\xA0world"};
    j = parse_json(tdm_oai_tokenize_body(ids, 2, 4096, strs));
    assert_num(j, "count", 2);
    assert_num(j, "max_model_len", 4096);
    assert_num(j, "tokens.1", 1879);
    assert_str(j, "token_strs.1", "\xC4\xA0world");
    cJSON_Delete(j);
    j = parse_json(tdm_oai_tokenize_body(ids, 0, 4096, NULL));
    assert_num(j, "count", 0);
    assert_null_at(j, "token_strs");
    cJSON_Delete(j);
    // Written without a cJSON tree (issue 11, part 4), byte for byte what
    // cJSON_PrintUnformatted gives for the same values: every control byte,
    // quote, backslash, multi-byte UTF-8 and a broken sequence (U+FFFD).
    char pieces[40][8];
    const char *tricky[40];
    int32_t many[40];
    for (int i = 0; i < 32; i++) {
        snprintf(pieces[i], sizeof pieces[i], "a%cz", i == 0 ? 'x' : (char)i);
        tricky[i] = pieces[i];
        many[i] = i * 1000003 % 151643;
    }
    const char *extra[8] = {"\"q\"", "back\\slash", "\xC4\xA0sp", "\xE2\x82\xAC",
                            "bad\xFF", "/", "", "\x7F"};
    for (int i = 32; i < 40; i++) {
        tricky[i] = extra[i - 32];
        many[i] = -i; // never an id, but the writer must not care
    }
    char *mine = tdm_oai_tokenize_body(many, 40, 131072, tricky);
    assert_non_null(mine);
    cJSON *ref = cJSON_CreateObject();
    cJSON_AddNumberToObject(ref, "count", 40);
    cJSON_AddNumberToObject(ref, "max_model_len", 131072);
    cJSON *arr = cJSON_AddArrayToObject(ref, "tokens");
    cJSON *sarr = cJSON_CreateArray();
    for (int i = 0; i < 40; i++) {
        cJSON_AddItemToArray(arr, cJSON_CreateNumber(many[i]));
        char *fixed = tdm_oai_utf8_dup(tricky[i], strlen(tricky[i]));
        cJSON_AddItemToArray(sarr, cJSON_CreateString(fixed));
        free(fixed);
    }
    cJSON_AddItemToObject(ref, "token_strs", sarr);
    char *want = cJSON_PrintUnformatted(ref);
    assert_string_equal(mine, want);
    free(want);
    free(mine);
    cJSON_Delete(ref);

    j = parse_json(tdm_oai_detokenize_body("Hello\xFF", 6));
    assert_str(j, "prompt", "Hello\xEF\xBF\xBD");
    cJSON_Delete(j);
    j = parse_json(tdm_oai_version_body("0.1.0"));
    assert_str(j, "version", "0.1.0");
    cJSON_Delete(j);
}

static void test_utf8_chars(void **state)
{
    (void)state;
    assert_int_equal(tdm_oai_utf8_chars("abc", 3), 3);
    assert_int_equal(tdm_oai_utf8_chars("\xC3\xA9t\xC3\xA9", 5), 3);
    assert_int_equal(tdm_oai_utf8_chars("\xF0\x9F\x98\x80", 4), 1);
    assert_int_equal(tdm_oai_utf8_chars("\xE2\x82", 2), 1); // one U+FFFD for the maximal subpart
    assert_int_equal(tdm_oai_utf8_chars("\xFF\xFE", 2), 2);
    assert_int_equal(tdm_oai_utf8_chars("", 0), 0);
}

// Truncations and byte mutations of valid bodies: every outcome is TDM_OK or a
// 4xx with a message, never a crash (the sanitizer build runs this too).
static void test_mutated_bodies_never_crash(void **state)
{
    (void)state;
    static const char *const seeds[] = {
        "{\"model\":\"qwen\",\"prompt\":[\"a\",\"b\"],\"max_tokens\":7,\"temperature\":0.5,"
        "\"logit_bias\":{\"5\":2},\"stop\":[\"x\"],\"stream\":true,\"stream_options\":"
        "{\"include_usage\":true},\"logprobs\":2,\"n\":2,\"seed\":3}",
        "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]}],"
        "\"logprobs\":true,\"top_logprobs\":3,\"stop_token_ids\":[1,2],\"min_tokens\":1}",
        "{\"prompt\":[[1,2],[3]],\"echo\":true,\"max_tokens\":0}",
    };
    uint64_t x = 88172645463325252ULL;
    char buf[512];
    int ok = 0, rejected = 0;
    for (size_t si = 0; si < sizeof seeds / sizeof seeds[0]; si++) {
        size_t len = strlen(seeds[si]);
        for (int iter = 0; iter < 400; iter++) {
            memcpy(buf, seeds[si], len);
            size_t n = len;
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            if (iter % 4 == 0) {
                n = x % (len + 1); // truncation
            } else {
                for (int k = 0; k < 1 + iter % 3; k++) {
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    static const char alphabet[] = "{}[]\",:0123456789-.e truenfalsx\\\x80\xff";
                    buf[x % len] = alphabet[(x >> 20) % (sizeof alphabet - 1)];
                }
            }
            for (int kind = 0; kind < 2; kind++) {
                struct tdm_oai_request r;
                struct tdm_oai_error e;
                memset(&e, 0, sizeof e);
                int rc = tdm_oai_request_parse(&r, (enum tdm_oai_kind)kind, buf, n, &model, &e);
                if (rc == TDM_OK) {
                    ok++;
                    tdm_oai_request_fini(&r);
                } else {
                    rejected++;
                    assert_int_equal(rc, TDM_EINVAL);
                    assert_true(e.status == 400 || e.status == 404);
                    assert_true(e.message[0] != '\0');
                }
            }
        }
    }
    assert_true(ok > 0 && rejected > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion_defaults),
        cmocka_unit_test(test_completion_all_fields),
        cmocka_unit_test(test_prompt_forms),
        cmocka_unit_test(test_validation_errors),
        cmocka_unit_test(test_unsupported_noop_values_accepted),
        cmocka_unit_test(test_allowed_ids_and_bad_words),
        cmocka_unit_test(test_logprob_token_ids),
        cmocka_unit_test(test_chat_template_kwargs),
        cmocka_unit_test(test_max_logprobs),
        cmocka_unit_test(test_prompt_logprobs_accepted),
        cmocka_unit_test(test_echo_without_generation),
        cmocka_unit_test(test_generation_config_defaults),
        cmocka_unit_test(test_max_tokens_resolution),
        cmocka_unit_test(test_chat_request),
        cmocka_unit_test(test_tokenize_detokenize_requests),
        cmocka_unit_test(test_response_ids),
        cmocka_unit_test(test_completion_body),
        cmocka_unit_test(test_chat_body_and_chunks),
        cmocka_unit_test(test_chunk_direct_equals_tree),
        cmocka_unit_test(test_logprobs_formats),
        cmocka_unit_test(test_error_bodies),
        cmocka_unit_test(test_models_tokenize_version),
        cmocka_unit_test(test_utf8_chars),
        cmocka_unit_test(test_mutated_bodies_never_crash),
        cmocka_unit_test(test_structured_output_shapes),
        cmocka_unit_test(test_structured_output_errors),
        cmocka_unit_test(test_structured_output_hostile),
        cmocka_unit_test(test_set_constraint),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
