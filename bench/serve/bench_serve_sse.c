// SPDX-License-Identifier: Apache-2.0
// bench_serve SSE parser: splits one streaming response into server-sent events
// (data lines up to a blank line), parses each event's JSON with cJSON and
// records what the metrics need: the time of each content chunk (first one ->
// TTFT, later ones -> ITL gaps), the text, usage counts, [DONE], and error events
// (`data: {"error": {...}}`, or the older flat `{"object":"error",...}`).
// Chunks that carry no text (chat's opening role chunk, a finish-only chunk, the
// usage chunk) are not content: they do not start or split a token gap.
// Buffers are sized once for the expected token count and grow by doubling, so a
// normal stream allocates nothing per chunk apart from cJSON's parse tree.
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bench_serve_impl.h"
#include "core.h"

int bench_stream_init(struct bench_stream *s, bool chat, size_t expect_tokens, double t_start)
{
    memset(s, 0, sizeof(*s));
    s->chat = chat;
    s->t_start = t_start;
    s->usage_completion = -1;
    s->usage_prompt = -1;
    s->itl_cap = expect_tokens + 8;
    s->itl = malloc(s->itl_cap * sizeof(double));
    s->text_cap = expect_tokens * 8 + 64;
    s->text = malloc(s->text_cap);
    s->line_cap = 1024;
    s->line = malloc(s->line_cap);
    s->event_cap = 1024;
    s->event = malloc(s->event_cap);
    if (!s->itl || !s->text || !s->line || !s->event) {
        bench_stream_fini(s);
        return TDM_ENOMEM;
    }
    s->text[0] = '\0';
    return TDM_OK;
}

void bench_stream_fini(struct bench_stream *s)
{
    free(s->itl);
    free(s->text);
    free(s->line);
    free(s->event);
    s->itl = NULL;
    s->text = s->line = s->event = NULL;
}

static void stream_fail(struct bench_stream *s, const char *reason, const char *detail)
{
    if (s->failed)
        return; // keep the first failure: later ones are usually its consequence
    s->failed = true;
    snprintf(s->reason, sizeof(s->reason), "%s", reason);
    snprintf(s->error, sizeof(s->error), "%s", detail);
}

static void on_content(struct bench_stream *s, const char *piece, size_t len, double now)
{
    if (s->n_content == 0) {
        s->ttft = now - s->t_start;
    } else {
        if (tdm_grow(&s->itl, &s->itl_cap, s->n_itl + 1, sizeof *s->itl, 64) != TDM_OK) {
            s->oom = true;
            return;
        }
        s->itl[s->n_itl++] = now - s->t_last;
    }
    s->t_last = now;
    s->n_content++;
    if (tdm_grow(&s->text, &s->text_cap, s->text_len + len + 1, 1, 256)) {
        s->oom = true;
        return;
    }
    memcpy(s->text + s->text_len, piece, len);
    s->text_len += len;
    s->text[s->text_len] = '\0';
}

// Formats an error object's message (or the raw JSON when it has none) into s.
static void on_error_event(struct bench_stream *s, const cJSON *err_obj, const cJSON *root)
{
    char detail[256];
    const cJSON *msg =
        cJSON_IsObject(err_obj) ? cJSON_GetObjectItemCaseSensitive(err_obj, "message") : err_obj;
    if (!cJSON_IsString(msg))
        msg = cJSON_GetObjectItemCaseSensitive(root, "message");
    if (cJSON_IsString(msg)) {
        snprintf(detail, sizeof(detail), "error event: %s", msg->valuestring);
    } else {
        char *raw = cJSON_PrintUnformatted(root);
        snprintf(detail, sizeof(detail), "error event: %s", raw ? raw : "(unprintable)");
        free(raw);
    }
    stream_fail(s, "error event", detail);
}

