// SPDX-License-Identifier: Apache-2.0
// chat_render_driver: renders one conversation with tdm_chat so the Jinja2
// reference scripts (ref/render_ref.py, ref/template_corpus.py,
// ref/template_fuzz.py) can compare the bytes. Not installed.
//
//   chat_render_driver (--config tokenizer_config.json | --template FILE|NAME)
//                      MESSAGES.json [--gen] [--raw] [--tools TOOLS.json]
//                      [--var NAME=VALUE]...
//
// Without --raw, MESSAGES.json is an OpenAI messages array parsed with
// tdm_chat_msgs_parse and rendered with tdm_chat_render; with --raw it is passed
// to the template as it is (tdm_chat_render_json), with the tools of --tools.
// --config also sets the special tokens (bos_token, eos_token, pad_token,
// unk_token) the file defines. Writes the prompt to stdout with no added newline;
// on error writes the message to stderr and exits 1 (2 for bad usage).
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"
#include "core.h"

#define MAX_VARS 16

struct driver_args {
    const char *config, *tmpl, *tools;
    bool gen, raw;
    const char *vars[MAX_VARS]; // "NAME=VALUE", pointing into argv
    size_t nvars;
};

static int add_var(void *opts, const char *value, char *err, size_t errlen)
{
    struct driver_args *a = opts;
    if (!strchr(value, '='))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--var: expected NAME=VALUE, got \"%s\"", value);
    if (a->nvars == MAX_VARS)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--var: at most %d", MAX_VARS);
    a->vars[a->nvars++] = value;
    return TDM_OK;
}

static const struct tdm_flag driver_flags[] = {
    TDM_FLAG_FIELD(struct driver_args, "config", TDM_FLAG_PTR, config,
                   .metavar = "tokenizer_config.json", .help = "the template from this file"),
    TDM_FLAG_FIELD(struct driver_args, "template", TDM_FLAG_PTR, tmpl, .metavar = "FILE|NAME",
                   .help = "a template file or a known template's name"),
    TDM_FLAG_FIELD(struct driver_args, "gen", TDM_FLAG_BOOL, gen,
                   .help = "add the generation prompt"),
    TDM_FLAG_FIELD(struct driver_args, "raw", TDM_FLAG_BOOL, raw,
                   .help = "pass the messages to the template as they are"),
    TDM_FLAG_FIELD(struct driver_args, "tools", TDM_FLAG_PTR, tools, .metavar = "TOOLS.json",
                   .help = "the tools array (with --raw)"),
    {.name = "var",
     .kind = TDM_FLAG_FN,
     .fn = add_var,
     .metavar = "NAME=VALUE",
     .help = "a string variable for the template (repeatable)"},
};
static const struct tdm_flags driver_table = {
    .usage = "usage: chat_render_driver (--config tokenizer_config.json | --template FILE|NAME) "
             "MESSAGES.json [--gen] [--raw] [--tools TOOLS.json] [--var NAME=VALUE]...\n",
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
    if (!messages || (!config == !tmpl) || (a.tools && !a.raw))
        goto usage;

    char err[512] = "";
    char *cfg_text = NULL, *msg_text = NULL, *tools_text = NULL, *out = NULL;
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
    static const char *const specials[] = {"bos_token", "eos_token", "pad_token", "unk_token"};
    for (size_t k = 0; cfg && k < 4 && rc == TDM_OK; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, specials[k]);
        if (cJSON_IsObject(v))
            v = cJSON_GetObjectItemCaseSensitive(v, "content");
        if (cJSON_IsString(v))
            rc = tdm_chat_template_set_var(t, specials[k], v->valuestring);
    }
    for (size_t k = 0; k < a.nvars && rc == TDM_OK; k++) {
        char name[64];
        const char *eq = strchr(a.vars[k], '=');
        snprintf(name, sizeof name, "%.*s", (int)(eq - a.vars[k]), a.vars[k]);
        rc = tdm_chat_template_set_var(t, name, eq + 1);
    }
    if (rc != TDM_OK) {
        snprintf(err, sizeof err, "setting template variables failed");
        goto fail;
    }
    rc = tdm_read_file(messages, &msg_text, &len, err, sizeof err);
    if (rc == TDM_OK && a.tools)
        rc = tdm_read_file(a.tools, &tools_text, &len, err, sizeof err);
    if (rc != TDM_OK)
        goto fail;
    if (a.raw) {
        rc = tdm_chat_render_json(t, msg_text, tools_text, a.gen, &out, err, sizeof err);
    } else {
        rc = tdm_chat_msgs_parse(msg_text, strlen(msg_text), &msgs, &n, err, sizeof err);
        if (rc == TDM_OK)
            rc = tdm_chat_render(t, msgs, n, a.gen, &out, err, sizeof err);
    }
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
    free(tools_text);
    cJSON_Delete(cfg);
    free(cfg_text);
    return rc == TDM_OK ? 0 : 1;
usage:
    tdm_flags_help(&driver_table, stderr);
    return 2;
}
