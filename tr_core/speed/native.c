/* The lean forward's small per-row operations in one call each: RMS norm (with the residual add before it), the
 * rotary embedding with the cache write, the attention's softmax and window product, and SiLU-times-up.
 *
 * Every function computes each row from that row's inputs alone, in a fixed order of operations (sums over
 * LANES accumulators combined pairwise, the same for every row, and no contraction into fused multiply-adds, which
 * could treat an element differently in a loop's vector body and its remainder), so a row's bits do not depend on
 * how many rows a call has. fp32 throughout. Built by native.py on the machine that runs it (gcc -O3 -march=native)
 * and called through ctypes with raw pointers; the caller checks shapes, dtypes and contiguity.
 */
#define _GNU_SOURCE /* syscall, for the AMX tile state (tr_amx_ready) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#include <immintrin.h>
#endif

#define LANES 16
#define BLOCK 64

/* The loops over exp_small (the softmax, SiLU) in 512-bit vectors where the CPU has AVX-512: gcc's tuning for
 * -march=native picks 256-bit ones on Intel's server cores. Each float gets the same operations either way (no
 * reassociation without -ffast-math), so the bits are the same; whole fast steps of 16-81 rows 0.96-0.98x on an AMX
 * Xeon (docs/speed.md). */
#ifdef HAVE_AVX512
#define WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define WIDE
#endif

static float sum_lanes(float *acc) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

/* a . b over d floats, in LANES accumulators combined pairwise. */
static float dot(const float *a, const float *b, int d) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i < d; i++, j++) acc[j] += a[i] * b[i];
    return sum_lanes(acc);
}

/* Row-wise work is shared among the threads only past small_ops_shared floats a call (up to it, one thread does it:
 * waking the others costs more than they save): tr_layers' norms, rotary embedding and SiLU, and the AMX linear
 * layer's rounding of its inputs. Where that pays depends on the CPU and its threads: native.py times it where the
 * library runs (tr_silu_mul_rows with and without sharing, ``choose_sharing``) and sets it (tr_small_ops_shared);
 * until then SMALL_OPS_SHARED. A row is computed by the same function whichever thread runs it: the same bits. */
#ifndef SMALL_OPS_SHARED
#define SMALL_OPS_SHARED (1 << 15)
#endif
static int64_t small_ops_shared = SMALL_OPS_SHARED;
void tr_small_ops_shared(int64_t floats) { small_ops_shared = floats; }

/* exp(x), ~2 ulp from -87 to 88: range reduction by ln 2, a degree-6 polynomial, the power of two put in by its
 * bits; 0 below -87, e^88 up to 88.7, infinity above, NaN kept. Branch-free, so the loops calling it vectorise. */
static inline float exp_small(float x) {
    float c = x > -87.0f ? x : -87.0f;  /* NaN -> -87: no undefined conversion below */
    c = c < 88.0f ? c : 88.0f;
    float k = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - k * 0.693145751953125f;
    r = r - k * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = x < -87.0f ? 0.0f : p * scale;
    y = x > 88.7f ? INFINITY : y;
    return x != x ? x : y;
}

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)); where delta is given, x[r] += delta[r] first (in place). */
void tr_add_rms_norm(float *x, const float *delta, const float *weight, float eps, int n, int d, float *out) {
    for (int r = 0; r < n; r++) {
        float *row = x + (int64_t)r * d;
        if (delta) {
            const float *add = delta + (int64_t)r * d;
            for (int i = 0; i < d; i++) row[i] += add[i];
        }
        float scale = 1.0f / sqrtf(dot(row, row, d) / (float)d + eps);
        float *o = out + (int64_t)r * d;
        for (int i = 0; i < d; i++) o[i] = weight[i] * (row[i] * scale);
    }
}

/* out (n, inter) = silu(gate) * up, of gate_up (n, 2 * inter): each row's gate, then its up. */
WIDE void tr_silu_mul(const float *gate_up, int n, int inter, float *out) {
    for (int r = 0; r < n; r++) {
        const float *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        float *o = out + (int64_t)r * inter;
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_small(-g[i])) * u[i];
    }
}

static void rope_row(const float *x, const float *cos, const float *sin, int dim, float scale, float *out) {
    int half = dim / 2;
    for (int i = 0; i < half; i++) out[i] = (x[i] * cos[i] - x[i + half] * sin[i]) * scale;
    for (int i = half; i < dim; i++) out[i] = (x[i] * cos[i] + x[i - half] * sin[i]) * scale;
}

/* The rotary embedding of the step's n rows, and where they go. q (n, H, D), k and v (n, Hkv, D), their rows
 * `stride` floats apart (the fused projection's output: q, k and v side by side in one row), cos and sin (n, D). Each query head h = kv * group + g of row r, rotated and times scale, to queries[kv][r * group + g]
 * (queries (Hkv, padded, D)); the rotated keys and the values to key_buf[kv][past + r], value_buf[kv][past + r]
 * (each kv head's buffer head_stride floats apart). */
void tr_rope_store(const float *q, const float *k, const float *v, int64_t stride, const float *cos,
                   const float *sin, int n, int heads, int kv_heads, int dim, float scale, float *queries, int padded, float *key_buf,
                   float *value_buf, int64_t head_stride, int64_t past) {
    int group = heads / kv_heads;
    for (int r = 0; r < n; r++) {
        const float *c = cos + (int64_t)r * dim, *s = sin + (int64_t)r * dim;
        for (int h = 0; h < heads; h++) {
            int kv = h / group, g = h % group;
            rope_row(q + r * stride + (int64_t)h * dim, c, s, dim, scale,
                     queries + ((int64_t)kv * padded + (int64_t)r * group + g) * dim);
        }
        for (int kv = 0; kv < kv_heads; kv++) {
            int64_t at = kv * head_stride + (past + r) * dim;
            rope_row(k + r * stride + (int64_t)kv * dim, c, s, dim, 1.0f, key_buf + at);
            memcpy(value_buf + at, v + r * stride + (int64_t)kv * dim, sizeof(float) * dim);
        }
    }
}

/* A row's scores: w[j] = q . keys[j] for the shared keys j < start, then w[start + j] = q . keys[idx[j]] for its
 * window's offsets j, -inf where not ok[j]. (With AVX-512 and D = 64, attend_rows64 computes rows instead.) */
static void scores_row(const float *q, const float *keys, int64_t start, const int64_t *idx, const uint8_t *ok,
                       int dim, float *w) {
    float *own = w + start;
    for (int64_t j = 0; j < start; j++) w[j] = dot(q, keys + j * dim, dim);
    for (int j = 0; j < BLOCK; j++) own[j] = ok[j] ? dot(q, keys + idx[j] * dim, dim) : -INFINITY;
}

/* The softmax's numerators in place over w's start + BLOCK scores (its window's 0 where not ok), and their sum:
 * one maximum and one sum over the row, in LANES accumulators combined pairwise. */
WIDE static float softmax_row(float *w, int64_t start, const uint8_t *ok) {
    int64_t row_len = start + BLOCK;
    float *own = w + start;
    float top[LANES];
    for (int j = 0; j < LANES; j++) top[j] = -INFINITY;
    int64_t i = 0;
#ifdef HAVE_AVX512 /* the same lanes' operations as the loops below (vmaxps a, b: a > b ? a : b), which gcc leaves scalar */
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    for (; i + LANES <= row_len; i += LANES) top16 = _mm512_max_ps(_mm512_loadu_ps(w + i), top16);
    _mm512_storeu_ps(top, top16);
#else
    for (; i + LANES <= row_len; i += LANES)
        for (int j = 0; j < LANES; j++) top[j] = w[i + j] > top[j] ? w[i + j] : top[j];
#endif
    for (int j = 0; i < row_len; i++, j++) top[j] = w[i] > top[j] ? w[i] : top[j];
    float most = top[0];
    for (int j = 1; j < LANES; j++) most = top[j] > most ? top[j] : most;
    for (i = 0; i < row_len; i++) w[i] = exp_small(w[i] - most);
    for (int j = 0; j < BLOCK; j++) own[j] = ok[j] ? own[j] : 0.0f;
    float acc[LANES] = {0};
    i = 0;
#ifdef HAVE_AVX512
    __m512 acc16 = _mm512_setzero_ps();
    for (; i + LANES <= row_len; i += LANES) acc16 = _mm512_add_ps(acc16, _mm512_loadu_ps(w + i));
    _mm512_storeu_ps(acc, acc16);
#else
    for (; i + LANES <= row_len; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += w[i + j];
#endif
    for (int j = 0; i < row_len; i++, j++) acc[j] += w[i];
    return sum_lanes(acc);
}

/* out (D) = (sum over the shared keys of w[j] * values[j], then over the window's valid offsets of
 * w[start + j] * values[idx[j]], in that order) / total. (With AVX-512 and D = 64, attend_rows64 instead.) */
static void values_row(const float *w, const float *values, int64_t start, const int64_t *idx, const uint8_t *ok,
                       int dim, float total, float *out) {
    const float *own = w + start;
    for (int d = 0; d < dim; d++) out[d] = 0.0f;
    for (int64_t j = 0; j < start; j++)
        for (int d = 0; d < dim; d++) out[d] += w[j] * values[j * dim + d];
    for (int j = 0; j < BLOCK; j++)
        if (ok[j])
            for (int d = 0; d < dim; d++) out[d] += own[j] * values[idx[j] * dim + d];
    for (int d = 0; d < dim; d++) out[d] /= total;
}

/* One query row's attention: q (D) scaled, against keys and values (rows of D floats) 0 .. start-1 (the shared
 * part) and its window's: idx[j] the key at offset j where ok[j]. w: start + BLOCK floats of scratch. out (D). */
static void attend_row(const float *q, const float *keys, const float *values, int64_t start, const int64_t *idx,
                       const uint8_t *ok, int dim, float *w, float *out) {
    scores_row(q, keys, start, idx, ok, dim, w);
    float total = softmax_row(w, start, ok);
    values_row(w, values, start, idx, ok, dim, total, out);
}

#ifdef HAVE_AVX512
/* The lane sums of 16 vectors p[0..15], as one vector (lane j: the sum of p[j]'s lanes), each by the tree gcc's
 * _mm512_reduce_add_ps takes (lane i plus lane i + 8, then i + 4, i + 2, i + 1; each addition commutes exactly), so
 * a sum has the same bits as that reduction's (the logits came out bit-equal to the build that reduced key by key);
 * 15 additions and 31 shuffles where 16 reductions take ~100 operations. */
static inline __m512 sum16(const __m512 *p) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* p[2i]'s lanes i + (i + 8) in the low half, p[2i + 1]'s in the high */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane L: p[4i + L]'s sums of 4 */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* lane L: p[8i + L]'s sums of 2, then p[8i + 4 + L]'s */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    /* lane 4L + k: p[L + 4k]'s sum; then each to its own lane */
    __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}

