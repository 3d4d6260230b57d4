// SPDX-License-Identifier: Apache-2.0
// model: a Qwen2 / Llama decoder expressed through the backend ops table.
//
// Load reads config.json and the safetensors tensors under their HF names,
// checks every shape against the config, stacks q/k/v (and their biases) into
// one qkv weight and gate/up into one gate_up weight so each layer runs three
// big matmuls instead of six, and hands the bf16/f16/f32 checkpoint data to
// the backend, which converts it to bf16 or int8 in its own layout. Norm
// weights and biases become f32; RoPE inverse frequencies are computed once,
// with HF's Llama 3 frequency scaling when rope_scaling says so. Every
// activation buffer is sized for max_batch_tokens rows at load time, so the
// forward allocates nothing.
//
// Forward, for a batch of sequences packed row after row:
//   x = embed(tokens)
//   per layer: h = rmsnorm(x); qkv = h.Wqkv^T + b; rope(q), rope(k);
//              store k, v in the paged cache (then each sequence's on_layer
//              hook, if set); a = attention(q, cache);
//              x += a.Wo^T; h = rmsnorm(x); g = h.Wgu^T; x += silu_mul(g).Wd^T
//   rows that want logits: gathered, final rmsnorm, lm_head into the caller's
//   logits buffer.
// Each row's numbers depend only on that row and its own sequence's cache (the
// backend's batch-invariance contract), so a sequence gets bitwise the same
// logits whatever else shares the step.
//
// GEMM classes: on a backend with matmul_runs (CUDA) a layer's GEMM runs its
// prompt rows with an algorithm of their own and its decode rows with the
// decode algorithm, one call over the step's runs of rows of one class
// (rows of a sequence are contiguous, its prompt rows first). A step without
// prompt rows calls matmul as before (the same launches). The LM head is
// decode class for every row: its rows are one per sequence (its drafts'
// besides), a decode-sized GEMM whatever the step.
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "backend.h"
#include "core.h"
#include "model.h"
#include "sample_draw.h"
#include "weight_cache.h"

// ---- structs --------------------------------------------------------------------------

struct tdm_layer {
    struct tdm_weight qkv;     // [q_dim + 2*kv_dim][hidden]
    struct tdm_weight o;       // [hidden][q_dim]
    struct tdm_weight gate_up; // [2*inter][hidden]: gate rows then up rows
    struct tdm_weight down;    // [hidden][inter]
    // Small f32 vectors live in backend memory, uploaded at load.
    float *qkv_bias;   // [q_dim + 2*kv_dim] f32 backend memory, NULL without bias
    float *input_norm; // [hidden] f32 backend memory
    float *post_norm;  // [hidden] f32 backend memory
};

struct tdm_model {
    struct tdm_model_config cfg;
    struct tdm_model_opts opts;
    const struct tdm_backend_ops *ops;
    struct tdm_backend *be;

    int q_dim;   // num_attention_heads * head_dim
    int kv_dim;  // num_key_value_heads * head_dim
    int qkv_dim; // q_dim + 2 * kv_dim

    struct tdm_layer *layers;  // [num_hidden_layers]
    struct tdm_weight embed;   // [vocab][hidden] bf16 (lookup; also the head when tied + bf16)
    struct tdm_weight lm_head; // [vocab][hidden] in the weight mode; unused when head_is_embed
    bool head_is_embed;        // tied and bf16: one weight serves both
    float *final_norm;         // [hidden] f32 backend memory
    float *inv_freq;           // [head_dim / 2] f32 backend memory

    // Activations, backend memory, T = max_batch_tokens rows.
    float *x;                   // [T][hidden] residual stream
    // h, attn and act feed matmuls: the backend's matmul-input format (f32
    // on the CPU, bf16 on CUDA; backend.h), sized for f32.
    float *h;                   // [T][hidden] normed input of a sublayer
    float *d;                   // [T][hidden] a sublayer's output, added to x by the next norm
    float *qkv;                 // [T][qkv_dim]
    float *attn;                // [T][q_dim]
    float *gate_up;             // [T][2*inter]
    float *act;                 // [T][inter]
    int32_t *pos;               // [T] position of each row, host
    int32_t *ids;               // [T] token id of each row, host
    int32_t *pos_be;            // [T] pos in backend memory (== pos on a host-memory backend)
    int32_t *ids_be;            // [T] ids in backend memory (== ids on a host-memory backend)
    float *logits_be;           // [T][vocab] backend memory; NULL on a host-memory backend,
                                // which writes the caller's logits directly
    struct tdm_attn_seq *aseqs; // [max_batch_seqs]
    struct tdm_row_run *runs;   // [2 * max_batch_seqs] the step's GEMM runs (a sequence's
                                // prompt rows, then its decode rows), host
    int32_t *chosen_ids;        // [max_batch_seqs] the ARGMAX and SAMPLE rows' tokens, host
    struct tdm_draw_params *draw; // [max_batch_seqs] their draws (SAMPLE), host
    struct tdm_draw_logprobs *chosen_lp; // [max_batch_seqs] their logprobs (asked), host
    struct tdm_draw_adj *adj;     // [adj_cap] the SAMPLE rows' adjustments, one array, host
    int adj_cap;
    uint32_t *masks; // [mask_cap] the SAMPLE rows' allow bitmaps, one array, host
    size_t mask_cap;
    void (*choose_hook)(void *arg); // tdm_model_set_choose_hook
    void *choose_arg;
    // Forwards in flight on a device backend (tdm_model_forward_issue), oldest
    // first from fl_head: each one's chosen rows' destinations ([2][T]), until
    // tdm_model_forward_wait takes its results.
    struct chosen_dest {
        int32_t *tok;
        struct tdm_draw_logprobs *lp; // NULL: the row asked none
    } * dest[2];
    int dest_n[2];
    int fl_head, n_inflight;
    // The last forward issued: its chosen rows (the bound of a from_prev row's
    // prev_row; 0 after a forward without them or a failed one). A host-memory
    // backend's are in chosen_ids until the next forward's head.
    int last_chosen;
    int32_t *gpairs;            // [2 * max_batch_seqs] (row, prev_row) of the from_prev rows
    int pad_table[1];           // block table of a graph bucket's padding rows (block 0, read only)

    // Packed-weight cache (weight_cache.h). wcache: the mapped entry the
    // weights were adopted from (kept until they are released), NULL when
    // they were prepared here. During a load: wcache_next is the next entry to
    // adopt; prepared lists the weights prepared, in load order, when an
    // entry is to be written (freed at the end of the load); wcache_bad is set
    // when an entry does not fit this model (the load is redone without it).
    struct tdm_wcache *wcache;
    int wcache_next;
    struct tdm_weight **prepared; // [n_prepared], not owned
    int n_prepared, cap_prepared;
    bool wcache_bad;
    pthread_t writer;    // writes the entry after a background-writing load
    bool writer_running; // writer started, not yet joined
    struct tdm_model_load_info info;
};

// ---- options ---------------------------------------------------------------------------

void tdm_model_opts_default(struct tdm_model_opts *o)
{
    memset(o, 0, sizeof *o);
    o->weights = TDM_WEIGHTS_BF16;
    o->num_threads = 0;
    o->max_batch_tokens = 512;
    o->max_batch_seqs = 64;
    o->backend = "cpu";
    o->device = 0;
    o->weight_cache_min_bytes = (size_t)64 << 20;
}

const struct tdm_model_load_info *tdm_model_load_info(const struct tdm_model *m)
{
    return &m->info;
}

const char *tdm_weight_cache_use_name(enum tdm_weight_cache_use u)
{
    switch (u) {
    case TDM_WCACHE_HIT:
        return "hit";
    case TDM_WCACHE_MISS:
        return "miss";
    case TDM_WCACHE_REBUILT:
        return "rebuilt";
    case TDM_WCACHE_FAILED:
        return "failed";
    default:
        return "off";
    }
}

static char auto_note[1100];
static pthread_mutex_t auto_note_mu = PTHREAD_MUTEX_INITIALIZER;

const char *tdm_model_device_auto_note(void)
{
    return auto_note;
}

int tdm_batch_invariance_parse(const char *flag, bool negate, const char *v,
                               enum tdm_batch_invariance *out, char *err, size_t errlen)
{
    bool on = true;
    if (v != NULL && tdm_parse_bool(v, &on) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: expected true or false, got \"%s\"", flag,
                          v);
    *out = on != negate ? TDM_BATCH_INVARIANT_ON : TDM_BATCH_INVARIANT_OFF;
    return TDM_OK;
}