static void on_event(struct bench_stream *s, double now)
{
    const char *data = s->event;
    size_t len = s->event_len;
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        s->done = true;
        s->t_done = now;
        return;
    }
    cJSON *root = tdm_json_check_depth(data, len, TDM_JSON_MAX_DEPTH, NULL, 0)
                      ? NULL
                      : cJSON_ParseWithLength(data, len);
    if (!root || !cJSON_IsObject(root)) {
        char detail[256];
        snprintf(detail, sizeof(detail), "unparsable SSE data: %.*s", (int)(len > 160 ? 160 : len),
                 data);
        stream_fail(s, "bad chunk", detail);
        cJSON_Delete(root);
        return;
    }
    const cJSON *err_obj = cJSON_GetObjectItemCaseSensitive(root, "error");
    const cJSON *object = cJSON_GetObjectItemCaseSensitive(root, "object");
    if ((err_obj && !cJSON_IsNull(err_obj)) ||
        (cJSON_IsString(object) && !strcmp(object->valuestring, "error"))) {
        on_error_event(s, err_obj, root);
        cJSON_Delete(root);
        return;
    }
    const cJSON *choices = cJSON_GetObjectItemCaseSensitive(root, "choices");
    const cJSON *choice = cJSON_IsArray(choices) ? cJSON_GetArrayItem(choices, 0) : NULL;
    if (cJSON_IsObject(choice)) {
        const cJSON *piece;
        if (s->chat) {
            const cJSON *delta = cJSON_GetObjectItemCaseSensitive(choice, "delta");
            piece = cJSON_GetObjectItemCaseSensitive(delta, "content");
        } else {
            piece = cJSON_GetObjectItemCaseSensitive(choice, "text");
        }
        if (cJSON_IsString(piece) && piece->valuestring[0])
            on_content(s, piece->valuestring, strlen(piece->valuestring), now);
    }
    const cJSON *usage = cJSON_GetObjectItemCaseSensitive(root, "usage");
    if (cJSON_IsObject(usage)) {
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(usage, "completion_tokens");
        const cJSON *pt = cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens");
        if (cJSON_IsNumber(ct) && ct->valuedouble >= 0 && ct->valuedouble < 1e9)
            s->usage_completion = (int)ct->valuedouble;
        if (cJSON_IsNumber(pt) && pt->valuedouble >= 0 && pt->valuedouble < 1e9)
            s->usage_prompt = (int)pt->valuedouble;
    }
    cJSON_Delete(root);
}

// One complete line (without its '\n'; a trailing '\r' is dropped here).
static void on_line(struct bench_stream *s, char *line, size_t len, double now)
{
    if (len && line[len - 1] == '\r')
        len--;
    if (len == 0) {
        if (s->event_has_data)
            on_event(s, now);
        s->event_len = 0;
        s->event_has_data = false;
        return;
    }
    if (line[0] == ':')
        return; // an SSE comment (keep-alive)
    if (len < 5 || memcmp(line, "data:", 5))
        return; // event:, id:, retry: carry nothing the bench measures
    const char *val = line + 5;
    size_t vlen = len - 5;
    if (vlen && *val == ' ') {
        val++;
        vlen--;
    }
    size_t need = s->event_len + (s->event_has_data ? 1 : 0) + vlen + 1;
    if (tdm_grow(&s->event, &s->event_cap, need, 1, 256)) {
        s->oom = true;
        return;
    }
    if (s->event_has_data)
        s->event[s->event_len++] = '\n';
    memcpy(s->event + s->event_len, val, vlen);
    s->event_len += vlen;
    s->event[s->event_len] = '\0';
    s->event_has_data = true;
}

int bench_stream_feed(struct bench_stream *s, const char *data, size_t len, double now)
{
    while (len) {
        const char *nl = memchr(data, '\n', len);
        size_t take = nl ? (size_t)(nl - data) : len;
        if (tdm_grow(&s->line, &s->line_cap, s->line_len + take + 1, 1, 256)) {
            s->oom = true;
            return TDM_ENOMEM;
        }
        memcpy(s->line + s->line_len, data, take);
        s->line_len += take;
        if (!nl)
            break;
        s->line[s->line_len] = '\0';
        on_line(s, s->line, s->line_len, now);
        s->line_len = 0;
        data = nl + 1;
        len -= take + 1;
    }
    return s->oom ? TDM_ENOMEM : TDM_OK;
}

void bench_stream_finish(struct bench_stream *s, double now)
{
    if (s->line_len) {
        on_line(s, s->line, s->line_len, now);
        s->line_len = 0;
    }
    if (s->event_has_data)
        on_event(s, now);
    s->event_len = 0;
    s->event_has_data = false;
}
