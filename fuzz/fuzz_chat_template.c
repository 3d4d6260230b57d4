// SPDX-License-Identifier: Apache-2.0
// Fuzzes the chat template renderer (common/text/chat): a template comes from a
// downloaded model's tokenizer_config.json or an operator's --chat-template,
// and its messages and tools from any client. The input is the template text,
// then (after a NUL byte) a messages JSON array, then (after another NUL) a
// tools JSON array. A template that loads is rendered with a fixed
// conversation ({role, content} form and the JSON form with a tool call, a
// tool result and a tool list) and, when the input carries them, with its own
// messages and tools. Every render must end (a result, TDM_EINVAL or
// TDM_ECAPACITY) within the renderer's limits: a crash, a sanitizer report, a
// timeout or an out-of-memory is a finding.
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_stack.h"
#include "chat.h"

static const char *const fixed_json =
    "[{\"role\":\"system\",\"content\":\"You are terse.\"},"
    "{\"role\":\"user\",\"content\":\"Weather in Paris?\"},"
    "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":"
    "\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}]},"
    "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"name\":\"get_weather\",\"content\":\"18C\"},"
    "{\"role\":\"assistant\",\"content\":\"18C and sunny.\"},"
    "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Thanks\"}]}]";
static const char *const fixed_tools =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather "
    "now\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"
    "\"required\":[\"city\"]}}}]";

// The part of [*p, end) up to the next NUL (or end), NUL-terminated on the heap;
// *p moves past that NUL. NULL when nothing is left.
static char *next_part(const uint8_t **p, const uint8_t *end, bool *present)
{
    *present = *p < end;
    if (!*present)
        return NULL;
    const uint8_t *z = memchr(*p, 0, (size_t)(end - *p));
    size_t n = z ? (size_t)(z - *p) : (size_t)(end - *p);
    char *s = malloc(n + 1);
    if (s) {
        memcpy(s, *p, n);
        s[n] = '\0';
    }
    *p += n + (z ? 1 : 0);
    return s;
}

static int fuzz_one(const uint8_t *data, size_t size)
{
    const uint8_t *p = data, *end = data + size;
    bool has_tpl, has_msgs, has_tools;
    char *tpl = next_part(&p, end, &has_tpl);
    char *msgs = next_part(&p, end, &has_msgs);
    char *tools = next_part(&p, end, &has_tools);
    char err[256];
    struct tdm_chat_template *t = NULL;
    if (tpl && tdm_chat_template_new(&t, tpl, NULL, err, sizeof err) == 0) {
        tdm_chat_template_set_tokens(t, "<s>", "</s>", "<pad>");
        struct tdm_chat_msg fixed[] = {{(char *)"system", (char *)"You are terse."},
                                       {(char *)"user", (char *)"Hi"},
                                       {(char *)"assistant", (char *)"Hello."},
                                       {(char *)"user", (char *)"Bye"}};
        char *out = NULL;
        if (tdm_chat_render(t, fixed, sizeof fixed / sizeof fixed[0], true, &out, err,
                            sizeof err) == 0)
            free(out);
        out = NULL;
        if (tdm_chat_render_json(t, fixed_json, fixed_tools, false, &out, err, sizeof err) == 0)
            free(out);
        if (has_msgs && msgs) {
            out = NULL;
            if (tdm_chat_render_json(t, msgs, has_tools ? tools : NULL, true, &out, err,
                                     sizeof err) == 0)
                free(out);
            // The {role, content} path parses the same messages first.
            struct tdm_chat_msg *m = NULL;
            size_t n = 0;
            if (tdm_chat_msgs_parse(msgs, strlen(msgs), &m, &n, err, sizeof err) == 0) {
                out = NULL;
                if (tdm_chat_render(t, m, n, false, &out, err, sizeof err) == 0)
                    free(out);
                tdm_chat_msgs_free(m, n);
            }
        }
        tdm_chat_template_free(t);
    }
    free(tpl);
    free(msgs);
    free(tools);
    return 0;
}

TDM_FUZZ_ON_HTTP_STACK(fuzz_one)
