// SPDX-License-Identifier: Apache-2.0
// openai requests: JSON bodies of /v1/completions, /v1/chat/completions,
// /tokenize and /detokenize into native structs, validated at the edge so the
// engine only ever sees plain, in-range values. Messages follow vLLM's
// (protocol.py and SamplingParams._verify_args) wording; type errors follow
// pydantic's ("Input should be a valid integer"). A null field counts as absent;
// unknown fields are ignored; features vLLM has and Tandem lacks are refused
// with 400 rather than silently ignored, unless the value is a no-op.
#include "openai.h"
#include "openai_impl.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar.h"

// ---- typed field access ------------------------------------------------------------------
// Each getter returns 1 when the field is present (non-null) and valid, 0 when
// absent or null, and -1 after filling e with a 400 naming the field.

static const cJSON *field(const cJSON *obj, const char *name)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
    return it && !cJSON_IsNull(it) ? it : NULL;
}

static int get_number(const cJSON *obj, const char *name, double *out, struct tdm_oai_error *e)
{
    const cJSON *it = field(obj, name);
    if (!it)
        return 0;
    if (!cJSON_IsNumber(it)) {
        tdm_oai_seterr(e, 400, name, "%s: Input should be a valid number", name);
        return -1;
    }
    *out = it->valuedouble;
    return 1;
}

static bool json_is_int(const cJSON *it, double lo, double hi)
{
    return cJSON_IsNumber(it) && isfinite(it->valuedouble) &&
           it->valuedouble == floor(it->valuedouble) && it->valuedouble >= lo &&
           it->valuedouble <= hi;
}

static int get_int(const cJSON *obj, const char *name, int *out, struct tdm_oai_error *e)
{
    const cJSON *it = field(obj, name);
    if (!it)
        return 0;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) ||
        it->valuedouble != floor(it->valuedouble)) {
        tdm_oai_seterr(e, 400, name, "%s: Input should be a valid integer", name);
        return -1;
    }
    // Every integer field is a count, an id, a size or a priority: none means
    // anything outside 32 bits (top_k or priority of 1e30 used to be clamped
    // and accepted).
    double v = it->valuedouble;
    if (v > INT32_MAX || v < INT32_MIN) {
        tdm_oai_seterr(e, 400, name, "%s must be between %d and %d, got %.17g.", name, INT32_MIN,
                       INT32_MAX, v);
        return -1;
    }
    *out = (int)v;
    return 1;
}

static int get_bool(const cJSON *obj, const char *name, bool *out, struct tdm_oai_error *e)
{
    const cJSON *it = field(obj, name);
    if (!it)
        return 0;
    if (!cJSON_IsBool(it)) {
        tdm_oai_seterr(e, 400, name, "%s: Input should be a valid boolean", name);
        return -1;
    }
    *out = cJSON_IsTrue(it);
    return 1;
}

// *out is a heap copy (caller frees).
static int get_string(const cJSON *obj, const char *name, char **out, struct tdm_oai_error *e)
{
    const cJSON *it = field(obj, name);
    if (!it)
        return 0;
    if (!cJSON_IsString(it)) {
        tdm_oai_seterr(e, 400, name, "%s: Input should be a valid string", name);
        return -1;
    }
    *out = strdup(it->valuestring);
    if (!*out) {
        tdm_oai_seterr(e, 500, NULL, "out of memory");
        return -1;
    }
    return 1;
}

static int err_range(struct tdm_oai_error *e, const char *param, const char *fmt, double v)
{
    char num[32];
    tdm_oai_fmt_float(num, v);
    char msg[256];
    snprintf(msg, sizeof msg, fmt, num);
    return tdm_oai_seterr(e, 400, param, "%s", msg);
}

static int not_supported(struct tdm_oai_error *e, const char *name, const char *why)
{
    return tdm_oai_seterr(e, 400, name, "%s is not supported by this server%s%s", name,
                          why ? ": " : "", why ? why : "");
}

static bool is_empty_value(const cJSON *it)
{
    return !it || cJSON_IsNull(it) || (cJSON_IsFalse(it)) ||
           ((cJSON_IsArray(it) || cJSON_IsObject(it)) && !it->child) ||
           (cJSON_IsString(it) && it->valuestring[0] == '\0');
}

// Fields vLLM supports that Tandem does not implement: refused unless empty/no-op.
static int check_unsupported(const cJSON *root, enum tdm_oai_kind kind, struct tdm_oai_error *e)
{
    static const struct {
        const char *name;
        const char *why;
    } fields[] = {
        {"suffix", NULL},
        {"functions", "use tools"},
        {"function_call", "use tool_choice"},
        {"use_beam_search", NULL},
        {"logits_processors", NULL},
        {"prompt_embeds", NULL},
        {"audio", NULL},
        {"modalities", NULL},
        {"mm_processor_kwargs", NULL},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, fields[i].name);
        if (!is_empty_value(it))
            return not_supported(e, fields[i].name, fields[i].why);
    }
    const cJSON *gwp = cJSON_GetObjectItemCaseSensitive(root, "guided_whitespace_pattern");
    if (!is_empty_value(gwp))
        return not_supported(e, "guided_whitespace_pattern",
                             "JSON whitespace is fixed (at most 4 bytes per place)");
    if (kind == TDM_OAI_COMPLETION && !is_empty_value(field(root, "tools")))
        return not_supported(e, "tools", "tools are a chat feature");
    return TDM_OK;
}

// ---- structured outputs -----------------------------------------------------------------------
// One constraint per request, from one of: response_format (json_object,
// json_schema), structured_outputs {json, regex, choice, grammar, json_object},
// guided_json, guided_regex, guided_choice, guided_grammar. Each becomes
// (kind, text): a schema object as compact JSON text (a schema given as a
// string is taken as is), choices as a JSON array of strings.

int tdm_oai_request_set_constraint(struct tdm_oai_request *r, enum tdm_constraint_kind kind,
                                   const char *text, size_t len, const char *param,
                                   struct tdm_oai_error *e)
{
    if (kind == TDM_CONSTRAINT_NONE || (unsigned)kind >= TDM_CONSTRAINT_COUNT)
        return tdm_oai_seterr(e, 400, param, "%s: unknown constraint kind %d",
                              param ? param : "constraint", (int)kind);
    if (r->sampling.constraint != TDM_CONSTRAINT_NONE)
        return tdm_oai_seterr(e, 400, param,
                              "You can only use one kind of structured outputs constraint but "
                              "multiple are specified: %s and %s",
                              r->constraint_param[0] ? r->constraint_param : "one",
                              param ? param : "another");
    if (!text)
        text = "", len = 0;
    // Validate now (a 400 with the grammar engine's message before any work);
    // the cache hands the same grammar to the engine at submit.
    struct tdm_grammar *g = NULL;
    char err[256] = "";
    int rc = tdm_grammar_compile_cached(&g, kind, text, len, err, sizeof err);
    tdm_grammar_unref(g);
    if (rc == TDM_ENOMEM)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    if (rc != TDM_OK)
        return tdm_oai_seterr(e, 400, param, "%s: %s", param ? param : "constraint", err);
    char *copy = malloc(len + 1);
    if (!copy)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    memcpy(copy, text, len);
    copy[len] = '\0';
    free(r->constraint_text);
    r->constraint_text = copy;
    r->constraint_len = len;
    snprintf(r->constraint_param, sizeof r->constraint_param, "%s", param ? param : "");
    r->sampling.constraint = kind;
    r->sampling.constraint_text = copy;
    r->sampling.constraint_len = len;
    return TDM_OK;
}

// val's text for kind, into *text (heap; caller frees) and sets the constraint.
static int constraint_from_json(struct tdm_oai_request *r, enum tdm_constraint_kind kind,
                                const cJSON *val, const char *param, struct tdm_oai_error *e)
{
    char *text = NULL;
    switch (kind) {
    case TDM_CONSTRAINT_JSON_SCHEMA:
        if (cJSON_IsString(val))
            text = strdup(val->valuestring);
        else if (cJSON_IsObject(val) || cJSON_IsBool(val))
            text = cJSON_PrintUnformatted(val);
        else
            return tdm_oai_seterr(e, 400, param,
                                  "%s: Input should be a valid dictionary or a JSON string",
                                  param);
        break;
    case TDM_CONSTRAINT_REGEX:
    case TDM_CONSTRAINT_GRAMMAR:
        if (!cJSON_IsString(val))
            return tdm_oai_seterr(e, 400, param, "%s: Input should be a valid string", param);
        text = strdup(val->valuestring);
        break;
    case TDM_CONSTRAINT_CHOICE: {
        if (!cJSON_IsArray(val))
            return tdm_oai_seterr(e, 400, param, "%s: Input should be a valid list", param);
        if (!val->child)
            return tdm_oai_seterr(e, 400, param, "%s: the list of choices is empty", param);
        const cJSON *it;
        cJSON_ArrayForEach(it, val)
        {
            if (!cJSON_IsString(it))
                return tdm_oai_seterr(e, 400, param, "%s: Input should be a list of strings",
                                      param);
        }
        text = cJSON_PrintUnformatted(val);
        break;
    }
    case TDM_CONSTRAINT_JSON_OBJECT:
        return tdm_oai_request_set_constraint(r, kind, "", 0, param, e);
    default:
        return tdm_oai_seterr(e, 500, NULL, "unknown constraint kind");
    }
    if (!text)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    int rc = tdm_oai_request_set_constraint(r, kind, text, strlen(text), param, e);
    free(text);
    return rc;
}

