// SPDX-License-Identifier: Apache-2.0
// router_stream: the router's per-choice stream steps as pure functions (see
// router_stream.h). A TokenChunk is converted in slices of at most SLICE
// tokens so that the top logprobs of a slice fit a stack array: the proto
// keeps them as pointers, the shared step wants [n][num_top] values.
#include "router_stream.h"

#include <stdint.h>
#include <stdlib.h>

#include "core.h"
#include "pd_codec.h"
#include "sampling.h"

#define SLICE 16

int tdm_router_take_chunk(struct tdm_oai_call *k, size_t i, const Tandem__TokenChunk *m,
                          int32_t tok_eos, const struct tdm_generation_config *gen,
                          struct tdm_router_take *out)
{
    out->stopped = out->upstream_done = out->refused = out->busy = false;
    struct tdm_oai_asm *a = &k->choices[i];
    bool was_done = a->done;
    bool with_lp = m->n_logprobs == m->n_tokens;
    int nt = m->num_top > 0 && m->n_top == m->n_tokens * (size_t)m->num_top ? m->num_top : 0;
    // A token's top list holds at most TDM_MAX_TOP_ENTRIES entries (top-N, or
    // the chosen token and logprob_token_ids); more from a worker are cut, not trusted.
    int keep = nt < TDM_MAX_TOP_ENTRIES ? nt : TDM_MAX_TOP_ENTRIES;
    enum tdm_finish reason = tdm_pd_finish_from_proto(m->finish);
    if (m->finished && reason == TDM_FINISH_NONE)
        reason = TDM_FINISH_ERROR; // finished without a reason: a broken peer
    struct tdm_token_logprob top[SLICE * TDM_MAX_TOP_ENTRIES];
    // Prompt logprobs (first chunk of a request that asked): a view for the
    // call, which copies them; a malformed set is ignored.
    struct tdm_prompt_logprobs plp = {0};
    struct tdm_token_logprob *plp_top = NULL;
    bool with_plp = m->n_prompt_logprobs > 0 && m->n_prompt_ranks == m->n_prompt_logprobs &&
                    m->n_prompt_logprobs <= INT32_MAX && m->prompt_num_top >= 0 &&
                    m->prompt_num_top <= TDM_MAX_LOGPROBS &&
                    m->n_prompt_top == m->n_prompt_logprobs * (size_t)m->prompt_num_top;
    if (with_plp && m->n_prompt_top > 0) {
        plp_top = malloc(m->n_prompt_top * sizeof *plp_top);
        if (plp_top == NULL)
            return TDM_ENOMEM;
        for (size_t t = 0; t < m->n_prompt_top; t++) {
            plp_top[t].token = m->prompt_top[t]->token;
            plp_top[t].logprob = m->prompt_top[t]->logprob;
        }
    }
    // A decode worker that did not bring the prompt logprobs asked for (one
    // older than them): the choice fails rather than answer without them.
    if (!with_plp && m->first_index == 0 && m->n_tokens > 0 && !a->done &&
        tdm_oai_call_prompt_lp(k, i) >= 0 && k->prompts[a->prompt_idx].plp == NULL) {
        tdm_oai_asm_fail(a, TDM_ETRANSPORT,
                         "the decode worker returned no prompt logprobs (is it older than "
                         "the router?)");
        out->stopped = !m->finished; // the caller cancels what still generates
        out->upstream_done = m->finished;
        return TDM_OK;
    }
    if (with_plp)
        plp = (struct tdm_prompt_logprobs){.n = (int)m->n_prompt_logprobs,
                                           .num_top = m->prompt_num_top,
                                           .logprob = m->prompt_logprobs,
                                           .rank = m->prompt_ranks,
                                           .top = plp_top};
    for (size_t start = 0; start < m->n_tokens || (start == 0 && m->finished);) {
        size_t n = m->n_tokens - start < SLICE ? m->n_tokens - start : SLICE;
        for (size_t t = 0; t < n; t++)
            for (int j = 0; j < keep; j++) {
                const Tandem__TopLogprob *p = m->top[(start + t) * (size_t)nt + (size_t)j];
                top[t * (size_t)keep + (size_t)j].token = p->token;
                top[t * (size_t)keep + (size_t)j].logprob = p->logprob;
            }
        bool last = start + n == m->n_tokens;
        const struct tdm_oai_gen_chunk g = {
            .tokens = m->tokens + start,
            .n = n,
            .logprobs = with_lp ? m->logprobs + start : NULL,
            .top = keep ? top : NULL,
            .num_top = keep,
            .prompt_logprobs = with_plp && start == 0 ? &plp : NULL,
            .finished = last && m->finished,
            .reason = reason,
            .stop_token = m->stop_token,
            .error = m->error ? m->error : TDM_ETRANSPORT,
            .message = m->message,
        };
        bool stopped = false;
        if (tdm_oai_call_take(k, i, &g, tok_eos, gen, &stopped) != TDM_OK) {
            free(plp_top);
            return TDM_ENOMEM;
        }
        out->stopped = out->stopped || stopped;
        start += n;
        if (last)
            break;
    }
    free(plp_top);
    out->upstream_done = m->finished;
    bool refusal = m->finished && !was_done && a->finish == TDM_FINISH_ERROR &&
                   a->completion_tokens == 0;
    out->refused = refusal && a->error == TDM_ECLOSED;
    out->busy = refusal && a->error == TDM_EBUSY;
    return TDM_OK;
}

enum tdm_router_upstream tdm_router_upstream_check(double now, double stream_started,
                                                   double last_report, double liveness_timeout,
                                                   uint64_t reported_instance,
                                                   uint64_t stream_instance, double router_resumed,
                                                   double unanswered_since)
{
    double since = last_report > stream_started ? last_report : stream_started;
    if (router_resumed > since)
        since = router_resumed;
    if (now - since > liveness_timeout && unanswered_since > 0 &&
        now - unanswered_since > liveness_timeout)
        return TDM_ROUTER_UPSTREAM_SILENT;
    if (reported_instance != 0 && stream_instance != 0 && reported_instance != stream_instance &&
        last_report > stream_started)
        return TDM_ROUTER_UPSTREAM_RESTARTED;
    return TDM_ROUTER_UPSTREAM_ALIVE;
}

bool tdm_router_call_retryable(const struct tdm_oai_call *k)
{
    for (size_t i = 0; i < k->n_choices; i++)
        if (k->choices[i].completion_tokens > 0)
            return false;
    return true;
}
