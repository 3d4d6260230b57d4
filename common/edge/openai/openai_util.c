// SPDX-License-Identifier: Apache-2.0
// openai utilities: error bodies and their status → type table, random ids,
// Python-style float formatting (vLLM's messages print floats with repr) and
// UTF-8 repair (token pieces may be fragments of a character; JSON must carry
// valid UTF-8, so they are replaced as Python's errors="replace" would).
#include "openai.h"
#include "openai_impl.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "core.h"

const char *tdm_oai_error_type(int status)
{
    switch (status) {
    case 400:
        return "BadRequestError";
    case 401:
        return "AuthenticationError";
    case 403:
        return "PermissionDeniedError";
    case 404:
        return "NotFoundError";
    case 405:
        return "MethodNotAllowedError";
    case 413:
        return "RequestTooLargeError";
    case 422:
        return "UnprocessableEntityError";
    case 429:
        return "RateLimitError";
    case 501:
        return "NotImplementedError";
    case 503:
        return "ServiceUnavailableError";
    case 504:
        return "TimeoutError";
    default:
        return status >= 400 && status < 500 ? "BadRequestError" : "InternalServerError";
    }
}

int tdm_oai_status_for_err(int err)
{
    switch (err) {
    case TDM_OK:
        return 200;
    case TDM_EINVAL:
        return 400;
    case TDM_ENOTFOUND:
        return 404;
    case TDM_EBUSY: // vLLM: a full queue is 503 with Retry-After, never 429
    case TDM_ECAPACITY:
    case TDM_ECLOSED:
        return 503;
    case TDM_ETIMEDOUT:
        return 504;
    case TDM_EPROTO:
    case TDM_ETRANSPORT:
        return 502;
    default:
        return 500;
    }
}

int tdm_oai_seterr(struct tdm_oai_error *e, int status, const char *param, const char *fmt, ...)
{
    int code = status >= 400 && status < 500 ? TDM_EINVAL : TDM_EPROTO;
    if (!e)
        return code;
    e->status = status;
    snprintf(e->type, sizeof e->type, "%s", tdm_oai_error_type(status));
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return code;
}

int tdm_oai_error_from_err(struct tdm_oai_error *e, int err, const char *detail)
{
    if (detail == NULL || detail[0] == '\0')
        detail = tdm_strerror(err);
    int status = err == TDM_OK ? 500 : tdm_oai_status_for_err(err); // a failure without a code
    if (err == TDM_EBUSY)
        return tdm_oai_seterr(e, status, NULL, "The server is overloaded: %s. Retry later.",
                              detail);
    return tdm_oai_seterr(e, status, NULL, "%s", detail);
}

char *tdm_oai_error_body_from(int status, const char *type, const char *param, const char *message)
{
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return NULL;
    char *out = NULL;
    cJSON *err = cJSON_AddObjectToObject(root, "error");
    char *msg = tdm_oai_utf8_dup(message ? message : "", message ? strlen(message) : 0);
    if (!err || !msg || !cJSON_AddStringToObject(err, "message", msg) ||
        !cJSON_AddStringToObject(err, "type", type ? type : tdm_oai_error_type(status)))
        goto done;
    if (param && *param) {
        if (!cJSON_AddStringToObject(err, "param", param))
            goto done;
    } else if (!cJSON_AddNullToObject(err, "param")) {
        goto done;
    }
    if (!cJSON_AddNumberToObject(err, "code", status))
        goto done;
    out = cJSON_PrintUnformatted(root);
done:
    free(msg);
    cJSON_Delete(root);
    return out;
}

char *tdm_oai_error_body(const struct tdm_oai_error *e)
{
    return tdm_oai_error_body_from(e->status, e->type[0] ? e->type : NULL, e->param, e->message);
}

