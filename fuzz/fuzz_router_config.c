// SPDX-License-Identifier: Apache-2.0
// Fuzzes the router's config parser (YAML through libyaml, plugins, profiles,
// ranges) and its JSON view: an operator's file or ConfigMap, reloaded live.
// A config that parses must also render as /v1/router/config's JSON.
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "fuzz_stack.h"
#include "config.h"

static int fuzz_one(const uint8_t *data, size_t size)
{
    struct tdm_router_config *cfg = NULL;
    char err[512];
    if (tdm_router_config_parse(&cfg, (const char *)data, size, NULL, err, sizeof err) == 0) {
        char *json = tdm_router_config_to_json(cfg, 0.0);
        if (!json)
            abort();
        free(json);
        tdm_router_config_unref(cfg);
    }
    return 0;
}

TDM_FUZZ_ON_HTTP_STACK(fuzz_one)
