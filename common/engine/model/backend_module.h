// SPDX-License-Identifier: Apache-2.0
// backend_module: a compute backend as a shared library loaded at run time
// (dlopen), as ggml loads its backends. The CUDA backend is one:
// libtandem-cuda.so holds its kernels, cudart, cuBLASLt and the CUDA side of
// the KV transfer (NCCL, CUDA IPC), so no tandem-* binary links a CUDA library
// and one set of binaries serves the CPU image and the GPU image.
// libtandem-cuda-emu.so is the same backend over the CUDA execution-model
// emulator (tests, and a GPU-less check of the loading path).
//
// A module exports one function, TDM_BACKEND_MODULE_INIT_SYMBOL, which returns
// its registration. Both sides state TDM_BACKEND_MODULE_API: the binary
// refuses a module of another version and the module refuses a binary of
// another, each with a message. Bump it whenever struct tdm_backend_ops,
// struct tdm_kvx_ops, the KV cache's storage interface or anything else the
// two sides share changes. A module carries its own copy of core, kv and hf
// (linked statically and hidden); its log lines go to the binary's log.
//
// Where a module "NAME" is looked for, first hit wins: the folders of
// TANDEM_BACKEND_PATH (':'-separated; when set, only there), else the
// binary's own folder, its ../lib, the build tree's lib folder (a binary run
// from its build folder), then the dynamic linker's search (LD_LIBRARY_PATH,
// the system's). The file is libtandem-NAME.so.
#ifndef TDM_BACKEND_MODULE_H
#define TDM_BACKEND_MODULE_H

#include <stddef.h>
#include <stdint.h>

#define TDM_BACKEND_MODULE_API                                                                     \
    7 // 2: set_batch_invariant; 3: matmul_runs (struct tdm_backend_ops);
      // 4: sample_rows returns logprobs; 5: take_results, gather_ids;
      // 6: adjustment lists (struct tdm_draw_params: rec_*, list*);
      // 7: matmul_silu_mul
#define TDM_BACKEND_MODULE_INIT_SYMBOL "tdm_backend_module_init"

struct tdm_backend_ops;
struct tdm_kvx_ops;

// What the binary hands a module's init.
struct tdm_backend_host {
    uint32_t api;               // TDM_BACKEND_MODULE_API of the binary
    uint32_t backend_ops_bytes; // sizeof(struct tdm_backend_ops) in the binary
    // The binary's log (core's tdm_log_emit): filters by the binary's level.
    void (*log)(int level, const char *module, const char *msg);
};

// What a module registers.
struct tdm_backend_module {
    uint32_t api;                          // TDM_BACKEND_MODULE_API of the module
    const char *name;                      // "cuda", "cuda-emu": the --device name
    const char *summary;                   // what it is built on, for the startup log
    const struct tdm_backend_ops *backend; // the compute backend
    const struct tdm_kvx_ops *kvx;         // device KV transfer (CUDA IPC, NCCL); NULL: nng only
};

// The module's entry: NULL with err filled when it cannot serve this binary.
typedef const struct tdm_backend_module *(*tdm_backend_module_init_fn)(
    const struct tdm_backend_host *host, char *err, size_t errlen);

// Loads module `name` once per process (later calls return the first
// outcome, failure included) and returns its registration. TDM_OK;
// TDM_ENOTFOUND when no libtandem-NAME.so is found (err lists where it
// looked); TDM_EBACKEND when one is found but cannot load (a library it
// needs is missing: err carries the dynamic linker's line naming it), has no
// init, is of another API version, or its init refuses. Thread-safe.
int tdm_backend_module_load(const char *name, const struct tdm_backend_module **out, char *err,
                            size_t errlen);

// The device KV transfer table (struct tdm_kvx_ops, common/engine/kvx/kvx.h: CUDA
// IPC and NCCL) of the CUDA backend module, libtandem-cuda.so, loaded on
// first use. TDM_OK with *out, NULL when the module has no device transfer;
// else tdm_backend_module_load's error with err and *out NULL. The workers
// check --kv-transfer against it and the roles pass it to their KV transport
// (struct tdm_kv_transport_config.ops): common/engine/kvx never loads a module.
int tdm_backend_module_kvx(const struct tdm_kvx_ops **out, char *err, size_t errlen);

#endif