/* A row's products with one key of 64 floats (q0..q3: the row's query), its dot product (the lanes summed by
 * _mm512_reduce_add_ps's tree), and one step of a weighted sum of values (o0..o3 += a * v): attend_rows64's and
 * attend_tiles64's fixed sequences of operations. */
#define PRODUCTS64(k)                                                                                              \
    _mm512_fmadd_ps(q3, _mm512_loadu_ps((k) + 48),                                                                 \
                    _mm512_fmadd_ps(q2, _mm512_loadu_ps((k) + 32),                                                 \
                                    _mm512_fmadd_ps(q1, _mm512_loadu_ps((k) + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(k)))))
#define DOT64(k) _mm512_reduce_add_ps(PRODUCTS64(k))
#define ADD64(a, v)                                                                                                \
    {                                                                                                              \
        __m512 s = _mm512_set1_ps(a);                                                                              \
        const float *vr = (v);                                                                                     \
        o0 = _mm512_fmadd_ps(s, _mm512_loadu_ps(vr), o0);                                                          \
        o1 = _mm512_fmadd_ps(s, _mm512_loadu_ps(vr + 16), o1);                                                     \
        o2 = _mm512_fmadd_ps(s, _mm512_loadu_ps(vr + 32), o2);                                                     \
        o3 = _mm512_fmadd_ps(s, _mm512_loadu_ps(vr + 48), o3);                                                     \
    }

/* Row b's window (D = 64): its scores at own[j] = q . keys[idx[j]] where ok[j], -inf elsewhere, then the softmax
 * over the row's start + BLOCK entries at w (softmax_row); returns the sum of its numerators. */
static float window_softmax64(const float *qb, const float *keys, int64_t start, const int64_t *idx,
                              const uint8_t *ok, float *w) {
    __m512 q0 = _mm512_loadu_ps(qb), q1 = _mm512_loadu_ps(qb + 16), q2 = _mm512_loadu_ps(qb + 32),
           q3 = _mm512_loadu_ps(qb + 48);
    float *own = w + start;
    for (int j = 0; j < BLOCK; j++) own[j] = ok[j] ? DOT64(keys + idx[j] * 64) : -INFINITY;
    return softmax_row(w, start, ok);
}

/* A row's output (D = 64): its shared part's weighted values a (64 floats), plus the window's valid offsets'
 * own[j] * values[idx[j]] in order, divided by total, to o. */
static void window_out64(const float *a, const float *own, const float *values, const int64_t *idx,
                         const uint8_t *ok, float total, float *o) {
    __m512 o0 = _mm512_loadu_ps(a), o1 = _mm512_loadu_ps(a + 16), o2 = _mm512_loadu_ps(a + 32),
           o3 = _mm512_loadu_ps(a + 48);
    for (int j = 0; j < BLOCK; j++)
        if (ok[j]) ADD64(own[j], values + idx[j] * 64)
    __m512 t = _mm512_set1_ps(total);
    _mm512_storeu_ps(o, _mm512_div_ps(o0, t));
    _mm512_storeu_ps(o + 16, _mm512_div_ps(o1, t));
    _mm512_storeu_ps(o + 32, _mm512_div_ps(o2, t));
    _mm512_storeu_ps(o + 48, _mm512_div_ps(o3, t));
}

#define KEYS_AT_ONCE 32 /* keys (and values) a block of rows goes through together: 8 kB of each, held in L1 */

/* attend_row for rows 0..B-1 of one kv head (D = 64), which share its keys and values: queries q + b * 64 (scaled),
 * row b's window idx_b / ok_b (index / valid + (row0 + b) / group * BLOCK), out_b = out + ((row0 + b) / group * heads
 * + kv * group + (row0 + b) % group) * 64. A row's scores (a key's 16 lanes of products by one multiply and three
 * fused multiply-adds, the lanes summed by _mm512_reduce_add_ps's tree: sum16 for 16 shared keys at once), softmax
 * (softmax_row) and weighted values (one chain of multiply-adds over the keys in order, in four registers) are one
 * fixed sequence of operations whatever rows go with it, the same bits as when each row was computed alone (the
 * logits came out bit-equal to that build); only the loops are nested the other way, KEYS_AT_ONCE shared keys at a
 * time for all B rows, so a tree's rows read the shared keys and values from L1 rather than each streaming them from
 * L2 (16 rows at 1,024 keys: 441-486 -> 349-371 us a layer). w: B * (start + BLOCK) floats, acc: B * 64 floats of
 * scratch. */
static void attend_rows64(const float *q, int B, const float *keys, const float *values, int64_t start,
                          const int64_t *index, const uint8_t *valid, int row0, int group, int heads, int kv,
                          float *w, float *acc, float *out) {
    int64_t len = start + BLOCK;
    for (int64_t j0 = 0; j0 < start; j0 += KEYS_AT_ONCE) { /* the shared scores, 16 keys' sums at once */
        int64_t j1 = j0 + KEYS_AT_ONCE < start ? j0 + KEYS_AT_ONCE : start;
        for (int b = 0; b < B; b++) {
            const float *qb = q + b * 64;
            __m512 q0 = _mm512_loadu_ps(qb), q1 = _mm512_loadu_ps(qb + 16), q2 = _mm512_loadu_ps(qb + 32),
                   q3 = _mm512_loadu_ps(qb + 48);
            float *wb = w + b * len;
            __m512 p[16];
            for (int64_t j = j0; j < j1; j += 16) {
                int count = j1 - j < 16 ? (int)(j1 - j) : 16;
                for (int i = 0; i < 16; i++)
                    p[i] = i < count ? PRODUCTS64(keys + (j + i) * 64) : _mm512_setzero_ps();
                _mm512_mask_storeu_ps(wb + j, (__mmask16)((1u << count) - 1), sum16(p));
            }
        }
    }
    float totals[B];
    for (int b = 0; b < B; b++) { /* the window's scores, the softmax */
        int r = (row0 + b) / group;
        totals[b] = window_softmax64(q + b * 64, keys, start, index + (int64_t)r * BLOCK, valid + (int64_t)r * BLOCK,
                                     w + b * len);
        _mm512_storeu_ps(acc + b * 64, _mm512_setzero_ps());
        _mm512_storeu_ps(acc + b * 64 + 16, _mm512_setzero_ps());
        _mm512_storeu_ps(acc + b * 64 + 32, _mm512_setzero_ps());
        _mm512_storeu_ps(acc + b * 64 + 48, _mm512_setzero_ps());
    }
    for (int64_t j0 = 0; j0 < start; j0 += KEYS_AT_ONCE) { /* the shared values, each row's sums in acc */
        int64_t j1 = j0 + KEYS_AT_ONCE < start ? j0 + KEYS_AT_ONCE : start;
        int b = 0;
        for (; b + 4 <= B; b += 4) { /* four rows' sums at once: 16 chains of multiply-adds in flight, not 4 */
            float *a = acc + b * 64;
            const float *wb = w + b * len;
            __m512 r[4][4];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) r[i][c] = _mm512_loadu_ps(a + i * 64 + c * 16);
            for (int64_t j = j0; j < j1; j++) {
                const float *vr = values + j * 64;
                __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32),
                       v3 = _mm512_loadu_ps(vr + 48);
                for (int i = 0; i < 4; i++) {
                    __m512 s = _mm512_set1_ps(wb[i * len + j]);
                    r[i][0] = _mm512_fmadd_ps(s, v0, r[i][0]);
                    r[i][1] = _mm512_fmadd_ps(s, v1, r[i][1]);
                    r[i][2] = _mm512_fmadd_ps(s, v2, r[i][2]);
                    r[i][3] = _mm512_fmadd_ps(s, v3, r[i][3]);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(a + i * 64 + c * 16, r[i][c]);
        }
        for (; b < B; b++) {
            float *a = acc + b * 64;
            const float *wb = w + b * len;
            __m512 o0 = _mm512_loadu_ps(a), o1 = _mm512_loadu_ps(a + 16), o2 = _mm512_loadu_ps(a + 32),
                   o3 = _mm512_loadu_ps(a + 48);
            for (int64_t j = j0; j < j1; j++) ADD64(wb[j], values + j * 64)
            _mm512_storeu_ps(a, o0);
            _mm512_storeu_ps(a + 16, o1);
            _mm512_storeu_ps(a + 32, o2);
            _mm512_storeu_ps(a + 48, o3);
        }
    }
    for (int b = 0; b < B; b++) { /* the window's values, the division */
        int row = row0 + b, r = row / group;
        window_out64(acc + b * 64, w + b * len + start, values, index + (int64_t)r * BLOCK, valid + (int64_t)r * BLOCK,
                     totals[b], out + ((int64_t)r * heads + kv * group + row % group) * 64);
    }
}
#endif