static int parse_response_format(const cJSON *root, struct tdm_oai_request *r,
                                 struct tdm_oai_error *e)
{
    const cJSON *rf = field(root, "response_format");
    if (!rf)
        return TDM_OK;
    if (!cJSON_IsObject(rf))
        return tdm_oai_seterr(e, 400, "response_format",
                              "response_format: Input should be a valid dictionary");
    const cJSON *type = field(rf, "type");
    if (!cJSON_IsString(type))
        return tdm_oai_seterr(e, 400, "response_format", "response_format.type: Field required");
    const char *t = type->valuestring;
    if (strcmp(t, "text") == 0)
        return TDM_OK;
    if (strcmp(t, "json_object") == 0)
        return tdm_oai_request_set_constraint(r, TDM_CONSTRAINT_JSON_OBJECT, "", 0,
                                              "response_format", e);
    if (strcmp(t, "json_schema") == 0) {
        const cJSON *js = field(rf, "json_schema");
        if (!js)
            return tdm_oai_seterr(e, 400, "response_format",
                                  "response_format.json_schema: Field required when type is "
                                  "\"json_schema\"");
        if (!cJSON_IsObject(js))
            return tdm_oai_seterr(e, 400, "response_format",
                                  "response_format.json_schema: Input should be a valid "
                                  "dictionary");
        const cJSON *name = field(js, "name");
        if (name && !cJSON_IsString(name))
            return tdm_oai_seterr(e, 400, "response_format",
                                  "response_format.json_schema.name: Input should be a valid "
                                  "string");
        const cJSON *strict = field(js, "strict");
        if (strict && !cJSON_IsBool(strict))
            return tdm_oai_seterr(e, 400, "response_format",
                                  "response_format.json_schema.strict: Input should be a valid "
                                  "boolean");
        const cJSON *schema = field(js, "schema");
        if (!schema)
            return tdm_oai_seterr(e, 400, "response_format",
                                  "response_format.json_schema.schema: Field required");
        if (!cJSON_IsObject(schema) && !cJSON_IsBool(schema))
            return tdm_oai_seterr(e, 400, "response_format",
                                  "response_format.json_schema.schema: Input should be a valid "
                                  "dictionary");
        return constraint_from_json(r, TDM_CONSTRAINT_JSON_SCHEMA, schema, "response_format", e);
    }
    if (strcmp(t, "structural_tag") == 0)
        return not_supported(e, "response_format", "structural tags");
    return tdm_oai_seterr(e, 400, "response_format",
                          "response_format.type: Input should be 'text', 'json_object' or "
                          "'json_schema', got '%.64s'",
                          t);
}

static int parse_constraints(const cJSON *root, struct tdm_oai_request *r,
                             struct tdm_oai_error *e)
{
    if (parse_response_format(root, r, e) != TDM_OK)
        return TDM_EINVAL;
    const cJSON *so = field(root, "structured_outputs");
    if (so) {
        if (!cJSON_IsObject(so))
            return tdm_oai_seterr(e, 400, "structured_outputs",
                                  "structured_outputs: Input should be a valid dictionary");
        if (!is_empty_value(cJSON_GetObjectItemCaseSensitive(so, "structural_tag")))
            return not_supported(e, "structured_outputs.structural_tag", NULL);
        if (!is_empty_value(cJSON_GetObjectItemCaseSensitive(so, "whitespace_pattern")))
            return not_supported(e, "structured_outputs.whitespace_pattern",
                                 "JSON whitespace is fixed (at most 4 bytes per place)");
        static const struct {
            const char *key, *param;
            enum tdm_constraint_kind kind;
        } keys[] = {
            {"json", "structured_outputs.json", TDM_CONSTRAINT_JSON_SCHEMA},
            {"regex", "structured_outputs.regex", TDM_CONSTRAINT_REGEX},
            {"choice", "structured_outputs.choice", TDM_CONSTRAINT_CHOICE},
            {"grammar", "structured_outputs.grammar", TDM_CONSTRAINT_GRAMMAR},
        };
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
            const cJSON *v = field(so, keys[i].key);
            if (v && constraint_from_json(r, keys[i].kind, v, keys[i].param, e) != TDM_OK)
                return TDM_EINVAL;
        }
        bool jo = false;
        if (get_bool(so, "json_object", &jo, e) < 0)
            return TDM_EINVAL;
        if (jo && tdm_oai_request_set_constraint(r, TDM_CONSTRAINT_JSON_OBJECT, "", 0,
                                                 "structured_outputs.json_object", e) != TDM_OK)
            return TDM_EINVAL;
    }
    static const struct {
        const char *key;
        enum tdm_constraint_kind kind;
    } guided[] = {
        {"guided_json", TDM_CONSTRAINT_JSON_SCHEMA},
        {"guided_regex", TDM_CONSTRAINT_REGEX},
        {"guided_choice", TDM_CONSTRAINT_CHOICE},
        {"guided_grammar", TDM_CONSTRAINT_GRAMMAR},
    };
    for (size_t i = 0; i < sizeof guided / sizeof guided[0]; i++) {
        const cJSON *v = field(root, guided[i].key);
        if (v && constraint_from_json(r, guided[i].kind, v, guided[i].key, e) != TDM_OK)
            return TDM_EINVAL;
    }
    const cJSON *backend = field(root, "guided_decoding_backend");
    if (backend && !cJSON_IsString(backend))
        return tdm_oai_seterr(e, 400, "guided_decoding_backend",
                              "guided_decoding_backend: Input should be a valid string");
    return TDM_OK;
}

// ---- prompts ---------------------------------------------------------------------------------
static int token_ids(const cJSON *arr, const char *param, const struct tdm_oai_model_info *m,
                     int32_t **ids, size_t *n, struct tdm_oai_error *e)
{
    size_t count = (size_t)cJSON_GetArraySize(arr);
    *ids = NULL;
    *n = 0;
    if (count == 0)
        return tdm_oai_seterr(e, 400, param, "The decoder prompt cannot be empty");
    int32_t *out = malloc(count * sizeof *out);
    if (!out)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, arr)
    {
        if (!json_is_int(it, -2147483648.0, 2147483647.0)) {
            free(out);
            return tdm_oai_seterr(e, 400, param, "%s: token ids must be integers", param);
        }
        int v = (int)it->valuedouble;
        if (v < 0 || (m && m->vocab_size > 0 && v >= m->vocab_size)) {
            free(out);
            return tdm_oai_seterr(e, 400, param, "Token id %d is out of vocabulary", v);
        }
        out[i++] = v;
    }
    *ids = out;
    *n = count;
    return TDM_OK;
}

static int prompt_text(const cJSON *s, struct tdm_oai_prompt *p, struct tdm_oai_error *e)
{
    if (s->valuestring[0] == '\0')
        return tdm_oai_seterr(e, 400, "prompt", "The decoder prompt cannot be empty");
    p->text = strdup(s->valuestring);
    if (!p->text)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    p->text_len = strlen(p->text);
    return TDM_OK;
}

static int parse_prompts(const cJSON *root, struct tdm_oai_request *r,
                         const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    const cJSON *p = field(root, "prompt");
    if (!p || (cJSON_IsArray(p) && !p->child))
        return tdm_oai_seterr(e, 400, "prompt",
                              "Either prompt or prompt_embeds must be provided and non-empty.");
    static const char type_msg[] = "prompt: Input should be a valid string, a list of strings, a "
                                   "list of token ids or a list of lists of token ids";
    if (cJSON_IsString(p)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts)
            return tdm_oai_seterr(e, 500, NULL, "out of memory");
        r->n_prompts = 1;
        return prompt_text(p, &r->prompts[0], e);
    }
    if (!cJSON_IsArray(p))
        return tdm_oai_seterr(e, 400, "prompt", "%s", type_msg);
    const cJSON *first = p->child;
    if (cJSON_IsNumber(first)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts)
            return tdm_oai_seterr(e, 500, NULL, "out of memory");
        r->n_prompts = 1;
        return token_ids(p, "prompt", m, &r->prompts[0].ids, &r->prompts[0].n_ids, e);
    }
    size_t count = (size_t)cJSON_GetArraySize(p);
    if (count > TDM_OAI_MAX_SEQUENCES)
        return tdm_oai_seterr(e, 400, "prompt",
                              "prompt: at most %d prompts per request (n x prompts sequences), "
                              "got %zu.",
                              TDM_OAI_MAX_SEQUENCES, count);
    r->prompts = calloc(count, sizeof *r->prompts);
    if (!r->prompts)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    r->n_prompts = count;
    bool strings = cJSON_IsString(first);
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, p)
    {
        int rc;
        if (strings && cJSON_IsString(it))
            rc = prompt_text(it, &r->prompts[i], e);
        else if (!strings && cJSON_IsArray(it))
            rc = token_ids(it, "prompt", m, &r->prompts[i].ids, &r->prompts[i].n_ids, e);
        else
            rc = tdm_oai_seterr(e, 400, "prompt", "%s", type_msg);
        if (rc != TDM_OK)
            return rc;
        i++;
    }
    return TDM_OK;
}

