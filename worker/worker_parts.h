// SPDX-License-Identifier: Apache-2.0
// decode_parts: a narrow window into a loaded decode server for the P/D roles
// (the decode worker's KV receiver, decode/pd_receiver.c, and the prefill
// worker, prefill/prefill.c), which run on the same engine, model and metrics
// registry as the HTTP path instead of loading their own.
#ifndef TDM_WORKER_PARTS_H
#define TDM_WORKER_PARTS_H

#include <stdbool.h>
#include <stdint.h>

struct tdm_worker;
struct tdm_engine;
struct tdm_model;
struct tdm_metrics_registry;

// Borrowed pointers, valid until tdm_worker_free.
struct tdm_worker_parts {
    struct tdm_engine *engine;
    struct tdm_model *model;
    struct tdm_metrics_registry *reg; // for the role's own tandem:* metrics
    const char *served_name;
    const int32_t *eos_ids; // [num_eos] config.json's and generation_config.json's
    int num_eos;
    int max_model_len;
    int block_size;
    int vocab_size;
};

// Fills *out after tdm_worker_load succeeded; TDM_EBUSY before.
int tdm_worker_parts(struct tdm_worker *s, struct tdm_worker_parts *out);
// True while the server accepts new requests (loaded, not draining).
bool tdm_worker_ready(const struct tdm_worker *s);

#endif
