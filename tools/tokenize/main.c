// SPDX-License-Identifier: Apache-2.0
// tandem-tokenize: the tokenizer (and chat template) from the command line.
// Text on stdin -> ids on stdout; --decode ids -> text; --chat renders an
// OpenAI messages array with the model's chat template and prints the prompt
// and its ids; --jsonl converts one JSON object per line in either direction
// (the exactness test against the JavaScript reference drives this mode).
// Errors go to stderr as one line and the exit status is 1 (2 for usage).
#include "chat.h"
#include "core.h"
#include "tokenizer.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct opts {
    const char *model_dir;
    const char *chat_template_path;
    bool decode, chat, jsonl;
    bool add_special;   // post-processor additions (HF add_special_tokens, default on)
    bool split_special; // special-token strings in text stay text
    bool skip_special;  // decode leaves special tokens out
};

#define OFF(field) offsetof(struct opts, field)
static const struct tdm_flag tokenize_flags[] = {
    {.name = "model",
     .kind = TDM_FLAG_PTR,
     .offset = OFF(model_dir),
     .metavar = "DIR",
     .help = "the model folder (its tokenizer; required)"},
    {.name = "decode",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(decode),
     .help = "read ids (whitespace/comma separated), print the text"},
    {.name = "chat",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(chat),
     .help = "read an OpenAI messages JSON array, print the rendered\nprompt, a newline, then its "
             "ids"},
    {.name = "chat-template",
     .kind = TDM_FLAG_PTR,
     .offset = OFF(chat_template_path),
     .metavar = "FILE",
     .help = "use this chat template instead of tokenizer_config.json's"},
    {.name = "jsonl",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(jsonl),
     .help = "one JSON object per line: {\"text\":..} -> {\"ids\":[..]},\n{\"ids\":[..]} -> "
             "{\"text\":..}"},
    {.name = "no-special",
     .kind = TDM_FLAG_NOT,
     .offset = OFF(add_special),
     .help = "do not add the post-processor's special tokens (BOS)"},
    {.name = "split-special",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(split_special),
     .help = "treat special-token strings in the text as plain text"},
    {.name = "skip-special-tokens",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(skip_special),
     .help = "leave special tokens out when decoding"},
};
static const struct tdm_flags tokenize_table = {
    .usage = "usage: tandem-tokenize --model DIR [options] < input\n"
             "  (default: encode stdin text, print ids separated by spaces)\n",
    .flags = tokenize_flags,
    .n = sizeof tokenize_flags / sizeof tokenize_flags[0],
    .footer = "  --help                        this text\n",
};

static int read_stdin(char **out, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        return TDM_ENOMEM;
    for (;;) {
        if (tdm_grow(&buf, &cap, n + 4096, 1, 0) != TDM_OK) {
            free(buf);
            return TDM_ENOMEM;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, stdin);
        n += r;
        if (r == 0)
            break;
    }
    if (ferror(stdin)) {
        free(buf);
        return TDM_EIO;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return TDM_OK;
}

static void print_ids(const int32_t *ids, size_t n)
{
    for (size_t i = 0; i < n; i++)
        printf(i ? " %d" : "%d", (int)ids[i]);
    putchar('\n');
}

// Parses ids separated by whitespace, commas or brackets.
static int parse_ids(const char *s, int32_t **ids, size_t *n, char *err, size_t errlen)
{
    size_t cap = 64, cnt = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!v)
        return TDM_ENOMEM;
    while (*s) {
        if (strchr(" \t\r\n,[]", *s)) {
            s++;
            continue;
        }
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s || x < 0 || x > 2147483647L || (*end && !strchr(" \t\r\n,[]", *end))) {
            free(v);
            int shown = (int)strcspn(s, " \t\r\n,[]");
            return tdm_seterr(err, errlen, TDM_EINVAL, "not a token id: \"%.*s\"",
                              shown > 20 ? 20 : shown, s);
        }
        if (tdm_grow(&v, &cap, cnt + 1, sizeof *v, 0) != TDM_OK) {
            free(v);
            return TDM_ENOMEM;
        }
        v[cnt++] = (int32_t)x;
        s = end;
    }
    *ids = v;
    *n = cnt;
    return TDM_OK;
}

static unsigned encode_flags(const struct opts *o)
{
    return (o->add_special ? TDM_TOK_ADD_SPECIAL : 0) |
           (o->split_special ? TDM_TOK_SPLIT_SPECIAL : 0);
}