int tdm_model_opts_set_device(struct tdm_model_opts *o, const char *spec, char *err, size_t errlen)
{
    char why[1024];
    const struct tdm_backend_ops *cuda;
    if (spec == NULL || spec[0] == '\0' || strcmp(spec, "auto") == 0) {
        int found = tdm_backend_lookup("cuda", &cuda, why, sizeof why);
        int visible = found == TDM_OK && cuda->device_count ? cuda->device_count() : 0;
        o->backend = visible > 0 ? "cuda" : "cpu";
        o->device = 0;
        pthread_mutex_lock(&auto_note_mu);
        if (visible > 0)
            auto_note[0] = '\0';
        else if (found == TDM_OK)
            snprintf(auto_note, sizeof auto_note, "no CUDA GPU visible");
        else
            snprintf(auto_note, sizeof auto_note, "no CUDA backend: %s", why);
        pthread_mutex_unlock(&auto_note_mu);
        static atomic_flag said = ATOMIC_FLAG_INIT;
        if (visible == 0 && !atomic_flag_test_and_set(&said))
            TDM_LOG_INFO("model", "--device auto: running on the CPU (%s)", auto_note);
        return TDM_OK;
    }
    if (strcmp(spec, "cpu") == 0) {
        o->backend = "cpu";
        o->device = 0;
        return TDM_OK;
    }
    int ordinal = 0;
    static const char *const devices[] = {"cuda-emu", "cuda"};
    for (size_t d = 0; d < sizeof devices / sizeof devices[0]; d++) {
        const char *name = devices[d];
        size_t nl = strlen(name);
        if (strncmp(spec, name, nl) != 0 || (spec[nl] != '\0' && spec[nl] != ':'))
            continue;
        if (spec[nl] == ':') {
            char *end;
            long v = strtol(spec + nl + 1, &end, 10);
            if (spec[nl + 1] == '\0' || *end != '\0' || v < 0 || v > 1023)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "--device %s: expected %s:N with N a GPU index", spec, name);
            ordinal = (int)v;
        }
        if (tdm_backend_lookup(name, &cuda, why, sizeof why) != TDM_OK)
            return tdm_seterr(err, errlen, TDM_EINVAL, "--device %s: no CUDA backend: %s", spec,
                              why);
        int visible = cuda->device_count ? cuda->device_count() : 0;
        if (ordinal >= visible)
            return tdm_seterr(err, errlen, TDM_EINVAL, "--device %s: %d CUDA GPU%s visible", spec,
                              visible, visible == 1 ? "" : "s");
        o->backend = name;
        o->device = ordinal;
        return TDM_OK;
    }
    return tdm_seterr(err, errlen, TDM_EINVAL, "--device %s: expected cpu, cuda or cuda:N", spec);
}

const struct tdm_model_config *tdm_model_config(const struct tdm_model *m)
{
    return &m->cfg;
}
const struct tdm_model_opts *tdm_model_opts(const struct tdm_model *m)
{
    return &m->opts;
}

void tdm_model_set_choose_hook(struct tdm_model *m, void (*fn)(void *arg), void *arg)
{
    m->choose_hook = fn;
    m->choose_arg = arg;
}

bool tdm_model_device_sampling(const struct tdm_model *m)
{
    return !m->ops->host_memory && m->ops->sample_rows != NULL;
}

bool tdm_model_fused_argmax(const struct tdm_model *m)
{
    // Host memory: the fused LM head; a device: the argmax of the head's rows
    // there, ids alone to the host.
    return m->ops->host_memory ? m->ops->matmul_argmax != NULL : m->ops->argmax_rows != NULL;
}

void tdm_model_host_parallel(struct tdm_model *m, void (*fn)(void *arg, int tid, int nthreads),
                             void *arg)
{
    if (m->ops->host_parallel)
        m->ops->host_parallel(m->be, fn, arg);
    else
        fn(arg, 0, 1);
}

size_t tdm_model_weight_bytes(const struct tdm_model *m)
{
    size_t b = 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const struct tdm_layer *L = &m->layers[l];
        b += L->qkv.nbytes + L->o.nbytes + L->gate_up.nbytes + L->down.nbytes;
    }
    b += m->head_is_embed ? m->embed.nbytes : m->lm_head.nbytes;
    return b;
}

void tdm_model_kv_config(const struct tdm_model *m, struct tdm_kv_config *cfg)
{
    cfg->num_layers = m->cfg.num_hidden_layers;
    cfg->num_kv_heads = m->cfg.num_key_value_heads;
    cfg->head_dim = m->cfg.head_dim;
}

int tdm_model_kv_capacity(struct tdm_model *m, const struct tdm_kv_config *cfg, double utilization,
                          int *num_blocks, char *err, size_t errlen)
{
    if (!(utilization > 0.0 && utilization <= 1.0))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--gpu-memory-utilization %g: expected a fraction in (0, 1]",
                          utilization);
    if (m->ops->kv_capacity == NULL)
        return tdm_seterr(err, errlen, TDM_ENOTFOUND,
                          "the %s backend has no device memory to take a fraction of",
                          m->ops->name);
    return m->ops->kv_capacity(m->be, cfg, utilization, num_blocks, err, errlen);
}

int tdm_model_kv_new(struct tdm_model *m, const struct tdm_kv_config *cfg,
                     struct tdm_kv_cache **out, char *err, size_t errlen)
{
    if (m->ops->kv_storage_new == NULL)
        return tdm_kv_new(out, cfg, err, errlen);
    *out = NULL;
    struct tdm_kv_storage *st;
    int rc = m->ops->kv_storage_new(m->be, cfg, &st, err, errlen);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_kv_new_with_storage(out, cfg, st, err, errlen);
    if (rc != TDM_OK)
        st->ops->free(st);
    return rc;
}

// ---- load helpers ----------------------------------------------------------------------

// Finds NAME with shape [d0] or [d0][d1]; a tensor pointer into the mapping.
static int get_tensor(const struct tdm_safetensors *st, const char *name, int64_t d0, int64_t d1,
                      const struct tdm_tensor **t, char *err, size_t errlen)
{
    int64_t shape[2] = {d0, d1};
    return tdm_st_get(st, name, d1 > 0 ? 2 : 1, shape, t, err, errlen);
}

static float src_elem_f32(const void *data, enum tdm_dtype dt, size_t i)
{
    switch (dt) {
    case TDM_DTYPE_F32:
        return ((const float *)data)[i];
    case TDM_DTYPE_F16:
        return tdm_f16_to_f32(((const uint16_t *)data)[i]);
    case TDM_DTYPE_BF16:
    default:
        return tdm_bf16_to_f32(((const uint16_t *)data)[i]);
    }
}

// Copies the n elements of a 1-D checkpoint vector into dst as f32.
static void copy_vec_f32(float *dst, const struct tdm_tensor *t, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = src_elem_f32(t->data, t->dtype, i);
}

static float *alloc_f32(struct tdm_model *m, size_t n)
{
    float *p = m->ops->alloc(m->be, n * sizeof(float));
    if (p && m->ops->host_memory)
        memset(p, 0, n * sizeof(float));
    return p;
}

