/* Paged attention for CPU tensors, read in place from the block table (no gathered copy of the context).
 *
 * Built and loaded by engine/kernels/cpu_attention.py; the reference is engine/attention/torch_ref.py.
 * One call covers the listed rows of a step (decode rows and short multi-token rows such as
 * speculative verification). Each row is one work item, computed in a fixed order
 * that depends only on that row's own context: a row's result never depends on which other
 * rows share the call or on how the items are split over threads.
 *
 * Layouts (element strides, all contiguous):
 *   query:       [num_tokens, num_heads, head_size], tokens query_token_stride apart (a view of fused q/k/v)
 *   out:         [num_tokens, num_heads, head_size]
 *   key, value:  [num_blocks, block_size, num_kv_heads, head_size]   (kv_cache[0], kv_cache[1])
 *   block_table: [num_reqs, block_table_stride] int32
 * Row r's tokens are query_start_loc[r] .. query_start_loc[r+1]-1; its context has seq_lens[r]
 * tokens, the new ones last, so query token j (of q) sits at position seq_len - q + j and
 * attends to keys 0 .. that position.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } bits = {(uint32_t)h << 16};
    return bits.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef struct {
    const void *query, *key, *value;
    void *out;
    int64_t query_token_stride;
    const int32_t *block_table, *query_start_loc, *seq_lens, *rows;
    int64_t block_table_stride;
    int num_rows, num_heads, num_kv_heads, head_size, block_size, dtype, max_context;
    float scale;
} Args;

typedef struct {
    const Args *a;
    int first_item, end_item;
    int failed;
} Slice;

/* exp(x) for x <= 0 (scores minus their maximum), vectorisable: 2^(x log2 e) split into an integer power,
 * set in the exponent bits, and 2^f for f in [-0.5, 0.5] by a degree-6 polynomial (relative error < 2e-7,
 * about one float ulp). Below -87 the result is 0, as expf's would be to within denormals. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 pushes the fraction out */
    const float f = t - n;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } scale = {((int32_t)n + 127) << 23}; /* 2^n */
    return p * scale.f;
}

