// SPDX-License-Identifier: Apache-2.0
// tandem-generate: runs one prompt through the model with the shared runner
// (chunked prefill, then decode) and prints the continuation. Sampling is
// greedy unless --temperature is given (a tool for tests and quick checks, so
// the deterministic choice is the default; generation_config.json is not
// applied). --json prints one object with ids, text and per-phase timings;
// --dump-logits writes the raw logits every token was sampled from as f32
// little-endian [steps][vocab] for the reference test. --kv-cache-dtype is the
// workers' flag (default auto = bf16, so a worker and this tool agree token for
// token; f32 for the exact reference). --json-schema FILE, --json-object,
// --regex RE, --choice A,B,C and --grammar FILE constrain the output as a
// request's structured outputs do (vLLM's guided_json, json_object,
// guided_regex, guided_choice, guided_grammar; docs/structured-outputs.md): the
// constraint compiles through the same grammar cache entry point as a worker's
// request parser (tdm_grammar_compile_cached), so a bad one is the same message.
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar.h"
#include "kv_cache.h"
#include "model.h"
#include "runner.h"
#include "sampling.h"
#include "tokenizer.h"

struct args {
    const char *model;
    const char *prompt;
    const char *prompt_ids;
    int max_tokens;
    struct tdm_sampling_params sp;
    enum tdm_weight_mode weights;
    int threads;
    const char *device; // --device; NULL = auto
    bool enforce_eager; // --enforce-eager
    enum tdm_batch_invariance batch_invariant; // --[no-]batch-invariant; DEFAULT: the model's
    int chunk;
    bool json;
    bool ignore_eos;
    const char *dump_logits;
    enum tdm_kv_dtype kv_dtype; // --kv-cache-dtype
    // Structured output: at most one of these.
    const char *json_schema_file; // --json-schema FILE
    bool json_object;             // --json-object
    const char *regex;            // --regex RE
    const char *choice;           // --choice A,B,C or a JSON array of strings
    const char *grammar_file;     // --grammar FILE (GBNF)
};

static int set_seed(void *o, const char *v, char *err, size_t errlen)
{
    struct args *a = o;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (*v == '\0' || *end != '\0' || errno != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--seed: expected an integer, got \"%s\"", v);
    a->sp.seed = x;
    a->sp.has_seed = true;
    return TDM_OK;
}

static int set_dtype(void *o, const char *v, char *err, size_t errlen)
{
    struct args *a = o;
    if (strcmp(v, "bf16") == 0)
        a->weights = TDM_WEIGHTS_BF16;
    else if (strcmp(v, "int8") == 0)
        a->weights = TDM_WEIGHTS_INT8;
    else
        return tdm_seterr(err, errlen, TDM_EINVAL, "--dtype: expected bf16 or int8, got \"%s\"", v);
    return TDM_OK;
}