// Backend memory holding the n f32 values of host (a small vector: norm
// weights, biases, inv_freq).
static int upload_vec(struct tdm_model *m, const float *host, size_t n, float **out, char *err,
                      size_t errlen, const char *what)
{
    *out = alloc_f32(m, n);
    if (*out == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", what);
    int rc = m->ops->upload(m->be, *out, host, n * sizeof(float));
    if (rc != TDM_OK)
        return tdm_seterr(err, errlen, rc, "%s: upload to the %s backend failed", what,
                          m->ops->name);
    return TDM_OK;
}

static int load_vec(struct tdm_model *m, const struct tdm_safetensors *st, const char *name,
                    int64_t n, float **out, char *err, size_t errlen)
{
    const struct tdm_tensor *t;
    int rc = get_tensor(st, name, n, 0, &t, err, errlen);
    if (rc != TDM_OK)
        return rc;
    float *host = malloc((size_t)n * sizeof *host);
    if (host == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", name);
    copy_vec_f32(host, t, (size_t)n);
    rc = upload_vec(m, host, (size_t)n, out, err, errlen, name);
    free(host);
    return rc;
}

// Drops the checkpoint pages of a tensor the backend has copied from: the
// mapping is read-only and file-backed, so a later read faults them back in
// from the page cache, and meanwhile the process does not hold the checkpoint
// and the prepared copy at once (the peak RSS of a load halves). Only pages
// wholly inside the tensor are dropped.
static void drop_source_pages(const void *data, size_t nbytes)
{
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        return;
    uintptr_t start = ((uintptr_t)data + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
    uintptr_t end = ((uintptr_t)data + nbytes) & ~((uintptr_t)page - 1);
    if (end > start)
        (void)madvise((void *)start, end - start, MADV_DONTNEED);
}

// Adopts the next entry of m->wcache as w, which must be a weight of (want,
// rows, cols); sets m->wcache_bad and returns TDM_EPROTO when it is not.
static int adopt_weight(struct tdm_model *m, struct tdm_weight *w, enum tdm_wtype want, int rows,
                        int cols, char *err, size_t errlen)
{
    const struct tdm_wcache_entry *e = tdm_wcache_get(m->wcache, m->wcache_next++);
    if (e == NULL || e->type != want || e->rows != rows || e->cols != cols) {
        m->wcache_bad = true;
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "weight cache: entry %d is not a %d x %d weight of type %d",
                          m->wcache_next - 1, rows, cols, (int)want);
    }
    int rc = m->ops->adopt_weight(m->be, w, e->type, e->rows, e->cols, e->ptr, e->bytes, e->nspans,
                                  err, errlen);
    if (rc != TDM_OK)
        m->wcache_bad = true;
    return rc == TDM_OK ? TDM_OK : TDM_EPROTO;
}

// Prepares one weight from nparts tensors named names[i], each [rows[i]][cols]
// (or adopts it from the packed-weight cache entry being loaded).
static int load_weight(struct tdm_model *m, const struct tdm_safetensors *st, struct tdm_weight *w,
                       const char *const *names, const int *rows, int nparts, int cols,
                       enum tdm_wtype want, char *err, size_t errlen)
{
    struct tdm_weight_src parts[3];
    int total_rows = 0;
    for (int i = 0; i < nparts; i++) {
        const struct tdm_tensor *t;
        int rc = get_tensor(st, names[i], rows[i], cols, &t, err, errlen);
        if (rc != TDM_OK)
            return rc;
        parts[i].data = t->data;
        parts[i].dtype = t->dtype;
        parts[i].rows = rows[i];
        total_rows += rows[i];
    }
    if (m->wcache != NULL)
        return adopt_weight(m, w, want, total_rows, cols, err, errlen);
    int rc = m->ops->prepare_weight(m->be, w, parts, nparts, cols, want, err, errlen);
    if (rc != TDM_OK)
        return rc;
    for (int i = 0; i < nparts; i++)
        drop_source_pages(parts[i].data,
                          (size_t)parts[i].rows * (size_t)cols * tdm_dtype_size(parts[i].dtype));
    if (m->cap_prepared > m->n_prepared)
        m->prepared[m->n_prepared++] = w;
    return TDM_OK;
}

// HF's rotary inverse frequencies: base^(-2i/d); with rope_scaling llama3 the
// long wavelengths are divided by factor and the band between low and high
// frequency wavelengths is interpolated (transformers' _compute_llama3_parameters).
static void compute_inv_freq(const struct tdm_model_config *c, float *inv_freq)
{
    int half = c->head_dim / 2;
    const struct tdm_rope_scaling *rs = &c->rope_scaling;
    for (int i = 0; i < half; i++) {
        double f = 1.0 / pow(c->rope_theta, (double)(2 * i) / (double)c->head_dim);
        if (rs->type == TDM_ROPE_LLAMA3) {
            double old_ctx = rs->original_max_position_embeddings;
            double low_wavelen = old_ctx / rs->low_freq_factor;
            double high_wavelen = old_ctx / rs->high_freq_factor;
            double wavelen = 2.0 * M_PI / f;
            if (wavelen > low_wavelen) {
                f = f / rs->factor;
            } else if (wavelen >= high_wavelen) {
                double smooth = (old_ctx / wavelen - rs->low_freq_factor) /
                                (rs->high_freq_factor - rs->low_freq_factor);
                f = (1.0 - smooth) * f / rs->factor + smooth * f;
            }
        }
        inv_freq[i] = (float)f;
    }
}

static void release_weight(struct tdm_model *m, struct tdm_weight *w)
{
    if (w->data != NULL || w->scales != NULL)
        m->ops->release_weight(m->be, w);
    memset(w, 0, sizeof *w);
}

static void release_buf(struct tdm_model *m, void *p)
{
    if (p != NULL)
        m->ops->release(m->be, p);
}

void tdm_model_free(struct tdm_model *m)
{
    if (m == NULL)
        return;
    if (m->writer_running) // it reads the weights released below
        pthread_join(m->writer, NULL);
    if (m->be != NULL) {
        if (m->layers != NULL) {
            for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
                struct tdm_layer *L = &m->layers[l];
                release_weight(m, &L->qkv);
                release_weight(m, &L->o);
                release_weight(m, &L->gate_up);
                release_weight(m, &L->down);
                release_buf(m, L->qkv_bias);
                release_buf(m, L->input_norm);
                release_buf(m, L->post_norm);
            }
        }
        release_weight(m, &m->embed);
        release_weight(m, &m->lm_head);
        release_buf(m, m->final_norm);
        release_buf(m, m->inv_freq);
        release_buf(m, m->x);
        release_buf(m, m->h);
        release_buf(m, m->d);
        release_buf(m, m->qkv);
        release_buf(m, m->attn);
        release_buf(m, m->gate_up);
        release_buf(m, m->act);
        if (m->ids_be != m->ids)
            release_buf(m, m->ids_be);
        if (m->pos_be != m->pos)
            release_buf(m, m->pos_be);
        release_buf(m, m->logits_be);
        m->ops->destroy(m->be);
    }
    tdm_wcache_free(m->wcache); // after the weights adopted from it
    free(m->prepared);
    free(m->layers);
    free(m->pos);
    free(m->ids);
    free(m->aseqs);
    free(m->runs);
    free(m->chosen_ids);
    free(m->draw);
    free(m->chosen_lp);
    free(m->dest[0]);
    free(m->dest[1]);
    free(m->gpairs);
    free(m->adj);
    free(m->masks);
    free(m);
}

static int load_layer(struct tdm_model *m, const struct tdm_safetensors *st, int l,
                      enum tdm_wtype want, char *err, size_t errlen)
{
    const struct tdm_model_config *c = &m->cfg;
    struct tdm_layer *L = &m->layers[l];
    char n0[128], n1[128], n2[128];
    const char *names[3] = {n0, n1, n2};
    int hidden = c->hidden_size, inter = c->intermediate_size;
    int rc;

#define LNAME(buf, suffix) snprintf(buf, sizeof buf, "model.layers.%d.%s", l, suffix)
    LNAME(n0, "self_attn.q_proj.weight");
    LNAME(n1, "self_attn.k_proj.weight");
    LNAME(n2, "self_attn.v_proj.weight");
    int qkv_rows[3] = {m->q_dim, m->kv_dim, m->kv_dim};
    if ((rc = load_weight(m, st, &L->qkv, names, qkv_rows, 3, hidden, want, err, errlen)))
        return rc;
    LNAME(n0, "self_attn.o_proj.weight");
    int o_rows[1] = {hidden};
    if ((rc = load_weight(m, st, &L->o, names, o_rows, 1, m->q_dim, want, err, errlen)))
        return rc;
    LNAME(n0, "mlp.gate_proj.weight");
    LNAME(n1, "mlp.up_proj.weight");
    int gu_rows[2] = {inter, inter};
    if ((rc = load_weight(m, st, &L->gate_up, names, gu_rows, 2, hidden, want, err, errlen)))
        return rc;
    LNAME(n0, "mlp.down_proj.weight");
    int d_rows[1] = {hidden};
    if ((rc = load_weight(m, st, &L->down, names, d_rows, 1, inter, want, err, errlen)))
        return rc;

    if (c->attention_bias) {
        float *bias = malloc((size_t)m->qkv_dim * sizeof *bias);
        if (bias == NULL)
            return tdm_seterr(err, errlen, TDM_ENOMEM, "layer %d: out of memory", l);
        LNAME(n0, "self_attn.q_proj.bias");
        LNAME(n1, "self_attn.k_proj.bias");
        LNAME(n2, "self_attn.v_proj.bias");
        int off = 0;
        for (int i = 0; i < 3; i++) {
            const struct tdm_tensor *t;
            if ((rc = get_tensor(st, names[i], qkv_rows[i], 0, &t, err, errlen))) {
                free(bias);
                return rc;
            }
            copy_vec_f32(bias + off, t, (size_t)qkv_rows[i]);
            off += qkv_rows[i];
        }
        rc = upload_vec(m, bias, (size_t)m->qkv_dim, &L->qkv_bias, err, errlen, n0);
        free(bias);
        if (rc != TDM_OK)
            return rc;
    }
    LNAME(n0, "input_layernorm.weight");
    if ((rc = load_vec(m, st, n0, hidden, &L->input_norm, err, errlen)))
        return rc;
    LNAME(n0, "post_attention_layernorm.weight");
    if ((rc = load_vec(m, st, n0, hidden, &L->post_norm, err, errlen)))
        return rc;
#undef LNAME
    return TDM_OK;
}

// Sets up the packed-weight cache for this load: *id filled (heap, caller
// frees) when an entry is to be used or written; then, when use_entry, maps
// and verifies it (m->wcache on a hit). Problems with the cache only turn it
// off or mark the entry for rebuilding: they never fail the load.
static void wcache_begin(struct tdm_model *m, const char *dir, bool use_entry,
                         struct tdm_wcache_id **id)
{
    char folder[2048], e[512];
    *id = NULL;
    m->info.weight_cache = TDM_WCACHE_OFF;
    if (m->opts.weight_cache_dir == NULL || m->ops->layout_version == 0 ||
        m->ops->adopt_weight == NULL || m->ops->weight_spans == NULL ||
        m->info.checkpoint_bytes < m->opts.weight_cache_min_bytes)
        return;
    const char *want = strcmp(m->opts.weight_cache_dir, "auto") == 0 ? NULL
                                                                     : m->opts.weight_cache_dir;
    if (tdm_wcache_folder(want, folder, sizeof folder) != TDM_OK)
        return;
    struct tdm_wcache_id *wid = malloc(sizeof *wid);
    if (wid == NULL)
        return;
    const char *mode = m->opts.weights == TDM_WEIGHTS_INT8 ? "int8" : "bf16";
    if (tdm_wcache_id_init(wid, folder, dir, m->ops->name, m->ops->layout_version, mode, e,
                           sizeof e) != TDM_OK) {
        TDM_LOG_WARN("model", "weight cache off for this load: %s", e);
        free(wid);
        return;
    }
    // Room to record every weight prepared: 4 per layer, the embedding, the head.
    m->cap_prepared = 4 * m->cfg.num_hidden_layers + 2;
    m->prepared = calloc((size_t)m->cap_prepared, sizeof *m->prepared);
    if (m->prepared == NULL) {
        m->cap_prepared = 0;
        free(wid);
        return;
    }
    *id = wid;
    m->info.weight_cache = TDM_WCACHE_MISS;
    if (!use_entry) {
        m->info.weight_cache = TDM_WCACHE_REBUILT;
        return;
    }
    int rc = tdm_wcache_open(&m->wcache, wid, m->opts.num_threads, e, sizeof e);
    if (rc == TDM_OK) {
        m->info.weight_cache = TDM_WCACHE_HIT;
        TDM_LOG_INFO("model", "weight cache hit: %s (%zu bytes)", wid->path,
                     tdm_wcache_file_bytes(m->wcache));
    } else if (rc == TDM_ENOTFOUND) {
        TDM_LOG_INFO("model", "weight cache miss: %s will be written", wid->path);
    } else {
        m->info.weight_cache = TDM_WCACHE_REBUILT;
        TDM_LOG_WARN("model", "weight cache entry ignored, rebuilding it: %s", e);
    }
}

// Writing an entry: on the loading thread, or on a background thread that
// tdm_model_free joins (the weights it reads are never written after load).
struct wcache_job {
    struct tdm_wcache_id *id;          // owned
    struct tdm_wcache_entry *entries;  // [n] owned, pointing into the model's weights
    int n;
    int rc;
    double seconds;
};

static void wcache_job_run(struct wcache_job *j)
{
    char e[512];
    double t0 = tdm_now();
    j->rc = tdm_wcache_write(j->id, j->entries, j->n, e, sizeof e);
    j->seconds = tdm_now() - t0;
    struct stat st;
    if (j->rc == TDM_OK)
        // Where and how big, so a first start's disk use is no surprise (issue
        // 28, item 4).
        TDM_LOG_INFO("model",
                     "weight cache written: %s (%.0f MB of packed weights, in %.2f s; later "
                     "starts map it; --no-weight-cache or TANDEM_CACHE=off to go without)",
                     j->id->path, stat(j->id->path, &st) == 0 ? st.st_size / 1e6 : 0.0, j->seconds);
    else
        TDM_LOG_WARN("model", "weight cache not written (the model still serves): %s", e);
}

static void *wcache_writer_main(void *arg)
{
#ifdef __linux__
    // Below the engine's threads: serving comes first on a busy machine.
    (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
#endif
    struct wcache_job *j = arg;
    wcache_job_run(j);
    free(j->entries);
    free(j->id);
    free(j);
    return NULL;
}

// Writes the weights prepared by this load as the entry *id names (taking
// *id): now, or on m->writer when opts.weight_cache_background.
static void wcache_finish(struct tdm_model *m, struct tdm_wcache_id **id)
{
    if (*id == NULL)
        return;
    if (m->wcache != NULL) { // a hit: nothing to write
        free(*id);
        *id = NULL;
        return;
    }
    struct wcache_job *j = calloc(1, sizeof *j);
    struct tdm_wcache_entry *entries = calloc((size_t)m->n_prepared + 1, sizeof *entries);
    if (j == NULL || entries == NULL) {
        free(j);
        free(entries);
        m->info.weight_cache = TDM_WCACHE_FAILED;
        TDM_LOG_WARN("model", "weight cache not written: out of memory");
        return;
    }
    for (int i = 0; i < m->n_prepared; i++) {
        const struct tdm_weight *w = m->prepared[i];
        entries[i].type = w->type;
        entries[i].rows = w->rows;
        entries[i].cols = w->cols;
        entries[i].nspans = m->ops->weight_spans(w, entries[i].ptr, entries[i].bytes);
    }
    j->id = *id;
    j->entries = entries;
    j->n = m->n_prepared;
    *id = NULL;
    if (m->opts.weight_cache_background &&
        pthread_create(&m->writer, NULL, wcache_writer_main, j) == 0) {
        m->writer_running = true;
        return;
    }
    wcache_job_run(j);
    m->info.cache_write_seconds = j->seconds;
    if (j->rc != TDM_OK)
        m->info.weight_cache = TDM_WCACHE_FAILED;
    free(j->entries);
    free(j->id);
    free(j);
}

// The options with their defaults filled in (backend, batch limits, threads).
static int model_opts_resolve(struct tdm_model *m, const struct tdm_model_opts *opts, char *err,
                              size_t errlen)
{
    m->opts = *opts;
    if (m->opts.backend == NULL)
        m->opts.backend = "cpu";
    if (m->opts.max_batch_tokens <= 0)
        m->opts.max_batch_tokens = 512;
    if (m->opts.max_batch_seqs <= 0)
        m->opts.max_batch_seqs = 64;
    if (m->opts.num_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        m->opts.num_threads = n > 0 ? (int)n : 1;
    }
    if (m->opts.batch_invariant == TDM_BATCH_INVARIANT_DEFAULT)
        m->opts.batch_invariant = TDM_BATCH_INVARIANT_ON; // until a GPU run says otherwise
    if (m->opts.batch_invariant != TDM_BATCH_INVARIANT_ON &&
        m->opts.batch_invariant != TDM_BATCH_INVARIANT_OFF)
        return tdm_seterr(err, errlen, TDM_EINVAL, "model: unknown batch invariance mode %d",
                          (int)m->opts.batch_invariant);
    if (m->opts.weights != TDM_WEIGHTS_BF16 && m->opts.weights != TDM_WEIGHTS_INT8)
        return tdm_seterr(err, errlen, TDM_EINVAL, "model: unknown weight mode %d",
                          (int)m->opts.weights);
    return TDM_OK;
}

// config.json, checked for what the forward supports, and the derived widths.
static int model_config_load(struct tdm_model *m, const char *dir, char *err, size_t errlen)
{
    int rc;
    if ((rc = tdm_hf_config_load(&m->cfg, dir, err, errlen)) != TDM_OK)
        return rc;
    const struct tdm_model_config *c = &m->cfg;
    if (c->head_dim % 2 != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "config.json: head_dim=%d is odd (RoPE pairs)",
                          c->head_dim);
    if (c->use_sliding_window) {
        // Sliding-window attention is not implemented; refusing beats silently
        // attending to the whole context.
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "config.json: use_sliding_window=true is not supported");
    }
    m->q_dim = c->num_attention_heads * c->head_dim;
    m->kv_dim = c->num_key_value_heads * c->head_dim;
    m->qkv_dim = m->q_dim + 2 * m->kv_dim;
    return TDM_OK;
}

// The named backend, created.
static int model_backend_open(struct tdm_model *m, char *err, size_t errlen)
{
    int rc;
    m->ops = tdm_backend_find(m->opts.backend);
    if (m->ops == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "model: backend \"%s\" is not built in",
                          m->opts.backend);
    if ((rc = m->ops->create(&m->be, m->opts.num_threads, m->opts.device, err, errlen)) != TDM_OK) {
        m->be = NULL;
        return rc;
    }
    // Before any weight: the backend sizes its GEMM scratch by the mode.
    if (m->ops->set_batch_invariant != NULL)
        m->ops->set_batch_invariant(m->be, m->opts.batch_invariant == TDM_BATCH_INVARIANT_ON);
    return TDM_OK;
}

// Every weight from st (or the weight cache entry being adopted), in the
// cache's entry order: the layers, the embedding, the head, the final norm.
static int model_load_weights(struct tdm_model *m, const struct tdm_safetensors *st, char *err,
                              size_t errlen)
{
    const struct tdm_model_config *c = &m->cfg;
    enum tdm_wtype want = m->opts.weights == TDM_WEIGHTS_INT8 ? TDM_W_Q8 : TDM_W_BF16;
    int hidden = c->hidden_size;
    int rc;
    m->layers = calloc((size_t)c->num_hidden_layers, sizeof *m->layers);
    if (m->layers == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "model: out of memory");
    for (int l = 0; l < c->num_hidden_layers; l++)
        if ((rc = load_layer(m, st, l, want, err, errlen)) != TDM_OK)
            return rc;

    const char *embed_name[1] = {"model.embed_tokens.weight"};
    int vocab_rows[1] = {c->vocab_size};
    if ((rc = load_weight(m, st, &m->embed, embed_name, vocab_rows, 1, hidden, TDM_W_BF16, err,
                          errlen)) != TDM_OK)
        return rc;
    if (c->tie_word_embeddings && want == TDM_W_BF16) {
        m->head_is_embed = true;
    } else {
        const char *head_name[1] = {c->tie_word_embeddings ? "model.embed_tokens.weight"
                                                           : "lm_head.weight"};
        if ((rc = load_weight(m, st, &m->lm_head, head_name, vocab_rows, 1, hidden, want, err,
                              errlen)) != TDM_OK)
            return rc;
    }
    if ((rc = load_vec(m, st, "model.norm.weight", hidden, &m->final_norm, err, errlen)))
        return rc;
    if (m->wcache != NULL && m->wcache_next != tdm_wcache_count(m->wcache)) {
        m->wcache_bad = true;
        return tdm_seterr(err, errlen, TDM_EPROTO, "weight cache: %d entries, this model has %d",
                          tdm_wcache_count(m->wcache), m->wcache_next);
    }
    return TDM_OK;
}

// RoPE's inverse frequencies, in backend memory.
static int model_upload_inv_freq(struct tdm_model *m, char *err, size_t errlen)
{
    const struct tdm_model_config *c = &m->cfg;
    float *inv_freq = malloc((size_t)c->head_dim / 2 * sizeof *inv_freq);
    if (inv_freq == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "model: out of memory");
    compute_inv_freq(c, inv_freq);
    int rc =
        upload_vec(m, inv_freq, (size_t)c->head_dim / 2, &m->inv_freq, err, errlen, "inv_freq");
    free(inv_freq);
    return rc;
}

// The activations and row tables for max_batch_tokens rows.
static int model_alloc_activations(struct tdm_model *m, char *err, size_t errlen)
{
    const struct tdm_model_config *c = &m->cfg;
    int hidden = c->hidden_size;
    size_t T = (size_t)m->opts.max_batch_tokens;
    m->x = alloc_f32(m, T * (size_t)hidden);
    m->h = alloc_f32(m, T * (size_t)hidden);
    m->d = alloc_f32(m, T * (size_t)hidden);
    m->qkv = alloc_f32(m, T * (size_t)m->qkv_dim);
    m->attn = alloc_f32(m, T * (size_t)m->q_dim);
    m->gate_up = alloc_f32(m, T * 2 * (size_t)c->intermediate_size);
    m->act = alloc_f32(m, T * (size_t)c->intermediate_size);
    m->pos = calloc(T, sizeof *m->pos);
    m->ids = calloc(T, sizeof *m->ids);
    m->aseqs = calloc((size_t)m->opts.max_batch_seqs, sizeof *m->aseqs);
    m->runs = calloc(2 * (size_t)m->opts.max_batch_seqs, sizeof *m->runs);
    // A chosen row a sequence, or every row of a DRAW_ALL one.
    m->chosen_ids = calloc(T, sizeof *m->chosen_ids);
    m->draw = calloc(T, sizeof *m->draw);
    m->chosen_lp = calloc(T, sizeof *m->chosen_lp);
    m->dest[0] = calloc(T, sizeof *m->dest[0]);
    m->dest[1] = calloc(T, sizeof *m->dest[1]);
    m->gpairs = calloc(2 * (size_t)m->opts.max_batch_seqs, sizeof *m->gpairs);
    if (m->ops->host_memory) {
        m->ids_be = m->ids;
        m->pos_be = m->pos;
    } else {
        m->ids_be = m->ops->alloc(m->be, T * sizeof(int32_t));
        m->pos_be = m->ops->alloc(m->be, T * sizeof(int32_t));
        m->logits_be = alloc_f32(m, T * (size_t)c->vocab_size);
    }
    if (!m->x || !m->h || !m->d || !m->qkv || !m->attn || !m->gate_up || !m->act || !m->pos ||
        !m->ids || !m->aseqs || !m->runs || !m->chosen_ids || !m->draw || !m->chosen_lp ||
        !m->dest[0] || !m->dest[1] || !m->gpairs || !m->ids_be || !m->pos_be ||
        (!m->ops->host_memory && !m->logits_be))
        return tdm_seterr(err, errlen, TDM_ENOMEM,
                          "model: out of memory for activations of %zu tokens", T);
    return TDM_OK;
}

static int model_load(struct tdm_model **out, const char *dir, const struct tdm_model_opts *opts,
                      bool use_entry, bool *entry_bad, char *err, size_t errlen)
{
    struct tdm_wcache_id *wid = NULL;
    struct tdm_model_opts defaults;
    struct tdm_safetensors *st = NULL;
    int rc;

    *out = NULL;
    if (opts == NULL) {
        tdm_model_opts_default(&defaults);
        opts = &defaults;
    }
    struct tdm_model *m = calloc(1, sizeof *m);
    if (m == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "model: out of memory");
    if ((rc = model_opts_resolve(m, opts, err, errlen)) != TDM_OK ||
        (rc = model_config_load(m, dir, err, errlen)) != TDM_OK ||
        (rc = model_backend_open(m, err, errlen)) != TDM_OK ||
        (rc = tdm_st_open(&st, dir, err, errlen)) != TDM_OK)
        goto fail;
    for (size_t i = 0; i < tdm_st_count(st); i++)
        m->info.checkpoint_bytes += tdm_st_at(st, i)->nbytes;
    wcache_begin(m, dir, use_entry, &wid);
    if ((rc = model_load_weights(m, st, err, errlen)) != TDM_OK)
        goto fail;
    tdm_st_free(st);
    st = NULL;
    wcache_finish(m, &wid);
    free(m->prepared);
    m->prepared = NULL;
    m->n_prepared = m->cap_prepared = 0;

    if ((rc = model_upload_inv_freq(m, err, errlen)) != TDM_OK ||
        (rc = model_alloc_activations(m, err, errlen)) != TDM_OK)
        goto fail;
    *out = m;
    return TDM_OK;

fail:
    *entry_bad = m->wcache_bad;
    free(wid);
    tdm_st_free(st);
    tdm_model_free(m);
    return rc;
}

int tdm_model_load(struct tdm_model **out, const char *dir, const struct tdm_model_opts *opts,
                   char *err, size_t errlen)
{
    double t0 = tdm_now();
    bool entry_bad = false;
    int rc = model_load(out, dir, opts, true, &entry_bad, err, errlen);
    if (rc != TDM_OK && entry_bad) {
        // A verified entry that still does not fit (written by another build
        // of the same layout version): prepare the weights and rewrite it.
        TDM_LOG_WARN("model", "weight cache entry does not fit, rebuilding it: %s", err);
        rc = model_load(out, dir, opts, false, &entry_bad, err, errlen);
    }
    if (rc == TDM_OK)
        (*out)->info.seconds = tdm_now() - t0;
    return rc;
}

// ---- forward ---------------------------------------------------------------------------

// Checks everything the kernels would otherwise trust; returns total rows.
static int validate_batch(const struct tdm_model *m, const struct tdm_kv_cache *kv,
                          const struct tdm_batch_seq *seqs, int n_seqs, int *n_rows,
                          int *n_logit_rows, int *n_chosen)
{
    const struct tdm_model_config *c = &m->cfg;
    const struct tdm_kv_config *kc = tdm_kv_config(kv);
    if (seqs == NULL || n_seqs <= 0 || n_seqs > m->opts.max_batch_seqs)
        return TDM_EINVAL;
    if (kc->num_layers != c->num_hidden_layers || kc->num_kv_heads != c->num_key_value_heads ||
        kc->head_dim != c->head_dim || kc->block_size <= 0)
        return TDM_EINVAL;
    int total = 0, logit_rows = 0, chosen_rows = 0;
    for (int s = 0; s < n_seqs; s++) {
        const struct tdm_batch_seq *q = &seqs[s];
        if (q->tokens == NULL || q->block_table == NULL || q->n_tokens <= 0 || q->start_pos < 0 ||
            q->prompt_len < 0)
            return TDM_EINVAL;
        if (q->n_tokens > m->opts.max_batch_tokens - total)
            return TDM_EINVAL;
        if (q->start_pos > c->max_position_embeddings - q->n_tokens)
            return TDM_EINVAL;
        // A from_prev row's tokens[0] is the last forward's chosen token.
        if (q->from_prev && (q->prev_row < 0 || q->prev_row >= m->last_chosen ||
                             (!m->ops->host_memory && m->ops->gather_ids == NULL)))
            return TDM_EINVAL;
        for (int i = q->from_prev ? 1 : 0; i < q->n_tokens; i++)
            if (q->tokens[i] < 0 || q->tokens[i] >= c->vocab_size)
                return TDM_EINVAL;
        int nblocks = (q->start_pos + q->n_tokens + kc->block_size - 1) / kc->block_size;
        for (int b = 0; b < nblocks; b++)
            if (q->block_table[b] < 0 || q->block_table[b] >= kc->num_blocks)
                return TDM_EINVAL;
        switch (q->logits) {
        case TDM_LOGITS_NONE:
            break;
        case TDM_LOGITS_LAST:
            logit_rows += 1;
            break;
        case TDM_LOGITS_ALL:
            logit_rows += q->n_tokens;
            break;
        case TDM_LOGITS_ARGMAX:
            if (!tdm_model_fused_argmax(m) || q->token_out == NULL)
                return TDM_EINVAL;
            chosen_rows += 1;
            break;
        case TDM_LOGITS_SAMPLE:
            if (!tdm_model_device_sampling(m) || q->token_out == NULL || q->draw == NULL ||
                q->draw->n_adj < 0 || (q->draw->n_adj > 0 && q->adj == NULL) ||
                (q->draw->logprobs && (q->logprobs_out == NULL || q->draw->top_logprobs < 0 ||
                                       q->draw->top_logprobs > TDM_DRAW_MAX_LOGPROBS)) ||
                (q->draw->rec_flags & ~TDM_DRAW_ADJ_SEEN) != 0 ||
                // A device list (sample_draw.h): a row read from it brings
                // no entries of its own.
                q->draw->list < 0 || (q->draw->list_load != 0 && q->draw->list_load != 1) ||
                (q->draw->list > 0 && !q->draw->list_load && q->draw->n_adj != 0))
                return TDM_EINVAL;
            for (int i = 0; i < q->draw->n_adj; i++) {
                const struct tdm_draw_adj *a = &q->adj[i];
                // A pending token (sample_draw.h): the last entry of a
                // from_prev row, naming a chosen row of the last forward.
                if ((a->flags & TDM_DRAW_ADJ_PENDING) &&
                    (i != q->draw->n_adj - 1 || !q->from_prev || m->ops->host_memory ||
                     (a->flags & ~(TDM_DRAW_ADJ_PENDING | TDM_DRAW_ADJ_SEEN)) != 0 ||
                     a->token < 0 || a->token >= m->last_chosen))
                    return TDM_EINVAL;
                if (!(a->flags & TDM_DRAW_ADJ_PENDING) &&
                    (a->token < 0 || a->token >= c->vocab_size))
                    return TDM_EINVAL;
            }
            chosen_rows += 1;
            break;
        case TDM_LOGITS_DRAW_ALL:
            if (!tdm_model_device_sampling(m) || q->token_out == NULL || q->draw == NULL ||
                q->allow != NULL)
                return TDM_EINVAL;
            for (int r = 0; r < q->n_tokens; r++) {
                const struct tdm_draw_params *d = &q->draw[r];
                if (d->n_adj < 0 || d->adj_off < 0 || (d->n_adj > 0 && q->adj == NULL) ||
                    d->list != 0 ||
                    (d->logprobs && (q->logprobs_out == NULL || d->top_logprobs < 0 ||
                                     d->top_logprobs > TDM_DRAW_MAX_LOGPROBS)))
                    return TDM_EINVAL;
                for (int i = 0; i < d->n_adj; i++)
                    if (q->adj[d->adj_off + i].token < 0 ||
                        q->adj[d->adj_off + i].token >= c->vocab_size ||
                        (q->adj[d->adj_off + i].flags & TDM_DRAW_ADJ_PENDING))
                        return TDM_EINVAL;
            }
            chosen_rows += q->n_tokens;
            break;
        default:
            return TDM_EINVAL;
        }
        total += q->n_tokens;
    }
    *n_rows = total;
    *n_logit_rows = logit_rows;
    *n_chosen = chosen_rows;
    return TDM_OK;
}

// A sublayer's norm: x += d first when d holds the previous sublayer's output
// (one op where the backend fuses them), then out = rmsnorm(x).
static void add_norm(struct tdm_model *m, const float *d, const float *weight, void *out, int n)
{
    int dim = m->cfg.hidden_size;
    float eps = m->cfg.rms_norm_eps;
    if (d && m->ops->add_rmsnorm) {
        m->ops->add_rmsnorm(m->be, m->x, d, weight, eps, out, n, dim);
        return;
    }
    if (d)
        m->ops->add(m->be, m->x, d, (size_t)n * (size_t)dim);
    m->ops->rmsnorm(m->be, m->x, weight, eps, out, n, dim);
}

// A sequence whose tokens the model chooses (the fused argmax, a device's
// draw): its logits stay where they are made.
static bool chosen(const struct tdm_batch_seq *q)
{
    return q->logits == TDM_LOGITS_ARGMAX || q->logits == TDM_LOGITS_SAMPLE ||
           q->logits == TDM_LOGITS_DRAW_ALL;
}

// Its chosen rows: the last, or every one (DRAW_ALL).
static int chosen_rows(const struct tdm_batch_seq *q)
{
    return q->logits == TDM_LOGITS_DRAW_ALL ? q->n_tokens : chosen(q) ? 1 : 0;
}

// The draw of a chosen row (NULL: the argmax).
static const struct tdm_draw_params *row_draw(const struct tdm_batch_seq *q, int i)
{
    return q->logits == TDM_LOGITS_DRAW_ALL ? &q->draw[i]
           : q->logits == TDM_LOGITS_SAMPLE ? q->draw
                                            : NULL;
}

// Where the chosen rows' tokens go (batch order of the ARGMAX, SAMPLE and
// DRAW_ALL rows), with the logprobs of the rows that asked: out[k] for chosen
// row k; returns their count.
static int chosen_dests(const struct tdm_batch_seq *seqs, int n_seqs, struct chosen_dest *out)
{
    int k = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int i = 0; i < chosen_rows(&seqs[s]); i++, k++) {
            const struct tdm_draw_params *d = row_draw(&seqs[s], i);
            out[k] = (struct chosen_dest){.tok = seqs[s].token_out + i,
                                          .lp = d && d->logprobs ? seqs[s].logprobs_out + i : NULL};
        }
    return k;
}

