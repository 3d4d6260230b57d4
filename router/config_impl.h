// SPDX-License-Identifier: Apache-2.0
// router config internals shared by config.c and config_store.c: the config as
// a cJSON object (the store adds its reload state to it).
#ifndef TDM_ROUTER_CONFIG_IMPL_H
#define TDM_ROUTER_CONFIG_IMPL_H

#include <cjson/cJSON.h>

#include "config.h"

// The normalised config as a cJSON object (caller deletes); NULL on ENOMEM.
// loaded_at (wall seconds) > 0 adds "loaded_at" (RFC 3339) and "loaded_at_unix".
cJSON *tdm_router_config_json_object_(const struct tdm_router_config *cfg, double loaded_at);

struct tdm_router_config_store;
// tdm_router_config_store_json as a cJSON object (caller deletes); NULL on ENOMEM.
cJSON *tdm_router_config_store_json_object_(struct tdm_router_config_store *st);

#endif