// ---- messages --------------------------------------------------------------------------------
// *json_out (may be NULL): the array as compact JSON; *conv_out: the conversation
// the template sees (tdm_oai_conversation_json).
static int parse_messages(const cJSON *root, struct tdm_chat_msg **msgs, size_t *n, char **json_out,
                          char **conv_out, struct tdm_oai_error *e)
{
    const cJSON *m = field(root, "messages");
    if (!m)
        return tdm_oai_seterr(e, 400, "messages", "messages: Field required");
    if (!cJSON_IsArray(m))
        return tdm_oai_seterr(e, 400, "messages", "messages: Input should be a valid list");
    if (!m->child)
        return tdm_oai_seterr(e, 400, "messages", "messages must contain at least one message");
    char *text = cJSON_PrintUnformatted(m);
    if (!text)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    char err[256] = "";
    int rc = tdm_chat_msgs_parse_calls(text, strlen(text), msgs, n, err, sizeof err);
    if (rc != TDM_OK) {
        free(text);
        if (rc == TDM_ENOMEM)
            return tdm_oai_seterr(e, 500, NULL, "out of memory");
        return tdm_oai_seterr(e, 400, "messages", "%s", err);
    }
    rc = tdm_oai_conversation_json(m, *msgs, *n, conv_out, e);
    if (rc != TDM_OK) {
        free(text);
        return rc;
    }
    if (json_out)
        *json_out = text;
    else
        free(text);
    return TDM_OK;
}

// ---- stop, stop_token_ids, logit_bias -------------------------------------------------------
static int parse_stop(const cJSON *root, struct tdm_oai_request *r, struct tdm_oai_error *e)
{
    const cJSON *s = field(root, "stop");
    if (!s)
        return TDM_OK;
    if (cJSON_IsString(s)) {
        if (!s->valuestring[0])
            return tdm_oai_seterr(e, 400, "stop", "stop cannot contain an empty string.");
        if (!(r->stop[0] = strdup(s->valuestring)))
            return tdm_oai_seterr(e, 500, NULL, "out of memory");
        r->n_stop = 1;
        return TDM_OK;
    }
    if (!cJSON_IsArray(s))
        return tdm_oai_seterr(e, 400, "stop",
                              "stop: Input should be a valid string or a list of strings");
    if (cJSON_GetArraySize(s) > TDM_OAI_MAX_STOP)
        return tdm_oai_seterr(e, 400, "stop", "stop may hold at most %d strings, got %d",
                              TDM_OAI_MAX_STOP, cJSON_GetArraySize(s));
    const cJSON *it;
    cJSON_ArrayForEach(it, s)
    {
        if (!cJSON_IsString(it))
            return tdm_oai_seterr(e, 400, "stop",
                                  "stop: Input should be a valid string or a list of strings");
        if (!it->valuestring[0])
            return tdm_oai_seterr(e, 400, "stop", "stop cannot contain an empty string.");
        if (!(r->stop[r->n_stop] = strdup(it->valuestring)))
            return tdm_oai_seterr(e, 500, NULL, "out of memory");
        r->n_stop++;
    }
    return TDM_OK;
}

// The token ids of the JSON list `list` (the request's field `name`) into
// out[] (room for all of them): how many; -1 with e set for an item that is
// not an integer; -2 with *oov the first id outside [0, vocabulary), whose
// error the caller words (vLLM words it per field).
static int token_ids_of(const cJSON *list, const char *name, const struct tdm_oai_model_info *m,
                        int32_t *out, int *oov, struct tdm_oai_error *e)
{
    int n = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, list)
    {
        if (!json_is_int(it, -2147483648.0, 2147483647.0)) {
            tdm_oai_seterr(e, 400, name, "%s must contain only integers", name);
            return -1;
        }
        int v = (int)it->valuedouble;
        if (v < 0 || (m && m->vocab_size > 0 && v >= m->vocab_size)) {
            *oov = v;
            return -2;
        }
        out[n++] = v;
    }
    return n;
}

static int parse_stop_ids(const cJSON *root, struct tdm_sampling_params *p,
                          const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    const cJSON *s = field(root, "stop_token_ids");
    if (!s)
        return TDM_OK;
    if (!cJSON_IsArray(s))
        return tdm_oai_seterr(e, 400, "stop_token_ids",
                              "stop_token_ids: Input should be a valid list");
    if (cJSON_GetArraySize(s) > TDM_MAX_STOP_IDS)
        return tdm_oai_seterr(e, 400, "stop_token_ids",
                              "stop_token_ids may hold at most %d ids, got %d", TDM_MAX_STOP_IDS,
                              cJSON_GetArraySize(s));
    int oov = 0, n = token_ids_of(s, "stop_token_ids", m, p->stop_token_ids, &oov, e);
    if (n == -2)
        return tdm_oai_seterr(e, 400, "stop_token_ids",
                              "token_id(s) [%d] in stop_token_ids contain out-of-vocab token ids. "
                              "Vocabulary size: %d",
                              oov, m ? m->vocab_size : 0);
    if (n < 0)
        return TDM_EINVAL;
    p->num_stop_token_ids = n;
    return TDM_OK;
}

// allowed_token_ids (vLLM's): a non-empty list of token ids, kept in r and
// lent to the sampling params.
static int parse_allowed_ids(const cJSON *root, struct tdm_oai_request *r,
                             const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    const cJSON *a = field(root, "allowed_token_ids");
    if (!a)
        return TDM_OK;
    if (!cJSON_IsArray(a))
        return tdm_oai_seterr(e, 400, "allowed_token_ids",
                              "allowed_token_ids: Input should be a valid list");
    int n = cJSON_GetArraySize(a);
    if (n == 0)
        return tdm_oai_seterr(e, 400, "allowed_token_ids",
                              "allowed_token_ids is not None and empty!");
    r->allowed_token_ids = malloc((size_t)n * sizeof *r->allowed_token_ids);
    if (!r->allowed_token_ids)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    int oov = 0;
    n = token_ids_of(a, "allowed_token_ids", m, r->allowed_token_ids, &oov, e);
    if (n == -2)
        return tdm_oai_seterr(e, 400, "allowed_token_ids",
                              "allowed_token_ids contains out-of-vocab token id!");
    if (n < 0)
        return TDM_EINVAL;
    r->n_allowed_token_ids = (size_t)n;
    r->sampling.allowed_token_ids = r->allowed_token_ids;
    r->sampling.num_allowed_token_ids = (int)r->n_allowed_token_ids;
    return TDM_OK;
}

// logprob_token_ids (vLLM's): each token's top logprobs are the chosen token
// and these ids (at most 128, in the vocabulary) instead of the top-N; the
// request must ask logprobs (chat: `logprobs: true`; completions: any
// `logprobs`). Kept in r and lent to the sampling params, which then ask the
// chosen token's logprob (logprobs 0) and the ids'.
static int parse_logprob_ids(const cJSON *root, struct tdm_oai_request *r,
                             const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    static const char name[] = "logprob_token_ids";
    const cJSON *a = field(root, name);
    if (!a)
        return TDM_OK;
    if (!cJSON_IsArray(a))
        return tdm_oai_seterr(e, 400, name, "logprob_token_ids: Input should be a valid list");
    int n = cJSON_GetArraySize(a);
    if (n == 0)
        return tdm_oai_seterr(e, 400, name, "`logprob_token_ids` must not be an empty list.");
    if (n > TDM_MAX_LOGPROB_TOKEN_IDS)
        return tdm_oai_seterr(e, 400, name,
                              "Requested logprob_token_ids of length %d, which is greater than "
                              "max allowed: %d",
                              n, TDM_MAX_LOGPROB_TOKEN_IDS);
    if (!r->logprobs)
        return tdm_oai_seterr(
            e, 400, name,
            r->kind == TDM_OAI_CHAT
                ? "when using `logprob_token_ids`, `logprobs` must be set to true."
                : "when using `logprob_token_ids`, `logprobs` must be set.");
    if (r->echo_prompt_only)
        return tdm_oai_seterr(e, 400, name,
                              "`logprob_token_ids` is not supported when `echo=True` and "
                              "`max_tokens=0` because no output tokens are generated.");
    r->logprob_token_ids = malloc((size_t)n * sizeof *r->logprob_token_ids);
    if (!r->logprob_token_ids)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    int oov = 0;
    n = token_ids_of(a, name, m, r->logprob_token_ids, &oov, e);
    if (n == -2)
        return tdm_oai_seterr(e, 400, name,
                              "token_id(s) [%d] in logprob_token_ids contain out-of-vocab token "
                              "ids. Vocabulary size: %d",
                              oov, m ? m->vocab_size : 0);
    if (n < 0)
        return TDM_EINVAL;
    r->sampling.logprob_token_ids = r->logprob_token_ids;
    r->sampling.num_logprob_token_ids = n;
    r->sampling.logprobs = 0; // the chosen token's; the ids replace the top-N
    return TDM_OK;
}

