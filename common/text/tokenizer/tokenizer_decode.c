// SPDX-License-Identifier: Apache-2.0
// tokenizer_decode: ids -> text, and the streaming detokenizer.
// As HF's ByteLevel decoder: every token contributes the bytes its characters
// stand for (precomputed per id at load; added tokens whose content has a char
// outside the byte table contribute their own UTF-8), special tokens are left
// out when asked, and the byte string is made valid UTF-8 by replacing each
// maximal ill-formed subpart with U+FFFD (Rust's from_utf8_lossy).
// The detokenizer holds back only a trailing proper prefix of a valid
// character; everything before it decodes the same whatever follows, which
// is why its deltas concatenate to the full decode.
#include "tokenizer_impl.h"

#include "core.h"

#include <stdlib.h>
#include <string.h>

// Appends the lossy UTF-8 of s[0..n) to out (room for 3 * n bytes). When
// hold_tail is set, a trailing truncated character is not converted: its
// length is returned in *held (the caller keeps those bytes).
static size_t lossy_convert(const char *s, size_t n, char *out, bool hold_tail, size_t *held)
{
    size_t i = 0, o = 0, adv;
    *held = 0;
    const uint8_t *u = (const uint8_t *)s;
    while (i < n) {
        enum tok_utf8 r = tok_utf8_scan(u + i, n - i, &adv);
        if (r == TOK_UTF8_VALID) {
            memcpy(out + o, s + i, adv);
            o += adv;
        } else if (r == TOK_UTF8_TRUNCATED && hold_tail) {
            *held = n - i;
            break;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
        i += adv;
    }
    return o;
}

static bool id_known(const struct tdm_tokenizer *tok, int32_t id)
{
    return id >= 0 && id < tok->vocab_size && tok->pieces[id] != NULL;
}

// The bytes id contributes after the first token (no decoder: HF joins with spaces).
static void token_bytes(const struct tdm_tokenizer *tok, int32_t id, const char **p, size_t *len)
{
    if (tok->has_decoder) {
        *p = tok->dec_bytes[id];
        *len = tok->dec_lens[id];
    } else {
        *p = tok->pieces[id];
        *len = tok->piece_lens[id];
    }
}

const char *tdm_tok_token_bytes(const struct tdm_tokenizer *tok, int32_t id, size_t *len)
{
    if (!id_known(tok, id))
        return NULL;
    const char *p;
    token_bytes(tok, id, &p, len);
    return p;
}

int tdm_tok_decode(const struct tdm_tokenizer *tok, const int32_t *ids, size_t n,
                   bool skip_special_tokens, char **text, size_t *len)
{
    *text = NULL;
    *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (!id_known(tok, ids[i]))
            return TDM_EINVAL;
        total += tok->has_decoder ? tok->dec_lens[ids[i]] : tok->piece_lens[ids[i]] + 1;
    }
    char *raw = malloc(total + 1);
    char *out = malloc(total * 3 + 1);
    if (!raw || !out) {
        free(raw);
        free(out);
        return TDM_ENOMEM;
    }
    size_t r = 0;
    bool first = true;
    for (size_t i = 0; i < n; i++) {
        if (skip_special_tokens && (tok->id_flags[ids[i]] & TOK_ID_SPECIAL))
            continue;
        const char *p;
        size_t l;
        token_bytes(tok, ids[i], &p, &l);
        if (!tok->has_decoder && !first)
            raw[r++] = ' ';
        memcpy(raw + r, p, l);
        r += l;
        first = false;
    }
    size_t held;
    size_t o = lossy_convert(raw, r, out, false, &held);
    out[o] = 0;
    free(raw);
    *text = out;
    *len = o;
    return TDM_OK;
}

// ---- streaming --------------------------------------------------------------------------------

struct tdm_detok {
    const struct tdm_tokenizer *tok;
    bool skip_special_tokens;
    bool first;   // no token emitted yet (for the space join without a decoder)
    char held[4]; // a proper prefix of a character, at most 3 bytes
    size_t n_held;
    char *work; // held bytes + the new token's bytes [work_cap]
    size_t work_cap;
    char *out; // the delta [out_cap]
    size_t out_cap;
};

int tdm_detok_new(struct tdm_detok **out, const struct tdm_tokenizer *tok, bool skip_special_tokens)
{
    *out = NULL;
    struct tdm_detok *d = calloc(1, sizeof *d);
    if (!d)
        return TDM_ENOMEM;
    d->tok = tok;
    d->skip_special_tokens = skip_special_tokens;
    d->first = true;
    *out = d;
    return TDM_OK;
}

void tdm_detok_free(struct tdm_detok *d)
{
    if (!d)
        return;
    free(d->work);
    free(d->out);
    free(d);
}

int tdm_detok_push(struct tdm_detok *d, int32_t id, const char **delta, size_t *delta_len)
{
    const struct tdm_tokenizer *tok = d->tok;
    *delta = "";
    *delta_len = 0;
    if (!id_known(tok, id))
        return TDM_EINVAL;
    if (d->skip_special_tokens && (tok->id_flags[id] & TOK_ID_SPECIAL))
        return TDM_OK;
    const char *p;
    size_t l;
    token_bytes(tok, id, &p, &l);
    size_t sep = (!tok->has_decoder && !d->first) ? 1 : 0;
    d->first = false;
    size_t n = d->n_held + sep + l;
    int rc;
    if ((rc = tdm_grow(&d->work, &d->work_cap, n + 1, 1, 64)) ||
        (rc = tdm_grow(&d->out, &d->out_cap, n * 3 + 1, 1, 64)))
        return rc;
    memcpy(d->work, d->held, d->n_held);
    if (sep)
        d->work[d->n_held] = ' ';
    memcpy(d->work + d->n_held + sep, p, l);
    size_t held;
    size_t o = lossy_convert(d->work, n, d->out, true, &held);
    memcpy(d->held, d->work + n - held, held);
    d->n_held = held;
    d->out[o] = 0;
    *delta = d->out;
    *delta_len = o;
    return TDM_OK;
}

int tdm_detok_flush(struct tdm_detok *d, const char **delta, size_t *delta_len)
{
    *delta = "";
    *delta_len = 0;
    if (d->n_held == 0)
        return TDM_OK;
    int rc = tdm_grow(&d->out, &d->out_cap, d->n_held * 3 + 1, 1, 64);
    if (rc)
        return rc;
    size_t held;
    size_t o = lossy_convert(d->held, d->n_held, d->out, false, &held);
    d->n_held = 0;
    d->out[o] = 0;
    *delta = d->out;
    *delta_len = o;
    return TDM_OK;
}
