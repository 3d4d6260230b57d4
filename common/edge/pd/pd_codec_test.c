// SPDX-License-Identifier: Apache-2.0
// pd_codec tests: sampling params survive the proto round trip; oversized
// lists from a peer are refused; a KV header that does not fit the receiver's
// cache (geometry, model, length, bad bytes) is refused; a PrefillRequest's
// push target (block range, layers per frame, the sender's KV header) survives
// packing and is checked on receipt; a KvData layer's size matches the
// cache's export; and garbage bytes never unpack as a message. A LoadQuery's
// answer (tdm_pd_answer_load_query) is tested where workers serve it, through
// the P/D service (pd_service_test).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "pd_codec.h"

static void test_sampling_round_trip(void **state)
{
    (void)state;
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.7f;
    p.top_p = 0.9f;
    p.top_k = 40;
    p.min_p = 0.05f;
    p.repetition_penalty = 1.1f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = -0.5f;
    p.has_seed = true;
    p.seed = 0xfedcba9876543210ull;
    p.min_tokens = 3;
    p.ignore_eos = true;
    p.num_stop_token_ids = 2;
    p.stop_token_ids[0] = 7;
    p.stop_token_ids[1] = 9;
    p.num_logit_bias = 1;
    p.logit_bias[0].token = 5;
    p.logit_bias[0].bias = -100;
    p.logprobs = 4;
    static const char schema[] = "{\"type\":\"object\"}";
    p.constraint = TDM_CONSTRAINT_JSON_SCHEMA;
    p.constraint_text = schema;
    p.constraint_len = sizeof schema - 1;
    const int32_t allowed[3] = {4, 8, 15}, bad_ids[5] = {1, 2, 3, 2, 9}, bad_lens[3] = {1, 2, 2};
    p.allowed_token_ids = allowed;
    p.num_allowed_token_ids = 3;
    p.bad_word_ids = bad_ids;
    p.bad_word_lens = bad_lens;
    p.num_bad_words = 3;
    const int32_t lp_ids[2] = {11, 4};
    p.logprob_token_ids = lp_ids;
    p.num_logprob_token_ids = 2;
    struct tdm_pd_sampling_msg *sm = malloc(sizeof *sm);
    tdm_pd_sampling_to_proto(&p, sm);
    size_t n = protobuf_c_message_get_packed_size(&sm->msg.base);
    uint8_t *buf = malloc(n);
    protobuf_c_message_pack(&sm->msg.base, buf);
    Tandem__SamplingParams *m = tandem__sampling_params__unpack(NULL, n, buf);
    assert_non_null(m);
    struct tdm_sampling_params q;
    char err[256];
    assert_int_equal(tdm_pd_sampling_from_proto(m, &q, err, sizeof err), TDM_OK);
    assert_true(q.temperature == p.temperature && q.top_p == p.top_p && q.top_k == p.top_k);
    assert_true(q.min_p == p.min_p && q.repetition_penalty == p.repetition_penalty);
    assert_true(q.presence_penalty == p.presence_penalty);
    assert_true(q.frequency_penalty == p.frequency_penalty);
    assert_true(q.has_seed && q.seed == p.seed && q.min_tokens == 3 && q.ignore_eos);
    assert_int_equal(q.num_stop_token_ids, 2);
    assert_int_equal(q.stop_token_ids[1], 9);
    assert_int_equal(q.num_logit_bias, 1);
    assert_int_equal(q.logit_bias[0].token, 5);
    assert_true(q.logit_bias[0].bias == -100);
    assert_int_equal(q.logprobs, 4);
    assert_int_equal(q.constraint, TDM_CONSTRAINT_JSON_SCHEMA);
    assert_int_equal(q.constraint_len, sizeof schema - 1);
    assert_memory_equal(q.constraint_text, schema, sizeof schema - 1);
    assert_int_equal(q.num_allowed_token_ids, 3);
    assert_memory_equal(q.allowed_token_ids, allowed, sizeof allowed);
    assert_int_equal(q.num_bad_words, 3);
    assert_memory_equal(q.bad_word_lens, bad_lens, sizeof bad_lens);
    assert_memory_equal(q.bad_word_ids, bad_ids, sizeof bad_ids);
    assert_int_equal(q.num_logprob_token_ids, 2);
    assert_memory_equal(q.logprob_token_ids, lp_ids, sizeof lp_ids);
    // More logprob_token_ids than a request may ask are refused.
    size_t saved_n = m->n_logprob_token_ids;
    m->n_logprob_token_ids = TDM_MAX_LOGPROB_TOKEN_IDS + 1;
    assert_int_equal(tdm_pd_sampling_from_proto(m, &q, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "logprob ids"));
    m->n_logprob_token_ids = saved_n;

    // Bad words whose lengths do not add up to the ids sent are refused.
    m->bad_word_lens[2] = 3;
    assert_int_equal(tdm_pd_sampling_from_proto(m, &q, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "bad words"));
    m->bad_word_lens[2] = -1;
    assert_int_equal(tdm_pd_sampling_from_proto(m, &q, err, sizeof err), TDM_EPROTO);
    m->bad_word_lens[2] = 2;

    // json_object travels with no text; an unknown kind is refused.
    m->constraint_kind = TDM_CONSTRAINT_JSON_OBJECT;
    ProtobufCBinaryData saved_text = m->constraint;
    m->constraint = (ProtobufCBinaryData){0};
    assert_int_equal(tdm_pd_sampling_from_proto(m, &q, err, sizeof err), TDM_OK);
    assert_int_equal(q.constraint, TDM_CONSTRAINT_JSON_OBJECT);
    assert_non_null(q.constraint_text);
    assert_int_equal(q.constraint_len, 0);
    m->constraint_kind = 99;
    assert_int_equal(tdm_pd_sampling_from_proto(m, &q, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "constraint_kind"));
    m->constraint_kind = 0;
    assert_int_equal(tdm_pd_sampling_from_proto(m, &q, err, sizeof err), TDM_OK);
    assert_int_equal(q.constraint, TDM_CONSTRAINT_NONE);
    assert_null(q.constraint_text);
    m->constraint = saved_text;

    // A peer sending more stop ids than the engine holds is refused.
    int32_t many[TDM_MAX_STOP_IDS + 1] = {0};
    m->n_stop_token_ids = TDM_MAX_STOP_IDS + 1;
    int32_t *saved = m->stop_token_ids;
    m->stop_token_ids = many;
    assert_int_equal(tdm_pd_sampling_from_proto(m, &q, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "stop_token_ids"));
    m->stop_token_ids = saved;
    m->n_stop_token_ids = 0;
    assert_int_equal(tdm_pd_sampling_from_proto(NULL, &q, err, sizeof err), TDM_EPROTO);
    tandem__sampling_params__free_unpacked(m, NULL);
    free(buf);
    free(sm);
}