static int set_kv_dtype(void *o, const char *v, char *err, size_t errlen)
{
    struct args *a = o;
    char e[200];
    if (tdm_kv_dtype_parse(v, &a->kv_dtype, e, sizeof e) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--kv-cache-dtype: %s", e);
    return TDM_OK;
}

static int set_batch_invariant(void *o, const char *v, char *err, size_t errlen)
{
    return tdm_batch_invariance_parse("batch-invariant", false, v,
                                      &((struct args *)o)->batch_invariant, err, errlen);
}

static int set_no_batch_invariant(void *o, const char *v, char *err, size_t errlen)
{
    return tdm_batch_invariance_parse("no-batch-invariant", true, v,
                                      &((struct args *)o)->batch_invariant, err, errlen);
}

#define PTR(n, field, mv, h)                                                                       \
    TDM_FLAG_FIELD(struct args, n, TDM_FLAG_PTR, field, .metavar = mv, .help = h, .empty_ok = true)
#define NUM(n, k, field, lo, hi, mv, h)                                                            \
    TDM_FLAG_FIELD(struct args, n, k, field, .min = lo, .max = hi, .metavar = mv, .help = h)
#define OFF(field) offsetof(struct args, field)

static const struct tdm_flag generate_flags[] = {
    PTR("model", model, "DIR", "the model folder (required)"),
    PTR("prompt", prompt, "TEXT", "the prompt as text (or --prompt-ids)"),
    PTR("prompt-ids", prompt_ids, "1,2,3", "the prompt as token ids"),
    NUM("max-tokens", TDM_FLAG_INT, max_tokens, 1, 1000000, "N", "tokens to generate (default 16)"),
    NUM("temperature", TDM_FLAG_FLOAT, sp.temperature, -1e9, 1e9, "T",
        "sampling temperature (default 0: greedy)"),
    NUM("top-p", TDM_FLAG_FLOAT, sp.top_p, -1e9, 1e9, "P", "nucleus sampling mass"),
    NUM("top-k", TDM_FLAG_INT, sp.top_k, -1, 1000000000, "K", "sample among the K most likely"),
    {.name = "seed", .kind = TDM_FLAG_FN, .fn = set_seed, .metavar = "S", .help = "sampling seed"},
    {.name = "ignore-eos",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(ignore_eos),
     .help = "go on past the end-of-sequence token"},
    {.name = "dtype",
     .kind = TDM_FLAG_FN,
     .fn = set_dtype,
     .metavar = "bf16|int8",
     .help = "weight format (default bf16)"},
    {.name = "kv-cache-dtype",
     .kind = TDM_FLAG_FN,
     .fn = set_kv_dtype,
     .metavar = "auto|bf16|f32",
     .help = "KV cache element type (default auto = bf16, as the workers)"},
    NUM("threads", TDM_FLAG_INT, threads, 0, 1024, "N", "compute threads (0: one per core)"),
    NUM("chunk", TDM_FLAG_INT, chunk, 1, 65536, "N", "prefill chunk in tokens (default 256)"),
    PTR("device", device, "cpu|cuda|cuda:N",
        "where the model computes (default cuda when built\nwith CUDA and a GPU is visible, else "
        "cpu)"),
    {.name = "enforce-eager",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(enforce_eager),
     .help = "no CUDA graphs for decode steps"},
    {.name = "batch-invariant",
     .kind = TDM_FLAG_FN,
     .fn = set_batch_invariant,
     .no_value = true,
     .help = "every GEMM on cuBLASLt, one algorithm per weight shape and row class (the "
             "default)"},
    {.name = "no-batch-invariant",
     .kind = TDM_FLAG_FN,
     .fn = set_no_batch_invariant,
     .no_value = true,
     .help = "on cuda: decode GEMMs of up to 16 rows on Tandem's split-K GEMV"},
    {.name = "json",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(json),
     .help = "print one JSON object: ids, text, per-phase timings"},
    PTR("dump-logits", dump_logits, "FILE", "write every step's logits as f32 [steps][vocab]"),
    PTR("json-schema", json_schema_file, "FILE",
        "constrain the output to the JSON Schema in FILE\n(as guided_json)"),
    {.name = "json-object",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(json_object),
     .help = "constrain the output to any JSON object"},
    PTR("regex", regex, "RE", "constrain the output to match RE (as guided_regex)"),
    PTR("choice", choice, "A,B,C",
        "the output is exactly one of these (comma-separated,\nor a JSON array of strings)"),
    PTR("grammar", grammar_file, "FILE", "constrain the output to the GBNF grammar in FILE"),
};

static const struct tdm_flags generate_table = {
    .usage = "usage: tandem-generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-tokens "
             "N\n"
             "       [--json-schema FILE | --json-object | --regex RE | --choice A,B,C | --grammar "
             "FILE]\n",
    .flags = generate_flags,
    .n = sizeof generate_flags / sizeof generate_flags[0],
};

static int fail(const char *fmt, const char *a)
{
    fputs("tandem-generate: ", stderr);
    fprintf(stderr, fmt, a);
    fputc('\n', stderr);
    return 1;
}

// Returns 0 to run, else main's exit status (0 after --help).
static int parse_args(struct args *a, int argc, char **argv, bool *stop)
{
    memset(a, 0, sizeof *a);
    tdm_sampling_params_default(&a->sp);
    a->sp.temperature = 0.0f;
    a->max_tokens = 16;
    a->chunk = 256;
    a->kv_dtype = TDM_KV_BF16; // auto
    int exit_code = 0;
    *stop = tdm_flags_main(&generate_table, a, argc, argv, NULL, 0, NULL, "tandem-generate",
                           &exit_code);
    if (*stop)
        return exit_code;
    *stop = true;
    if (a->model == NULL)
        return fail("%s", "--model DIR is required") + 1;
    if ((a->prompt == NULL) == (a->prompt_ids == NULL))
        return fail("%s", "give exactly one of --prompt TEXT and --prompt-ids 1,2,3") + 1;
    a->sp.ignore_eos = a->ignore_eos;
    int constraints = (a->json_schema_file != NULL) + a->json_object + (a->regex != NULL) +
                      (a->choice != NULL) + (a->grammar_file != NULL);
    if (constraints > 1)
        return fail("%s", "give at most one of --json-schema, --json-object, --regex, --choice "
                          "and --grammar") +
               1;
    *stop = false;
    return 0;
}

// "a,b,c" (or a JSON array as is) -> a JSON array of strings in *out (heap).
static int choice_json(const char *v, char **out)
{
    if (v[0] == '[') {
        *out = strdup(v);
        return *out ? TDM_OK : TDM_ENOMEM;
    }
    cJSON *arr = cJSON_CreateArray();
    for (const char *p = v; arr != NULL;) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        char *item = strndup(p, n);
        cJSON *str = item ? cJSON_CreateString(item) : NULL;
        free(item);
        if (str == NULL || !cJSON_AddItemToArray(arr, str)) {
            cJSON_Delete(str);
            cJSON_Delete(arr);
            arr = NULL;
            break;
        }
        if (comma == NULL)
            break;
        p = comma + 1;
    }
    *out = arr ? cJSON_PrintUnformatted(arr) : NULL;
    cJSON_Delete(arr);
    return *out ? TDM_OK : TDM_ENOMEM;
}

