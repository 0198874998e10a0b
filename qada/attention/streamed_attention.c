/* qada's CPU kernel for the K/V groups a decode step reads in full: softmax attention of a few query rows over
 * each head's keys, in one pass over K and V (an online softmax over blocks of keys), the keys of each head cut
 * into chunks that the OpenMP threads share, the chunks merged by their log-sum-exps.
 *
 * The chunk routine comes in versions compiled for 1-8 query rows of 64 or 128 features (FIXED below: the rows and
 * their outputs held in registers, the products unrolled; 1.3-2x faster than the general one on a 2-core CPU) and
 * a general one for any other shape.
 *
 * Built by qada.attention.streamed (compiled once per machine, loaded with ctypes). Compiled with fast-math for
 * the vectorised exp and the reassociated dot products; linked without it, so that loading it changes no
 * floating-point setting of the process. Fast-math assumes finite numbers: no infinity is used (-FLT_MAX stands
 * for "no key yet"; a chunk without keys weighs exp(-FLT_MAX - m) = 0 in the merge).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#define BLOCK 64
#define MAX_GROUP 32 /* query rows per head: a fixed bound for the scores (a variable-length array ran ~4% slower) */

/* Keys [t0, t1) of one head: the running maximum m[G], the sum l[G] and the unnormalised output acc[G][d]. */
static void attend_chunk(const float *q, long q_row, const float *k, const float *v, long kv_row, int G, int d,
                         long t0, long t1, float scale, float *m, float *l, float *acc) {
    float s[MAX_GROUP][BLOCK];
    for (int g = 0; g < G; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.f;
        for (int c = 0; c < d; c++) acc[g * d + c] = 0.f;
    }
    for (long b = t0; b < t1; b += BLOCK) {
        int n = (int)(t1 - b < BLOCK ? t1 - b : BLOCK);
        for (int j = 0; j < n; j++) { /* the scores of the block's keys */
            const float *key = k + (b + j) * kv_row;
            for (int g = 0; g < G; g++) {
                const float *row = q + g * q_row;
                float dot = 0.f;
                for (int c = 0; c < d; c++) dot += row[c] * key[c];
                s[g][j] = dot * scale;
            }
        }
        for (int g = 0; g < G; g++) { /* the online softmax: rescale what came before to the new maximum */
            float top = m[g];
            for (int j = 0; j < n; j++) top = s[g][j] > top ? s[g][j] : top;
            float rescale = expf(m[g] - top), sum = 0.f;
            for (int j = 0; j < n; j++) {
                float p = expf(s[g][j] - top);
                s[g][j] = p;
                sum += p;
            }
            l[g] = l[g] * rescale + sum;
            m[g] = top;
            for (int c = 0; c < d; c++) acc[g * d + c] *= rescale;
        }
        for (int j = 0; j < n; j++) { /* the values, weighted */
            const float *value = v + (b + j) * kv_row;
            for (int g = 0; g < G; g++) {
                float p = s[g][j];
                float *a = acc + g * d;
                for (int c = 0; c < d; c++) a[c] += p * value[c];
            }
        }
    }
}


/* attend_chunk for a fixed G and d (known when compiled): the query rows, pre-scaled, and the output rows stay in
 * registers (or the first cache level) through the chunk, the products fully unrolled. */
