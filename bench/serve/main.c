// SPDX-License-Identifier: Apache-2.0
// tandem-bench: the serving benchmark client (like `vllm bench serve`). All the
// work is in the bench_serve library so that its test can run the same code.
// main only raises the open-file limit: every in-flight stream holds a socket,
// and --request-rate inf with 1000 prompts opens 1000 of them at once.
#include <stdio.h>
#include <sys/resource.h>

#include "bench_serve.h"

int main(int argc, char **argv)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl); // best effort: the soft limit stays if refused
    }
    return tdm_bench_main(argc, argv, stdout, stderr);
}
