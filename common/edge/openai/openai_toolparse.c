// SPDX-License-Identifier: Apache-2.0
// openai tool-call parsers: generated text in, content and tool calls out, for
// the output formats of openai_tools.h (vLLM's hermes and llama3_json parsers,
// and the JSON a forced `required` or named call produces). One incremental
// parser serves both the stream and the non-stream body, so the two agree.
//
// How it works: every byte fed is kept (`all`); `pos` is how far the text is
// decided. Content is emitted up to `pos`, except a tail that could still be
// the start of a marker (`<tool_call>`, `<|python_tag|>`) or an incomplete
// UTF-8 character. A call is re-scanned from its start at each feed (calls are
// short; this keeps the scanner a plain recursive-descent JSON validator): the
// header (id, name) goes out once the "name" string is complete, and argument
// bytes go out as soon as they are known to lie inside the arguments value,
// exactly as the model wrote them (so the streamed fragments concatenate to the
// non-stream `arguments`). A call that does not parse before anything of it
// was sent goes out as content; one that breaks after its header went out is
// closed as sent (the stream cannot take it back), and the non-stream
// extraction then falls back to the whole text as content, as vLLM does.
#include "openai.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core.h"
#include "openai_impl.h"

#define HERMES_OPEN "<tool_call>"
#define HERMES_CLOSE "</tool_call>"
#define LLAMA_TAG "<|python_tag|>"
#define JSON_MAX_DEPTH 128 // nesting a tool call's JSON may reach

enum pstate {
    P_TEXT,       // hermes: content, looking for <tool_call>
    P_CALL,       // hermes: inside <tool_call> ... </tool_call>
    P_LLAMA_HEAD, // llama3_json: before the first non-space byte is known
    P_SEQ_OBJ,    // llama3_json / required: a call object is expected or running
    P_SEQ_SEP,    // llama3_json: after a call (";" or the end); required: "," or "]"
    P_REQ_HEAD,   // required: before "["
    P_REQ_END,    // required: after "]" (only whitespace may follow)
    P_NAMED,      // named: every byte is an argument byte
    P_PLAIN,      // the rest is content
    P_SWALLOW,    // the rest is dropped (a broken call of a sequence)
};

struct tdm_oai_toolparse {
    enum tdm_oai_tool_format fmt;
    char *fn_name;   // NAMED: the function
    bool parallel;   // false: calls after the first are dropped
    struct tdm_strbuf all; // every byte fed
    size_t pos;      // bytes of all decided
    enum pstate st;
    bool final; // finish was called

    // the running call (P_CALL, P_SEQ_OBJ)
    size_t call_start; // offset in all where its JSON starts
    bool header_sent;  // its header went out
    int index;         // its index once the header went out
    char call_id[48];  // its id once the header went out
    size_t args_sent;  // argument bytes sent
    bool broken;       // malformed after the header went out: swallow to its end
    bool dropping;     // a call past the first without parallel_tool_calls
    char *name;        // heap once known
    size_t seg_start;  // llama3_json: where the text after the last complete call starts

    // hermes: whitespace after a call is held; it is content only if content follows
    bool after_call;
    struct tdm_strbuf ws_hold;

    int n_headers; // calls whose header went out
    bool had_bad;  // a call failed to parse (non-stream: all text is content)

    // complete calls (non-stream extraction)
    struct tdm_oai_tool_call *calls;
    size_t n_calls, cap_calls;

    // output since the last clear
    struct tdm_strbuf content;
    struct tdm_oai_tool_delta *deltas;
    size_t n_deltas, cap_deltas;
};

// ---- JSON scanning ------------------------------------------------------------------------
// Each scanner reads s[*i..n): J_OK with *i past the value, J_MORE when the input
// ends while still a valid prefix, J_BAD when it cannot be JSON.
enum { J_OK = 0, J_MORE, J_BAD };

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static void skip_ws(const char *s, size_t n, size_t *i)
{
    while (*i < n && is_ws(s[*i]))
        (*i)++;
}

