// SPDX-License-Identifier: Apache-2.0
// worker_impl: the worker's state, shared by its files (worker.c: lifecycle
// and routes; worker_generate.c: the OpenAI generation path). Not for roles:
// they see worker.h only.
#ifndef TDM_WORKER_IMPL_H
#define TDM_WORKER_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "engine.h"
#include "http.h"
#include "metrics.h"
#include "openai.h"
#include "text.h"
#include "worker.h"

#define WORKER_MOD "worker" // log module

enum server_state { STATE_LOADING = 0, STATE_READY, STATE_DRAINING };

struct tdm_worker {
    struct tdm_worker_config cfg;
    struct tdm_http_server *http;
    int port;
    _Atomic int state;
    _Atomic int inflight; // API handlers running (drain waits for 0)
    pthread_mutex_t mu;   // guards nothing but the drain wait's condvar
    pthread_cond_t idle_cv;
    _Atomic(tdm_worker_health_fn) health_fn; // a role's /health details (NULL = none)
    void *_Atomic health_arg;

    // after load
    struct tdm_model *model;
    struct tdm_text text; // tokenizer, chat template, generation config, served name
    struct tdm_oai_model_info info;
    int32_t eos_ids[2 * TDM_MAX_EOS]; // config.json's and generation_config.json's
    int num_eos;
    struct tdm_metrics_registry *reg;
    struct tdm_metrics_vllm metrics;
    struct tdm_metrics_gauge *prompt_tokens_waiting; // tandem:num_prompt_tokens_waiting
    struct tdm_metrics_counter *steps_ahead;         // tandem:engine_steps_ahead_total
    struct tdm_metrics_counter *thread_seconds;      // tandem:engine_thread_seconds_total{phase}
    struct tdm_metrics_counter *list_rows;           // tandem:engine_list_rows_total
    struct tdm_metrics_spec spec_metrics; // vllm:spec_decode_* (registered when speculating)
    struct tdm_engine *engine;
    struct tdm_grammar_vocab *gvocab; // structured outputs: the tokenizer's token trie
                                      // (owned; NULL: constrained requests refused)
    struct tdm_tracer *tracer; // NULL = tracing off (--otlp-traces-endpoint)
    char model_path[TDM_WORKER_STR]; // the folder --model names (a Hub id resolved to the cache)
    // Where the model computes, for the ready line: "cpu", "cuda:0", or "cpu
    // (--device auto: why not a GPU)".
    char device_desc[1280];
    int max_model_len;
    int num_blocks;
    int64_t created;
};

// POST /v1/completions (kind TDM_OAI_COMPLETION) and /v1/chat/completions on a
// ready worker: answers c (stream or body) and returns when every engine
// request it submitted is released.
void worker_handle_generate(struct tdm_worker *s, struct tdm_http_conn *c, enum tdm_oai_kind kind);

#endif
