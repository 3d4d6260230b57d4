// SPDX-License-Identifier: Apache-2.0
// tandem-mkmodel: command line over mkmodel.c. Starts from a preset (tiny by
// default), applies every flag given (core's flag table), validates and writes
// the folder.
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "mkmodel.h"

struct mk_args {
    struct tdm_mkmodel_spec s;
    const char *out; // --out DIR
};

// --preset is applied before the other flags (main), so they override it.
static int set_preset_done(void *o, const char *v, char *err, size_t errlen)
{
    (void)o;
    (void)v;
    (void)err;
    (void)errlen;
    return TDM_OK;
}

static int set_arch(void *o, const char *v, char *err, size_t errlen)
{
    struct mk_args *a = o;
    if (strcmp(v, "qwen2") == 0)
        a->s.arch = TDM_ARCH_QWEN2;
    else if (strcmp(v, "llama") == 0)
        a->s.arch = TDM_ARCH_LLAMA;
    else
        return tdm_seterr(err, errlen, TDM_EINVAL, "--arch: expected qwen2 or llama, got \"%s\"",
                          v);
    return TDM_OK;
}

static int set_attention_bias(void *o, const char *v, char *err, size_t errlen)
{
    (void)v;
    (void)err;
    (void)errlen;
    ((struct mk_args *)o)->s.attention_bias = 1;
    return TDM_OK;
}

static int set_no_attention_bias(void *o, const char *v, char *err, size_t errlen)
{
    (void)v;
    (void)err;
    (void)errlen;
    ((struct mk_args *)o)->s.attention_bias = 0;
    return TDM_OK;
}

static int set_dtype(void *o, const char *v, char *err, size_t errlen)
{
    struct mk_args *a = o;
    if (strcmp(v, "bf16") == 0)
        a->s.dtype = TDM_DTYPE_BF16;
    else if (strcmp(v, "f16") == 0)
        a->s.dtype = TDM_DTYPE_F16;
    else if (strcmp(v, "f32") == 0)
        a->s.dtype = TDM_DTYPE_F32;
    else
        return tdm_seterr(err, errlen, TDM_EINVAL, "--dtype: expected bf16, f16 or f32, got \"%s\"",
                          v);
    return TDM_OK;
}

static int set_seed(void *o, const char *v, char *err, size_t errlen)
{
    struct mk_args *a = o;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (*v == '\0' || *end != '\0' || errno != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--seed: expected an integer, got \"%s\"", v);
    a->s.seed = x;
    return TDM_OK;
}

#define SIZE(n, field, h)                                                                          \
    TDM_FLAG_FIELD(struct mk_args, n, TDM_FLAG_INT, s.field, .min = 0, .max = 1e9, .metavar = "N", \
                   .help = h)
#define REAL(n, k, field, h)                                                                       \
    TDM_FLAG_FIELD(struct mk_args, n, k, s.field, .min = -1e300, .max = 1e300, .metavar = "X",  \
                   .help = h)
#define FN(n, f, mv, h) {.name = n, .kind = TDM_FLAG_FN, .fn = f, .metavar = mv, .help = h}
#define FN0(n, f, h) {.name = n, .kind = TDM_FLAG_FN, .fn = f, .no_value = true, .help = h}
#define OFF(field) offsetof(struct mk_args, field)

