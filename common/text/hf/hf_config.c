// SPDX-License-Identifier: Apache-2.0
// hf_config: config.json and generation_config.json of a Hugging Face model
// folder into plain structs. Defaults follow transformers' Qwen2Config and
// LlamaConfig (not PretrainedConfig's), so a field missing from the file means
// what it means to transformers. Every size is validated here, once, with a
// message that names the file, the field and the value; the model loader can
// then trust the struct (positive sizes, divisible heads, even head_dim).
#include "hf.h"

#include "core.h"
#include "hf_impl.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Which file a message is about, and where the message goes.
struct jctx {
    const char *file;
    char *err;
    size_t errlen;
};

// Short JSON text of a value for messages ("\"896\"", "-3", "[1,2]").
static void json_snippet(const cJSON *v, char *out, size_t outlen)
{
    char *s = cJSON_PrintUnformatted(v);
    if (!s) {
        snprintf(out, outlen, "(unprintable)");
        return;
    }
    if (strlen(s) > 40)
        snprintf(out, outlen, "%.37s...", s);
    else
        snprintf(out, outlen, "%s", s);
    cJSON_free(s);
}

static int bad_type(struct jctx *c, const char *key, const char *want, const cJSON *v)
{
    char got[64];
    json_snippet(v, got, sizeof(got));
    return tdm_seterr(c->err, c->errlen, TDM_EINVAL, "%s: %s must be %s, got %s", c->file, key,
                      want, got);
}

// Present and not JSON null.
static const cJSON *field(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static bool json_is_int(const cJSON *v, long long lo, long long hi)
{
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return false;
    double d = v->valuedouble;
    return d == floor(d) && d >= (double)lo && d <= (double)hi;
}

// Reads an integer field in [lo, INT_MAX]. Absent or null: *out = def, or an
// error when required. `want` words the type error ("a positive integer").
static int get_int(struct jctx *c, const cJSON *obj, const char *key, bool required, int def,
                   int lo, const char *want, int *out)
{
    const cJSON *v = field(obj, key);
    if (!v) {
        if (required)
            return tdm_seterr(c->err, c->errlen, TDM_EINVAL, "%s: missing required field \"%s\"",
                              c->file, key);
        *out = def;
        return TDM_OK;
    }
    if (!json_is_int(v, lo, INT_MAX))
        return bad_type(c, key, want, v);
    *out = (int)v->valuedouble;
    return TDM_OK;
}

// A finite number > 0 (or >= 0 when allow_zero).
static int get_num(struct jctx *c, const cJSON *obj, const char *key, double def, bool allow_zero,
                   double *out)
{
    const cJSON *v = field(obj, key);
    if (!v) {
        *out = def;
        return TDM_OK;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < 0 ||
        (!allow_zero && v->valuedouble == 0))
        return bad_type(c, key, allow_zero ? "a non-negative number" : "a positive number", v);
    *out = v->valuedouble;
    return TDM_OK;
}

static int get_bool(struct jctx *c, const cJSON *obj, const char *key, bool def, bool *out)
{
    const cJSON *v = field(obj, key);
    if (!v) {
        *out = def;
        return TDM_OK;
    }
    if (!cJSON_IsBool(v))
        return bad_type(c, key, "true or false", v);
    *out = cJSON_IsTrue(v);
    return TDM_OK;
}

// A token id: a non-negative int, a list of them, or null/absent (n = 0).
static int get_token_ids(struct jctx *c, const cJSON *obj, const char *key, int *ids, int max,
                         int *n)
{
    *n = 0;
    const cJSON *v = field(obj, key);
    if (!v)
        return TDM_OK;
    if (cJSON_IsNumber(v)) {
        if (!json_is_int(v, 0, INT_MAX))
            return bad_type(c, key, "a non-negative integer or a list of them", v);
        ids[0] = (int)v->valuedouble;
        *n = 1;
        return TDM_OK;
    }
    if (!cJSON_IsArray(v))
        return bad_type(c, key, "a non-negative integer or a list of them", v);
    const cJSON *e;
    cJSON_ArrayForEach(e, v)
    {
        if (!json_is_int(e, 0, INT_MAX))
            return bad_type(c, key, "a non-negative integer or a list of them", v);
        if (*n == max)
            return tdm_seterr(c->err, c->errlen, TDM_EINVAL, "%s: %s lists more than %d ids",
                              c->file, key, max);
        ids[(*n)++] = (int)e->valuedouble;
    }
    return TDM_OK;
}

int tdm_hf_json_object(const char *what, const char *json, size_t len, cJSON **out, char *err,
                       size_t errlen)
{
    const char *end = NULL;
    *out = NULL;
    if (!json)
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: no text", what);
    char depth_err[96];
    if (tdm_json_check_depth(json, len, TDM_JSON_MAX_DEPTH, depth_err, sizeof depth_err))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s: %s", what, depth_err);
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, false);
    if (!root) {
        size_t at = (end && end >= json && end <= json + len) ? (size_t)(end - json) : 0;
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s: not valid JSON (near byte %zu)", what, at);
    }
    // cJSON stops after the first value; anything but whitespace after it is an error.
    for (const char *p = end; p && p < json + len; p++) {
        if (*p == '\0' && p == json + len - 1)
            break; // a counted NUL terminator
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return tdm_seterr(err, errlen, TDM_EPROTO,
                              "%s: not valid JSON (trailing data at byte %zu)", what,
                              (size_t)(p - json));
        }
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s: top level is not a JSON object", what);
    }
    *out = root;
    return TDM_OK;
}

