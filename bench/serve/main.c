// SPDX-License-Identifier: Apache-2.0
// tandem-bench: the serving benchmark client (like `vllm bench serve`). All the
// work is in the bench_serve library so that its test can run the same code.
#include <stdio.h>

#include "bench_serve.h"

int main(int argc, char **argv)
{
    return tdm_bench_main(argc, argv, stdout, stderr);
}
