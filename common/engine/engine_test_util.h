// SPDX-License-Identifier: Apache-2.0
// engine_test_util: what the engine's tests share (engine_test,
// engine_grammar_test): the test model loaded on the emulated CUDA module, for
// the cases that draw tokens on a device. Tests only; include after cmocka.h.
#ifndef TDM_ENGINE_TEST_UTIL_H
#define TDM_ENGINE_TEST_UTIL_H

#include "core.h"
#include "model.h"

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
