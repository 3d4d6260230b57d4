// SPDX-License-Identifier: Apache-2.0
// Tests of the request side of tool calling (openai_tools.c): tools,
// tool_choice and parallel_tool_calls parsed and refused as vLLM does (400
// naming the field), the tools as the template sees them (model_dump form),
// the conversation (tool_calls arguments parsed, tool_call_id kept), the
// --tool-call-parser configuration, and the JSON Schema forcing `required`
// and named calls: compiled by the grammar engine, it accepts the calls the
// parser reads and refuses what the parser would not.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "core.h"
#include "grammar.h"
#include "openai.h"

static const struct tdm_oai_model_info hermes = {.served_name = "qwen",
                                                 .vocab_size = 1000,
                                                 .max_model_len = 100,
                                                 .tool_parser = TDM_OAI_TOOL_PARSER_HERMES};
static const struct tdm_oai_model_info plain = {
    .served_name = "qwen", .vocab_size = 1000, .max_model_len = 100};

#define USER "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"
#define WEATHER                                                                                    \
    "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather\","   \
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"         \
    "\"required\":[\"city\"]}}}"
#define TIME "{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}}"

static int parse(struct tdm_oai_request *r, const struct tdm_oai_model_info *m, const char *json,
                 struct tdm_oai_error *e)
{
    memset(e, 0, sizeof *e);
    return tdm_oai_request_parse(r, TDM_OAI_CHAT, json, strlen(json), m, e);
}

static void expect_error(const struct tdm_oai_model_info *m, const char *json, const char *param,
                         const char *message)
{
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    int rc = parse(&r, m, json, &e);
    if (rc == TDM_OK || e.status != 400 || strcmp(e.param, param) != 0 ||
        !strstr(e.message, message)) {
        print_error("body %s\n  got rc=%d status=%d param='%s' message='%s'\n  want param '%s' "
                    "message containing '%s'\n",
                    json, rc, e.status, e.param, e.message, param, message);
        if (rc == TDM_OK)
            tdm_oai_request_fini(&r);
        fail();
    }
}

