// SPDX-License-Identifier: Apache-2.0
// openai tools: tool calling as vLLM serves it, without I/O. The request side
// (`tools`, `tool_choice`, `parallel_tool_calls`, validated with a 400 naming the
// field), the conversation the chat template sees (assistant `tool_calls` with
// their arguments parsed into objects and `tool` messages with `tool_call_id`,
// as vLLM's chat_utils hands them to transformers), the tool-call parsers that
// turn generated text into `tool_calls` (vLLM's `--tool-call-parser` hermes and
// llama3_json, plus the JSON shapes of a forced `required` or named call), and
// the JSON Schema that forces a `required` or named call through the grammar
// engine. Included by openai.h; docs/tool-calling.md describes the behaviour.
//
// Parsers are incremental: text goes in as it is generated, content and tool
// call deltas come out, and a marker (`<tool_call>`) is never half emitted as
// content. The non-stream extraction runs the same parser over the whole text.
#ifndef TDM_OPENAI_TOOLS_H
#define TDM_OPENAI_TOOLS_H

#include <stdbool.h>
#include <stddef.h>

// ---- server configuration -----------------------------------------------------------------
// vLLM's --tool-call-parser values (the ones Tandem has).
enum tdm_oai_tool_parser {
    TDM_OAI_TOOL_PARSER_NONE = 0,    // tool_choice "auto" is refused (vLLM's 400)
    TDM_OAI_TOOL_PARSER_HERMES,      // <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    TDM_OAI_TOOL_PARSER_LLAMA3_JSON, // [<|python_tag|>]{"name": ..., "parameters": {...}}; ...
};
// The parser for --enable-auto-tool-choice and --tool-call-parser NAME, as vLLM
// checks them at startup: enable without a parser is an error, an unknown name
// is an error listing the known ones; a parser without enable is accepted and
// gives NONE (vLLM then refuses "auto" too). TDM_EINVAL with err.
int tdm_oai_tool_parser_config(bool enable_auto_tool_choice, const char *parser_name,
                               enum tdm_oai_tool_parser *out, char *err, size_t errlen);
const char *tdm_oai_tool_parser_name(enum tdm_oai_tool_parser p); // "hermes", ... or "none"
// The parser whose format a chat template writes tool calls in, read from the
// template's text: "<tool_call>" tags (Qwen2.5, Hermes 2/3) -> HERMES; the
// "ipython" role with {"name": ..., "parameters": ...} calls (Llama 3.1-3.3) ->
// LLAMA3_JSON; anything else (no tools, or a format without a parser here:
// functionary, Command R, firefunction) -> NONE. `tandem up` turns on tool
// choice "auto" with it (issue 28, item 3).
enum tdm_oai_tool_parser tdm_oai_tool_parser_for_template(const char *template_text);
// The same for a model folder: tokenizer_config.json's chat_template (a string,
// or the entry named "default"), else chat_template.jinja. NONE when the folder
// has no template; TDM_EPROTO (with err) for an unreadable tokenizer_config.json.
int tdm_oai_tool_parser_for_model(const char *model_dir, enum tdm_oai_tool_parser *out, char *err,
                                  size_t errlen);

// ---- request ----------------------------------------------------------------------------
#define TDM_OAI_MAX_TOOLS 1024 // tools per request
enum tdm_oai_tool_choice {
    TDM_OAI_TOOL_CHOICE_NONE = 0, // default without tools: nothing is parsed
    TDM_OAI_TOOL_CHOICE_AUTO,     // default with tools: the server's parser reads the output
    TDM_OAI_TOOL_CHOICE_REQUIRED, // the output is a JSON array of {"name","parameters"}
    TDM_OAI_TOOL_CHOICE_NAMED,    // the output is the named function's arguments
};

struct tdm_oai_tool {
    char *name;            // heap, non-empty, unique in the request
    char *parameters_json; // heap: the "parameters" JSON Schema, compact; NULL when absent
};

// A chat request's tool fields, resolved as vLLM resolves them.
struct tdm_oai_tool_request {
    struct tdm_oai_tool *tools; // [n_tools] heap; NULL when the request has none
    size_t n_tools;
    char *tools_json; // heap: the tools as the template sees them (vLLM's model_dump:
                      // {"type","function":{"name","description","parameters",...}});
                      // NULL when the request has no `tools` (the template gets none)
    enum tdm_oai_tool_choice choice;
    char *choice_name;               // NAMED: the function's name (heap), else NULL
    bool parallel_tool_calls;        // default true; false keeps at most one call
    enum tdm_oai_tool_parser parser; // AUTO: the server's parser, else NONE
};
void tdm_oai_tool_request_fini(struct tdm_oai_tool_request *t); // a zeroed t is fine