static int parse_object(struct jctx *c, const char *json, size_t len, cJSON **out)
{
    return tdm_hf_json_object(c->file, json, len, out, c->err, c->errlen);
}

// ---- config.json --------------------------------------------------------------------

static int parse_arch(struct jctx *c, const cJSON *root, struct tdm_model_config *cfg)
{
    static const struct {
        const char *cls, *model_type;
        enum tdm_arch arch;
    } known[] = {
        {"Qwen2ForCausalLM", "qwen2", TDM_ARCH_QWEN2},
        {"LlamaForCausalLM", "llama", TDM_ARCH_LLAMA},
    };
    const cJSON *archs = field(root, "architectures");
    if (archs && !cJSON_IsArray(archs))
        return bad_type(c, "architectures", "a list of strings", archs);
    const cJSON *first = archs ? cJSON_GetArrayItem(archs, 0) : NULL;
    if (first) {
        if (!cJSON_IsString(first))
            return bad_type(c, "architectures", "a list of strings", archs);
        for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
            if (strcmp(first->valuestring, known[i].cls) == 0) {
                cfg->arch = known[i].arch;
                snprintf(cfg->architecture, sizeof(cfg->architecture), "%s", known[i].cls);
                return TDM_OK;
            }
        }
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: unsupported architecture \"%.100s\" (supported: Qwen2ForCausalLM, "
                          "LlamaForCausalLM)",
                          c->file, first->valuestring);
    }
    const cJSON *mt = field(root, "model_type");
    if (!mt)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: missing required field \"architectures\" (and no \"model_type\")",
                          c->file);
    if (!cJSON_IsString(mt))
        return bad_type(c, "model_type", "a string", mt);
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
        if (strcmp(mt->valuestring, known[i].model_type) == 0) {
            cfg->arch = known[i].arch;
            // No class name was written: record the one transformers would use.
            snprintf(cfg->architecture, sizeof(cfg->architecture), "%s", known[i].cls);
            return TDM_OK;
        }
    }
    return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                      "%s: unsupported model_type \"%.100s\" (supported: qwen2, llama)", c->file,
                      mt->valuestring);
}

