// SPDX-License-Identifier: Apache-2.0
// openai_prompt_driver: parses one chat completions body with
// tdm_oai_request_parse (tool parser hermes, so tool_choice "auto" is accepted)
// and prints the prompt tdm_oai_chat_prompt renders from it, so that
// ref/tools_render_ref.py can compare it with vLLM's preprocessing followed by
// Jinja2. Not installed.
//
//   openai_prompt_driver --template FILE [--var NAME=VALUE]... BODY.json
//
// Writes the prompt to stdout with no added newline; on error writes the
// message to stderr and exits 1 (2 for bad usage).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"
#include "core.h"
#include "openai.h"

int main(int argc, char **argv)
{
    const char *tmpl = NULL, *body_path = NULL;
    const char *vars[16];
    size_t nvars = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--template") == 0 && i + 1 < argc)
            tmpl = argv[++i];
        else if (strcmp(argv[i], "--var") == 0 && i + 1 < argc && nvars < 16 &&
                 strchr(argv[i + 1], '='))
            vars[nvars++] = argv[++i];
        else if (body_path == NULL && argv[i][0] != '-')
            body_path = argv[i];
        else
            body_path = NULL, i = argc;
    }
    if (tmpl == NULL || body_path == NULL) {
        fprintf(stderr, "usage: openai_prompt_driver --template FILE [--var N=V]... BODY.json\n");
        return 2;
    }
    char err[512];
    char *body = NULL;
    size_t len = 0;
    struct tdm_chat_template *t = NULL;
    int rc = tdm_read_file(body_path, &body, &len, err, sizeof err);
    if (rc == TDM_OK)
        rc = tdm_chat_template_new(&t, NULL, tmpl, err, sizeof err);
    for (size_t i = 0; rc == TDM_OK && i < nvars; i++) {
        char name[64];
        const char *eq = strchr(vars[i], '=');
        snprintf(name, sizeof name, "%.*s", (int)(eq - vars[i]), vars[i]);
        rc = tdm_chat_template_set_var(t, name, eq + 1);
    }
    if (rc != TDM_OK) {
        fprintf(stderr, "%s\n", err);
        free(body);
        tdm_chat_template_free(t);
        return 1;
    }
    struct tdm_oai_model_info info = {.served_name = NULL,
                                      .vocab_size = 0,
                                      .max_model_len = 0,
                                      .tool_parser = TDM_OAI_TOOL_PARSER_HERMES};
    struct tdm_oai_request req;
    struct tdm_oai_error e;
    char *prompt = NULL;
    rc = tdm_oai_request_parse(&req, TDM_OAI_CHAT, body, len, &info, &e);
    if (rc == TDM_OK) {
        rc = tdm_oai_chat_prompt(&req, t, NULL, &prompt, &e);
        tdm_oai_request_fini(&req);
    }
    if (rc == TDM_OK)
        fwrite(prompt, 1, strlen(prompt), stdout);
    else
        fprintf(stderr, "%d %s: %s\n", e.status, e.param, e.message);
    free(prompt);
    free(body);
    tdm_chat_template_free(t);
    return rc == TDM_OK ? 0 : 1;
}
