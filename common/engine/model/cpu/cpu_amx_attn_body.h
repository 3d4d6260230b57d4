// SPDX-License-Identifier: Apache-2.0
// cpu_amx_attn_body: causal GQA attention over a bf16 paged KV cache on
// AMX-BF16 tiles (an f32 pool keeps the per-query f32 kernels: it is the
// choice of f32 attention), written once against the tile macros of cpu_amx_body.h (AMX_ATTR,
// AMX_STATE, AMX_LOADCFG, AMX_ZERO, AMX_LOAD, AMX_STORE, AMX_DP, AMX_RELEASE)
// plus
//   AMX_ATTN      the function's name
//   AMXV(name)    the element-wise helpers of the instantiation: pack_q,
//                 softmax, transpose, accum and finish (AVX-512 for the
//                 real tiles, their scalar twins for the software model,
//                 bit for bit the same)
// and included twice by cpu_kernels_amx.c. No include guard, on purpose.
//
// A task's rows are its (query token, head) pairs, token-major (row r: token
// i0 + r / nh, head h0 + r % nh), 16 to a row tile. Per span of
// CPU_ATTN_SPAN positions (as the per-query kernels' spans):
//   the span's keys are read in place when their rows are whole 32-dim tiles
//   and the blocks hold whole 16-key chunks, else copied into kb as rows of
//   hdp (head_dim rounded up to 32) dims, zeros past head_dim; the values,
//   zeros past the span's last key (up to a multiple of 32) and past
//   head_dim, are transposed into vT (the prefetches of the next rows are
//   spread over the span's pieces of work);
//   S^T = K . Q^T, per 16 keys: A = 16 key rows (32 dims a tile), B =
//   the row tile's q in pairs of dims ([16 pairs][16 rows][2] bf16, packed
//   once per task) as hi + lo (hi = q rounded to bf16, lo = the rest
//   rounded: q to ~16 bits, as the scores' exp amplifies their error), C =
//   [16 keys][16 rows] f32, per 32 dims one TDPBF16PS with hi, then lo;
//   the online softmax step (AMXV(softmax)) runs on S^T a lane per row:
//   scores times scale, keys past a row's position masked out, the span's
//   max, corr = exp(m_old - m_new), p = exp(s - m_new), the running sum in
//   four partials by key mod 4, and p written in key pairs as the B tiles of
//   O^T = V^T . P^T ([16 key pairs][16 rows][2] bf16), as hi + lo too;
//   O^T per 16 dims: A = 16 dims x 32 keys of vT, per 32 keys one
//   TDPBF16PS with hi, then lo, C from zero each span; acc = acc * corr + C
//   (AMXV(accum)).
// The output is acc * (1 / l). q and p are carried as two bf16 each (~16
// bits: rounding either to one bf16 doubled the error of the model_reference
// corpus), the keys and values are bf16 in the pool; scores, sums and
// accumulators are f32.
//
// Invariance: a row's result depends on its position, its q and the cache
// only. Tile rows never mix (C row / column n reads only its own A row / B
// column); the chunks of 32 keys are aligned to the span, whatever the other
// rows of the tile; a key past a row's position gets p = +0, so it adds
// nothing to its sums (its value row is a real cache row or zeros, never
// uninitialized memory); a span past a whole row tile's positions is skipped,
// and one past some of its rows leaves them as they were (corr = 1, the sums
// add zeros). So prefill in any chunks, decode and any batch give a query
// the same bits (tested in cpu_backend_test on this kernel and its model).

