/*
gpt2_cpu.c — the GPT-2 model on the CPU in fp32 with OpenMP; see gpt2_cpu.h.

Determinism: every kernel computes each output element in one thread and in a fixed order (sums
are never split across threads), so a step gives the same bits whatever the number of threads;
the trainer's bit-exact resume rests on it (DESIGN.md §9).
*/
#define _POSIX_C_SOURCE 200809L
#include "gpt2_cpu.h"
#include "gpt2_data.h"
#include "bnb8.h"   // bnb8_bf16_to_f32, bnb8_f32_to_bf16: the model files' bf16, rounded as the library rounds
#include <stdlib.h>
#include <string.h>
#include <errno.h>

// ------------------------------------------------------------------------------------------------
// Configuration

int gpt2_config_check(const GPT2Config *c, const char *where) {
    const char *why = gpt2_shape_problem(c);
    if (why)
        return train_fail("%s: bad model shape maxT=%d V=%d Vp=%d L=%d NH=%d C=%d: %s", where, c->max_seq_len,
                          c->vocab_size, c->padded_vocab_size, c->num_layers, c->num_heads, c->channels, why);
    return 0;
}

int gpt2_config_from_descriptor(GPT2Config *c, const char *desc) {
    static const int table[][3] = {{6, 384, 6}, {12, 768, 12}, {24, 1024, 16}, {36, 1280, 20},
                                   {48, 1600, 25}, {60, 1920, 30}, {72, 2880, 30}};
    memset(c, 0, sizeof *c);
    long long val[5] = {-1, -1, -1, -1, -1};   // d c h v t
    const char *keys = "dchvt", *p = desc;
    while (*p) {
        const char *k = strchr(keys, *p);
        if (!k || (k == keys) != (p == desc) || p[1] < '0' || p[1] > '9')
            return train_fail("model '%s' is neither a .bin file nor a descriptor like d12 or d4c128h4", desc);
        int i = (int)(k - keys);
        if (val[i] >= 0) return train_fail("model descriptor '%s' sets '%c' twice", desc, *p);
        char *end;
        errno = 0;
        val[i] = strtoll(p + 1, &end, 10);
        if (errno || val[i] < 1 || val[i] > (1 << 24))
            return train_fail("model descriptor '%s': '%c' out of range", desc, *p);
        p = end;
    }
    if (val[0] < 0) return train_fail("model '%s' is neither a .bin file nor a descriptor like d12 or d4c128h4", desc);
    c->num_layers = (int)val[0];
    c->channels = (int)(64 * val[0]);
    c->num_heads = (int)val[0];
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (table[i][0] == val[0]) { c->channels = table[i][1]; c->num_heads = table[i][2]; }
    if (val[1] > 0) { c->channels = (int)val[1]; if (val[2] < 0) c->num_heads = c->channels >= 64 ? c->channels / 64 : 1; }
    if (val[2] > 0) c->num_heads = (int)val[2];
    c->vocab_size = val[3] > 0 ? (int)val[3] : 50257;
    c->max_seq_len = val[4] > 0 ? (int)val[4] : 1024;
    c->padded_vocab_size = (c->vocab_size + 63) / 64 * 64;
    char where[300];
    snprintf(where, sizeof where, "model descriptor '%s'", desc);
    return gpt2_config_check(c, where);
}

// ------------------------------------------------------------------------------------------------
// Parameters and activations: named views into one allocation each

// The tensors of a ParameterTensors as an array (the struct is the readable view, this the loop).
static float **param_slot(ParameterTensors *p, int i) {
    float **slots[GPT2_NUM_PARAMS] = {&p->wte, &p->wpe, &p->ln1w, &p->ln1b, &p->qkvw, &p->qkvb,
        &p->attprojw, &p->attprojb, &p->ln2w, &p->ln2b, &p->fcw, &p->fcb, &p->fcprojw, &p->fcprojb,
        &p->lnfw, &p->lnfb, &p->lnew, &p->lneb};
    return slots[i];
}

float *gpt2_param(const ParameterTensors *p, int i) { return *param_slot((ParameterTensors *)p, i); }

void gpt2_point_params(ParameterTensors *p, float *memory, const int64_t sizes[GPT2_NUM_PARAMS]) {
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) { *param_slot(p, i) = sizes[i] ? memory : NULL; memory += sizes[i]; }
}


static const char *act_names[NUM_ACT_TENSORS] = {
    "encoded", "tokemb", "lne", "lne_mean", "lne_rstd", "ln1", "ln1_mean", "ln1_rstd", "qkv", "atty", "att",
    "residual2", "ln2", "ln2_mean", "ln2_rstd", "fch", "fch_gelu", "residual3", "lnf", "lnf_mean", "lnf_rstd",
    "logits", "losses", "dres (grad)", "dbuf (grad)", "dbuf4 (grad)", "dqkv+datt (grad)"};
const char *gpt2_act_name(int i) { return i >= 0 && i < NUM_ACT_TENSORS ? act_names[i] : "?"; }