static inline __attribute__((always_inline)) void attend_fixed(const float *q, long q_row, const float *k,
        const float *v, long kv_row, const int G, const int d, long t0, long t1, float scale, float *m, float *l,
        float *acc) {
    float qs[G][d], a[G][d], s[G][BLOCK], mg[G], lg[G];
    for (int g = 0; g < G; g++) {
        mg[g] = -FLT_MAX;
        lg[g] = 0.f;
        for (int c = 0; c < d; c++) { qs[g][c] = q[g * q_row + c] * scale; a[g][c] = 0.f; }
    }
    for (long b = t0; b < t1; b += BLOCK) {
        int n = (int)(t1 - b < BLOCK ? t1 - b : BLOCK);
        for (int j = 0; j < n; j++) {
            const float *key = k + (b + j) * kv_row;
            for (int g = 0; g < G; g++) {
                float dot = 0.f;
                for (int c = 0; c < d; c++) dot += qs[g][c] * key[c];
                s[g][j] = dot;
            }
        }
        for (int g = 0; g < G; g++) {
            float top = mg[g];
            for (int j = 0; j < n; j++) top = s[g][j] > top ? s[g][j] : top;
            float rescale = expf(mg[g] - top), sum = 0.f;
            for (int j = 0; j < n; j++) { float p = expf(s[g][j] - top); s[g][j] = p; sum += p; }
            lg[g] = lg[g] * rescale + sum;
            mg[g] = top;
            for (int c = 0; c < d; c++) a[g][c] *= rescale;
        }
        for (int j = 0; j < n; j++) {
            const float *value = v + (b + j) * kv_row;
            for (int g = 0; g < G; g++) {
                float p = s[g][j];
                for (int c = 0; c < d; c++) a[g][c] += p * value[c];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        m[g] = mg[g];
        l[g] = lg[g];
        for (int c = 0; c < d; c++) acc[g * d + c] = a[g][c];
    }
}

#define FIXED(GG, DD) \
    static void attend_##GG##_##DD(const float *q, long q_row, const float *k, const float *v, long kv_row, \
                                   long t0, long t1, float scale, float *m, float *l, float *acc) { \
        attend_fixed(q, q_row, k, v, kv_row, GG, DD, t0, t1, scale, m, l, acc); }
FIXED(1, 64) FIXED(2, 64) FIXED(3, 64) FIXED(4, 64) FIXED(5, 64) FIXED(6, 64) FIXED(7, 64) FIXED(8, 64)
FIXED(1, 128) FIXED(2, 128) FIXED(3, 128) FIXED(4, 128) FIXED(5, 128) FIXED(6, 128) FIXED(7, 128) FIXED(8, 128)

typedef void (*fixed_chunk)(const float *, long, const float *, const float *, long, long, long, float, float *,
                            float *, float *);

static fixed_chunk fixed_for(int G, int d) {
    static const fixed_chunk d64[8] = {attend_1_64, attend_2_64, attend_3_64, attend_4_64,
                                       attend_5_64, attend_6_64, attend_7_64, attend_8_64};
    static const fixed_chunk d128[8] = {attend_1_128, attend_2_128, attend_3_128, attend_4_128,
                                        attend_5_128, attend_6_128, attend_7_128, attend_8_128};
    if (G < 1 || G > 8) return NULL;
    return d == 64 ? d64[G - 1] : d == 128 ? d128[G - 1] : NULL;
}

/* q: heads x G x d (strides q_head, q_row); k, v: heads x T x d (strides kv_head, kv_row; d contiguous);
 * out: heads x G x d, contiguous; G <= MAX_GROUP. Returns 0, -1 when its scratch cannot be allocated, -2 when G
 * exceeds MAX_GROUP. */
int streamed_attention(const float *q, long q_head, long q_row, const float *k, const float *v, long kv_head,
                       long kv_row, float *out, int heads, int G, int d, long T, float scale, int chunks,
                       int threads) {
    if (G > MAX_GROUP) return -2;
    int items = heads * chunks;
    long size = (T + chunks - 1) / chunks;
    float *m = malloc(sizeof(float) * (size_t)items * G * (d + 2));
    if (m == NULL) return -1;
    float *l = m + (long)items * G, *acc = l + (long)items * G;
    fixed_chunk fixed = fixed_for(G, d);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int item = 0; item < items; item++) {
        int head = item / chunks, chunk = item % chunks;
        long t0 = chunk * size, t1 = (chunk + 1) * size < T ? (chunk + 1) * size : T;
        if (fixed != NULL)
            fixed(q + head * q_head, q_row, k + head * kv_head, v + head * kv_head, kv_row, t0, t1, scale,
                  m + (long)item * G, l + (long)item * G, acc + (long)item * G * d);
        else
            attend_chunk(q + head * q_head, q_row, k + head * kv_head, v + head * kv_head, kv_row, G, d, t0, t1,
                         scale, m + (long)item * G, l + (long)item * G, acc + (long)item * G * d);
    }
    for (int head = 0; head < heads; head++) { /* merge the chunks of each query row */
        for (int g = 0; g < G; g++) {
            float top = -FLT_MAX, total = 0.f, *o = out + ((long)head * G + g) * d;
            for (int chunk = 0; chunk < chunks; chunk++) {
                float mc = m[(head * chunks + chunk) * G + g];
                top = mc > top ? mc : top;
            }
            for (int c = 0; c < d; c++) o[c] = 0.f;
            for (int chunk = 0; chunk < chunks; chunk++) {
                long item = (long)head * chunks + chunk;
                float w = expf(m[item * G + g] - top);
                total += w * l[item * G + g];
                const float *a = acc + (item * G + g) * d;
                for (int c = 0; c < d; c++) o[c] += w * a[c];
            }
            for (int c = 0; c < d; c++) o[c] /= total;
        }
    }
    free(m);
    return 0;
}