// bad_words (vLLM's): a list of non-empty strings, kept in r until the
// prompts' tokenizer turns them into token sequences (tdm_oai_bad_words_build).
static int parse_bad_words(const cJSON *root, struct tdm_oai_request *r, struct tdm_oai_error *e)
{
    const cJSON *b = field(root, "bad_words");
    if (!b)
        return TDM_OK;
    if (!cJSON_IsArray(b))
        return tdm_oai_seterr(e, 400, "bad_words", "bad_words: Input should be a valid list");
    int n = cJSON_GetArraySize(b);
    if (n > TDM_MAX_BAD_WORDS) // a word is one sequence or two: vLLM stops at one too many
        return tdm_oai_seterr(e, 400, "bad_words",
                              "Too many bad words after tokenization: %d. The max number is %d.",
                              TDM_MAX_BAD_WORDS + 1, TDM_MAX_BAD_WORDS);
    r->bad_words = calloc(n > 0 ? (size_t)n : 1, sizeof *r->bad_words);
    if (!r->bad_words)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    const cJSON *it;
    cJSON_ArrayForEach(it, b)
    {
        if (!cJSON_IsString(it))
            return tdm_oai_seterr(e, 400, "bad_words", "bad_words must contain only strings");
        if (!it->valuestring[0])
            return tdm_oai_seterr(e, 400, "bad_words", "bad_words cannot contain an empty string.");
        if (!(r->bad_words[r->n_bad_words] = strdup(it->valuestring)))
            return tdm_oai_seterr(e, 500, NULL, "out of memory");
        r->n_bad_words++;
    }
    return TDM_OK;
}

static int parse_logit_bias(const cJSON *root, struct tdm_sampling_params *p,
                            const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    const cJSON *b = field(root, "logit_bias");
    if (!b)
        return TDM_OK;
    if (!cJSON_IsObject(b))
        return tdm_oai_seterr(e, 400, "logit_bias",
                              "logit_bias: Input should be a valid dictionary");
    if (cJSON_GetArraySize(b) > TDM_MAX_LOGIT_BIAS)
        return tdm_oai_seterr(e, 400, "logit_bias",
                              "logit_bias may hold at most %d entries, got %d", TDM_MAX_LOGIT_BIAS,
                              cJSON_GetArraySize(b));
    const cJSON *it;
    cJSON_ArrayForEach(it, b)
    {
        char *end = NULL;
        long id = strtol(it->string, &end, 10);
        if (!it->string[0] || *end || id < INT32_MIN || id > INT32_MAX)
            return tdm_oai_seterr(e, 400, "logit_bias",
                                  "Found token_id `%.40s` in logit_bias but token_id must be an "
                                  "integer or string representing an integer",
                                  it->string);
        if (id < 0 || (m && m->vocab_size > 0 && id >= m->vocab_size))
            return tdm_oai_seterr(e, 400, "logit_bias",
                                  "token_id(s) [%ld] in logit_bias contain out-of-vocab token ids. "
                                  "Vocabulary size: %d",
                                  id, m ? m->vocab_size : 0);
        if (!cJSON_IsNumber(it))
            return tdm_oai_seterr(e, 400, "logit_bias",
                                  "logit_bias.%.40s: Input should be a valid number", it->string);
        // OpenAI's range; vLLM clamps rather than rejects.
        double v = it->valuedouble;
        v = v > 100.0 ? 100.0 : v < -100.0 ? -100.0 : v;
        p->logit_bias[p->num_logit_bias].token = (int32_t)id;
        p->logit_bias[p->num_logit_bias].bias = (float)v;
        p->num_logit_bias++;
    }
    return TDM_OK;
}

// ---- sampling values --------------------------------------------------------------------------
// Reads the sampling fields, checks them in vLLM's order and words, and resolves
// the defaults through generation_config.json.
static int parse_sampling(const cJSON *root, struct tdm_oai_request *r,
                          const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    struct tdm_sampling_params *p = &r->sampling;
    tdm_sampling_params_default(p);
    double temperature, top_p, min_p, rep, pres = 0, freq = 0, seed;
    int top_k, rc;
    float f_temperature, f_top_p, f_min_p, f_rep;
    struct tdm_sampling_request sreq = {0};

    if ((rc = get_number(root, "temperature", &temperature, e)) < 0)
        return TDM_EINVAL;
    if (rc) {
        if (temperature < 0)
            return err_range(e, "temperature", "temperature must be non-negative, got %s.",
                             temperature);
        if (temperature > 2)
            return err_range(e, "temperature", "temperature must be in [0, 2], got %s.",
                             temperature);
        f_temperature = (float)temperature;
        sreq.temperature = &f_temperature;
    }
    if ((rc = get_number(root, "top_p", &top_p, e)) < 0)
        return TDM_EINVAL;
    if (rc) {
        if (!(top_p > 0 && top_p <= 1))
            return err_range(e, "top_p", "top_p must be in (0, 1], got %s.", top_p);
        f_top_p = (float)top_p;
        sreq.top_p = &f_top_p;
    }
    if ((rc = get_int(root, "top_k", &top_k, e)) < 0)
        return TDM_EINVAL;
    if (rc) {
        if (top_k < -1)
            return tdm_oai_seterr(e, 400, "top_k",
                                  "top_k must be 0 (disable), or at least 1, got %d.", top_k);
        sreq.top_k = &top_k;
    }
    if ((rc = get_number(root, "min_p", &min_p, e)) < 0)
        return TDM_EINVAL;
    if (rc) {
        if (!(min_p >= 0 && min_p <= 1))
            return err_range(e, "min_p", "min_p must be in [0, 1], got %s.", min_p);
        f_min_p = (float)min_p;
        sreq.min_p = &f_min_p;
    }
    if ((rc = get_number(root, "repetition_penalty", &rep, e)) < 0)
        return TDM_EINVAL;
    if (rc) {
        if (!(rep > 0))
            return err_range(e, "repetition_penalty",
                             "repetition_penalty must be greater than zero, got %s.", rep);
        f_rep = (float)rep;
        sreq.repetition_penalty = &f_rep;
    }
    if (get_number(root, "presence_penalty", &pres, e) < 0)
        return TDM_EINVAL;
    if (!(pres >= -2 && pres <= 2))
        return err_range(e, "presence_penalty", "presence_penalty must be in [-2, 2], got %s.",
                         pres);
    if (get_number(root, "frequency_penalty", &freq, e) < 0)
        return TDM_EINVAL;
    if (!(freq >= -2 && freq <= 2))
        return err_range(e, "frequency_penalty", "frequency_penalty must be in [-2, 2], got %s.",
                         freq);
    if ((rc = get_number(root, "seed", &seed, e)) < 0)
        return TDM_EINVAL;
    if (rc) {
        // int64 range, as vLLM's Field(ge=-2**63, le=2**63-1); JSON numbers
        // beyond 2^53 have already lost precision in the double.
        if (seed != floor(seed))
            return tdm_oai_seterr(e, 400, "seed", "seed: Input should be a valid integer");
        if (seed < -9223372036854775808.0 || seed >= 9223372036854775808.0)
            return tdm_oai_seterr(e, 400, "seed", "seed: Input should be %s",
                                  seed < 0 ? "greater than or equal to -9223372036854775808"
                                           : "less than or equal to 9223372036854775807");
        p->has_seed = true;
        p->seed = (uint64_t)(int64_t)seed;
    }
    if (get_bool(root, "ignore_eos", &p->ignore_eos, e) < 0)
        return TDM_EINVAL;
    if ((rc = get_int(root, "min_tokens", &p->min_tokens, e)) < 0)
        return TDM_EINVAL;
    if (p->min_tokens < 0)
        return tdm_oai_seterr(e, 400, "min_tokens",
                              "min_tokens must be greater than or equal to 0, got %d.",
                              p->min_tokens);
    if (parse_stop_ids(root, p, m, e) != TDM_OK)
        return TDM_EINVAL;
    if (parse_logit_bias(root, p, m, e) != TDM_OK)
        return TDM_EINVAL;
    if (parse_allowed_ids(root, r, m, e) != TDM_OK || parse_bad_words(root, r, e) != TDM_OK)
        return TDM_EINVAL;

    struct tdm_sampling_resolved res;
    tdm_hf_sampling_resolve(m ? m->gen : NULL, &sreq, 0, &res);
    p->temperature = res.temperature;
    p->top_p = res.top_p;
    p->top_k = res.top_k;
    p->min_p = res.min_p;
    p->repetition_penalty = res.repetition_penalty;
    p->presence_penalty = (float)pres;
    p->frequency_penalty = (float)freq;
    p->logprobs = r->logprobs ? r->top_logprobs : -1;
    return parse_logprob_ids(root, r, m, e);
}

