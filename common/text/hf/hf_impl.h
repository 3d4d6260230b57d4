// SPDX-License-Identifier: Apache-2.0
// hf_impl: internals shared by the hf module's files (not for other modules).
#ifndef TDM_HF_IMPL_H
#define TDM_HF_IMPL_H

#include <cjson/cJSON.h>
#include <stddef.h>

// Parses len bytes of untrusted text as one JSON object (only whitespace, or a
// final NUL, may follow it). On success *out is the tree (caller cJSON_Deletes).
// Otherwise TDM_EPROTO with "<what>: not valid JSON (near byte N)" or
// "<what>: top level is not a JSON object".
int tdm_hf_json_object(const char *what, const char *json, size_t len, cJSON **out, char *err,
                       size_t errlen);

#endif