// Each size is computed in double, where nothing overflows, and exact: with the total at most
// GPT2_MAX_ACT_BYTES / 4 < 2^53, so is every partial product (each factor is at least 1, or the size 0).
int gpt2_act_sizes(const GPT2Config *c, int64_t B, int64_t T, int64_t s[NUM_ACT_TENSORS]) {
    double C = c->channels, L = c->num_layers, NH = c->num_heads, Vp = c->padded_vocab_size, BT = (double)B * (double)T;
    double st = c->stable_embedding ? 1 : 0, b = (double)B, t = (double)T, total = 0.0;
    double sizes[NUM_ACT_TENSORS] = {
        BT * C, st * BT * C, st * BT * C, st * BT, st * BT,
        L * BT * C, L * BT, L * BT, L * BT * 3 * C, L * BT * C, L * b * NH * t * t,
        L * BT * C, L * BT * C, L * BT, L * BT, L * BT * 4 * C, L * BT * 4 * C, L * BT * C,
        BT * C, BT, BT, BT * Vp, BT,
        BT * C, BT * C, BT * 4 * C, BT * 3 * C + b * NH * t};
    for (int i = 0; i < NUM_ACT_TENSORS; i++) total += sizes[i];
    if (B < 1 || T < 1 || 4.0 * total > (double)GPT2_MAX_ACT_BYTES)
        return train_fail("activations for B=%lld, T=%lld of L=%d C=%d NH=%d Vp=%d: %.3g bytes, more than the limit "
                          "of 2^52 bytes (GPT2_MAX_ACT_BYTES): lower -b or -t", (long long)B, (long long)T, c->num_layers,
                          c->channels, c->num_heads, c->padded_vocab_size, 4.0 * total);
    for (int i = 0; i < NUM_ACT_TENSORS; i++) s[i] = (int64_t)sizes[i];
    return 0;
}

static float **act_slot(ActivationTensors *a, int i) {
    float **slots[NUM_ACT_TENSORS] = {&a->encoded, &a->tokemb, &a->lne, &a->lne_mean, &a->lne_rstd, &a->ln1,
        &a->ln1_mean, &a->ln1_rstd, &a->qkv, &a->atty, &a->att, &a->residual2, &a->ln2, &a->ln2_mean,
        &a->ln2_rstd, &a->fch, &a->fch_gelu, &a->residual3, &a->lnf, &a->lnf_mean, &a->lnf_rstd, &a->logits,
        &a->losses, &a->dres, &a->dbuf, &a->dbuf4, &a->dqkv};
    return slots[i];
}

// ------------------------------------------------------------------------------------------------
// Kernels. Shapes in comments; N = B*T rows. Each output element is written by one thread and its
// sums run in a fixed order (see the note at the top).

// Dot products in 8 interleaved partial sums, combined pairwise: the lanes vectorize without
// -ffast-math, and this exact order is what every path of matmul_forward computes.
#define LANES 8
static inline float lanes_sum(const float a[LANES]) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
static inline float dot_lanes(const float *x, const float *w, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) acc[k] += x[i + k] * w[i + k];
    for (int k = 0; i + k < n; k++) acc[k] += x[i + k] * w[i + k];
    return lanes_sum(acc);
}

// out[r, o..o+1] for rows r..r+3: 4 x 2 dot products sharing their loads (C a multiple of LANES,
// so that the accumulators live in registers; the lanes and their sum are dot_lanes' exactly).
static inline void matmul_tile_4x2(float *out, const float *inp, const float *weight, const float *bias,
                                   int64_t r, int64_t o, int64_t C, int64_t OC) {
    const float *x0 = inp + r * C, *x1 = x0 + C, *x2 = x1 + C, *x3 = x2 + C;
    const float *w0 = weight + o * C, *w1 = w0 + C;
    float a[8][LANES] = {{0}};
    for (int64_t i = 0; i < C; i += LANES) {
        for (int k = 0; k < LANES; k++) {
            a[0][k] += x0[i + k] * w0[i + k]; a[1][k] += x0[i + k] * w1[i + k];
            a[2][k] += x1[i + k] * w0[i + k]; a[3][k] += x1[i + k] * w1[i + k];
            a[4][k] += x2[i + k] * w0[i + k]; a[5][k] += x2[i + k] * w1[i + k];
            a[6][k] += x3[i + k] * w0[i + k]; a[7][k] += x3[i + k] * w1[i + k];
        }
    }
    for (int rr = 0; rr < 4; rr++)
        for (int oo = 0; oo < 2; oo++) {
            float s = lanes_sum(a[rr * 2 + oo]);
            out[(r + rr) * OC + o + oo] = bias ? s + bias[o + oo] : s;
        }
}

// out (N, OC) = inp (N, C) @ weight (OC, C)^T + bias (OC); bias may be NULL.
// Tasks are (output block, row block), output-major, so a weight tile is reused by every row block.
static void matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int64_t N, int64_t C, int64_t OC) {
    const int64_t RB = 32, OB = 64;
    int64_t nrb = (N + RB - 1) / RB, nob = (OC + OB - 1) / OB;
    #pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < nrb * nob; task++) {
        int64_t o0 = (task / nrb) * OB, r0 = (task % nrb) * RB;
        int64_t o1 = o0 + OB < OC ? o0 + OB : OC, r1 = r0 + RB < N ? r0 + RB : N;
        int64_t r = r0;
        for (; r + 4 <= r1 && C % LANES == 0; r += 4) {
            int64_t o = o0;
            for (; o + 2 <= o1; o += 2) matmul_tile_4x2(out, inp, weight, bias, r, o, C, OC);
            for (; o < o1; o++)
                for (int64_t rr = r; rr < r + 4; rr++) {
                    float s = dot_lanes(inp + rr * C, weight + o * C, C);
                    out[rr * OC + o] = bias ? s + bias[o] : s;
                }
        }
        for (; r < r1; r++)
            for (int64_t o = o0; o < o1; o++) {
                float s = dot_lanes(inp + r * C, weight + o * C, C);
                out[r * OC + o] = bias ? s + bias[o] : s;
            }
    }
}