// The most logprobs a request may ask: --max-logprobs, else vLLM's default 20.
static int max_logprobs(const struct tdm_oai_model_info *m)
{
    return m && m->limit_logprobs ? m->max_logprobs : TDM_MAX_LOGPROBS;
}

static int parse_logprobs(const cJSON *root, struct tdm_oai_request *r,
                          const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    int rc, v = 0;
    if (r->kind == TDM_OAI_COMPLETION) {
        if ((rc = get_int(root, "logprobs", &v, e)) < 0)
            return TDM_EINVAL;
        if (!rc)
            return TDM_OK;
        if (v < 0)
            return tdm_oai_seterr(e, 400, "logprobs", "`logprobs` must be a positive value.");
        r->logprobs = true;
    } else {
        bool on = false;
        if (get_bool(root, "logprobs", &on, e) < 0)
            return TDM_EINVAL;
        if ((rc = get_int(root, "top_logprobs", &v, e)) < 0)
            return TDM_EINVAL;
        if (rc && v < 0)
            return tdm_oai_seterr(e, 400, "top_logprobs",
                                  "`top_logprobs` must be a positive value.");
        if (v > 0 && !on)
            return tdm_oai_seterr(e, 400, "top_logprobs",
                                  "when using `top_logprobs`, `logprobs` must be set to true.");
        r->logprobs = on;
    }
    if (v > max_logprobs(m))
        return tdm_oai_seterr(e, 400, "logprobs",
                              "Requested sample logprobs of %d, which is greater than max "
                              "allowed: %d",
                              v, max_logprobs(m));
    r->top_logprobs = v;
    return TDM_OK;
}

static int parse_model(const cJSON *root, char **model, const struct tdm_oai_model_info *m,
                       struct tdm_oai_error *e)
{
    if (get_string(root, "model", model, e) < 0)
        return e->status == 500 ? TDM_ENOMEM : TDM_EINVAL;
    if (*model && m && m->served_name && strcmp(*model, m->served_name) != 0)
        // vLLM's words, and which model is served (issue 28, item 6).
        return tdm_oai_seterr(e, 404, "model",
                              "The model `%.200s` does not exist. This server serves `%.200s` "
                              "(GET /v1/models lists it).",
                              *model, m->served_name);
    return TDM_OK;
}

