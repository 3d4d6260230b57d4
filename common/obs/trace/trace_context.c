// SPDX-License-Identifier: Apache-2.0
// trace_context: W3C Trace Context headers and span building (trace.h). The
// parser follows the spec's processing model: version ff is invalid; for
// version 00 the header is exactly 55 characters; a later version (unknown to
// us) is parsed by the version-00 layout on its first 55 characters and may
// carry more after a '-'; lower-case hex only; all-zero trace id or parent id
// invalid. Whatever fails, the caller starts a new trace and drops tracestate.
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "core.h"
#include "trace.h"

// ---- hex -----------------------------------------------------------------------------------
static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1; // upper case is invalid in traceparent
}

// n bytes from 2n lower-case hex chars; false on any other character.
static bool unhex(const char *s, uint8_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

static bool all_zero(const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return false;
    return true;
}

void tdm_trace_hex(const uint8_t *bytes, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
    out[2 * n] = '\0';
}

// ---- random ids ----------------------------------------------------------------------------
static void random_bytes(uint8_t *out, size_t n)
{
    if (getrandom(out, n, 0) == (ssize_t)n)
        return;
    // No entropy source: time and a counter still make ids unique in practice.
    static _Atomic uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)ts.tv_nsec ^
                 (atomic_fetch_add(&counter, 1) * 0x9E3779B97F4A7C15ull);
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out[i] = (uint8_t)x;
    }
}

void tdm_trace_new_span_id(uint8_t out[8])
{
    do
        random_bytes(out, 8);
    while (all_zero(out, 8));
}

void tdm_trace_ctx_new(struct tdm_trace_ctx *out)
{
    memset(out, 0, sizeof *out);
    do
        random_bytes(out->trace_id, 16);
    while (all_zero(out->trace_id, 16));
    out->sampled = true;
}

// ---- traceparent / tracestate --------------------------------------------------------------
int tdm_trace_parse(const char *tp, const char *ts, struct tdm_trace_ctx *out)
{
    memset(out, 0, sizeof *out);
    if (tp == NULL)
        return TDM_EINVAL;
    // Optional surrounding whitespace (HTTP OWS) is not part of the value.
    while (*tp == ' ' || *tp == '\t')
        tp++;
    size_t len = strlen(tp);
    while (len > 0 && (tp[len - 1] == ' ' || tp[len - 1] == '\t'))
        len--;
    if (len < TDM_TRACEPARENT_LEN)
        return TDM_EINVAL;
    uint8_t version, flags;
    if (!unhex(tp, &version, 1) || version == 0xff)
        return TDM_EINVAL;
    if (version == 0 && len != TDM_TRACEPARENT_LEN)
        return TDM_EINVAL;
    if (version > 0 && len > TDM_TRACEPARENT_LEN && tp[TDM_TRACEPARENT_LEN] != '-')
        return TDM_EINVAL;
    if (tp[2] != '-' || tp[35] != '-' || tp[52] != '-')
        return TDM_EINVAL;
    if (!unhex(tp + 3, out->trace_id, 16) || !unhex(tp + 36, out->span_id, 8) ||
        !unhex(tp + 53, &flags, 1))
        goto invalid;
    if (all_zero(out->trace_id, 16) || all_zero(out->span_id, 8))
        goto invalid;
    out->sampled = (flags & 1) != 0;
    if (ts) {
        size_t tl = strlen(ts);
        bool ok = tl <= TDM_TRACESTATE_MAX;
        for (size_t i = 0; ok && i < tl; i++)
            ok = ts[i] >= 0x20 && ts[i] < 0x7f;
        if (ok)
            memcpy(out->tracestate, ts, tl + 1);
    }
    return TDM_OK;
invalid:
    memset(out, 0, sizeof *out);
    return TDM_EINVAL;
}

bool tdm_trace_ctx_from_headers(const char *traceparent, const char *tracestate,
                                struct tdm_trace_ctx *out)
{
    if (tdm_trace_parse(traceparent, tracestate, out) == TDM_OK)
        return true;
    tdm_trace_ctx_new(out);
    return false;
}

void tdm_trace_format(const struct tdm_trace_ctx *ctx, char out[TDM_TRACEPARENT_LEN + 1])
{
    char tid[33], sid[17];
    tdm_trace_hex(ctx->trace_id, 16, tid);
    tdm_trace_hex(ctx->span_id, 8, sid);
    snprintf(out, TDM_TRACEPARENT_LEN + 1, "00-%s-%s-%s", tid, sid, ctx->sampled ? "01" : "00");
}