static void fill_header(struct tdm_kv_header *h)
{
    memset(h, 0, sizeof *h);
    h->magic = TDM_KV_MAGIC;
    h->version = 1;
    snprintf(h->model, sizeof h->model, "%s", "tiny");
    h->num_layers = 2;
    h->num_kv_heads = 2;
    h->head_dim = 16;
    h->block_size = 16;
    h->num_tokens = 40;
}

// The finish reason crosses the wire as the same number; a value from a newer
// or broken peer reads as an error finish.
static void test_finish_on_the_wire(void **state)
{
    (void)state;
    for (int r = TDM_FINISH_NONE; r < TDM_FINISH_COUNT; r++) {
        Tandem__TokenChunk m = TANDEM__TOKEN_CHUNK__INIT;
        m.finished = r != TDM_FINISH_NONE;
        m.finish = tdm_pd_finish_to_proto((enum tdm_finish)r);
        uint8_t buf[64];
        size_t n = tandem__token_chunk__pack(&m, buf);
        Tandem__TokenChunk *back = tandem__token_chunk__unpack(NULL, n, buf);
        assert_non_null(back);
        assert_int_equal(tdm_pd_finish_from_proto(back->finish), r);
        tandem__token_chunk__free_unpacked(back, NULL);
    }
    assert_int_equal(tdm_pd_finish_from_proto((Tandem__FinishReason)99), TDM_FINISH_ERROR);
    assert_int_equal(tdm_pd_finish_from_proto((Tandem__FinishReason)-1), TDM_FINISH_ERROR);
    assert_int_equal(tdm_pd_finish_to_proto((enum tdm_finish)7), TANDEM__FINISH_REASON__FINISH_ERROR);
}