static int parse_root(cJSON **root, const char *json, size_t len, struct tdm_oai_error *e)
{
    char depth_err[96];
    *root = NULL;
    size_t values = 0; // counted by the nesting check's scan
    if (json && tdm_json_check_depth_count(json, len, TDM_JSON_MAX_DEPTH, &values, depth_err,
                                           sizeof depth_err))
        return tdm_oai_seterr(e, 400, NULL, "The request body is not accepted: %s", depth_err);
    // cJSON ends its strings at a decoded \u0000, which would silently cut a
    // prompt ("a\u0000bbbb" became 1 token): refuse it instead.
    if (json && tdm_json_has_nul_escape(json, len))
        return tdm_oai_seterr(e, 400, NULL,
                              "The request body is not accepted: strings must not contain "
                              "NUL characters (\\u0000)");
    // The parse tree's memory, bounded by the body's size before it is built
    // (issue 29, part 3): ~80 bytes a value, so a dense array ("[1,1,1,...]":
    // 2 body bytes a value) would take 40x the body; a real request (token
    // ids of 3+ digits, text) stays far under the bound.
    if ((double)values * TDM_JSON_NODE_BYTES >
        (double)TDM_OAI_PARSE_BYTES_PER_BODY_BYTE * (double)len + TDM_OAI_PARSE_SLACK)
        return tdm_oai_seterr(e, 400, NULL,
                              "The request body is not accepted: its %zu JSON values would take "
                              "%.1f MiB to parse, over %d x its %zu bytes + 1 MiB",
                              values, (double)values * TDM_JSON_NODE_BYTES / 1048576.0,
                              TDM_OAI_PARSE_BYTES_PER_BODY_BYTE, len);
    const char *end = NULL;
    *root = json ? cJSON_ParseWithLengthOpts(json, len, &end, false) : NULL;
    if (!*root) {
        // cJSON points its parse end at the first byte it could not read.
        size_t at = json && end && end >= json && end <= json + len ? (size_t)(end - json) : 0;
        return tdm_oai_seterr(e, 400, NULL, "The request body is not valid JSON (near byte %zu)",
                              at);
    }
    // cJSON stops after the first value: anything but whitespace after it
    // (a second object, smuggled bytes) makes the body invalid.
    while (end && end < json + len && (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n'))
        end++;
    if (end && end < json + len) {
        cJSON_Delete(*root);
        *root = NULL;
        return tdm_oai_seterr(e, 400, NULL,
                              "The request body is not valid JSON: trailing data at byte %zu",
                              (size_t)(end - json));
    }
    if (!cJSON_IsObject(*root)) {
        cJSON_Delete(*root);
        *root = NULL;
        return tdm_oai_seterr(e, 400, NULL, "The request body must be a JSON object");
    }
    return TDM_OK;
}

static int fail_code(const struct tdm_oai_error *e)
{
    return e->status >= 500 ? TDM_ENOMEM : TDM_EINVAL;
}

// ---- completions and chat -----------------------------------------------------------------------
// parse_request runs these stages in order; each returns TDM_OK or the code parse_request
// returns, with e filled. The order is the order of the checks, so it decides which error a
// request with several faults gets.
typedef int (*request_stage_fn)(const cJSON *root, struct tdm_oai_request *r,
                                const struct tdm_oai_model_info *m, struct tdm_oai_error *e);

// What to run on: the model, and the messages and tools (chat) or the prompts (completions).
static int parse_input(const cJSON *root, struct tdm_oai_request *r,
                       const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    int rc;
    if (check_unsupported(root, r->kind, e) != TDM_OK)
        return TDM_EINVAL;
    if ((rc = parse_model(root, &r->model, m, e)) != TDM_OK)
        return rc;
    if (r->kind == TDM_OAI_CHAT) {
        if (parse_messages(root, &r->messages, &r->n_messages, &r->messages_json,
                           &r->conversation_json, e) != TDM_OK ||
            tdm_oai_tools_parse(root, m, false, &r->tools, e) != TDM_OK)
            return fail_code(e);
    } else if (parse_prompts(root, r, m, e) != TDM_OK) {
        return fail_code(e);
    }
    return TDM_OK;
}

static int parse_stream(const cJSON *root, struct tdm_oai_request *r,
                        const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    (void)m;
    if (get_bool(root, "stream", &r->stream, e) < 0)
        return TDM_EINVAL;
    const cJSON *so = field(root, "stream_options");
    if (so) {
        if (!cJSON_IsObject(so))
            return tdm_oai_seterr(e, 400, "stream_options",
                                  "stream_options: Input should be a valid dictionary");
        if (!r->stream && so->child)
            return tdm_oai_seterr(e, 400, "stream_options",
                                  "Stream options can only be defined when `stream=True`.");
        if (get_bool(so, "include_usage", &r->include_usage, e) < 0 ||
            get_bool(so, "continuous_usage_stats", &r->continuous_usage_stats, e) < 0)
            return TDM_EINVAL;
    }
    return TDM_OK;
}

// max_tokens, truncate_prompt_tokens, and echo, which with max_tokens=0 on a completion means echo
// without generation.
static int parse_max_tokens(const cJSON *root, struct tdm_oai_request *r,
                            const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    bool chat = r->kind == TDM_OAI_CHAT;
    // max_tokens: chat prefers max_completion_tokens (vLLM: `max_completion_tokens or max_tokens`).
    int mt = 0, mct = 0;
    int has_mt = get_int(root, "max_tokens", &mt, e);
    if (has_mt < 0)
        return TDM_EINVAL;
    int has_mct = chat ? get_int(root, "max_completion_tokens", &mct, e) : 0;
    if (has_mct < 0)
        return TDM_EINVAL;
    if (get_bool(root, "echo", &r->echo, e) < 0)
        return TDM_EINVAL;
    const char *mt_name = "max_tokens";
    if (has_mct && mct != 0) {
        mt = mct;
        has_mt = 1;
        mt_name = "max_completion_tokens";
    } else if (has_mct && !has_mt) {
        mt = 0;
        has_mt = 1;
        mt_name = "max_completion_tokens";
    }
    r->max_tokens = chat ? -1 : 16;
    // truncate_prompt_tokens, as vLLM checks it (-1: the model's context).
    int tpt = 0, has_tpt = get_int(root, "truncate_prompt_tokens", &tpt, e);
    if (has_tpt < 0)
        return TDM_EINVAL;
    if (has_tpt) {
        int max_len = m ? m->max_model_len : 0;
        if (tpt < -1)
            return tdm_oai_seterr(e, 400, "truncate_prompt_tokens",
                                  "truncate_prompt_tokens: Input should be greater than or equal "
                                  "to -1");
        if (tpt == 0)
            return tdm_oai_seterr(e, 400, "truncate_prompt_tokens",
                                  "truncate_prompt_tokens must be >= 1, got 0");
        if (tpt == -1)
            tpt = max_len; // unknown context (0): no truncation
        if (max_len > 0 && tpt > max_len)
            return tdm_oai_seterr(e, 400, "truncate_prompt_tokens",
                                  "truncate_prompt_tokens value (%d) is greater than "
                                  "max_model_len (%d). Please, select a smaller truncation size.",
                                  tpt, max_len);
        r->truncate_prompt_tokens = tpt;
    }
    if (has_mt) {
        if (!chat && mt == 0 && r->echo) {
            r->echo_only = true; // vLLM: echo without generation
            r->max_tokens = 0;
        } else if (mt < 1) {
            return tdm_oai_seterr(e, 400, mt_name, "max_tokens must be at least 1, got %d.", mt);
        } else {
            r->max_tokens = mt;
        }
    }
    return TDM_OK;
}

// n, bounded alone and as sequences per request, and best_of, which may only equal n.
static int parse_n(const cJSON *root, struct tdm_oai_request *r, const struct tdm_oai_model_info *m,
                   struct tdm_oai_error *e)
{
    (void)m;
    int rc;
    if ((rc = get_int(root, "n", &r->n, e)) < 0)
        return TDM_EINVAL;
    if (!rc)
        r->n = 1;
    if (r->n < 1)
        return tdm_oai_seterr(e, 400, "n", "n must be at least 1, got %d.", r->n);
    if (r->n > TDM_OAI_MAX_N)
        return tdm_oai_seterr(e, 400, "n", "n must be at most %d, got %d.", TDM_OAI_MAX_N, r->n);
    if (r->kind != TDM_OAI_CHAT && r->n_prompts * (size_t)r->n > TDM_OAI_MAX_SEQUENCES)
        return tdm_oai_seterr(e, 400, "n",
                              "n x prompts must be at most %d sequences per request, got %d x "
                              "%zu.",
                              TDM_OAI_MAX_SEQUENCES, r->n, r->n_prompts);
    int best_of = 0;
    if ((rc = get_int(root, "best_of", &best_of, e)) < 0)
        return TDM_EINVAL;
    if (rc && best_of < r->n)
        return tdm_oai_seterr(
            e, 400, "best_of",
            "best_of must be greater than or equal to n, got n=%d and best_of=%d.", r->n, best_of);
    if (rc && best_of > r->n)
        return not_supported(e, "best_of", "best_of greater than n");
    return TDM_OK;
}

static int parse_logprobs_and_stop(const cJSON *root, struct tdm_oai_request *r,
                                   const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    if (parse_logprobs(root, r, m, e) != TDM_OK)
        return TDM_EINVAL;
    // prompt_logprobs (completions and chat), as vLLM checks it.
    int plp = 0, rc = get_int(root, "prompt_logprobs", &plp, e);
    if (rc < 0)
        return TDM_EINVAL;
    if (rc) {
        if (r->stream && (plp > 0 || plp == -1))
            return tdm_oai_seterr(e, 400, "prompt_logprobs",
                                  "`prompt_logprobs` are not available when `stream=True`.");
        if (plp < -1)
            return tdm_oai_seterr(e, 400, "prompt_logprobs",
                                  "`prompt_logprobs` must be a positive value or -1.");
        int asked = plp == -1 && m && m->vocab_size > 0 ? m->vocab_size : plp;
        if (plp == -1 || plp > max_logprobs(m))
            return tdm_oai_seterr(e, 400, "prompt_logprobs",
                                  "Requested prompt logprobs of %d, which is greater than max "
                                  "allowed: %d",
                                  asked, max_logprobs(m));
        r->prompt_logprobs = plp;
    }
    // The prompt's logprobs come with the first generated token: echo
    // without generation generates one and drops it (vLLM).
    if (r->echo_only && (r->logprobs || r->prompt_logprobs >= 0)) {
        r->echo_only = false;
        r->echo_prompt_only = true;
        r->max_tokens = 1;
    }
    if (parse_stop(root, r, e) != TDM_OK)
        return fail_code(e);
    return TDM_OK;
}

// chat_template_kwargs (vLLM's): the server's --default-chat-template-kwargs
// (m->default_chat_template_kwargs), the request's documents (a list of
// {string: string} objects, the template's `documents`: RAG templates) and
// over both the request's object. Its
// add_generation_prompt and continue_final_message win over the request's
// fields of those names (vLLM updates its template arguments with the
// kwargs); the rest go to the template as variables, compact JSON in *out
// (heap; NULL when none). chat_template and tokenize are vLLM's 400; messages
// and tools come from the request's own fields only.
static const char untrusted_template[] =
    "Chat template is passed with request, but --trust-request-chat-template is not set. Refused "
    "request with untrusted chat template.";

// A chat's own chat_template (vLLM's): its text in *out (heap; NULL when
// absent), refused in vLLM's words unless the server trusts them
// (--trust-request-chat-template).
static int parse_chat_template(const cJSON *root, const struct tdm_oai_model_info *m, char **out,
                               struct tdm_oai_error *e)
{
    *out = NULL;
    const cJSON *t = field(root, "chat_template");
    if (!t)
        return TDM_OK;
    if (!cJSON_IsString(t))
        return tdm_oai_seterr(e, 400, "chat_template",
                              "chat_template: Input should be a valid string");
    if (!(m && m->trust_request_chat_template))
        return tdm_oai_seterr(e, 400, NULL, "%s", untrusted_template);
    if (!(*out = strdup(t->valuestring)))
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    return TDM_OK;
}

// documents (vLLM's list[dict[str, str]]), in pydantic's words.
static int check_documents(const cJSON *docs, struct tdm_oai_error *e)
{
    if (!cJSON_IsArray(docs))
        return tdm_oai_seterr(e, 400, "documents", "documents: Input should be a valid list");
    int di = 0;
    const cJSON *d, *it;
    cJSON_ArrayForEach(d, docs)
    {
        if (!cJSON_IsObject(d))
            return tdm_oai_seterr(e, 400, "documents",
                                  "documents.%d: Input should be a valid dictionary", di);
        cJSON_ArrayForEach(it, d)
        {
            if (!cJSON_IsString(it))
                return tdm_oai_seterr(e, 400, "documents",
                                      "documents.%d.%.40s: Input should be a valid string", di,
                                      it->string);
        }
        di++;
    }
    return TDM_OK;
}

// A copy of v under key in obj, as Python's dict update: a key obj has keeps
// its place, its value replaced. TDM_OK, or 500 with e.
static int dict_put(cJSON *obj, const char *key, const cJSON *v, struct tdm_oai_error *e)
{
    cJSON *copy = cJSON_Duplicate(v, true);
    if (!copy)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    if (cJSON_GetObjectItemCaseSensitive(obj, key))
        cJSON_ReplaceItemInObjectCaseSensitive(obj, key, copy);
    else
        cJSON_AddItemToObject(obj, key, copy);
    return TDM_OK;
}

static int parse_chat_kwargs(const cJSON *root, const struct tdm_oai_model_info *m, char **out,
                             bool *add_generation_prompt, bool *continue_final_message,
                             struct tdm_oai_error *e)
{
    *out = NULL;
    const cJSON *req = field(root, "chat_template_kwargs");
    if (req && !cJSON_IsObject(req))
        return tdm_oai_seterr(e, 400, "chat_template_kwargs",
                              "chat_template_kwargs: Input should be a valid dictionary");
    cJSON *kw = m && m->default_chat_template_kwargs ? cJSON_Parse(m->default_chat_template_kwargs)
                                                     : cJSON_CreateObject();
    if (!kw || !cJSON_IsObject(kw)) {
        cJSON_Delete(kw);
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    }
    const cJSON *docs = field(root, "documents"), *it;
    int rc = docs ? check_documents(docs, e) : TDM_OK;
    if (rc == TDM_OK && docs)
        rc = dict_put(kw, "documents", docs, e);
    cJSON_ArrayForEach(it, req)
    {
        if (rc == TDM_OK)
            rc = dict_put(kw, it->string, it, e);
    }
    for (cJSON *c = kw->child; c && rc == TDM_OK; c = c->next) {
        const char *k = c->string;
        if (strcmp(k, "chat_template") == 0 && !(m && m->trust_request_chat_template))
            rc = tdm_oai_seterr(e, 400, NULL, "%s", untrusted_template);
        else if (strcmp(k, "chat_template") == 0 || strcmp(k, "tokenize") == 0)
            rc = tdm_oai_seterr(e, 400, "chat_template_kwargs",
                                "Found unexpected chat template kwargs from request: {'%s'}", k);
        else if (strcmp(k, "messages") == 0 || strcmp(k, "tools") == 0)
            rc =
                tdm_oai_seterr(e, 400, "chat_template_kwargs",
                               "chat_template_kwargs.%s: the request's own %s field sets it", k, k);
        else if ((strcmp(k, "add_generation_prompt") == 0 ||
                  strcmp(k, "continue_final_message") == 0) &&
                 !cJSON_IsBool(c))
            rc = tdm_oai_seterr(e, 400, "chat_template_kwargs",
                                "chat_template_kwargs.%s: Input should be a valid boolean", k);
    }
    if (rc == TDM_OK) {
        cJSON *g = cJSON_DetachItemFromObjectCaseSensitive(kw, "add_generation_prompt");
        cJSON *c = cJSON_DetachItemFromObjectCaseSensitive(kw, "continue_final_message");
        if (g)
            *add_generation_prompt = cJSON_IsTrue(g);
        if (c)
            *continue_final_message = cJSON_IsTrue(c);
        cJSON_Delete(g);
        cJSON_Delete(c);
        if (kw->child && !(*out = cJSON_PrintUnformatted(kw)))
            rc = tdm_oai_seterr(e, 500, NULL, "out of memory");
    }
    cJSON_Delete(kw);
    return rc;
}

int tdm_oai_check_chat_template_kwargs(const char *value, char *err, size_t errlen)
{
    cJSON *root = cJSON_CreateObject(), *kw = cJSON_Parse(value);
    if (!root || !kw) {
        cJSON_Delete(root);
        cJSON_Delete(kw);
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--default-chat-template-kwargs: expected a JSON object, got \"%.60s\"",
                          value);
    }
    cJSON_AddItemToObject(root, "chat_template_kwargs", kw);
    struct tdm_oai_error e = {0};
    char *out = NULL;
    bool g = true, c = false;
    int rc = parse_chat_kwargs(root, NULL, &out, &g, &c, &e);
    free(out);
    cJSON_Delete(root);
    return rc == TDM_OK ? TDM_OK
                        : tdm_seterr(err, errlen, TDM_EINVAL, "--default-chat-template-kwargs: %s",
                                     e.message);
}

const char *tdm_oai_response_role(const struct tdm_oai_request *req)
{
    if (req->add_generation_prompt || req->n_messages == 0 ||
        !req->messages[req->n_messages - 1].role)
        return "assistant";
    return req->messages[req->n_messages - 1].role;
}

// The boolean switches on detokenizing and on templating, with their defaults.
static int parse_output_flags(const cJSON *root, struct tdm_oai_request *r,
                              const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    bool chat = r->kind == TDM_OAI_CHAT;
    r->skip_special_tokens = true;
    r->spaces_between_special_tokens = true;
    r->add_special_tokens = !chat;
    r->add_generation_prompt = true;
    if (get_bool(root, "include_stop_str_in_output", &r->include_stop_str_in_output, e) < 0 ||
        get_bool(root, "skip_special_tokens", &r->skip_special_tokens, e) < 0 ||
        get_bool(root, "spaces_between_special_tokens", &r->spaces_between_special_tokens, e) < 0 ||
        get_bool(root, "add_special_tokens", &r->add_special_tokens, e) < 0 ||
        get_bool(root, "return_token_ids", &r->return_token_ids, e) < 0)
        return TDM_EINVAL;
    // vLLM: the request's value or the server's --return-tokens-as-token-ids.
    bool as_ids = false;
    if (get_bool(root, "return_tokens_as_token_ids", &as_ids, e) < 0)
        return TDM_EINVAL;
    r->return_tokens_as_token_ids = as_ids || (m && m->return_tokens_as_token_ids);
    // vLLM's hermes parser (adjust_request): some models mark <tool_call> as a
    // special token, which skipping would remove before the parser sees it.
    if (chat && tdm_oai_tool_format_of(&r->tools) == TDM_OAI_TOOL_FORMAT_HERMES)
        r->skip_special_tokens = false;
    if (chat) {
        if (get_bool(root, "add_generation_prompt", &r->add_generation_prompt, e) < 0 ||
            get_bool(root, "continue_final_message", &r->continue_final_message, e) < 0)
            return TDM_EINVAL;
        if (parse_chat_template(root, m, &r->chat_template, e) != TDM_OK ||
            parse_chat_kwargs(root, m, &r->chat_template_kwargs, &r->add_generation_prompt,
                              &r->continue_final_message, e) != TDM_OK)
            return TDM_EINVAL;
        if (r->add_generation_prompt && r->continue_final_message)
            return tdm_oai_seterr(e, 400, "continue_final_message",
                                  "Cannot set both `continue_final_message` and "
                                  "`add_generation_prompt` to True.");
    }
    return TDM_OK;
}

// user, request_id, priority and cache_salt: who asked, how to name and rank
// the request, and whose cached prefixes it may use.
static int parse_identity(const cJSON *root, struct tdm_oai_request *r,
                          const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    (void)m;
    if (get_string(root, "user", &r->user, e) < 0 ||
        get_string(root, "request_id", &r->request_id, e) < 0)
        return fail_code(e);
    // The request id goes into every log line and response id: no control
    // characters (a newline would forge log lines), at most 256 bytes.
    if (r->request_id) {
        size_t n = strlen(r->request_id);
        if (n > 256)
            return tdm_oai_seterr(e, 400, "request_id",
                                  "request_id must be at most 256 bytes, got %zu.", n);
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)r->request_id[i] < 0x20 || r->request_id[i] == 0x7f)
                return tdm_oai_seterr(e, 400, "request_id",
                                      "request_id must not contain control characters.");
    }
    if (get_int(root, "priority", &r->priority, e) < 0)
        return TDM_EINVAL;
    // cache_salt (vLLM's): a non-empty string; it keys the prefix cache, so
    // it also goes on the P/D wire (at most 1 KiB: the engine's
    // TDM_ENGINE_CACHE_SALT_MAX, which this module cannot include).
    if (get_string(root, "cache_salt", &r->cache_salt, e) < 0)
        return fail_code(e);
    if (r->cache_salt && r->cache_salt[0] == '\0')
        return tdm_oai_seterr(e, 400, "cache_salt",
                              "Parameter 'cache_salt' must be a non-empty string if provided.");
    if (r->cache_salt && strlen(r->cache_salt) > 1024)
        return tdm_oai_seterr(e, 400, "cache_salt",
                              "cache_salt must be at most 1024 bytes, got %zu.",
                              strlen(r->cache_salt));
    return TDM_OK;
}