#define ROWS_AT_ONCE 8 /* the most query rows of one kv head one thread attends together (attend_rows64) */

/* The step's attention, whole: for query head h = kv * group + g of row r, its query (scaled) at
 * queries[kv][r * group + g] (queries (Hkv, padded, D)) against kv head kv's keys and values (head_stride floats
 * apart per kv head, rows of D floats): every key before start, and the row's window (index (n, BLOCK) the key at
 * each offset, valid where valid[r][j]). The softmax over the shared scores then the window's (one maximum, one
 * sum); out (n, H * D). Each (row, head) is computed by one thread, alone, in the same order whatever the call; the
 * rows are shared among `threads` threads where the work is large enough to pay for them, in blocks of up to
 * ROWS_AT_ONCE rows of one kv head (fewer where that leaves threads idle), which go through the keys together. */
void tr_attend(const float *queries, int padded, const float *keys, const float *values, int64_t head_stride,
               int64_t start, const int64_t *index, const uint8_t *valid, int n, int group, int kv_heads, int dim,
               float *out, int threads) {
    int m = n * group, heads = kv_heads * group;
    int many = (int64_t)kv_heads * m * (start + BLOCK) * dim > (1 << 16);
    int rows = 1;
#ifdef HAVE_AVX512
    if (dim == 64) { /* about two blocks per thread, at most ROWS_AT_ONCE rows each */
        rows = (int)((int64_t)kv_heads * m / (2 * (many ? threads : 1)));
        rows = rows < 1 ? 1 : rows > ROWS_AT_ONCE ? ROWS_AT_ONCE : rows;
    }
#endif
    int per_head = (m + rows - 1) / rows;
    int64_t tasks = (int64_t)kv_heads * per_head;
#pragma omp parallel num_threads(threads) if(many)
    {
        float *w = malloc(sizeof(float) * ((start + BLOCK) * rows + 64 * rows));
        if (!w) abort(); /* tens of kB: without them the process could not go on anyway */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int kv = (int)(t / per_head), row0 = (int)(t % per_head) * rows;
            int count = m - row0 < rows ? m - row0 : rows;
            const float *q = queries + ((int64_t)kv * padded + row0) * dim;
#ifdef HAVE_AVX512
            if (dim == 64) {
                attend_rows64(q, count, keys + kv * head_stride, values + kv * head_stride, start, index, valid,
                              row0, group, heads, kv, w, w + (start + BLOCK) * rows, out);
                continue;
            }
#endif
            for (int b = 0; b < count; b++) {
                int row = row0 + b, r = row / group;
                attend_row(q + (int64_t)b * dim, keys + kv * head_stride, values + kv * head_stride, start,
                           index + (int64_t)r * BLOCK, valid + (int64_t)r * BLOCK, dim, w,
                           out + ((int64_t)r * heads + kv * group + row % group) * dim);
            }
        }
        free(w);
    }
}

#ifdef HAVE_AVX512
/* Linear layers: y (n, out) = x (n, in) @ w^T, x and y fp32, w fp16 (tr_linear_f16) or fp32 (tr_linear_f32). The
 * weights come in tiles of TILE outputs (layouts.py's pack): tile t holds, input after input, the weights of outputs
 * TILE*t..TILE*t+TILE-1 (zeros past out), so each tile is read front to back, one stream the prefetcher follows.
 *
 * Each output y[r][o] is one sum whatever the call: x[r][0] * w[o][0], then + x[r][i] * w[o][i] for i in order, each
 * step one fused multiply-add (explicit, so the same on every compiler). Rows are computed 12 at a time against a
 * tile, then the rest (1 to 11) together (one load of its weights, as fp32, serves them all); how many changes which
 * sums run side by side, never how one is computed, so a row's bits do not depend on how many rows the call has.
 * Tiles are shared among `threads` OpenMP threads (torch's own runtime, which the library finds loaded). For one row
 * the weights' reading is the whole cost; for many, the multiply-adds. */
#define TILE 32

#define ROW_ZERO(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0;
#define ROW_FMA(r)                                                                                                 \
    {                                                                                                              \
        __m512 xb = _mm512_set1_ps(x[(int64_t)(r) * in + i]);                                                     \
        a##r##0 = _mm512_fmadd_ps(xb, w0, a##r##0);                                                                \
        a##r##1 = _mm512_fmadd_ps(xb, w1, a##r##1);                                                                \
    }