// rope_scaling null/absent or {"rope_type"|"type": "default"|"llama3", ...}. Newer
// transformers writes the same keys (plus rope_theta) under "rope_parameters".
static int parse_rope(struct jctx *c, const cJSON *root, struct tdm_model_config *cfg)
{
    int rc;
    const char *key = "rope_scaling";
    const cJSON *rs = field(root, key);
    const cJSON *rp = field(root, "rope_parameters");
    if (!rs && rp) {
        key = "rope_parameters";
        rs = rp;
    }
    memset(&cfg->rope_scaling, 0, sizeof(cfg->rope_scaling));
    cfg->rope_scaling.type = TDM_ROPE_DEFAULT;
    if (!rs)
        return TDM_OK;
    if (!cJSON_IsObject(rs))
        return bad_type(c, key, "an object or null", rs);
    if (rs == rp && field(rs, "rope_theta") && !field(root, "rope_theta")) {
        if ((rc = get_num(c, rs, "rope_theta", 10000.0, false, &cfg->rope_theta)))
            return rc;
    }
    const cJSON *t = field(rs, "rope_type");
    if (!t)
        t = field(rs, "type");
    if (!t)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: %s has no \"rope_type\" (or \"type\")", c->file, key);
    if (!cJSON_IsString(t))
        return bad_type(c, "rope_scaling.rope_type", "a string", t);
    if (strcmp(t->valuestring, "default") == 0)
        return TDM_OK;
    if (strcmp(t->valuestring, "llama3") != 0)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: unsupported rope scaling type \"%.60s\" (supported: llama3)",
                          c->file, t->valuestring);

    struct tdm_rope_scaling *r = &cfg->rope_scaling;
    static const char *num_keys[] = {"factor", "low_freq_factor", "high_freq_factor"};
    float *num_dst[] = {&r->factor, &r->low_freq_factor, &r->high_freq_factor};
    for (int i = 0; i < 3; i++) {
        const cJSON *v = field(rs, num_keys[i]);
        char name[64];
        snprintf(name, sizeof(name), "rope_scaling.%s", num_keys[i]);
        if (!v)
            return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                              "%s: missing required field \"%s\" for llama3 rope scaling", c->file,
                              name);
        if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble <= 0 ||
            v->valuedouble > 1e6)
            return bad_type(c, name, "a positive number", v);
        *num_dst[i] = (float)v->valuedouble;
    }
    const cJSON *om = field(rs, "original_max_position_embeddings");
    if (!om)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: missing required field \"rope_scaling.original_max_position_"
                          "embeddings\" for llama3 rope scaling",
                          c->file);
    if (!json_is_int(om, 1, INT_MAX))
        return bad_type(c, "rope_scaling.original_max_position_embeddings", "a positive integer",
                        om);
    r->original_max_position_embeddings = (int)om->valuedouble;
    // The smoothing step divides by (high - low) (Llama 3.1 frequency interpolation).
    if (!(r->high_freq_factor > r->low_freq_factor))
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: rope_scaling.high_freq_factor=%g must be greater than "
                          "low_freq_factor=%g",
                          c->file, (double)r->high_freq_factor, (double)r->low_freq_factor);
    r->type = TDM_ROPE_LLAMA3;
    return TDM_OK;
}

static int parse_dtype(struct jctx *c, const cJSON *root, enum tdm_dtype *out)
{
    // transformers >= 4.56 writes "dtype"; older files say "torch_dtype".
    const char *key = "dtype";
    const cJSON *v = field(root, key);
    if (!v) {
        key = "torch_dtype";
        v = field(root, key);
    }
    *out = TDM_DTYPE_BF16;
    if (!v)
        return TDM_OK;
    if (!cJSON_IsString(v))
        return bad_type(c, key, "a string", v);
    const char *s = v->valuestring;
    if (strncmp(s, "torch.", 6) == 0)
        s += 6;
    if (strcmp(s, "bfloat16") == 0)
        *out = TDM_DTYPE_BF16;
    else if (strcmp(s, "float16") == 0)
        *out = TDM_DTYPE_F16;
    else if (strcmp(s, "float32") == 0)
        *out = TDM_DTYPE_F32;
    else
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: unsupported %s \"%.60s\" (supported: bfloat16, float16, float32)",
                          c->file, key, v->valuestring);
    return TDM_OK;
}