// The backward products' register tile: out[q * C + k] (q < nq <= 4 rows, k < nk <= 16 columns)
// += sum over j in [j0, j1), in order, of e(q, j) * v(j)[k], with e(q, j) = e[q * eq + j * ej] and
// v(j) = v + j * vj. Full 4 x 16 tiles keep their sums in registers.
static inline void tile_accumulate(float *out, int64_t C, int64_t nq, int64_t nk, const float *e, int64_t eq, int64_t ej,
                                   const float *v, int64_t vj, int64_t j0, int64_t j1) {
    if (nq == 4 && nk == 16) {
        float acc[4][16];
        for (int q = 0; q < 4; q++)
            for (int k = 0; k < 16; k++) acc[q][k] = out[q * C + k];
        for (int64_t j = j0; j < j1; j++) {
            const float *x = v + j * vj;
            float e0 = e[j * ej], e1 = e[eq + j * ej], e2 = e[2 * eq + j * ej], e3 = e[3 * eq + j * ej];
            for (int k = 0; k < 16; k++) {
                acc[0][k] += e0 * x[k]; acc[1][k] += e1 * x[k];
                acc[2][k] += e2 * x[k]; acc[3][k] += e3 * x[k];
            }
        }
        for (int q = 0; q < 4; q++)
            for (int k = 0; k < 16; k++) out[q * C + k] = acc[q][k];
        return;
    }
    for (int64_t q = 0; q < nq; q++)
        for (int64_t k = 0; k < nk; k++) {
            float s = out[q * C + k];
            for (int64_t j = j0; j < j1; j++) s += e[q * eq + j * ej] * v[j * vj + k];
            out[q * C + k] = s;
        }
}

// dinp (N, C) = dout (N, OC) @ weight (OC, C): each element sums over o = 0..OC-1 in order.
// Tiles of 4 rows x 16 columns; the weight is read in blocks of OB rows.
static void matmul_backward_input(float *dinp, const float *dout, const float *weight,
                                  int64_t N, int64_t C, int64_t OC) {
    const int64_t RB = 16, OB = 256, CB = 16;
    int64_t nrb = (N + RB - 1) / RB;
    #pragma omp parallel for schedule(static)
    for (int64_t rb = 0; rb < nrb; rb++) {
        int64_t r0 = rb * RB, r1 = r0 + RB < N ? r0 + RB : N;
        memset(dinp + r0 * C, 0, sizeof(float) * (size_t)((r1 - r0) * C));
        for (int64_t o0 = 0; o0 < OC; o0 += OB) {
            int64_t o1 = o0 + OB < OC ? o0 + OB : OC;
            for (int64_t r = r0; r < r1; r += 4)
                for (int64_t c = 0; c < C; c += CB)   // e(q, o) = dout[r + q, o], v(o) = weight[o, c..]
                    tile_accumulate(dinp + r * C + c, C, r + 4 < r1 ? 4 : r1 - r, c + CB < C ? CB : C - c,
                                    dout + r * OC, OC, 1, weight + c, C, o0, o1);
        }
    }
}

// dweight (OC, C) += dout^T @ inp (N, C); dbias (OC) += column sums of dout (may be NULL).
// Each element sums over rows in order; tiles of 4 outputs x 16 columns, rows in blocks of RB.
static void matmul_backward_weight(float *dweight, float *dbias, const float *dout, const float *inp,
                                   int64_t N, int64_t C, int64_t OC) {
    const int64_t OBK = 16, RB = 64, CB = 16;
    int64_t nob = (OC + OBK - 1) / OBK;
    #pragma omp parallel for schedule(static)
    for (int64_t ob = 0; ob < nob; ob++) {
        int64_t o0 = ob * OBK, o1 = o0 + OBK < OC ? o0 + OBK : OC;
        if (dbias)
            for (int64_t o = o0; o < o1; o++) {
                float s = dbias[o];
                for (int64_t r = 0; r < N; r++) s += dout[r * OC + o];
                dbias[o] = s;
            }
        for (int64_t r0 = 0; r0 < N; r0 += RB) {
            int64_t r1 = r0 + RB < N ? r0 + RB : N;
            for (int64_t o = o0; o < o1; o += 4)
                for (int64_t c = 0; c < C; c += CB)   // e(q, r) = dout[r, o + q], v(r) = inp[r, c..]
                    tile_accumulate(dweight + o * C + c, C, o + 4 < o1 ? 4 : o1 - o, c + CB < C ? CB : C - c,
                                    dout + o, 1, OC, inp + c, C, r0, r1);
        }
    }
}

// out (N, C) = (inp - mean) / sqrt(var + 1e-5) * weight + bias per row; mean, rstd (N) kept.
static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                              const float *bias, int64_t N, int64_t C) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *x = inp + n * C;
        float m = 0.0f;
        for (int64_t i = 0; i < C; i++) m += x[i];
        m /= (float)C;
        float v = 0.0f;
        for (int64_t i = 0; i < C; i++) { float d = x[i] - m; v += d * d; }
        v /= (float)C;
        float s = 1.0f / sqrtf(v + 1e-5f);
        float *y = out + n * C;
        for (int64_t i = 0; i < C; i++) y[i] = (x[i] - m) * s * weight[i] + bias[i];
        mean[n] = m;
        rstd[n] = s;
    }
}

// dinp (N, C) += d(layernorm)/d(inp) . dout; dweight, dbias (C) += their gradients.
static void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                               const float *weight, const float *mean, const float *rstd, int64_t N, int64_t C) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *x = inp + n * C, *dy = dout + n * C;
        float m = mean[n], s = rstd[n], dmean = 0.0f, dnorm_mean = 0.0f;
        for (int64_t i = 0; i < C; i++) {
            float norm = (x[i] - m) * s, dn = weight[i] * dy[i];
            dmean += dn;
            dnorm_mean += dn * norm;
        }
        dmean /= (float)C;
        dnorm_mean /= (float)C;
        float *dx = dinp + n * C;
        for (int64_t i = 0; i < C; i++) {
            float norm = (x[i] - m) * s, dn = weight[i] * dy[i];
            dx[i] += (dn - dmean - norm * dnorm_mean) * s;
        }
    }
    // Parameter gradients: columns split across threads, rows summed in order.
    const int64_t CB = 32;
    #pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < C; c0 += CB) {
        int64_t c1 = c0 + CB < C ? c0 + CB : C;
        for (int64_t n = 0; n < N; n++) {
            const float *x = inp + n * C, *dy = dout + n * C;
            float m = mean[n], s = rstd[n];
            for (int64_t i = c0; i < c1; i++) {
                dweight[i] += dy[i] * ((x[i] - m) * s);
                dbias[i] += dy[i];
            }
        }
    }
}