static void test_kv_header_check(void **state)
{
    (void)state;
    struct tdm_kv_config kv = {
        .num_layers = 2, .num_kv_heads = 2, .head_dim = 16, .block_size = 16, .num_blocks = 64};
    struct tdm_kv_header h;
    char err[256];
    fill_header(&h);
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h, &kv, "tiny", 40, err, sizeof err),
                     TDM_OK);
    // Each mismatch is refused with a message naming it.
    fill_header(&h);
    h.head_dim = 64;
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h, &kv, "tiny", 40, err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "2/2/64/16/0 != ours 2/2/16/16/0"));
    fill_header(&h);
    h.block_size = 32;
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h, &kv, "tiny", 40, err, sizeof err),
                     TDM_EPROTO);
    fill_header(&h);
    h.dtype = 1; // bf16 payload, the receiver asked for f32
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h, &kv, "tiny", 40, err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "2/2/16/16/1 != ours 2/2/16/16/0"));
    kv.dtype = TDM_KV_BF16; // ... or asked for bf16
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h, &kv, "tiny", 40, err, sizeof err),
                     TDM_OK);
    kv.dtype = TDM_KV_F32;
    fill_header(&h);
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h, &kv, "other", 40, err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "model"));
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h, &kv, "tiny", 41, err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "40 tokens"));
    h.magic = 0;
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h, &kv, "tiny", 40, err, sizeof err),
                     TDM_EPROTO);
    assert_int_equal(tdm_pd_kv_header_check(&h, sizeof h - 1, &kv, "tiny", 40, err, sizeof err),
                     TDM_EPROTO);
    assert_int_equal(tdm_pd_kv_header_check(NULL, 0, &kv, "tiny", 40, err, sizeof err), TDM_EPROTO);
}

// The push target of a PrefillRequest survives packing; the prefill side
// refuses a header that does not fit its cache and a block range outside the
// prompt, and caps layers_per_frame.
static void test_push_target(void **state)
{
    (void)state;
    struct tdm_kv_config kv = {
        .num_layers = 2, .num_kv_heads = 2, .head_dim = 16, .block_size = 16, .num_blocks = 64};
    int32_t prompt[40] = {0};
    Tandem__PrefillRequest pr = TANDEM__PREFILL_REQUEST__INIT;
    pr.request_id = "r";
    pr.transfer_id = 7;
    pr.n_prompt = 40;
    pr.prompt = prompt;
    struct tdm_pd_push push = {.first_block = 1, .num_blocks = 2, .layers_per_frame = 8};
    struct tdm_kv_header h;
    tdm_pd_push_to_proto(&pr, &push, &kv, "tiny", &h);
    size_t n = tandem__prefill_request__get_packed_size(&pr);
    uint8_t *buf = malloc(n);
    tandem__prefill_request__pack(&pr, buf);
    Tandem__PrefillRequest *m = tandem__prefill_request__unpack(NULL, n, buf);
    assert_non_null(m);
    assert_int_equal(m->first_block, 1);
    assert_int_equal(m->num_blocks, 2);
    assert_int_equal(m->layers_per_frame, 8);
    assert_int_equal(m->kv_header.len, sizeof h);
    char err[256];
    struct tdm_pd_push got;
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "tiny", 4, &got, err, sizeof err), TDM_OK);
    assert_int_equal(got.first_block, 1);
    assert_int_equal(got.num_blocks, 2);
    assert_int_equal(got.layers_per_frame, 4); // capped by the receiver
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "tiny", 0, &got, err, sizeof err), TDM_OK);
    assert_int_equal(got.layers_per_frame, 8);

    // Another model or geometry is refused before anything is computed.
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "other", 4, &got, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "model"));
    struct tdm_kv_config kv2 = kv;
    kv2.head_dim = 64;
    assert_int_equal(tdm_pd_push_from_proto(m, &kv2, "tiny", 4, &got, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "2/2/16/16/0 != ours 2/2/64/16/0"));
    // The range must lie in the prompt's 3 blocks (40 tokens).
    m->first_block = 2;
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "tiny", 4, &got, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "blocks [2, 4) outside the prompt's 3 blocks"));
    m->first_block = -1;
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "tiny", 4, &got, err, sizeof err), TDM_EPROTO);
    m->first_block = 1;
    m->layers_per_frame = 0;
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "tiny", 4, &got, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "layers_per_frame"));
    m->num_blocks = 0; // nothing to send: the frame size does not matter
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "tiny", 4, &got, err, sizeof err), TDM_OK);
    assert_int_equal(got.num_blocks, 0);
    // A header for another prompt length, or none at all.
    m->n_prompt = 39;
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "tiny", 4, &got, err, sizeof err), TDM_EPROTO);
    m->n_prompt = 40;
    m->kv_header.len = 0;
    assert_int_equal(tdm_pd_push_from_proto(m, &kv, "tiny", 4, &got, err, sizeof err), TDM_EPROTO);
    tandem__prefill_request__free_unpacked(m, NULL);
    free(buf);

    // Mixed pair: a bf16 decode worker asks an f32 prefill worker (and the
    // other way round): accepted, and the push carries the asker's dtype, the
    // payload the prefill worker converts to. An unknown dtype is refused.
    for (int dd = 0; dd < 2; dd++) {
        struct tdm_kv_config dkv = kv, pkv = kv;
        dkv.dtype = dd ? TDM_KV_BF16 : TDM_KV_F32;
        pkv.dtype = dd ? TDM_KV_F32 : TDM_KV_BF16;
        push.num_blocks = 2;
        tdm_pd_push_to_proto(&pr, &push, &dkv, "tiny", &h);
        assert_int_equal(h.dtype, (int)dkv.dtype);
        assert_int_equal(tdm_pd_push_from_proto(&pr, &pkv, "tiny", 4, &got, err, sizeof err),
                         TDM_OK);
        assert_int_equal(got.dtype, dkv.dtype);
    }
    h.dtype = 7;
    assert_int_equal(tdm_pd_push_from_proto(&pr, &kv, "tiny", 4, &got, err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "dtype 7"));
}

