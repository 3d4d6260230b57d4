// SPDX-License-Identifier: Apache-2.0
// cpu_amx_body: the AMX bf16 GEMM, written once against a few tile macros and
// included twice by cpu_kernels_amx.c: once with the macros mapped to the
// real instructions (<immintrin.h> _tile_*), once mapped to the software model
// (cpu_amx_emu.h). No include guard, on purpose. The includer defines:
//   AMX_GEMM              the function's name
//   AMX_ATTR              its attributes (the target, for the real one)
//   AMX_STATE             declarations at its top (the emulated tile state)
//   AMX_LOADCFG(cfg)      LDTILECFG from a struct cpu_amx_cfg *
//   AMX_ZERO(t)           TILEZERO
//   AMX_LOAD(t, p, s)     TILELOADD from p, s bytes between rows
//   AMX_STORE(t, p, s)    TILESTORED
//   AMX_DP(c, a, b)       TDPBF16PS c += a . b
//   AMX_RELEASE()         TILERELEASE
// Tile numbers are constants (the instructions take them as immediates).
//
// Shapes (nothing is repacked; cpu_impl.h's BF16 layout already is AMX's):
//   B tile = one panel's 16 consecutive k pairs: 16 rows of [16 out rows][2]
//            bf16, i.e. rows 64 bytes apart inside a k step and G * 64 bytes
//            from one k pair to the next (the block's k-step stride);
//   A tile = 16 tokens x 16 k pairs of xq (bf16 pairs), xq_stride * 4 bytes
//            from token to token;
//   C tile = 16 tokens x 16 output rows, f32.
// Tiles 0-3 are C (2 token tiles x 2 panels), 4-5 A, 6-7 B: per k chunk 2 A
// loads and 2 B loads feed 4 TDPBF16PS. The k chunks of a token tile pair run
// in passes of about CPU_AMX_KPASS chunks (cpu_kernels_amx.c), each pass over
// both panel pairs of the block, C parked in a local buffer between passes: a
// whole k of A tiles (2 x 28 KiB at k = 896) does not stay in the 48 KiB L1
// while the B tiles stream through, a pass's does, so the second panel pair
// reads A from L1 rather than L2 (one thread, 512 tokens: the fused gate/up
// 10.9-11.6 -> 9.5-10.3 ms, down 5.75-6.0 -> 5.0-5.3 ms). A lone token tile
// (decode, or the odd last tile) takes C tiles 0-3 as 4 panels: 1 A load and 4
// B loads (tiles 6 and 7 in turn) per k chunk, so the block is read in one
// pass rather than two. The first pass over a block (the one that streams it
// from memory) prefetches the lines CPU_STREAM_PREFETCH / 2 bytes past the
// next chunk into L2 (cpu_impl.h; a->stream_prefetch): with only the
// hardware's prefetchers, batch-1 decode streamed at ~75% of the read probe on
// Sapphire Rapids. One configuration per call serves every shape: all tiles
// 16 x 64 bytes, except that a call of n < 16 tokens (decode) configures A and
// C with n rows.
// mm_prep_x zeroes the pairs of xq past the last k pair up to a multiple of 16
// and, for n > 16, the token rows past n up to a multiple of 16; the k tail of
// each panel is copied into a zeroed 16-row buffer. So k padding multiplies
// zeros by zeros (which adds +0 and changes no bit; a stale Inf there would
// make NaN). Token rows never mix (C row m reads only A row m), so padding
// tokens reach only C rows that are not stored; they are zeroed only so that
// no uninitialized memory is read.
//
// Accumulation: C tile element (token t, row r) starts at +0 and takes one
// TDPBF16PS per 32-k chunk, chunks in ascending k, whatever n, the tile or
// the thread: its bits depend on its row and token only (cpu_impl.h).

