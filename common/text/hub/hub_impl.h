// SPDX-License-Identifier: Apache-2.0
// hub internals shared by hub.c, hub_http.c and the tests: the
// resolved client settings, the metadata a HEAD on a resolve URL yields, the
// libcurl transfers and SHA-256.
#ifndef TDM_HUB_IMPL_H
#define TDM_HUB_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "hub.h"

// ---- HTTP -------------------------------------------------------------------------
// Settings after the environment was consulted (all strings owned).
struct tdm_hub_client {
    char *endpoint;    // no trailing '/'
    char *token;       // NULL = no Authorization header
    char *auth_origin; // "scheme://host:port" of endpoint: the only origin that gets the token
    bool offline;
    enum tdm_hub_progress progress; // never AUTO here
    int max_retries;
    double retry_base_s;
    double connect_timeout_s;
    double stall_timeout_s;
};

// What the Hub says about a file (huggingface_hub's HfFileMetadata).
struct tdm_hub_meta {
    char commit[64]; // X-Repo-Commit
    char etag[160];  // X-Linked-Etag, else ETag; quotes and W/ removed
    long long size;  // X-Linked-Size, else Content-Length; -1 unknown
    char *location;  // where the bytes are (the CDN URL after a 3xx, else the URL asked);
                     // heap, caller frees. Informational: downloads re-resolve each attempt.
};

// HEAD url following relative redirects only (renamed repos), as huggingface_hub
// does; an absolute redirect (the CDN) ends the walk and becomes m->location.
// TDM_ENOTFOUND on 404, TDM_EPROTO on 401/403/other 4xx, TDM_ETRANSPORT when
// retries ran out.
int tdm_hub_http_head(const struct tdm_hub_client *c, const char *url, struct tdm_hub_meta *m,
                      char *err, size_t errlen);

// GETs url into dest (appending: a partial dest is resumed with a Range
// request; a 200 answer to a Range restarts it). Follows every redirect, with
// the token only for c->auth_origin. Retries dropped connections, stalls and
// 5xx with backoff. When expected_size >= 0 a complete answer of another size
// is TDM_EPROTO (dest is deleted). label names the file in the progress output.
int tdm_hub_http_download(const struct tdm_hub_client *c, const char *url, const char *dest,
                          long long expected_size, const char *label, char *err, size_t errlen);

// "scheme://host:port" (lowercase host, default port filled in) of url; -1 if unparsable.
int tdm_hub_url_origin(const char *url, char *out, size_t cap);

#endif