// The JSON Schema a REQUIRED or NAMED request constrains the output with, as
// vLLM builds it: NAMED, the function's parameters (an empty object schema when
// it has none); REQUIRED, an array (minItems 1; maxItems 1 without
// parallel_tool_calls) of objects {"name": one tool's name (enum), "parameters":
// that tool's parameters} as an anyOf over the tools, their "$defs" hoisted to
// the top (the same name with two different schemas is TDM_EINVAL). *out heap,
// NULL for NONE and AUTO (nothing to force). TDM_OK / TDM_EINVAL (err) / TDM_ENOMEM.
int tdm_oai_tool_constraint_schema(const struct tdm_oai_tool_request *t, char **out, char *err,
                                   size_t errlen);

// ---- parsing the output -----------------------------------------------------------------
// Which shape the generated text has (from the request's choice and parser).
enum tdm_oai_tool_format {
    TDM_OAI_TOOL_FORMAT_NONE = 0,    // plain content
    TDM_OAI_TOOL_FORMAT_HERMES,      // auto, --tool-call-parser hermes
    TDM_OAI_TOOL_FORMAT_LLAMA3_JSON, // auto, --tool-call-parser llama3_json
    TDM_OAI_TOOL_FORMAT_REQUIRED,    // [{"name": ..., "parameters": {...}}, ...]
    TDM_OAI_TOOL_FORMAT_NAMED,       // the arguments object of the named function
};
enum tdm_oai_tool_format tdm_oai_tool_format_of(const struct tdm_oai_tool_request *t);

// One complete tool call (non-stream message.tool_calls[i]).
struct tdm_oai_tool_call {
    char id[48];     // "chatcmpl-tool-" and 32 random hex digits
    char *name;      // heap
    char *arguments; // heap: the arguments as JSON text (the model's own bytes)
};

// One entry of a stream chunk's delta.tool_calls: the first for a call carries
// id, type "function" and name; the following ones argument fragments only.
struct tdm_oai_tool_delta {
    int index;   // the call's position in the message (0, 1, ...)
    bool header; // id, type and name are sent with this entry
    char id[48]; // header: the call's id
    char *name;  // header: heap; else NULL
    char *args;  // argument bytes of this chunk (heap, NUL-terminated; may be "")
    size_t args_len;
};

struct tdm_oai_toolparse;
// format NONE is not a parser (TDM_EINVAL). name: the function of NAMED (copied).
// parallel false keeps the first call only (later ones are dropped whole).
int tdm_oai_toolparse_new(struct tdm_oai_toolparse **out, enum tdm_oai_tool_format format,
                          const char *name, bool parallel);
void tdm_oai_toolparse_free(struct tdm_oai_toolparse *p); // NULL is fine
// Feeds generated text (any split, even inside a marker or a UTF-8 character).
// Content and deltas that are certain accumulate until tdm_oai_toolparse_clear.
// TDM_OK / TDM_ENOMEM.
int tdm_oai_toolparse_feed(struct tdm_oai_toolparse *p, const char *text, size_t len);
// The output ended: what was held back is settled (a tool call never completed
// goes out as content when nothing of it was sent yet). TDM_OK / TDM_ENOMEM.
int tdm_oai_toolparse_finish(struct tdm_oai_toolparse *p);
// What accumulated since the last clear (borrowed until the next feed/clear).
const char *tdm_oai_toolparse_content(const struct tdm_oai_toolparse *p, size_t *len);
const struct tdm_oai_tool_delta *tdm_oai_toolparse_deltas(const struct tdm_oai_toolparse *p,
                                                          size_t *n);
void tdm_oai_toolparse_clear(struct tdm_oai_toolparse *p);         // content and deltas
void tdm_oai_toolparse_clear_content(struct tdm_oai_toolparse *p); // content only
// Calls whose header went out so far (finish_reason "tool_calls" when > 0 in auto).
int tdm_oai_toolparse_calls(const struct tdm_oai_toolparse *p);

// The non-stream message of a whole output, as vLLM's extract_tool_calls: the
// calls and the content (text outside the calls; *content NULL when there is
// none). A call that does not parse leaves the whole text as content and no
// calls (vLLM's fallback). *calls heap [n_calls]; free with tdm_oai_tool_calls_free
// and *content with free(). TDM_OK / TDM_ENOMEM.
int tdm_oai_tools_extract(enum tdm_oai_tool_format format, const char *name, bool parallel,
                          const char *text, size_t len, struct tdm_oai_tool_call **calls,
                          size_t *n_calls, char **content);
void tdm_oai_tool_calls_free(struct tdm_oai_tool_call *calls, size_t n);

#endif
