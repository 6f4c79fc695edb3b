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

/* One specialised copy per element type and common head size, and one for any other head size. */
static void attend_any(const Args *a, int row, int token, int n, float *q, float *scores, float *acc) {
    const int bf16 = a->dtype == DTYPE_BF16;
    switch (a->head_size * 2 + bf16) {
    case 64: attend(a, row, token, n, q, scores, acc, 32, 0); break;
    case 65: attend(a, row, token, n, q, scores, acc, 32, 1); break;
    case 128: attend(a, row, token, n, q, scores, acc, 64, 0); break;
    case 129: attend(a, row, token, n, q, scores, acc, 64, 1); break;
    case 256: attend(a, row, token, n, q, scores, acc, 128, 0); break;
    case 257: attend(a, row, token, n, q, scores, acc, 128, 1); break;
    default:
        if (bf16)
            attend(a, row, token, n, q, scores, acc, a->head_size, 1);
        else
            attend(a, row, token, n, q, scores, acc, a->head_size, 0);
    }
}

static void *run_slice(void *arg) {
    Slice *s = (Slice *)arg;
    const Args *a = s->a;
    const size_t heads = (size_t)a->num_heads, context = a->max_context > 0 ? (size_t)a->max_context : 1;
    float *q = malloc(sizeof(float) * heads * a->head_size);
    float *acc = malloc(sizeof(float) * heads * a->head_size);
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