static int config_fill(struct jctx *c, const cJSON *root, struct tdm_model_config *cfg)
{
    int rc;
    const char *pos = "a positive integer";
    if ((rc = parse_arch(c, root, cfg)))
        return rc;
    bool qwen2 = cfg->arch == TDM_ARCH_QWEN2;

    if ((rc = get_int(c, root, "hidden_size", true, 0, 1, pos, &cfg->hidden_size)) ||
        (rc = get_int(c, root, "intermediate_size", true, 0, 1, pos, &cfg->intermediate_size)) ||
        (rc = get_int(c, root, "num_hidden_layers", true, 0, 1, pos, &cfg->num_hidden_layers)) ||
        (rc =
             get_int(c, root, "num_attention_heads", true, 0, 1, pos, &cfg->num_attention_heads)) ||
        (rc = get_int(c, root, "num_key_value_heads", false, cfg->num_attention_heads, 1, pos,
                      &cfg->num_key_value_heads)) ||
        (rc = get_int(c, root, "head_dim", false, 0, 1, pos, &cfg->head_dim)) ||
        (rc = get_int(c, root, "vocab_size", true, 0, 1, pos, &cfg->vocab_size)) ||
        (rc = get_int(c, root, "max_position_embeddings", false, qwen2 ? 32768 : 2048, 1, pos,
                      &cfg->max_position_embeddings)))
        return rc;

    double eps, theta;
    if ((rc = get_num(c, root, "rms_norm_eps", 1e-6, false, &eps)) ||
        (rc = get_num(c, root, "rope_theta", 10000.0, false, &theta)))
        return rc;
    cfg->rms_norm_eps = (float)eps;
    cfg->rope_theta = theta;
    if ((rc = parse_rope(c, root, cfg)))
        return rc;

    // Both Qwen2Config and LlamaConfig default tie_word_embeddings to false.
    if ((rc = get_bool(c, root, "tie_word_embeddings", false, &cfg->tie_word_embeddings)))
        return rc;
    if (qwen2) {
        cfg->attention_bias = true; // Qwen2Attention always has q/k/v biases
    } else {
        if ((rc = get_bool(c, root, "attention_bias", false, &cfg->attention_bias)))
            return rc;
        bool mlp_bias;
        if ((rc = get_bool(c, root, "mlp_bias", false, &mlp_bias)))
            return rc;
        if (mlp_bias)
            return tdm_seterr(c->err, c->errlen, TDM_EINVAL, "%s: mlp_bias=true is not supported",
                              c->file);
    }
    const cJSON *act = field(root, "hidden_act");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu") != 0)) {
        char got[64];
        json_snippet(act, got, sizeof(got));
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: unsupported hidden_act %s (supported: \"silu\")", c->file, got);
    }

    if ((rc = get_bool(c, root, "use_sliding_window", false, &cfg->use_sliding_window)) ||
        (rc = get_int(c, root, "max_window_layers", false, qwen2 ? 28 : 0, 0,
                      "a non-negative integer", &cfg->max_window_layers)))
        return rc;
    // Like Qwen2Config: the window only exists when use_sliding_window is true.
    cfg->sliding_window = 0;
    if (cfg->use_sliding_window &&
        (rc = get_int(c, root, "sliding_window", true, 0, 1, pos, &cfg->sliding_window)))
        return rc;

    int bos[TDM_MAX_EOS], nbos;
    if ((rc = get_token_ids(c, root, "bos_token_id", bos, TDM_MAX_EOS, &nbos)) ||
        (rc = get_token_ids(c, root, "eos_token_id", cfg->eos_token_ids, TDM_MAX_EOS,
                            &cfg->num_eos_token_ids)))
        return rc;
    cfg->bos_token_id = nbos > 0 ? bos[0] : -1;
    if ((rc = parse_dtype(c, root, &cfg->torch_dtype)))
        return rc;

    // ---- cross-field checks
    if (cfg->num_attention_heads % cfg->num_key_value_heads != 0)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: num_key_value_heads=%d does not divide num_attention_heads=%d",
                          c->file, cfg->num_key_value_heads, cfg->num_attention_heads);
    if (cfg->head_dim == 0) {
        if (cfg->hidden_size % cfg->num_attention_heads != 0)
            return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                              "%s: hidden_size=%d is not divisible by num_attention_heads=%d "
                              "(and head_dim is not given)",
                              c->file, cfg->hidden_size, cfg->num_attention_heads);
        cfg->head_dim = cfg->hidden_size / cfg->num_attention_heads;
    }
    // Rotary embedding rotates pairs of dimensions.
    if (cfg->head_dim % 2 != 0)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL, "%s: head_dim=%d must be even", c->file,
                          cfg->head_dim);
    if ((long long)cfg->head_dim * cfg->num_attention_heads > INT_MAX)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: head_dim=%d x num_attention_heads=%d is too large", c->file,
                          cfg->head_dim, cfg->num_attention_heads);
    if (cfg->bos_token_id >= cfg->vocab_size)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                          "%s: bos_token_id=%d is not below vocab_size=%d", c->file,
                          cfg->bos_token_id, cfg->vocab_size);
    for (int i = 0; i < cfg->num_eos_token_ids; i++)
        if (cfg->eos_token_ids[i] >= cfg->vocab_size)
            return tdm_seterr(c->err, c->errlen, TDM_EINVAL,
                              "%s: eos_token_id=%d is not below vocab_size=%d", c->file,
                              cfg->eos_token_ids[i], cfg->vocab_size);
    return TDM_OK;
}