void tdm_oai_random_hex(char out[TDM_OAI_ID_HEX + 1])
{
    unsigned char bytes[TDM_OAI_ID_HEX / 2];
    size_t got = 0;
    while (got < sizeof bytes) {
        ssize_t r = getrandom(bytes + got, sizeof bytes - got, 0);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    if (got < sizeof bytes) {
        // getrandom cannot fail on Linux >= 3.17 once the pool is ready; keep ids
        // unique anyway from the clock and a counter.
        static unsigned long counter;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        unsigned long long mix =
            (unsigned long long)ts.tv_nsec ^ ((unsigned long long)ts.tv_sec << 30) ^
            (unsigned long long)__atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
        for (size_t i = got; i < sizeof bytes; i++) {
            mix = mix * 6364136223846793005ULL + 1442695040888963407ULL;
            bytes[i] = (unsigned char)(mix >> 56);
        }
    }
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < sizeof bytes; i++) {
        out[2 * i] = hex[bytes[i] >> 4];
        out[2 * i + 1] = hex[bytes[i] & 15];
    }
    out[TDM_OAI_ID_HEX] = '\0';
}

void tdm_oai_fmt_float(char out[32], double v)
{
    if (isnan(v)) {
        snprintf(out, 32, "nan");
        return;
    }
    if (isinf(v)) {
        snprintf(out, 32, v < 0 ? "-inf" : "inf");
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(out, 32, "%.*g", prec, v);
        if (strtod(out, NULL) == v)
            break;
    }
    if (!strpbrk(out, ".en")) {
        size_t l = strlen(out);
        if (l + 2 < 32)
            memcpy(out + l, ".0", 3);
    }
}

size_t tdm_oai_utf8_seq_len(const unsigned char *s, size_t len)
{
    if (len == 0)
        return 0;
    unsigned c = s[0];
    size_t need;
    unsigned min;
    if (c < 0x80)
        return c == 0 ? 0 : 1;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 2;
        min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        min = 0x10000;
    } else {
        return 0;
    }
    if (len < need)
        return 0;
    unsigned cp = c & (need == 2 ? 0x1F : need == 3 ? 0x0F : 0x07);
    for (size_t i = 1; i < need; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return need;
}

// Bytes one U+FFFD replaces at an invalid sequence: the maximal subpart of a
// well-formed sequence (Unicode 3.9 practice, which Python follows), at least 1.
static size_t invalid_len(const unsigned char *s, size_t len)
{
    unsigned c = s[0];
    size_t need = c >= 0xC2 && c <= 0xDF   ? 2
                  : c >= 0xE0 && c <= 0xEF ? 3
                  : c >= 0xF0 && c <= 0xF4 ? 4
                                           : 1;
    size_t i = 1;
    while (i < need && i < len) {
        unsigned lo = 0x80, hi = 0xBF;
        if (i == 1) {
            if (c == 0xE0)
                lo = 0xA0;
            else if (c == 0xED)
                hi = 0x9F;
            else if (c == 0xF0)
                lo = 0x90;
            else if (c == 0xF4)
                hi = 0x8F;
        }
        if (s[i] < lo || s[i] > hi)
            break;
        i++;
    }
    return i;
}

char *tdm_oai_utf8_dup(const char *s, size_t len)
{
    // Worst case every byte becomes the 3-byte U+FFFD.
    char *out = malloc(len * 3 + 1);
    if (!out)
        return NULL;
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, o = 0;
    while (i < len) {
        size_t n = tdm_oai_utf8_seq_len(p + i, len - i);
        if (n) {
            memcpy(out + o, p + i, n);
            o += n;
            i += n;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i += invalid_len(p + i, len - i);
        }
    }
    out[o] = '\0';
    return out;
}

size_t tdm_oai_utf8_chars(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, count = 0;
    while (i < len) {
        size_t n = tdm_oai_utf8_seq_len(p + i, len - i);
        if (!n && p[i] == 0)
            n = 1; // NUL is one code point
        i += n ? n : invalid_len(p + i, len - i);
        count++;
    }
    return count;
}
