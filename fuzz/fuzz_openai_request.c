// SPDX-License-Identifier: Apache-2.0
// Fuzzes what an HTTP request body reaches on every OpenAI route of the router
// and the workers: the first byte picks the route (completions, chat,
// tokenize, detokenize), the rest is the body. A body the parser accepts goes
// on to tokenization and chat rendering with the real tokenizer, as a server
// does before any engine work. Any crash, leak or UB is a finding; an error
// status is the expected answer to junk.
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "chat.h"
#include "fuzz_common.h"
#include "openai.h"

static struct tdm_tokenizer *tok;
static struct tdm_chat_template *chat;
static char chat_err[256];

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    tok = fuzz_tokenizer();
    if (tdm_chat_template_new(&chat, tdm_tok_chat_template(tok), NULL, chat_err, sizeof chat_err))
        chat = NULL;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    struct tdm_oai_model_info info = {.served_name = "m", .vocab_size = tdm_tok_vocab_size(tok),
                                      .max_model_len = 4096};
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