// The chosen rows' tokens and asked logprobs (chosen_ids, chosen_lp) to their
// destinations.
static void scatter_chosen(struct tdm_model *m, const struct chosen_dest *dest, int n)
{
    for (int k = 0; k < n; k++) {
        if (dest[k].lp)
            *dest[k].lp = m->chosen_lp[k];
        *dest[k].tok = m->chosen_ids[k];
    }
}

// One forward's shape: its rows, the head's rows and how it runs.
struct fwd_plan {
    int n;            // rows run (a graph's bucket: padding included)
    int n_seqs_run;   // sequences run (a graph's bucket: padding included)
    int n_logit_rows; // rows the head computes logits for (a graph's whole bucket)
    int n_logit_real; // logits rows the caller gets
    int n_chosen;     // ARGMAX and SAMPLE rows
    int n_runs;       // m->runs: the rows by GEMM class (a backend with matmul_runs)
    int n_gather;     // m->gpairs: from_prev rows whose token the device fills in
    bool any_prompt;  // some row is a prompt row, on a backend with matmul_runs
    bool any_hook;    // a sequence has an on_layer hook
    bool in_order;    // the head's rows are the batch's rows in order
    bool graph;       // runs as a CUDA graph of its bucket
};

// Appends rows [row, row + n) of class cls to the step's runs, merged with
// the last run when it is of the same class and ends at row.
static void add_run(struct tdm_model *m, struct fwd_plan *pl, int row, int n,
                    enum tdm_gemm_class cls)
{
    struct tdm_row_run *last = pl->n_runs > 0 ? &m->runs[pl->n_runs - 1] : NULL;
    if (n <= 0)
        return;
    if (last && last->cls == cls && last->row + last->n == row)
        last->n += n;
    else
        m->runs[pl->n_runs++] = (struct tdm_row_run){.row = row, .n = n, .cls = cls};
}

