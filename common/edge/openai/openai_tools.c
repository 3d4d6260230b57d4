// SPDX-License-Identifier: Apache-2.0
// openai tools, request side: `tools`, `tool_choice` and `parallel_tool_calls`
// validated as vLLM's ChatCompletionRequest validates them (check_tool_usage,
// with pydantic-style messages and a 400 naming the field), the tools and the
// conversation as vLLM hands them to the chat template (tool.model_dump();
// chat_utils: content as one string, assistant tool_calls with arguments
// parsed from their JSON string into objects by _postprocess_messages,
// tool_call_id and name kept), the --tool-call-parser configuration and the
// JSON Schema that forces `required` and named calls (vLLM's
// _get_json_schema_from_tool). The parsers of the output are in
// openai_toolparse.c.
#include "openai.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "openai_impl.h"
#include "tokenizer.h"

// ---- server configuration -----------------------------------------------------------------

static const struct {
    const char *name;
    enum tdm_oai_tool_parser parser;
} parsers[] = {
    {"hermes", TDM_OAI_TOOL_PARSER_HERMES},
    {"llama3_json", TDM_OAI_TOOL_PARSER_LLAMA3_JSON},
};

int tdm_oai_tool_parser_config(bool enable_auto_tool_choice, const char *parser_name,
                               enum tdm_oai_tool_parser *out, char *err, size_t errlen)
{
    *out = TDM_OAI_TOOL_PARSER_NONE;
    bool named = parser_name && *parser_name;
    if (!named) {
        if (enable_auto_tool_choice)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--enable-auto-tool-choice requires --tool-call-parser");
        return TDM_OK;
    }
    for (size_t i = 0; i < sizeof parsers / sizeof parsers[0]; i++)
        if (strcmp(parser_name, parsers[i].name) == 0) {
            *out = enable_auto_tool_choice ? parsers[i].parser : TDM_OAI_TOOL_PARSER_NONE;
            return TDM_OK;
        }
    return tdm_seterr(err, errlen, TDM_EINVAL,
                      "--tool-call-parser: unknown parser \"%.64s\" (known: hermes, llama3_json)",
                      parser_name);
}

const char *tdm_oai_tool_parser_name(enum tdm_oai_tool_parser p)
{
    for (size_t i = 0; i < sizeof parsers / sizeof parsers[0]; i++)
        if (parsers[i].parser == p)
            return parsers[i].name;
    return "none";
}

enum tdm_oai_tool_parser tdm_oai_tool_parser_for_template(const char *t)
{
    if (!t)
        return TDM_OAI_TOOL_PARSER_NONE;
    if (strstr(t, "<tool_call>"))
        return TDM_OAI_TOOL_PARSER_HERMES;
    if (strstr(t, "ipython") && strstr(t, "\"parameters\": "))
        return TDM_OAI_TOOL_PARSER_LLAMA3_JSON;
    return TDM_OAI_TOOL_PARSER_NONE;
}

int tdm_oai_tool_parser_for_model(const char *dir, enum tdm_oai_tool_parser *out, char *err,
                                  size_t errlen)
{
    *out = TDM_OAI_TOOL_PARSER_NONE;
    char path[4096];
    char *text = NULL;
    size_t len = 0;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (tdm_read_file(path, &text, &len, NULL, 0) == TDM_OK) {
        cJSON *cfg = tdm_json_check_depth(text, len, TDM_JSON_MAX_DEPTH, NULL, 0) == TDM_OK
                         ? cJSON_ParseWithLength(text, len)
                         : NULL;
        free(text);
        if (!cfg)
            return tdm_seterr(err, errlen, TDM_EPROTO, "%s: not valid JSON", path);
        // The template the tokenizer loader (and so the workers) would use.
        const char *t = tdm_tok_config_chat_template(cfg);
        *out = tdm_oai_tool_parser_for_template(t);
        cJSON_Delete(cfg);
        if (t)
            return TDM_OK;
    }
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    if (tdm_read_file(path, &text, &len, NULL, 0) == TDM_OK) {
        *out = tdm_oai_tool_parser_for_template(text);
        free(text);
    }
    return TDM_OK;
}