// ---- spans ---------------------------------------------------------------------------------
void tdm_span_begin(struct tdm_span *sp, const struct tdm_tracer *t,
                    const struct tdm_trace_ctx *parent, const char *name, enum tdm_span_kind kind,
                    double start)
{
    sp->recording = t != NULL && parent != NULL && parent->sampled;
    if (!sp->recording)
        return;
    memcpy(sp->trace_id, parent->trace_id, sizeof sp->trace_id);
    memcpy(sp->parent_id, parent->span_id, sizeof sp->parent_id);
    tdm_trace_new_span_id(sp->span_id);
    sp->sampled = true;
    snprintf(sp->tracestate, sizeof sp->tracestate, "%s", parent->tracestate);
    snprintf(sp->name, sizeof sp->name, "%s", name);
    sp->kind = kind;
    sp->start = start;
    sp->end = start;
    sp->status = 0;
    sp->status_message[0] = '\0';
    sp->n_attrs = 0;
    sp->n_events = 0;
}

void tdm_span_begin_child(struct tdm_span *sp, const struct tdm_span *parent, const char *name,
                          enum tdm_span_kind kind, double start)
{
    sp->recording = parent->recording;
    if (!sp->recording)
        return;
    struct tdm_trace_ctx c;
    tdm_span_ctx(parent, &c);
    // Not through tdm_span_begin's tracer check: the parent already recorded.
    memcpy(sp->trace_id, c.trace_id, sizeof sp->trace_id);
    memcpy(sp->parent_id, c.span_id, sizeof sp->parent_id);
    tdm_trace_new_span_id(sp->span_id);
    sp->sampled = true;
    snprintf(sp->tracestate, sizeof sp->tracestate, "%s", c.tracestate);
    snprintf(sp->name, sizeof sp->name, "%s", name);
    sp->kind = kind;
    sp->start = start;
    sp->end = start;
    sp->status = 0;
    sp->status_message[0] = '\0';
    sp->n_attrs = 0;
    sp->n_events = 0;
}

void tdm_span_ctx(const struct tdm_span *sp, struct tdm_trace_ctx *out)
{
    memcpy(out->trace_id, sp->trace_id, sizeof out->trace_id);
    memcpy(out->span_id, sp->span_id, sizeof out->span_id);
    out->sampled = sp->recording && sp->sampled;
    snprintf(out->tracestate, sizeof out->tracestate, "%s", sp->tracestate);
}

static struct tdm_span_attr *attr_slot(struct tdm_span *sp, const char *key)
{
    if (!sp->recording || sp->n_attrs >= TDM_SPAN_MAX_ATTRS)
        return NULL;
    struct tdm_span_attr *a = &sp->attrs[sp->n_attrs++];
    a->key = key;
    return a;
}

void tdm_span_attr_str(struct tdm_span *sp, const char *key, const char *value)
{
    struct tdm_span_attr *a = attr_slot(sp, key);
    if (a) {
        a->type = TDM_SPAN_ATTR_STR;
        snprintf(a->s, sizeof a->s, "%s", value ? value : "");
    }
}

void tdm_span_attr_int(struct tdm_span *sp, const char *key, int64_t value)
{
    struct tdm_span_attr *a = attr_slot(sp, key);
    if (a) {
        a->type = TDM_SPAN_ATTR_INT;
        a->i = value;
    }
}

void tdm_span_attr_double(struct tdm_span *sp, const char *key, double value)
{
    struct tdm_span_attr *a = attr_slot(sp, key);
    if (a) {
        a->type = TDM_SPAN_ATTR_DOUBLE;
        a->d = value;
    }
}

void tdm_span_event(struct tdm_span *sp, const char *name, double t)
{
    if (!sp->recording || sp->n_events >= TDM_SPAN_MAX_EVENTS)
        return;
    sp->events[sp->n_events].name = name;
    sp->events[sp->n_events].t = t;
    sp->n_events++;
}

void tdm_span_error(struct tdm_span *sp, const char *message)
{
    if (!sp->recording)
        return;
    sp->status = 2;
    snprintf(sp->status_message, sizeof sp->status_message, "%s", message ? message : "");
}