// Packs the rows: token ids, positions and each sequence's slice, and the
// rows' GEMM runs by class where the backend has them (a sequence's rows at
// positions below its prompt_len are prompt rows, by what they are, not by
// the chunk). Returns whether the step is decode-only (one row per sequence,
// each LAST or ARGMAX).
static bool pack_rows(struct tdm_model *m, const struct tdm_batch_seq *seqs, int n_seqs,
                      struct fwd_plan *pl)
{
    int row = 0;
    bool all_decode = true;
    pl->n_runs = 0;
    pl->n_gather = 0;
    pl->any_prompt = false;
    for (int s = 0; s < n_seqs; s++) {
        const struct tdm_batch_seq *q = &seqs[s];
        int n_prompt = q->prompt_len - q->start_pos;
        n_prompt = n_prompt < 0 ? 0 : n_prompt > q->n_tokens ? q->n_tokens : n_prompt;
        if (m->ops->matmul_runs) {
            pl->any_prompt |= n_prompt > 0;
            add_run(m, pl, row, n_prompt, TDM_GEMM_PROMPT);
            add_run(m, pl, row + n_prompt, q->n_tokens - n_prompt, TDM_GEMM_DECODE);
        }
        m->aseqs[s] = (struct tdm_attn_seq){.row = row,
                                            .n_tokens = q->n_tokens,
                                            .start_pos = q->start_pos,
                                            .block_table = q->block_table};
        for (int i = 0; i < q->n_tokens; i++) {
            m->ids[row] = q->tokens[i];
            if (i == 0 && q->from_prev && m->ops->host_memory) {
                m->ids[row] = m->chosen_ids[q->prev_row]; // the last forward's, at its end
            } else if (i == 0 && q->from_prev) {
                m->ids[row] = 0; // gathered on the device once uploaded
                m->gpairs[2 * pl->n_gather] = row;
                m->gpairs[2 * pl->n_gather + 1] = q->prev_row;
                pl->n_gather++;
            }
            m->pos[row] = q->start_pos + i;
            row++;
        }
        all_decode &= q->n_tokens == 1 && (q->logits == TDM_LOGITS_LAST || chosen(q));
    }
    return all_decode;
}

