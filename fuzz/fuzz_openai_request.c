// SPDX-License-Identifier: Apache-2.0
// Fuzzes what an HTTP request body reaches on every OpenAI route of the router
// and the workers: the first byte picks the route (completions, chat,
// tokenize, detokenize), the rest is the body. A body the parser accepts goes
// on to tokenization and chat rendering with the real tokenizer, as a server
// does before any engine work. The body bytes are also fed, as generated text,
// to a tool-call parser (bits 2-3 of the first byte pick hermes, llama3_json,
// required or named), whole and in cuts, as the servers run them on model
// output. Any crash, leak or UB is a finding; an error status is the expected
// answer to junk.
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "fuzz_stack.h"
#include "chat.h"
#include "fuzz_common.h"
#include "openai.h"

static struct tdm_tokenizer *tok;
static struct tdm_chat_template *chat;
static char chat_err[256];

int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    tok = fuzz_tokenizer();
    if (tdm_chat_template_new(&chat, tdm_tok_chat_template(tok), NULL, chat_err, sizeof chat_err))
        chat = NULL;
    return 0;
}

// The body as model output through one parser: extracted whole, then streamed
// in pieces whose sizes come from the bytes themselves.
static void parse_output(enum tdm_oai_tool_format f, const char *text, size_t len)
{
    struct tdm_oai_tool_call *calls = NULL;
    size_t n = 0;
    char *content = NULL;
    if (tdm_oai_tools_extract(f, "f", true, text, len, &calls, &n, &content) == 0) {
        tdm_oai_tool_calls_free(calls, n);
        free(content);
    }
    struct tdm_oai_toolparse *p = NULL;
    if (tdm_oai_toolparse_new(&p, f, "f", (len & 1) != 0) != 0)
        return;
    for (size_t at = 0; at < len;) {
        size_t step = 1 + (unsigned char)text[at] % 7;
        if (step > len - at)
            step = len - at;
        if (tdm_oai_toolparse_feed(p, text + at, step) != 0)
            break;
        tdm_oai_toolparse_clear(p);
        at += step;
    }
    (void)tdm_oai_toolparse_finish(p);
    tdm_oai_toolparse_free(p);
}

static int fuzz_one(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    struct tdm_oai_model_info info = {.served_name = "m",
                                      .vocab_size = tdm_tok_vocab_size(tok),
                                      .max_model_len = 4096,
                                      .tool_parser = TDM_OAI_TOOL_PARSER_HERMES,
                                      .trust_request_chat_template = (data[0] & 0x10) != 0,
                                      .default_chat_template_kwargs =
                                          data[0] & 0x20 ? "{\"enable_thinking\":false}" : NULL};
    static const enum tdm_oai_tool_format formats[4] = {
        TDM_OAI_TOOL_FORMAT_HERMES, TDM_OAI_TOOL_FORMAT_LLAMA3_JSON, TDM_OAI_TOOL_FORMAT_REQUIRED,
        TDM_OAI_TOOL_FORMAT_NAMED};
    parse_output(formats[(data[0] >> 2) % 4], body, len);
    struct tdm_oai_error e;
    char *out = NULL;
    switch (data[0] % 4) {
    case 0:
    case 1: {
        struct tdm_oai_request req;
        enum tdm_oai_kind kind = data[0] % 4 ? TDM_OAI_CHAT : TDM_OAI_COMPLETION;
        if (tdm_oai_request_parse(&req, kind, body, len, &info, &e) != 0)
            return 0;
        struct tdm_oai_tokenized_prompt *p = NULL;
        size_t n = 0;
        int prompt_tokens = 0;
        (void)tdm_oai_prompts_build(&req, &info, tok, chat, chat_err, &p, &n, &prompt_tokens, &e);
        tdm_oai_prompts_free(p, n);
        if (tdm_oai_bad_words_build(&req, &info, tok, &e) == TDM_OK) {
            char err[256];
            (void)tdm_sampling_params_validate(&req.sampling, info.vocab_size, err, sizeof err);
        }
        tdm_oai_request_fini(&req);
        break;
    }
    case 2:
        (void)tdm_oai_tokenize_run(body, len, &info, tok, chat, chat_err, 4096, &out, &e);
        break;
    default:
        (void)tdm_oai_detokenize_run(body, len, &info, tok, &out, &e);
        break;
    }
    free(out);
    return 0;
}

TDM_FUZZ_ON_HTTP_STACK(fuzz_one)
