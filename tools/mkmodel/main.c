// SPDX-License-Identifier: Apache-2.0
// tandem-mkmodel: command line over mkmodel.c. Starts from a preset (tiny by
// default), applies every flag given, validates and writes the folder.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "mkmodel.h"

static void usage(FILE *f)
{
    fputs("usage: tandem-mkmodel --out DIR [--preset tiny|qwen2.5-0.5b] [--arch qwen2|llama]\n"
          "  [--hidden N] [--intermediate N] [--layers N] [--heads N] [--kv-heads N]\n"
          "  [--head-dim N] [--vocab N] [--max-pos N] [--tie|--no-tie]\n"
          "  [--attention-bias|--no-attention-bias] (Llama only; Qwen2 always has biases)\n"
          "  [--rope-theta X] [--rms-eps X] [--rope-llama3 [--rope-factor X]\n"
          "   [--rope-low-freq X] [--rope-high-freq X] [--rope-orig-max-pos N]]\n"
          "  [--dtype bf16|f16|f32] [--seed N] [--tokenizer-from DIR]\n",
          f);
}

static int parse_int(const char *flag, const char *v, int *out)
{
    char *end;
    long x = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < 0 || x > 1000000000) {
        fprintf(stderr, "tandem-mkmodel: %s needs a non-negative integer, got \"%s\"\n", flag, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int parse_double(const char *flag, const char *v, double *out)
{
    char *end;
    double x = strtod(v, &end);
    if (*v == '\0' || *end != '\0') {
        fprintf(stderr, "tandem-mkmodel: %s needs a number, got \"%s\"\n", flag, v);
        return -1;
    }
    *out = x;
    return 0;
}

int main(int argc, char **argv)
{
    struct tdm_mkmodel_spec s;
    const char *out = NULL;
    char err[512];
    tdm_mkmodel_preset(&s, "tiny");
    // The preset comes first so that later flags override it whatever their order.
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--preset") == 0 && tdm_mkmodel_preset(&s, argv[i + 1]) != TDM_OK) {
            fprintf(stderr, "tandem-mkmodel: unknown preset \"%s\" (tiny, qwen2.5-0.5b)\n",
                    argv[i + 1]);
            return 2;
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        double d;
        int bad = 0;
#define NEED_VALUE()                                                                               \
    do {                                                                                           \
        if (v == NULL) {                                                                           \
            fprintf(stderr, "tandem-mkmodel: %s needs a value\n", a);                              \
            return 2;                                                                              \
        }                                                                                          \
        i++;                                                                                       \
    } while (0)
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--preset") == 0) {
            NEED_VALUE();
        } else if (strcmp(a, "--out") == 0) {
            NEED_VALUE();
            out = v;
        } else if (strcmp(a, "--arch") == 0) {
            NEED_VALUE();
            if (strcmp(v, "qwen2") == 0)
                s.arch = TDM_ARCH_QWEN2;
            else if (strcmp(v, "llama") == 0)
                s.arch = TDM_ARCH_LLAMA;
            else {
                fprintf(stderr, "tandem-mkmodel: --arch must be qwen2 or llama, got \"%s\"\n", v);
                return 2;
            }
        } else if (strcmp(a, "--hidden") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.hidden_size);
        } else if (strcmp(a, "--intermediate") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.intermediate_size);
        } else if (strcmp(a, "--layers") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.num_layers);
        } else if (strcmp(a, "--heads") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.num_heads);
        } else if (strcmp(a, "--kv-heads") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.num_kv_heads);
        } else if (strcmp(a, "--head-dim") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.head_dim);
        } else if (strcmp(a, "--vocab") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.vocab_size);
        } else if (strcmp(a, "--max-pos") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.max_position_embeddings);
        } else if (strcmp(a, "--tie") == 0) {
            s.tie_word_embeddings = true;
        } else if (strcmp(a, "--no-tie") == 0) {
            s.tie_word_embeddings = false;
        } else if (strcmp(a, "--attention-bias") == 0) {
            s.attention_bias = 1;
        } else if (strcmp(a, "--no-attention-bias") == 0) {
            s.attention_bias = 0;
        } else if (strcmp(a, "--rope-theta") == 0) {
            NEED_VALUE();
            bad = parse_double(a, v, &s.rope_theta);
        } else if (strcmp(a, "--rms-eps") == 0) {
            NEED_VALUE();
            if (!(bad = parse_double(a, v, &d)))
                s.rms_norm_eps = (float)d;
        } else if (strcmp(a, "--rope-llama3") == 0) {
            s.rope_llama3 = true;
        } else if (strcmp(a, "--rope-factor") == 0) {
            NEED_VALUE();
            if (!(bad = parse_double(a, v, &d)))
                s.rope_factor = (float)d;
        } else if (strcmp(a, "--rope-low-freq") == 0) {
            NEED_VALUE();
            if (!(bad = parse_double(a, v, &d)))
                s.rope_low_freq_factor = (float)d;
        } else if (strcmp(a, "--rope-high-freq") == 0) {
            NEED_VALUE();
            if (!(bad = parse_double(a, v, &d)))
                s.rope_high_freq_factor = (float)d;
        } else if (strcmp(a, "--rope-orig-max-pos") == 0) {
            NEED_VALUE();
            bad = parse_int(a, v, &s.rope_original_max_pos);
        } else if (strcmp(a, "--dtype") == 0) {
            NEED_VALUE();
            if (strcmp(v, "bf16") == 0)
                s.dtype = TDM_DTYPE_BF16;
            else if (strcmp(v, "f16") == 0)
                s.dtype = TDM_DTYPE_F16;
            else if (strcmp(v, "f32") == 0)
                s.dtype = TDM_DTYPE_F32;
            else {
                fprintf(stderr, "tandem-mkmodel: --dtype must be bf16, f16 or f32, got \"%s\"\n",
                        v);
                return 2;
            }
        } else if (strcmp(a, "--seed") == 0) {
            NEED_VALUE();
            char *end;
            s.seed = strtoull(v, &end, 10);
            bad = *v == '\0' || *end != '\0';
            if (bad)
                fprintf(stderr, "tandem-mkmodel: --seed needs an integer, got \"%s\"\n", v);
        } else if (strcmp(a, "--tokenizer-from") == 0) {
            NEED_VALUE();
            s.tokenizer_from = v;
        } else {
            fprintf(stderr, "tandem-mkmodel: unknown argument \"%s\"\n", a);
            usage(stderr);
            return 2;
        }
#undef NEED_VALUE
        if (bad)
            return 2;
    }
    if (out == NULL) {
        fprintf(stderr, "tandem-mkmodel: --out DIR is required\n");
        return 2;
    }
    if (tdm_mkmodel_write(&s, out, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-mkmodel: %s\n", err);
        return 1;
    }
    return 0;
}
