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

// text[i] opens a string: the index of its closing quote (len when none).
static size_t string_end(const char *text, size_t len, size_t i)
{
    for (i++; i < len; i++) {
        if (text[i] == '\\')
            i++; // the escaped byte cannot end the string
        else if (text[i] == '"')
            return i;
    }
    return len;
}

// One scan for both questions: the values cJSON would build (the root, every
// array element, every object member) and the first byte where nesting passes
// max_depth (len when it never does). Deeper text goes on being counted as if
// it were max_depth deep.
static size_t scan(const char *text, size_t len, int max_depth, size_t *too_deep_at)
{
    // For the container at depth d: is it an array, and is that array still
    // waiting for its first element (counted when it starts; the others at
    // their commas)? Object members count at their colons.
    bool is_array[TDM_JSON_MAX_DEPTH + 1], waiting[TDM_JSON_MAX_DEPTH + 1];
    int maxd = max_depth < 0 ? 0 : max_depth < TDM_JSON_MAX_DEPTH ? max_depth : TDM_JSON_MAX_DEPTH;
    int depth = 0;
    size_t n = len > 0 ? 1 : 0; // the root
    *too_deep_at = len;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (c == ' ' || c == '\t' || c == '\r' || c == '\n')
            continue;
        int d = depth < maxd ? depth : maxd;
        if (depth > 0 && is_array[d] && waiting[d] && c != ']') {
            n++; // an array's first element
            waiting[d] = false;
        }
        switch (c) {
        case '"':
            i = string_end(text, len, i);
            break;
        case '[':
        case '{':
            if (++depth > max_depth && *too_deep_at == len)
                *too_deep_at = i;
            d = depth < maxd ? depth : maxd;
            is_array[d] = c == '[';
            waiting[d] = c == '[';
            break;
        case ']':
        case '}':
            if (depth > 0)
                depth--; // unbalanced closers only lower the count, never below zero
            break;
        case ',':
            n += depth > 0 && is_array[d]; // the next element
            break;
        case ':':
            n++;
            break;
        default:
            break;
        }
    }
    return n;
}

int tdm_json_check_depth_count(const char *text, size_t len, int max_depth, size_t *values,
                               char *err, size_t errlen)
{
    size_t at, n = scan(text, len, max_depth, &at);
    if (values)
        *values = n;
    if (at < len)
        return tdm_seterr(err, errlen, TDM_EINVAL, "JSON nests deeper than %d levels (at byte %zu)",
                          max_depth, at);
    return TDM_OK;
}

int tdm_json_check_depth(const char *text, size_t len, int max_depth, char *err, size_t errlen)
{
    return tdm_json_check_depth_count(text, len, max_depth, NULL, err, errlen);
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