#define ROW_STORE(r)                                                                                               \
    {                                                                                                              \
        float *yr = y + (int64_t)(r) * out + o0;                                                                   \
        if (o0 + TILE <= out) {                                                                                    \
            _mm512_storeu_ps(yr, a##r##0);                                                                         \
            _mm512_storeu_ps(yr + 16, a##r##1);                                                                    \
        } else {                                                                                                   \
            float part[TILE];                                                                                      \
            _mm512_storeu_ps(part, a##r##0);                                                                       \
            _mm512_storeu_ps(part + 16, a##r##1);                                                                  \
            for (int j = 0; o0 + j < out; j++) yr[j] = part[j];                                                    \
        }                                                                                                          \
    }
/* Kernels of fetch_from_rows rows or more also ask for the weights FETCH_AHEAD bytes ahead of the ones they load
 * (FETCH: the lines of `bytes` bytes at `at`, into L2; a prefetch leaves the core's window free, where a demand load
 * holds a place in it until its line comes). Such a kernel runs 10-24 multiply instructions per 128 bytes of fp32 or
 * bf16 weights, so its window may hold too few loads to keep the memory busy: then reading and multiplying add up
 * instead of overlapping. Whether that pays depends on the CPU: native.py measures it where the library runs and
 * sets the row count (tr_fetch_from_rows; until then, and where it does not pay, 13: never). On a 2-vCPU AMD EPYC
 * (docs/speed.md), from 5 rows: a step's linear layers at 8-24 rows 0.72-0.88x side by side, 81 rows 0.91-0.95x;
 * from 2 rows, 2-4 rows 1.03-1.09x; into L1, or 4 kB ahead, less. They change when the weights are read, never how a
 * sum is computed: the same bits (and a request past the weights' end does nothing: a prefetch never faults). */
#define FETCH_AHEAD 16384
static int fetch_from_rows = 13;
void tr_fetch_from_rows(int rows) { fetch_from_rows = rows; }
#define FETCH(R, at, bytes)                                                                                        \
    if ((R) >= fetch_from_rows)                                                                                    \
        for (int f_ = 0; f_ < (int)(bytes); f_ += 64) _mm_prefetch((const char *)(at) + FETCH_AHEAD + f_, _MM_HINT_T1);
/* Input i's 16 weights at p, as fp32: from fp16, or as they are. */
#define LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD_F32(p) _mm512_loadu_ps(p)
/* A kernel for R rows: each row's accumulators are variables of their own (gcc keeps arrays of vectors in memory). */
#define LINEAR_ROWS(NAME, WEIGHT, LOAD, R, EACH)                                                                   \
static void NAME##_##R(const float *x, const WEIGHT *tile, int in, int out, float *y, int o0) {                  \
    EACH(ROW_ZERO)                                                                                                 \
    for (int i = 0; i < in; i++) {                                                                                 \
        __m512 w0 = LOAD(tile + (int64_t)i * TILE), w1 = LOAD(tile + (int64_t)i * TILE + 16);                     \
        FETCH(R, tile + (int64_t)i * TILE, TILE * sizeof(WEIGHT))                                                  \
        EACH(ROW_FMA)                                                                                              \
    }                                                                                                              \
    EACH(ROW_STORE)                                                                                                \
}
#define ROWS_1(F) F(0)
#define ROWS_2(F) ROWS_1(F) F(1)
#define ROWS_3(F) ROWS_2(F) F(2)
#define ROWS_4(F) ROWS_3(F) F(3)
#define ROWS_5(F) ROWS_4(F) F(4)
#define ROWS_6(F) ROWS_5(F) F(5)
#define ROWS_7(F) ROWS_6(F) F(6)
#define ROWS_8(F) ROWS_7(F) F(7)
#define ROWS_9(F) ROWS_8(F) F(8)
#define ROWS_10(F) ROWS_9(F) F(9)
#define ROWS_11(F) ROWS_10(F) F(10)
#define ROWS_12(F) ROWS_11(F) F(11)
/* The kernels of one kind for 1 to 12 rows (KERNEL(..., R, ROWS_R) each), and a switch calling the one for `rows`. */
#define EACH_ROW_COUNT(KERNEL, ...)                                                                                \
    KERNEL(__VA_ARGS__, 1, ROWS_1) KERNEL(__VA_ARGS__, 2, ROWS_2) KERNEL(__VA_ARGS__, 3, ROWS_3)                   \
    KERNEL(__VA_ARGS__, 4, ROWS_4) KERNEL(__VA_ARGS__, 5, ROWS_5) KERNEL(__VA_ARGS__, 6, ROWS_6)                   \
    KERNEL(__VA_ARGS__, 7, ROWS_7) KERNEL(__VA_ARGS__, 8, ROWS_8) KERNEL(__VA_ARGS__, 9, ROWS_9)                   \
    KERNEL(__VA_ARGS__, 10, ROWS_10) KERNEL(__VA_ARGS__, 11, ROWS_11) KERNEL(__VA_ARGS__, 12, ROWS_12)
#define ROW_COUNT_SWITCH(rows, NAME, ...)                                                                          \
    switch (rows) {                                                                                                \
        case 1: NAME##_1(__VA_ARGS__); break;                                                                      \
        case 2: NAME##_2(__VA_ARGS__); break;                                                                      \
        case 3: NAME##_3(__VA_ARGS__); break;                                                                      \
        case 4: NAME##_4(__VA_ARGS__); break;                                                                      \
        case 5: NAME##_5(__VA_ARGS__); break;                                                                      \
        case 6: NAME##_6(__VA_ARGS__); break;                                                                      \
        case 7: NAME##_7(__VA_ARGS__); break;                                                                      \
        case 8: NAME##_8(__VA_ARGS__); break;                                                                      \
        case 9: NAME##_9(__VA_ARGS__); break;                                                                      \
        case 10: NAME##_10(__VA_ARGS__); break;                                                                    \
        case 11: NAME##_11(__VA_ARGS__); break;                                                                    \
        case 12: NAME##_12(__VA_ARGS__); break;                                                                    \
        default: abort(); /* TILE_ROWS gives 1 to 12 rows */                                                       \
    }
/* A call's rows against one tile, as calls FN(rows, x, tile, r0, ...) of a kernel for that many rows from row r0:
 * 12 at a time, then the last 1 to 11 in one call, so each row count up to 12 reads a tile's weights once (how many
 * go together never changes how one row is computed). */
#define TILE_ROWS(n, FN, x, tile, ...)                                                                             \
    {                                                                                                              \
        int r_ = 0;                                                                                                \
        for (; (n) - r_ >= 12; r_ += 12) FN(12, x, tile, r_, __VA_ARGS__);                                        \
        if ((n) > r_) FN((n) - r_, x, tile, r_, __VA_ARGS__);                                                      \
    }
/* The kernels for 1 to 12 rows of one weight type; then all rows of a call (TILE_ROWS), its tiles shared among the
 * threads. */
#define LINEAR(NAME, WEIGHT, LOAD)                                                                                 \
EACH_ROW_COUNT(LINEAR_ROWS, NAME, WEIGHT, LOAD)                                                                   \
static void NAME##_rows(int rows, const float *x, const WEIGHT *tile, int r0, int in, int out, float *y, int o0) {\
    const float *xr = x + (int64_t)r0 * in;                                                                        \
    float *yr = y + (int64_t)r0 * out;                                                                             \
    ROW_COUNT_SWITCH(rows, NAME, xr, tile, in, out, yr, o0)                                                        \
}                                                                                                                  \
void NAME(const float *x, const WEIGHT *tiles, int n, int in, int out, float *y, int threads) {                  \
    int count = (out + TILE - 1) / TILE;                                                                           \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                              \
    for (int t = 0; t < count; t++) {                                                                              \
        const WEIGHT *tile = tiles + (int64_t)t * in * TILE;                                                       \
        int o0 = t * TILE;                                                                                         \
        TILE_ROWS(n, NAME##_rows, x, tile, in, out, y, o0)                                                         \
    }                                                                                                              \
}

LINEAR(tr_linear_f16, uint16_t, LOAD_F16)
LINEAR(tr_linear_f32, float, LOAD_F32)

#ifdef __AVX512BF16__
/* y (n, out) = x (n, in) @ w^T with bf16 products (tr_linear_bf16): w bf16 and x rounded to bf16 (to nearest even),
 * each product pair summed into fp32 by the CPU's bf16 dot product (vdpbf16ps: 32 multiplies an instruction, twice
 * an fp32 multiply-add's, and no conversion of the weights). The weights come in tiles of TILE outputs by input pairs
 * (layouts.py's bf16 pack): tile t holds, pair p after pair p, outputs TILE*t..TILE*t+TILE-1's weights of inputs
 * 2p and 2p + 1 side by side (zeros past out and past in). Each output y[r][o] is one sum whatever the call: pair 0's
 * two products into 0, then pair p's added for p in order, one dot-product instruction a pair; rows go against a
 * tile as in tr_linear_f16 (TILE_ROWS), so a row's bits do not depend on how many rows the call has. */
#define ROW_DP(r)                                                                                                  \
    {                                                                                                              \
        __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[(int64_t)(r) * pairs + p]);                               \
        a##r##0 = _mm512_dpbf16_ps(a##r##0, xb, w0);                                                               \
        a##r##1 = _mm512_dpbf16_ps(a##r##1, xb, w1);                                                               \
    }
#define LINEAR_PAIRS(NAME, R, EACH)                                                                                \
static void NAME##_##R(const uint32_t *x, const uint16_t *tile, int pairs, int out, float *y, int o0) {            \
    EACH(ROW_ZERO)                                                                                                 \
    for (int p = 0; p < pairs; p++) {                                                                              \
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + (int64_t)p * 2 * TILE),                                  \
                 w1 = (__m512bh)_mm512_loadu_si512(tile + (int64_t)p * 2 * TILE + TILE);                           \
        FETCH(R, tile + (int64_t)p * 2 * TILE, 2 * TILE * sizeof(uint16_t))                                       \
        EACH(ROW_DP)                                                                                               \
    }                                                                                                              \
    EACH(ROW_STORE)                                                                                                \
}
EACH_ROW_COUNT(LINEAR_PAIRS, bf16_rows)

static void bf16_rows(int rows, const uint32_t *x, const uint16_t *tile, int r0, int pairs, int out, float *y,
                      int o0) {
    const uint32_t *xr = x + (int64_t)r0 * pairs;
    float *yr = y + (int64_t)r0 * out;
    ROW_COUNT_SWITCH(rows, bf16_rows, xr, tile, pairs, out, yr, o0)
}