void tdm_oai_tool_request_fini(struct tdm_oai_tool_request *t)
{
    if (t == NULL)
        return;
    for (size_t i = 0; i < t->n_tools; i++) {
        free(t->tools[i].name);
        free(t->tools[i].parameters_json);
    }
    free(t->tools);
    free(t->tools_json);
    free(t->choice_name);
    memset(t, 0, sizeof *t);
}

enum tdm_oai_tool_format tdm_oai_tool_format_of(const struct tdm_oai_tool_request *t)
{
    switch (t->choice) {
    case TDM_OAI_TOOL_CHOICE_AUTO:
        return t->parser == TDM_OAI_TOOL_PARSER_HERMES        ? TDM_OAI_TOOL_FORMAT_HERMES
               : t->parser == TDM_OAI_TOOL_PARSER_LLAMA3_JSON ? TDM_OAI_TOOL_FORMAT_LLAMA3_JSON
                                                              : TDM_OAI_TOOL_FORMAT_NONE;
    case TDM_OAI_TOOL_CHOICE_REQUIRED:
        return TDM_OAI_TOOL_FORMAT_REQUIRED;
    case TDM_OAI_TOOL_CHOICE_NAMED:
        return TDM_OAI_TOOL_FORMAT_NAMED;
    default:
        return TDM_OAI_TOOL_FORMAT_NONE;
    }
}

// ---- tools ----------------------------------------------------------------------------------

static const cJSON *present(const cJSON *obj, const char *name)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
    return it && !cJSON_IsNull(it) ? it : NULL;
}

static int oom(struct tdm_oai_error *e)
{
    return tdm_oai_seterr(e, 500, NULL, "out of memory");
}

// One tool into t->tools[i] and its model_dump form into dump (appended).
static int parse_tool(const cJSON *tool, size_t i, struct tdm_oai_tool_request *t, cJSON *dump,
                      struct tdm_oai_error *e)
{
    if (!cJSON_IsObject(tool))
        return tdm_oai_seterr(e, 400, "tools", "tools[%zu]: Input should be a valid dictionary", i);
    const cJSON *type = present(tool, "type");
    if (type && !(cJSON_IsString(type) && strcmp(type->valuestring, "function") == 0))
        return tdm_oai_seterr(e, 400, "tools", "tools[%zu].type: Input should be 'function'", i);
    const cJSON *fn = present(tool, "function");
    if (!fn)
        return tdm_oai_seterr(e, 400, "tools", "tools[%zu].function: Field required", i);
    if (!cJSON_IsObject(fn))
        return tdm_oai_seterr(e, 400, "tools",
                              "tools[%zu].function: Input should be a valid dictionary", i);
    const cJSON *name = present(fn, "name");
    if (!name)
        return tdm_oai_seterr(e, 400, "tools", "tools[%zu].function.name: Field required", i);
    if (!cJSON_IsString(name))
        return tdm_oai_seterr(e, 400, "tools",
                              "tools[%zu].function.name: Input should be a valid string", i);
    if (!name->valuestring[0])
        return tdm_oai_seterr(e, 400, "tools", "tools[%zu].function.name must not be empty", i);
    for (size_t j = 0; j < i; j++)
        if (strcmp(t->tools[j].name, name->valuestring) == 0)
            return tdm_oai_seterr(e, 400, "tools",
                                  "tools[%zu].function.name: the name '%.64s' is given twice "
                                  "(tool names must be unique)",
                                  i, name->valuestring);
    const cJSON *desc = present(fn, "description");
    if (desc && !cJSON_IsString(desc))
        return tdm_oai_seterr(e, 400, "tools",
                              "tools[%zu].function.description: Input should be a valid string", i);
    const cJSON *params = present(fn, "parameters");
    if (params && !cJSON_IsObject(params))
        return tdm_oai_seterr(e, 400, "tools",
                              "tools[%zu].function.parameters: Input should be a valid dictionary",
                              i);
    struct tdm_oai_tool *out = &t->tools[i];
    if (!(out->name = strdup(name->valuestring)))
        return oom(e);
    if (params && !(out->parameters_json = cJSON_PrintUnformatted(params)))
        return oom(e);
    t->n_tools = i + 1;

