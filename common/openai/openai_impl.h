// SPDX-License-Identifier: Apache-2.0
// openai internals shared by the request parser and the response builders:
// Python-style float formatting for error messages and UTF-8 repair for text
// that goes into JSON strings.
#ifndef TDM_OPENAI_IMPL_H
#define TDM_OPENAI_IMPL_H

#include <stddef.h>

// Formats v as Python's repr(float) would for ordinary values: the shortest
// digits that read back to the same double, with ".0" added to integral values
// ("3.0", "0.7", "1e-05" is written "1e-05"). out must hold 32 bytes.
void tdm_oai_fmt_float(char out[32], double v);

// Copies len bytes of s into a heap NUL-terminated string, replacing each
// invalid UTF-8 sequence (and NUL bytes, which cJSON strings cannot carry) with
// U+FFFD, the way Python's decode(errors="replace") does. NULL on ENOMEM.
char *tdm_oai_utf8_dup(const char *s, size_t len);

// Length of the valid UTF-8 sequence starting at s (1..4), or 0 when s[0..len)
// does not start with one (invalid or truncated).
size_t tdm_oai_utf8_seq_len(const unsigned char *s, size_t len);

#endif