int tdm_hf_config_parse(struct tdm_model_config *cfg, const char *json, size_t len, char *err,
                        size_t errlen)
{
    struct jctx c = {"config.json", err, errlen};
    cJSON *root;
    memset(cfg, 0, sizeof(*cfg));
    int rc = parse_object(&c, json, len, &root);
    if (rc)
        return rc;
    rc = config_fill(&c, root, cfg);
    cJSON_Delete(root);
    return rc;
}

int tdm_hf_config_load(struct tdm_model_config *cfg, const char *dir, char *err, size_t errlen)
{
    char *path = tdm_path_join(dir, "config.json");
    if (!path)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "config.json: out of memory");
    char *text;
    size_t len;
    int rc = tdm_read_file(path, &text, &len, err, errlen);
    free(path);
    if (rc) {
        memset(cfg, 0, sizeof(*cfg));
        return rc;
    }
    rc = tdm_hf_config_parse(cfg, text, len, err, errlen);
    free(text);
    return rc;
}

// ---- generation_config.json -----------------------------------------------------------

static int get_opt_float(struct jctx *c, const cJSON *obj, const char *key, double lo, double hi,
                         bool lo_open, const char *want, bool *has, float *out)
{
    const cJSON *v = field(obj, key);
    *has = false;
    if (!v)
        return TDM_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble > hi ||
        v->valuedouble < lo || (lo_open && v->valuedouble == lo))
        return bad_type(c, key, want, v);
    *has = true;
    *out = (float)v->valuedouble;
    return TDM_OK;
}

static int generation_fill(struct jctx *c, const cJSON *root, struct tdm_generation_config *gc)
{
    int rc;
    if ((rc = get_opt_float(c, root, "temperature", 0, HUGE_VAL, false, "a non-negative number",
                            &gc->has_temperature, &gc->temperature)) ||
        (rc = get_opt_float(c, root, "top_p", 0, 1, true, "a number in (0, 1]", &gc->has_top_p,
                            &gc->top_p)) ||
        (rc = get_opt_float(c, root, "min_p", 0, 1, false, "a number in [0, 1]", &gc->has_min_p,
                            &gc->min_p)) ||
        (rc = get_opt_float(c, root, "repetition_penalty", 0, HUGE_VAL, true, "a positive number",
                            &gc->has_repetition_penalty, &gc->repetition_penalty)))
        return rc;
    if (field(root, "top_k")) {
        if ((rc = get_int(c, root, "top_k", false, 0, -1, "an integer >= -1", &gc->top_k)))
            return rc;
        gc->has_top_k = true;
    }
    if (field(root, "max_new_tokens")) {
        if ((rc = get_int(c, root, "max_new_tokens", false, 0, 1, "a positive integer",
                          &gc->max_new_tokens)))
            return rc;
        gc->has_max_new_tokens = true;
    }
    if ((rc = get_bool(c, root, "do_sample", false, &gc->do_sample)))
        return rc;
    int ids[TDM_MAX_EOS], n;
    if ((rc = get_token_ids(c, root, "eos_token_id", gc->eos_token_ids, TDM_MAX_EOS,
                            &gc->num_eos_token_ids)) ||
        (rc = get_token_ids(c, root, "pad_token_id", ids, TDM_MAX_EOS, &n)))
        return rc;
    gc->pad_token_id = n > 0 ? ids[0] : -1;
    if ((rc = get_token_ids(c, root, "bos_token_id", ids, TDM_MAX_EOS, &n)))
        return rc;
    gc->bos_token_id = n > 0 ? ids[0] : -1;
    return TDM_OK;
}