    // vLLM renders tool.model_dump(): declared fields first (absent ones as
    // null), then the extra fields in the order given.
    cJSON *d = cJSON_CreateObject(), *df = NULL;
    if (!d || !cJSON_AddItemToArray(dump, d)) {
        cJSON_Delete(d);
        return oom(e);
    }
    if (!cJSON_AddStringToObject(d, "type", "function") ||
        !(df = cJSON_AddObjectToObject(d, "function")) ||
        !cJSON_AddStringToObject(df, "name", name->valuestring) ||
        !cJSON_AddItemToObject(df, "description",
                               desc ? cJSON_CreateString(desc->valuestring) : cJSON_CreateNull()) ||
        !cJSON_AddItemToObject(df, "parameters",
                               params ? cJSON_Duplicate(params, true) : cJSON_CreateNull()))
        return oom(e);
    const cJSON *it;
    cJSON_ArrayForEach(it, fn)
    {
        if (strcmp(it->string, "name") == 0 || strcmp(it->string, "description") == 0 ||
            strcmp(it->string, "parameters") == 0)
            continue;
        if (!cJSON_AddItemToObject(df, it->string, cJSON_Duplicate(it, true)))
            return oom(e);
    }
    cJSON_ArrayForEach(it, tool)
    {
        if (strcmp(it->string, "type") == 0 || strcmp(it->string, "function") == 0)
            continue;
        if (!cJSON_AddItemToObject(d, it->string, cJSON_Duplicate(it, true)))
            return oom(e);
    }
    return TDM_OK;
}

static int parse_tools(const cJSON *tools, struct tdm_oai_tool_request *t, struct tdm_oai_error *e)
{
    if (!cJSON_IsArray(tools))
        return tdm_oai_seterr(e, 400, "tools", "tools: Input should be a valid list");
    size_t n = (size_t)cJSON_GetArraySize(tools);
    if (n > TDM_OAI_MAX_TOOLS)
        return tdm_oai_seterr(e, 400, "tools", "tools may hold at most %d tools, got %zu",
                              TDM_OAI_MAX_TOOLS, n);
    t->tools = calloc(n ? n : 1, sizeof *t->tools);
    cJSON *dump = cJSON_CreateArray();
    int rc = TDM_OK;
    if (!t->tools || !dump) {
        rc = oom(e);
        goto out;
    }
    size_t i = 0;
    const cJSON *tool;
    cJSON_ArrayForEach(tool, tools)
    {
        if ((rc = parse_tool(tool, i++, t, dump, e)) != TDM_OK)
            goto out;
    }
    if (!(t->tools_json = cJSON_PrintUnformatted(dump)))
        rc = oom(e);
out:
    cJSON_Delete(dump);
    return rc;
}

static const char usage_named[] =
    "Correct usage: `{\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}`";

int tdm_oai_tools_parse(const cJSON *root, const struct tdm_oai_model_info *m, bool tools_only,
                        struct tdm_oai_tool_request *t, struct tdm_oai_error *e)
{
    memset(t, 0, sizeof *t);
    t->parallel_tool_calls = true;
    const cJSON *tools = present(root, "tools");
    const cJSON *tc = present(root, "tool_choice");
    const cJSON *ptc = present(root, "parallel_tool_calls");
    if (ptc && !cJSON_IsBool(ptc))
        return tdm_oai_seterr(e, 400, "parallel_tool_calls",
                              "parallel_tool_calls: Input should be a valid boolean");
    if (ptc)
        t->parallel_tool_calls = cJSON_IsTrue(ptc);
    int rc;
    if (tools && (rc = parse_tools(tools, t, e)) != TDM_OK)
        return rc;
    if (tools_only)
        return TDM_OK;

