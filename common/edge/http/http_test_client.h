// SPDX-License-Identifier: Apache-2.0
// http_test_client: a raw-socket HTTP client for the tests of common/edge/http and
// common/edge/openai (see http_test_client.c). Every call asserts (cmocka) on a
// broken connection or response; returned responses are heap strings the
// caller frees.
#ifndef TDM_HTTP_TEST_CLIENT_H
#define TDM_HTTP_TEST_CLIENT_H

#include <stddef.h>

// A connected socket to 127.0.0.1:port.
int connect_to(int port);
// Writes all of buf.
void send_all(int fd, const char *buf, size_t len);
// Reads one response (headers, then a Content-Length or chunked body); *len its size.
char *read_response(int fd, size_t *len);
// Reads until the peer closes.
char *read_to_eof(int fd, size_t *len);
// Sends req on a new connection and reads the whole response.
char *roundtrip(int port, const char *req);
// The status code of a response.
int status_of(const char *resp);
// A response header's value (case-insensitive name) copied into out, or NULL.
const char *header_of(const char *resp, const char *name, char *out, size_t cap);
// The body of a response (after the blank line).
const char *body_of(const char *resp);
// Decodes a chunked body starting at p into out; returns what follows the last chunk.
const char *dechunk(const char *p, char *out, size_t cap);
// Asserts an OpenAI error response: status, application/json with a matching
// Content-Length, {"error":{"message","type","param","code"}} with type and code.
void assert_oai_error(const char *resp, int status, const char *type);
// POSTs json to path (Connection: close) and returns the response.
char *post(int port, const char *path, const char *json);
// Splits a dechunked SSE body into its events: data payloads, comments kept as
// ": text". Returns the count.
int sse_events(char *body, char **ev, int max);

#endif