static void test_tool_choice(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    // tools given, no tool_choice: "auto" with the server's parser.
    assert_int_equal(parse(&r, &hermes, "{" USER ",\"tools\":[" WEATHER "," TIME "]}", &e), TDM_OK);
    assert_int_equal(r.tools.choice, TDM_OAI_TOOL_CHOICE_AUTO);
    assert_int_equal(r.tools.parser, TDM_OAI_TOOL_PARSER_HERMES);
    assert_int_equal(tdm_oai_tool_format_of(&r.tools), TDM_OAI_TOOL_FORMAT_HERMES);
    assert_false(r.skip_special_tokens); // vLLM's hermes adjust_request
    assert_int_equal(r.tools.n_tools, 2);
    assert_string_equal(r.tools.tools[0].name, "get_weather");
    assert_non_null(strstr(r.tools.tools[0].parameters_json, "\"city\""));
    assert_null(r.tools.tools[1].parameters_json);
    assert_true(r.tools.parallel_tool_calls);
    // vLLM's tool.model_dump(): absent description/parameters are null.
    assert_string_equal(r.tools.tools_json,
                        "[" WEATHER ",{\"type\":\"function\",\"function\":{\"name\":\"get_time\","
                        "\"description\":null,\"parameters\":null}}]");
    tdm_oai_request_fini(&r);

    // Named, required, none, parallel_tool_calls.
    assert_int_equal(parse(&r, &plain,
                           "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":{\"type\":"
                           "\"function\",\"function\":{\"name\":\"get_weather\"}},"
                           "\"parallel_tool_calls\":false}",
                           &e),
                     TDM_OK);
    assert_int_equal(r.tools.choice, TDM_OAI_TOOL_CHOICE_NAMED);
    assert_string_equal(r.tools.choice_name, "get_weather");
    assert_false(r.tools.parallel_tool_calls);
    assert_int_equal(tdm_oai_tool_format_of(&r.tools), TDM_OAI_TOOL_FORMAT_NAMED);
    tdm_oai_request_fini(&r);
    assert_int_equal(
        parse(&r, &plain, "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":\"required\"}", &e),
        TDM_OK);
    assert_int_equal(r.tools.choice, TDM_OAI_TOOL_CHOICE_REQUIRED);
    tdm_oai_request_fini(&r);
    // "none": the tools are still rendered (vLLM's default), nothing is parsed.
    assert_int_equal(
        parse(&r, &plain, "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":\"none\"}", &e),
        TDM_OK);
    assert_int_equal(r.tools.choice, TDM_OAI_TOOL_CHOICE_NONE);
    assert_non_null(r.tools.tools_json);
    assert_int_equal(tdm_oai_tool_format_of(&r.tools), TDM_OAI_TOOL_FORMAT_NONE);
    tdm_oai_request_fini(&r);
    // "required" with an empty list behaves as "none" (OpenAI, vLLM).
    assert_int_equal(parse(&r, &plain, "{" USER ",\"tools\":[],\"tool_choice\":\"required\"}", &e),
                     TDM_OK);
    assert_int_equal(r.tools.choice, TDM_OAI_TOOL_CHOICE_NONE);
    tdm_oai_request_fini(&r);
    // No tools: none, and the template gets no tools.
    assert_int_equal(parse(&r, &plain, "{" USER "}", &e), TDM_OK);
    assert_int_equal(r.tools.choice, TDM_OAI_TOOL_CHOICE_NONE);
    assert_null(r.tools.tools_json);
    tdm_oai_request_fini(&r);
}

static void test_tool_errors(void **state)
{
    (void)state;
    expect_error(&plain, "{" USER ",\"tools\":[" WEATHER "]}", "tool_choice",
                 "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser");
    expect_error(&hermes, "{" USER ",\"tools\":{}}", "tools",
                 "tools: Input should be a valid list");
    expect_error(&hermes, "{" USER ",\"tools\":[7]}", "tools",
                 "tools[0]: Input should be a valid dictionary");
    expect_error(&hermes,
                 "{" USER ",\"tools\":[{\"type\":\"code\",\"function\":{\"name\":\"a\"}}]}",
                 "tools", "tools[0].type: Input should be 'function'");
    expect_error(&hermes, "{" USER ",\"tools\":[{\"type\":\"function\"}]}", "tools",
                 "tools[0].function: Field required");
    expect_error(&hermes, "{" USER ",\"tools\":[{\"function\":{\"description\":\"x\"}}]}", "tools",
                 "tools[0].function.name: Field required");
    expect_error(&hermes, "{" USER ",\"tools\":[{\"function\":{\"name\":3}}]}", "tools",
                 "tools[0].function.name: Input should be a valid string");
    expect_error(&hermes, "{" USER ",\"tools\":[{\"function\":{\"name\":\"\"}}]}", "tools",
                 "tools[0].function.name must not be empty");
    expect_error(&hermes, "{" USER ",\"tools\":[" WEATHER "," TIME "," WEATHER "]}", "tools",
                 "tools[2].function.name: the name 'get_weather' is given twice");
    expect_error(&hermes,
                 "{" USER ",\"tools\":[{\"function\":{\"name\":\"a\",\"parameters\":[1]}}]}",
                 "tools", "tools[0].function.parameters: Input should be a valid dictionary");
    expect_error(&hermes,
                 "{" USER ",\"tools\":[{\"function\":{\"name\":\"a\",\"description\":1}}]}",
                 "tools", "tools[0].function.description: Input should be a valid string");
    expect_error(&hermes, "{" USER ",\"tool_choice\":\"auto\"}", "tool_choice",
                 "When using `tool_choice`, `tools` must be set.");
    expect_error(&hermes, "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":\"always\"}",
                 "tool_choice", "Invalid value for `tool_choice`: \"always\"!");
    expect_error(&hermes, "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":3}", "tool_choice",
                 "Invalid value for `tool_choice`: 3!");
    expect_error(&hermes,
                 "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":{\"type\":\"function\","
                 "\"function\":{\"name\":\"nope\"}}}",
                 "tool_choice",
                 "The tool specified in `tool_choice` ('nope') does not match any of the specified "
                 "`tools`");
    expect_error(&hermes,
                 "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":{\"type\":\"function\"}}",
                 "tool_choice", "Invalid value for `function` in `tool_choice`!");
    expect_error(&hermes, "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":{\"function\":{}}}",
                 "tool_choice", "Expected field `name` in `function` in `tool_choice`!");
    expect_error(&hermes,
                 "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":{\"type\":\"tool\","
                 "\"function\":{\"name\":\"get_weather\"}}}",
                 "tool_choice", "tool_choice.type: Input should be 'function'");
    expect_error(&hermes, "{" USER ",\"tools\":[" WEATHER "],\"parallel_tool_calls\":1}",
                 "parallel_tool_calls", "Input should be a valid boolean");
    expect_error(&hermes, "{" USER ",\"functions\":[{\"name\":\"a\"}]}", "functions",
                 "not supported");
    // Assistant tool calls in the history.
    expect_error(&hermes,
                 "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"1\",\"type\":"
                 "\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{oops\"}}]}]}",
                 "messages", "messages[0].tool_calls[0].function.arguments is not valid JSON");
    expect_error(&hermes,
                 "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"1\"}]}]}",
                 "messages", "messages[0].tool_calls[0].function: Field required");
    expect_error(&hermes, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":{}}]}", "messages",
                 "messages[0].tool_calls: Input should be a valid list");
    expect_error(&hermes,
                 "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":"
                 "\"f\",\"arguments\":5}}]}]}",
                 "messages",
                 "messages[0].tool_calls[0].function.arguments: Input should be a "
                 "valid string");
}

static void test_conversation(void **state)
{
    (void)state;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    const char *body =
        "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
        "{\"type\":\"text\",\"text\":\"b\"}],\"name\":\"ann\"},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":["
        "{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
        "\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}},"
        "{\"id\":\"call_2\",\"type\":\"function\",\"function\":{\"name\":\"get_time\","
        "\"arguments\":\"\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"sunny\"}],"
        "\"tools\":[" WEATHER "," TIME "]}";
    assert_int_equal(parse(&r, &hermes, body, &e), TDM_OK);
    assert_string_equal(
        r.conversation_json,
        "[{\"role\":\"user\",\"content\":\"a\\nb\",\"name\":\"ann\"},"
        "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":["
        "{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
        "\"arguments\":{\"city\":\"Paris\"}}},"
        "{\"id\":\"call_2\",\"type\":\"function\",\"function\":{\"name\":\"get_time\","
        "\"arguments\":{}}}]},"
        "{\"role\":\"tool\",\"content\":\"sunny\",\"tool_call_id\":\"call_1\"}]");
    tdm_oai_request_fini(&r);
}

// /tokenize's chat form renders the same conversation and takes tools.
static void test_tokenize_form(void **state)
{
    (void)state;
    struct tdm_oai_tokenize_request t;
    struct tdm_oai_error e;
    const char *body = "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"c\","
                       "\"type\":\"function\",\"function\":{\"name\":\"get_time\",\"arguments\":"
                       "\"{\\\"tz\\\": \\\"UTC\\\"}\"}}]}],\"tools\":[" TIME "]}";
    assert_int_equal(tdm_oai_tokenize_parse(&t, body, strlen(body), &plain, &e), TDM_OK);
    assert_non_null(strstr(t.conversation_json, "\"arguments\":{\"tz\":\"UTC\"}"));
    assert_non_null(strstr(t.tools.tools_json, "\"get_time\""));
    tdm_oai_tokenize_fini(&t);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

// The parser `tandem up` turns on for a model (issue 28, item 3), from its
// chat template's text, in each place a model folder keeps it.
static void test_parser_for_template(void **state)
{
    (void)state;
    assert_int_equal(tdm_oai_tool_parser_for_template(NULL), TDM_OAI_TOOL_PARSER_NONE);
    assert_int_equal(tdm_oai_tool_parser_for_template("{{ messages }}"), TDM_OAI_TOOL_PARSER_NONE);
    assert_int_equal(tdm_oai_tool_parser_for_template(
                         "{%- for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n"),
                     TDM_OAI_TOOL_PARSER_HERMES);
    assert_int_equal(tdm_oai_tool_parser_for_template(
                         "<|start_header_id|>ipython<|end_header_id|> {\"name\": function name, "
                         "\"parameters\": dictionary of argument name and its value}"),
                     TDM_OAI_TOOL_PARSER_LLAMA3_JSON);
    // ipython without Llama's call shape (functionary's <function=...>): none.
    assert_int_equal(tdm_oai_tool_parser_for_template("ipython <function=get_weather>{...}"),
                     TDM_OAI_TOOL_PARSER_NONE);

    char dir[] = "/tmp/tdm-tools-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char cfg[256], jinja[256], err[256];
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    snprintf(jinja, sizeof jinja, "%s/chat_template.jinja", dir);
    enum tdm_oai_tool_parser p = TDM_OAI_TOOL_PARSER_HERMES;
    assert_int_equal(tdm_oai_tool_parser_for_model(dir, &p, err, sizeof err), TDM_OK);
    assert_int_equal(p, TDM_OAI_TOOL_PARSER_NONE); // no template at all
    write_text(cfg, "{\"chat_template\": \"x<tool_call>y\"}");
    assert_int_equal(tdm_oai_tool_parser_for_model(dir, &p, err, sizeof err), TDM_OK);
    assert_int_equal(p, TDM_OAI_TOOL_PARSER_HERMES);
    write_text(cfg, "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"<tool_call>\"},"
                    " {\"name\": \"default\", \"template\": \"plain\"}]}");
    assert_int_equal(tdm_oai_tool_parser_for_model(dir, &p, err, sizeof err), TDM_OK);
    assert_int_equal(p, TDM_OAI_TOOL_PARSER_NONE); // the default one counts
    write_text(cfg, "{\"bos_token\": null}");
    write_text(jinja, "ipython \"parameters\": ");
    assert_int_equal(tdm_oai_tool_parser_for_model(dir, &p, err, sizeof err), TDM_OK);
    assert_int_equal(p, TDM_OAI_TOOL_PARSER_LLAMA3_JSON);
    write_text(cfg, "{\"chat_template\": ");
    assert_int_equal(tdm_oai_tool_parser_for_model(dir, &p, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "tokenizer_config.json: not valid JSON"));
    unlink(cfg);
    unlink(jinja);
    rmdir(dir);
}

// Every real template in shared/chat-templates gets the parser vLLM's docs
// pair it with (hermes: Qwen2.5, Hermes 2 Pro / 3; llama3_json: Llama
// 3.1-3.3), and none where Tandem has no parser for its format.
static void test_parser_for_shared_templates(void **state)
{
    (void)state;
    static const struct {
        const char *file;
        enum tdm_oai_tool_parser want;
    } table[] = {
        {"Qwen-Qwen2.5-7B-Instruct.jinja", TDM_OAI_TOOL_PARSER_HERMES},
        {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", TDM_OAI_TOOL_PARSER_HERMES},
        {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", TDM_OAI_TOOL_PARSER_HERMES},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", TDM_OAI_TOOL_PARSER_LLAMA3_JSON},
        {"meta-llama-Llama-3.2-3B-Instruct.jinja", TDM_OAI_TOOL_PARSER_LLAMA3_JSON},
        {"meta-llama-Llama-3.3-70B-Instruct.jinja", TDM_OAI_TOOL_PARSER_LLAMA3_JSON},
        {"meetkai-functionary-medium-v3.1.jinja", TDM_OAI_TOOL_PARSER_NONE},
        {"CohereForAI-c4ai-command-r-plus-tool_use.jinja", TDM_OAI_TOOL_PARSER_NONE},
        {"fireworks-ai-llama-3-firefunction-v2.jinja", TDM_OAI_TOOL_PARSER_NONE},
        {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", TDM_OAI_TOOL_PARSER_NONE},
    };
    char path[1024];
    snprintf(path, sizeof path, "%s/chat-templates", TANDEM_SHARED_DIR);
    struct stat st;
    if (stat(path, &st) != 0) {
        print_message("%s is absent: the real templates are not checked\n", path);
        skip();
    }
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        snprintf(path, sizeof path, "%s/chat-templates/%s", TANDEM_SHARED_DIR, table[i].file);
        char *text = NULL;
        size_t len = 0;
        char err[256];
        assert_int_equal(tdm_read_file(path, &text, &len, err, sizeof err), TDM_OK);
        if (tdm_oai_tool_parser_for_template(text) != table[i].want)
            fail_msg("%s: %s", table[i].file,
                     tdm_oai_tool_parser_name(tdm_oai_tool_parser_for_template(text)));
        free(text);
    }
}

static void test_parser_config(void **state)
{
    (void)state;
    enum tdm_oai_tool_parser p = TDM_OAI_TOOL_PARSER_HERMES;
    char err[256];
    assert_int_equal(tdm_oai_tool_parser_config(false, "", &p, err, sizeof err), TDM_OK);
    assert_int_equal(p, TDM_OAI_TOOL_PARSER_NONE);
    assert_int_equal(tdm_oai_tool_parser_config(true, "hermes", &p, err, sizeof err), TDM_OK);
    assert_int_equal(p, TDM_OAI_TOOL_PARSER_HERMES);
    assert_int_equal(tdm_oai_tool_parser_config(true, "llama3_json", &p, err, sizeof err), TDM_OK);
    assert_int_equal(p, TDM_OAI_TOOL_PARSER_LLAMA3_JSON);
    assert_string_equal(tdm_oai_tool_parser_name(p), "llama3_json");
    // A parser without --enable-auto-tool-choice: "auto" stays refused (vLLM).
    assert_int_equal(tdm_oai_tool_parser_config(false, "hermes", &p, err, sizeof err), TDM_OK);
    assert_int_equal(p, TDM_OAI_TOOL_PARSER_NONE);
    assert_int_equal(tdm_oai_tool_parser_config(true, NULL, &p, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "--enable-auto-tool-choice requires --tool-call-parser"));
    assert_int_equal(tdm_oai_tool_parser_config(true, "mistral", &p, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "unknown parser \"mistral\" (known: hermes, llama3_json)"));
}

// The constraint compiled by the grammar engine accepts accept[] and refuses
// refuse[]; what it accepts, the parser of that format reads as calls.
static void check_constraint(const char *body, const char *const *accept, size_t n_acc,
                             const char *const *refuse, size_t n_ref)
{
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    assert_int_equal(parse(&r, &plain, body, &e), TDM_OK);
    char err[256] = "", *schema = NULL;
    assert_int_equal(tdm_oai_tool_constraint_schema(&r.tools, &schema, err, sizeof err), TDM_OK);
    assert_non_null(schema);
    struct tdm_grammar *g = NULL;
    if (tdm_grammar_compile_json_schema(&g, schema, strlen(schema), err, sizeof err) != TDM_OK) {
        print_error("schema %s: %s\n", schema, err);
        fail();
    }
    enum tdm_oai_tool_format f = tdm_oai_tool_format_of(&r.tools);
    for (size_t i = 0; i < n_acc + n_ref; i++) {
        const char *text = i < n_acc ? accept[i] : refuse[i - n_acc];
        struct tdm_grammar_matcher *m = NULL;
        assert_int_equal(tdm_grammar_matcher_new(&m, g, NULL), TDM_OK);
        bool ok = tdm_grammar_matcher_accept_bytes(m, text, strlen(text)) == TDM_OK &&
                  tdm_grammar_matcher_accepts_eos(m);
        tdm_grammar_matcher_free(m);
        if (ok != (i < n_acc)) {
            print_error("schema %s: '%s' %s\n", schema, text, ok ? "accepted" : "refused");
            fail();
        }
        if (!ok)
            continue;
        struct tdm_oai_tool_call *calls = NULL;
        size_t n = 0;
        char *content = NULL;
        assert_int_equal(tdm_oai_tools_extract(f, r.tools.choice_name, r.tools.parallel_tool_calls,
                                               text, strlen(text), &calls, &n, &content),
                         TDM_OK);
        assert_true(n >= 1);
        assert_null(content);
        for (size_t k = 0; k < n; k++) {
            cJSON *args = cJSON_Parse(calls[k].arguments);
            assert_true(cJSON_IsObject(args));
            cJSON_Delete(args);
        }
        tdm_oai_tool_calls_free(calls, n);
    }
    tdm_grammar_unref(g);
    free(schema);
    tdm_oai_request_fini(&r);
}

static void test_constraint(void **state)
{
    (void)state;
    const char *named_ok[] = {"{\"city\": \"Paris\"}", "{\"city\":\"\"}"};
    const char *named_bad[] = {"{}", "{\"city\": 3}", "[\"Paris\"]", "Paris"};
    check_constraint("{" USER ",\"tools\":[" WEATHER "," TIME "],\"tool_choice\":{\"type\":"
                     "\"function\",\"function\":{\"name\":\"get_weather\"}}}",
                     named_ok, 2, named_bad, 4);
    const char *req_ok[] = {
        "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}]",
        "[{\"name\": \"get_time\", \"parameters\": {}}, {\"name\": \"get_weather\", "
        "\"parameters\": {\"city\": \"Rome\"}}]"};
    const char *req_bad[] = {"[]", "[{\"name\": \"get_weather\", \"parameters\": {}}]",
                             "[{\"name\": \"nope\", \"parameters\": {}}]",
                             "{\"name\": \"get_time\", \"parameters\": {}}"};
    check_constraint("{" USER ",\"tools\":[" WEATHER "," TIME "],\"tool_choice\":\"required\"}",
                     req_ok, 2, req_bad, 4);
    // Without parallel_tool_calls: one call at most.
    const char *one_bad[] = {req_ok[1]};
    check_constraint("{" USER ",\"tools\":[" WEATHER "," TIME "],\"tool_choice\":\"required\","
                     "\"parallel_tool_calls\":false}",
                     req_ok, 1, one_bad, 1);

    // $defs of the tools move to the top; two different ones of one name are refused.
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    const char *defs = "{" USER ",\"tool_choice\":\"required\",\"tools\":["
                       "{\"function\":{\"name\":\"a\",\"parameters\":{\"type\":\"object\","
                       "\"properties\":{\"p\":{\"$ref\":\"#/$defs/P\"}},\"$defs\":{\"P\":{\"type\":"
                       "\"integer\"}}}}},"
                       "{\"function\":{\"name\":\"b\",\"parameters\":{\"type\":\"object\","
                       "\"properties\":{\"q\":{\"$ref\":\"#/$defs/P\"}},\"$defs\":{\"P\":{\"type\":"
                       "\"%s\"}}}}}]}";
    char body[1024], err[256], *schema = NULL;
    snprintf(body, sizeof body, defs, "integer");
    assert_int_equal(parse(&r, &plain, body, &e), TDM_OK);
    assert_int_equal(tdm_oai_tool_constraint_schema(&r.tools, &schema, err, sizeof err), TDM_OK);
    assert_non_null(strstr(schema, "\"$defs\":{\"P\":{\"type\":\"integer\"}}"));
    struct tdm_grammar *g = NULL;
    assert_int_equal(tdm_grammar_compile_json_schema(&g, schema, strlen(schema), err, sizeof err),
                     TDM_OK);
    tdm_grammar_unref(g);
    free(schema);
    tdm_oai_request_fini(&r);
    snprintf(body, sizeof body, defs, "string");
    expect_error(&plain, body, "tools", "the definition 'P' in $defs has different schemas");
    // A forced call rides as the request's constraint; it cannot be combined
    // with another one.
    assert_int_equal(parse(&r, &plain,
                           "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":{\"type\":"
                           "\"function\",\"function\":{\"name\":\"get_weather\"}}}",
                           &e),
                     TDM_OK);
    assert_int_equal(r.sampling.constraint, TDM_CONSTRAINT_JSON_SCHEMA);
    assert_non_null(strstr(r.sampling.constraint_text, "\"city\""));
    tdm_oai_request_fini(&r);
    expect_error(&plain,
                 "{" USER ",\"tools\":[" WEATHER "],\"tool_choice\":\"required\","
                 "\"response_format\":{\"type\":\"json_object\"}}",
                 "tool_choice", "You can only use one kind of structured outputs constraint");
    // A keyword the grammar engine lacks: 400 naming it when the call is
    // forced; auto forces nothing, so the same tools serve.
    const char *minimum =
        "{" USER ",\"tools\":[{\"function\":{\"name\":\"n\",\"parameters\":{\"type\":"
        "\"object\",\"properties\":{\"k\":{\"type\":\"integer\",\"allOf\":[]}}}}}]%s}";
    snprintf(body, sizeof body, minimum, ",\"tool_choice\":\"required\"");
    expect_error(&plain, body, "tool_choice", "\"allOf\" is not supported");
    snprintf(body, sizeof body, minimum, "");
    assert_int_equal(parse(&r, &hermes, body, &e), TDM_OK);
    tdm_oai_request_fini(&r);
    // auto and none force nothing.
    assert_int_equal(parse(&r, &hermes, "{" USER ",\"tools\":[" WEATHER "]}", &e), TDM_OK);
    assert_int_equal(tdm_oai_tool_constraint_schema(&r.tools, &schema, err, sizeof err), TDM_OK);
    assert_null(schema);
    tdm_oai_request_fini(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tool_choice),
        cmocka_unit_test(test_tool_errors),
        cmocka_unit_test(test_conversation),
        cmocka_unit_test(test_parser_config),
        cmocka_unit_test(test_constraint),
        cmocka_unit_test(test_tokenize_form),
        cmocka_unit_test(test_parser_for_template),
        cmocka_unit_test(test_parser_for_shared_templates),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
