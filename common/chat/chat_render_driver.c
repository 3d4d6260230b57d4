// SPDX-License-Identifier: Apache-2.0
// chat_render_driver: renders one conversation with tdm_chat so the Jinja2
// reference (ref/render_ref.py) can compare the bytes. Not installed.
//
//   chat_render_driver (--config tokenizer_config.json | --template FILE|NAME)
//                      MESSAGES.json [--gen]
//
// Writes the prompt to stdout with no added newline; on error writes the message
// to stderr and exits 1 (2 for bad usage).
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"
#include "core.h"

struct driver_args {
    const char *config, *tmpl;
    bool gen;
};

static const struct tdm_flag driver_flags[] = {
    TDM_FLAG_FIELD(struct driver_args, "config", TDM_FLAG_PTR, config,
                   .metavar = "tokenizer_config.json", .help = "the template from this file"),
    TDM_FLAG_FIELD(struct driver_args, "template", TDM_FLAG_PTR, tmpl, .metavar = "FILE|NAME",
                   .help = "a template file or a known template's name"),
    TDM_FLAG_FIELD(struct driver_args, "gen", TDM_FLAG_BOOL, gen,
                   .help = "add the generation prompt"),
};
static const struct tdm_flags driver_table = {
    .usage = "usage: chat_render_driver (--config tokenizer_config.json | --template FILE|NAME) "
             "MESSAGES.json [--gen]\n",
    .flags = driver_flags,
    .n = sizeof driver_flags / sizeof driver_flags[0],
};

int main(int argc, char **argv)
{
    struct driver_args a = {.config = NULL};
    char *rest[1];
    int n_rest = 0, exit_code = 0;
    if (tdm_flags_main(&driver_table, &a, argc, argv, rest, 1, &n_rest, "chat_render_driver",
                       &exit_code))
        return exit_code;
    const char *config = a.config, *tmpl = a.tmpl, *messages = n_rest ? rest[0] : NULL;
    bool gen = a.gen;
    if (!messages || (!config == !tmpl))
        goto usage;

    char err[512] = "";
    char *cfg_text = NULL, *msg_text = NULL, *out = NULL;
    size_t len = 0, n = 0;
    cJSON *cfg = NULL;
    const char *template_text = NULL;
    struct tdm_chat_template *t = NULL;
    struct tdm_chat_msg *msgs = NULL;
    int rc;
    if (config) {
        rc = tdm_read_file(config, &cfg_text, &len, err, sizeof err);
        if (rc != TDM_OK)
            goto fail;
        rc = tdm_json_check_depth(cfg_text, len, TDM_JSON_MAX_DEPTH, err, sizeof err);
        if (rc != TDM_OK)
            goto fail;
        cfg = cJSON_ParseWithLength(cfg_text, len);
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
        if (cJSON_IsString(ct))
            template_text = ct->valuestring;
    }
    rc = tdm_chat_template_new(&t, template_text, tmpl, err, sizeof err);
    if (rc != TDM_OK)
        goto fail;
    rc = tdm_read_file(messages, &msg_text, &len, err, sizeof err);
    if (rc != TDM_OK)
        goto fail;
    rc = tdm_chat_msgs_parse(msg_text, len, &msgs, &n, err, sizeof err);
    if (rc != TDM_OK)
        goto fail;
    rc = tdm_chat_render(t, msgs, n, gen, &out, err, sizeof err);
    if (rc != TDM_OK)
        goto fail;
    fwrite(out, 1, strlen(out), stdout);
fail:
    if (rc != TDM_OK)
        fprintf(stderr, "%s: %s\n", tdm_strerror(rc), err);
    free(out);
    tdm_chat_msgs_free(msgs, n);
    tdm_chat_template_free(t);
    free(msg_text);
    cJSON_Delete(cfg);
    free(cfg_text);
    return rc == TDM_OK ? 0 : 1;
usage:
    tdm_flags_help(&driver_table, stderr);
    return 2;
}
