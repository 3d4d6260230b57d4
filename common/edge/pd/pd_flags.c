// SPDX-License-Identifier: Apache-2.0
// pd_flags: the --nng-url value check both P/D roles' flag tables use (see
// pd.h).
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "pd.h"

int tdm_pd_flag_url(char *dst, size_t dst_size, const char *value, bool allow_empty, char *err,
                    size_t errlen)
{
    if (strlen(value) >= dst_size || ((value[0] || !allow_empty) && strstr(value, "://") == NULL))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--nng-url: expected tcp://HOST:PORT, got \"%s\"", value);
    snprintf(dst, dst_size, "%s", value);
    return TDM_OK;
}