// A KvData layer's size is what the cache's export writes for that range.
static void test_layer_bytes(void **state)
{
    (void)state;
    struct tdm_kv_config kv = {
        .num_layers = 3, .num_kv_heads = 2, .head_dim = 16, .block_size = 8, .num_blocks = 10};
    struct tdm_kv_cache *cache = NULL;
    char err[256];
    assert_int_equal(tdm_kv_new(&cache, &kv, err, sizeof err), TDM_OK);
    for (int nb = 0; nb <= kv.num_blocks; nb++)
        assert_int_equal(tdm_pd_layer_bytes(&kv, nb), tdm_kv_layer_bytes(cache, nb));
    assert_int_equal(tdm_pd_layer_bytes(&kv, 3), 2u * 3 * 2 * 8 * 16 * sizeof(float));
    tdm_kv_free(cache);
    // bf16: half the bytes, again what the cache writes.
    kv.dtype = TDM_KV_BF16;
    assert_int_equal(tdm_kv_new(&cache, &kv, err, sizeof err), TDM_OK);
    for (int nb = 0; nb <= kv.num_blocks; nb++)
        assert_int_equal(tdm_pd_layer_bytes(&kv, nb), tdm_kv_layer_bytes(cache, nb));
    assert_int_equal(tdm_pd_layer_bytes(&kv, 3), 2u * 3 * 2 * 8 * 16 * 2);
    tdm_kv_free(cache);
}

static void test_garbage_messages(void **state)
{
    (void)state;
    // Truncations of a valid GenerateRequest and random bytes: unpack returns NULL
    // or a message (protobuf-c checks lengths); never reads out of bounds (ASan).
    Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
    int32_t prompt[5] = {1, 2, 3, 4, 5};
    g.request_id = "abc";
    g.n_prompt = 5;
    g.prompt = prompt;
    g.max_tokens = 9;
    size_t n = tandem__generate_request__get_packed_size(&g);
    uint8_t *buf = malloc(n);
    tandem__generate_request__pack(&g, buf);
    Tandem__GenerateRequest *m = tandem__generate_request__unpack(NULL, n, buf);
    assert_non_null(m);
    assert_int_equal(m->n_prompt, 5);
    assert_int_equal(m->prompt[4], 5);
    assert_int_equal(m->max_tokens, 9);
    tandem__generate_request__free_unpacked(m, NULL);
    int nulls = 0;
    for (size_t k = 1; k < n; k++) {
        uint8_t *cut = malloc(k);
        memcpy(cut, buf, k);
        m = tandem__generate_request__unpack(NULL, k, cut);
        nulls += m == NULL;
        if (m)
            tandem__generate_request__free_unpacked(m, NULL);
        free(cut);
    }
    assert_true(nulls > 0);
    struct tdm_rng rng;
    tdm_rng_seed(&rng, 3);
    uint8_t junk[64];
    for (int it = 0; it < 2000; it++) {
        size_t len = (size_t)(tdm_rng_next(&rng) % sizeof junk);
        for (size_t i = 0; i < len; i++)
            junk[i] = (uint8_t)tdm_rng_next(&rng);
        Tandem__TokenChunk *t = tandem__token_chunk__unpack(NULL, len, junk);
        if (t)
            tandem__token_chunk__free_unpacked(t, NULL);
    }
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sampling_round_trip),
        cmocka_unit_test(test_kv_header_check),
        cmocka_unit_test(test_finish_on_the_wire),
        cmocka_unit_test(test_push_target),
        cmocka_unit_test(test_layer_bytes),
        cmocka_unit_test(test_garbage_messages),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