// Sampling and constraints, then the checks across fields parsed by earlier stages.
static int parse_generation(const cJSON *root, struct tdm_oai_request *r,
                            const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    if (parse_sampling(root, r, m, e) != TDM_OK)
        return fail_code(e);
    if (parse_constraints(root, r, e) != TDM_OK)
        return fail_code(e);
    if (r->kind == TDM_OAI_CHAT && tdm_oai_tools_force(r, e) != TDM_OK)
        return fail_code(e);
    if (r->max_tokens > 0 && r->sampling.min_tokens > r->max_tokens)
        return tdm_oai_seterr(e, 400, "min_tokens",
                              "min_tokens must be less than or equal to max_tokens=%d, got %d.",
                              r->max_tokens, r->sampling.min_tokens);
    if (r->sampling.temperature < 1e-5f && r->n > 1)
        return tdm_oai_seterr(e, 400, "n", "n must be 1 when using greedy sampling, got %d.", r->n);
    // Backstop: the sampler refuses what it cannot run; say so as a 400.
    char err[256];
    if (m && m->vocab_size > 0 &&
        tdm_sampling_params_validate(&r->sampling, m->vocab_size, err, sizeof err) != TDM_OK)
        return tdm_oai_seterr(e, 400, NULL, "%s", err);
    return TDM_OK;
}