// Decides how the packed batch runs; a graph step's padding rows are packed
// after the batch's.
static void plan_forward(struct tdm_model *m, const struct tdm_batch_seq *seqs, int n_seqs,
                         bool all_decode, struct fwd_plan *pl)
{
    pl->any_hook = false;
    for (int s = 0; s < n_seqs; s++)
        pl->any_hook |= seqs[s].on_layer != NULL;

    // A decode-only step runs as a CUDA graph of its padded bucket (vLLM's
    // cudagraph capture sizes): rows n_seqs .. bucket-1 are padding (token 0
    // at position 0, no KV write) whose outputs are never read.
    // ... all LAST or all ARGMAX (the graph ends with the head's logits either
    // way; the ARGMAX rows' ids are taken after it): the head's rows are then
    // the batch's rows in order (in_order).
    pl->in_order = all_decode && (pl->n_chosen == 0 || pl->n_chosen == n_seqs);
    // ... and no prompt row (a prompt's 1-token last chunk): a graph's GEMMs are
    // its bucket's decode GEMMs.
    pl->graph = m->ops->graph_begin != NULL && !m->opts.enforce_eager && pl->in_order &&
                !pl->any_hook && !pl->any_prompt;
    pl->n_seqs_run = n_seqs;
    if (pl->graph) {
        int bucket = 1;
        while (bucket < n_seqs)
            bucket *= 2;
        if (bucket > m->opts.max_batch_seqs || bucket > m->opts.max_batch_tokens)
            bucket = n_seqs;
        for (int s = n_seqs; s < bucket; s++) {
            m->aseqs[s] = (struct tdm_attn_seq){
                .row = s, .n_tokens = 1, .start_pos = 0, .block_table = m->pad_table, .pad = true};
            m->ids[s] = 0;
            m->pos[s] = 0;
        }
        pl->n_seqs_run = bucket;
        pl->n = bucket;
        pl->n_logit_rows = bucket; // the padding rows' logits are computed, never copied out
    }
    pl->n_logit_real = pl->graph ? (pl->n_chosen > 0 ? 0 : n_seqs) : pl->n_logit_rows;
}

