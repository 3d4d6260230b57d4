// SPDX-License-Identifier: Apache-2.0
// pd_send: a protobuf-c message packed and sent as one transport frame, with
// an optional raw payload after it (see pd_codec.h). Messages up to 1 KiB are
// packed on the stack; larger ones take one allocation for the send's length.
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "pd_codec.h"

int tdm_pd_send_fill(struct tdm_net_outbox *ob, const char *url, int type,
                     const ProtobufCMessage *m, size_t payload_len, tdm_net_fill_fn fill, void *arg,
                     double timeout_s, char *err, size_t errlen)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t small[1024];
    uint8_t *buf = n <= sizeof small ? small : malloc(n);
    if (buf == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "pack: out of memory");
    protobuf_c_message_pack(m, buf);
    int rc =
        tdm_net_send_fill(ob, url, type, buf, n, payload_len, fill, arg, timeout_s, err, errlen);
    if (buf != small)
        free(buf);
    return rc;
}

struct copy_arg {
    const void *src;
};

static int copy_payload(void *arg, uint8_t *payload, size_t payload_len)
{
    memcpy(payload, ((struct copy_arg *)arg)->src, payload_len);
    return 0;
}

int tdm_pd_send(struct tdm_net_outbox *ob, const char *url, int type, const ProtobufCMessage *m,
                const void *payload, size_t payload_len, double timeout_s, char *err, size_t errlen)
{
    struct copy_arg a = {payload};
    return tdm_pd_send_fill(ob, url, type, m, payload ? payload_len : 0,
                            payload ? copy_payload : NULL, &a, timeout_s, err, errlen);
}
