// SPDX-License-Identifier: Apache-2.0
// spec: n-gram prompt lookup (see spec.h). The search is a backwards scan,
// O(n_tokens x prompt_lookup_max) per proposal: ~10 us for a few thousand
// tokens, small against a forward step; the first (longest) n that matches
// wins, and for that n the match nearest the end.
#include <string.h>

#include "core.h"
#include "spec.h"

int tdm_spec_config_resolve(struct tdm_spec_config *c, char *err, size_t errlen)
{
    if (c->num_speculative_tokens == 0)
        return TDM_OK;
    if (c->num_speculative_tokens < 1 || c->num_speculative_tokens > TDM_SPEC_MAX_TOKENS)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "num_speculative_tokens must be in [1, %d], got %d", TDM_SPEC_MAX_TOKENS,
                          c->num_speculative_tokens);
    // vLLM: both unset -> 5; one unset -> the other's value.
    if (c->prompt_lookup_max == 0 && c->prompt_lookup_min == 0)
        c->prompt_lookup_max = c->prompt_lookup_min = 5;
    else if (c->prompt_lookup_max == 0)
        c->prompt_lookup_max = c->prompt_lookup_min;
    else if (c->prompt_lookup_min == 0)
        c->prompt_lookup_min = c->prompt_lookup_max;
    if (c->prompt_lookup_min < 1 || c->prompt_lookup_min > 64)
        return tdm_seterr(err, errlen, TDM_EINVAL, "prompt_lookup_min must be in [1, 64], got %d",
                          c->prompt_lookup_min);
    if (c->prompt_lookup_max < c->prompt_lookup_min || c->prompt_lookup_max > 64)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "prompt_lookup_max must be in [prompt_lookup_min=%d, 64], got %d",
                          c->prompt_lookup_min, c->prompt_lookup_max);
    return TDM_OK;
}

int tdm_spec_propose(const struct tdm_spec_config *c, const int32_t *tokens, int n, int max_draft,
                     int32_t *draft)
{
    if (c->num_speculative_tokens <= 0 || max_draft <= 0)
        return 0;
    int hi = c->prompt_lookup_max < n - 1 ? c->prompt_lookup_max : n - 1;
    for (int g = hi; g >= c->prompt_lookup_min; g--) {
        const int32_t *tail = tokens + n - g;
        // Start positions s < n - g, nearest the end first.
        for (int s = n - g - 1; s >= 0; s--) {
            if (tokens[s] != tail[0] || memcmp(tokens + s, tail, (size_t)g * sizeof *tail) != 0)
                continue;
            // The tokens after the match, copied forward LZ77-style: past
            // tokens[n-1] the copy continues into the draft itself, so a loop
            // of period shorter than the draft is proposed in full.
            int from = s + g;
            for (int i = 0; i < max_draft; i++) {
                int at = from + i;
                draft[i] = at < n ? tokens[at] : draft[at - n];
            }
            return max_draft;
        }
    }
    return 0;
}

void tdm_spec_adapt_init(struct tdm_spec_adapt *a)
{
    *a = (struct tdm_spec_adapt){.backoff = TDM_SPEC_BACKOFF_MIN};
}

bool tdm_spec_adapt_step(struct tdm_spec_adapt *a)
{
    if (a->pause > 0) {
        a->pause--;
        return false;
    }
    return true;
}

bool tdm_spec_adapt_update(struct tdm_spec_adapt *a, int proposed, int accepted)
{
    a->win_drafts++;
    a->win_proposed += proposed;
    a->win_accepted += accepted;
    if (a->win_drafts < TDM_SPEC_WINDOW)
        return false;
    bool low = a->win_accepted < TDM_SPEC_MIN_ACCEPT_RATE * a->win_proposed;
    if (low) {
        a->pause = a->backoff;
        a->backoff = a->backoff * 2 > TDM_SPEC_BACKOFF_MAX ? TDM_SPEC_BACKOFF_MAX : a->backoff * 2;
    } else {
        a->backoff = TDM_SPEC_BACKOFF_MIN;
    }
    a->win_drafts = 0;
    a->win_proposed = 0;
    a->win_accepted = 0;
    return low;
}
