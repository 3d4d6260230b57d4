// SPDX-License-Identifier: Apache-2.0
// grammar_validate: a small JSON Schema validator for TESTS (not linked into
// any server): checks that a structured output parses and fits its schema,
// for the keywords common/engine/grammar supports ($ref to #, #/$defs, #/definitions;
// const, enum, anyOf, type, min/maxLength, pattern (POSIX ERE), format date,
// min/maxItems, items, properties in schema order, required). Independent of
// the grammar engine, so that the engine's outputs are checked by other code.
#include "grammar_validate.h"

#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <string.h>

static size_t utf8_chars(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static bool validate(const cJSON *v, const cJSON *s, const cJSON *root, char *why, size_t wl);

static bool validate_type(const cJSON *v, const char *t)
{
    if (!strcmp(t, "string"))
        return cJSON_IsString(v);
    if (!strcmp(t, "number"))
        return cJSON_IsNumber(v);
    if (!strcmp(t, "integer"))
        return cJSON_IsNumber(v) && v->valuedouble == (double)(long long)v->valuedouble;
    if (!strcmp(t, "boolean"))
        return cJSON_IsBool(v);
    if (!strcmp(t, "null"))
        return cJSON_IsNull(v);
    if (!strcmp(t, "object"))
        return cJSON_IsObject(v);
    if (!strcmp(t, "array"))
        return cJSON_IsArray(v);
    return false;
}

#define NOPE(...) (snprintf(why, wl, __VA_ARGS__), false)

static bool validate(const cJSON *v, const cJSON *s, const cJSON *root, char *why, size_t wl)
{
    if (cJSON_IsTrue(s))
        return true;
    const cJSON *k;
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "$ref"))) {
        const char *r = k->valuestring;
        const cJSON *t = !strcmp(r, "#") ? root
                         : !strncmp(r, "#/$defs/", 8)
                             ? cJSON_GetObjectItemCaseSensitive(
                                   cJSON_GetObjectItemCaseSensitive(root, "$defs"), r + 8)
                             : cJSON_GetObjectItemCaseSensitive(
                                   cJSON_GetObjectItemCaseSensitive(root, "definitions"), r + 14);
        return validate(v, t, root, why, wl);
    }
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "const")) && !cJSON_Compare(v, k, true))
        return NOPE("const");
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "enum"))) {
        const cJSON *e;
        bool any = false;
        cJSON_ArrayForEach(e, k) any |= cJSON_Compare(v, e, true);
        if (!any)
            return NOPE("enum");
    }
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "anyOf"))) {
        const cJSON *e;
        bool any = false;
        cJSON_ArrayForEach(e, k) any |= validate(v, e, root, why, wl);
        if (!any)
            return NOPE("anyOf");
    }
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "type"))) {
        bool ok = false;
        if (cJSON_IsString(k))
            ok = validate_type(v, k->valuestring);
        const cJSON *e;
        if (cJSON_IsArray(k))
            cJSON_ArrayForEach(e, k) ok |= validate_type(v, e->valuestring);
        if (!ok)
            return NOPE("type");
    }
    if (cJSON_IsString(v)) {
        size_t n = utf8_chars(v->valuestring);
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "minLength")) && n < (size_t)k->valueint)
            return NOPE("minLength");
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "maxLength")) && n > (size_t)k->valueint)
            return NOPE("maxLength");
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "pattern"))) {
            regex_t re;
            if (regcomp(&re, k->valuestring, REG_EXTENDED | REG_NOSUB) != 0)
                return NOPE("pattern %s: not a POSIX ERE this validator can run", k->valuestring);
            int rc = regexec(&re, v->valuestring, 0, NULL, 0);
            regfree(&re);
            if (rc)
                return NOPE("pattern");
        }
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "format")) &&
            !strcmp(k->valuestring, "date")) {
            int y, mo, d;
            char tail;
            if (sscanf(v->valuestring, "%4d-%2d-%2d%c", &y, &mo, &d, &tail) != 3 || mo < 1 ||
                mo > 12 || d < 1 || d > 31 || strlen(v->valuestring) != 10)
                return NOPE("date");
        }
    }
    if (cJSON_IsNumber(v)) {
        double x = v->valuedouble;
        if (!isfinite(x))
            return NOPE("not a finite number");
        const cJSON *emn = cJSON_GetObjectItemCaseSensitive(s, "exclusiveMinimum");
        const cJSON *emx = cJSON_GetObjectItemCaseSensitive(s, "exclusiveMaximum");
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "minimum")) &&
            (cJSON_IsTrue(emn) ? x <= k->valuedouble : x < k->valuedouble))
            return NOPE("minimum");
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "maximum")) &&
            (cJSON_IsTrue(emx) ? x >= k->valuedouble : x > k->valuedouble))
            return NOPE("maximum");
        if (cJSON_IsNumber(emn) && x <= emn->valuedouble)
            return NOPE("exclusiveMinimum");
        if (cJSON_IsNumber(emx) && x >= emx->valuedouble)
            return NOPE("exclusiveMaximum");
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "multipleOf"))) {
            double q = x / k->valuedouble;
            if (fabs(q - nearbyint(q)) > 1e-9 * fmax(1.0, fabs(q)))
                return NOPE("multipleOf");
        }
    }
    if (cJSON_IsArray(v)) {
        int n = cJSON_GetArraySize(v);
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "minItems")) && n < k->valueint)
            return NOPE("minItems");
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "maxItems")) && n > k->valueint)
            return NOPE("maxItems");
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items"), *e;
        if (items)
            cJSON_ArrayForEach(e, v) if (!validate(e, items, root, why, wl)) return false;
    }
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    if (cJSON_IsObject(v) && props) {
        const cJSON *e, *schema_prop = props->child;
        cJSON_ArrayForEach(e, v)
        {
            // Keys must be schema properties, in schema order.
            while (schema_prop && strcmp(schema_prop->string, e->string))
                schema_prop = schema_prop->next;
            if (!schema_prop)
                return NOPE("key %s not allowed here", e->string);
            if (!validate(e, schema_prop, root, why, wl))
                return false;
        }
        const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
        cJSON_ArrayForEach(e, req) if (!cJSON_GetObjectItemCaseSensitive(
                                           v, e->valuestring)) return NOPE("required %s",
                                                                           e->valuestring);
    }
    return true;
}

