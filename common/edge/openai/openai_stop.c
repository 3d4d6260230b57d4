// SPDX-License-Identifier: Apache-2.0
// openai stop strings: a streaming matcher over generated text. Text not yet
// sent ("pending") keeps only what could still be the start of a stop string,
// so a client never sees part of a stop string that later completes (vLLM holds
// back the same tail when stop strings are set). Invariant between calls:
// pending is a suffix of all text fed so far, shorter than the longest stop
// string (plus at most 3 bytes of an incomplete UTF-8 character), and no stop
// string ends inside it since the last feed that was allowed to match.
#include "openai.h"
#include "openai_impl.h"

#include <stdlib.h>
#include <string.h>

#include "core.h"

struct tdm_oai_stop {
    char **stops; // [n] NUL-terminated copies
    size_t *lens; // [n]
    size_t n;
    bool include;  // include_stop_str_in_output
    bool done;     // a stop string matched; nothing more is emitted
    char *pending; // text fed but not yet emitted
    size_t pending_len;
    size_t pending_cap;
    char *out; // what the last call hands back
    size_t out_cap;
};

int tdm_oai_stop_new(struct tdm_oai_stop **out, const char *const *stops, size_t n,
                     bool include_stop_str_in_output)
{
    *out = NULL;
    if (n > 0 && !stops)
        return TDM_EINVAL;
    for (size_t i = 0; i < n; i++)
        if (!stops[i] || !stops[i][0])
            return TDM_EINVAL;
    struct tdm_oai_stop *s = calloc(1, sizeof *s);
    if (!s)
        return TDM_ENOMEM;
    s->include = include_stop_str_in_output;
    if (n > 0) {
        s->stops = calloc(n, sizeof *s->stops);
        s->lens = calloc(n, sizeof *s->lens);
        if (!s->stops || !s->lens)
            goto fail;
        for (size_t i = 0; i < n; i++) {
            s->stops[i] = strdup(stops[i]);
            if (!s->stops[i])
                goto fail;
            s->lens[i] = strlen(stops[i]);
            s->n = i + 1;
        }
    }
    *out = s;
    return TDM_OK;
fail:
    tdm_oai_stop_free(s);
    return TDM_ENOMEM;
}

void tdm_oai_stop_free(struct tdm_oai_stop *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n; i++)
        free(s->stops[i]);
    free(s->stops);
    free(s->lens);
    free(s->pending);
    free(s->out);
    free(s);
}

bool tdm_oai_stop_done(const struct tdm_oai_stop *s)
{
    return s->done;
}

// Length of the longest suffix of text[0..len) that is a proper prefix of some
// stop string: the text that must wait for more input.
static size_t holdback(const struct tdm_oai_stop *s, const char *text, size_t len)
{
    size_t best = 0;
    for (size_t i = 0; i < s->n; i++) {
        size_t max = s->lens[i] - 1 < len ? s->lens[i] - 1 : len;
        for (size_t k = max; k > best; k--) {
            if (memcmp(text + len - k, s->stops[i], k) == 0) {
                best = k;
                break;
            }
        }
    }
    return best;
}

// Bytes at the end of text[0..len) that start a UTF-8 character not yet complete.
static size_t incomplete_tail(const char *text, size_t len)
{
    const unsigned char *p = (const unsigned char *)text;
    for (size_t back = 1; back <= 3 && back <= len; back++) {
        unsigned c = p[len - back];
        if ((c & 0xC0) == 0x80)
            continue; // continuation byte: look further back for the lead
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > back ? back : 0;
    }
    return 0;
}

// Moves pending[0..n) into out and drops it from pending.
static void emit_prefix(struct tdm_oai_stop *s, size_t n, const char **emit, size_t *emit_len)
{
    memcpy(s->out, s->pending, n);
    memmove(s->pending, s->pending + n, s->pending_len - n);
    s->pending_len -= n;
    *emit = s->out;
    *emit_len = n;
}

int tdm_oai_stop_feed(struct tdm_oai_stop *s, const char *delta, size_t len, const char **emit,
                      size_t *emit_len)
{
    return tdm_oai_stop_feed_ex(s, delta, len, true, emit, emit_len);
}

int tdm_oai_stop_feed_ex(struct tdm_oai_stop *s, const char *delta, size_t len, bool may_match,
                         const char **emit, size_t *emit_len)
{
    *emit = s->out ? s->out : "";
    *emit_len = 0;
    if (s->done)
        return -1;
    if (tdm_grow(&s->pending, &s->pending_cap, s->pending_len + len + 1, 1, 64) != TDM_OK ||
        tdm_grow(&s->out, &s->out_cap, s->pending_len + len + 1, 1, 64) != TDM_OK)
        return -2;
    size_t old = s->pending_len;
    memcpy(s->pending + old, delta, len);
    s->pending_len += len;

    // A match must end inside the new bytes (pending had none before). Take the
    // one ending first; at equal ends the longer (earlier start) one.
    size_t best_end = (size_t)-1, best_start = 0;
    int best = -1;
    for (size_t i = 0; may_match && i < s->n; i++) {
        size_t l = s->lens[i];
        if (l > s->pending_len)
            continue;
        size_t first_start = old + 1 > l ? old + 1 - l : 0;
        for (size_t st = first_start; st + l <= s->pending_len; st++) {
            if (st + l > best_end)
                break;
            if (memcmp(s->pending + st, s->stops[i], l) == 0) {
                if (st + l < best_end || st < best_start) {
                    best_end = st + l;
                    best_start = st;
                    best = (int)i;
                }
                break;
            }
        }
    }
    if (best >= 0) {
        s->done = true;
        emit_prefix(s, s->include ? best_end : best_start, emit, emit_len);
        s->pending_len = 0;
        return best;
    }
    size_t keep = holdback(s, s->pending, s->pending_len);
    size_t ready = s->pending_len - keep;
    ready -= incomplete_tail(s->pending, ready);
    emit_prefix(s, ready, emit, emit_len);
    return -1;
}

void tdm_oai_stop_flush(struct tdm_oai_stop *s, const char **emit, size_t *emit_len)
{
    *emit = s->out ? s->out : "";
    *emit_len = 0;
    if (s->done || s->pending_len == 0)
        return;
    // out always has room for pending (reserved in the feed that grew it).
    emit_prefix(s, s->pending_len, emit, emit_len);
}