/* s[t] = exp(s[t] - max(s)) in place; returns their sum. */
static float softmax_numerators(float *restrict s, int n) {
    float m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
    for (int t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    return sum;
}

/* Element loads and stores: float32, or bfloat16 held as uint16_t. */
static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* <q, x[0..D)> for x a row of the cache. */
static inline float dot(const float *restrict q, const void *base, int64_t offset, const int D, const int bf16) {
    float s = 0.0f;
    if (bf16) {
        const uint16_t *x = (const uint16_t *)base + offset;
#pragma omp simd reduction(+ : s)
        for (int d = 0; d < D; d++) s += q[d] * bf16_to_f32(x[d]);
    } else {
        const float *x = (const float *)base + offset;
#pragma omp simd reduction(+ : s)
        for (int d = 0; d < D; d++) s += q[d] * x[d];
    }
    return s;
}

/* acc[0..D) += p * x[0..D) for x a row of the cache. */
static inline void axpy(float *restrict acc, float p, const void *base, int64_t offset, const int D, const int bf16) {
    if (bf16) {
        const uint16_t *x = (const uint16_t *)base + offset;
#pragma omp simd
        for (int d = 0; d < D; d++) acc[d] += p * bf16_to_f32(x[d]);
    } else {
        const float *x = (const float *)base + offset;
#pragma omp simd
        for (int d = 0; d < D; d++) acc[d] += p * x[d];
    }
}

static inline void store(void *base, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = f32_to_bf16(x);
    else
        ((float *)base)[i] = x;
}

/* Every query head of one query token over keys 0..n-1 of `row`'s context. Each key's row (all KV
 * heads, contiguous in a block) is read once per pass: scores first, then the weighted values; the
 * scores of the whole context are kept, so the reduction order is fixed by the context alone.
 * Always inlined into callers with constant D and bf16: each per-key loop has a fixed trip count. */
static inline __attribute__((always_inline)) void attend(const Args *a, int row, int token, int n, float *restrict q,
                                                         float *restrict scores, float *restrict acc, const int D,
                                                         const int bf16) {
    const int Hq = a->num_heads, H = a->num_kv_heads, G = Hq / H, bs = a->block_size;
    const int32_t *table = a->block_table + (int64_t)row * a->block_table_stride;
    for (int i = 0; i < Hq * D; i++) q[i] = load(a->query, (int64_t)token * a->query_token_stride + i, bf16);
    for (int t0 = 0, b = 0; t0 < n; t0 += bs, b++) {
        const int64_t block = (int64_t)table[b] * bs * H * D;
        const int end = n - t0 < bs ? n - t0 : bs;
        for (int i = 0; i < end; i++) {
            const int64_t k = block + (int64_t)i * H * D;
            for (int kh = 0, h = 0; kh < H; kh++)
                for (int g = 0; g < G; g++, h++) scores[h * n + t0 + i] = dot(q + h * D, a->key, k + kh * D, D, bf16) * a->scale;
        }
    }
    /* Softmax per query head; the normaliser is applied to the output, not to each weight. */
    float inv_sum[Hq];
    for (int h = 0; h < Hq; h++) inv_sum[h] = 1.0f / softmax_numerators(scores + h * n, n);
    memset(acc, 0, sizeof(float) * Hq * D);
    for (int t0 = 0, b = 0; t0 < n; t0 += bs, b++) {
        const int64_t block = (int64_t)table[b] * bs * H * D;
        const int end = n - t0 < bs ? n - t0 : bs;
        for (int i = 0; i < end; i++) {
            const int64_t v = block + (int64_t)i * H * D;
            for (int kh = 0, h = 0; kh < H; kh++)
                for (int g = 0; g < G; g++, h++) axpy(acc + h * D, scores[h * n + t0 + i], a->value, v + kh * D, D, bf16);
        }
    }
    const int64_t out = (int64_t)token * Hq * D;
    for (int i = 0; i < Hq * D; i++) store(a->out, out + i, acc[i] * inv_sum[i / D], bf16);
}

/* Asks for the next block while this one is computed: blocks are scattered, and the hardware
 * prefetcher does not follow a jump to another page. */
static inline void prefetch_block(const void *base, int64_t offset, int64_t count, const int bf16) {
    const char *p = (const char *)base + offset * (bf16 ? 2 : 4);
    const int64_t bytes = count * (bf16 ? 2 : 4);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

#if defined(__AVX512F__)
/* ---- The vector path with AVX-512, for head sizes that are a multiple of 16 ------------------------------
 * Sixteen float lanes per vector (GCC vector extensions: one AVX-512 register). */
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
enum { LANES = 16 };

static inline v16 load16(const void *base, int64_t offset, const int bf16) {
    if (bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)base + offset, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        v16 f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    v16 f;
    memcpy(&f, (const float *)base + offset, sizeof f);
    return f;
}

/* With AVX512-BF16 (vdpbf16ps): lane j of the result is the sum over 32-element chunks c of
 * q[32c + 2j] k[32c + 2j] + q[32c + 2j + 1] k[32c + 2j + 1], for D a multiple of 32. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_DPBF16 1
static inline v16 dot_bf16_pairs(const uint16_t *q, const uint16_t *k, const int D) {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 32)
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q + c), (__m512bh)_mm512_loadu_si512(k + c));
    return (v16)sum;
}
#else
#define HAVE_DPBF16 0
static inline v16 dot_bf16_pairs(const uint16_t *q, const uint16_t *k, const int D) {
    (void)q, (void)k, (void)D;
    return (v16){0};
}
#endif

/* Lane t of the result is the sum of all lanes of p[t], by the same tree for every t:
 *   level 1 adds neighbouring lanes (pairs of keys share a vector), level 2 pairs of those (four keys
 *   share one), level 3 (eight keys), level 4 (sixteen), each level halving the vectors. */
static inline v16 sum_lanes16(const v16 p[LANES]) {
    v16 u[8], w[4], z[2];
    for (int i = 0; i < 8; i++)
        u[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    for (int i = 0; i < 4; i++)
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return __builtin_shufflevector(z[0], z[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(z[0], z[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* attend() for D % 16 == 0: scores sixteen keys at a time (one vector of partial products per key,
 * summed across lanes by sum_lanes16), weighted values accumulated in vectors. A key's score is the
 * same tree of the same products whatever its place in the chunk, so the result still depends on
 * the row's own context only. */
static inline __attribute__((always_inline)) void attend_vec(const Args *a, int row, int token, int n,
                                                             float *restrict q, float *restrict scores,
                                                             float *restrict acc, const int D, const int bf16) {
    const int Hq = a->num_heads, H = a->num_kv_heads, G = Hq / H, bs = a->block_size, C = D / LANES;
    const int32_t *table = a->block_table + (int64_t)row * a->block_table_stride;
    for (int i = 0; i < Hq * D; i++) q[i] = load(a->query, (int64_t)token * a->query_token_stride + i, bf16);
    for (int t0 = 0, b = 0; t0 < n; t0 += bs, b++) {
        const int64_t block = (int64_t)table[b] * bs * H * D;
        if (t0 + bs < n) prefetch_block(a->key, (int64_t)table[b + 1] * bs * H * D, (int64_t)bs * H * D, bf16);
        const int end = n - t0 < bs ? n - t0 : bs;
        for (int i0 = 0; i0 < end; i0 += LANES) {
            const int count = end - i0 < LANES ? end - i0 : LANES;
            for (int h = 0; h < Hq; h++) {
                const int64_t head = block + (int64_t)i0 * H * D + (int64_t)(h / G) * D;
                v16 qv[C], part[LANES];
                memcpy(qv, q + h * D, sizeof qv);
                if (count == LANES && bf16 && D % 32 == 0 && HAVE_DPBF16) {
                    /* bfloat16 pairs multiplied and added straight into float32 lanes (the products are exact) */
                    const int64_t q_offset = (int64_t)token * a->query_token_stride + (int64_t)h * D;
                    for (int t = 0; t < LANES; t++)
                        part[t] = dot_bf16_pairs((const uint16_t *)a->query + q_offset,
                                                 (const uint16_t *)a->key + head + (int64_t)t * H * D, D);
                } else if (count == LANES) { /* the common case: no branch in the key loop, which then unrolls */
                    for (int t = 0; t < LANES; t++) {
                        v16 sum = qv[0] * load16(a->key, head + (int64_t)t * H * D, bf16);
                        for (int c = 1; c < C; c++) sum += qv[c] * load16(a->key, head + (int64_t)t * H * D + c * LANES, bf16);
                        part[t] = sum;
                    }
                } else {
                    for (int t = 0; t < LANES; t++) {
                        v16 sum = {0};
                        if (t < count) {
                            sum = qv[0] * load16(a->key, head + (int64_t)t * H * D, bf16);
                            for (int c = 1; c < C; c++)
                                sum += qv[c] * load16(a->key, head + (int64_t)t * H * D + c * LANES, bf16);
                        }
                        part[t] = sum;
                    }
                }
                v16 sums = sum_lanes16(part) * a->scale;
                float *out = scores + h * n + t0 + i0;
                if (count == LANES)
                    memcpy(out, &sums, sizeof sums);
                else
                    for (int t = 0; t < count; t++) out[t] = sums[t];
            }
        }
    }
    float inv_sum[Hq];
    for (int h = 0; h < Hq; h++) inv_sum[h] = 1.0f / softmax_numerators(scores + h * n, n);
    v16 *accv = (v16 *)acc; /* [Hq][C], 64-byte aligned by run_slice */
    for (int i = 0; i < Hq * C; i++) accv[i] = (v16){0};
    for (int t0 = 0, b = 0; t0 < n; t0 += bs, b++) {
        const int64_t block = (int64_t)table[b] * bs * H * D;
        if (t0 + bs < n) prefetch_block(a->value, (int64_t)table[b + 1] * bs * H * D, (int64_t)bs * H * D, bf16);
        const int end = n - t0 < bs ? n - t0 : bs;
        for (int h = 0; h < Hq; h++) {
            const int64_t head = block + (int64_t)(h / G) * D;
            const float *p = scores + h * n + t0;
            v16 sum[C];
            memcpy(sum, accv + h * C, sizeof sum);
            for (int t = 0; t < end; t++)
                for (int c = 0; c < C; c++) sum[c] += p[t] * load16(a->value, head + (int64_t)t * H * D + c * LANES, bf16);
            memcpy(accv + h * C, sum, sizeof sum);
        }
    }
    const int64_t out = (int64_t)token * Hq * D;
    for (int i = 0; i < Hq * D; i++) store(a->out, out + i, acc[i] * inv_sum[i / D], bf16);
}

#define attend_fast attend_vec
#else
/* ---- The vector path without AVX-512 (AVX2: sixteen 256-bit registers), head sizes a multiple of 16 -------
 * Eight float lanes per vector, one ymm register each; every inner loop holds at most eight accumulators
 * and the operands it needs, so nothing spills (16-lane vectors took two registers each and did).
 *
 * A head's D elements are handled as D/16 chunks of sixteen, each split into two vectors of eight. For
 * float32 that is elements 0-7 and 8-15; for bfloat16 it is the even and the odd elements of the chunk
 * (one 32-byte load: the even ones shifted into the high half of each 32-bit lane, the odd ones masked,
 * two instructions for sixteen values). The query and the output accumulators use the same order, so
 * dot products and the weighted sum see every element exactly once; the output is put back in order
 * when it is stored. */
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
enum { LANES8 = 8 };

static inline v8 as_v8(v8u u) {
    v8 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The chunk of sixteen elements at base + offset as two float vectors (see above for the order). */
static inline void load_chunk(const void *base, int64_t offset, const int bf16, v8 *lo, v8 *hi) {
    if (bf16) {
        v8u u;
        memcpy(&u, (const uint16_t *)base + offset, sizeof u);
        *lo = as_v8(u << 16);
        *hi = as_v8(u & 0xffff0000u);
    } else {
        memcpy(lo, (const float *)base + offset, sizeof *lo);
        memcpy(hi, (const float *)base + offset + 8, sizeof *hi);
    }
}

/* Position, in a head's chunked order, of element d (bfloat16: even elements first in each chunk of 16). */
static inline int chunked_index(int d, const int bf16) {
    return bf16 ? (d & ~15) + ((d & 1) << 3) + ((d & 15) >> 1) : d;
}

/* Lane t of the result is the sum of all lanes of p[t], by the same tree for every t:
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). Levels 1 and 2 stay inside 128-bit halves (vshufps),
 * level 3 combines halves (vperm2f128). */
static inline v8 sum_lanes8(const v8 p[LANES8]) {
    v8 u[4], w[2];
    for (int i = 0; i < 4; i++)
        u[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
    /* u[i] = [p2i:01 p2i:23 p2i+1:01 p2i+1:23 | p2i:45 p2i:67 p2i+1:45 p2i+1:67] */
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
    /* w[i] = [p4i:0-3 p4i+1:0-3 p4i+2:0-3 p4i+3:0-3 | the same for lanes 4-7] */
    return __builtin_shufflevector(w[0], w[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(w[0], w[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Scores of `count` (<= 8) keys, rows key_offset, key_offset + stride, ... of the cache, against one
 * query head q (chunked order), scaled. count is a constant 8 on the common path, so the loops unroll. */
static inline __attribute__((always_inline)) v8 scores8(const v8 *restrict q, const void *key, int64_t key_offset,
                                                        int64_t stride, int count, const int D, const int bf16) {
    v8 part[LANES8];
    for (int t = 0; t < LANES8; t++) part[t] = (v8){0};
    for (int c = 0; c < D / 16; c++) {
        const v8 q0 = q[2 * c], q1 = q[2 * c + 1];
        for (int t = 0; t < LANES8; t++) {
            if (t < count) {
                v8 k0, k1;
                load_chunk(key, key_offset + t * stride + c * 16, bf16, &k0, &k1);
                part[t] += q0 * k0;
                part[t] += q1 * k1;
            }
        }
    }
    return sum_lanes8(part);
}

/* attend() for D % 16 == 0 without AVX-512: scores eight keys at a time (one vector of partial products
 * per key, summed across lanes by sum_lanes8), weighted values accumulated in vectors, even and odd
 * keys of a row in separate accumulators (two independent FMA chains), added once at the end. A key's
 * score is the same tree of the same products whatever its place in the chunk, and the value sum's
 * order is fixed by the row's own positions, so the result depends on the row's own context only. */
static inline __attribute__((always_inline)) void attend_avx2(const Args *a, int row, int token, int n,
                                                              float *restrict q, float *restrict scores,
                                                              float *restrict acc, const int D, const int bf16) {
    const int Hq = a->num_heads, H = a->num_kv_heads, G = Hq / H, bs = a->block_size, C = D / LANES8;
    const int64_t stride = (int64_t)H * D; /* between consecutive tokens' rows in a block */
    const int32_t *table = a->block_table + (int64_t)row * a->block_table_stride;
    const int64_t q_row = (int64_t)token * a->query_token_stride;
    for (int h = 0; h < Hq; h++)
        for (int d = 0; d < D; d++) q[h * D + chunked_index(d, bf16)] = load(a->query, q_row + h * D + d, bf16);
    const v8 *qv = (const v8 *)q; /* [Hq][C], 32-byte aligned by run_slice */
    for (int t0 = 0, b = 0; t0 < n; t0 += bs, b++) {
        const int64_t block = (int64_t)table[b] * bs * stride;
        if (t0 + bs < n) prefetch_block(a->key, (int64_t)table[b + 1] * bs * stride, (int64_t)bs * stride, bf16);
        const int end = n - t0 < bs ? n - t0 : bs;
        for (int i0 = 0; i0 < end; i0 += LANES8) {
            const int count = end - i0 < LANES8 ? end - i0 : LANES8;
            for (int h = 0; h < Hq; h++) {
                const int64_t head = block + (int64_t)i0 * stride + (int64_t)(h / G) * D;
                float *out = scores + h * n + t0 + i0;
                if (count == LANES8) { /* the common case: no branch in the key loop */
                    const v8 sums = scores8(qv + h * C, a->key, head, stride, LANES8, D, bf16) * a->scale;
                    memcpy(out, &sums, sizeof sums);
                } else {
                    const v8 sums = scores8(qv + h * C, a->key, head, stride, count, D, bf16) * a->scale;
                    for (int t = 0; t < count; t++) out[t] = sums[t];
                }
            }
        }
    }
    float inv_sum[Hq];
    for (int h = 0; h < Hq; h++) inv_sum[h] = 1.0f / softmax_numerators(scores + h * n, n);
    /* acc: [Hq][2][C] vectors, even keys' sums then odd keys'; 32-byte aligned by run_slice */
    v8 *accv = (v8 *)acc;
    for (int i = 0; i < Hq * 2 * C; i++) accv[i] = (v8){0};
    for (int t0 = 0, b = 0; t0 < n; t0 += bs, b++) {
        const int64_t block = (int64_t)table[b] * bs * stride;
        if (t0 + bs < n) prefetch_block(a->value, (int64_t)table[b + 1] * bs * stride, (int64_t)bs * stride, bf16);
        const int end = n - t0 < bs ? n - t0 : bs;
        for (int h = 0; h < Hq; h++) {
            const int64_t head = block + (int64_t)(h / G) * D;
            const float *p = scores + h * n + t0;
            /* four vectors (two chunks) of each parity at a time: eight accumulators */
            for (int c0 = 0; c0 < C; c0 += 4) {
                const int width = C - c0 < 4 ? C - c0 : 4;
                v8 even[4] = {{0}}, odd[4] = {{0}}; /* width is 2 or 4 (C is even) */
                for (int c = 0; c < 4; c++)
                    if (c < width) even[c] = accv[(h * 2) * C + c0 + c], odd[c] = accv[(h * 2 + 1) * C + c0 + c];
                /* t0 is a multiple of bs; with an odd bs the parity of i is not the key's parity, which
                 * does not matter: the split is fixed by the row's positions either way. */
                int i = 0;
                for (; i + 1 < end; i += 2) {
                    const float pe = p[i], po = p[i + 1];
                    for (int c = 0; c < 4; c += 2) {
                        if (c < width) {
                            v8 x0, x1, y0, y1;
                            load_chunk(a->value, head + (int64_t)i * stride + (c0 + c) * 8, bf16, &x0, &x1);
                            load_chunk(a->value, head + (int64_t)(i + 1) * stride + (c0 + c) * 8, bf16, &y0, &y1);
                            even[c] += pe * x0;
                            even[c + 1] += pe * x1;
                            odd[c] += po * y0;
                            odd[c + 1] += po * y1;
                        }
                    }
                }
                if (i < end) {
                    const float pe = p[i];
                    for (int c = 0; c < 4; c += 2) {
                        if (c < width) {
                            v8 x0, x1;
                            load_chunk(a->value, head + (int64_t)i * stride + (c0 + c) * 8, bf16, &x0, &x1);
                            even[c] += pe * x0;
                            even[c + 1] += pe * x1;
                        }
                    }
                }
                for (int c = 0; c < 4; c++)
                    if (c < width) accv[(h * 2) * C + c0 + c] = even[c], accv[(h * 2 + 1) * C + c0 + c] = odd[c];
            }
        }
    }
    const int64_t out = (int64_t)token * Hq * D;
    for (int h = 0; h < Hq; h++) {
        const float *even = acc + (h * 2) * D, *odd = acc + (h * 2 + 1) * D;
        for (int d = 0; d < D; d++) {
            const int j = chunked_index(d, bf16);
            store(a->out, out + h * D + d, (even[j] + odd[j]) * inv_sum[h], bf16);
        }
    }
}
#define attend_fast attend_avx2
#define LANES 16 /* the head-size multiple the vector path needs */
#endif

/* One specialised copy per element type and common head size, the vector path for any other multiple
 * of 16, and the scalar one for the rest. */
static void attend_any(const Args *a, int row, int token, int n, float *q, float *scores, float *acc) {
    const int bf16 = a->dtype == DTYPE_BF16;
    switch (a->head_size * 2 + bf16) {
    case 64: attend_fast(a, row, token, n, q, scores, acc, 32, 0); break;
    case 65: attend_fast(a, row, token, n, q, scores, acc, 32, 1); break;
    case 128: attend_fast(a, row, token, n, q, scores, acc, 64, 0); break;
    case 129: attend_fast(a, row, token, n, q, scores, acc, 64, 1); break;
    case 256: attend_fast(a, row, token, n, q, scores, acc, 128, 0); break;
    case 257: attend_fast(a, row, token, n, q, scores, acc, 128, 1); break;
    default:
        if (a->head_size % LANES == 0) {
            if (bf16)
                attend_fast(a, row, token, n, q, scores, acc, a->head_size, 1);
            else
                attend_fast(a, row, token, n, q, scores, acc, a->head_size, 0);
        } else if (bf16) {
            attend(a, row, token, n, q, scores, acc, a->head_size, 1);
        } else {
            attend(a, row, token, n, q, scores, acc, a->head_size, 0);
        }
    }
}

static void *run_slice(void *arg) {
    Slice *s = (Slice *)arg;
    const Args *a = s->a;
    const size_t heads = (size_t)a->num_heads, context = a->max_context > 0 ? (size_t)a->max_context : 1;
    /* q and acc are read as vectors (64-byte aligned, sizes rounded up to 64 bytes); acc holds two sums
     * per head on the AVX2 path */
    const size_t padded = (size_t)(a->head_size + 15) / 16 * 16;
    float *q = aligned_alloc(64, sizeof(float) * heads * padded);
    float *acc = aligned_alloc(64, sizeof(float) * heads * 2 * padded);
    float *scores = malloc(sizeof(float) * heads * context);
    if (!q || !acc || !scores) {
        s->failed = 1;
    } else {
        for (int item = s->first_item; item < s->end_item; item++) {
            const int row = a->rows[item];
            const int first = a->query_start_loc[row], q_len = a->query_start_loc[row + 1] - first;
            const int seq_len = a->seq_lens[row];
            for (int j = 0; j < q_len; j++) {
                const int n = seq_len - q_len + j + 1; /* query j sits at position n - 1 */
                attend_any(a, row, first + j, n, q, scores, acc);
            }
        }
    }
    free(q);
    free(acc);
    free(scores);
    return NULL;
}

/* Returns 0 on success, -1 when scratch memory or a thread could not be had (nothing is half-written
 * that the caller keeps: it raises). max_context bounds every listed row's seq_len. */
int paged_attention(const void *query, int64_t query_token_stride, const void *key, const void *value, void *out, const int32_t *block_table,
                    int64_t block_table_stride, const int32_t *query_start_loc, const int32_t *seq_lens,
                    const int32_t *rows, int num_rows, int num_heads, int num_kv_heads, int head_size, int block_size,
                    int dtype, int max_context, float scale, int num_threads) {
    Args a = {query, key, value, out, query_token_stride, block_table, query_start_loc, seq_lens, rows, block_table_stride,
              num_rows, num_heads, num_kv_heads, head_size, block_size, dtype, max_context, scale};
    const int num_items = num_rows;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > num_items) num_threads = num_items > 0 ? num_items : 1;
    Slice slices[num_threads];
    pthread_t threads[num_threads];
    int started = 0, failed = 0;
    for (int i = 0; i < num_threads; i++) {
        slices[i] = (Slice){&a, (int)((int64_t)num_items * i / num_threads),
                            (int)((int64_t)num_items * (i + 1) / num_threads), 0};
    }
    /* Slice 0 runs on the calling thread; the rest on their own threads. */
    for (int i = 1; i < num_threads; i++) {
        if (pthread_create(&threads[i], NULL, run_slice, &slices[i]) != 0) {
            failed = 1;
            break;
        }
        started = i;
    }
    run_slice(&slices[0]);
    for (int i = 1; i <= started; i++) pthread_join(threads[i], NULL);
    for (int i = 0; i < num_threads; i++) failed |= slices[i].failed;
    return failed ? -1 : 0;
}