    // vLLM's check_tool_usage: tool_choice defaults to "auto" with a non-empty
    // tools list, else to "none".
    if (!tc) {
        t->choice = t->n_tools > 0 ? TDM_OAI_TOOL_CHOICE_AUTO : TDM_OAI_TOOL_CHOICE_NONE;
    } else if (cJSON_IsString(tc) && strcmp(tc->valuestring, "none") == 0) {
        t->choice = TDM_OAI_TOOL_CHOICE_NONE;
    } else {
        if (!tools)
            return tdm_oai_seterr(e, 400, "tool_choice",
                                  "When using `tool_choice`, `tools` must be set.");
        if (cJSON_IsString(tc) && strcmp(tc->valuestring, "auto") == 0) {
            t->choice = TDM_OAI_TOOL_CHOICE_AUTO;
        } else if (cJSON_IsString(tc) && strcmp(tc->valuestring, "required") == 0) {
            // OpenAI: "required" with no tools behaves as "none".
            t->choice = t->n_tools > 0 ? TDM_OAI_TOOL_CHOICE_REQUIRED : TDM_OAI_TOOL_CHOICE_NONE;
        } else if (cJSON_IsObject(tc)) {
            const cJSON *type = present(tc, "type");
            if (type && !(cJSON_IsString(type) && strcmp(type->valuestring, "function") == 0))
                return tdm_oai_seterr(e, 400, "tool_choice",
                                      "tool_choice.type: Input should be 'function'. %s",
                                      usage_named);
            const cJSON *fn = present(tc, "function");
            if (!cJSON_IsObject(fn))
                return tdm_oai_seterr(e, 400, "tool_choice",
                                      "Invalid value for `function` in `tool_choice`! %s",
                                      usage_named);
            const cJSON *name = present(fn, "name");
            if (!name)
                return tdm_oai_seterr(e, 400, "tool_choice",
                                      "Expected field `name` in `function` in `tool_choice`! %s",
                                      usage_named);
            if (!cJSON_IsString(name) || !name->valuestring[0])
                return tdm_oai_seterr(e, 400, "tool_choice",
                                      "Invalid `name` in `function` in `tool_choice`! %s",
                                      usage_named);
            bool found = false;
            for (size_t i = 0; i < t->n_tools && !found; i++)
                found = strcmp(t->tools[i].name, name->valuestring) == 0;
            if (!found)
                return tdm_oai_seterr(e, 400, "tool_choice",
                                      "The tool specified in `tool_choice` ('%.64s') does not "
                                      "match any of the specified `tools`",
                                      name->valuestring);
            t->choice = TDM_OAI_TOOL_CHOICE_NAMED;
            if (!(t->choice_name = strdup(name->valuestring)))
                return oom(e);
        } else {
            char *v = cJSON_PrintUnformatted(tc);
            tdm_oai_seterr(e, 400, "tool_choice",
                           "Invalid value for `tool_choice`: %.64s! Only named tools, \"none\", "
                           "\"auto\" or \"required\" are supported.",
                           v ? v : "?");
            free(v);
            return TDM_EINVAL;
        }
    }
    if (t->choice == TDM_OAI_TOOL_CHOICE_AUTO) {
        t->parser = m ? m->tool_parser : TDM_OAI_TOOL_PARSER_NONE;
        if (t->parser == TDM_OAI_TOOL_PARSER_NONE)
            return tdm_oai_seterr(e, 400, "tool_choice",
                                  "\"auto\" tool choice requires --enable-auto-tool-choice and "
                                  "--tool-call-parser to be set");
    }
    return TDM_OK;
}

// ---- the conversation the template sees -------------------------------------------------------

