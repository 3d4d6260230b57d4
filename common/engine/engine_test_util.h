// SPDX-License-Identifier: Apache-2.0
// engine_test_util: what the engine's tests share (engine_test,
// engine_grammar_test): the test model loaded on the emulated CUDA module, for
// the cases that draw tokens on a device, and a request's submission. Tests
// only; include after cmocka.h.
#ifndef TDM_ENGINE_TEST_UTIL_H
#define TDM_ENGINE_TEST_UTIL_H

#include <stdio.h>

#include "core.h"
#include "engine.h"
#include "model.h"

// A request of `kind` for prompt[0 .. n) with sp and max_tokens (0: up to
// the context), submitted to e; fails the test when it is refused.
static inline struct tdm_engine_request *tdm_test_submit(struct tdm_engine *e,
                                                         const int32_t *prompt, int n,
                                                         const struct tdm_sampling_params *sp,
                                                         int max_tokens, enum tdm_engine_kind kind)
{
    struct tdm_engine_request_params p;
    struct tdm_engine_request *r = NULL;
    char err[256];
    tdm_engine_request_params_default(&p);
    p.id = "t";
    p.prompt = prompt;
    p.n_prompt = n;
    p.sampling = *sp;
    p.max_tokens = max_tokens;
    p.kind = kind;
    int rc = tdm_engine_submit(e, &p, &r, err, sizeof err);
    if (rc != TDM_OK)
        fprintf(stderr, "submit: %s\n", err);
    assert_int_equal(rc, TDM_OK);
    return r;
}

// The model in dir on the emulated CUDA module (--device cuda-emu): batches of
// up to 256 tokens and max_batch_seqs sequences. Fails the test when it does
// not load; the caller frees it (tdm_model_free).
static inline struct tdm_model *tdm_test_emu_model(const char *dir, int max_batch_seqs)
{
    char err[256];
    struct tdm_model_opts o;
    tdm_model_opts_default(&o);
    o.max_batch_tokens = 256;
    o.max_batch_seqs = max_batch_seqs;
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda-emu", err, sizeof err), TDM_OK);
    struct tdm_model *dm = NULL;
    if (tdm_model_load(&dm, dir, &o, err, sizeof err) != TDM_OK)
        fail_msg("cuda-emu load: %s", err);
    return dm;
}

#endif