static int run_jsonl(const struct tdm_tokenizer *tok, const struct opts *o, char *input, char *err,
                     size_t errlen)
{
    size_t line_no = 0;
    char *save = NULL;
    for (char *line = strtok_r(input, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        line_no++;
        if (strspn(line, " \t\r") == strlen(line))
            continue;
        char depth_err[96];
        if (tdm_json_check_depth(line, strlen(line), TDM_JSON_MAX_DEPTH, depth_err,
                                 sizeof depth_err))
            return tdm_seterr(err, errlen, TDM_EINVAL, "line %zu: %s", line_no, depth_err);
        cJSON *obj = cJSON_Parse(line);
        if (!cJSON_IsObject(obj)) {
            cJSON_Delete(obj);
            return tdm_seterr(err, errlen, TDM_EINVAL, "line %zu: not a JSON object", line_no);
        }
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(obj, "text");
        const cJSON *idv = cJSON_GetObjectItemCaseSensitive(obj, "ids");
        cJSON *res = cJSON_CreateObject();
        int rc = res ? TDM_OK : TDM_ENOMEM;
        if (!rc && cJSON_IsString(text)) {
            int32_t *ids;
            size_t n;
            rc = tdm_tok_encode_ex(tok, text->valuestring, strlen(text->valuestring),
                                   encode_flags(o), &ids, &n);
            if (!rc) {
                cJSON *arr = cJSON_AddArrayToObject(res, "ids");
                for (size_t i = 0; arr && i < n; i++)
                    cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
                free(ids);
            }
        } else if (!rc && cJSON_IsArray(idv)) {
            size_t n = (size_t)cJSON_GetArraySize(idv), k = 0;
            int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
            const cJSON *it;
            rc = ids ? TDM_OK : TDM_ENOMEM;
            cJSON_ArrayForEach(it, idv)
            {
                if (rc || !cJSON_IsNumber(it) || it->valuedouble < 0 ||
                    it->valuedouble > 2147483647.0) {
                    rc = rc ? rc : TDM_EINVAL;
                    break;
                }
                ids[k++] = (int32_t)it->valuedouble;
            }
            char *s = NULL;
            size_t len;
            if (!rc)
                rc = tdm_tok_decode(tok, ids, k, o->skip_special, &s, &len);
            if (!rc)
                cJSON_AddStringToObject(res, "text", s);
            free(s);
            free(ids);
        } else if (!rc) {
            rc = TDM_EINVAL;
        }
        cJSON_Delete(obj);
        if (rc) {
            cJSON_Delete(res);
            return tdm_seterr(err, errlen, rc,
                              "line %zu: %s (expected {\"text\": string} or "
                              "{\"ids\": [ids in the vocabulary]})",
                              line_no, tdm_strerror(rc));
        }
        char *printed = cJSON_PrintUnformatted(res);
        cJSON_Delete(res);
        if (!printed)
            return TDM_ENOMEM;
        puts(printed);
        free(printed);
    }
    return TDM_OK;
}

static int run_chat(const struct tdm_tokenizer *tok, const struct opts *o, const char *input,
                    size_t len, char *err, size_t errlen)
{
    struct tdm_chat_template *t = NULL;
    struct tdm_chat_msg *msgs = NULL;
    size_t n_msgs = 0;
    char *prompt = NULL;
    int32_t *ids = NULL;
    size_t n_ids;
    int rc =
        tdm_chat_template_new(&t, tdm_tok_chat_template(tok), o->chat_template_path, err, errlen);
    if (!rc)
        rc = tdm_chat_template_set_tokens(t, tdm_tok_id_to_piece(tok, tdm_tok_bos_id(tok)),
                                          tdm_tok_id_to_piece(tok, tdm_tok_eos_id(tok)),
                                          tdm_tok_id_to_piece(tok, tdm_tok_pad_id(tok)));
    if (rc) {
        tdm_chat_template_free(t);
        return rc;
    }
    rc = tdm_chat_msgs_parse(input, len, &msgs, &n_msgs, err, errlen);
    if (!rc)
        rc = tdm_chat_render(t, msgs, n_msgs, true, &prompt, err, errlen);
    if (!rc)
        rc = tdm_tok_encode_ex(tok, prompt, strlen(prompt), encode_flags(o), &ids, &n_ids);
    if (!rc) {
        fputs(prompt, stdout);
        putchar('\n');
        print_ids(ids, n_ids);
    }
    free(ids);
    free(prompt);
    tdm_chat_msgs_free(msgs, n_msgs);
    tdm_chat_template_free(t);
    return rc;
}

int main(int argc, char **argv)
{
    struct opts o = {.add_special = true};
    int exit_code = 0;
    if (tdm_flags_main(&tokenize_table, &o, argc, argv, NULL, 0, NULL, "tandem-tokenize",
                       &exit_code))
        return exit_code;
    if (!o.model_dir) {
        fprintf(stderr, "tandem-tokenize: --model DIR is required (see --help)\n");
        return 2;
    }
    if (o.decode + o.chat + o.jsonl > 1) {
        fprintf(stderr, "tandem-tokenize: --decode, --chat and --jsonl exclude each other\n");
        return 2;
    }
    char err[512] = "";
    struct tdm_tokenizer *tok = NULL;
    char *input = NULL;
    size_t len = 0;
    int rc = tdm_tok_load(&tok, o.model_dir, err, sizeof err);
    if (rc)
        goto out;
    if ((rc = read_stdin(&input, &len))) {
        snprintf(err, sizeof err, "reading stdin failed");
        goto out;
    }
    if (o.jsonl) {
        rc = run_jsonl(tok, &o, input, err, sizeof err);
    } else if (o.chat) {
        rc = run_chat(tok, &o, input, len, err, sizeof err);
    } else if (o.decode) {
        int32_t *ids = NULL;
        size_t n = 0;
        char *text;
        size_t tlen;
        if (!(rc = parse_ids(input, &ids, &n, err, sizeof err))) {
            rc = tdm_tok_decode(tok, ids, n, o.skip_special, &text, &tlen);
            if (rc)
                snprintf(err, sizeof err, "an id is outside the vocabulary of %d tokens",
                         tdm_tok_vocab_size(tok));
            else {
                fwrite(text, 1, tlen, stdout);
                free(text);
            }
            free(ids);
        }
    } else {
        int32_t *ids;
        size_t n;
        if (!(rc = tdm_tok_encode_ex(tok, input, len, encode_flags(&o), &ids, &n))) {
            print_ids(ids, n);
            free(ids);
        }
    }
out:
    if (rc)
        fprintf(stderr, "tandem-tokenize: %s%s%s\n", tdm_strerror(rc), err[0] ? ": " : "", err);
    free(input);
    tdm_tok_free(tok);
    if (fflush(stdout) != 0 && !rc) {
        fprintf(stderr, "tandem-tokenize: writing stdout failed\n");
        rc = TDM_EIO;
    }
    return rc ? 1 : 0;
}
