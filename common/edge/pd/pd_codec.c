// SPDX-License-Identifier: Apache-2.0
// pd_codec: C <-> protobuf-c conversions of the P/D messages (see pd_codec.h):
// sampling params, the KV header check, the push target.
#include "pd_codec.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

// The wire's numbers are enum tdm_finish's, so a cast converts; these checks
// keep the two from drifting apart.
_Static_assert(TANDEM__FINISH_REASON__FINISH_NONE == (int)TDM_FINISH_NONE &&
                   TANDEM__FINISH_REASON__FINISH_STOP == (int)TDM_FINISH_STOP &&
                   TANDEM__FINISH_REASON__FINISH_LENGTH == (int)TDM_FINISH_LENGTH &&
                   TANDEM__FINISH_REASON__FINISH_ABORT == (int)TDM_FINISH_ABORT &&
                   TANDEM__FINISH_REASON__FINISH_ERROR == (int)TDM_FINISH_ERROR,
               "tandem.proto FinishReason must match enum tdm_finish");

Tandem__FinishReason tdm_pd_finish_to_proto(enum tdm_finish reason)
{
    return (unsigned)reason < TDM_FINISH_COUNT ? (Tandem__FinishReason)reason
                                               : TANDEM__FINISH_REASON__FINISH_ERROR;
}

enum tdm_finish tdm_pd_finish_from_proto(Tandem__FinishReason reason)
{
    return (unsigned)reason < TDM_FINISH_COUNT ? (enum tdm_finish)reason : TDM_FINISH_ERROR;
}

void tdm_pd_sampling_to_proto(const struct tdm_sampling_params *p, struct tdm_pd_sampling_msg *out)
{
    Tandem__SamplingParams init = TANDEM__SAMPLING_PARAMS__INIT;
    out->msg = init;
    Tandem__SamplingParams *m = &out->msg;
    m->temperature = p->temperature;
    m->top_p = p->top_p;
    m->top_k = p->top_k;
    m->min_p = p->min_p;
    m->repetition_penalty = p->repetition_penalty;
    m->presence_penalty = p->presence_penalty;
    m->frequency_penalty = p->frequency_penalty;
    m->has_seed = p->has_seed;
    m->seed = p->seed;
    m->min_tokens = p->min_tokens;
    m->ignore_eos = p->ignore_eos;
    int ns = p->num_stop_token_ids < 0 ? 0 : p->num_stop_token_ids;
    if (ns > TDM_MAX_STOP_IDS)
        ns = TDM_MAX_STOP_IDS;
    memcpy(out->stop_ids, p->stop_token_ids, (size_t)ns * sizeof *out->stop_ids);
    m->n_stop_token_ids = (size_t)ns;
    m->stop_token_ids = out->stop_ids;
    int nb = p->num_logit_bias < 0 ? 0 : p->num_logit_bias;
    if (nb > TDM_MAX_LOGIT_BIAS)
        nb = TDM_MAX_LOGIT_BIAS;
    Tandem__LogitBias binit = TANDEM__LOGIT_BIAS__INIT;
    for (int i = 0; i < nb; i++) {
        out->bias[i] = binit;
        out->bias[i].token = p->logit_bias[i].token;
        out->bias[i].bias = p->logit_bias[i].bias;
        out->bias_ptr[i] = &out->bias[i];
    }
    m->n_logit_bias = (size_t)nb;
    m->logit_bias = out->bias_ptr;
    m->logprobs = p->logprobs;
    m->constraint_kind = (int32_t)p->constraint;
    if (p->constraint != TDM_CONSTRAINT_NONE && p->constraint_text) {
        m->constraint.data = (uint8_t *)(uintptr_t)p->constraint_text; // borrowed, packed only
        m->constraint.len = p->constraint_len;
    }
    // Borrowed, packed only.
    if (p->num_allowed_token_ids > 0) {
        m->n_allowed_token_ids = (size_t)p->num_allowed_token_ids;
        m->allowed_token_ids = (int32_t *)(uintptr_t)p->allowed_token_ids;
    }
    if (p->num_logprob_token_ids > 0) {
        m->n_logprob_token_ids = (size_t)p->num_logprob_token_ids;
        m->logprob_token_ids = (int32_t *)(uintptr_t)p->logprob_token_ids;
    }
    if (p->num_bad_words > 0) {
        size_t total = 0;
        for (int i = 0; i < p->num_bad_words; i++)
            total += (size_t)p->bad_word_lens[i];
        m->n_bad_word_ids = total;
        m->bad_word_ids = (int32_t *)(uintptr_t)p->bad_word_ids;
        m->n_bad_word_lens = (size_t)p->num_bad_words;
        m->bad_word_lens = (int32_t *)(uintptr_t)p->bad_word_lens;
    }
}

