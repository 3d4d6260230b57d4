// SPDX-License-Identifier: Apache-2.0
// grammar_validate: a JSON Schema validator for tests of structured outputs
// (grammar_test, engine_grammar_test): the output must be UTF-8, parse as one
// JSON value and fit the schema (the keywords common/engine/grammar supports). Not
// for servers: tests only (library tdm_grammar_validate).
#ifndef TDM_GRAMMAR_VALIDATE_H
#define TDM_GRAMMAR_VALIDATE_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

// True when value fits schema (its own root for $ref); else false with why.
bool tdm_grammar_validate_json(const cJSON *value, const cJSON *schema, char *why, size_t wl);
// text (len bytes) parses as one JSON value (whitespace around it allowed) and
// fits the schema text; else false with why.
bool tdm_grammar_validate_text(const char *text, size_t len, const char *schema, char *why,
                               size_t wl);
bool tdm_grammar_valid_utf8(const char *s, size_t n);

#endif
