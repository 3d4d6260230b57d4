// SPDX-License-Identifier: Apache-2.0
// kvx_choose: the --kv-transfer choice for one (prefill, decode) pair, a pure
// function so every combination of settings, devices, hosts and IPC-open
// outcomes is tested (kvx_test.c). Preference order CUDA IPC, NCCL, nng: the
// nearer transport first, and nng last because it stages through host memory.
#include <stdio.h>
#include <string.h>

#include "kvx.h"

static const char *const NAMES[] = {
    [TDM_KVX_AUTO] = "auto",
    [TDM_KVX_NNG] = "nng",
    [TDM_KVX_CUDA_IPC] = "cuda-ipc",
    [TDM_KVX_NCCL] = "nccl",
};

int tdm_kvx_mode_parse(const char *s, enum tdm_kvx_mode *out)
{
    for (int m = TDM_KVX_AUTO; m <= TDM_KVX_NCCL; m++) {
        if (s != NULL && strcmp(s, NAMES[m]) == 0) {
            *out = (enum tdm_kvx_mode)m;
            return 0;
        }
    }
    return -1;
}

const char *tdm_kvx_mode_name(enum tdm_kvx_mode m)
{
    return (unsigned)m <= TDM_KVX_NCCL ? NAMES[m] : "?";
}

static bool allows(const struct tdm_kvx_side *s, enum tdm_kvx_mode m)
{
    return s->setting == TDM_KVX_AUTO || s->setting == m;
}

static bool known(const char *host)
{
    return host != NULL && host[0] != '\0';
}

// Why mode m is impossible for the pair, or NULL when it is possible.
static const char *impossible(const struct tdm_kvx_side *p, const struct tdm_kvx_side *d,
                              enum tdm_kvx_ipc_open ipc_open, enum tdm_kvx_mode m, char *buf,
                              size_t len)
{
    switch (m) {
    case TDM_KVX_CUDA_IPC:
        if (!p->gpu || !d->gpu)
            return "cuda-ipc needs a GPU on both workers";
        if (!known(p->host_id) || !known(d->host_id) || strcmp(p->host_id, d->host_id) != 0) {
            snprintf(buf, len,
                     "cuda-ipc needs both workers on one host: prefill on %s, decode on %s",
                     known(p->host_id) ? p->host_id : "(unknown)",
                     known(d->host_id) ? d->host_id : "(unknown)");
            return buf;
        }
        if (ipc_open == TDM_KVX_IPC_FAILED)
            return "the decode worker's KV pool handle did not open in the prefill worker";
        return NULL;
    case TDM_KVX_NCCL:
        if (!p->gpu || !d->gpu)
            return "nccl needs a GPU on both workers";
        if (!p->nccl || !d->nccl)
            return "nccl needs both workers built with NCCL";
        return NULL;
    default:
        return NULL; // nng: always possible
    }
}

int tdm_kvx_choose(const struct tdm_kvx_side *prefill, const struct tdm_kvx_side *decode,
                   enum tdm_kvx_ipc_open ipc_open, enum tdm_kvx_mode *out, char *why, size_t whylen)
{
    static const enum tdm_kvx_mode order[] = {TDM_KVX_CUDA_IPC, TDM_KVX_NCCL, TDM_KVX_NNG};
    char buf[256];
    const char *last = NULL;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        enum tdm_kvx_mode m = order[i];
        if (!allows(prefill, m) || !allows(decode, m))
            continue;
        const char *no = impossible(prefill, decode, ipc_open, m, buf, sizeof buf);
        if (no == NULL) {
            *out = m;
            return 0;
        }
        last = no;
    }
    if (why != NULL && whylen > 0) {
        if (last != NULL)
            snprintf(why, whylen, "%s", last);
        else
            snprintf(why, whylen, "prefill wants %s, decode wants %s",
                     tdm_kvx_mode_name(prefill->setting), tdm_kvx_mode_name(decode->setting));
    }
    return -1;
}