// Causal self-attention. qkv (B, T, 3C) holds q, k, v, each split into NH heads of C/NH.
// atty (B, T, C) = softmax(q k^T / sqrt(hs)) v; att (B, NH, T, T) keeps the probabilities.
static void attention_forward(float *atty, float *att, const float *qkv, int64_t B, int64_t T, int64_t C,
                              int64_t NH) {
    int64_t hs = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);
    #pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < NH; h++) {
                const float *q = qkv + (b * T + t) * C3 + h * hs;
                float *a = att + ((b * NH + h) * T + t) * T, maxv = -INFINITY;
                for (int64_t t2 = 0; t2 <= t; t2++) {
                    const float *k = qkv + (b * T + t2) * C3 + C + h * hs;
                    float s = 0.0f;
                    for (int64_t i = 0; i < hs; i++) s += q[i] * k[i];
                    s *= scale;
                    a[t2] = s;
                    maxv = fmaxf(maxv, s);
                }
                float sum = 0.0f;
                for (int64_t t2 = 0; t2 <= t; t2++) { a[t2] = expf(a[t2] - maxv); sum += a[t2]; }
                float inv = 1.0f / sum;
                for (int64_t t2 = 0; t2 <= t; t2++) a[t2] *= inv;
                for (int64_t t2 = t + 1; t2 < T; t2++) a[t2] = 0.0f;
                float *y = atty + (b * T + t) * C + h * hs;
                for (int64_t i = 0; i < hs; i++) y[i] = 0.0f;
                for (int64_t t2 = 0; t2 <= t; t2++) {
                    const float *v = qkv + (b * T + t2) * C3 + 2 * C + h * hs;
                    for (int64_t i = 0; i < hs; i++) y[i] += a[t2] * v[i];
                }
            }
}

// dqkv (B, T, 3C) = gradient through attention of datty (B, T, C). scratch: (B, NH, T).
// One (b, h) per task: dk and dv accumulate over t, in order, inside one thread.
static void attention_backward(float *dqkv, float *scratch, const float *datty, const float *qkv, const float *att,
                               int64_t B, int64_t T, int64_t C, int64_t NH) {
    int64_t hs = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < NH; h++) {
            for (int64_t t = 0; t < T; t++)
                for (int64_t part = 0; part < 3; part++)
                    memset(dqkv + (b * T + t) * C3 + part * C + h * hs, 0, sizeof(float) * (size_t)hs);
            float *datt = scratch + (b * NH + h) * T;
            for (int64_t t = 0; t < T; t++) {
                const float *a = att + ((b * NH + h) * T + t) * T, *dy = datty + (b * T + t) * C + h * hs;
                for (int64_t t2 = 0; t2 <= t; t2++) {           // y = sum a v
                    const float *v = qkv + (b * T + t2) * C3 + 2 * C + h * hs;
                    float *dv = dqkv + (b * T + t2) * C3 + 2 * C + h * hs, s = 0.0f;
                    for (int64_t i = 0; i < hs; i++) { s += v[i] * dy[i]; dv[i] += a[t2] * dy[i]; }
                    datt[t2] = s;
                }
                float dot = 0.0f;                                 // softmax: a (datt - sum a datt)
                for (int64_t t2 = 0; t2 <= t; t2++) dot += a[t2] * datt[t2];
                const float *q = qkv + (b * T + t) * C3 + h * hs;
                float *dq = dqkv + (b * T + t) * C3 + h * hs;
                for (int64_t t2 = 0; t2 <= t; t2++) {             // scores = q k / sqrt(hs)
                    float ds = a[t2] * (datt[t2] - dot) * scale;
                    const float *k = qkv + (b * T + t2) * C3 + C + h * hs;
                    float *dk = dqkv + (b * T + t2) * C3 + C + h * hs;
                    for (int64_t i = 0; i < hs; i++) { dq[i] += ds * k[i]; dk[i] += ds * q[i]; }
                }
            }
        }
}

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#define GELU_SCALE 0.7978845608028654f
static void gelu_forward(float *out, const float *inp, int64_t n) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float x = inp[i];
        out[i] = 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
    }
}
// d (n) *= GELU'(inp), in place.
static void gelu_backward(float *d, const float *inp, int64_t n) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float x = inp[i], th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
        float local = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        d[i] *= local;
    }
}

static void residual_add(float *out, const float *inp, int64_t n) {   // out (n) += inp (n)
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] += inp[i];
}

// exp(x) for x <= 0 within 2 ulp (Cephes' expf polynomial after Cody-Waite reduction), without
// branches or calls so that softmax's loop over 50k logits vectorizes; libm's expf does not.
static inline float exp_nonpositive(float x) {
    // clamp at -87 (keeps 2^k normal; -inf and negative NaNs go there too) on the bits: for negative floats
    // a larger magnitude is a larger integer, and an integer min vectorizes where a float compare
    // (which may trap) does not
    union { float f; uint32_t u; } in = {x};
    in.u = in.u < 0xc2ae0000u ? in.u : 0xc2ae0000u;
    x = in.f;
    union { float f; uint32_t u; } t = {x * 1.44269504088896341f + 12582912.0f};
    float k = t.f - 12582912.0f;                                       // round(x / ln 2)
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    // 2^k from t's bits (t = 1.5 * 2^23 + k has k in its low mantissa bits), in unsigned arithmetic:
    // a NaN x (a positive NaN passes the clamp above) makes k NaN, and converting that to int would
    // be undefined; here it only gives some scale, and p, NaN too, carries the NaN on.
    union { uint32_t u; float f; } scale = {(t.u - 0x4b400000u + 127u) << 23};
    return p * scale.f;
}
float gpt2_exp_nonpositive(float x) { return exp_nonpositive(x); }