void tr_linear_bf16(const float *x, const uint16_t *tiles, int n, int in, int out, float *y, int threads) {
    int pairs = (in + 1) / 2, count = (out + TILE - 1) / TILE;
    uint32_t *xp = malloc(sizeof(uint32_t) * (size_t)n * pairs);
    if (!xp) abort(); /* a few kB a call: without them the process could not go on anyway */
    for (int r = 0; r < n; r++) { /* each row's inputs rounded to bf16, two to a 32-bit word (the odd one's pair 0) */
        const float *xr = x + (int64_t)r * in;
        uint16_t *h = (uint16_t *)(xp + (int64_t)r * pairs);
        int i = 0;
        for (; i + 32 <= in; i += 32)
            _mm512_storeu_si512(h + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16),
                                                                    _mm512_loadu_ps(xr + i)));
        if (i < in) {
            float part[32] = {0};
            memcpy(part, xr + i, sizeof(float) * (in - i));
            uint16_t hs[32];
            _mm512_storeu_si512(hs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(part + 16), _mm512_loadu_ps(part)));
            memcpy(h + i, hs, sizeof(uint16_t) * (2 * pairs - i));
        }
    }
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int t = 0; t < count; t++) {
        const uint16_t *tile = tiles + (int64_t)t * pairs * 2 * TILE;
        int o0 = t * TILE;
        TILE_ROWS(n, bf16_rows, xp, tile, pairs, out, y, o0)
    }
    free(xp);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* y (n, out) = x (n, in) @ w^T on AMX tiles (tr_linear_amx): w bf16, x rounded to bf16 (to nearest even), fp32 sums,
 * fp32 out. The weights come in blocks of AMX_OUT = 32 outputs (layouts.py's amx pack): block b holds, for each run k
 * of 32 inputs in order, two B tiles (outputs 32b..32b+15, then 32b+16..32b+31), each 16 rows of input pairs by 16
 * outputs (row p: output o's weights of inputs 32k + 2p and 32k + 2p + 1 side by side; zeros past out and in), 1 kB
 * each, so a block is read front to back. The rows go in tiles of 16 (the last padded with zero rows).
 *
 * Each output y[r][o] is one sum whatever the call: a tile accumulator at 0, then one tdpbf16ps per run of 32 inputs,
 * runs in order; an accumulator's row r depends on row r of the inputs alone, so a row's bits do not depend on how
 * many rows the call has (padding rows are other rows). Row tiles go two at a time against a block's two B tiles
 * (4 accumulators, 2 A and 2 B tiles: the 8 tile registers); the block's weights come from memory on the first pair
 * (prefetched AMX_AHEAD bytes ahead) and from the core's cache for the others, so many rows cost arithmetic, not
 * more reading. A call of one row tile takes the blocks two at a time instead (one A tile a run for both, two
 * streams of weights: 0.95x at 1-8 rows on an AMX Xeon). Needs the tile state granted to the process (tr_amx_ready)
 * and configured in each thread. */
#define AMX_OUT 32
#define AMX_IN 32
#define AMX_AHEAD 4096
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where this process may use the AMX tiles (asked of the kernel once: arch_prctl ARCH_REQ_XCOMP_PERM), else 0. */
int tr_amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned long bits = 0;
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
            ready = 0;
        else
            ready = syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && (bits >> XFEATURE_XTILEDATA & 1);
    }
    return ready;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static void amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { /* tmm0-3 accumulators (16 x 16 fp32), tmm4-5 A (16 x 32 bf16), tmm6-7 B */
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* One block of 32 outputs against one row tile (arow: its 16 rows of kb * 32 bf16, `lda` bytes apart; w: the block's
 * tiles): accumulators tmm0-1; runs two at a time, A tiles tmm4 then tmm5 and B tiles tmm6-7 then tmm2-3, so the
 * next run's tiles load while the last run's products are made (tiles have no renaming: a load into a tile waits
 * for the products reading it). Stores the 16 rows by 32 floats to out, rows `ldo` floats apart. */
static void amx_block1(const char *arow, int64_t lda, const uint16_t *w, int kb, int fetch, float *out, int64_t ldo) {
    _tile_zero(0);
    _tile_zero(1);
    int k = 0;
    for (; k + 2 <= kb; k += 2) {
        const uint16_t *b = w + (int64_t)k * 2 * 512;
        if (fetch)
            for (int f = 0; f < 4096; f += 64) _mm_prefetch((const char *)b + AMX_AHEAD + f, _MM_HINT_T0);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_loadd(2, b + 1024, 64);
        _tile_loadd(3, b + 1536, 64);
        _tile_loadd(4, arow + k * 64, lda);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, arow + (k + 1) * 64, lda);
        _tile_dpbf16ps(0, 5, 2);
        _tile_dpbf16ps(1, 5, 3);
    }
    if (k < kb) {
        const uint16_t *b = w + (int64_t)k * 2 * 512;
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_loadd(4, arow + k * 64, lda);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
}

/* The same against the row tiles m0 and m0 + 1 (two): 4 accumulators tmm0-3, A tiles tmm4-5, B tiles tmm6-7 (all 8
 * tile registers); 32 rows by 32 floats to out (rows `ldo` floats apart). Each accumulator gets the same products in
 * the same order as in amx_block1: a row's bits do not depend on which of the two ran it. */
static void amx_block2(const char *arow, int64_t lda, const uint16_t *w, int kb, int fetch, float *out, int64_t ldo) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < kb; k++) {
        const uint16_t *b = w + (int64_t)k * 2 * 512;
        if (fetch)
            for (int f = 0; f < 2048; f += 64) _mm_prefetch((const char *)b + AMX_AHEAD + f, _MM_HINT_T0);
        _tile_loadd(4, arow + k * 64, lda);
        if (k % 2 == 0) { /* each load comes after the products that read its tile, and while others run */
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, arow + 16 * lda + k * 64, lda);
            _tile_dpbf16ps(3, 5, 7);
            _tile_dpbf16ps(2, 5, 6);
        } else {
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, arow + 16 * lda + k * 64, lda);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
    _tile_stored(2, out + 16 * ldo, ldo * 4);
    _tile_stored(3, out + 16 * ldo + 16, ldo * 4);
}

/* One row tile against two blocks side by side (64 outputs; w2: the second block's tiles): accumulators tmm0-1 for
 * w, tmm2-3 for w2, the A tile tmm4 loaded once a run for both, B tiles through tmm5-7; both blocks' weights
 * prefetched, two streams. Each accumulator gets the products amx_block1 gives it, in its order, so the bits are
 * amx_block1's. Stores to out (w's 32 columns) and out2 (w2's), rows `ldo` floats apart. */
static void amx_block1x2(const char *arow, int64_t lda, const uint16_t *w, const uint16_t *w2, int kb, float *out,
                         float *out2, int64_t ldo) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < kb; k++) {
        const uint16_t *b = w + (int64_t)k * 2 * 512, *b2 = w2 + (int64_t)k * 2 * 512;
        for (int f = 0; f < 2048; f += 64) {
            _mm_prefetch((const char *)b + AMX_AHEAD + f, _MM_HINT_T0);
            _mm_prefetch((const char *)b2 + AMX_AHEAD + f, _MM_HINT_T0);
        }
        _tile_loadd(4, arow + k * 64, lda);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b2, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b2 + 512, 64); /* after the product reading tmm5 */
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
    _tile_stored(2, out2, ldo * 4);
    _tile_stored(3, out2 + 16, ldo * 4);
}

/* A core's L2 cache in bytes, as the system says (2 MB where it does not). */
static int64_t l2_cache_bytes(void) {
    static int64_t bytes = -1;
    if (bytes < 0) {
        long got = sysconf(_SC_LEVEL2_CACHE_SIZE);
        bytes = got > 0 ? got : 2 << 20;
    }
    return bytes;
}

/* A row of `in` inputs rounded to bf16 (to nearest even) at h, zeros past in up to the next multiple of 32. */
static void amx_round_row(const float *xr, int in, uint16_t *h) {
    int i = 0;
    for (; i + 32 <= in; i += 32)
        _mm512_storeu_si512(h + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(xr + i)));
    if (i < in) {
        float part[32] = {0};
        memcpy(part, xr + i, sizeof(float) * (in - i));
        _mm512_storeu_si512(h + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(part + 16), _mm512_loadu_ps(part)));
    }
}

/* tr_linear_amx's products for one row tile (n <= 16 rows, an output that stays in the cache), inside its threads:
 * the blocks shared out in `parts` runs of consecutive blocks (one a thread: as even as static scheduling of the
 * blocks), each run's blocks two at a time (amx_block1x2: one A tile a run for both, two streams of weights), an odd
 * run's last block alone (amx_block1). Whole tiles are stored straight into y, others through a buffer. */
static void amx_one_tile(const char *a, int64_t lda, const uint16_t *tiles, int kb, int count, int n, int out,
                         float *y, int parts) {
    float c[16 * 32], c2[16 * 32];
    int64_t size = (int64_t)kb * 2 * 512; /* a block's tiles, in uint16_t */
    _Pragma("omp for schedule(static)")
    for (int part = 0; part < parts; part++) {
        int t = (int)((int64_t)count * part / parts), end = (int)((int64_t)count * (part + 1) / parts);
        for (; t + 2 <= end; t += 2) {
            int o0 = t * AMX_OUT, cols2 = out - o0 - AMX_OUT < AMX_OUT ? out - o0 - AMX_OUT : AMX_OUT;
            const uint16_t *w = tiles + t * size;
            if (n == 16 && cols2 == AMX_OUT) {
                amx_block1x2(a, lda, w, w + size, kb, y + o0, y + o0 + AMX_OUT, out);
                continue;
            }
            amx_block1x2(a, lda, w, w + size, kb, c, c2, 32);
            for (int r = 0; r < n; r++) {
                memcpy(y + (int64_t)r * out + o0, c + r * 32, sizeof(float) * AMX_OUT);
                memcpy(y + (int64_t)r * out + o0 + AMX_OUT, c2 + r * 32, sizeof(float) * cols2);
            }
        }
        if (t < end) {
            int o0 = t * AMX_OUT, cols = out - o0 < AMX_OUT ? out - o0 : AMX_OUT;
            int whole = n == 16 && cols == AMX_OUT;
            amx_block1(a, lda, tiles + t * size, kb, 1, whole ? y + o0 : c, whole ? out : 32);
            if (!whole)
                for (int r = 0; r < n; r++) memcpy(y + (int64_t)r * out + o0, c + r * 32, sizeof(float) * cols);
        }
    }
}

/* tr_linear_amx's products for any rows, inside its threads: per block of 32 outputs, the row tiles two at a time
 * (amx_block2; a last odd one amx_block1), the block's weights from memory on the first pair and from the core's
 * cache for the others. Whole tiles of an output that stays in the cache are stored straight into y; the others go
 * through a buffer, an output larger than the L2 cache (stream) in streamed stores. */
static void amx_tiles(const char *a, int64_t lda, const uint16_t *tiles, int kb, int count, int mt, int n, int out,
                      float *y, int stream) {
    float c[32 * 32];
    _Pragma("omp for schedule(static)")
    for (int t = 0; t < count; t++) {
        const uint16_t *w = tiles + (int64_t)t * kb * 2 * 512;
        int o0 = t * AMX_OUT, cols = out - o0 < AMX_OUT ? out - o0 : AMX_OUT;
        for (int m = 0; m < mt; m += 2) {
            int two = m + 1 < mt, r0 = m * 16, rows = n - r0 < (two ? 32 : 16) ? n - r0 : (two ? 32 : 16);
            const char *arow = a + (int64_t)m * 16 * lda;
            int whole = !stream && cols == AMX_OUT && rows == (two ? 32 : 16);
            float *to = whole ? y + (int64_t)r0 * out + o0 : c;
            if (two)
                amx_block2(arow, lda, w, kb, m == 0, to, whole ? out : 32);
            else
                amx_block1(arow, lda, w, kb, m == 0, to, whole ? out : 32);
            if (whole)
                continue;
            for (int r = 0; r < rows; r++) {
                float *dst = y + (int64_t)(r0 + r) * out + o0;
                if (stream && cols == 32 && ((uintptr_t)dst & 63) == 0) {
                    _mm512_stream_ps(dst, _mm512_loadu_ps(c + r * 32));
                    _mm512_stream_ps(dst + 16, _mm512_loadu_ps(c + r * 32 + 16));
                } else
                    memcpy(dst, c + r * 32, sizeof(float) * cols);
            }
        }
    }
}