// An assistant message's tool_calls, each with function.arguments parsed into
// a value (vLLM's _postprocess_messages; "" or absent becomes {}).
static int conv_tool_calls(const cJSON *calls, size_t mi, cJSON *out, struct tdm_oai_error *e)
{
    if (!cJSON_IsArray(calls))
        return tdm_oai_seterr(e, 400, "messages",
                              "messages[%zu].tool_calls: Input should be a valid list", mi);
    cJSON *arr = cJSON_Duplicate(calls, true);
    if (!arr || !cJSON_AddItemToObject(out, "tool_calls", arr)) {
        cJSON_Delete(arr);
        return oom(e);
    }
    size_t j = 0;
    cJSON *call;
    cJSON_ArrayForEach(call, arr)
    {
        if (!cJSON_IsObject(call))
            return tdm_oai_seterr(e, 400, "messages",
                                  "messages[%zu].tool_calls[%zu]: Input should be a valid "
                                  "dictionary",
                                  mi, j);
        cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
        if (!cJSON_IsObject(fn))
            return tdm_oai_seterr(e, 400, "messages",
                                  "messages[%zu].tool_calls[%zu].function: Field required", mi, j);
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        if (!cJSON_IsString(name))
            return tdm_oai_seterr(e, 400, "messages",
                                  "messages[%zu].tool_calls[%zu].function.name: Input should be "
                                  "a valid string",
                                  mi, j);
        cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        cJSON *parsed = NULL;
        if (!args || cJSON_IsNull(args) || (cJSON_IsString(args) && args->valuestring[0] == '\0')) {
            parsed = cJSON_CreateObject();
        } else if (cJSON_IsString(args)) {
            const char *end = NULL;
            parsed = cJSON_ParseWithOpts(args->valuestring, &end, true);
            if (!parsed)
                return tdm_oai_seterr(e, 400, "messages",
                                      "messages[%zu].tool_calls[%zu].function.arguments is not "
                                      "valid JSON",
                                      mi, j);
        } else if (cJSON_IsObject(args) || cJSON_IsArray(args)) {
            j++;
            continue; // already a value
        } else {
            return tdm_oai_seterr(e, 400, "messages",
                                  "messages[%zu].tool_calls[%zu].function.arguments: Input "
                                  "should be a valid string",
                                  mi, j);
        }
        if (!parsed)
            return oom(e);
        if (args)
            cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", parsed);
        else if (!cJSON_AddItemToObject(fn, "arguments", parsed)) {
            cJSON_Delete(parsed);
            return oom(e);
        }
        j++;
    }
    return TDM_OK;
}

int tdm_oai_conversation_json(const cJSON *messages, const struct tdm_chat_msg *msgs, size_t n,
                              char **out, struct tdm_oai_error *e)
{
    *out = NULL;
    cJSON *conv = cJSON_CreateArray();
    if (!conv)
        return oom(e);
    int rc = TDM_OK;
    size_t i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, messages)
    {
        if (i >= n)
            break;
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(conv, o)) {
            cJSON_Delete(o);
            rc = oom(e);
            goto out;
        }
        if (!cJSON_AddStringToObject(o, "role", msgs[i].role) ||
            !cJSON_AddStringToObject(o, "content", msgs[i].content)) {
            rc = oom(e);
            goto out;
        }
        if (strcmp(msgs[i].role, "assistant") == 0) {
            const cJSON *calls = present(m, "tool_calls");
            if (calls && (rc = conv_tool_calls(calls, i, o, e)) != TDM_OK)
                goto out;
        } else if (strcmp(msgs[i].role, "tool") == 0) {
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(m, "tool_call_id");
            if (id && !cJSON_AddItemToObject(o, "tool_call_id", cJSON_Duplicate(id, true))) {
                rc = oom(e);
                goto out;
            }
        }
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(m, "name");
        if (cJSON_IsString(name) && !cJSON_AddStringToObject(o, "name", name->valuestring)) {
            rc = oom(e);
            goto out;
        }
        i++;
    }
    if (!(*out = cJSON_PrintUnformatted(conv)))
        rc = oom(e);
out:
    cJSON_Delete(conv);
    return rc;
}

// ---- the constraint of a forced call ----------------------------------------------------
int tdm_oai_tools_force(struct tdm_oai_request *r, struct tdm_oai_error *e)
{
    char err[256] = "", *schema = NULL;
    int rc = tdm_oai_tool_constraint_schema(&r->tools, &schema, err, sizeof err);
    if (rc != TDM_OK)
        return rc == TDM_ENOMEM ? oom(e) : tdm_oai_seterr(e, 400, "tools", "%s", err);
    if (schema == NULL)
        return TDM_OK;
    rc = tdm_oai_request_set_constraint(r, TDM_CONSTRAINT_JSON_SCHEMA, schema, strlen(schema),
                                        "tool_choice", e);
    free(schema);
    return rc;
}

// tool's parameters, or {"type":"object","properties":{}} when it has none
// (vLLM: a call without parameters is generated as {}).
static cJSON *params_schema(const struct tdm_oai_tool *tool)
{
    if (tool->parameters_json) {
        cJSON *p = cJSON_Parse(tool->parameters_json);
        if (p && p->child)
            return p;
        cJSON_Delete(p);
    }
    cJSON *p = cJSON_CreateObject();
    if (p && (!cJSON_AddStringToObject(p, "type", "object") ||
              !cJSON_AddObjectToObject(p, "properties"))) {
        cJSON_Delete(p);
        return NULL;
    }
    return p;
}

