// SPDX-License-Identifier: Apache-2.0
// Fuzzes what a peer's nng frame reaches before any engine work: the first
// byte picks a message type of tandem.proto, the rest is unpacked by
// protobuf-c and, where Tandem converts it, handed to the codec's checks
// (sampling params, the push target and KV header of a PrefillRequest, a
// PrefillResult's KV header). Peers are untrusted input: every field must be
// range-checked, never trusted.
#include <stddef.h>
#include <stdint.h>

#include "fuzz_stack.h"
#include "pd_codec.h"

static const struct tdm_kv_config kv = {
    .num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .block_size = 16, .num_blocks = 64};

static int fuzz_one(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    char err[256];
    struct tdm_sampling_params sp;
    switch (data[0] % 9) {
    case 0: {
        Tandem__GenerateRequest *m = tandem__generate_request__unpack(NULL, n, p);
        if (m) {
            (void)tdm_pd_sampling_from_proto(m->sampling, &sp, err, sizeof err);
            tandem__generate_request__free_unpacked(m, NULL);
        }
        break;
    }
    case 1: {
        Tandem__PrefillRequest *m = tandem__prefill_request__unpack(NULL, n, p);
        if (m) {
            struct tdm_pd_push push;
            (void)tdm_pd_sampling_from_proto(m->sampling, &sp, err, sizeof err);
            (void)tdm_pd_push_from_proto(m, &kv, "m", 8, &push, err, sizeof err);
            tandem__prefill_request__free_unpacked(m, NULL);
        }
        break;
    }
    case 2: {
        Tandem__PrefillResult *m = tandem__prefill_result__unpack(NULL, n, p);
        if (m) {
            (void)tdm_pd_kv_header_check(m->kv_header.data, m->kv_header.len, &kv, "m", 40, err,
                                         sizeof err);
            tandem__prefill_result__free_unpacked(m, NULL);
        }
        break;
    }
#define UNPACK_ONLY(idx, desc)                                                                     \
    case idx: {                                                                                    \
        ProtobufCMessage *m = protobuf_c_message_unpack(&desc, NULL, n, p);                        \
        if (m)                                                                                     \
            protobuf_c_message_free_unpacked(m, NULL);                                             \
        break;                                                                                     \
    }
        UNPACK_ONLY(3, tandem__kv_data__descriptor)
        UNPACK_ONLY(4, tandem__token_chunk__descriptor)
        UNPACK_ONLY(5, tandem__cancel__descriptor)
        UNPACK_ONLY(6, tandem__load_query__descriptor)
        UNPACK_ONLY(7, tandem__load_report__descriptor)
    default: {
        (void)tdm_pd_kv_header_check(p, n, &kv, "m", 40, err, sizeof err);
        break;
    }
    }
    return 0;
}

TDM_FUZZ_ON_HTTP_STACK(fuzz_one)