/* The calling thread's buffer for a call's inputs rounded to bf16 (grown, never shrunk; one per thread that calls). */
static _Thread_local uint16_t *amx_rows;
static _Thread_local size_t amx_rows_size;

void tr_linear_amx(const float *x, const uint16_t *tiles, int n, int in, int out, float *y, int threads) {
    int kb = (in + AMX_IN - 1) / AMX_IN, mt = (n + 15) / 16, count = (out + AMX_OUT - 1) / AMX_OUT;
    int64_t lda = (int64_t)kb * AMX_IN * 2; /* bytes between rows of the rounded inputs */
    if (n <= 0) return;
    size_t need = (size_t)mt * 16 * lda;
    if (need > amx_rows_size) {
        free(amx_rows);
        amx_rows = aligned_alloc(64, need);
        if (!amx_rows) abort(); /* tens of kB a call: without them the process could not go on anyway */
        amx_rows_size = need;
    }
    uint16_t *a = amx_rows;
    /* an output larger than a core's L2 cache (the output layer's: rows x vocabulary) goes to memory in streamed
     * stores, around the caches: written in 128-byte pieces scattered over its rows, it otherwise costs a read of
     * each line before its write (measured on an AMX Xeon: 96 rows of a 49152-word output layer 5.9 -> 3.5 ms);
     * smaller ones (the body's, read by the next call) stay in the cache. The values are the same either way. */
    int stream = (int64_t)n * out * 4 > l2_cache_bytes();
    memset((char *)a + (size_t)n * lda, 0, (size_t)(mt * 16 - n) * lda); /* the padding rows: zeros */
    /* each row's inputs rounded to bf16, zeros past in (written whole: kb runs of 32): the rows shared out among the
     * threads where the inputs pass small_ops_shared floats, else by this thread before they start (no barrier) */
    int share = (int64_t)n * in > small_ops_shared;
    if (!share)
        for (int r = 0; r < n; r++)
            amx_round_row(x + (int64_t)r * in, in, (uint16_t *)((char *)a + r * lda));
    _Pragma("omp parallel num_threads(threads)")
    {
        if (share) {
            _Pragma("omp for schedule(static)")
            for (int r = 0; r < n; r++)
                amx_round_row(x + (int64_t)r * in, in, (uint16_t *)((char *)a + r * lda));
        }
        amx_configure();
        if (mt == 1 && !stream)
            amx_one_tile((const char *)a, lda, tiles, kb, count, n, out, y, threads);
        else
            amx_tiles((const char *)a, lda, tiles, kb, count, mt, n, out, y, stream);
        if (stream)
            _mm_sfence(); /* the streamed stores reach memory before the threads part */
        _tile_release();
    }
}

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
/* Attention's shared part on AMX tiles (tr_attend_amx, the fast mode's `amx` format; D = 64): tr_attend's layout and
 * order with the shared keys' scores and weighted values as tile products. A row's query and its shared keys are
 * rounded to bf16 (to nearest even), each score summed in fp32 by two tdpbf16ps (dims 0-31, then 32-63); the
 * softmax in fp32 over the row's shared scores and its window's (the window's scores and weighted values in fp32 as
 * in attend_rows64); the shared part's numerators rounded to bf16 and multiplied by the values rounded to bf16, one
 * tdpbf16ps per run of 32 keys in order, into fp32. An accumulator's row r depends on row r of the A tile alone, so
 * every row's bits are the same whatever rows share its tiles (the padding rows are other rows), and a plain step runs
 * the same code. */

/* The shared keys 0..start-1 of one kv head (start a multiple of 64; rows of 64 floats), from key k0 (a multiple of
 * 64) on, as B tiles for the scores: block b of 16 keys, run r of 32 dims: the 1 kB tile at kt + (2b + r) * 512, its
 * row p holding keys 16b..16b+15's dims 32r + 2p and 32r + 2p + 1 in turn. And as B tiles for the weighted values:
 * run s of 32 keys, group c of 16 dims: the tile at vt + (4s + c) * 512, its row p holding dims 16c..16c+15 of keys
 * 32s + 2p and 32s + 2p + 1 side by side. 64 keys each call. */
static void kv_tiles64(const float *keys, const float *values, int64_t k0, uint16_t *kt, uint16_t *vt) {
    const __m512i rows = _mm512_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480);
    const __m512i pairs = _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004, 0x150005, 0x160006,
                                            0x170007, 0x180008, 0x190009, 0x1a000a, 0x1b000b, 0x1c000c, 0x1d000d,
                                            0x1e000e, 0x1f000f); /* 16-bit lanes 0, 16, 1, 17, ...: two rows interleaved */
    for (int64_t b = k0 / 16; b < k0 / 16 + 4; b++) {
        uint32_t words[16 * 32] __attribute__((aligned(64))); /* key j's dims as bf16 pairs: words[32 j + w] */
        for (int j = 0; j < 16; j++) {
            const float *k = keys + (16 * b + j) * 64;
            _mm512_store_si512(words + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(k + 16), _mm512_loadu_ps(k)));
            _mm512_store_si512(words + 32 * j + 16,
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(k + 48), _mm512_loadu_ps(k + 32)));
        }
        for (int r = 0; r < 2; r++)
            for (int p = 0; p < 16; p++)
                _mm512_storeu_si512(kt + (2 * b + r) * 512 + p * 32,
                                    _mm512_i32gather_epi32(rows, (const void *)(words + 16 * r + p), 4));
    }
    for (int64_t s = k0 / 32; s < k0 / 32 + 2; s++)
        for (int p = 0; p < 16; p++) {
            const float *v0 = values + (32 * s + 2 * p) * 64, *v1 = v0 + 64;
            for (int c = 0; c < 4; c++) {
                __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v1 + 16 * c), _mm512_loadu_ps(v0 + 16 * c));
                _mm512_storeu_si512(vt + (4 * s + c) * 512 + p * 32, _mm512_permutexvar_epi16(pairs, both));
            }
        }
}

/* attend_rows64 for rows 0..B-1 (B <= 16) of one kv head, the shared part on tiles: kt, vt its keys' and values' tiles
 * (kv_tiles64). Scratch: w 16 * (start + BLOCK) floats, acc 16 * 64 floats, pb 16 * start and qb 16 * 64 bf16 (their
 * rows past B: any finite values, as calloc leaves them). Tiles: tmm0-3 accumulators, tmm4-5 A, tmm6-7 (and tmm5 for
 * the values) B; configured by the caller. */
static void attend_tiles64(const float *q, int B, const uint16_t *kt, const uint16_t *vt, const float *keys,
                           const float *values, int64_t start, const int64_t *index, const uint8_t *valid, int row0,
                           int group, int heads, int kv, float *w, float *acc, uint16_t *pb, uint16_t *qb,
                           float *out) {
    int64_t len = start + BLOCK;
    float totals[16];
    if (start) {
        for (int b = 0; b < B; b++) { /* the queries rounded to bf16: A tiles of dims 0-31 and 32-63 */
            const float *qr = q + b * 64;
            _mm512_storeu_si512(qb + b * 64, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qr + 16), _mm512_loadu_ps(qr)));
            _mm512_storeu_si512(qb + b * 64 + 32,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qr + 48), _mm512_loadu_ps(qr + 32)));
        }
        _tile_loadd(4, qb, 128);
        _tile_loadd(5, qb + 32, 128);
        for (int64_t b = 0; b < start / 16; b += 4) { /* 4 blocks of 16 keys' scores: each dims 0-31 then 32-63 */
            const uint16_t *k = kt + 2 * b * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
/* block i's scores into accumulator i: its two B tiles (dims 0-31, then 32-63) against the queries in tmm4-5 */
#define SCORES(i)                                                                                                  \
    _tile_loadd(6, k + 1024 * (i), 64);                                                                            \
    _tile_loadd(7, k + 1024 * (i) + 512, 64);                                                                      \
    _tile_dpbf16ps(i, 4, 6);                                                                                       \
    _tile_dpbf16ps(i, 5, 7);
            SCORES(0)
            SCORES(1)
            SCORES(2)
            SCORES(3)
#undef SCORES
            _tile_stored(0, w + 16 * b, len * 4);
            _tile_stored(1, w + 16 * b + 16, len * 4);
            _tile_stored(2, w + 16 * b + 32, len * 4);
            _tile_stored(3, w + 16 * b + 48, len * 4);
        }
    }
    for (int b = 0; b < B; b++) { /* the window's scores, the softmax, the shared numerators rounded to bf16 */
        int r = (row0 + b) / group;
        totals[b] = window_softmax64(q + b * 64, keys, start, index + (int64_t)r * BLOCK, valid + (int64_t)r * BLOCK,
                                     w + b * len);
        for (int64_t j = 0; j < start; j += 32)
            _mm512_storeu_si512(pb + b * start + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + b * len + j + 16),
                                                                                 _mm512_loadu_ps(w + b * len + j)));
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < start / 32; s++) { /* the shared values: each run of 32 keys into dims 0-15 .. 48-63 */
        const uint16_t *v = vt + 4 * s * 512;
        _tile_loadd(4, pb + 32 * s, start * 2);
        _tile_loadd(6, v, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, v + 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, v + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, v + 1536, 64);
        _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, acc, 256);
    _tile_stored(1, acc + 16, 256);
    _tile_stored(2, acc + 32, 256);
    _tile_stored(3, acc + 48, 256);
    for (int b = 0; b < B; b++) { /* the window's values, the division */
        int row = row0 + b, r = row / group;
        window_out64(acc + b * 64, w + b * len + start, values, index + (int64_t)r * BLOCK, valid + (int64_t)r * BLOCK,
                     totals[b], out + ((int64_t)r * heads + kv * group + row % group) * 64);
    }
}