int tdm_oai_tool_constraint_schema(const struct tdm_oai_tool_request *t, char **out, char *err,
                                   size_t errlen)
{
    *out = NULL;
    if (t->choice == TDM_OAI_TOOL_CHOICE_NAMED) {
        for (size_t i = 0; i < t->n_tools; i++) {
            if (strcmp(t->tools[i].name, t->choice_name) != 0)
                continue;
            cJSON *p = params_schema(&t->tools[i]);
            *out = p ? cJSON_PrintUnformatted(p) : NULL;
            cJSON_Delete(p);
            return *out ? TDM_OK : tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        }
        return tdm_seterr(err, errlen, TDM_EINVAL, "tool_choice names no tool of the request");
    }
    if (t->choice != TDM_OAI_TOOL_CHOICE_REQUIRED)
        return TDM_OK;
    int rc = TDM_ENOMEM;
    cJSON *root = cJSON_CreateObject(), *items = NULL, *any = NULL, *defs = cJSON_CreateObject();
    if (!root || !defs || !cJSON_AddStringToObject(root, "type", "array") ||
        !cJSON_AddNumberToObject(root, "minItems", 1) ||
        (!t->parallel_tool_calls && !cJSON_AddNumberToObject(root, "maxItems", 1)) ||
        !(items = cJSON_AddObjectToObject(root, "items")) ||
        !cJSON_AddStringToObject(items, "type", "object") ||
        !(any = cJSON_AddArrayToObject(items, "anyOf")))
        goto out;
    for (size_t i = 0; i < t->n_tools; i++) {
        cJSON *params = params_schema(&t->tools[i]);
        if (!params)
            goto out;
        // "$defs" of every tool move to the top, where "#/$defs/..." points.
        cJSON *d = cJSON_DetachItemFromObjectCaseSensitive(params, "$defs");
        for (cJSON *it = d ? d->child : NULL; it; it = it->next) {
            cJSON *have = cJSON_GetObjectItemCaseSensitive(defs, it->string);
            if (have && !cJSON_Compare(have, it, true)) {
                rc = tdm_seterr(err, errlen, TDM_EINVAL,
                                "tools: the definition '%.64s' in $defs has different schemas "
                                "in two tools",
                                it->string);
                cJSON_Delete(d);
                cJSON_Delete(params);
                goto out;
            }
            if (!have && !cJSON_AddItemToObject(defs, it->string, cJSON_Duplicate(it, true))) {
                cJSON_Delete(d);
                cJSON_Delete(params);
                goto out;
            }
        }
        cJSON_Delete(d);
        cJSON *alt = cJSON_CreateObject(), *props = NULL, *name = NULL, *en = NULL, *req = NULL;
        if (!alt || !cJSON_AddItemToArray(any, alt)) {
            cJSON_Delete(alt);
            cJSON_Delete(params);
            goto out;
        }
        if (!(props = cJSON_AddObjectToObject(alt, "properties")) ||
            !(name = cJSON_AddObjectToObject(props, "name")) ||
            !cJSON_AddStringToObject(name, "type", "string") ||
            !(en = cJSON_AddArrayToObject(name, "enum")) ||
            !cJSON_AddItemToArray(en, cJSON_CreateString(t->tools[i].name)) ||
            !cJSON_AddItemToObject(props, "parameters", params)) {
            cJSON_Delete(params);
            goto out;
        }
        if (!(req = cJSON_AddArrayToObject(alt, "required")) ||
            !cJSON_AddItemToArray(req, cJSON_CreateString("name")) ||
            !cJSON_AddItemToArray(req, cJSON_CreateString("parameters")))
            goto out;
    }
    if (defs->child) {
        cJSON_AddItemToObject(root, "$defs", defs);
        defs = NULL;
    }
    *out = cJSON_PrintUnformatted(root);
    rc = *out ? TDM_OK : TDM_ENOMEM;
out:
    if (rc == TDM_ENOMEM)
        tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    cJSON_Delete(defs);
    cJSON_Delete(root);
    return rc;
}