// Softmax over the first V of Vp columns of logits (N, Vp), in place (padding columns get 0); with
// targets, losses (N) = -log p[target], computed from the logits (no log of an underflowed 0).
// Max and sum run in LANES interleaved partials, combined in a fixed order.
void gpt2_softmax_forward(float *logits, float *losses, const int *targets, int64_t N, int64_t V, int64_t Vp) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *x = logits + n * Vp, mx[LANES], sm[LANES];
        for (int k = 0; k < LANES; k++) { mx[k] = -INFINITY; sm[k] = 0.0f; }
        int64_t V8 = V / LANES * LANES;
        for (int64_t i = 0; i < V8; i += LANES)
            for (int k = 0; k < LANES; k++) mx[k] = x[i + k] > mx[k] ? x[i + k] : mx[k];
        float maxv = -INFINITY;
        for (int k = 0; k < LANES; k++) maxv = mx[k] > maxv ? mx[k] : maxv;
        for (int64_t i = V8; i < V; i++) maxv = x[i] > maxv ? x[i] : maxv;
        float target_logit = targets ? x[targets[n]] : 0.0f;
        for (int64_t i = 0; i < V; i++) x[i] = exp_nonpositive(x[i] - maxv);
        for (int64_t i = 0; i < V8; i += LANES)
            for (int k = 0; k < LANES; k++) sm[k] += x[i + k];
        double sum = 0.0;
        for (int k = 0; k < LANES; k++) sum += sm[k];
        for (int64_t i = V8; i < V; i++) sum += x[i];
        float inv = (float)(1.0 / sum);
        for (int64_t i = 0; i < V; i++) x[i] *= inv;
        for (int64_t i = V; i < Vp; i++) x[i] = 0.0f;
        if (targets) losses[n] = (float)(log(sum) - (double)(target_logit - maxv));
    }
}

// d(mean loss)/d(logits) = (p - onehot(target)) / N, in place of the probabilities.
static void crossentropy_softmax_backward(float *probs, const int *targets, int64_t N, int64_t V, int64_t Vp) {
    float dloss = 1.0f / (float)N;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *p = probs + n * Vp;
        for (int64_t i = 0; i < V; i++) p[i] = (p[i] - (i == targets[n] ? 1.0f : 0.0f)) * dloss;
        for (int64_t i = V; i < Vp; i++) p[i] = 0.0f;
    }
}

// ------------------------------------------------------------------------------------------------
// The model

void gpt2_free(GPT2 *m) {
    free(m->params_memory); free(m->acts_memory); free(m->inputs); free(m->targets);
    memset(m, 0, sizeof *m);
}

// Parameters for m->config, zeroed. (A run on the GPU keeps only this host copy of the weights,
// for initialization and checkpoints.)
static int gpt2_alloc_params(GPT2 *m) {
    gpt2_param_sizes(&m->config, m->param_sizes);
    m->num_parameters = 0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) m->num_parameters += m->param_sizes[i];
    m->params_memory = (float *)calloc((size_t)m->num_parameters, sizeof(float));
    if (!m->params_memory) return train_fail("out of memory for %lld parameters", (long long)m->num_parameters);
    gpt2_point_params(&m->params, m->params_memory, m->param_sizes);
    return 0;
}

// GPT-2's initialization: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), layernorms 1 and 0,
// biases 0, wte's padding rows 0. StableEmbedding: wte Xavier-uniform over its V real rows. Each run
// of INIT_CHUNK elements of a tensor draws from its own stream (seed, tensor, chunk), so the chunks
// fill in parallel with the same bits on any number of threads (7e9 weights in seconds).
#define INIT_CHUNK 65536
int gpt2_create(GPT2 *m, const GPT2Config *c) {
    memset(m, 0, sizeof *m);
    m->config = *c;
    return gpt2_config_check(c, "model") || gpt2_alloc_params(m) ? -1 : 0;
}

int gpt2_init_random(GPT2 *m, const GPT2Config *c, uint64_t seed) {
    if (gpt2_create(m, c)) return -1;
    int64_t C = c->channels, V = c->vocab_size;
    float resid_std = 0.02f / sqrtf(2.0f * (float)c->num_layers), xavier = sqrtf(6.0f / (float)(V + C));
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        float *p = *param_slot(&m->params, i);
        int64_t n = i == GPT2_WTE ? V * C : m->param_sizes[i];   // wte's padding rows stay 0
        if (gpt2_param_is_ln_weight(i)) {
            for (int64_t j = 0; j < n; j++) p[j] = 1.0f;
            continue;
        }
        if (!gpt2_param_is_matrix[i]) continue;          // biases: 0
        int uniform = i == GPT2_WTE && c->stable_embedding;
        float std = (i == GPT2_ATTPROJW || i == GPT2_FCPROJW) ? resid_std : 0.02f;
        int64_t chunks = (n + INIT_CHUNK - 1) / INIT_CHUNK;
        #pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < chunks; k++) {
            Rng id = {seed ^ 0x5eed0f6a7b2c1d3eull ^ ((uint64_t)i << 48) ^ (uint64_t)k}, rng = {rng_u64(&id)};
            int64_t end = (k + 1) * INIT_CHUNK < n ? (k + 1) * INIT_CHUNK : n;
            for (int64_t j = k * INIT_CHUNK; j < end; j++)
                p[j] = uniform ? (2.0f * rng_uniform(&rng) - 1.0f) * xavier : std * rng_normal(&rng);
        }
    }
    return 0;
}