/* Whether tr_layers attends with tr_attend_amx in the amx format (native.py turns it on once its check passed; off, it
 * runs tr_attend there too). */
static int attend_tiles = 0;
void tr_attend_tiles(int on) { attend_tiles = on; }

/* The calling thread's buffer for a call's key and value tiles (grown, never shrunk; one per thread that calls). */
static _Thread_local uint16_t *kv_scratch;
static _Thread_local size_t kv_scratch_size;

/* tr_attend with the shared part on AMX tiles (attend_tiles64), for D = 64 where the tile state is granted; other
 * head sizes (a shape of the model, the same for every call) run tr_attend. The shared keys and values come laid in
 * tiles (kv_tiles64) at `tiles`: per kv head, the keys' tiles of `cap` positions (cap * 64 bf16), then the values'
 * (as many); those of positions tiled_from..start-1 (multiples of 64) are laid first, 64 keys a task (the earlier
 * ones were laid by earlier calls: tr_layers keeps them with the cache). tiles NULL: laid afresh in a buffer of the
 * calling thread. Then the rows go in blocks of up to 16 of one kv head (fewer where that leaves threads idle). */
static void attend_amx(const float *queries, int padded, const float *keys, const float *values, int64_t head_stride,
                       int64_t start, const int64_t *index, const uint8_t *valid, int n, int group, int kv_heads,
                       float *out, int threads, uint16_t *tiles, int64_t cap, int64_t tiled_from) {
    int m = n * group, heads = kv_heads * group;
    int many = (int64_t)kv_heads * m * (start + BLOCK) * 64 > (1 << 16);
    int rows = (int)((int64_t)kv_heads * m / (2 * (many ? threads : 1)));
    rows = rows < 1 ? 1 : rows > 16 ? 16 : rows;
    int per_head = (m + rows - 1) / rows;
    if (!tiles) {
        cap = start;
        tiled_from = 0;
        size_t need = sizeof(uint16_t) * 2 * (size_t)kv_heads * cap * 64;
        if (need > kv_scratch_size) {
            free(kv_scratch);
            kv_scratch = aligned_alloc(64, need);
            if (!kv_scratch) abort(); /* a few MB at most: without them the process could not go on anyway */
            kv_scratch_size = need;
        }
        tiles = kv_scratch;
    }
    int64_t tasks = (int64_t)kv_heads * per_head, per_kv = cap * 64, fresh = (start - tiled_from) / 64;
#pragma omp parallel num_threads(threads) if(many)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < kv_heads * fresh; t++) {
            int kv = (int)(t / fresh);
            uint16_t *kt = tiles + 2 * kv * per_kv;
            kv_tiles64(keys + kv * head_stride, values + kv * head_stride, tiled_from + t % fresh * 64, kt,
                       kt + per_kv);
        }
        amx_configure();
        float *w = calloc((size_t)16 * (start + BLOCK) + 16 * 64, sizeof(float));
        uint16_t *pb = calloc((size_t)16 * start + 16 * 64, sizeof(uint16_t));
        if (!w || !pb) abort(); /* tens of kB: without them the process could not go on anyway */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int kv = (int)(t / per_head), row0 = (int)(t % per_head) * rows;
            int count = m - row0 < rows ? m - row0 : rows;
            const uint16_t *kt = tiles + 2 * kv * per_kv;
            attend_tiles64(queries + ((int64_t)kv * padded + row0) * 64, count, kt, kt + per_kv,
                           keys + kv * head_stride, values + kv * head_stride, start, index, valid, row0, group,
                           heads, kv, w, w + 16 * (start + BLOCK), pb, pb + 16 * start, out);
        }
        free(w);
        free(pb);
        _tile_release();
    }
}

/* tr_attend's call with the shared part on AMX tiles, laid afresh (attend_amx): the amx format's attention call by
 * call (the lean forward's path outside tr_layers). */
void tr_attend_amx(const float *queries, int padded, const float *keys, const float *values, int64_t head_stride,
                   int64_t start, const int64_t *index, const uint8_t *valid, int n, int group, int kv_heads, int dim,
                   float *out, int threads) {
    if (dim != 64 || start % BLOCK || !tr_amx_ready())
        tr_attend(queries, padded, keys, values, head_stride, start, index, valid, n, group, kv_heads, dim, out,
                  threads);
    else
        attend_amx(queries, padded, keys, values, head_stride, start, index, valid, n, group, kv_heads, out, threads,
                   NULL, 0, 0);
}
#endif
#endif

/* The CPU's peak rate of the linear layers' products, for calibrate.py's limits: each of `threads` threads runs
 * `rounds` rounds of 16 independent chains of one multiply instruction on registers (no memory: the arithmetic
 * alone). kind (the codes of tr_layers' f16): 0 fp32 fused multiply-adds (16 products each; the fp32 and fp16-weight
 * layers' instruction), 2 bf16 dot products (32 each; tr_linear_bf16's), 3 AMX tile products (amx_peak). 16 chains: more than the instructions'
 * latency times their throughput (on an AMD EPYC, 8 chains already ran at the peak), few enough to stay in registers
 * (24 in an array spilled to memory and ran at half the rate). sink[thread]: a sum that keeps the work from being
 * optimised away. Returns the threads that ran side by side (1 where built without OpenMP: the threads' rounds then
 * ran one after another), or 0 for a kind not built here (nothing run). */