int tdm_pd_sampling_from_proto(const Tandem__SamplingParams *m, struct tdm_sampling_params *out,
                               char *err, size_t errlen)
{
    tdm_sampling_params_default(out);
    if (m == NULL)
        return tdm_seterr(err, errlen, TDM_EPROTO, "sampling params missing");
    if (m->n_stop_token_ids > TDM_MAX_STOP_IDS)
        return tdm_seterr(err, errlen, TDM_EPROTO, "stop_token_ids: %zu > %d entries",
                          m->n_stop_token_ids, TDM_MAX_STOP_IDS);
    if (m->n_logit_bias > TDM_MAX_LOGIT_BIAS)
        return tdm_seterr(err, errlen, TDM_EPROTO, "logit_bias: %zu > %d entries", m->n_logit_bias,
                          TDM_MAX_LOGIT_BIAS);
    out->temperature = m->temperature;
    out->top_p = m->top_p;
    out->top_k = m->top_k;
    out->min_p = m->min_p;
    out->repetition_penalty = m->repetition_penalty;
    out->presence_penalty = m->presence_penalty;
    out->frequency_penalty = m->frequency_penalty;
    out->has_seed = m->has_seed;
    out->seed = m->seed;
    out->min_tokens = m->min_tokens;
    out->ignore_eos = m->ignore_eos;
    for (size_t i = 0; i < m->n_stop_token_ids; i++)
        out->stop_token_ids[i] = m->stop_token_ids[i];
    out->num_stop_token_ids = (int)m->n_stop_token_ids;
    for (size_t i = 0; i < m->n_logit_bias; i++) {
        if (m->logit_bias[i] == NULL)
            return tdm_seterr(err, errlen, TDM_EPROTO, "logit_bias[%zu] missing", i);
        out->logit_bias[i].token = m->logit_bias[i]->token;
        out->logit_bias[i].bias = m->logit_bias[i]->bias;
    }
    out->num_logit_bias = (int)m->n_logit_bias;
    out->logprobs = m->logprobs;
    if (m->constraint_kind < 0 || m->constraint_kind >= TDM_CONSTRAINT_COUNT)
        return tdm_seterr(err, errlen, TDM_EPROTO, "constraint_kind %d unknown",
                          (int)m->constraint_kind);
    out->constraint = (enum tdm_constraint_kind)m->constraint_kind;
    if (out->constraint != TDM_CONSTRAINT_NONE) {
        // Borrowed from m; an empty text is "" (json_object), never NULL.
        out->constraint_text = m->constraint.data ? (const char *)m->constraint.data : "";
        out->constraint_len = m->constraint.data ? m->constraint.len : 0;
    }
    // Borrowed from m; the engine checks the ids and the words' lengths.
    if (m->n_allowed_token_ids > INT32_MAX || m->n_bad_word_lens > TDM_MAX_BAD_WORDS ||
        m->n_bad_word_ids > TDM_MAX_BAD_WORD_TOKENS ||
        m->n_logprob_token_ids > TDM_MAX_LOGPROB_TOKEN_IDS)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "allowed_token_ids, bad words or logprob_token_ids: %zu ids, %zu words "
                          "of %zu tokens, %zu logprob ids",
                          m->n_allowed_token_ids, m->n_bad_word_lens, m->n_bad_word_ids,
                          m->n_logprob_token_ids);
    size_t total = 0;
    for (size_t i = 0; i < m->n_bad_word_lens; i++)
        total +=
            m->bad_word_lens[i] > 0 ? (size_t)m->bad_word_lens[i] : TDM_MAX_BAD_WORD_TOKENS + 1;
    if (total != m->n_bad_word_ids)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "bad words: lengths sum to %zu tokens, %zu ids sent", total,
                          m->n_bad_word_ids);
    out->allowed_token_ids = m->allowed_token_ids;
    out->num_allowed_token_ids = (int)m->n_allowed_token_ids;
    out->bad_word_ids = m->bad_word_ids;
    out->bad_word_lens = m->bad_word_lens;
    out->num_bad_words = (int)m->n_bad_word_lens;
    out->logprob_token_ids = m->logprob_token_ids;
    out->num_logprob_token_ids = (int)m->n_logprob_token_ids;
    return TDM_OK;
}