static AMX_ATTR void AMX_ATTN(const struct cpu_attn_job *j, const struct tdm_attn_seq *sq, int i0,
                              int i1, int kvh, int h0, int nh, uint8_t *scratch)
{
    AMX_STATE;
    enum { TMAX = CPU_ATTN_TASK_TOKENS * CPU_ATTN_MAX_GROUP / 16, SPAN = CPU_ATTN_SPAN };
    const int hd = j->head_dim, bs = j->block_size;
    const int hdp = (hd + 31) / 32 * 32;
    const int R = (i1 - i0) * nh, T = (R + 15) / 16;
    uint8_t *sp = scratch;
    uint32_t *qT = (uint32_t *)sp; // [T][hi, lo][hdp / 2][16] dim pairs of q
    sp += (size_t)TMAX * hdp * 64;
    float *acc = (float *)sp; // [T][hdp][16]
    sp += (size_t)TMAX * hdp * 64;
    float *mrow = (float *)sp, *lrow = mrow + TMAX * 16; // [T][16] each
    sp += (size_t)TMAX * 2 * 64;
    uint16_t *kb = (uint16_t *)sp; // [SPAN][hdp] (copied keys)
    sp += (size_t)SPAN * hdp * 2;
    uint16_t *vT = (uint16_t *)sp; // [hdp][SPAN]
    sp += (size_t)SPAN * hdp * 2;
    float *sT = (float *)sp; // [SPAN][16]
    sp += (size_t)SPAN * 64;
    uint32_t *pT = (uint32_t *)sp; // [hi, lo][SPAN / 2][16]
    sp += (size_t)SPAN * 64;
    float *cpk = (float *)sp; // [4][16][16]: a set of C tiles

    // Rows: position (-1: a padding row, every key masked) and q as hi + lo
    // in dim pairs (AMXV(pack_q)).
    int prow[TMAX * 16];
    for (int tt = 0; tt < T; tt++) {
        const float *qrow[16];
        for (int i = 0; i < 16; i++) {
            const int r = tt * 16 + i;
            prow[r] = r < R ? sq->start_pos + i0 + r / nh : -1;
            qrow[i] = r < R ? j->q + (size_t)(sq->row + i0 + r / nh) * j->q_stride +
                                  (size_t)(h0 + r % nh) * hd
                            : NULL;
        }
        AMXV(pack_q)(qT + (size_t)tt * 2 * (hdp / 2) * 16, qrow, hd, hdp);
    }
    memset(acc, 0, (size_t)T * hdp * 64);
    for (int r = 0; r < T * 16; r++)
        mrow[r] = -INFINITY, lrow[r] = 0.0f;

    struct cpu_amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < CPU_AMX_TILES; t++)
        cfg.rows[t] = CPU_AMX_ROWS, cfg.colsb[t] = CPU_AMX_COLSB;
    AMX_LOADCFG(&cfg);

    const int pmax = sq->start_pos + i1 - 1;
    // Keys whose rows are whole 32-dim tiles, in blocks that hold whole
    // 16-key chunks, are read in place as A tiles; else the span's keys are
    // copied into kb first. Values are read in place by the transposition.
    const bool direct = hd == hdp && bs % 16 == 0;
    const uint16_t *kchunk[SPAN / 16]; // first key row of each 16-key chunk, hdp apart
    const uint16_t *vrow[SPAN];        // each key's value row (hd dims)
    static const uint16_t zero_row[CPU_ATTN_TILE_MAX_HD];
    for (int s0 = 0; s0 <= pmax; s0 += SPAN) {
        const int nkeys = pmax + 1 - s0 < SPAN ? pmax + 1 - s0 : SPAN;
        const int n32 = (nkeys + 31) / 32 * 32;
        // The span's keys and values.
        for (int k = 0; k < nkeys;) {
            const int pos = s0 + k, blk = sq->block_table[pos / bs], slot = pos % bs;
            const int run = bs - slot < nkeys - k ? bs - slot : nkeys - k;
            const uint16_t *kbase = tdm_kv_k_bf16(j->kv, j->layer, blk);
            const uint16_t *vbase = tdm_kv_v_bf16(j->kv, j->layer, blk);
            if (!kbase || !vbase) {
                TDM_LOG_ERR("cpu", "attention: layer %d block %d out of range", j->layer, blk);
                AMX_RELEASE();
                for (int r = 0; r < R; r++)
                    memset(j->out + (size_t)(sq->row + i0 + r / nh) * j->n_heads * hd +
                               (size_t)(h0 + r % nh) * hd,
                           0, sizeof(float) * (size_t)hd);
                return;
            }
            for (int i = 0; i < run; i++) {
                const size_t off = ((size_t)kvh * bs + slot + i) * hd;
                vrow[k + i] = vbase + off;
                if (direct) {
                    if ((k + i) % 16 == 0)
                        kchunk[(k + i) / 16] = kbase + off;
                    continue;
                }
                uint16_t *kd = kb + (size_t)(k + i) * hdp;
                memcpy(kd, kbase + off, (size_t)hd * 2);
                memset(kd + hd, 0, (size_t)(hdp - hd) * 2);
            }
            k += run;
        }
        if (!direct) {
            // Zero keys up to the last 16-key chunk (their scores are masked,
            // but the copy is not left uninitialized).
            memset(kb + (size_t)nkeys * hdp, 0, (size_t)(n32 - nkeys) * hdp * 2);
            for (int c = 0; c < n32; c += 16)
                kchunk[c / 16] = kb + (size_t)c * hdp;
        }
        // Values past the span's last key are zeros: a masked key's p is +0,
        // and +0 times a stale Inf or NaN of the pool would be NaN.
        for (int k = nkeys; k < n32; k++)
            vrow[k] = zero_row;
        // The memory reads are spread over the span's work: the next span's
        // keys and values are prefetched while this span's scores are taken,
        // 16 positions a chunk (below); a span's lines all at once would
        // fill the core's miss buffers with nothing computing meanwhile. The
        // first span's keys, which nothing fetched ahead, are prefetched
        // while its values are transposed, 32 keys a piece. (Until
        // 2026-12-07 every span's keys were fetched so, and only the values
        // a span ahead: batch 32 x 4096 tokens took 6.50-6.56 ms a layer
        // against 5.80-5.85 now, 3 runs each in turn.)
        for (int k0 = 0; k0 < n32; k0 += 32) {
            // In place keys only (copied ones were read above), through the
            // chunk pointers just resolved.
            for (int c = k0; s0 == 0 && direct && c < k0 + 32 && c < nkeys; c += 16)
                for (size_t b = 0; b < (size_t)16 * hd * 2; b += 64)
                    __builtin_prefetch((const uint8_t *)kchunk[c / 16] + b, 0, 2);
            AMXV(transpose)(vT + k0, vrow + k0, 32, hd, hdp);
        }

        for (int tt = 0; tt < T; tt++) {
            const int last = (tt + 1) * 16 < R ? (tt + 1) * 16 - 1 : R - 1;
            if (prow[last] < s0)
                continue; // every row of the tile is past this span
            const int nkt = prow[last] - s0 + 1 < nkeys ? prow[last] - s0 + 1 : nkeys;
            const int t16 = (nkt + 15) / 16 * 16, t32 = (nkt + 31) / 32 * 32;
            const uint32_t *qt = qT + (size_t)tt * 2 * (hdp / 2) * 16;
            for (int c = 0; c < t16; c += 16) {
                if (tt == 0 && s0 + SPAN + c <= pmax) {
                    const int p1 = s0 + SPAN + c + 16;
                    attn_prefetch_kv(j, sq, kvh, s0 + SPAN + c, p1 < pmax + 1 ? p1 : pmax + 1);
                }
                AMX_ZERO(0);
                for (int dc = 0; dc < hdp / 32; dc++) {
                    AMX_LOAD(4, kchunk[c / 16] + dc * 32, (size_t)hdp * 2);
                    AMX_LOAD(5, qt + (size_t)dc * 16 * 16, 64);
                    AMX_DP(0, 4, 5);
                    AMX_LOAD(6, qt + ((size_t)hdp / 2 + (size_t)dc * 16) * 16, 64);
                    AMX_DP(0, 4, 6);
                }
                AMX_STORE(0, sT + (size_t)c * 16, 64);
            }
            float corr[16];
            AMXV(softmax)
            (sT, t16, t32, s0, prow + tt * 16, j->scale, mrow + tt * 16, lrow + tt * 16, corr, pT);
            for (int dg = 0; dg < hdp / 16; dg += 4) {
                const bool four = hdp / 16 - dg >= 4; // else two (hdp is a multiple of 32)
                AMX_ZERO(0);
                AMX_ZERO(1);
                if (four) {
                    AMX_ZERO(2);
                    AMX_ZERO(3);
                }
                const uint16_t *va = vT + (size_t)dg * 16 * SPAN;
                for (int c = 0; c < t32; c += 32) {
                    AMX_LOAD(5, pT + (size_t)c / 2 * 16, 64);
                    AMX_LOAD(7, pT + (size_t)(SPAN + c) / 2 * 16, 64);
                    AMX_LOAD(4, va + c, SPAN * 2);
                    AMX_DP(0, 4, 5);
                    AMX_DP(0, 4, 7);
                    AMX_LOAD(6, va + 16 * SPAN + c, SPAN * 2);
                    AMX_DP(1, 6, 5);
                    AMX_DP(1, 6, 7);
                    if (four) {
                        AMX_LOAD(4, va + 32 * SPAN + c, SPAN * 2);
                        AMX_DP(2, 4, 5);
                        AMX_DP(2, 4, 7);
                        AMX_LOAD(6, va + 48 * SPAN + c, SPAN * 2);
                        AMX_DP(3, 6, 5);
                        AMX_DP(3, 6, 7);
                    }
                }
                AMX_STORE(0, cpk, 64);
                AMX_STORE(1, cpk + 256, 64);
                if (four) {
                    AMX_STORE(2, cpk + 512, 64);
                    AMX_STORE(3, cpk + 768, 64);
                }
                AMXV(accum)
                (acc + ((size_t)tt * hdp + (size_t)dg * 16) * 16, cpk, corr, four ? 64 : 32);
            }
        }
    }
    AMX_RELEASE();
    for (int tt = 0; tt < T; tt++) {
        float *orow[16];
        for (int i = 0; i < 16; i++) {
            const int r = tt * 16 + i;
            orow[i] = r < R ? j->out + (size_t)(sq->row + i0 + r / nh) * j->n_heads * hd +
                                  (size_t)(h0 + r % nh) * hd
                            : NULL;
        }
        AMXV(finish)(orow, acc + (size_t)tt * hdp * 16, lrow + tt * 16, hd);
    }
}