#define CHAINS16(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* kind 3: AMX tile products (tdpbf16ps, 16 x 16 x 32 = 8,192 products each; tr_linear_amx's), 16 a round into 4
 * accumulators, on tiles loaded once with bf16 values of mixed signs and magnitudes (the rate falls by half and more
 * from tiles of equal values to such ones, measured here: the products' data is part of their cost). */
static int amx_peak(int64_t rounds, int threads, float *sink) {
    if (!tr_amx_ready()) return 0;
    _Pragma("omp parallel for schedule(static, 1) num_threads(threads)")
    for (int t = 0; t < threads; t++) {
        uint16_t data[2][512] __attribute__((aligned(64)));
        uint32_t r = 12345u + (uint32_t)t;
        for (int i = 0; i < 1024; i++) {
            r = r * 1103515245u + 12345u;
            data[i / 512][i % 512] = (uint16_t)(0x3f80u ^ ((r >> 16) & 0x807fu)); /* sign and low mantissa bits */
        }
        float out[256];
        amx_configure();
        _tile_loadd(4, data[0], 64);
        _tile_loadd(5, data[1], 64);
        _tile_loadd(6, data[1], 64);
        _tile_loadd(7, data[0], 64);
        for (int64_t i = 0; i < rounds; i++)
            for (int j = 0; j < 4; j++) {
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        _tile_stored(0, out, 64);
        sink[t] = out[0];
        _tile_release();
    }
#ifdef _OPENMP
    return threads;
#else
    return 1;
#endif
}
#endif
int tr_peak_products(int kind, int64_t rounds, int threads, float *sink) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (kind == 3) return amx_peak(rounds, threads, sink);
#endif
#ifdef __AVX512BF16__
    if (kind != 0 && kind != 2) return 0;
#else
    if (kind != 0) return 0;
#endif
    _Pragma("omp parallel for schedule(static, 1) num_threads(threads)")
    for (int t = 0; t < threads; t++) {
#define CHAIN_ZERO(c) __m512 a##c = _mm512_set1_ps(1e-3f * c);
#define CHAIN_FMA(c) a##c = _mm512_fmadd_ps(x, a##c, w);
#define CHAIN_DP(c) a##c = _mm512_dpbf16_ps(a##c, xb, wb);
#define CHAIN_SUM(c) total = _mm512_add_ps(total, a##c);
        CHAINS16(CHAIN_ZERO)
        __m512 x = _mm512_set1_ps(0.999f), w = _mm512_set1_ps(1e-4f), total = _mm512_setzero_ps();
        if (kind == 0)
            for (int64_t r = 0; r < rounds; r++) {
                CHAINS16(CHAIN_FMA)
            }
#ifdef __AVX512BF16__
        __m512bh xb = _mm512_cvtne2ps_pbh(x, x), wb = _mm512_cvtne2ps_pbh(w, w);
        if (kind == 2)
            for (int64_t r = 0; r < rounds; r++) {
                CHAINS16(CHAIN_DP)
            }
#endif
        CHAINS16(CHAIN_SUM)
        sink[t] = _mm512_reduce_add_ps(total);
#undef CHAIN_ZERO
#undef CHAIN_FMA
#undef CHAIN_DP
#undef CHAIN_SUM
    }
#ifdef _OPENMP
    return threads;
#else
    return 1;
#endif
}

/* tr_layers' small operations over many rows: the rows shared among `threads` threads in runs of whole rows where
 * the call's floats pass small_ops_shared (fewer: one thread, as waking the others costs more than they save). Each
 * row is computed by the same function from its own inputs alone, so its bits do not depend on the split. */
#define SPLIT_ROWS(n, width, threads, ...)                                                                         \
    do {                                                                                                           \
        int parts_ = (int64_t)(n) * (width) > small_ops_shared && (threads) > 1 ? (threads) : 1;                   \
        _Pragma("omp parallel for schedule(static) num_threads(parts_) if(parts_ > 1)")                            \
        for (int p_ = 0; p_ < parts_; p_++) {                                                                      \
            int r0 = (int)((int64_t)(n) * p_ / parts_), rows = (int)((int64_t)(n) * (p_ + 1) / parts_) - r0;       \
            if (rows > 0) __VA_ARGS__;                                                                             \
        }                                                                                                          \
    } while (0)

static void add_rms_norm_rows(float *x, const float *delta, const float *weight, float eps, int n, int d, float *out,
                              int threads) {
    SPLIT_ROWS(n, d, threads, tr_add_rms_norm(x + (int64_t)r0 * d, delta ? delta + (int64_t)r0 * d : NULL, weight,
                                              eps, rows, d, out + (int64_t)r0 * d));
}

static void silu_mul_rows(const float *gate_up, int n, int inter, float *act, int threads) {
    SPLIT_ROWS(n, 2 * inter, threads, tr_silu_mul(gate_up + (int64_t)r0 * 2 * inter, rows, inter,
                                                  act + (int64_t)r0 * inter));
}

/* silu_mul_rows on its own: the call native.py times, shared and not, to set small_ops_shared (choose_sharing). */
void tr_silu_mul_rows(const float *gate_up, int n, int inter, float *act, int threads) {
    silu_mul_rows(gate_up, n, inter, act, threads);
}

/* tr_rope_store of the fused q/k/v rows (qkv, `width` floats a row): rows r0.. go to queries' rows r0 * group on and
 * to the key and value buffers' positions past + r0 on. */
static void rope_store_rows(const float *qkv, int64_t width, const float *cos, const float *sin, int n, int heads,
                            int kv_heads, int dim, float scale, float *queries, int padded, float *keys,
                            float *values, int64_t head_stride, int64_t past, int threads) {
    int nq = heads * dim, nkv = kv_heads * dim, group = heads / kv_heads;
    SPLIT_ROWS(n, width, threads, {
        const float *q = qkv + (int64_t)r0 * width;
        tr_rope_store(q, q + nq, q + nq + nkv, width, cos + (int64_t)r0 * dim, sin + (int64_t)r0 * dim, rows, heads,
                      kv_heads, dim, scale, queries + (int64_t)r0 * group * dim, padded, keys, values, head_stride,
                      past + r0);
    });
}

/* The decoder layers of a Llama-family model for one step's n rows, the same calls the lean forward makes from
 * Python one by one (lean.py's _windowed_native), so the same bits. weights (layers, 6): per layer the pointers of
 * its input norm's weight, its fused q/k/v tiles, o tiles, post-attention norm's weight, fused gate/up tiles and down
 * tiles (fp32 where f16 is 0, fp16 where 1, bf16 pairs where 2: tr_linear_bf16, AMX tiles where 3: tr_linear_amx);
 * eps (layers, 2) the norms' epsilons; kv (layers, 3): its key and value buffers (Hkv, capacity, D), where the step's rows go from position
 * past on, and their floats per kv head. hidden (n, d): the embedded rows, the residual stream updated in place; x
 * (n, d): the final norm's output. The buffers: qkv
 * (n, (H + 2 Hkv) D), att (n, H D), o and delta (n, d), gate_up (n, 2 inter), act (n, inter); queries, rows and
 * windows as tr_attend's. In the amx format with its attention on tiles (tr_attend_tiles), tiles (layers): per layer
 * the address of its keys' and values' AMX tiles for `cap` positions (attend_amx), laid from tiled_from to the
 * window's start by this call; NULL: laid afresh in each layer's call. */
void tr_layers(int layers, const int64_t *weights, const float *eps, const int64_t *kv, int64_t past, int f16, int d,
               int heads, int kv_heads, int dim, int inter, float scale, int n, float *hidden, float *x,
               const float *cos, const float *sin, float *queries, int padded, int64_t start, const int64_t *index,
               const uint8_t *valid, float *qkv, float *att, float *o, float *gate_up, float *act, float *delta,
               const float *final_norm, float final_eps, int threads, const int64_t *tiles, int64_t cap,
               int64_t tiled_from) {
    int nq = heads * dim, nkv = kv_heads * dim, width = nq + 2 * nkv;
    const float *last = NULL;
#ifdef __AVX512BF16__
#define LINEAR_BF16(in_rows, tiles, in, out, y) tr_linear_bf16(in_rows, (const uint16_t *)(tiles), n, in, out, y, threads)
#else
#define LINEAR_BF16(in_rows, tiles, in, out, y) abort()
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LINEAR_AMX(in_rows, tiles, in, out, y) tr_linear_amx(in_rows, (const uint16_t *)(tiles), n, in, out, y, threads)
#else
#define LINEAR_AMX(in_rows, tiles, in, out, y) abort()
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ATTEND(queries, padded, keys, values, stride, start, index, valid, n, group, kv_heads, dim, out, threads) \
    (f16 == 3 && attend_tiles && dim == 64 && start % BLOCK == 0 && tr_amx_ready()                             \
         ? attend_amx(queries, padded, keys, values, stride, start, index, valid, n, group, kv_heads, out, threads, \
                      tiles ? (uint16_t *)tiles[l] : NULL, cap, tiled_from)                                       \
         : tr_attend(queries, padded, keys, values, stride, start, index, valid, n, group, kv_heads, dim, out,     \
                     threads))
#else
#define ATTEND(...) tr_attend(__VA_ARGS__)
#endif
#define LINEAR_CALL(in_rows, tiles, in, out, y)                                                                    \
    (f16 == 3 ? LINEAR_AMX(in_rows, tiles, in, out, y)                                                             \
     : f16 == 2 ? LINEAR_BF16(in_rows, tiles, in, out, y)                                                          \
     : f16    ? tr_linear_f16(in_rows, (const uint16_t *)(tiles), n, in, out, y, threads)                          \
              : tr_linear_f32(in_rows, (const float *)(tiles), n, in, out, y, threads))
    for (int l = 0; l < layers; l++) {
        const int64_t *w = weights + (int64_t)l * 6, *c = kv + (int64_t)l * 3;
        float *keys = (float *)c[0], *values = (float *)c[1];
        add_rms_norm_rows(hidden, last, (const float *)w[0], eps[2 * l], n, d, x, threads);
        LINEAR_CALL(x, w[1], d, width, qkv);
        rope_store_rows(qkv, width, cos, sin, n, heads, kv_heads, dim, scale, queries, padded, keys, values, c[2],
                        past, threads);
        ATTEND(queries, padded, keys, values, c[2], start, index, valid, n, heads / kv_heads, kv_heads, dim, att,
               threads);
        LINEAR_CALL(att, w[2], nq, d, o);
        add_rms_norm_rows(hidden, o, (const float *)w[3], eps[2 * l + 1], n, d, x, threads);
        LINEAR_CALL(x, w[4], d, 2 * inter, gate_up);
        silu_mul_rows(gate_up, n, inter, act, threads);
        LINEAR_CALL(act, w[5], inter, d, delta);
        last = delta;
    }
#undef LINEAR_CALL
#undef ATTEND
    add_rms_norm_rows(hidden, last, final_norm, final_eps, n, d, x, threads);
}
#endif

#ifdef HAVE_AVX512
/* The k largest values of each row of x (n, v), best first, and their ids (among equal values the lowest id first:
 * argmax's choice), for topk.py's top_k: one pass over each row, 16 values compared with the row's k-th best so far
 * at a time, the few larger ones inserted in order; rows shared among the threads. Returns 0, or 1 where a row holds
 * a NaN or fewer than k values above -infinity (its k best are then not all found here: the caller asks torch). */
int tr_top_k(const float *x, int n, int v, int k, float *values, int64_t *ids, int threads) {
    int bad = 0;
    _Pragma("omp parallel for schedule(static) num_threads(threads) reduction(| : bad) if (n > 1)")
    for (int r = 0; r < n; r++) {
        const float *row = x + (int64_t)r * v;
        float *best = values + (int64_t)r * k;
        int64_t *at = ids + (int64_t)r * k;
        for (int j = 0; j < k; j++) {
            best[j] = -INFINITY;
            at[j] = -1;
        }
        __mmask16 nan = 0;
        __m512 least = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < v; i += 16) {
            __mmask16 valid = i + 16 <= v ? (__mmask16)0xffff : (__mmask16)((1u << (v - i)) - 1);
            __m512 c = _mm512_maskz_loadu_ps(valid, row + i);
            nan |= _mm512_mask_cmp_ps_mask(valid, c, c, _CMP_UNORD_Q);
            for (__mmask16 m = _mm512_mask_cmp_ps_mask(valid, c, least, _CMP_GT_OQ); m; m &= m - 1) {
                int id = i + __builtin_ctz(m), p = k - 1;
                float w = row[id];
                if (!(w > best[k - 1]))
                    continue;
                for (; p > 0 && w > best[p - 1]; p--) { /* after the equal ones: they have lower ids */
                    best[p] = best[p - 1];
                    at[p] = at[p - 1];
                }
                best[p] = w;
                at[p] = id;
                least = _mm512_set1_ps(best[k - 1]);
            }
        }
        if (nan || at[k - 1] < 0)
            bad = 1;
    }
    return bad;
}
#endif