int tdm_pd_kv_header_check(const void *bytes, size_t len, const struct tdm_kv_config *k,
                           const char *model, int num_tokens, char *err, size_t errlen)
{
    struct tdm_kv_header h;
    if (bytes == NULL || len != sizeof h)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: %zu bytes, expected %zu", len,
                          sizeof h);
    memcpy(&h, bytes, sizeof h);
    if (h.magic != TDM_KV_MAGIC || h.version != 1)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: bad magic 0x%08x / version %u",
                          h.magic, h.version);
    if (h.num_layers != k->num_layers || h.num_kv_heads != k->num_kv_heads ||
        h.head_dim != k->head_dim || h.block_size != k->block_size || h.dtype != (int)k->dtype)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "kv header: layers/heads/head_dim/block_size/dtype %d/%d/%d/%d/%d != "
                          "ours %d/%d/%d/%d/%d",
                          h.num_layers, h.num_kv_heads, h.head_dim, h.block_size, h.dtype,
                          k->num_layers, k->num_kv_heads, k->head_dim, k->block_size,
                          (int)k->dtype);
    char name[sizeof h.model + 1];
    memcpy(name, h.model, sizeof h.model);
    name[sizeof h.model] = '\0';
    if (strncmp(name, model, sizeof h.model - 1) != 0)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: model \"%s\" != \"%s\"", name,
                          model);
    if (h.num_tokens != num_tokens)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: %d tokens, prompt has %d",
                          h.num_tokens, num_tokens);
    return TDM_OK;
}

size_t tdm_pd_layer_bytes(const struct tdm_kv_config *kv, int num_blocks)
{
    return 2u * (size_t)num_blocks * (size_t)kv->num_kv_heads * (size_t)kv->block_size *
           (size_t)kv->head_dim * tdm_kv_dtype_size(kv->dtype);
}

void tdm_pd_push_to_proto(Tandem__PrefillRequest *m, const struct tdm_pd_push *push,
                          const struct tdm_kv_config *kv, const char *model,
                          struct tdm_kv_header *h)
{
    memset(h, 0, sizeof *h);
    h->magic = TDM_KV_MAGIC;
    h->version = 1;
    snprintf(h->model, sizeof h->model, "%s", model ? model : "");
    h->num_layers = kv->num_layers;
    h->num_kv_heads = kv->num_kv_heads;
    h->head_dim = kv->head_dim;
    h->block_size = kv->block_size;
    h->dtype = (int32_t)kv->dtype;
    h->num_tokens = (int32_t)m->n_prompt;
    h->first_block = push->first_block;
    h->num_blocks = push->num_blocks;
    m->first_block = push->first_block;
    m->num_blocks = push->num_blocks;
    m->layers_per_frame = push->layers_per_frame;
    m->kv_header.data = (uint8_t *)h;
    m->kv_header.len = sizeof *h;
}

int tdm_pd_push_from_proto(const Tandem__PrefillRequest *m, const struct tdm_kv_config *kv,
                           const char *model, int max_layers_per_frame, struct tdm_pd_push *out,
                           char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (m->n_prompt == 0 || m->n_prompt > (size_t)INT32_MAX / 2 || kv->block_size <= 0)
        return tdm_seterr(err, errlen, TDM_EPROTO, "push: prompt of %zu tokens", m->n_prompt);
    // The decode worker's dtype is the payload it wants: any known one (the
    // prefill worker converts on export).
    struct tdm_kv_config want = *kv;
    struct tdm_kv_header peer;
    if (m->kv_header.data != NULL && m->kv_header.len == sizeof peer) {
        memcpy(&peer, m->kv_header.data, sizeof peer);
        if (tdm_kv_dtype_size(peer.dtype) == 0)
            return tdm_seterr(err, errlen, TDM_EPROTO,
                              "kv header: dtype %d is not f32 (0) or bf16 (1)", peer.dtype);
        want.dtype = (enum tdm_kv_dtype)peer.dtype;
    }
    int rc = tdm_pd_kv_header_check(m->kv_header.data, m->kv_header.len, &want, model,
                                    (int)m->n_prompt, err, errlen);
    if (rc != TDM_OK)
        return rc;
    int64_t prompt_blocks = ((int64_t)m->n_prompt + kv->block_size - 1) / kv->block_size;
    if (m->first_block < 0 || m->num_blocks < 0 ||
        (int64_t)m->first_block + m->num_blocks > prompt_blocks)
        return tdm_seterr(
            err, errlen, TDM_EPROTO, "push: blocks [%d, %lld) outside the prompt's %lld blocks",
            m->first_block, (long long)m->first_block + m->num_blocks, (long long)prompt_blocks);
    if (m->num_blocks > 0 && m->layers_per_frame < 1)
        return tdm_seterr(err, errlen, TDM_EPROTO, "push: layers_per_frame %d < 1",
                          m->layers_per_frame);
    out->first_block = m->first_block;
    out->num_blocks = m->num_blocks;
    out->dtype = want.dtype;
    out->layers_per_frame = m->layers_per_frame < 1 ? 1 : m->layers_per_frame;
    if (max_layers_per_frame >= 1 && out->layers_per_frame > max_layers_per_frame)
        out->layers_per_frame = max_layers_per_frame;
    return TDM_OK;
}