int gpt2_alloc_acts(GPT2 *m, int64_t B, int64_t T) {
    free(m->acts_memory); free(m->inputs); free(m->targets);
    m->acts_memory = NULL; m->inputs = m->targets = NULL;
    if (gpt2_act_sizes(&m->config, B, T, m->act_sizes)) return -1;
    m->num_activations = 0;
    for (int i = 0; i < NUM_ACT_TENSORS; i++) m->num_activations += m->act_sizes[i];
    m->acts_memory = (float *)malloc(sizeof(float) * (size_t)m->num_activations);
    m->inputs = (int *)calloc((size_t)(B * T), sizeof(int));
    m->targets = (int *)calloc((size_t)(B * T), sizeof(int));
    if (!m->acts_memory || !m->inputs || !m->targets)
        return train_fail("out of memory for activations of B=%lld, T=%lld (%lld floats)", (long long)B,
                          (long long)T, (long long)m->num_activations);
    float *p = m->acts_memory;
    for (int i = 0; i < NUM_ACT_TENSORS; i++) { *act_slot(&m->acts, i) = m->act_sizes[i] ? p : NULL; p += m->act_sizes[i]; }
    m->batch_size = B;
    m->seq_len = T;
    return 0;
}

void gpt2_forward_hidden(GPT2 *m, const int *inputs, int64_t B, int64_t T) {
    const GPT2Config *c = &m->config;
    int64_t C = c->channels, L = c->num_layers, NH = c->num_heads, BT = B * T;
    ParameterTensors *p = &m->params;
    ActivationTensors *a = &m->acts;
    if (inputs != m->inputs) memcpy(m->inputs, inputs, sizeof(int) * (size_t)BT);
    m->B = B; m->T = T;
    // encoded (B, T, C) = wte[token] (through StableEmbedding's layernorm) + wpe[t]
    float *tok = c->stable_embedding ? a->tokemb : a->encoded;
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) memcpy(tok + bt * C, p->wte + (int64_t)inputs[bt] * C, sizeof(float) * (size_t)C);
    const float *tok_out = tok;
    if (c->stable_embedding) {
        layernorm_forward(a->lne, a->lne_mean, a->lne_rstd, a->tokemb, p->lnew, p->lneb, BT, C);
        tok_out = a->lne;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        const float *wp = p->wpe + (bt % T) * C;
        for (int64_t i = 0; i < C; i++) a->encoded[bt * C + i] = tok_out[bt * C + i] + wp[i];
    }
    for (int64_t l = 0; l < L; l++) {
        const float *residual = l == 0 ? a->encoded : a->residual3 + (l - 1) * BT * C;
        float *ln1 = a->ln1 + l * BT * C, *qkv = a->qkv + l * BT * 3 * C, *atty = a->atty + l * BT * C;
        float *att = a->att + l * B * NH * T * T, *res2 = a->residual2 + l * BT * C, *ln2 = a->ln2 + l * BT * C;
        float *fch = a->fch + l * BT * 4 * C, *fchg = a->fch_gelu + l * BT * 4 * C, *res3 = a->residual3 + l * BT * C;
        layernorm_forward(ln1, a->ln1_mean + l * BT, a->ln1_rstd + l * BT, residual, p->ln1w + l * C, p->ln1b + l * C, BT, C);
        matmul_forward(qkv, ln1, p->qkvw + l * 3 * C * C, p->qkvb + l * 3 * C, BT, C, 3 * C);
        attention_forward(atty, att, qkv, B, T, C, NH);
        matmul_forward(res2, atty, p->attprojw + l * C * C, p->attprojb + l * C, BT, C, C);
        residual_add(res2, residual, BT * C);
        layernorm_forward(ln2, a->ln2_mean + l * BT, a->ln2_rstd + l * BT, res2, p->ln2w + l * C, p->ln2b + l * C, BT, C);
        matmul_forward(fch, ln2, p->fcw + l * 4 * C * C, p->fcb + l * 4 * C, BT, C, 4 * C);
        gelu_forward(fchg, fch, BT * 4 * C);
        matmul_forward(res3, fchg, p->fcprojw + l * 4 * C * C, p->fcprojb + l * C, BT, 4 * C, C);
        residual_add(res3, res2, BT * C);
    }
    layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, a->residual3 + (L - 1) * BT * C, p->lnfw, p->lnfb, BT, C);
}

float gpt2_forward(GPT2 *m, const int *inputs, const int *targets, int64_t B, int64_t T) {
    const GPT2Config *c = &m->config;
    int64_t BT = B * T;
    gpt2_forward_hidden(m, inputs, B, T);
    matmul_forward(m->acts.logits, m->acts.lnf, m->params.wte, NULL, BT, c->channels, c->padded_vocab_size);
    gpt2_softmax_forward(m->acts.logits, m->acts.losses, targets, BT, c->vocab_size, c->padded_vocab_size);
    m->mean_loss = -1.0f;
    if (targets) {
        if (targets != m->targets) memcpy(m->targets, targets, sizeof(int) * (size_t)BT);
        double sum = 0.0;
        for (int64_t i = 0; i < BT; i++) sum += m->acts.losses[i];
        m->mean_loss = (float)(sum / (double)BT);
    } else {
        m->targets[0] = -1;
    }
    return m->mean_loss;
}

void gpt2_get_logits(GPT2 *m, float *out, int64_t row0, int64_t count) {
    int64_t C = m->config.channels;
    matmul_forward(out, m->acts.lnf + row0 * C, m->params.wte, NULL, count, C, m->config.padded_vocab_size);
}