static void generation_clear(struct tdm_generation_config *gc)
{
    memset(gc, 0, sizeof(*gc));
    gc->pad_token_id = -1;
    gc->bos_token_id = -1;
}

int tdm_hf_generation_config_parse(struct tdm_generation_config *gc, const char *json, size_t len,
                                   char *err, size_t errlen)
{
    struct jctx c = {"generation_config.json", err, errlen};
    cJSON *root;
    generation_clear(gc);
    int rc = parse_object(&c, json, len, &root);
    if (rc)
        return rc;
    rc = generation_fill(&c, root, gc);
    cJSON_Delete(root);
    if (rc)
        generation_clear(gc);
    return rc;
}

int tdm_hf_generation_config_load(struct tdm_generation_config *gc, const char *dir, char *err,
                                  size_t errlen)
{
    generation_clear(gc);
    char *path = tdm_path_join(dir, "generation_config.json");
    if (!path)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "generation_config.json: out of memory");
    char *text;
    size_t len;
    int rc = tdm_read_file(path, &text, &len, err, errlen);
    free(path);
    if (rc == TDM_ENOTFOUND) {
        if (err && errlen)
            err[0] = '\0';
        return TDM_OK; // optional file: vLLM's fallbacks apply
    }
    if (rc)
        return rc;
    rc = tdm_hf_generation_config_parse(gc, text, len, err, errlen);
    free(text);
    return rc;
}

void tdm_hf_sampling_resolve(const struct tdm_generation_config *gc,
                             const struct tdm_sampling_request *req, int max_tokens_limit,
                             struct tdm_sampling_resolved *out)
{
    static const struct tdm_sampling_request none = {0};
    static const struct tdm_generation_config empty = {0};
    if (!req)
        req = &none;
    if (!gc)
        gc = &empty;

    out->temperature = req->temperature      ? *req->temperature
                       : gc->has_temperature ? gc->temperature
                                             : 1.0f;
    out->top_p = req->top_p ? *req->top_p : gc->has_top_p ? gc->top_p : 1.0f;
    // vLLM reads the file through GenerationConfig.to_diff_dict(), which drops
    // values equal to transformers' defaults; only top_k=50 differs from vLLM's own
    // fallback (off), so a file saying top_k 50 leaves top_k off.
    int top_k = req->top_k ? *req->top_k : (gc->has_top_k && gc->top_k != 50) ? gc->top_k : 0;
    out->top_k = top_k < 0 ? 0 : top_k;
    out->min_p = req->min_p ? *req->min_p : gc->has_min_p ? gc->min_p : 0.0f;
    out->repetition_penalty = req->repetition_penalty      ? *req->repetition_penalty
                              : gc->has_repetition_penalty ? gc->repetition_penalty
                                                           : 1.0f;
    // vLLM's get_max_tokens: the smallest of the request's max_tokens, the file's
    // max_new_tokens and what is left of the context; each only when known.
    int m = -1;
    if (req->max_tokens && *req->max_tokens > 0)
        m = *req->max_tokens;
    if (gc->has_max_new_tokens && (m < 0 || gc->max_new_tokens < m))
        m = gc->max_new_tokens;
    if (max_tokens_limit > 0 && (m < 0 || max_tokens_limit < m))
        m = max_tokens_limit;
    out->max_tokens = m;
}