// The requested constraint as (kind, text) in a->sp (text: heap, in *text),
// compiled once through the grammar cache so a bad one fails here, naming the
// flag. TDM_OK with kind NONE when no flag was given.
static int constraint_setup(struct args *a, char **text, char *err, size_t errlen)
{
    enum tdm_constraint_kind kind = TDM_CONSTRAINT_NONE;
    const char *flag = NULL;
    size_t len = 0;
    int rc = TDM_OK;
    char e[300];
    *text = NULL;
    if (a->json_schema_file || a->grammar_file) {
        kind = a->json_schema_file ? TDM_CONSTRAINT_JSON_SCHEMA : TDM_CONSTRAINT_GRAMMAR;
        flag = a->json_schema_file ? "--json-schema" : "--grammar";
        const char *path = a->json_schema_file ? a->json_schema_file : a->grammar_file;
        if (tdm_read_file(path, text, &len, e, sizeof e) != TDM_OK)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: %s", flag, e);
    } else if (a->regex) {
        kind = TDM_CONSTRAINT_REGEX;
        flag = "--regex";
        *text = strdup(a->regex);
    } else if (a->choice) {
        kind = TDM_CONSTRAINT_CHOICE;
        flag = "--choice";
        rc = choice_json(a->choice, text);
    } else if (a->json_object) {
        kind = TDM_CONSTRAINT_JSON_OBJECT;
        flag = "--json-object";
        *text = strdup("");
    } else {
        return TDM_OK;
    }
    if (rc != TDM_OK || *text == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    if (kind != TDM_CONSTRAINT_JSON_SCHEMA && kind != TDM_CONSTRAINT_GRAMMAR)
        len = strlen(*text);
    struct tdm_grammar *g = NULL;
    if (tdm_grammar_compile_cached(&g, kind, *text, len, e, sizeof e) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: %s", flag, e);
    tdm_grammar_unref(g); // the cache keeps it for the runner
    a->sp.constraint = kind;
    a->sp.constraint_text = *text;
    a->sp.constraint_len = len;
    return TDM_OK;
}

// Parses "1,2,3" into a heap array.
static int parse_ids(const char *s, int32_t **ids, int *n)
{
    size_t cap = 1;
    for (const char *p = s; *p; p++)
        cap += *p == ',';
    *ids = malloc(cap * sizeof **ids);
    if (*ids == NULL)
        return TDM_ENOMEM;
    *n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno != 0 || x < 0 || x > INT32_MAX || (*end != ',' && *end != '\0'))
            return TDM_EINVAL;
        (*ids)[(*n)++] = (int32_t)x;
        p = *end == ',' ? end + 1 : end;
    }
    return *n > 0 ? TDM_OK : TDM_EINVAL;
}

static int write_logits(const char *path, const float *logits, size_t count)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return TDM_EIO;
    size_t w = fwrite(logits, sizeof(float), count, f); // x86-64 and arm64 are little-endian
    int bad = ferror(f);
    if (fclose(f) != 0 || bad || w != count)
        return TDM_EIO;
    return TDM_OK;
}