static const struct tdm_flag mkmodel_flags[] = {
    {.name = "out",
     .kind = TDM_FLAG_PTR,
     .offset = OFF(out),
     .metavar = "DIR",
     .help = "the folder to write (required)"},
    FN("preset", set_preset_done, "tiny|demo|qwen2.5-0.5b", "the starting shape (default tiny; demo is tandem up's)"),
    FN("arch", set_arch, "qwen2|llama", "architecture"),
    SIZE("hidden", hidden_size, "hidden size"),
    SIZE("intermediate", intermediate_size, "MLP size"),
    SIZE("layers", num_layers, "decoder layers"),
    SIZE("heads", num_heads, "attention heads"),
    SIZE("kv-heads", num_kv_heads, "KV heads"),
    SIZE("head-dim", head_dim, "head size (0 = hidden / heads)"),
    SIZE("vocab", vocab_size, "vocabulary size"),
    SIZE("max-pos", max_position_embeddings, "context length"),
    {.name = "tie",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(s.tie_word_embeddings),
     .help = "tie the embedding and the LM head"},
    {.name = "no-tie",
     .kind = TDM_FLAG_NOT,
     .offset = OFF(s.tie_word_embeddings),
     .help = "separate LM head"},
    FN0("attention-bias", set_attention_bias, "QKV biases (Llama only; Qwen2 always has them)"),
    FN0("no-attention-bias", set_no_attention_bias, "no QKV biases (Llama only)"),
    REAL("rope-theta", TDM_FLAG_DOUBLE, rope_theta, "RoPE base"),
    REAL("rms-eps", TDM_FLAG_FLOAT, rms_norm_eps, "RMSNorm epsilon"),
    {.name = "rope-llama3",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(s.rope_llama3),
     .help = "write llama3 rope_scaling (with the four below)"},
    REAL("rope-factor", TDM_FLAG_FLOAT, rope_factor, "llama3 scaling factor"),
    REAL("rope-low-freq", TDM_FLAG_FLOAT, rope_low_freq_factor, "llama3 low_freq_factor"),
    REAL("rope-high-freq", TDM_FLAG_FLOAT, rope_high_freq_factor, "llama3 high_freq_factor"),
    SIZE("rope-orig-max-pos", rope_original_max_pos, "llama3 original_max_position_embeddings"),
    FN("dtype", set_dtype, "bf16|f16|f32", "dtype of model.safetensors"),
    FN("seed", set_seed, "N", "seed of the random weights"),
    {.name = "tokenizer-from",
     .kind = TDM_FLAG_PTR,
     .offset = OFF(s.tokenizer_from),
     .metavar = "DIR",
     .help = "copy tokenizer.json (+ tokenizer_config.json) from DIR"},
};

static const struct tdm_flags mkmodel_table = {
    .usage = "usage: tandem-mkmodel --out DIR [--preset tiny|demo|qwen2.5-0.5b] [options]\n",
    .flags = mkmodel_flags,
    .n = sizeof mkmodel_flags / sizeof mkmodel_flags[0],
};

int main(int argc, char **argv)
{
    struct mk_args a = {.out = NULL};
    char err[512];
    tdm_mkmodel_preset(&a.s, "tiny");
    // The preset comes first so that later flags override it whatever their order.
    for (int i = 1; i < argc; i++) {
        const char *p = strcmp(argv[i], "--preset") == 0 && i + 1 < argc ? argv[i + 1]
                        : strncmp(argv[i], "--preset=", 9) == 0          ? argv[i] + 9
                                                                         : NULL;
        if (p && tdm_mkmodel_preset(&a.s, p) != TDM_OK) {
            fprintf(stderr, "tandem-mkmodel: unknown preset \"%s\" (tiny, demo, qwen2.5-0.5b)\n", p);
            return 2;
        }
    }
    int exit_code = 0;
    if (tdm_flags_main(&mkmodel_table, &a, argc, argv, NULL, 0, NULL, "tandem-mkmodel", &exit_code))
        return exit_code;
    if (a.out == NULL) {
        fprintf(stderr, "tandem-mkmodel: --out DIR is required (see --help)\n");
        return 2;
    }
    if (tdm_mkmodel_write(&a.s, a.out, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-mkmodel: %s\n", err);
        return 1;
    }
    // Where it went, for the next command (tandem-decode --model DIR, ...).
    char real[4096];
    printf("tandem-mkmodel: wrote %s (%d layers, hidden %d, vocab %d)\n",
           realpath(a.out, real) ? real : a.out, a.s.num_layers, a.s.hidden_size,
           a.s.vocab_size);
    return 0;
}