// The layers' gradients are summed into (+=) by the kernels, so accumulate = 0 zeroes them first.
int gpt2_backward(GPT2 *m, float *grads, int accumulate, gpt2_grads_ready ready, void *ctx) {
    const GPT2Config *c = &m->config;
    int64_t B = m->B, T = m->T, C = c->channels, L = c->num_layers, NH = c->num_heads, BT = B * T;
    int64_t V = c->vocab_size, Vp = c->padded_vocab_size;
    ParameterTensors *p = &m->params, gv, *g = &gv;
    ActivationTensors *a = &m->acts;
    float *datt_scratch = a->dqkv + BT * 3 * C;
    gpt2_point_params(g, grads, m->param_sizes);
    if (!accumulate) memset(grads, 0, sizeof(float) * (size_t)m->num_parameters);
    int rc = 0;
#define GRADS_READY(which) if (ready && (rc = ready(ctx, (which), NULL)) != 0) \
        return train_fail("gpt2_backward: the grads_ready callback returned %d for group %d", rc, (which))
    crossentropy_softmax_backward(a->logits, m->targets, BT, V, Vp);
    matmul_backward_input(a->dbuf, a->logits, p->wte, BT, C, Vp);                 // d lnf
    matmul_backward_weight(g->wte, NULL, a->logits, a->lnf, BT, C, Vp);
    memset(a->dres, 0, sizeof(float) * (size_t)(BT * C));
    layernorm_backward(a->dres, g->lnfw, g->lnfb, a->dbuf, a->residual3 + (L - 1) * BT * C, p->lnfw,
                       a->lnf_mean, a->lnf_rstd, BT, C);
    GRADS_READY(GPT2_GRADS_LNF);
    for (int64_t l = L - 1; l >= 0; l--) {
        // dres holds d(residual3[l]), the gradient of both residual2[l] and the MLP's output
        const float *residual = l == 0 ? a->encoded : a->residual3 + (l - 1) * BT * C;
        const float *ln1 = a->ln1 + l * BT * C, *qkv = a->qkv + l * BT * 3 * C, *atty = a->atty + l * BT * C;
        const float *att = a->att + l * B * NH * T * T, *res2 = a->residual2 + l * BT * C, *ln2 = a->ln2 + l * BT * C;
        const float *fch = a->fch + l * BT * 4 * C, *fchg = a->fch_gelu + l * BT * 4 * C;
        matmul_backward_input(a->dbuf4, a->dres, p->fcprojw + l * 4 * C * C, BT, 4 * C, C);
        matmul_backward_weight(g->fcprojw + l * 4 * C * C, g->fcprojb + l * C, a->dres, fchg, BT, 4 * C, C);
        gelu_backward(a->dbuf4, fch, BT * 4 * C);
        matmul_backward_input(a->dbuf, a->dbuf4, p->fcw + l * 4 * C * C, BT, C, 4 * C);
        matmul_backward_weight(g->fcw + l * 4 * C * C, g->fcb + l * 4 * C, a->dbuf4, ln2, BT, C, 4 * C);
        layernorm_backward(a->dres, g->ln2w + l * C, g->ln2b + l * C, a->dbuf, res2, p->ln2w + l * C,
                           a->ln2_mean + l * BT, a->ln2_rstd + l * BT, BT, C);
        // dres now holds d(residual2[l]), the gradient of both residual and the attention's output
        matmul_backward_input(a->dbuf, a->dres, p->attprojw + l * C * C, BT, C, C);
        matmul_backward_weight(g->attprojw + l * C * C, g->attprojb + l * C, a->dres, atty, BT, C, C);
        attention_backward(a->dqkv, datt_scratch, a->dbuf, qkv, att, B, T, C, NH);
        matmul_backward_input(a->dbuf, a->dqkv, p->qkvw + l * 3 * C * C, BT, C, 3 * C);
        matmul_backward_weight(g->qkvw + l * 3 * C * C, g->qkvb + l * 3 * C, a->dqkv, ln1, BT, C, 3 * C);
        layernorm_backward(a->dres, g->ln1w + l * C, g->ln1b + l * C, a->dbuf, residual, p->ln1w + l * C,
                           a->ln1_mean + l * BT, a->ln1_rstd + l * BT, BT, C);
        GRADS_READY((int)l);
    }
    // dres = d(encoded): to wpe by position (each t in one thread, b in order), and to wte
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < C; i++) g->wpe[t * C + i] += a->dres[(b * T + t) * C + i];
    const float *dtok = a->dres;
    if (c->stable_embedding) {
        memset(a->dbuf, 0, sizeof(float) * (size_t)(BT * C));
        layernorm_backward(a->dbuf, g->lnew, g->lneb, a->dres, a->tokemb, p->lnew, a->lne_mean, a->lne_rstd, BT, C);
        dtok = a->dbuf;
    }
    // wte rows are scattered to: split by columns so that each element sums its rows in order
    const int64_t CB = 16;
    #pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < C; c0 += CB) {
        int64_t c1 = c0 + CB < C ? c0 + CB : C;
        for (int64_t bt = 0; bt < BT; bt++) {
            float *row = g->wte + (int64_t)m->inputs[bt] * C;
            for (int64_t i = c0; i < c1; i++) row[i] += dtok[bt * C + i];
        }
    }
    GRADS_READY(GPT2_GRADS_EMBED);
#undef GRADS_READY
    return 0;
}

// ------------------------------------------------------------------------------------------------
// llm.c's model file

int gpt2_params_nonfinite(const GPT2Config *c, const float *p, char *buf, size_t size) {
    int64_t sizes[GPT2_NUM_PARAMS];
    gpt2_param_sizes(c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; p += sizes[i], i++)
        for (int64_t j = 0; j < sizes[i]; j++)
            if (!isfinite(p[j])) {
                snprintf(buf, size, "tensor '%s' element %lld is %g", gpt2_param_names[i], (long long)j, (double)p[j]);
                return 1;
            }
    return 0;
}

// Model file (DESIGN.md §8.1): header[2..7] = maxT, V, L, NH, C, Vp; then the 16 tensors in llm.c's
// order, 4 (fp32) or 2 (bf16) bytes each. bnb8 extension: header[8] = 1 when StableEmbedding's
// layernorm (lnew, lneb) follows them. Such a model is written as version 8003 or 8005, not llm.c's 3
// or 5: llm.c ignores header[8] and what follows its tensors, so from a version 3 or 5 file it would
// compute another network (no layernorm after wte, which it also ties to the output head), silently,
// while it refuses any other version. Files of version 3 or 5 with header[8] = 1, written before,
// still load.
int gpt2_model_file_version(const GPT2Config *c, int bf16) {
    if (c->stable_embedding) return bf16 ? MODEL_VERSION_STABLE_BF16 : MODEL_VERSION_STABLE_FP32;
    return bf16 ? MODEL_VERSION_BF16 : MODEL_VERSION_FP32;
}