// A layer's GEMM over the step's rows: by class where the step has prompt
// rows and the backend has classes, else one call (decode-only steps: the
// launches of before).
static void layer_matmul(struct tdm_model *m, const struct fwd_plan *pl, const struct tdm_weight *w,
                         const float *bias, const void *x, float *y)
{
    if (pl->any_prompt)
        m->ops->matmul_runs(m->be, w, bias, x, y, m->runs, pl->n_runs);
    else
        m->ops->matmul(m->be, w, bias, x, y, pl->n);
}

// The decoder layers over the packed rows; *pending: the last sublayer's
// output, still to be added to x (NULL when there are no layers).
static int forward_layers(struct tdm_model *m, struct tdm_kv_cache *kv,
                          const struct tdm_batch_seq *seqs, int n_seqs, const struct fwd_plan *pl,
                          const float **pending)
{
    const struct tdm_model_config *c = &m->cfg;
    const struct tdm_backend_ops *ops = m->ops;
    struct tdm_backend *be = m->be;
    int n = pl->n, n_seqs_run = pl->n_seqs_run, inter = c->intermediate_size, hd = c->head_dim;
    float scale = 1.0f / sqrtf((float)hd);
    int n_q = c->num_attention_heads, n_kv = c->num_key_value_heads;
    int rc;
    // Each sublayer's output waits in d for the next norm, which adds it to x
    // (the residual) as it normalises: one op where the backend fuses them.
    *pending = NULL;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const struct tdm_layer *L = &m->layers[l];
        // Attention block. q, k, v live side by side in each qkv row.
        add_norm(m, *pending, L->input_norm, m->h, n);
        layer_matmul(m, pl, &L->qkv, L->qkv_bias, m->h, m->qkv);
        if (ops->rope_store_attention && !pl->any_hook) {
            ops->rope_store_attention(be, kv, l, m->aseqs, n_seqs_run, m->qkv, m->qkv_dim,
                                      m->pos_be, m->inv_freq, m->attn, n_q, n_kv, hd, scale);
        } else {
            // k follows q in each row with the same head_dim, so one call
            // rotates the n_heads query heads and the n_kv_heads key heads.
            ops->rope(be, m->qkv, n, m->qkv_dim, n_q + n_kv, hd, m->pos_be, m->inv_freq);
            ops->kv_store(be, kv, l, m->aseqs, n_seqs_run, m->qkv + m->q_dim,
                          m->qkv + m->q_dim + m->kv_dim, m->qkv_dim);
            // Layer l's KV is in the cache (ops are synchronous, or issued on
            // a device stream: the mark orders the storage's exports and
            // waits after these stores, not after the layers above): a hook
            // may hand it to a sender while the layers above still compute.
            if (pl->any_hook && (rc = tdm_kv_mark_layer(kv, l)) != TDM_OK)
                return rc;
            for (int s = 0; pl->any_hook && s < n_seqs; s++)
                if (seqs[s].on_layer)
                    seqs[s].on_layer(seqs[s].layer_arg, l);
            ops->attention(be, kv, l, m->aseqs, n_seqs_run, m->qkv, m->qkv_dim, m->attn, n_q, n_kv,
                           hd, scale);
        }
        layer_matmul(m, pl, &L->o, NULL, m->attn, m->d);
        // MLP block (SwiGLU).
        add_norm(m, m->d, L->post_norm, m->h, n);
        // The product [n][2 * inter] round-trips through memory unless the
        // backend fuses the two (the decode class's GEMM only).
        if (pl->any_prompt || !ops->matmul_silu_mul ||
            !ops->matmul_silu_mul(be, &L->gate_up, m->h, m->act, n)) {
            layer_matmul(m, pl, &L->gate_up, NULL, m->h, m->gate_up);
            ops->silu_mul(be, m->gate_up, m->act, n, inter);
        }
        layer_matmul(m, pl, &L->down, NULL, m->act, m->d);
        *pending = m->d;
    }
    return TDM_OK;
}

// Gathers the rows that want logits from x into d (batch order), the
// chosen rows (ARGMAX, SAMPLE) after the logits rows (batch order within each
// group).
static int gather_head_rows(struct tdm_model *m, const struct tdm_batch_seq *seqs, int n_seqs,
                            int n_logit_rows)
{
    int hidden = m->cfg.hidden_size;
    int out_row = 0, arg_row = n_logit_rows;
    for (int s = 0; s < n_seqs; s++) {
        const struct tdm_batch_seq *q = &seqs[s];
        int first = m->aseqs[s].row, count = 0, *at = &out_row;
        if (q->logits == TDM_LOGITS_LAST || chosen(q)) {
            count = chosen_rows(q) > 1 ? q->n_tokens : 1;
            first += q->n_tokens - count;
            if (chosen(q))
                at = &arg_row;
        } else if (q->logits == TDM_LOGITS_ALL) {
            count = q->n_tokens;
        }
        if (count > 0) {
            // d and x are distinct buffers, so copy's no-overlap rule holds.
            size_t bytes = (size_t)count * hidden * sizeof(float);
            int rc;
            if (m->ops->host_memory)
                memcpy(m->d + (size_t)*at * hidden, m->x + (size_t)first * hidden, bytes);
            else if ((rc = m->ops->copy(m->be, m->d + (size_t)*at * hidden,
                                        m->x + (size_t)first * hidden, bytes)) != TDM_OK)
                return rc;
            *at += count;
        }
    }
    return TDM_OK;
}

// The final norm and the head: on a host-memory backend into the caller's
// logits (and the ARGMAX rows' ids), else into logits_be.
static int forward_head(struct tdm_model *m, const struct tdm_batch_seq *seqs, int n_seqs,
                        const struct fwd_plan *pl, const float *pending, float *logits)
{
    const struct tdm_backend_ops *ops = m->ops;
    struct tdm_backend *be = m->be;
    int hidden = m->cfg.hidden_size, n_logit_rows = pl->n_logit_rows, n_chosen = pl->n_chosen;
    int rc;
    // A decode step whose rows all want logits (or all their argmax), in
    // batch order (every graph step): the last residual add and the final
    // norm of every row in one op. Else the rows that want logits are
    // gathered (in batch order) into d after the add, then normed into h.
    const float *head_in = m->d;
    if (pl->in_order) {
        add_norm(m, pending, m->final_norm, m->h, pl->n);
        head_in = NULL;
    } else if (pending) {
        ops->add(be, m->x, pending, (size_t)pl->n * (size_t)hidden);
    }
    if (head_in && (rc = gather_head_rows(m, seqs, n_seqs, n_logit_rows)) != TDM_OK)
        return rc;
    // A graph step's rows are its bucket's (padding included), all LAST or all
    // ARGMAX; else the LAST/ALL rows, then the ARGMAX rows.
    int head_rows = pl->graph ? n_logit_rows : n_logit_rows + n_chosen;
    if (head_in)
        ops->rmsnorm(be, head_in, m->final_norm, m->cfg.rms_norm_eps, m->h, head_rows, hidden);
    // One lm_head read for all logit rows (n_logit_rows <= n fits the workspace).
    const struct tdm_weight *head = m->head_is_embed ? &m->embed : &m->lm_head;
    if (ops->host_memory) {
        if (n_chosen > 0) {
            // Greedy rows: the head's argmax without writing their logits.
            if ((rc = ops->matmul_argmax(be, head, NULL, m->h + (size_t)n_logit_rows * hidden,
                                         n_chosen, m->chosen_ids)) != TDM_OK)
                return rc;
            scatter_chosen(m, m->dest[0], chosen_dests(seqs, n_seqs, m->dest[0]));
        }
        if (n_logit_rows > 0)
            ops->matmul(be, head, NULL, m->h, logits, n_logit_rows);
        return TDM_OK;
    }
    ops->matmul(be, head, NULL, m->h, m->logits_be, head_rows);
    return TDM_OK;
}