static bool is_hex(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

static int j_string(const char *s, size_t n, size_t *i)
{
    size_t k = *i + 1; // past the opening quote
    while (k < n) {
        unsigned char c = (unsigned char)s[k];
        if (c == '"') {
            *i = k + 1;
            return J_OK;
        }
        if (c < 0x20)
            return J_BAD;
        if (c != '\\') {
            k++;
            continue;
        }
        if (k + 1 >= n)
            return J_MORE;
        char e = s[k + 1];
        if (e == 'u') {
            for (size_t h = 0; h < 4; h++) {
                if (k + 2 + h >= n)
                    return J_MORE;
                if (!is_hex(s[k + 2 + h]))
                    return J_BAD;
            }
            k += 6;
        } else if (strchr("\"\\/bfnrt", e) != NULL && e != '\0') {
            k += 2;
        } else {
            return J_BAD;
        }
    }
    return J_MORE;
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? ; a number running to the end
// of the input is J_MORE (more digits may follow).
static int j_number(const char *s, size_t n, size_t *i)
{
    size_t k = *i;
    if (s[k] == '-')
        k++;
    if (k >= n)
        return J_MORE;
    if (s[k] == '0') {
        k++;
    } else if (is_digit(s[k])) {
        while (k < n && is_digit(s[k]))
            k++;
    } else {
        return J_BAD;
    }
    if (k < n && s[k] == '.') {
        k++;
        if (k >= n)
            return J_MORE;
        if (!is_digit(s[k]))
            return J_BAD;
        while (k < n && is_digit(s[k]))
            k++;
    }
    if (k < n && (s[k] == 'e' || s[k] == 'E')) {
        k++;
        if (k < n && (s[k] == '+' || s[k] == '-'))
            k++;
        if (k >= n)
            return J_MORE;
        if (!is_digit(s[k]))
            return J_BAD;
        while (k < n && is_digit(s[k]))
            k++;
    }
    if (k >= n)
        return J_MORE;
    *i = k;
    return J_OK;
}

static int j_literal(const char *s, size_t n, size_t *i, const char *word)
{
    size_t wl = strlen(word);
    for (size_t k = 0; k < wl; k++) {
        if (*i + k >= n)
            return J_MORE;
        if (s[*i + k] != word[k])
            return J_BAD;
    }
    *i += wl;
    return J_OK;
}

static int j_value(const char *s, size_t n, size_t *i, int depth);

static int j_container(const char *s, size_t n, size_t *i, int depth)
{
    bool object = s[*i] == '{';
    char close = object ? '}' : ']';
    if (depth >= JSON_MAX_DEPTH)
        return J_BAD;
    (*i)++;
    skip_ws(s, n, i);
    if (*i >= n)
        return J_MORE;
    if (s[*i] == close) {
        (*i)++;
        return J_OK;
    }
    for (;;) {
        int r;
        if (object) {
            if (s[*i] != '"')
                return J_BAD;
            if ((r = j_string(s, n, i)) != J_OK)
                return r;
            skip_ws(s, n, i);
            if (*i >= n)
                return J_MORE;
            if (s[*i] != ':')
                return J_BAD;
            (*i)++;
            skip_ws(s, n, i);
            if (*i >= n)
                return J_MORE;
        }
        if ((r = j_value(s, n, i, depth + 1)) != J_OK)
            return r;
        skip_ws(s, n, i);
        if (*i >= n)
            return J_MORE;
        if (s[*i] == close) {
            (*i)++;
            return J_OK;
        }
        if (s[*i] != ',')
            return J_BAD;
        (*i)++;
        skip_ws(s, n, i);
        if (*i >= n)
            return J_MORE;
    }
}

static int j_value(const char *s, size_t n, size_t *i, int depth)
{
    if (*i >= n)
        return J_MORE;
    switch (s[*i]) {
    case '{':
    case '[':
        return j_container(s, n, i, depth);
    case '"':
        return j_string(s, n, i);
    case 't':
        return j_literal(s, n, i, "true");
    case 'f':
        return j_literal(s, n, i, "false");
    case 'n':
        return j_literal(s, n, i, "null");
    default:
        if (s[*i] == '-' || is_digit(s[*i]))
            return j_number(s, n, i);
        return J_BAD;
    }
}

// What scanning one call object {"name": "...", "<args key>": value, ...} found.
struct call_scan {
    int status;     // J_OK (object closed at obj_end), J_MORE, J_BAD
    size_t obj_end; // J_OK: offset just past the closing brace
    bool has_name;  // the name string is complete at [name_s, name_e)
    size_t name_s, name_e;
    bool has_args; // the arguments value starts at args_s
    size_t args_s;
    bool args_done; // ... and ends at args_e
    size_t args_e;
    size_t args_safe; // !args_done: bytes [args_s, args_safe) surely belong to the value
};

// Which keys carry the arguments: hermes "arguments"; llama3_json "arguments" or
// "parameters" (not both); required "parameters".
static bool is_args_key(enum tdm_oai_tool_format fmt, const char *k, size_t kl)
{
    bool arguments = kl == 11 && memcmp(k, "\"arguments\"", 11) == 0;
    bool parameters = kl == 12 && memcmp(k, "\"parameters\"", 12) == 0;
    switch (fmt) {
    case TDM_OAI_TOOL_FORMAT_HERMES:
        return arguments;
    case TDM_OAI_TOOL_FORMAT_LLAMA3_JSON:
        return arguments || parameters;
    case TDM_OAI_TOOL_FORMAT_REQUIRED:
        return parameters;
    default:
        return false;
    }
}

static void scan_call(enum tdm_oai_tool_format fmt, const char *s, size_t n, struct call_scan *cs)
{
    memset(cs, 0, sizeof *cs);
    size_t i = 0;
    int r;
    skip_ws(s, n, &i);
    cs->status = J_MORE;
    if (i >= n)
        return;
    if (s[i] != '{')
        goto bad;
    i++;
    skip_ws(s, n, &i);
    if (i >= n)
        return;
    if (s[i] == '}') {
        cs->status = J_OK;
        cs->obj_end = i + 1;
        return;
    }
    for (;;) {
        if (s[i] != '"')
            goto bad;
        size_t ks = i;
        if ((r = j_string(s, n, &i)) != J_OK)
            goto stop;
        size_t kl = i - ks;
        bool name_key = kl == 6 && memcmp(s + ks, "\"name\"", 6) == 0;
        bool args_key = is_args_key(fmt, s + ks, kl);
        if ((name_key && cs->has_name) || (args_key && cs->has_args))
            goto bad; // a repeated key: which one was meant is unclear
        skip_ws(s, n, &i);
        if (i >= n)
            return;
        if (s[i] != ':')
            goto bad;
        i++;
        skip_ws(s, n, &i);
        if (i >= n)
            return;
        size_t vs = i;
        if (name_key) {
            if (s[i] != '"')
                goto bad;
            if ((r = j_string(s, n, &i)) != J_OK)
                goto stop;
            cs->has_name = true;
            cs->name_s = vs;
            cs->name_e = i;
        } else if (args_key) {
            cs->has_args = true;
            cs->args_s = vs;
            cs->args_safe = vs;
            if ((r = j_value(s, n, &i, 1)) != J_OK) {
                // Inside an object or array every byte so far is the value's;
                // a scalar is sent whole once complete.
                if (r == J_MORE && (s[vs] == '{' || s[vs] == '['))
                    cs->args_safe = n;
                goto stop;
            }
            cs->args_done = true;
            cs->args_e = i;
        } else if ((r = j_value(s, n, &i, 1)) != J_OK) {
            goto stop;
        }
        skip_ws(s, n, &i);
        if (i >= n)
            return;
        if (s[i] == '}') {
            cs->status = J_OK;
            cs->obj_end = i + 1;
            return;
        }
        if (s[i] != ',')
            goto bad;
        i++;
        skip_ws(s, n, &i);
        if (i >= n)
            return;
    }
stop:
    cs->status = r;
    return;
bad:
    cs->status = J_BAD;
}

// ---- output ---------------------------------------------------------------------------------

// Bytes of s[0..n) up to the last complete UTF-8 character (a character split
// by the feed is held until its rest arrives).
static size_t utf8_whole(const char *s, size_t n)
{
    size_t k = n;
    // Walk back over at most 3 continuation bytes to the lead byte.
    size_t back = 0;
    while (k > 0 && back < 4 && ((unsigned char)s[k - 1] & 0xC0) == 0x80) {
        k--;
        back++;
    }
    if (k == 0)
        return n;
    unsigned char lead = (unsigned char)s[k - 1];
    size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    if (need > 1 && back + 1 < need)
        return k - 1; // the lead byte and its continuation bytes wait
    return n;
}

// Length of the longest suffix of s[0..n) that is a proper prefix of marker.
static size_t marker_tail(const char *s, size_t n, const char *marker)
{
    size_t ml = strlen(marker);
    for (size_t l = ml - 1; l > 0; l--)
        if (l <= n && memcmp(s + n - l, marker, l) == 0)
            return l;
    return 0;
}

static const char *find_bytes(const char *s, size_t n, const char *what)
{
    size_t wl = strlen(what);
    for (size_t i = 0; i + wl <= n; i++)
        if (s[i] == what[0] && memcmp(s + i, what, wl) == 0)
            return s + i;
    return NULL;
}

static int add_content(struct tdm_oai_toolparse *p, const char *s, size_t n)
{
    return tdm_strbuf_add(&p->content, s, n);
}

// Content of the hermes text mode: after a call, whitespace waits for content.
static int text_content(struct tdm_oai_toolparse *p, const char *s, size_t n)
{
    size_t i = 0;
    if (p->after_call) {
        while (i < n && is_ws(s[i]))
            i++;
        if (tdm_strbuf_add(&p->ws_hold, s, i) != TDM_OK)
            return TDM_ENOMEM;
        if (i == n)
            return TDM_OK;
        p->after_call = false;
        if (add_content(p, p->ws_hold.p, p->ws_hold.len) != TDM_OK)
            return TDM_ENOMEM;
        p->ws_hold.len = 0;
    }
    return add_content(p, s + i, n - i);
}

// The pending delta for call `index` (the last entry when it is that call's).
static struct tdm_oai_tool_delta *delta_for(struct tdm_oai_toolparse *p, int index)
{
    if (p->n_deltas > 0 && p->deltas[p->n_deltas - 1].index == index)
        return &p->deltas[p->n_deltas - 1];
    if (tdm_grow(&p->deltas, &p->cap_deltas, p->n_deltas + 1, sizeof *p->deltas, 4) != TDM_OK)
        return NULL;
    struct tdm_oai_tool_delta *d = &p->deltas[p->n_deltas];
    memset(d, 0, sizeof *d);
    d->index = index;
    d->args = calloc(1, 1);
    if (d->args == NULL)
        return NULL;
    p->n_deltas++;
    return d;
}

static int send_header(struct tdm_oai_toolparse *p, const char *name)
{
    p->index = p->n_headers++;
    p->header_sent = true;
    struct tdm_oai_tool_delta *d = delta_for(p, p->index);
    if (d == NULL)
        return TDM_ENOMEM;
    d->header = true;
    char hex[TDM_OAI_ID_HEX + 1];
    tdm_oai_random_hex(hex);
    snprintf(p->call_id, sizeof p->call_id, "chatcmpl-tool-%s", hex);
    memcpy(d->id, p->call_id, sizeof d->id);
    d->name = strdup(name);
    return d->name ? TDM_OK : TDM_ENOMEM;
}

static int send_args(struct tdm_oai_toolparse *p, const char *s, size_t n)
{
    if (n == 0)
        return TDM_OK;
    struct tdm_oai_tool_delta *d = delta_for(p, p->index);
    if (d == NULL)
        return TDM_ENOMEM;
    char *q = realloc(d->args, d->args_len + n + 1);
    if (q == NULL)
        return TDM_ENOMEM;
    memcpy(q + d->args_len, s, n);
    d->args_len += n;
    q[d->args_len] = '\0';
    d->args = q;
    p->args_sent += n;
    return TDM_OK;
}

// A complete call, with the id its header went out with (or a new one).
static int record_call(struct tdm_oai_toolparse *p, const char *name, const char *args,
                       size_t args_len)
{
    if (tdm_grow(&p->calls, &p->cap_calls, p->n_calls + 1, sizeof *p->calls, 4) != TDM_OK)
        return TDM_ENOMEM;
    struct tdm_oai_tool_call *c = &p->calls[p->n_calls];
    memset(c, 0, sizeof *c);
    if (p->header_sent) {
        memcpy(c->id, p->call_id, sizeof c->id);
    } else {
        char hex[TDM_OAI_ID_HEX + 1];
        tdm_oai_random_hex(hex);
        snprintf(c->id, sizeof c->id, "chatcmpl-tool-%s", hex);
    }
    c->name = strdup(name);
    c->arguments = malloc(args_len + 1);
    if (c->name == NULL || c->arguments == NULL) {
        free(c->name);
        free(c->arguments);
        return TDM_ENOMEM;
    }
    memcpy(c->arguments, args, args_len);
    c->arguments[args_len] = '\0';
    p->n_calls++;
    return TDM_OK;
}

static void reset_call(struct tdm_oai_toolparse *p, size_t start)
{
    p->call_start = start;
    p->header_sent = false;
    p->args_sent = 0;
    p->broken = false;
    free(p->name);
    p->name = NULL;
    p->dropping = !p->parallel && (p->n_headers > 0 || p->n_calls > 0);
}

// ---- one call --------------------------------------------------------------------------------
enum { C_MORE = 0, C_DONE, C_BAD };

// Scans the running call over s[0..n) (its JSON; n excludes a held marker tail).
// complete: nothing more will come for this call (its end marker was seen, or
// the output ended). tail_ws: the call must be the object and whitespace only
// (hermes); else the object ends the call and *end says where. Sends what is
// certain; on C_DONE records the call.
static int run_call(struct tdm_oai_toolparse *p, const char *s, size_t n, bool complete,
                    bool tail_ws, size_t *end)
{
    struct call_scan cs;
    if (p->broken)
        return complete ? C_BAD : C_MORE;
    scan_call(p->fmt, s, n, &cs);
    if (cs.status == J_BAD)
        return C_BAD;
    if (cs.status == J_OK && tail_ws) {
        size_t k = cs.obj_end;
        skip_ws(s, n, &k);
        if (k < n)
            return C_BAD;
    }
    if (cs.status == J_MORE && complete)
        return C_BAD;
    if (cs.has_name && p->name == NULL) {
        cJSON *nm = cJSON_ParseWithLength(s + cs.name_s, cs.name_e - cs.name_s);
        if (nm == NULL)
            return C_BAD;
        p->name = cJSON_IsString(nm) ? strdup(nm->valuestring) : NULL;
        cJSON_Delete(nm);
        if (p->name == NULL)
            return C_BAD;
    }
    if (!p->dropping && p->name != NULL) {
        if (!p->header_sent && send_header(p, p->name) != TDM_OK)
            return -1;
        if (cs.has_args) {
            size_t upto = cs.args_done
                              ? cs.args_e
                              : cs.args_s + utf8_whole(s + cs.args_s, cs.args_safe - cs.args_s);
            size_t from = cs.args_s + p->args_sent;
            if (upto > from && send_args(p, s + from, upto - from) != TDM_OK)
                return -1;
        }
    }
    // A marked call ends at its end marker (or the end of the output).
    if (cs.status != J_OK || (tail_ws && !complete))
        return C_MORE;
    if (!cs.has_name || !cs.has_args)
        return C_BAD;
    *end = cs.obj_end;
    if (!p->dropping && record_call(p, p->name, s + cs.args_s, cs.args_e - cs.args_s) != TDM_OK)
        return -1;
    return C_DONE;
}

// A call failed to parse: the non-stream extraction falls back to content (a
// dropped call past the first without parallel_tool_calls does not count).
static void call_failed(struct tdm_oai_toolparse *p)
{
    if (!p->dropping)
        p->had_bad = true;
}

// ---- the formats --------------------------------------------------------------------------------

static int step_hermes(struct tdm_oai_toolparse *p)
{
    const size_t ol = strlen(HERMES_OPEN), cl = strlen(HERMES_CLOSE);
    for (;;) {
        const char *s = p->all.p + p->pos;
        size_t n = p->all.len - p->pos;
        if (p->st == P_TEXT) {
            const char *m = find_bytes(s, n, HERMES_OPEN);
            if (m != NULL) {
                if (text_content(p, s, (size_t)(m - s)) != TDM_OK)
                    return TDM_ENOMEM;
                p->ws_hold.len = 0; // whitespace between two calls is dropped
                p->after_call = false;
                p->pos += (size_t)(m - s) + ol;
                p->st = P_CALL;
                reset_call(p, p->pos);
                continue;
            }
            size_t e = n;
            if (!p->final) {
                e -= marker_tail(s, n, HERMES_OPEN);
                e = utf8_whole(s, e);
            }
            if (text_content(p, s, e) != TDM_OK)
                return TDM_ENOMEM;
            p->pos += e;
            return TDM_OK;
        }
        // P_CALL: the JSON runs to </tool_call> (the first one, as vLLM's regex).
        const char *m = find_bytes(s, n, HERMES_CLOSE);
        size_t body = m ? (size_t)(m - s) : n;
        if (m == NULL && !p->final)
            body -= marker_tail(s, n, HERMES_CLOSE);
        size_t end = 0;
        int r = run_call(p, s, body, m != NULL || p->final, true, &end);
        if (r < 0)
            return TDM_ENOMEM;
        if (r == C_MORE)
            return TDM_OK;
        if (r == C_BAD) {
            call_failed(p);
            if (!p->header_sent && !p->dropping) {
                // Nothing of it went out: the marker and the text are content.
                if (add_content(p, HERMES_OPEN, ol) != TDM_OK)
                    return TDM_ENOMEM;
                p->st = P_TEXT;
                continue; // its text is read again as content
            }
            if (m == NULL && !p->final) {
                p->broken = true; // swallow to its end marker
                return TDM_OK;
            }
        }
        // The call ended (parsed, or broken after its header went out).
        p->pos += m ? body + cl : n;
        p->st = P_TEXT;
        p->after_call = true;
        p->ws_hold.len = 0;
        if (m == NULL)
            return TDM_OK;
    }
}

// Each sequence state below either moves the parser on and asks step_seq to run the next state
// (SEQ_AGAIN), or returns what step_seq returns: TDM_OK (wait for more output) or TDM_ENOMEM.
// s, n: the output not yet consumed (from p->pos).
enum { SEQ_AGAIN = -1 };

// P_LLAMA_HEAD, P_REQ_HEAD: the calls open with <|python_tag|> or "{" (llama3_json) or "["
// (required); anything else makes all of the output content.
static int seq_head(struct tdm_oai_toolparse *p, const char *s, size_t n, bool llama)
{
    size_t i = 0;
    skip_ws(s, n, &i);
    if (i == n) {
        if (!p->final)
            return TDM_OK;
        p->st = P_PLAIN; // only whitespace: it is the content
        return SEQ_AGAIN;
    }
    if (llama) {
        size_t tl = strlen(LLAMA_TAG);
        size_t avail = n - i < tl ? n - i : tl;
        if (memcmp(s + i, LLAMA_TAG, avail) == 0) {
            if (avail < tl) {
                if (!p->final)
                    return TDM_OK; // may still become the tag
                p->st = P_PLAIN;
                return SEQ_AGAIN;
            }
            p->pos += i + tl;
            p->st = P_SEQ_OBJ;
            reset_call(p, p->pos);
            return SEQ_AGAIN;
        }
    }
    if (s[i] == (llama ? '{' : '[')) {
        p->pos += llama ? i : i + 1;
        p->st = P_SEQ_OBJ;
        reset_call(p, p->pos);
        return SEQ_AGAIN;
    }
    if (!llama)
        call_failed(p);
    p->st = P_PLAIN; // not a tool call: all of it is content
    return SEQ_AGAIN;
}

// P_SEQ_OBJ: one call's object.
static int seq_obj(struct tdm_oai_toolparse *p, const char *s, size_t n, bool llama)
{
    size_t i = 0, end = 0;
    if (!llama) {
        // required: "]" may close the array here only when it is empty
        skip_ws(s, n, &i);
        if (i < n && s[i] == ']' && p->n_calls == 0 && p->n_headers == 0) {
            p->pos += i + 1;
            p->st = P_REQ_END;
            return SEQ_AGAIN;
        }
    } else if (p->final) {
        skip_ws(s, n, &i);
        if (i == n) { // "...;" then the end
            p->pos += n;
            return TDM_OK;
        }
    }
    int r = run_call(p, s, n, p->final, false, &end);
    if (r < 0)
        return TDM_ENOMEM;
    if (r == C_MORE)
        return TDM_OK;
    if (r == C_BAD) {
        call_failed(p);
        if (!p->header_sent && !p->dropping) {
            // Unsent: the text from the last complete call on is content.
            p->pos = p->seg_start;
            p->st = P_PLAIN;
        } else {
            p->st = P_SWALLOW;
        }
        return SEQ_AGAIN;
    }
    p->pos += end;
    p->seg_start = p->pos;
    p->st = P_SEQ_SEP;
    return SEQ_AGAIN;
}

// P_SEQ_SEP: after a call, ";" (llama3_json) or "," (required) starts the next one, and "]"
// ends a required array.
static int seq_sep(struct tdm_oai_toolparse *p, const char *s, size_t n, bool llama)
{
    size_t i = 0;
    skip_ws(s, n, &i);
    if (i == n)
        return TDM_OK; // trailing whitespace is dropped at the end
    if (s[i] == (llama ? ';' : ',')) {
        p->pos += i + 1;
        p->st = P_SEQ_OBJ;
        reset_call(p, p->pos);
        return SEQ_AGAIN;
    }
    if (!llama && s[i] == ']') {
        p->pos += i + 1;
        p->st = P_REQ_END;
        return SEQ_AGAIN;
    }
    if (!llama) {
        call_failed(p);
        p->st = P_SWALLOW;
        return SEQ_AGAIN;
    }
    // Text after the calls is content (vLLM drops it).
    p->pos += i;
    p->st = P_PLAIN;
    return SEQ_AGAIN;
}

// P_REQ_END: after a required array's "]" only whitespace may follow.
static int seq_req_end(struct tdm_oai_toolparse *p, const char *s, size_t n)
{
    size_t i = 0;
    skip_ws(s, n, &i);
    if (i < n) {
        call_failed(p);
        p->st = P_SWALLOW;
        return SEQ_AGAIN;
    }
    p->pos += n;
    return TDM_OK;
}

// llama3_json and required share the sequence states.
static int step_seq(struct tdm_oai_toolparse *p)
{
    bool llama = p->fmt == TDM_OAI_TOOL_FORMAT_LLAMA3_JSON;
    for (;;) {
        const char *s = p->all.p + p->pos;
        size_t n = p->all.len - p->pos;
        int rc;
        switch (p->st) {
        case P_LLAMA_HEAD:
        case P_REQ_HEAD:
            rc = seq_head(p, s, n, llama);
            break;
        case P_SEQ_OBJ:
            rc = seq_obj(p, s, n, llama);
            break;
        case P_SEQ_SEP:
            rc = seq_sep(p, s, n, llama);
            break;
        case P_REQ_END:
            rc = seq_req_end(p, s, n);
            break;
        case P_SWALLOW:
            p->pos += n;
            return TDM_OK;
        default: { // P_PLAIN
            size_t e = p->final ? n : utf8_whole(s, n);
            if (add_content(p, s, e) != TDM_OK)
                return TDM_ENOMEM;
            p->pos += e;
            return TDM_OK;
        }
        }
        if (rc != SEQ_AGAIN)
            return rc;
    }
}

static int step_named(struct tdm_oai_toolparse *p)
{
    const char *s = p->all.p + p->pos;
    size_t n = p->all.len - p->pos;
    if (!p->header_sent && send_header(p, p->fn_name) != TDM_OK)
        return TDM_ENOMEM;
    size_t e = p->final ? n : utf8_whole(s, n);
    if (send_args(p, s, e) != TDM_OK)
        return TDM_ENOMEM;
    p->pos += e;
    if (p->final)
        return record_call(p, p->fn_name, p->all.p ? p->all.p : "", p->all.len);
    return TDM_OK;
}

static int step(struct tdm_oai_toolparse *p)
{
    switch (p->fmt) {
    case TDM_OAI_TOOL_FORMAT_HERMES:
        return step_hermes(p);
    case TDM_OAI_TOOL_FORMAT_NAMED:
        return step_named(p);
    default:
        return step_seq(p);
    }
}

// ---- public ---------------------------------------------------------------------------------

int tdm_oai_toolparse_new(struct tdm_oai_toolparse **out, enum tdm_oai_tool_format format,
                          const char *name, bool parallel)
{
    *out = NULL;
    if (format == TDM_OAI_TOOL_FORMAT_NONE || (format == TDM_OAI_TOOL_FORMAT_NAMED && !name))
        return TDM_EINVAL;
    struct tdm_oai_toolparse *p = calloc(1, sizeof *p);
    if (p == NULL)
        return TDM_ENOMEM;
    p->fmt = format;
    p->parallel = parallel;
    if (name && (p->fn_name = strdup(name)) == NULL) {
        free(p);
        return TDM_ENOMEM;
    }
    switch (format) {
    case TDM_OAI_TOOL_FORMAT_HERMES:
        p->st = P_TEXT;
        break;
    case TDM_OAI_TOOL_FORMAT_LLAMA3_JSON:
        p->st = P_LLAMA_HEAD;
        break;
    case TDM_OAI_TOOL_FORMAT_REQUIRED:
        p->st = P_REQ_HEAD;
        break;
    default:
        p->st = P_NAMED;
        break;
    }
    *out = p;
    return TDM_OK;
}

void tdm_oai_toolparse_clear_content(struct tdm_oai_toolparse *p)
{
    p->content.len = 0;
    if (p->content.p)
        p->content.p[0] = '\0';
}

void tdm_oai_toolparse_clear(struct tdm_oai_toolparse *p)
{
    tdm_oai_toolparse_clear_content(p);
    for (size_t i = 0; i < p->n_deltas; i++) {
        free(p->deltas[i].name);
        free(p->deltas[i].args);
    }
    p->n_deltas = 0;
}

void tdm_oai_toolparse_free(struct tdm_oai_toolparse *p)
{
    if (p == NULL)
        return;
    tdm_oai_toolparse_clear(p);
    free(p->deltas);
    free(p->content.p);
    free(p->all.p);
    free(p->ws_hold.p);
    free(p->name);
    free(p->fn_name);
    tdm_oai_tool_calls_free(p->calls, p->n_calls);
    free(p);
}

int tdm_oai_toolparse_feed(struct tdm_oai_toolparse *p, const char *text, size_t len)
{
    if (p->final || len == 0)
        return TDM_OK;
    if (tdm_strbuf_add(&p->all, text, len) != TDM_OK)
        return TDM_ENOMEM;
    return step(p);
}

int tdm_oai_toolparse_finish(struct tdm_oai_toolparse *p)
{
    if (p->final)
        return TDM_OK;
    p->final = true;
    if (p->all.p == NULL && tdm_strbuf_add(&p->all, "", 0) != TDM_OK)
        return TDM_ENOMEM;
    return step(p);
}

const char *tdm_oai_toolparse_content(const struct tdm_oai_toolparse *p, size_t *len)
{
    *len = p->content.len;
    return p->content.p ? p->content.p : "";
}

const struct tdm_oai_tool_delta *tdm_oai_toolparse_deltas(const struct tdm_oai_toolparse *p,
                                                          size_t *n)
{
    *n = p->n_deltas;
    return p->deltas;
}

int tdm_oai_toolparse_calls(const struct tdm_oai_toolparse *p)
{
    return p->n_headers;
}

void tdm_oai_tool_calls_free(struct tdm_oai_tool_call *calls, size_t n)
{
    for (size_t i = 0; calls && i < n; i++) {
        free(calls[i].name);
        free(calls[i].arguments);
    }
    free(calls);
}

int tdm_oai_tools_extract(enum tdm_oai_tool_format format, const char *name, bool parallel,
                          const char *text, size_t len, struct tdm_oai_tool_call **calls,
                          size_t *n_calls, char **content)
{
    *calls = NULL;
    *n_calls = 0;
    *content = NULL;
    struct tdm_oai_toolparse *p = NULL;
    int rc = tdm_oai_toolparse_new(&p, format, name, parallel);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_oai_toolparse_feed(p, text, len);
    if (rc == TDM_OK)
        rc = tdm_oai_toolparse_finish(p);
    if (rc != TDM_OK)
        goto out;
    if (p->had_bad || p->n_calls == 0) {
        // No call, or one that does not parse: the text is the content (vLLM).
        *content = malloc(len + 1);
        if (*content == NULL) {
            rc = TDM_ENOMEM;
            goto out;
        }
        memcpy(*content, text, len);
        (*content)[len] = '\0';
        goto out;
    }
    if (p->content.len > 0) {
        *content = strdup(p->content.p);
        if (*content == NULL) {
            rc = TDM_ENOMEM;
            goto out;
        }
    }
    *calls = p->calls;
    *n_calls = p->n_calls;
    p->calls = NULL;
    p->n_calls = 0;
out:
    tdm_oai_toolparse_free(p);
    return rc;
}