static int parse_request(struct tdm_oai_request *r, const cJSON *root,
                         const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    static const request_stage_fn stages[] = {
        parse_input,        parse_stream,   parse_max_tokens, parse_n, parse_logprobs_and_stop,
        parse_output_flags, parse_identity, parse_generation,
    };
    for (size_t i = 0; i < sizeof stages / sizeof stages[0]; i++) {
        int rc = stages[i](root, r, m, e);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

int tdm_oai_request_parse(struct tdm_oai_request *req, enum tdm_oai_kind kind, const char *json,
                          size_t len, const struct tdm_oai_model_info *model,
                          struct tdm_oai_error *e)
{
    memset(req, 0, sizeof *req);
    req->kind = kind;
    req->prompt_logprobs = -1;
    tdm_sampling_params_default(&req->sampling);
    cJSON *root;
    int rc = parse_root(&root, json, len, e);
    if (rc != TDM_OK)
        return rc;
    rc = parse_request(req, root, model, e);
    cJSON_Delete(root);
    if (rc != TDM_OK) {
        tdm_oai_request_fini(req);
        req->kind = kind;
    }
    return rc;
}

void tdm_oai_request_fini(struct tdm_oai_request *req)
{
    if (!req)
        return;
    free(req->model);
    for (size_t i = 0; i < req->n_prompts; i++) {
        free(req->prompts[i].text);
        free(req->prompts[i].ids);
    }
    free(req->prompts);
    tdm_chat_msgs_free(req->messages, req->n_messages);
    free(req->messages_json);
    free(req->conversation_json);
    tdm_oai_tool_request_fini(&req->tools);
    for (size_t i = 0; i < req->n_stop; i++)
        free(req->stop[i]);
    free(req->user);
    free(req->request_id);
    free(req->cache_salt);
    free(req->constraint_text);
    free(req->allowed_token_ids);
    free(req->logprob_token_ids);
    for (size_t i = 0; i < req->n_bad_words; i++)
        free(req->bad_words[i]);
    free(req->bad_words);
    free(req->bad_word_ids);
    free(req->bad_word_lens);
    free(req->chat_template_kwargs);
    free(req->chat_template);
    memset(req, 0, sizeof *req);
}

int tdm_oai_request_max_tokens(const struct tdm_oai_request *req,
                               const struct tdm_oai_model_info *model, size_t prompt_len,
                               int *max_tokens, struct tdm_oai_error *e)
{
    int max_len = model ? model->max_model_len : 0;
    *max_tokens = 0;
    // vLLM's words (serving_engine._validate_input, v0.10+), for both endpoints.
    if (max_len > 0 && prompt_len >= (size_t)max_len &&
        !(req->echo_only && prompt_len == (size_t)max_len))
        return tdm_oai_seterr(e, 400, NULL,
                              "This model's maximum context length is %d tokens. However, your "
                              "request has %zu input tokens. Please reduce the length of the "
                              "input messages.",
                              max_len, prompt_len);
    if (req->echo_only)
        return TDM_OK;
    if (max_len > 0 && req->max_tokens > 0 &&
        prompt_len + (size_t)req->max_tokens > (size_t)max_len)
        return tdm_oai_seterr(e, 400, "max_tokens",
                              "'max_tokens' or 'max_completion_tokens' is too large: %d. This "
                              "model's maximum context length is %d tokens and your request has "
                              "%zu input tokens (%d > %d - %zu).",
                              req->max_tokens, max_len, prompt_len, req->max_tokens, max_len,
                              prompt_len);
    struct tdm_sampling_request sreq = {0};
    int mt = req->max_tokens;
    if (mt > 0)
        sreq.max_tokens = &mt;
    struct tdm_sampling_resolved res;
    int room = max_len > 0 ? max_len - (int)prompt_len : 0;
    tdm_hf_sampling_resolve(model ? model->gen : NULL, &sreq, room, &res);
    if (res.max_tokens < 1)
        return tdm_oai_seterr(e, 400, "max_tokens",
                              "max_tokens is not set and the model's context length is unknown");
    if (req->sampling.min_tokens > res.max_tokens)
        return tdm_oai_seterr(e, 400, "min_tokens",
                              "min_tokens must be less than or equal to max_tokens=%d, got %d.",
                              res.max_tokens, req->sampling.min_tokens);
    *max_tokens = res.max_tokens;
    return TDM_OK;
}

// ---- /tokenize and /detokenize
// -------------------------------------------------------------------
static int parse_tokenize(struct tdm_oai_tokenize_request *r, const cJSON *root,
                          const struct tdm_oai_model_info *m, struct tdm_oai_error *e)
{
    int rc;
    if ((rc = parse_model(root, &r->model, m, e)) != TDM_OK)
        return rc;
    const cJSON *prompt = field(root, "prompt");
    bool chat = field(root, "messages") != NULL;
    if (chat && prompt)
        return tdm_oai_seterr(e, 400, NULL, "Either prompt or messages must be given, not both");
    if (chat) {
        if (parse_messages(root, &r->messages, &r->n_messages, NULL, &r->conversation_json, e) !=
                TDM_OK ||
            tdm_oai_tools_parse(root, m, true, &r->tools, e) != TDM_OK)
            return fail_code(e);
    } else {
        if (!prompt)
            return tdm_oai_seterr(e, 400, "prompt", "prompt: Field required");
        if (get_string(root, "prompt", &r->prompt, e) < 0)
            return fail_code(e);
        r->prompt_len = strlen(r->prompt);
    }
    r->add_special_tokens = !chat;
    r->add_generation_prompt = true;
    if (get_bool(root, "add_special_tokens", &r->add_special_tokens, e) < 0 ||
        get_bool(root, "add_generation_prompt", &r->add_generation_prompt, e) < 0 ||
        get_bool(root, "continue_final_message", &r->continue_final_message, e) < 0 ||
        get_bool(root, "return_token_strs", &r->return_token_strs, e) < 0)
        return TDM_EINVAL;
    if (chat && (parse_chat_template(root, m, &r->chat_template, e) != TDM_OK ||
                 parse_chat_kwargs(root, m, &r->chat_template_kwargs, &r->add_generation_prompt,
                                   &r->continue_final_message, e) != TDM_OK))
        return fail_code(e);
    if (chat && r->add_generation_prompt && r->continue_final_message)
        return tdm_oai_seterr(e, 400, "continue_final_message",
                              "Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.");
    return TDM_OK;
}

int tdm_oai_tokenize_parse(struct tdm_oai_tokenize_request *req, const char *json, size_t len,
                           const struct tdm_oai_model_info *model, struct tdm_oai_error *e)
{
    memset(req, 0, sizeof *req);
    cJSON *root;
    int rc = parse_root(&root, json, len, e);
    if (rc != TDM_OK)
        return rc;
    rc = parse_tokenize(req, root, model, e);
    cJSON_Delete(root);
    if (rc != TDM_OK)
        tdm_oai_tokenize_fini(req);
    return rc;
}

void tdm_oai_tokenize_fini(struct tdm_oai_tokenize_request *req)
{
    if (!req)
        return;
    free(req->model);
    free(req->prompt);
    tdm_chat_msgs_free(req->messages, req->n_messages);
    free(req->conversation_json);
    free(req->chat_template_kwargs);
    free(req->chat_template);
    tdm_oai_tool_request_fini(&req->tools);
    memset(req, 0, sizeof *req);
}

int tdm_oai_detokenize_parse(struct tdm_oai_detokenize_request *req, const char *json, size_t len,
                             const struct tdm_oai_model_info *model, struct tdm_oai_error *e)
{
    memset(req, 0, sizeof *req);
    cJSON *root;
    int rc = parse_root(&root, json, len, e);
    if (rc != TDM_OK)
        return rc;
    if ((rc = parse_model(root, &req->model, model, e)) != TDM_OK)
        goto fail;
    const cJSON *t = field(root, "tokens");
    if (!t) {
        rc = tdm_oai_seterr(e, 400, "tokens", "tokens: Field required");
        goto fail;
    }
    if (!cJSON_IsArray(t)) {
        rc = tdm_oai_seterr(e, 400, "tokens", "tokens: Input should be a valid list");
        goto fail;
    }
    if (t->child) {
        rc = token_ids(t, "tokens", model, &req->tokens, &req->n_tokens, e);
        if (rc != TDM_OK)
            goto fail;
    }
    cJSON_Delete(root);
    return TDM_OK;
fail:
    cJSON_Delete(root);
    tdm_oai_detokenize_fini(req);
    return rc;
}

void tdm_oai_detokenize_fini(struct tdm_oai_detokenize_request *req)
{
    if (!req)
        return;
    free(req->model);
    free(req->tokens);
    memset(req, 0, sizeof *req);
}