// The chosen rows (over the logits rows after the n_logit_real LAST/ALL
// ones): their tokens, and the logprobs their draws ask.
static int forward_chosen(struct tdm_model *m, const struct tdm_batch_seq *seqs, int n_seqs,
                          const struct fwd_plan *pl)
{
    const struct tdm_backend_ops *ops = m->ops;
    struct tdm_backend *be = m->be;
    int vocab = m->cfg.vocab_size;
    int rc;
    float *rows = m->logits_be + (size_t)pl->n_logit_real * vocab;
    bool any_draw = false;
    int n_adj = 0;
    size_t words = ((size_t)vocab + 31) / 32, mask_words = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int i = 0; i < chosen_rows(&seqs[s]); i++) {
            const struct tdm_draw_params *d = row_draw(&seqs[s], i);
            if (d == NULL)
                continue;
            any_draw = true;
            n_adj += d->n_adj;
            mask_words += seqs[s].allow ? words : 0;
        }
    if (n_adj > m->adj_cap) {
        struct tdm_draw_adj *grown = realloc(m->adj, (size_t)n_adj * sizeof *grown);
        if (grown == NULL)
            return TDM_ENOMEM;
        m->adj = grown;
        m->adj_cap = n_adj;
    }
    if (mask_words > m->mask_cap) {
        uint32_t *grown = realloc(m->masks, mask_words * sizeof *grown);
        if (grown == NULL)
            return TDM_ENOMEM;
        m->masks = grown;
        m->mask_cap = mask_words;
    }
    if (any_draw && m->choose_hook)
        m->choose_hook(m->choose_arg); // the masks, computed while the layers ran
    // The chosen rows' draws (a greedy row's: inv_t 0) and their adjustments
    // in one array, each row's at its offset.
    n_adj = 0;
    mask_words = 0;
    for (int s = 0, k = 0; s < n_seqs; s++)
        for (int i = 0; i < chosen_rows(&seqs[s]); i++) {
            const struct tdm_batch_seq *q = &seqs[s];
            const struct tdm_draw_params *qd = row_draw(q, i);
            struct tdm_draw_params *d = &m->draw[k++];
            *d = (struct tdm_draw_params){0};
            if (qd == NULL)
                continue;
            // A SAMPLE row's adjustments start at adj, a DRAW_ALL row's at its
            // offset there.
            const struct tdm_draw_adj *qa =
                q->logits == TDM_LOGITS_DRAW_ALL ? q->adj + qd->adj_off : q->adj;
            *d = *qd;
            d->adj_off = n_adj;
            if (d->n_adj > 0)
                memcpy(m->adj + n_adj, qa, (size_t)d->n_adj * sizeof *qa);
            n_adj += d->n_adj;
            d->mask_off = (int32_t)mask_words;
            d->n_mask_words = q->allow ? (int32_t)words : 0;
            if (q->allow) {
                memcpy(m->masks + mask_words, q->allow, words * sizeof *q->allow);
                mask_words += words;
            }
        }
    rc = any_draw ? ops->sample_rows(be, rows, pl->n_chosen, vocab, m->draw, m->adj, n_adj,
                                     m->masks, mask_words)
                  : ops->argmax_rows(be, rows, pl->n_chosen, vocab);
    if (rc != TDM_OK)
        return rc;
    // In flight until tdm_model_forward_wait takes its tokens.
    int slot = (m->fl_head + m->n_inflight) % 2;
    m->dest_n[slot] = chosen_dests(seqs, n_seqs, m->dest[slot]);
    m->n_inflight++;
    return TDM_OK;
}

// A device backend's step end: the graph closed, the chosen rows' tokens
// taken (their argmax when all are greedy, else the draw of each: an ARGMAX
// row's is the argmax, inv_t 0) and the logits rows downloaded.
static int forward_finish(struct tdm_model *m, const struct tdm_batch_seq *seqs, int n_seqs,
                          const struct fwd_plan *pl, float *logits)
{
    const struct tdm_backend_ops *ops = m->ops;
    struct tdm_backend *be = m->be;
    int rc;
    if (pl->graph && (rc = ops->graph_end(be)) != TDM_OK)
        return rc;
    // The chosen rows' tokens first: their draws are issued right behind the
    // head, without a wait (their inputs are staged), and their ids come back
    // in the step's wait; the logits rows (sampled on the host) then copy from
    // an idle device.
    if (pl->n_chosen > 0 && (rc = forward_chosen(m, seqs, n_seqs, pl)) != TDM_OK)
        return rc;
    if (pl->n_logit_real > 0)
        return ops->download(be, logits, m->logits_be,
                             (size_t)pl->n_logit_real * (size_t)m->cfg.vocab_size * sizeof(float));
    return TDM_OK;
}

// Issues one forward; *issued: some of its work reached the backend.
static int forward_issue(struct tdm_model *m, struct tdm_kv_cache *kv,
                         const struct tdm_batch_seq *seqs, int n_seqs, float *logits, bool *issued)
{
    *issued = false;
    if (m == NULL || kv == NULL || m->n_inflight >= 2)
        return TDM_EINVAL;
    struct fwd_plan pl;
    int rc = validate_batch(m, kv, seqs, n_seqs, &pl.n, &pl.n_logit_rows, &pl.n_chosen);
    if (rc != TDM_OK)
        return rc;
    if (pl.n_logit_rows > 0 && logits == NULL)
        return TDM_EINVAL;

    const struct tdm_backend_ops *ops = m->ops;
    struct tdm_backend *be = m->be;
    bool all_decode = pack_rows(m, seqs, n_seqs, &pl);
    plan_forward(m, seqs, n_seqs, all_decode, &pl);
    *issued = true;
    m->last_chosen = 0;
    if (!ops->host_memory) {
        if ((rc = ops->upload(be, m->ids_be, m->ids, (size_t)pl.n * sizeof(int32_t))) != TDM_OK ||
            (rc = ops->upload(be, m->pos_be, m->pos, (size_t)pl.n * sizeof(int32_t))) != TDM_OK ||
            (pl.n_gather > 0 &&
             (rc = ops->gather_ids(be, m->ids_be, m->gpairs, pl.n_gather)) != TDM_OK))
            return rc;
    }
    bool replay = false;
    if (pl.graph) {
        if ((rc = ops->graph_begin(be, kv, m->aseqs, pl.n_seqs_run, &replay)) != TDM_OK)
            return rc;
    } else if (ops->begin_forward &&
               (rc = ops->begin_forward(be, kv, m->aseqs, n_seqs)) != TDM_OK) {
        return rc;
    }
    if (!replay) { // a replayed graph already holds the step's logits
        const float *pending;
        ops->embed(be, &m->embed, m->ids_be, pl.n, m->x);
        if ((rc = forward_layers(m, kv, seqs, n_seqs, &pl, &pending)) != TDM_OK)
            return rc;
        if (pl.n_logit_rows == 0 && pl.n_chosen == 0)
            return ops->sync ? ops->sync(be) : TDM_OK; // x's last residual add is never read
        if ((rc = forward_head(m, seqs, n_seqs, &pl, pending, logits)) != TDM_OK)
            return rc;
        if (ops->host_memory) {
            m->last_chosen = pl.n_chosen;
            return TDM_OK;
        }
    }
    if ((rc = forward_finish(m, seqs, n_seqs, &pl, logits)) == TDM_OK)
        m->last_chosen = pl.n_chosen;
    return rc;
}

// Takes the oldest forward in flight's tokens to their destinations.
static int forward_take(struct tdm_model *m)
{
    int slot = m->fl_head;
    m->fl_head = (m->fl_head + 1) % 2;
    m->n_inflight--;
    int rc = m->ops->take_results(m->be, m->chosen_ids, m->chosen_lp);
    if (rc == TDM_OK)
        scatter_chosen(m, m->dest[slot], m->dest_n[slot]);
    return rc;
}

int tdm_model_forward_issue(struct tdm_model *m, struct tdm_kv_cache *kv,
                            const struct tdm_batch_seq *seqs, int n_seqs, float *logits)
{
    bool issued;
    int rc = forward_issue(m, kv, seqs, n_seqs, logits, &issued);
    if (rc != TDM_OK && issued) {
        // Every forward in flight ends with the failed one: the device idle,
        // their results taken and dropped (the backend's error reported once).
        if (m->ops->sync)
            (void)m->ops->sync(m->be);
        while (m->n_inflight > 0)
            (void)forward_take(m);
        m->last_chosen = 0;
    }
    return rc;
}

int tdm_model_forward_wait(struct tdm_model *m)
{
    if (m == NULL)
        return TDM_EINVAL;
    if (m->n_inflight == 0)
        return TDM_OK;
    int rc = forward_take(m);
    if (rc != TDM_OK)
        m->last_chosen = 0;
    return rc;
}

int tdm_model_forward_pending(const struct tdm_model *m)
{
    return m ? m->n_inflight : 0;
}

bool tdm_model_forward_async(const struct tdm_model *m)
{
    return !m->ops->host_memory && m->ops->take_results != NULL && m->ops->gather_ids != NULL;
}

int tdm_model_forward(struct tdm_model *m, struct tdm_kv_cache *kv,
                      const struct tdm_batch_seq *seqs, int n_seqs, float *logits)
{
    int rc = tdm_model_forward_issue(m, kv, seqs, n_seqs, logits);
    while (rc == TDM_OK && m->n_inflight > 0)
        rc = tdm_model_forward_wait(m);
    return rc;
}