// y rows of blocks [b0, b1) for all a->n tokens of a BF16 weight.
static AMX_ATTR void AMX_GEMM(const struct cpu_mm_args *a, int b0, int b1)
{
    AMX_STATE;
    const struct tdm_weight *w = a->w;
    const int kp = (w->cols + 1) / 2;   // k pairs
    const int nck = (kp + 15) / 16;     // k chunks of 16 pairs (one TDPBF16PS each)
    const int ktail = kp % 16;          // pairs of a short last chunk (0: none)
    const size_t xs = a->xq_stride * 4; // bytes from token to token in xq
    const int ntt = (a->n + 15) / 16;   // token tiles
    struct cpu_amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < CPU_AMX_TILES; t++) {
        // C (0-3) and A (4-5) have a row per token; B (6-7) a row per k pair.
        cfg.rows[t] = (uint8_t)(t < 6 && a->n < CPU_AMX_ROWS ? a->n : CPU_AMX_ROWS);
        cfg.colsb[t] = CPU_AMX_COLSB;
    }
    AMX_LOADCFG(&cfg);
    // [panel][k pair of the tail][16 rows][2] bf16, zero past the tail.
    _Alignas(64) uint8_t btail[CPU_BLOCK_PANELS][CPU_AMX_ROWS][CPU_AMX_COLSB];
    // C tiles of a partial (or biased) store: [tile][token][row] f32.
    _Alignas(64) float ct[4][CPU_AMX_ROWS][CPU_PANEL_ROWS];
    // Two token tiles: k in passes of about CPU_AMX_KPASS chunks, each over
    // every panel pair of the block, so the pass's A tiles (2 x kpass KiB) are
    // read from L2 once and from L1 by the other panel pair; C parked here
    // between passes ([panel pair][tile][token][row], exact f32).
    const int npass = (nck + CPU_AMX_KPASS - 1) / CPU_AMX_KPASS;
    const int kpass = (nck + npass - 1) / npass;
    _Alignas(64) float cpark[CPU_BLOCK_PANELS / 2][4][CPU_AMX_ROWS][CPU_PANEL_ROWS];
    for (int b = b0; b < b1; b++) {
        const uint8_t *wb = cpu_w_block(w, b);
        const int G = cpu_w_block_panels(w, b);
        const size_t bs = (size_t)G * 64; // B tile row stride: one k step of the block
        if (ktail) {
            memset(btail, 0, sizeof btail);
            for (int g = 0; g < G; g++)
                for (int j = 0; j < ktail; j++)
                    memcpy(btail[g][j], wb + ((size_t)((nck - 1) * 16 + j) * G + g) * 64, 64);
        }
        for (int tt = 0; tt < ntt; tt += 2) {
            const bool two_t = tt + 1 < ntt;
            const uint8_t *xa = (const uint8_t *)a->xq + (size_t)tt * 16 * xs;
            // One token tile (decode, or an odd last one): C tiles 0-3 are
            // 4 panels, so the block is read in one pass; else 2 x 2.
            const bool wide = !two_t;
            const int kstep = wide ? nck : kpass;
            for (int c0 = 0; c0 < nck; c0 += kstep)
                for (int g = 0; g < G; g += wide ? 4 : 2) {
                    const bool two_g = g + 1 < G;
                    const int np = G - g < 4 ? G - g : 4; // panels of a wide pass
                    const int c1 = c0 + kstep < nck ? c0 + kstep : nck;
                    if (c0 == 0) {
                        AMX_ZERO(0);
                        AMX_ZERO(1);
                        AMX_ZERO(2);
                        AMX_ZERO(3);
                    } else {
                        AMX_LOAD(0, cpark[g / 2][0], sizeof cpark[0][0][0]);
                        AMX_LOAD(1, cpark[g / 2][1], sizeof cpark[0][0][0]);
                        AMX_LOAD(2, cpark[g / 2][2], sizeof cpark[0][0][0]);
                        AMX_LOAD(3, cpark[g / 2][3], sizeof cpark[0][0][0]);
                    }
                    for (int c = c0; c < c1; c++) {
                        const uint8_t *bp = wb + ((size_t)c * 16 * G + g) * 64;
                        if (tt == 0 && g == 0 && a->stream_prefetch) {
                            // The first pass over the block streams it from
                            // memory: the next lines of the stream into L2,
                            // past the next chunk (cpu_impl.h).
                            const uint8_t *ahead =
                                wb + (size_t)(c + 1) * 16 * bs + CPU_STREAM_PREFETCH / 2;
                            for (int l = 0; l < 16 * G; l++)
                                __builtin_prefetch(ahead + (size_t)l * 64, 0, 2);
                        }
                        size_t bstride = bs, bnext = 64;
                        if (ktail && c == nck - 1) {
                            bp = btail[g][0];
                            bstride = CPU_AMX_COLSB;
                            bnext = sizeof btail[0];
                        }
                        AMX_LOAD(4, xa + (size_t)c * 64, xs);
                        AMX_LOAD(6, bp, bstride);
                        AMX_DP(0, 4, 6);
                        if (wide) {
                            if (np > 1) {
                                AMX_LOAD(7, bp + bnext, bstride);
                                AMX_DP(1, 4, 7);
                            }
                            if (np > 2) {
                                AMX_LOAD(6, bp + 2 * bnext, bstride);
                                AMX_DP(2, 4, 6);
                            }
                            if (np > 3) {
                                AMX_LOAD(7, bp + 3 * bnext, bstride);
                                AMX_DP(3, 4, 7);
                            }
                            continue;
                        }
                        if (two_g) {
                            AMX_LOAD(7, bp + bnext, bstride);
                            AMX_DP(1, 4, 7);
                        }
                        if (two_t) {
                            AMX_LOAD(5, xa + 16 * xs + (size_t)c * 64, xs);
                            AMX_DP(2, 5, 6);
                            if (two_g)
                                AMX_DP(3, 5, 7);
                        }
                    }
                    if (c1 < nck) {
                        AMX_STORE(0, cpark[g / 2][0], sizeof cpark[0][0][0]);
                        AMX_STORE(1, cpark[g / 2][1], sizeof cpark[0][0][0]);
                        AMX_STORE(2, cpark[g / 2][2], sizeof cpark[0][0][0]);
                        AMX_STORE(3, cpark[g / 2][3], sizeof cpark[0][0][0]);
                        continue;
                    }
                    // Epilogue: y = C (+ bias), tokens < n and rows < w->rows only.
                    for (int q = 0; q < 4; q++) {
                        const int ti = wide ? 0 : q / 2, gi = wide ? q : q % 2;
                        if (wide ? q >= np : (ti && !two_t) || (gi && !two_g))
                            continue;
                        const int t0 = (tt + ti) * 16, r0 = b * CPU_BLOCK_ROWS + (g + gi) * 16;
                        const int nt = a->n - t0 < 16 ? a->n - t0 : 16;
                        const int nr = w->rows - r0 < 16 ? w->rows - r0 : 16;
                        const size_t ys = (a->y_stride ? a->y_stride : (size_t)w->rows) * 4;
                        if (nt == 16 && nr == 16 && !a->bias) {
                            float *y = cpu_mm_y(a, t0, r0);
                            switch (q) {
                            case 0:
                                AMX_STORE(0, y, ys);
                                break;
                            case 1:
                                AMX_STORE(1, y, ys);
                                break;
                            case 2:
                                AMX_STORE(2, y, ys);
                                break;
                            default:
                                AMX_STORE(3, y, ys);
                                break;
                            }
                            continue;
                        }
                        switch (q) {
                        case 0:
                            AMX_STORE(0, ct[0], sizeof ct[0][0]);
                            break;
                        case 1:
                            AMX_STORE(1, ct[1], sizeof ct[0][0]);
                            break;
                        case 2:
                            AMX_STORE(2, ct[2], sizeof ct[0][0]);
                            break;
                        default:
                            AMX_STORE(3, ct[3], sizeof ct[0][0]);
                            break;
                        }
                        for (int m = 0; m < nt; m++) {
                            float *y = cpu_mm_y(a, t0 + m, r0);
                            if (a->bias)
                                for (int l = 0; l < nr; l++)
                                    y[l] = ct[q][m][l] + a->bias[r0 + l];
                            else
                                for (int l = 0; l < nr; l++)
                                    y[l] = ct[q][m][l];
                        }
                    }
                }
        }
    }
    AMX_RELEASE();
}
