// SPDX-License-Identifier: Apache-2.0
// pd_codec: glue between Tandem's C types and the protobuf-c messages of
// tandem.proto, shared by the router, the prefill worker and the decode
// worker's P/D receiver: sampling params in both directions (with range checks
// on the way in, since a peer's bytes are untrusted input), the KV header and
// push target of a PrefillRequest, and sending a packed message as one
// transport frame (pd_send.c). This is the wire edge: the one header in
// common/ whose API uses protobuf-c types, included only by the .c files that
// build or read messages (router/router.c, decode/, prefill/, common/edge/pd/);
// pd.h, the module's API for everything else, has none.
#ifndef TDM_PD_CODEC_H
#define TDM_PD_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "core.h"
#include "kv_cache.h"
#include "sampling.h"
#include "tandem.pb-c.h"
#include "transport.h"

// Storage for a SamplingParams message built from C params (the message points
// into it; keep it alive while the message is packed).
struct tdm_pd_sampling_msg {
    Tandem__SamplingParams msg;
    Tandem__LogitBias bias[TDM_MAX_LOGIT_BIAS];
    Tandem__LogitBias *bias_ptr[TDM_MAX_LOGIT_BIAS];
    int32_t stop_ids[TDM_MAX_STOP_IDS];
};
void tdm_pd_sampling_to_proto(const struct tdm_sampling_params *p, struct tdm_pd_sampling_msg *out);
// TDM_EPROTO (err says which field) when m is NULL or a list is too long;
// value ranges are the engine's to check (tdm_engine_submit validates).
// Constraint text, allowed_token_ids and bad words: to_proto's message and
// from_proto's params BORROW them (from p, from m): keep the source alive
// while the message / params are in use.
int tdm_pd_sampling_from_proto(const Tandem__SamplingParams *m, struct tdm_sampling_params *out,
                               char *err, size_t errlen);

// A finish reason on the wire (TokenChunk.finish): the same numbers as enum
// tdm_finish. From the wire, a value this build does not know is an error
// finish (a peer's bytes are untrusted).
Tandem__FinishReason tdm_pd_finish_to_proto(enum tdm_finish reason);
enum tdm_finish tdm_pd_finish_from_proto(Tandem__FinishReason reason);

// Checks a PrefillResult's kv_header bytes (struct tdm_kv_header) against the
// receiver's cache geometry (kv: layers, KV heads, head_dim, block size, and
// the payload dtype the receiver asked for, kv->dtype), its served model name
// and the prompt length. TDM_EPROTO with err naming the mismatch ("kv header:
// layers/heads/head_dim/block_size/dtype 2/2/64/16/0 != ours 24/2/64/16/1").
int tdm_pd_kv_header_check(const void *bytes, size_t len, const struct tdm_kv_config *kv,
                           const char *model, int num_tokens, char *err, size_t errlen);

// Bytes of one layer of a KvData payload for num_blocks blocks of a cache with
// geometry kv: K then V, each [num_blocks][num_kv_heads][block_size][head_dim]
// of kv->dtype (tdm_kv_export_layer's layout). A frame of n layers carries n
// times this.
size_t tdm_pd_layer_bytes(const struct tdm_kv_config *kv, int num_blocks);

// The push target of a PrefillRequest: which of the prompt's blocks the decode
// worker lacks (it reserved them before asking) and how to frame them.
struct tdm_pd_push {
    int first_block;      // first block of the prompt to send
    int num_blocks;       // blocks to send; 0 = no KV, the result only
    int layers_per_frame; // layers in one KvData frame, >= 1
    enum tdm_kv_dtype dtype; // payload element type: the decode worker's pool's (its
                             // kv header's), which the prefill worker converts to
};
// Fills m's push fields and kv_header from the sender's (decode worker's) cache
// geometry kv (its dtype: the payload it wants), served model and prompt length. h is caller storage m points
// into: keep it alive while m is packed.
void tdm_pd_push_to_proto(Tandem__PrefillRequest *m, const struct tdm_pd_push *push,
                          const struct tdm_kv_config *kv, const char *model,
                          struct tdm_kv_header *h);
// The receiver's (prefill worker's) side: checks m's kv_header against its own
// cache geometry kv and served model and m's prompt length
// (tdm_pd_kv_header_check; any known dtype is accepted and becomes out->dtype,
// whatever kv->dtype is: the KV is converted on export), and the block range
// against the prompt's ceil(n_prompt / block_size) blocks; caps
// layers_per_frame at max_layers_per_frame. TDM_EPROTO with err naming the field.
int tdm_pd_push_from_proto(const Tandem__PrefillRequest *m, const struct tdm_kv_config *kv,
                           const char *model, int max_layers_per_frame, struct tdm_pd_push *out,
                           char *err, size_t errlen);

// Packs m and sends it as a frame of the given type (payload may be NULL).
// Errors as tdm_net_send, TDM_ENOMEM.
int tdm_pd_send(struct tdm_net_outbox *ob, const char *url, int type, const ProtobufCMessage *m,
                const void *payload, size_t payload_len, double timeout_s, char *err,
                size_t errlen);
// Same with the payload written in place by fill (see tdm_net_send_fill).
int tdm_pd_send_fill(struct tdm_net_outbox *ob, const char *url, int type,
                     const ProtobufCMessage *m, size_t payload_len, tdm_net_fill_fn fill, void *arg,
                     double timeout_s, char *err, size_t errlen);

#endif
