// SPDX-License-Identifier: Apache-2.0
// JSON nesting check: how deep the arrays and objects of a JSON text nest,
// found by a byte scan before any parser sees the text.
//
// cJSON parses arrays and objects by recursion on the caller's stack, about
// three frames a level, and its own limit (1 000 levels) assumes a main-thread
// stack. civetweb's worker threads and the services' own threads have far
// less, so a 1.5 KB body of 800 nested brackets overflowed the stack and
// killed the process. Every place that parses JSON from outside (request
// bodies, config and model files, Hub answers) calls this first, with
// TDM_JSON_MAX_DEPTH, and refuses deeper text with an error naming the limit.
//
// The scan skips string contents (with their escapes), so brackets inside
// strings do not count; it does not validate the JSON: the parser does that.
// Unbalanced closers only lower the count, never below zero.
#include <stddef.h>

#include "core.h"

int tdm_json_check_depth(const char *text, size_t len, int max_depth, char *err, size_t errlen)
{
    int depth = 0;
    bool in_string = false;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (in_string) {
            if (c == '\\')
                i++; // the escaped byte cannot end the string
            else if (c == '"')
                in_string = false;
            continue;
        }
        switch (c) {
        case '"':
            in_string = true;
            break;
        case '[':
        case '{':
            if (++depth > max_depth)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "JSON nests deeper than %d levels (at byte %zu)", max_depth, i);
            break;
        case ']':
        case '}':
            if (depth > 0)
                depth--;
            break;
        default:
            break;
        }
    }
    return TDM_OK;
}

bool tdm_json_has_nul_escape(const char *text, size_t len)
{
    bool in_string = false;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (!in_string) {
            in_string = c == '"';
            continue;
        }
        if (c == '"') {
            in_string = false;
        } else if (c == '\\' && i + 1 < len) {
            if (text[i + 1] == 'u' && i + 5 < len && text[i + 2] == '0' && text[i + 3] == '0' &&
                text[i + 4] == '0' && text[i + 5] == '0')
                return true;
            i++; // the escaped byte (a backslash, a quote, 'u' of another code point)
        } else if (c == '\0') {
            return true; // a raw NUL inside a string: invalid JSON, refused all the same
        }
    }
    return false;
}