static void print_json(const struct args *a, const int32_t *prompt, int n_prompt,
                       const struct tdm_gen_request *r, const char *text, double load_s,
                       const struct tdm_gen_stats *st)
{
    cJSON *o = cJSON_CreateObject();
    cJSON *p = cJSON_AddArrayToObject(o, "prompt_ids");
    for (int i = 0; i < n_prompt; i++)
        cJSON_AddItemToArray(p, cJSON_CreateNumber(prompt[i]));
    cJSON *ids = cJSON_AddArrayToObject(o, "ids");
    for (int i = 0; i < r->n_out; i++)
        cJSON_AddItemToArray(ids, cJSON_CreateNumber(r->out_ids[i]));
    if (text)
        cJSON_AddStringToObject(o, "text", text);
    else
        cJSON_AddNullToObject(o, "text");
    cJSON_AddStringToObject(o, "finish_reason", r->stopped ? "stop" : "length");
    const char *ck = tdm_constraint_kind_name(a->sp.constraint);
    if (ck)
        cJSON_AddStringToObject(o, "constraint", ck);
    else
        cJSON_AddNullToObject(o, "constraint");
    cJSON_AddStringToObject(o, "dtype", a->weights == TDM_WEIGHTS_INT8 ? "int8" : "bf16");
    cJSON *t = cJSON_AddObjectToObject(o, "timings");
    cJSON_AddNumberToObject(t, "load_s", load_s);
    cJSON_AddNumberToObject(t, "prefill_s", st->prefill_s);
    cJSON_AddNumberToObject(t, "decode_s", st->decode_s);
    cJSON_AddNumberToObject(t, "prefill_tokens", (double)st->prefill_tokens);
    cJSON_AddNumberToObject(t, "decode_tokens", (double)st->decode_tokens);
    cJSON_AddNumberToObject(t, "prefill_tokens_per_s",
                            st->prefill_s > 0 ? (double)st->prefill_tokens / st->prefill_s : 0);
    cJSON_AddNumberToObject(t, "decode_tokens_per_s",
                            st->decode_s > 0 ? (double)st->decode_tokens / st->decode_s : 0);
    cJSON_AddNumberToObject(t, "time_to_first_token_s", r->first_token_s);
    cJSON_AddNumberToObject(t, "num_masks", (double)st->num_masks);
    cJSON_AddNumberToObject(t, "mask_s", st->mask_s);
    char *s = cJSON_PrintUnformatted(o);
    if (s)
        puts(s);
    free(s);
    cJSON_Delete(o);
}

// What one run holds; gen_free releases it all.
struct gen {
    struct tdm_model *m;
    struct tdm_kv_cache *kv;
    struct tdm_tokenizer *tok; // NULL when the model has none and the prompt is ids
    int32_t *prompt;           // [n_prompt]
    int n_prompt;
    int32_t *out_ids; // [max_tokens]
    float *logits;    // [max_tokens][vocab_size] f32, host; only with --dump-logits
    char *text;       // the decoded output, NULL without a tokenizer
    char *constraint_text;
    struct tdm_grammar_vocab *gvocab; // only with a constraint
    double load_s;
};

static void gen_free(struct gen *g)
{
    free(g->text);
    tdm_grammar_vocab_free(g->gvocab);
    free(g->constraint_text);
    free(g->logits);
    free(g->out_ids);
    free(g->prompt);
    tdm_tok_free(g->tok);
    tdm_kv_free(g->kv);
    tdm_model_free(g->m);
}

// The model, loaded for one sequence at a time. 0, or 1 (told).
static int load_model(const struct args *a, struct gen *g, char *err, size_t errlen)
{
    double t0 = tdm_now();
    struct tdm_model_opts mo;
    tdm_model_opts_default(&mo);
    mo.weights = a->weights;
    mo.num_threads = a->threads;
    mo.enforce_eager = a->enforce_eager;
    mo.batch_invariant = a->batch_invariant;
    if (tdm_model_opts_set_device(&mo, a->device, err, errlen) != TDM_OK)
        return fail("%s", err);
    mo.max_batch_seqs = 1;
    mo.max_batch_tokens = a->chunk < 512 ? a->chunk : 512;
    if (tdm_model_load(&g->m, a->model, &mo, err, errlen) != TDM_OK)
        return fail("%s", err);
    g->load_s = tdm_now() - t0;
    return 0;
}

// The tokenizer, the prompt's ids and, for a constraint, the grammar's view
// of the vocabulary. 0, or 1 (told).
static int load_prompt(const struct args *a, struct gen *g, char *err, size_t errlen)
{
    // The tokenizer is needed for text prompts; with ids it only decodes the output.
    int trc = tdm_tok_load(&g->tok, a->model, err, errlen);
    if (trc != TDM_OK) {
        g->tok = NULL;
        if (a->prompt != NULL)
            return fail("%s", err);
    }
    if (a->prompt != NULL) {
        size_t n;
        if (tdm_tok_encode(g->tok, a->prompt, strlen(a->prompt), true, &g->prompt, &n) != TDM_OK ||
            n == 0)
            return fail("%s", "the prompt encodes to no tokens");
        g->n_prompt = (int)n;
    } else {
        int prc = parse_ids(a->prompt_ids, &g->prompt, &g->n_prompt);
        if (prc == TDM_ENOMEM)
            return fail("%s", "out of memory");
        if (prc != TDM_OK)
            return fail("--prompt-ids needs comma-separated non-negative integers, got \"%s\"",
                        a->prompt_ids);
    }

    if (a->sp.constraint != TDM_CONSTRAINT_NONE) {
        if (g->tok == NULL) // err still says why the tokenizer did not load
            return fail("structured outputs need the model's tokenizer: %s", err);
        if (tdm_grammar_vocab_from_tokenizer(&g->gvocab, g->tok, -1, err, errlen) != TDM_OK)
            return fail("%s", err);
    }
    return 0;
}

