// SPDX-License-Identifier: Apache-2.0
// sanitizer: which sanitizer this translation unit is built with, asked of the
// compiler in this one place (GCC defines __SANITIZE_ADDRESS__ and
// __SANITIZE_THREAD__; clang answers __has_feature). CMake's TANDEM_SANITIZE
// (address,undefined in CI's ASan pass, thread in its TSan pass; the fuzzers
// with clang) turns them on for the whole build. Code runs several times
// slower there, and the sanitizer's allocator replaces glibc's malloc.
//   TDM_SANITIZE_ADDRESS  1 under AddressSanitizer, else 0
//   TDM_SANITIZE_THREAD   1 under ThreadSanitizer, else 0
//   TDM_SANITIZE_MEMORY   1 under MemorySanitizer (clang), else 0
// A test that would run for minutes under them does less there and says, where
// it does, what the release build's run (CI's last step) still checks in full.
// Header-only.
#ifndef TDM_SANITIZER_H
#define TDM_SANITIZER_H

#if defined(__SANITIZE_ADDRESS__)
#define TDM_SANITIZE_ADDRESS 1
#endif
#if defined(__SANITIZE_THREAD__)
#define TDM_SANITIZE_THREAD 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(TDM_SANITIZE_ADDRESS)
#define TDM_SANITIZE_ADDRESS 1
#endif
#if __has_feature(thread_sanitizer) && !defined(TDM_SANITIZE_THREAD)
#define TDM_SANITIZE_THREAD 1
#endif
#if __has_feature(memory_sanitizer)
#define TDM_SANITIZE_MEMORY 1
#endif
#endif
#ifndef TDM_SANITIZE_ADDRESS
#define TDM_SANITIZE_ADDRESS 0
#endif
#ifndef TDM_SANITIZE_THREAD
#define TDM_SANITIZE_THREAD 0
#endif
#ifndef TDM_SANITIZE_MEMORY
#define TDM_SANITIZE_MEMORY 0
#endif

#endif