bool tdm_grammar_valid_utf8(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
        if (!len || i + len > n)
            return false;
        for (size_t k = 1; k < len; k++)
            if (((unsigned char)s[i + k] & 0xC0) != 0x80)
                return false;
        i += len;
    }
    return true;
}


bool tdm_grammar_validate_json(const cJSON *value, const cJSON *schema, char *why, size_t wl)
{
    if (why && wl)
        why[0] = '\0';
    return validate(value, schema, schema, why, wl);
}

bool tdm_grammar_validate_text(const char *text, size_t len, const char *schema, char *why,
                               size_t wl)
{
    if (!tdm_grammar_valid_utf8(text, len))
        return NOPE("not valid UTF-8");
    cJSON *s = cJSON_Parse(schema);
    if (!s)
        return NOPE("the schema does not parse");
    const char *end = NULL;
    cJSON *v = cJSON_ParseWithLengthOpts(text, len, &end, false);
    bool ok;
    if (!v) {
        ok = NOPE("not JSON");
    } else {
        while (end && end < text + len && (*end == ' ' || *end == '\t' || *end == '\n' ||
                                            *end == '\r'))
            end++;
        ok = end == text + len ? tdm_grammar_validate_json(v, s, why, wl)
                               : NOPE("text after the JSON value");
    }
    cJSON_Delete(v);
    cJSON_Delete(s);
    return ok;
}