// A KV cache just large enough for the prompt and max_tokens, and the output
// buffers. 0, or 1 (told).
static int alloc_run(const struct args *a, struct gen *g, char *err, size_t errlen)
{
    struct tdm_kv_config kc;
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(g->m, &kc);
    kc.block_size = 16;
    kc.num_blocks = (g->n_prompt + a->max_tokens + kc.block_size - 1) / kc.block_size + 1;
    kc.enable_prefix_caching = false;
    kc.dtype = a->kv_dtype;
    if (tdm_model_kv_new(g->m, &kc, &g->kv, err, errlen) != TDM_OK)
        return fail("%s", err);

    const struct tdm_model_config *cfg = tdm_model_config(g->m);
    g->out_ids = malloc((size_t)a->max_tokens * sizeof *g->out_ids);
    if (a->dump_logits)
        g->logits = malloc((size_t)a->max_tokens * (size_t)cfg->vocab_size * sizeof *g->logits);
    if (g->out_ids == NULL || (a->dump_logits && g->logits == NULL))
        return fail("%s", "out of memory");
    return 0;
}

// The output: --json's object, else the text, else the ids.
static void print_output(const struct args *a, struct gen *g, const struct tdm_gen_request *req,
                         const struct tdm_gen_stats *st)
{
    size_t text_len = 0;
    if (g->tok != NULL &&
        tdm_tok_decode(g->tok, g->out_ids, (size_t)req->n_out, true, &g->text, &text_len) != TDM_OK)
        g->text = NULL;
    if (a->json) {
        print_json(a, g->prompt, g->n_prompt, req, g->text, g->load_s, st);
    } else if (g->text != NULL) {
        fwrite(g->text, 1, text_len, stdout);
        fputc('\n', stdout);
    } else {
        for (int i = 0; i < req->n_out; i++)
            printf("%s%d", i ? "," : "", (int)g->out_ids[i]);
        fputc('\n', stdout);
    }
}

// Runs the prompt (chunked prefill, then decode), writes --dump-logits and
// prints the output. 0, or 1 (told).
static int generate(const struct args *a, struct gen *g, char *err, size_t errlen)
{
    struct tdm_gen_request req;
    memset(&req, 0, sizeof req);
    req.prompt = g->prompt;
    req.n_prompt = g->n_prompt;
    req.max_tokens = a->max_tokens;
    req.params = a->sp;
    req.out_ids = g->out_ids;
    req.logits_out = g->logits;
    struct tdm_gen_opts go;
    tdm_gen_opts_default(&go);
    go.chunk = a->chunk;
    go.grammar_vocab = g->gvocab;
    struct tdm_gen_stats st;
    if (tdm_gen_run(g->m, g->kv, &req, 1, &go, &st, err, errlen) != TDM_OK)
        return fail("%s", err);
    const struct tdm_model_config *cfg = tdm_model_config(g->m);
    if (a->dump_logits && write_logits(a->dump_logits, g->logits,
                                       (size_t)req.n_out * (size_t)cfg->vocab_size) != TDM_OK)
        return fail("%s: cannot write the logits", a->dump_logits);
    print_output(a, g, &req, &st);
    return 0;
}

int main(int argc, char **argv)
{
    struct args a;
    struct gen g;
    char err[512];
    memset(&g, 0, sizeof g);

    bool stop = false;
    int exit_code = parse_args(&a, argc, argv, &stop);
    if (stop)
        return exit_code;
    tdm_log_set_role("generate");
    tdm_log_set_level_name("warn"); // stderr carries errors only
    int rc;
    if (constraint_setup(&a, &g.constraint_text, err, sizeof err) != TDM_OK)
        rc = fail("%s", err);
    else
        rc = load_model(&a, &g, err, sizeof err) || load_prompt(&a, &g, err, sizeof err) ||
             alloc_run(&a, &g, err, sizeof err) || generate(&a, &g, err, sizeof err);
    gen_free(&g);
    return rc;
}