static int stable_embedding_version(int32_t version) {
    return version == MODEL_VERSION_STABLE_FP32 || version == MODEL_VERSION_STABLE_BF16;
}

// The header of an open model file, every field and the file's size checked: the shape and the
// bytes per parameter (4 or 2).
static int model_header(FILE *f, const char *path, GPT2Config *c, int64_t *bytes_per) {
    int32_t h[HEADER_INTS];
    int64_t size;
    if (read_header(f, path, "model", h, &size)) return -1;
    if (h[0] != MODEL_MAGIC) return train_fail("%s: not an llm.c model file (magic %d, expected %d)", path, h[0], MODEL_MAGIC);
    if (h[1] != MODEL_VERSION_FP32 && h[1] != MODEL_VERSION_BF16 && !stable_embedding_version(h[1]))
        return train_fail("%s: model file version %d, expected 3 (fp32) or 5 (bf16), or %d / %d (the same with "
                          "StableEmbedding)", path, h[1], MODEL_VERSION_STABLE_FP32, MODEL_VERSION_STABLE_BF16);
    if (h[8] != 0 && h[8] != 1) return train_fail("%s: header[8] = %d, expected 0 or 1 (StableEmbedding flag)", path, h[8]);
    if (stable_embedding_version(h[1]) && h[8] != 1)
        return train_fail("%s: model file version %d is a StableEmbedding model's, but header[8] = %d, expected 1", path,
                          h[1], h[8]);
    GPT2Config hc = {h[2], h[3], h[7], h[4], h[5], h[6], h[8]};
    *c = hc;
    if (gpt2_config_check(c, path)) return -1;
    *bytes_per = h[1] == MODEL_VERSION_FP32 || h[1] == MODEL_VERSION_STABLE_FP32 ? 4 : 2;
    int64_t expected = 1024 + gpt2_num_parameters(c) * *bytes_per;
    if (size != expected)   // checked before allocating: a bad header cannot ask for terabytes
        return train_fail("%s: %s model file has %lld bytes, its header says %lld (maxT=%d V=%d L=%d NH=%d C=%d Vp=%d)",
                          path, size < expected ? "truncated" : "oversized", (long long)size, (long long)expected,
                          h[2], h[3], h[4], h[5], h[6], h[7]);
    return 0;
}

int gpt2_load_config(GPT2Config *c, const char *path) {
    FILE *f = open_input(path, "model");
    if (!f) return -1;
    int64_t bytes_per;
    int status = model_header(f, path, c, &bytes_per);
    fclose(f);
    return status;
}

int gpt2_load(GPT2 *m, const char *path) {
    memset(m, 0, sizeof *m);
    FILE *f = open_input(path, "model");
    if (!f) return -1;
    int64_t bytes_per = 0;
    int status = model_header(f, path, &m->config, &bytes_per);
    if (!status) status = gpt2_alloc_params(m);
    if (!status && bytes_per == 4) {
        if (fread(m->params_memory, sizeof(float), (size_t)m->num_parameters, f) != (size_t)m->num_parameters)
            status = train_fail("%s: truncated model file (read failed)", path);
    } else if (!status) {
        uint16_t buf[65536];
        for (int64_t i = 0; !status && i < m->num_parameters; i += 65536) {
            size_t k = (size_t)(m->num_parameters - i < 65536 ? m->num_parameters - i : 65536);
            if (fread(buf, 2, k, f) != k) status = train_fail("%s: truncated model file (read failed)", path);
            for (size_t j = 0; !status && j < k; j++) m->params_memory[i + (int64_t)j] = bnb8_bf16_to_f32(buf[j]);
        }
    }
    char where[160];   // a model with NaN or Inf weights cannot train: refused, naming the tensor
    if (!status && gpt2_params_nonfinite(&m->config, m->params_memory, where, sizeof where))
        status = train_fail("%s: non-finite weight: %s (a diverged model; use an earlier checkpoint)", path, where);
    fclose(f);
    if (status) gpt2_free(m);
    return status;
}

typedef struct { const GPT2Config *config; const float *params; int bf16; } ModelWrite;
static int model_writer(FILE *f, const void *ctx) {
    const ModelWrite *w = (const ModelWrite *)ctx;
    const GPT2Config *c = w->config;
    int32_t h[HEADER_INTS] = {0};
    h[0] = MODEL_MAGIC; h[1] = gpt2_model_file_version(c, w->bf16); h[2] = c->max_seq_len; h[3] = c->vocab_size;
    h[4] = c->num_layers; h[5] = c->num_heads; h[6] = c->channels; h[7] = c->padded_vocab_size;
    h[8] = c->stable_embedding;
    if (fwrite(h, sizeof(int32_t), HEADER_INTS, f) != HEADER_INTS) return -1;
    int64_t n = gpt2_num_parameters(c);
    const float *params = w->params;
    if (!w->bf16) return fwrite(params, sizeof(float), (size_t)n, f) == (size_t)n ? 0 : -1;
    uint16_t buf[65536];
    for (int64_t i = 0; i < n; i += 65536) {
        size_t k = (size_t)(n - i < 65536 ? n - i : 65536);
        for (size_t j = 0; j < k; j++) buf[j] = bnb8_f32_to_bf16(params[i + (int64_t)j]);
        if (fwrite(buf, 2, k, f) != k) return -1;
    }
    return 0;
}
int gpt2_save_params(const GPT2Config *c, const float *params, const char *path, int bf16) {
    ModelWrite w = {c, params, bf16};
    return write_atomically(path, model_writer, &w);
}
int gpt2_save(const GPT2 *m, const char *path, int bf16) { return gpt2_save_params(&m->config, m->params_memory, path, bf16); }

