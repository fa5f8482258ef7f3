/*
train_gpt2_8bit.c — trains GPT-2 with bnb8's optimizers: fp32 states (the 16-byte baseline), 8-bit
block-wise states (Dettmers et al.) or FlashOptim's flash recipe; AdamW, Lion or SGD with momentum;
on the CPU, or on the GPU with gpt2_cuda.cu's model when built with -DTRAIN_CUDA (with gradient
release for flash there).

One flat file in the spirit of llm.c's train_gpt2.c, written from the math:
  - the model: one parameter allocation holding named tensors, one activation allocation,
    forward and backward in fp32 with OpenMP;
  - llm.c's files: models (fp32 version 3, bf16 version 5), tokens and tokenizer, fully validated;
  - the training loop: warm-up + cosine learning rate, global gradient clipping, evaluation,
    sampling, checkpoints (model + optimizer state + trainer state + DONE marker, each written to
    a temporary file and renamed) and bit-exact resume;
  - the report of SPEC §8: every buffer, persistent bytes per parameter from the optimizer's own
    accounting, tokens/s, losses, a generated sample.

Determinism: every kernel computes each output element in one thread and in a fixed order (sums
are never split across threads), so a step gives the same bits whatever the number of threads.
With the optimizer state, the data position and the RNG saved in a checkpoint, a resumed run is
bit-identical to one that never stopped (test/test_train.c checks it).

Build and run: `make train`, or `make build/train_gpt2_8bit && ./build/train_gpt2_8bit -h`; the GPU
build is build/train_gpt2_8bit_cuda (`make train GPU=1`). Compiled with -DTRAIN_NO_MAIN, this file is
a library for the tests (test/test_train.c, test/test_train_gpu.c).
*/
#define _POSIX_C_SOURCE 200809L   // fseeko, fsync, mkdir, opendir, clock_gettime
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdarg.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <errno.h>
#include <dirent.h>
#include <sys/types.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "bnb8.h"
#include "gpt2_cuda.h"   // the GPU model (TRAIN_CUDA builds; plain C declarations)

// ------------------------------------------------------------------------------------------------
// Errors. Every function that can fail returns 0 or -1 and leaves a message (naming the file or the
// argument) in train_error_text; main prints it and exits 1. Nothing here aborts the process.

static char train_error_text[1024];

static int train_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(train_error_text, sizeof train_error_text, fmt, ap);
    va_end(ap);
    return -1;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int host_is_little_endian(void) { uint16_t one = 1; uint8_t b; memcpy(&b, &one, 1); return b == 1; }

// ------------------------------------------------------------------------------------------------
// Random numbers: splitmix64 (one 64-bit state, so a checkpoint saves it in one word).

typedef struct { uint64_t s; } Rng;

static uint64_t rng_u64(Rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_uniform(Rng *r) { return (float)(rng_u64(r) >> 40) * 0x1.0p-24f; }   // [0, 1)
static float rng_normal(Rng *r) {                                                     // Box-Muller
    double u1 = ((double)(rng_u64(r) >> 11) + 1.0) * 0x1.0p-53, u2 = (double)(rng_u64(r) >> 11) * 0x1.0p-53;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

// ------------------------------------------------------------------------------------------------
// Model configuration, from a descriptor or a checkpoint header.

typedef struct {
    int max_seq_len;          // maxT: rows of wpe
    int vocab_size;           // V
    int padded_vocab_size;    // Vp >= V: rows of wte (llm.c pads to a multiple of 64/128)
    int num_layers;           // L
    int num_heads;            // NH
    int channels;             // C
    int stable_embedding;     // StableEmbedding: layernorm after the token embedding (bnb8 extension)
} GPT2Config;

static int config_check(const GPT2Config *c, const char *where) {
    if (c->max_seq_len < 1 || c->max_seq_len > (1 << 20) || c->vocab_size < 1 || c->vocab_size > (1 << 24) ||
        c->padded_vocab_size < c->vocab_size || c->padded_vocab_size > (1 << 24) || c->num_layers < 1 ||
        c->num_layers > 4096 || c->channels < 1 || c->channels > (1 << 16) || c->num_heads < 1 ||
        c->channels % c->num_heads != 0 || (c->stable_embedding != 0 && c->stable_embedding != 1))
        return train_fail("%s: bad model shape maxT=%d V=%d Vp=%d L=%d NH=%d C=%d (need C a multiple of NH, Vp >= V)",
                          where, c->max_seq_len, c->vocab_size, c->padded_vocab_size, c->num_layers,
                          c->num_heads, c->channels);
    return 0;
}

// Descriptors: "dL" is llm.c's depth-L GPT-2 (d6 384 channels / 6 heads, d12 768/12 = GPT-2 124M,
// d24 1024/16, d36 1280/20, d48 1600/25, d60 1920/30, d72 2880/30); any other L gets 64 L channels
// and L heads. Letters after it set the rest: c channels, h heads, v vocabulary, t maxT; e.g.
// "d4c128h4" (the CPU default) or "d2c32h2v64t16" (the tests' tiny model). V defaults to GPT-2's
// 50257, maxT to 1024; Vp is V rounded up to a multiple of 64 (50304 for GPT-2, as llm.c).
static int config_from_descriptor(GPT2Config *c, const char *desc) {
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
    return config_check(c, where);
}

// ------------------------------------------------------------------------------------------------
// Parameters: one allocation, these tensors in llm.c's file order (then the StableEmbedding pair).

#define NUM_PARAM_TENSORS 18
typedef struct {
    float *wte;        // (Vp, C)       token embedding, tied with the LM head
    float *wpe;        // (maxT, C)     position embedding
    float *ln1w;       // (L, C)
    float *ln1b;       // (L, C)
    float *qkvw;       // (L, 3C, C)
    float *qkvb;       // (L, 3C)
    float *attprojw;   // (L, C, C)
    float *attprojb;   // (L, C)
    float *ln2w;       // (L, C)
    float *ln2b;       // (L, C)
    float *fcw;        // (L, 4C, C)
    float *fcb;        // (L, 4C)
    float *fcprojw;    // (L, C, 4C)
    float *fcprojb;    // (L, C)
    float *lnfw;       // (C)
    float *lnfb;       // (C)
    float *lnew;       // (C) StableEmbedding's layernorm weight; (0) when off
    float *lneb;       // (C) and bias
} ParameterTensors;

static const char *param_names[NUM_PARAM_TENSORS] = {
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b",
    "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb", "lnew", "lneb"};
static const char *param_shapes[NUM_PARAM_TENSORS] = {
    "(Vp, C)", "(maxT, C)", "(L, C)", "(L, C)", "(L, 3C, C)", "(L, 3C)", "(L, C, C)", "(L, C)", "(L, C)",
    "(L, C)", "(L, 4C, C)", "(L, 4C)", "(L, C, 4C)", "(L, C)", "(C)", "(C)", "(C)", "(C)"};
// Matrices (and embeddings) get weight decay; biases and layernorm parameters do not.
static const int param_is_matrix[NUM_PARAM_TENSORS] = {1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0};

static void param_sizes_of(const GPT2Config *c, int64_t s[NUM_PARAM_TENSORS]) {
    int64_t Vp = c->padded_vocab_size, C = c->channels, L = c->num_layers, maxT = c->max_seq_len;
    int64_t sizes[NUM_PARAM_TENSORS] = {Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
                                        L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C,
                                        c->stable_embedding ? C : 0, c->stable_embedding ? C : 0};
    memcpy(s, sizes, sizeof sizes);
}

// The tensors of a ParameterTensors as an array (the struct is the readable view, this the loop).
static float **param_slot(ParameterTensors *p, int i) {
    float **slots[NUM_PARAM_TENSORS] = {&p->wte, &p->wpe, &p->ln1w, &p->ln1b, &p->qkvw, &p->qkvb,
        &p->attprojw, &p->attprojb, &p->ln2w, &p->ln2b, &p->fcw, &p->fcb, &p->fcprojw, &p->fcprojb,
        &p->lnfw, &p->lnfb, &p->lnew, &p->lneb};
    return slots[i];
}

static void point_params(ParameterTensors *p, float *memory, const int64_t sizes[NUM_PARAM_TENSORS]) {
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) { *param_slot(p, i) = sizes[i] ? memory : NULL; memory += sizes[i]; }
}

// ------------------------------------------------------------------------------------------------
// Activations and the backward pass's scratch: one allocation for a batch of (B, T).

#define NUM_ACT_TENSORS 27
typedef struct {
    float *encoded;    // (B, T, C)      the residual stream's start: token (+ layernorm) + position
    float *tokemb;     // (B, T, C)      StableEmbedding: the token embeddings before their layernorm
    float *lne;        // (B, T, C)      and after it
    float *lne_mean;   // (B, T)
    float *lne_rstd;   // (B, T)
    float *ln1;        // (L, B, T, C)
    float *ln1_mean;   // (L, B, T)
    float *ln1_rstd;   // (L, B, T)
    float *qkv;        // (L, B, T, 3C)
    float *atty;       // (L, B, T, C)   attention output, before its projection
    float *att;        // (L, B, NH, T, T) attention probabilities
    float *residual2;  // (L, B, T, C)   residual + attention projection
    float *ln2;        // (L, B, T, C)
    float *ln2_mean;   // (L, B, T)
    float *ln2_rstd;   // (L, B, T)
    float *fch;        // (L, B, T, 4C)
    float *fch_gelu;   // (L, B, T, 4C)
    float *residual3;  // (L, B, T, C)   residual2 + MLP projection
    float *lnf;        // (B, T, C)
    float *lnf_mean;   // (B, T)
    float *lnf_rstd;   // (B, T)
    float *logits;     // (B, T, Vp)     logits, then probabilities, then their gradient, in place
    float *losses;     // (B, T)
    // backward scratch, reused by every layer
    float *dres;       // (B, T, C)      gradient of the residual stream
    float *dbuf;       // (B, T, C)
    float *dbuf4;      // (B, T, 4C)
    float *dqkv;       // (B, T, 3C)
} ActivationTensors;
// datt rows for attention's backward live at the end of dqkv's region (see act_sizes_of).

static const char *act_names[NUM_ACT_TENSORS] = {
    "encoded", "tokemb", "lne", "lne_mean", "lne_rstd", "ln1", "ln1_mean", "ln1_rstd", "qkv", "atty", "att",
    "residual2", "ln2", "ln2_mean", "ln2_rstd", "fch", "fch_gelu", "residual3", "lnf", "lnf_mean", "lnf_rstd",
    "logits", "losses", "dres (grad)", "dbuf (grad)", "dbuf4 (grad)", "dqkv+datt (grad)"};

static void act_sizes_of(const GPT2Config *c, int64_t B, int64_t T, int64_t s[NUM_ACT_TENSORS]) {
    int64_t C = c->channels, L = c->num_layers, NH = c->num_heads, Vp = c->padded_vocab_size, BT = B * T;
    int64_t st = c->stable_embedding ? 1 : 0;
    int64_t sizes[NUM_ACT_TENSORS] = {
        BT * C, st * BT * C, st * BT * C, st * BT, st * BT,
        L * BT * C, L * BT, L * BT, L * BT * 3 * C, L * BT * C, L * B * NH * T * T,
        L * BT * C, L * BT * C, L * BT, L * BT, L * BT * 4 * C, L * BT * 4 * C, L * BT * C,
        BT * C, BT, BT, BT * Vp, BT,
        BT * C, BT * C, BT * 4 * C, BT * 3 * C + B * NH * T};
    memcpy(s, sizes, sizeof sizes);
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

// dinp (N, C) = dout (N, OC) @ weight (OC, C): each element sums over o = 0..OC-1 in order.
// Register tiles of 4 rows x 16 columns; the weight is read in blocks of OB rows.
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
                for (int64_t c = 0; c < C; c += CB) {
                    if (r + 4 <= r1 && c + CB <= C) {
                        float acc[4][16];
                        for (int rr = 0; rr < 4; rr++)
                            for (int k = 0; k < 16; k++) acc[rr][k] = dinp[(r + rr) * C + c + k];
                        const float *d0 = dout + r * OC, *d1 = d0 + OC, *d2 = d1 + OC, *d3 = d2 + OC;
                        for (int64_t o = o0; o < o1; o++) {
                            const float *w = weight + o * C + c;
                            float e0 = d0[o], e1 = d1[o], e2 = d2[o], e3 = d3[o];
                            for (int k = 0; k < 16; k++) {
                                acc[0][k] += e0 * w[k]; acc[1][k] += e1 * w[k];
                                acc[2][k] += e2 * w[k]; acc[3][k] += e3 * w[k];
                            }
                        }
                        for (int rr = 0; rr < 4; rr++)
                            for (int k = 0; k < 16; k++) dinp[(r + rr) * C + c + k] = acc[rr][k];
                    } else {
                        int64_t re = r + 4 < r1 ? r + 4 : r1, ce = c + CB < C ? c + CB : C;
                        for (int64_t rr = r; rr < re; rr++)
                            for (int64_t cc = c; cc < ce; cc++) {
                                float s = dinp[rr * C + cc];
                                for (int64_t o = o0; o < o1; o++) s += dout[rr * OC + o] * weight[o * C + cc];
                                dinp[rr * C + cc] = s;
                            }
                    }
                }
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
                for (int64_t c = 0; c < C; c += CB) {
                    if (o + 4 <= o1 && c + CB <= C) {
                        float acc[4][16];
                        for (int q = 0; q < 4; q++)
                            for (int k = 0; k < 16; k++) acc[q][k] = dweight[(o + q) * C + c + k];
                        for (int64_t r = r0; r < r1; r++) {
                            const float *x = inp + r * C + c, *d = dout + r * OC + o;
                            float e0 = d[0], e1 = d[1], e2 = d[2], e3 = d[3];
                            for (int k = 0; k < 16; k++) {
                                acc[0][k] += e0 * x[k]; acc[1][k] += e1 * x[k];
                                acc[2][k] += e2 * x[k]; acc[3][k] += e3 * x[k];
                            }
                        }
                        for (int q = 0; q < 4; q++)
                            for (int k = 0; k < 16; k++) dweight[(o + q) * C + c + k] = acc[q][k];
                    } else {
                        int64_t oe = o + 4 < o1 ? o + 4 : o1, ce = c + CB < C ? c + CB : C;
                        for (int64_t oo = o; oo < oe; oo++)
                            for (int64_t cc = c; cc < ce; cc++) {
                                float s = dweight[oo * C + cc];
                                for (int64_t r = r0; r < r1; r++) s += dout[r * OC + oo] * inp[r * C + cc];
                                dweight[oo * C + cc] = s;
                            }
                    }
                }
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

// Softmax over the first V of Vp columns of logits (N, Vp), in place (padding columns get 0); with
// targets, losses (N) = -log p[target], computed from the logits (no log of an underflowed 0).
// Max and sum run in LANES interleaved partials, combined in a fixed order.
static void softmax_forward(float *logits, float *losses, const int *targets, int64_t N, int64_t V, int64_t Vp) {
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

typedef struct {
    GPT2Config config;
    ParameterTensors params;        // views into params_memory
    int64_t param_sizes[NUM_PARAM_TENSORS];
    float *params_memory;
    int64_t num_parameters;
    ParameterTensors grads;         // views into grads_memory, same layout
    float *grads_memory;
    ActivationTensors acts;         // views into acts_memory
    int64_t act_sizes[NUM_ACT_TENSORS];
    float *acts_memory;
    int64_t num_activations;
    int64_t batch_size, seq_len;    // what the activations were allocated for (0: not yet)
    int64_t B, T;                   // of the last forward
    int *inputs, *targets;          // (B, T) of the last forward; targets[0] < 0: none
    float mean_loss;                // of the last forward with targets
    // The flash recipe: the persistent weights and gradients are bf16, same layout (the optimizer
    // owns the weights' int8 correction); params_memory and grads_memory are the fp32 working
    // copies the CPU forward and backward compute with (flash_weights_to_fp32, flash_grads_to_bf16).
    uint16_t *params_bf16, *grads_bf16;
    const float *master;            // set while checkpointing flash: the decoded fp32 masters to save
} GPT2;

static void gpt2_free(GPT2 *m) {
    free(m->params_memory); free(m->grads_memory); free(m->acts_memory); free(m->inputs); free(m->targets);
    free(m->params_bf16); free(m->grads_bf16);
    memset(m, 0, sizeof *m);
}

// Parameters for m->config, zeroed. (The CPU's gradients come with its activations, gpt2_alloc_acts:
// a run on the GPU keeps only this host copy of the weights, for initialization and checkpoints.)
static int gpt2_alloc_params(GPT2 *m) {
    param_sizes_of(&m->config, m->param_sizes);
    m->num_parameters = 0;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) m->num_parameters += m->param_sizes[i];
    m->params_memory = (float *)calloc((size_t)m->num_parameters, sizeof(float));
    if (!m->params_memory) return train_fail("out of memory for %lld parameters", (long long)m->num_parameters);
    point_params(&m->params, m->params_memory, m->param_sizes);
    return 0;
}

// GPT-2's initialization: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), layernorms 1 and 0,
// biases 0, wte's padding rows 0. StableEmbedding: wte Xavier-uniform over its V real rows. Each run
// of INIT_CHUNK elements of a tensor draws from its own stream (seed, tensor, chunk), so the chunks
// fill in parallel with the same bits on any number of threads (7e9 weights in seconds).
#define INIT_CHUNK 65536
static int gpt2_init_random(GPT2 *m, const GPT2Config *c, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->config = *c;
    if (config_check(c, "model") || gpt2_alloc_params(m)) return -1;
    int64_t C = c->channels, V = c->vocab_size;
    float resid_std = 0.02f / sqrtf(2.0f * (float)c->num_layers), xavier = sqrtf(6.0f / (float)(V + C));
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        float *p = *param_slot(&m->params, i);
        int64_t n = i == 0 ? V * C : m->param_sizes[i];   // wte's padding rows stay 0
        if (i == 2 || i == 8 || i == 14 || i == 16) {     // layernorm weights
            for (int64_t j = 0; j < n; j++) p[j] = 1.0f;
            continue;
        }
        if (!param_is_matrix[i]) continue;                 // biases: 0
        int uniform = i == 0 && c->stable_embedding;
        float std = (i == 6 || i == 12) ? resid_std : 0.02f;
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

// The CPU's gradients (once) and activations for batches up to (B, T).
static int gpt2_alloc_acts(GPT2 *m, int64_t B, int64_t T) {
    if (!m->grads_memory) {
        m->grads_memory = (float *)calloc((size_t)m->num_parameters, sizeof(float));
        if (!m->grads_memory) return train_fail("out of memory for the gradients of %lld parameters", (long long)m->num_parameters);
        point_params(&m->grads, m->grads_memory, m->param_sizes);
    }
    free(m->acts_memory); free(m->inputs); free(m->targets);
    m->acts_memory = NULL; m->inputs = m->targets = NULL;
    act_sizes_of(&m->config, B, T, m->act_sizes);
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

// Forward through the final layernorm; the layer outputs for (B, T) land in m->acts.
static void gpt2_forward_body(GPT2 *m, const int *inputs, int64_t B, int64_t T) {
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

// Full forward for (B, T) <= the allocated size: logits become probabilities; with targets the
// mean loss is m->mean_loss (else -1). Returns the mean loss.
static float gpt2_forward(GPT2 *m, const int *inputs, const int *targets, int64_t B, int64_t T) {
    const GPT2Config *c = &m->config;
    int64_t BT = B * T;
    gpt2_forward_body(m, inputs, B, T);
    matmul_forward(m->acts.logits, m->acts.lnf, m->params.wte, NULL, BT, c->channels, c->padded_vocab_size);
    softmax_forward(m->acts.logits, m->acts.losses, targets, BT, c->vocab_size, c->padded_vocab_size);
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

static void gpt2_zero_grad(GPT2 *m) { memset(m->grads_memory, 0, sizeof(float) * (size_t)m->num_parameters); }

// Gradients of the mean loss of the last forward (which had targets), added to m->grads.
static void gpt2_backward(GPT2 *m) {
    const GPT2Config *c = &m->config;
    int64_t B = m->B, T = m->T, C = c->channels, L = c->num_layers, NH = c->num_heads, BT = B * T;
    int64_t V = c->vocab_size, Vp = c->padded_vocab_size;
    ParameterTensors *p = &m->params, *g = &m->grads;
    ActivationTensors *a = &m->acts;
    float *datt_scratch = a->dqkv + BT * 3 * C;
    crossentropy_softmax_backward(a->logits, m->targets, BT, V, Vp);
    matmul_backward_input(a->dbuf, a->logits, p->wte, BT, C, Vp);                 // d lnf
    matmul_backward_weight(g->wte, NULL, a->logits, a->lnf, BT, C, Vp);
    memset(a->dres, 0, sizeof(float) * (size_t)(BT * C));
    layernorm_backward(a->dres, g->lnfw, g->lnfb, a->dbuf, a->residual3 + (L - 1) * BT * C, p->lnfw,
                       a->lnf_mean, a->lnf_rstd, BT, C);
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
}

// ------------------------------------------------------------------------------------------------
// Files. llm.c's formats (SPEC §7): a header of 256 little-endian int32, then the payload.

#define MODEL_MAGIC 20240326
#define TOKENS_MAGIC 20240520
#define TOKENIZER_MAGIC 20240328
#define HEADER_INTS 256

// Size of an open file (then rewound).
static int file_size_of(FILE *f, const char *path, int64_t *size) {
    if (fseeko(f, 0, SEEK_END) != 0) return train_fail("%s: cannot seek", path);
    off_t s = ftello(f);
    if (s < 0 || fseeko(f, 0, SEEK_SET) != 0) return train_fail("%s: cannot seek", path);
    *size = (int64_t)s;
    return 0;
}

static int read_header(FILE *f, const char *path, const char *what, int32_t h[HEADER_INTS], int64_t *size) {
    if (!host_is_little_endian()) return train_fail("%s: big-endian hosts are not supported", path);
    if (file_size_of(f, path, size)) return -1;
    if (*size < (int64_t)sizeof(int32_t) * HEADER_INTS || fread(h, sizeof(int32_t), HEADER_INTS, f) != HEADER_INTS)
        return train_fail("%s: truncated %s file: %lld bytes, shorter than its 1024-byte header", path, what, (long long)*size);
    return 0;
}

// Writes to path.tmp, flushes to disk, then renames: a crash never leaves a half file under path.
typedef int (*file_writer)(FILE *f, const void *ctx);
static int write_atomically(const char *path, file_writer writer, const void *ctx) {
    size_t len = strlen(path);
    char *tmp = (char *)malloc(len + 5);
    if (!tmp) return train_fail("out of memory");
    memcpy(tmp, path, len);
    memcpy(tmp + len, ".tmp", 5);
    FILE *f = fopen(tmp, "wb");
    if (!f) { train_fail("cannot create %s: %s", tmp, strerror(errno)); free(tmp); return -1; }
    int ok = writer(f, ctx) == 0;
    ok &= fflush(f) == 0;
    ok &= fsync(fileno(f)) == 0;
    ok &= fclose(f) == 0;
    int status = 0;
    if (!ok) status = train_fail("writing %s failed (disk full?)", tmp);
    else if (rename(tmp, path) != 0) status = train_fail("cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (status) remove(tmp);
    free(tmp);
    return status;
}

// The first non-finite weight, as "tensor 'name' element i is nan" in buf; 0 when all are finite.
static int params_nonfinite(const GPT2 *m, char *buf, size_t size) {
    const float *p = m->master ? m->master : m->params_memory;
    for (int i = 0; i < NUM_PARAM_TENSORS; p += m->param_sizes[i], i++)
        for (int64_t j = 0; j < m->param_sizes[i]; j++)
            if (!isfinite(p[j])) {
                snprintf(buf, size, "tensor '%s' element %lld is %g", param_names[i], (long long)j, (double)p[j]);
                return 1;
            }
    return 0;
}

// Model file: header[2..7] = maxT, V, L, NH, C, Vp; version 3 = fp32, 5 = bf16 parameters, in
// llm.c's order. bnb8 extension: header[8] = 1 when StableEmbedding's layernorm (lnew, lneb) follows
// the 16 tensors (llm.c leaves header[8] at 0 and ignores what follows the tensors it reads).
static int gpt2_load(GPT2 *m, const char *path) {
    memset(m, 0, sizeof *m);
    FILE *f = fopen(path, "rb");
    if (!f) return train_fail("cannot open model file %s: %s", path, strerror(errno));
    int32_t h[HEADER_INTS];
    int64_t size;
    int status = read_header(f, path, "model", h, &size);
    if (!status && h[0] != MODEL_MAGIC)
        status = train_fail("%s: not an llm.c model file (magic %d, expected %d)", path, h[0], MODEL_MAGIC);
    if (!status && h[1] != 3 && h[1] != 5)
        status = train_fail("%s: model file version %d, expected 3 (fp32) or 5 (bf16)", path, h[1]);
    if (!status && h[8] != 0 && h[8] != 1)
        status = train_fail("%s: header[8] = %d, expected 0 or 1 (StableEmbedding flag)", path, h[8]);
    if (!status) {
        GPT2Config c = {h[2], h[3], h[7], h[4], h[5], h[6], h[8]};
        status = config_check(&c, path);
        m->config = c;
    }
    int64_t bytes_per = h[1] == 3 ? 4 : 2, expected = 0;
    if (!status) {
        int64_t sizes[NUM_PARAM_TENSORS], n = 0;
        param_sizes_of(&m->config, sizes);
        for (int i = 0; i < NUM_PARAM_TENSORS; i++) n += sizes[i];
        expected = 1024 + n * bytes_per;
        if (size != expected)   // checked before allocating: a bad header cannot ask for terabytes
            status = train_fail("%s: %s model file has %lld bytes, its header says %lld (maxT=%d V=%d L=%d NH=%d C=%d Vp=%d)",
                                path, size < expected ? "truncated" : "oversized", (long long)size, (long long)expected,
                                h[2], h[3], h[4], h[5], h[6], h[7]);
    }
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
    if (!status && params_nonfinite(m, where, sizeof where))
        status = train_fail("%s: non-finite weight: %s (a diverged model; use an earlier checkpoint)", path, where);
    fclose(f);
    if (status) gpt2_free(m);
    return status;
}

typedef struct { const GPT2 *model; int bf16; } ModelWrite;
static int model_writer(FILE *f, const void *ctx) {
    const ModelWrite *w = (const ModelWrite *)ctx;
    const GPT2Config *c = &w->model->config;
    int32_t h[HEADER_INTS] = {0};
    h[0] = MODEL_MAGIC; h[1] = w->bf16 ? 5 : 3; h[2] = c->max_seq_len; h[3] = c->vocab_size;
    h[4] = c->num_layers; h[5] = c->num_heads; h[6] = c->channels; h[7] = c->padded_vocab_size;
    h[8] = c->stable_embedding;
    if (fwrite(h, sizeof(int32_t), HEADER_INTS, f) != HEADER_INTS) return -1;
    int64_t n = w->model->num_parameters;
    const float *params = w->model->master ? w->model->master : w->model->params_memory;
    if (!w->bf16) return fwrite(params, sizeof(float), (size_t)n, f) == (size_t)n ? 0 : -1;
    uint16_t buf[65536];
    for (int64_t i = 0; i < n; i += 65536) {
        size_t k = (size_t)(n - i < 65536 ? n - i : 65536);
        for (size_t j = 0; j < k; j++) buf[j] = bnb8_f32_to_bf16(params[i + (int64_t)j]);
        if (fwrite(buf, 2, k, f) != k) return -1;
    }
    return 0;
}
static int gpt2_save(const GPT2 *m, const char *path, int bf16) {
    ModelWrite w = {m, bf16};
    return write_atomically(path, model_writer, &w);
}

// Tokens file: header[2] = count, then count uint16 tokens; the size is exactly 1024 + 2 count.
typedef struct {
    char path[512];
    uint16_t *tokens;
    int64_t count;
} TokenFile;

static int tokens_load(TokenFile *t, const char *path) {
    memset(t, 0, sizeof *t);
    snprintf(t->path, sizeof t->path, "%s", path);
    FILE *f = fopen(path, "rb");
    if (!f) return train_fail("cannot open tokens file %s: %s", path, strerror(errno));
    int32_t h[HEADER_INTS];
    int64_t size;
    int status = read_header(f, path, "tokens", h, &size);
    if (!status && h[0] != TOKENS_MAGIC)
        status = train_fail("%s: not an llm.c tokens file (magic %d, expected %d)", path, h[0], TOKENS_MAGIC);
    if (!status && h[1] != 1) status = train_fail("%s: tokens file version %d, expected 1", path, h[1]);
    if (!status && h[2] < 0) status = train_fail("%s: negative token count %d", path, h[2]);
    if (!status && size != 1024 + 2 * (int64_t)h[2])
        status = train_fail("%s: %s tokens file has %lld bytes, its header says %d tokens (%lld bytes)", path,
                            size < 1024 + 2 * (int64_t)h[2] ? "truncated" : "oversized", (long long)size, h[2],
                            (long long)(1024 + 2 * (int64_t)h[2]));
    if (!status) {
        t->count = h[2];
        t->tokens = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(t->count > 0 ? t->count : 1));
        if (!t->tokens) status = train_fail("out of memory for %s", path);
        else if (fread(t->tokens, 2, (size_t)t->count, f) != (size_t)t->count)
            status = train_fail("%s: truncated tokens file (read failed)", path);
    }
    fclose(f);
    if (status) { free(t->tokens); t->tokens = NULL; }
    return status;
}

// Every token must index the model's vocabulary.
static int tokens_check_vocab(const TokenFile *t, int V) {
    for (int64_t i = 0; i < t->count; i++)
        if (t->tokens[i] >= V)
            return train_fail("%s: token %lld is %d, outside the model's vocabulary of %d", t->path, (long long)i,
                              t->tokens[i], V);
    return 0;
}

// Tokenizer file: header[2] = vocabulary size, header[3] = end-of-text id; then per token a length
// byte (1..255) and its bytes, exactly to the end of the file.
typedef struct {
    int vocab_size, eot;
    uint8_t *data;        // the file's payload
    int64_t *offset;      // (vocab_size) start of each token's bytes in data
} Tokenizer;

static void tokenizer_free(Tokenizer *t) { free(t->data); free(t->offset); memset(t, 0, sizeof *t); }

static int tokenizer_load(Tokenizer *t, const char *path) {
    memset(t, 0, sizeof *t);
    FILE *f = fopen(path, "rb");
    if (!f) return train_fail("cannot open tokenizer file %s: %s", path, strerror(errno));
    int32_t h[HEADER_INTS];
    int64_t size, n = 0;
    int status = read_header(f, path, "tokenizer", h, &size);
    if (!status && h[0] != TOKENIZER_MAGIC)
        status = train_fail("%s: not an llm.c tokenizer file (magic %d, expected %d)", path, h[0], TOKENIZER_MAGIC);
    if (!status && h[1] != 2) status = train_fail("%s: tokenizer file version %d, expected 2", path, h[1]);
    if (!status && (h[2] < 1 || h[2] > (1 << 24) || h[3] < 0 || h[3] >= h[2]))
        status = train_fail("%s: bad tokenizer header: vocabulary %d, end-of-text id %d", path, h[2], h[3]);
    if (!status && size - 1024 < 2 * (int64_t)h[2])   // before allocating: each token takes >= 2 bytes
        status = train_fail("%s: truncated tokenizer file: %lld bytes after the header cannot hold %d tokens", path,
                            (long long)(size - 1024), h[2]);
    if (!status) {
        n = size - 1024;
        t->vocab_size = h[2];
        t->eot = h[3];
        t->data = (uint8_t *)malloc((size_t)(n > 0 ? n : 1));
        t->offset = (int64_t *)malloc(sizeof(int64_t) * (size_t)t->vocab_size);
        if (!t->data || !t->offset) status = train_fail("out of memory for %s", path);
        else if (fread(t->data, 1, (size_t)n, f) != (size_t)n) status = train_fail("%s: read failed", path);
    }
    int64_t pos = 0;
    for (int i = 0; !status && i < t->vocab_size; i++) {
        if (pos >= n) { status = train_fail("%s: truncated tokenizer file: ends at token %d of %d", path, i, t->vocab_size); break; }
        int len = t->data[pos];
        if (len == 0) { status = train_fail("%s: token %d has length 0", path, i); break; }
        if (pos + 1 + len > n) { status = train_fail("%s: truncated tokenizer file: token %d runs past the end", path, i); break; }
        t->offset[i] = pos + 1;
        pos += 1 + len;
    }
    if (!status && pos != n)
        status = train_fail("%s: oversized tokenizer file: %lld bytes after the last token", path, (long long)(n - pos));
    fclose(f);
    if (status) tokenizer_free(t);
    return status;
}

// Prints a token's bytes; control bytes other than newline and tab are shown as '?'.
static void tokenizer_print(const Tokenizer *t, int id, FILE *out) {
    if (!t->data || id < 0 || id >= t->vocab_size) { fprintf(out, "<%d>", id); return; }
    const uint8_t *s = t->data + t->offset[id];
    int len = s[-1];
    for (int i = 0; i < len; i++) fputc(s[i] < 32 && s[i] != '\n' && s[i] != '\t' ? '?' : s[i], out);
}

// ------------------------------------------------------------------------------------------------
// Data: batches of B sequences of T+1 consecutive tokens, read in order and wrapping around.

typedef struct {
    const TokenFile *file;
    int64_t B, T, position;    // the next batch starts at position
    int *inputs, *targets;     // (B, T)
} DataLoader;

static int loader_init(DataLoader *d, const TokenFile *file, int64_t B, int64_t T) {
    memset(d, 0, sizeof *d);
    if (file->count < B * T + 1)
        return train_fail("%s has %lld tokens, fewer than one batch needs (B*T+1 = %lld)", file->path,
                          (long long)file->count, (long long)(B * T + 1));
    d->file = file; d->B = B; d->T = T;
    d->inputs = (int *)malloc(sizeof(int) * (size_t)(B * T));
    d->targets = (int *)malloc(sizeof(int) * (size_t)(B * T));
    if (!d->inputs || !d->targets) return train_fail("out of memory for a batch");
    return 0;
}
static void loader_free(DataLoader *d) { free(d->inputs); free(d->targets); memset(d, 0, sizeof *d); }

static void loader_next(DataLoader *d) {
    int64_t n = d->B * d->T;
    if (d->position + n + 1 > d->file->count) d->position = 0;
    const uint16_t *p = d->file->tokens + d->position;
    for (int64_t i = 0; i < n; i++) { d->inputs[i] = p[i]; d->targets[i] = p[i + 1]; }
    d->position += n;
}

// ------------------------------------------------------------------------------------------------
// Recipes and optimizers

typedef struct {
    const char *name;
    bnb8_state_format format;
    const char *about;
} Recipe;

// `flash` (FlashOptim, SPEC §6): the persistent weights are bf16 with an int8 correction each (the
// optimizer's, together a near-fp32 master), the gradients bf16, the states companded 8-bit codes
// with a bf16 scale per 32. The CPU model computes in fp32 on working copies: the forward uses the
// bf16 weights widened (as FlashOptim's forward uses the bf16 weights), the backward's fp32
// gradients are rounded to bf16 before the step. Tensors under min_8bit_size (biases, layernorms
// of small models) and StableEmbedding's wte keep 32-bit states, and their correction.
static const Recipe recipes[] = {
    {"fp32", BNB8_STATE_32BIT, "fp32 weights and gradients, 32-bit optimizer states"},
    {"8bit", BNB8_STATE_8BIT, "fp32 weights and gradients, 8-bit block-wise states"},
    {"flash", BNB8_STATE_FLASH, "bf16 weights + int8 error correction, companded 8-bit states, bf16 gradients"},
};

// flash on the CPU: the fp32 working weights are the bf16 weights widened (exact); the fp32
// gradients of the backward pass become the bf16 gradients the optimizer reads (nearest even).
static void flash_weights_to_fp32(GPT2 *m) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m->num_parameters; i++) m->params_memory[i] = bnb8_bf16_to_f32(m->params_bf16[i]);
}
static void flash_grads_to_bf16(GPT2 *m) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m->num_parameters; i++) m->grads_bf16[i] = bnb8_f32_to_bf16(m->grads_memory[i]);
}

// The optimizer's tensors, registered in parameter order. With gradient release (GPU, flash) each
// per-layer tensor (2..13) is registered as L slices, "qkvw.0" .. "qkvw.L-1", one per layer, so
// that a layer's slices can be stepped as soon as backward has its gradients.
static int64_t tensor_slices(const GPT2 *m, int release, int i) {
    return release && i >= 2 && i <= 13 ? m->config.num_layers : 1;
}
// The optimizer id of slice l of tensor i.
static int optimizer_id(const GPT2 *m, int release, int i, int64_t l) {
    int64_t id = l;
    for (int k = 0; k < i; k++) if (m->param_sizes[k]) id += tensor_slices(m, release, k);
    return (int)id;
}
// Offset of tensor i in the parameter layout.
static int64_t param_offset(const GPT2 *m, int i) {
    int64_t off = 0;
    for (int k = 0; k < i; k++) off += m->param_sizes[k];
    return off;
}

// flash: the fp32 masters (bf16 weight + correction, decoded) of every tensor into out (host).
static int flash_export_masters(const GPT2 *m, const bnb8_optimizer *opt, int release, float *out) {
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        if (!m->param_sizes[i]) continue;
        int64_t slices = tensor_slices(m, release, i), n = m->param_sizes[i] / slices;
        for (int64_t l = 0; l < slices; l++)
            if (bnb8_optimizer_export_fp32(opt, optimizer_id(m, release, i, l), out + param_offset(m, i) + l * n))
                return train_fail("export of '%s': %s", param_names[i], bnb8_last_error());
    }
    return 0;
}
#define NUM_RECIPES ((int)(sizeof recipes / sizeof recipes[0]))

typedef struct {
    const char *name;
    bnb8_optim kind;
    float lr, weight_decay;    // defaults for this trainer (-l, -c override them)
} OptimizerChoice;
static const OptimizerChoice optimizers[] = {
    {"adamw", BNB8_ADAMW, 3e-3f, 0.1f},
    {"lion", BNB8_LION, 3e-4f, 1.0f},    // Lion: ~10x smaller lr, ~10x larger decay (its paper)
    {"sgd", BNB8_SGD, 0.3f, 0.0f},       // SGD with momentum 0.9; decay is L2 for SGD
};
#define NUM_OPTIMIZERS ((int)(sizeof optimizers / sizeof optimizers[0]))

static int find_recipe(const char *name) {
    for (int i = 0; i < NUM_RECIPES; i++) if (strcmp(recipes[i].name, name) == 0) return i;
    return -1;
}
static int find_optimizer(const char *name) {
    for (int i = 0; i < NUM_OPTIMIZERS; i++) if (strcmp(optimizers[i].name, name) == 0) return i;
    return -1;
}

// Where the optimizer finds tensor i: its weights and gradients, in host or device memory, of one
// dtype. On the CPU the model's fp32 arrays, or for flash its bf16 ones; on the GPU gpt2_cuda's.
// Under gradient release the per-layer gradients are one layer's slice, shared by every layer.
typedef struct {
    void *param[NUM_PARAM_TENSORS], *grad[NUM_PARAM_TENSORS];
    bnb8_dtype dtype;
    int release;
} Placement;

static int cpu_placement(GPT2 *m, int flash, Placement *pl) {
    if (flash && !m->params_bf16) {
        m->params_bf16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)m->num_parameters);
        m->grads_bf16 = (uint16_t *)calloc((size_t)m->num_parameters, sizeof(uint16_t));
        if (!m->params_bf16 || !m->grads_bf16)
            return train_fail("out of memory for the bf16 weights and gradients of %lld parameters", (long long)m->num_parameters);
    }
    memset(pl, 0, sizeof *pl);
    pl->dtype = flash ? BNB8_BF16 : BNB8_F32;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        if (!m->param_sizes[i]) continue;
        int64_t off = param_offset(m, i);
        pl->param[i] = flash ? (void *)(m->params_bf16 + off) : (void *)(m->params_memory + off);
        pl->grad[i] = flash ? (void *)(m->grads_bf16 + off) : m->grads_memory ? (void *)(m->grads_memory + off) : NULL;
    }
    return 0;
}

// Registers every parameter tensor where pl says. Biases and layernorm parameters get weight decay 0
// (per-name overrides); with StableEmbedding wte keeps 32-bit states, as bitsandbytes' StableEmbedding
// asks; a release slice takes its whole tensor's state format. flash: the weights become bf16 +
// correction of the fp32 weights in m->params_memory. state_bytes[i] receives each tensor's state
// memory, measured by the library's accounting.
static int optimizer_build(bnb8_optimizer **out, GPT2 *m, const Placement *pl, const Recipe *r,
                           const OptimizerChoice *oc, float lr, float weight_decay, int map, int64_t blocksize,
                           double state_bytes[NUM_PARAM_TENSORS]) {
    bnb8_config cfg = bnb8_config_default(oc->kind);
    cfg.lr = lr;
    cfg.weight_decay = weight_decay;
    cfg.format = r->format;
    if (r->format == BNB8_STATE_8BIT) { cfg.map = (bnb8_map)map; cfg.blocksize = blocksize; }
    if (oc->kind == BNB8_ADAMW) cfg.beta2 = 0.95f;   // GPT-2 practice (llm.c, nanoGPT)
    int flash = r->format == BNB8_STATE_FLASH;
    size_t es = bnb8_dtype_size(pl->dtype);
    bnb8_optimizer *opt = NULL;
    if (bnb8_optimizer_create(&opt, oc->kind, &cfg))
        return train_fail("optimizer: %s", bnb8_last_error());
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        state_bytes[i] = 0.0;
        if (m->param_sizes[i] == 0) continue;
        int stable_wte = i == 0 && m->config.stable_embedding;
        int64_t slices = tensor_slices(m, pl->release, i), n = m->param_sizes[i] / slices;
        for (int64_t l = 0; l < slices; l++) {
            char name[64];
            if (slices > 1) snprintf(name, sizeof name, "%s.%lld", param_names[i], (long long)l);
            else snprintf(name, sizeof name, "%s", param_names[i]);
            if (!param_is_matrix[i] || stable_wte || slices > 1) {
                bnb8_config o = cfg;
                if (!param_is_matrix[i]) o.weight_decay = 0.0f;
                if (stable_wte && flash) o.min_8bit_size = INT64_MAX;   // 32-bit states, bf16 + correction weights
                else if (stable_wte) o.format = BNB8_STATE_32BIT;
                if (slices > 1) o.min_8bit_size = m->param_sizes[i] >= cfg.min_8bit_size ? 0 : INT64_MAX;
                if (bnb8_optimizer_override(opt, name, &o)) goto fail;
            }
            double before = bnb8_optimizer_memory(opt, 0).states;
            int id = -1;
            char *param = (char *)pl->param[i] + es * (size_t)(l * n);
            // a tensor's gradients; under release, the one slice every layer's gradients pass through
            if (bnb8_optimizer_add(opt, name, param, pl->dtype, pl->grad[i], pl->dtype, n, &id)) goto fail;
            // flash: bf16 + correction of the fp32 weights
            if (flash && bnb8_optimizer_import_fp32(opt, id, m->params_memory + param_offset(m, i) + l * n)) goto fail;
            state_bytes[i] += bnb8_optimizer_memory(opt, 0).states - before;
        }
    }
    *out = opt;
    return 0;
fail:
    train_fail("optimizer: %s", bnb8_last_error());
    bnb8_optimizer_free(opt);
    return -1;
}

// ------------------------------------------------------------------------------------------------
// Settings (the command line) and results

typedef struct {
    const char *train_path, *val_path, *tokenizer_path;   // "" = none (val, tokenizer)
    const char *model;        // descriptor (d12, d4c128h4, ...) or an llm.c .bin checkpoint
    const char *out_dir;      // checkpoints go here; "" = none
    int64_t B, T, steps;
    int64_t accum;            // micro-batches of (B, T) per optimizer step (gradient accumulation)
    float lr;                 // <= 0: the optimizer's default
    float weight_decay;       // < 0: the optimizer's default
    int64_t warmup;           // linear warm-up steps, then cosine decay to final_lr_frac * lr
    float final_lr_frac;
    float grad_clip;          // global gradient norm clip (0 = off)
    const char *recipe, *optimizer;
    int map;                  // 8-bit states' map: BNB8_MAP_DYNAMIC or BNB8_MAP_LINEAR (ablation)
    int64_t blocksize;        // 8-bit block size, 64..4096, or 0: one absmax per tensor (ablation)
    int device;               // 0: the GPU when there is one, 1: the CPU, 2: the GPU
    int release;              // gradient release (GPU, flash): step each layer inside backward
    int recompute;            // GPU: keep each layer's output only, recompute the rest in backward
    int stable_embedding;     // 1 on, 0 off, -1 auto: on for descriptors, as the file says for .bin
    int64_t eval_every, val_batches, sample_every, gen_tokens, ckpt_every;
    int64_t stop_after;       // stop after this step (the schedule still spans `steps`); 0 = no
    uint64_t seed;
    int resume;
    int verbose;              // 0: print nothing (tests)
} TrainArgs;

typedef struct {
    float *losses;            // optional, (steps): train loss of step s at [s-1]; steps not run are left
    float *final_params;      // optional, (final_params_count): the weights at the end
    int64_t final_params_count;
    int64_t first_step, last_step;     // the steps this call ran
    float first_loss, last_loss, val_loss;
    double tokens_per_second;
    bnb8_memory memory;
    int64_t skipped_steps;    // steps whose gradient had a NaN or Inf: no update made
    int on_gpu;               // the run trained on the GPU
    double gpu_computed, gpu_measured;   // GPU: device bytes the report computes, and measures
} TrainResult;

// Tests only (NULL in the trainer): called after each backward pass, before the step, to inject
// faults into the gradients; the optimizer is there to observe.
static void (*train_after_backward)(GPT2 *m, bnb8_optimizer *opt, int64_t step);

#define DEFAULT_DATA_DIR "dev/data/fortunes/"

static void train_args_default(TrainArgs *a) {
    memset(a, 0, sizeof *a);
    a->train_path = DEFAULT_DATA_DIR "fortunes_train.bin";
    a->val_path = DEFAULT_DATA_DIR "fortunes_val.bin";
    a->tokenizer_path = DEFAULT_DATA_DIR "gpt2_tokenizer.bin";
    a->model = "d4c128h4";
    a->out_dir = "";
    a->B = 8; a->T = 64; a->steps = 150; a->accum = 1;
    a->lr = 0.0f; a->weight_decay = -1.0f;
    a->warmup = 10; a->final_lr_frac = 0.1f; a->grad_clip = 1.0f;
    a->recipe = "8bit"; a->optimizer = "adamw";
    a->map = BNB8_MAP_DYNAMIC; a->blocksize = 256;
    a->stable_embedding = -1;
    a->eval_every = 50; a->val_batches = 10; a->sample_every = 0; a->gen_tokens = 48; a->ckpt_every = 0;
    a->stop_after = 0; a->seed = 1337; a->resume = 0; a->verbose = 1;
}

// Learning rate of step s (1-based): linear warm-up, then cosine from lr to final_lr_frac * lr.
static float lr_schedule(const TrainArgs *a, float lr, int64_t s) {
    if (s <= a->warmup) return (float)((double)lr * (double)s / (double)a->warmup);
    double progress = a->steps > a->warmup ? (double)(s - a->warmup) / (double)(a->steps - a->warmup) : 1.0;
    double lo = (double)lr * a->final_lr_frac;
    return (float)(lo + 0.5 * (1.0 + cos(3.141592653589793 * progress)) * ((double)lr - lo));
}

// ------------------------------------------------------------------------------------------------
// Checkpoints: in out_dir, for step s: model_s.bin (llm.c fp32), optim_s.bin (bnb8 state file),
// state_s.bin (this trainer's: data position, RNG, settings) and DONE_s, written last. Each is
// written to a temporary file and renamed; resume takes the newest step that has its DONE.

#define STATE_MAGIC 20251122
#define STATE_VERSION 1
#define STATE_WORDS 16
typedef struct {
    int64_t step, position, B, T, recipe, optimizer, stable_embedding, steps;
    uint64_t rng, seed;
    int64_t release;          // the optimizer's tensors are per-layer slices (word 12; 0 in older files)
    int64_t accum;            // micro-batches per step (word 13; 0 in older files, meaning 1)
} TrainerState;

static int state_writer(FILE *f, const void *ctx) {
    const TrainerState *s = (const TrainerState *)ctx;
    int64_t w[STATE_WORDS] = {STATE_MAGIC, STATE_VERSION, s->step, s->position, (int64_t)s->rng, s->B, s->T,
                              s->recipe, s->optimizer, s->stable_embedding, (int64_t)s->seed, s->steps, s->release,
                              s->accum};
    return fwrite(w, sizeof w, 1, f) == 1 ? 0 : -1;
}

static int state_load(TrainerState *s, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return train_fail("cannot open trainer state file %s: %s", path, strerror(errno));
    int64_t w[STATE_WORDS], size;
    int status = file_size_of(f, path, &size);
    if (!status && size != (int64_t)sizeof w)
        status = train_fail("%s: %s trainer state file: %lld bytes, expected %zu", path,
                            size < (int64_t)sizeof w ? "truncated" : "oversized", (long long)size, sizeof w);
    if (!status && fread(w, sizeof w, 1, f) != 1) status = train_fail("%s: read failed", path);
    fclose(f);
    if (!status && w[0] != STATE_MAGIC) status = train_fail("%s: not a trainer state file (magic %lld)", path, (long long)w[0]);
    if (!status && w[1] != STATE_VERSION) status = train_fail("%s: trainer state version %lld, expected %d", path, (long long)w[1], STATE_VERSION);
    if (status) return status;
    s->step = w[2]; s->position = w[3]; s->rng = (uint64_t)w[4]; s->B = w[5]; s->T = w[6]; s->recipe = w[7];
    s->optimizer = w[8]; s->stable_embedding = w[9]; s->seed = (uint64_t)w[10]; s->steps = w[11]; s->release = w[12];
    s->accum = w[13] == 0 ? 1 : w[13];
    if (s->step < 1 || s->position < 0 || s->B < 1 || s->T < 1 || s->recipe < 0 || s->recipe >= NUM_RECIPES ||
        s->optimizer < 0 || s->optimizer >= NUM_OPTIMIZERS || (s->release != 0 && s->release != 1) || s->accum < 1)
        return train_fail("%s: inconsistent trainer state (step %lld, position %lld, B %lld, T %lld)", path,
                          (long long)s->step, (long long)s->position, (long long)s->B, (long long)s->T);
    return 0;
}

static int empty_writer(FILE *f, const void *ctx) { (void)f; (void)ctx; return 0; }

static void checkpoint_path(char *buf, size_t size, const char *dir, const char *kind, int64_t step, const char *ext) {
    snprintf(buf, size, "%s/%s_%08lld%s", dir, kind, (long long)step, ext);
}

static int checkpoint_save(const char *dir, const GPT2 *m, bnb8_optimizer *opt, const TrainerState *s) {
    char path[1024], where[160];
    // Weights that are no longer finite are never saved: the newest checkpoint stays a good one.
    if (params_nonfinite(m, where, sizeof where))
        return train_fail("step %lld: the weights are not finite (%s): checkpoint not written; the newest complete "
                          "checkpoint in %s is the last good one", (long long)s->step, where, dir);
    static const char *kinds[3] = {"model", "optim", "state"};
    int status = 0;
    checkpoint_path(path, sizeof path, dir, "model", s->step, ".bin");
    if (gpt2_save(m, path, 0)) status = -1;
    checkpoint_path(path, sizeof path, dir, "optim", s->step, ".bin");
    if (!status && bnb8_optimizer_save(opt, path)) status = train_fail("%s", bnb8_last_error());
    checkpoint_path(path, sizeof path, dir, "state", s->step, ".bin");
    if (!status) status = write_atomically(path, state_writer, s);
    checkpoint_path(path, sizeof path, dir, "DONE", s->step, "");
    if (!status) status = write_atomically(path, empty_writer, NULL);
    if (status)    // no DONE: the files of this step are useless; a full disk gets their space back
        for (int k = 0; k < 3; k++) { checkpoint_path(path, sizeof path, dir, kinds[k], s->step, ".bin"); remove(path); }
    return status;
}

// The newest step in dir with a DONE marker, or 0.
static int64_t checkpoint_latest(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int64_t best = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *n = e->d_name;
        if (strncmp(n, "DONE_", 5) != 0 || strlen(n) != 13) continue;
        int64_t v = 0, ok = 1;
        for (int i = 5; i < 13; i++) { if (n[i] < '0' || n[i] > '9') ok = 0; v = 10 * v + (n[i] - '0'); }
        if (ok && v > best) best = v;
    }
    closedir(d);
    return best;
}

static int ensure_dir(const char *dir) {
    struct stat st;
    if (stat(dir, &st) == 0) return S_ISDIR(st.st_mode) ? 0 : train_fail("output path %s is not a directory", dir);
    if (mkdir(dir, 0755) != 0) return train_fail("cannot create output directory %s: %s", dir, strerror(errno));
    return 0;
}

// ------------------------------------------------------------------------------------------------
// The GPU: gpt2_cuda.cu's model (the same tensors in the same layout), bnb8's optimizer on the
// device, and gradient release. Linked in the TRAIN_CUDA build; in the CPU-only build the gpt2_cuda
// functions are weak and NULL, so gpu_open says the GPU is not available and the run stays on the CPU.

#ifndef TRAIN_CUDA
#pragma weak gpt2_cuda_last_error
#pragma weak gpt2_cuda_device
#pragma weak gpt2_cuda_create
#pragma weak gpt2_cuda_free
#pragma weak gpt2_cuda_stream
#pragma weak gpt2_cuda_param_tensor
#pragma weak gpt2_cuda_set_params
#pragma weak gpt2_cuda_get_params
#pragma weak gpt2_cuda_forward
#pragma weak gpt2_cuda_loss
#pragma weak gpt2_cuda_get_logits
#pragma weak gpt2_cuda_backward
#pragma weak gpt2_cuda_grad_norm
#pragma weak gpt2_cuda_grads_alloc
#pragma weak gpt2_cuda_grads_free
#pragma weak gpt2_cuda_param_bytes
#pragma weak gpt2_cuda_act_bytes
#pragma weak gpt2_cuda_num_act_tensors
#pragma weak gpt2_cuda_act_name
#pragma weak gpt2_cuda_act_tensor_bytes
#define gpu_linked() (gpt2_cuda_device != NULL)
#else
#define gpu_linked() 1
#endif

typedef struct {
    GPT2Cuda *model;             // NULL: the run is on the CPU
    GPT2CudaGrads grads;         // device: every gradient, or under release the release layout
    size_t grads_bytes;
    int flash, release;
    char name[128];              // the GPU's
    size_t total_bytes;          // its memory
    size_t used_before;          // in use before this run allocated anything (cudaMemGetInfo)
    size_t used_peak;            // the most in use at the end of a step since
    float *logits;               // (Vp) host: one row of logits, for sampling
    // what the grads_ready callback needs under release
    const GPT2 *host;
    bnb8_optimizer *opt;
    float lr;
} Gpu;

// Is there a GPU this build can train on?
static int gpu_available(void) {
    return gpu_linked() && gpt2_cuda_device(NULL, 0, NULL, NULL) == 0;
}

static void gpu_close(Gpu *g) {
    if (g->model) { gpt2_cuda_grads_free(&g->grads); gpt2_cuda_free(g->model); }
    free(g->logits);
    memset(g, 0, sizeof *g);
}

// The model on the GPU from m's fp32 weights (host), bf16 for flash (bf16 gradients, so flash holds
// 2 + 1 + 2 + 2.125 bytes per parameter), fp32 for the fp32 and 8bit recipes (fp32 gradients).
static int gpu_open(Gpu *g, GPT2 *m, int flash, int release, int recompute, int64_t B, int64_t T) {
    memset(g, 0, sizeof *g);
    size_t free_bytes = 0;
    if (!gpu_linked()) return train_fail("this trainer was built without the GPU model (make on a machine with nvcc)");
    if (gpt2_cuda_device(g->name, sizeof g->name, &free_bytes, &g->total_bytes))
        return train_fail("GPU: %s", gpt2_cuda_last_error());
    g->used_before = g->used_peak = g->total_bytes - free_bytes;
    g->flash = flash;
    g->release = release;
    const GPT2Config *c = &m->config;
    GPT2CudaConfig gc = {c->max_seq_len, c->vocab_size, c->padded_vocab_size, c->num_layers, c->num_heads,
                         c->channels, c->stable_embedding, recompute};
    int precision = flash ? GPT2_CUDA_BF16 : GPT2_CUDA_FP32;
    g->logits = (float *)malloc(sizeof(float) * (size_t)c->padded_vocab_size);
    if (!g->logits) return train_fail("out of memory");
    if (gpt2_cuda_create(&g->model, &gc, precision, (int)B, (int)T) || gpt2_cuda_set_params(g->model, m->params_memory) ||
        gpt2_cuda_grads_alloc(g->model, &g->grads, precision, release, &g->grads_bytes)) {
        train_fail("GPU model: %s", gpt2_cuda_last_error());
        gpu_close(g);
        return -1;
    }
    m->batch_size = B;
    m->seq_len = T;
    return 0;
}

static void gpu_placement(Gpu *g, const GPT2 *m, Placement *pl) {
    memset(pl, 0, sizeof *pl);
    pl->dtype = g->flash ? BNB8_BF16 : BNB8_F32;
    pl->release = g->release;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++)
        if (m->param_sizes[i]) { pl->param[i] = gpt2_cuda_param_tensor(g->model, i); pl->grad[i] = g->grads.tensor[i]; }
}

// Device memory in use now, kept as the peak when it is the most so far.
static void gpu_note_memory(Gpu *g) {
    size_t free_bytes = 0, total = 0;
    if (gpt2_cuda_device(NULL, 0, &free_bytes, &total) == 0 && total - free_bytes > g->used_peak) g->used_peak = total - free_bytes;
}

// Gradient release: backward calls this as each group's gradients become final (the final
// LayerNorm, then layer L-1 .. 0, then the embeddings); their tensors are stepped right there, on
// the model's stream, before backward overwrites the shared slices with the next layer's.
static int gpu_grads_ready(void *ctx, int which, struct CUstream_st *stream) {
    Gpu *g = (Gpu *)ctx;
    const GPT2 *m = g->host;
    static const int lnf[] = {14, 15}, embed[] = {0, 1, 16, 17};
    int ids[NUM_PARAM_TENSORS], count = 0;
    if (which >= 0) {
        for (int i = 2; i <= 13; i++) ids[count++] = optimizer_id(m, 1, i, which);
    } else {
        const int *list = which == GPT2_CUDA_GRADS_LNF ? lnf : embed;
        int k = which == GPT2_CUDA_GRADS_LNF ? 2 : 4;
        for (int j = 0; j < k; j++) if (m->param_sizes[list[j]]) ids[count++] = optimizer_id(m, 1, list[j], 0);
    }
    return bnb8_optimizer_step_tensors(g->opt, ids, count, g->lr, 1.0f, stream) ? 1 : 0;
}

// gnorm_scale of a step whose gradients are the sum of accum micro-batches' mean gradients, norm
// the norm of their mean: the mean, clipped at clip (0 = off).
static float step_scale(double norm, float clip, int64_t accum) {
    float scale = clip > 0.0f && norm > clip ? (float)(clip / norm) : 1.0f;
    return scale / (float)accum;
}

// The gradients of one micro-batch: overwritten (accumulate 0) or added to (1); with release each
// layer is stepped inside backward (at lr). Waits for the loss.
static int gpu_forward_backward(Gpu *g, const GPT2 *m, bnb8_optimizer *opt, const int *inputs, const int *targets,
                                int64_t B, int64_t T, int accumulate, float lr, float *loss) {
    g->host = m; g->opt = opt; g->lr = lr;
    if (gpt2_cuda_forward(g->model, inputs, targets, (int)B, (int)T, 1) ||
        gpt2_cuda_backward(g->model, &g->grads, accumulate, g->release ? gpu_grads_ready : NULL, g))
        return train_fail("GPU step: %s%s%s", gpt2_cuda_last_error(), g->release ? "; optimizer: " : "",
                          g->release ? bnb8_last_error() : "");
    if (gpt2_cuda_loss(g->model, loss, NULL)) return train_fail("GPU loss: %s", gpt2_cuda_last_error());
    return 0;
}

// The optimizer step on gradients summed over accum micro-batches. *norm: their mean's norm (NAN
// under release, where the layers were stepped in backward and no global norm is formed); *skipped:
// 1 when it was not finite and nothing was updated. Then the device memory in use, once per step.
static int gpu_optimizer_step(Gpu *g, bnb8_optimizer *opt, float lr, float clip, int64_t accum, double *norm,
                              int *skipped) {
    *norm = NAN;
    *skipped = 0;
    if (!g->release) {
        if (gpt2_cuda_grad_norm(g->model, &g->grads, norm)) return train_fail("GPU gradient norm: %s", gpt2_cuda_last_error());
        *norm /= (double)accum;
        *skipped = !isfinite(*norm);
        if (!*skipped && bnb8_optimizer_step(opt, lr, step_scale(*norm, clip, accum), gpt2_cuda_stream(g->model)))
            return train_fail("optimizer step: %s", bnb8_last_error());
    }
    gpu_note_memory(g);
    return 0;
}

// Mean loss of one batch (no backward).
static int gpu_loss(Gpu *g, const int *inputs, const int *targets, int64_t B, int64_t T, float *loss) {
    if (gpt2_cuda_forward(g->model, inputs, targets, (int)B, (int)T, 0) || gpt2_cuda_loss(g->model, loss, NULL))
        return train_fail("GPU forward: %s", gpt2_cuda_last_error());
    return 0;
}

// The logits after tokens[0..t-1] (one sequence), into g->logits.
static int gpu_next_logits(Gpu *g, const int *tokens, int64_t t) {
    if (gpt2_cuda_forward(g->model, tokens, NULL, 1, (int)t, 0) || gpt2_cuda_get_logits(g->model, g->logits, t - 1, 1))
        return train_fail("GPU forward: %s", gpt2_cuda_last_error());
    return 0;
}

// The weights as fp32 into m->params_memory (host), for checkpoints and results: the masters
// (weight + correction) for flash, the weights themselves otherwise.
static int gpu_fetch_weights(Gpu *g, GPT2 *m, const bnb8_optimizer *opt) {
    if (g->flash) return flash_export_masters(m, opt, g->release, m->params_memory);
    if (gpt2_cuda_get_params(g->model, m->params_memory)) return train_fail("GPU weights: %s", gpt2_cuda_last_error());
    return 0;
}

// ------------------------------------------------------------------------------------------------
// Evaluation and sampling

// Mean loss over the first val_batches batches of the file (all of them if fewer); NAN on a GPU error.
static float evaluate(GPT2 *m, Gpu *gpu, const TokenFile *val, int64_t B, int64_t T, int64_t max_batches) {
    int64_t n = (val->count - 1) / (B * T);
    if (max_batches > 0 && n > max_batches) n = max_batches;
    int *inputs = (int *)malloc(sizeof(int) * (size_t)(2 * B * T)), *targets = inputs + B * T;
    if (!inputs) return NAN;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *p = val->tokens + i * B * T;
        for (int64_t j = 0; j < B * T; j++) { inputs[j] = p[j]; targets[j] = p[j + 1]; }
        float loss = NAN;
        if (gpu && gpu->model) { if (gpu_loss(gpu, inputs, targets, B, T, &loss)) break; }
        else loss = gpt2_forward(m, inputs, targets, B, T);
        sum += loss;
    }
    free(inputs);
    return n > 0 ? (float)(sum / (double)n) : NAN;
}

// Generates up to gen_tokens tokens after an end-of-text (at most T in all); only the last
// position's logits are computed. Returns the number of tokens in out (out[0] is the start), or -1
// on a GPU error.
static int64_t generate(GPT2 *m, Gpu *gpu, Rng *rng, int eot, int64_t gen_tokens, int *out) {
    const GPT2Config *c = &m->config;
    int64_t n = gen_tokens + 1 < m->seq_len ? gen_tokens + 1 : m->seq_len;
    int64_t C = c->channels, V = c->vocab_size, Vp = c->padded_vocab_size;
    int on_gpu = gpu && gpu->model;
    float *logits = on_gpu ? gpu->logits : m->acts.logits;   // (Vp)
    out[0] = eot;
    for (int64_t t = 1; t < n; t++) {
        if (on_gpu) {
            if (gpu_next_logits(gpu, out, t)) return -1;
        } else {
            gpt2_forward_body(m, out, 1, t);
            matmul_forward(logits, m->acts.lnf + (t - 1) * C, m->params.wte, NULL, 1, C, Vp);
        }
        softmax_forward(logits, NULL, NULL, 1, V, Vp);
        float u = rng_uniform(rng), cdf = 0.0f;
        int next = (int)V - 1;
        for (int64_t i = 0; i < V; i++) { cdf += logits[i]; if (u < cdf) { next = (int)i; break; } }
        out[t] = next;
    }
    return n;
}

static void print_sample(GPT2 *m, Gpu *gpu, Rng *rng, const Tokenizer *tok, int64_t gen_tokens) {
    int *ids = (int *)malloc(sizeof(int) * (size_t)m->seq_len);
    if (!ids) return;
    int eot = tok->data ? tok->eot : m->config.vocab_size - 1;
    int64_t n = generate(m, gpu, rng, eot, gen_tokens, ids);
    if (n < 0) printf("---- no sample: %s\n", train_error_text);
    else printf("---- sample (%lld tokens) ----\n", (long long)(n - 1));
    for (int64_t i = 1; i < n; i++) {
        if (tok->data) tokenizer_print(tok, ids[i], stdout);
        else printf("%d ", ids[i]);
    }
    printf("\n------------------------------\n");
    free(ids);
}

// ------------------------------------------------------------------------------------------------
// The report (SPEC §8)

static void print_bytes(double b) {
    if (b >= 1e9) printf("%9.2f GB", b / 1e9);
    else if (b >= 1e6) printf("%9.2f MB", b / 1e6);
    else if (b >= 1e3) printf("%9.2f kB", b / 1e3);
    else printf("%9.0f B ", b);
}

// Peak resident memory of the process (Linux /proc), or -1.
static double peak_resident_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1.0;
    char line[256];
    double kb = -1.0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0) kb = atof(line + 6);
    fclose(f);
    return kb < 0 ? -1.0 : kb * 1024.0;
}

// Device memory of a GPU run by the accounting: weights, correction, gradients (or the release
// scratch), optimizer states, activations (with every scratch buffer and cuBLASLt's workspace).
static double gpu_bytes_computed(const Gpu *g, bnb8_optimizer *opt) {
    bnb8_memory mem = bnb8_optimizer_memory(opt, 0);
    return mem.weights + mem.correction + (double)g->grads_bytes + mem.states + (double)gpt2_cuda_act_bytes(g->model);
}

static void print_memory(const GPT2 *m, const Gpu *gpu, bnb8_optimizer *opt, const double state_bytes[NUM_PARAM_TENSORS],
                         const Recipe *r) {
    int flash = r->format == BNB8_STATE_FLASH, on_gpu = gpu && gpu->model, release = on_gpu && gpu->release;
    bnb8_memory mem = bnb8_optimizer_memory(opt, !release);
    double es = flash ? 2.0 : 4.0, cs = flash ? 1.0 : 0.0;   // bytes per element: weights/gradients, correction
    if (on_gpu) printf("memory: every buffer on the GPU (%s, %.1f GB)\n", gpu->name, (double)gpu->total_bytes / 1e9);
    printf("memory: %s; optimizer states as the library holds them%s\n",
           flash ? "weights bf16 + int8 correction, gradients bf16" : "weights and gradients fp32",
           release ? "; gradient release: one layer's gradient slices, reused" : "");
    printf("  %-10s %-11s %13s %12s %12s %12s %12s %s\n", "parameter", "shape", "elements", "weights", "correction",
           "gradients", "opt. state", " state B/elem");
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        if (!m->param_sizes[i]) continue;
        double n = (double)m->param_sizes[i];
        printf("  %-10s %-11s %13lld ", param_names[i], param_shapes[i], (long long)m->param_sizes[i]);
        print_bytes(es * n); printf("  "); print_bytes(cs * n); printf("  ");
        print_bytes(es * n / (double)tensor_slices(m, release, i)); printf("  ");
        print_bytes(state_bytes[i]);
        printf("  %6.3f\n", state_bytes[i] / n);
    }
    printf("  %-10s %-11s %13lld ", "total", "", (long long)mem.params);
    print_bytes(mem.weights); printf("  "); print_bytes(mem.correction); printf("  ");
    print_bytes(release ? (double)gpu->grads_bytes : mem.gradients); printf("  "); print_bytes(mem.states);
    if (flash && !on_gpu) {
        printf("\n  fp32 working copies, not persistent (the CPU model computes in fp32):\n");
        printf("    %-34s ", "weights (the bf16 weights widened)"); print_bytes(4.0 * (double)m->num_parameters);
        printf("\n    %-34s ", "gradients (before rounding to bf16)"); print_bytes(4.0 * (double)m->num_parameters);
    }
    double acts = 0.0;
    printf("\n  activations (B=%lld, T=%lld), one allocation:\n", (long long)m->batch_size, (long long)m->seq_len);
    if (on_gpu) {
        for (int i = 0; i < gpt2_cuda_num_act_tensors(); i++) {
            double b = (double)gpt2_cuda_act_tensor_bytes(gpu->model, i);
            if (b == 0.0) continue;
            printf("    %-18s ", gpt2_cuda_act_name(i)); print_bytes(b); printf("\n");
        }
        acts = (double)gpt2_cuda_act_bytes(gpu->model);
    } else {
        for (int i = 0; i < NUM_ACT_TENSORS; i++) {
            if (!m->act_sizes[i]) continue;
            printf("    %-18s %13lld ", act_names[i], (long long)m->act_sizes[i]);
            print_bytes(4.0 * (double)m->act_sizes[i]);
            printf("\n");
        }
        acts = 4.0 * (double)m->num_activations;
        printf("    %-18s %13lld ", "total", (long long)m->num_activations);
    }
    if (on_gpu) printf("    %-18s ", "total");
    print_bytes(acts);
    double P = (double)mem.params;
    printf("\n  persistent bytes per parameter (recipe %s%s, from bnb8_optimizer_memory):\n", r->name,
           release ? " + gradient release" : "");
    printf("    weights %.3f + master correction %.3f + gradients %.3f + optimizer state %.3f = %.3f\n",
           mem.weights / P, mem.correction / P, mem.gradients / P, mem.states / P,
           (mem.weights + mem.correction + mem.gradients + mem.states) / P);
    if (release)
        printf("    gradient scratch under release (wte, wpe, final and StableEmbedding layernorms in full, one layer's\n"
               "    slices of the rest): %.3f bytes per parameter\n", (double)gpu->grads_bytes / P);
    if (flash && !on_gpu) printf("    working copies: %.3f bytes per parameter (fp32 weights and gradients for the CPU model)\n", 8.0);
    printf("    activations: %.3f bytes per parameter at this batch size\n", acts / P);
    if (on_gpu) {
        double computed = gpu_bytes_computed(gpu, opt);
        double measured = (double)(gpu->used_peak - gpu->used_before);
        printf("  device memory: computed (weights + correction + gradients + states + activations) ");
        print_bytes(computed);
        printf("\n                 measured (cudaMemGetInfo, most in use after a step, minus before the run) ");
        print_bytes(measured);
        if (measured > 0) printf("  (%+.1f%%)", 100.0 * (measured - computed) / computed);
        printf("\n");
    }
}

// ------------------------------------------------------------------------------------------------
// Training

static double grad_norm(const GPT2 *m) {
    // Fixed chunks summed in double, then in order: the same bits for any number of threads.
    const int64_t CHUNK = 1 << 16;
    int64_t n = m->num_parameters, nchunks = (n + CHUNK - 1) / CHUNK;
    double *partial = (double *)malloc(sizeof(double) * (size_t)nchunks);
    if (!partial) return NAN;
    #pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < nchunks; k++) {
        int64_t e = (k + 1) * CHUNK < n ? (k + 1) * CHUNK : n;
        double s = 0.0;
        for (int64_t i = k * CHUNK; i < e; i++) s += (double)m->grads_memory[i] * m->grads_memory[i];
        partial[k] = s;
    }
    double total = 0.0;
    for (int64_t k = 0; k < nchunks; k++) total += partial[k];
    free(partial);
    return sqrt(total);
}

static int train_run(const TrainArgs *a, TrainResult *res) {
    GPT2 model = {0};
    Gpu gpu = {0};
    TokenFile train_file = {0}, val_file = {0};
    Tokenizer tok = {0};
    DataLoader loader = {0};
    bnb8_optimizer *opt = NULL;
    double state_bytes[NUM_PARAM_TENSORS] = {0};
    int status = -1, have_val = a->val_path && a->val_path[0];
    int has_out = a->out_dir && a->out_dir[0];
    int ri = find_recipe(a->recipe), oi = find_optimizer(a->optimizer);
    TrainResult dummy = {0};
    if (!res) res = &dummy;
    res->first_step = res->last_step = res->skipped_steps = 0;
    res->first_loss = res->last_loss = res->val_loss = NAN;
    res->tokens_per_second = 0.0;
    res->on_gpu = 0;

    if (ri < 0) { train_fail("unknown recipe '%s' (fp32, 8bit, flash)", a->recipe); goto done; }
    if (oi < 0) { train_fail("unknown optimizer '%s' (adamw, lion, sgd)", a->optimizer); goto done; }
    if (a->B < 1 || a->T < 1 || a->steps < 1 || a->accum < 1 || a->warmup < 0 || a->stop_after < 0 || a->eval_every < 0 ||
        a->sample_every < 0 || a->ckpt_every < 0 || a->gen_tokens < 0 || !(a->grad_clip >= 0.0f) ||
        !(a->final_lr_frac >= 0.0f && a->final_lr_frac <= 1.0f) || a->device < 0 || a->device > 2 ||
        a->release < 0 || a->release > 1 || a->recompute < 0 || a->recompute > 1 || a->map < 0 || a->map >= BNB8_NUM_MAPS || a->blocksize < 0) {
        train_fail("bad settings: B, T and steps must be >= 1, the others >= 0, final lr fraction in [0, 1]");
        goto done;
    }
    if ((a->resume || a->ckpt_every) && !has_out) {
        train_fail("checkpoints and resume need an output directory (-o)");
        goto done;
    }
    const Recipe *recipe = &recipes[ri];
    const OptimizerChoice *oc = &optimizers[oi];
    float lr = a->lr > 0.0f ? a->lr : oc->lr, wd = a->weight_decay >= 0.0f ? a->weight_decay : oc->weight_decay;
    int flash = recipe->format == BNB8_STATE_FLASH;
    int on_gpu = a->device == 2 || (a->device == 0 && gpu_available());
    if ((a->map != BNB8_MAP_DYNAMIC || a->blocksize != 256) && strcmp(a->recipe, "8bit") != 0) {
        train_fail("-M and -K set the 8-bit states' map and block size: they need -r 8bit");
        goto done;
    }
    if (a->recompute && !on_gpu) {
        train_fail("activation recomputation (-C 1) is for the GPU model (-D gpu); the CPU model keeps every activation");
        goto done;
    }
    if (a->release) {   // each layer is stepped inside backward: no global norm exists before its step
        const char *why = !on_gpu ? "runs on the GPU only (-D 2)" : !flash ? "is for the flash recipe (-r flash)"
                        : a->grad_clip > 0.0f ? "steps each layer inside backward, before a global gradient norm "
                                                "exists: turn clipping off (-g 0)"
                        : a->accum > 1 ? "steps each layer inside backward, so gradients cannot accumulate over "
                                         "micro-batches: use -A 1" : NULL;
        if (why) { train_fail("gradient release (-R 1) %s", why); goto done; }
    }

    // The model: from the newest complete checkpoint when resuming, else from -e.
    int64_t start = 0;
    TrainerState st = {0};
    if (has_out && ensure_dir(a->out_dir)) goto done;
    if (a->resume) {
        start = checkpoint_latest(a->out_dir);
        if (start == 0 && a->verbose) printf("note: no complete checkpoint in %s: starting from step 0\n", a->out_dir);
    }
    char path[1024], model_path[1024];
    snprintf(model_path, sizeof model_path, "%s", a->model);
    if (start > 0) {
        checkpoint_path(path, sizeof path, a->out_dir, "state", start, ".bin");
        if (state_load(&st, path)) goto done;
        if (st.step != start || st.B != a->B || st.T != a->T || st.recipe != ri || st.optimizer != oi ||
            st.release != a->release || st.accum != a->accum) {
            train_fail("%s: the checkpoint was made with step %lld, B=%lld, T=%lld, A=%lld, recipe %s, optimizer %s, "
                       "release %lld; this run asks for B=%lld, T=%lld, A=%lld, recipe %s, optimizer %s, release %d", path,
                       (long long)st.step, (long long)st.B, (long long)st.T, (long long)st.accum, recipes[st.recipe].name,
                       optimizers[st.optimizer].name, (long long)st.release, (long long)a->B, (long long)a->T,
                       (long long)a->accum, recipe->name, oc->name, a->release);
            goto done;
        }
        checkpoint_path(model_path, sizeof model_path, a->out_dir, "model", start, ".bin");
        if (gpt2_load(&model, model_path)) goto done;
    } else {
        size_t len = strlen(a->model);
        if (len > 4 && strcmp(a->model + len - 4, ".bin") == 0) {
            if (gpt2_load(&model, a->model)) goto done;
            if (a->stable_embedding >= 0 && a->stable_embedding != model.config.stable_embedding) {
                train_fail("%s was made %s StableEmbedding; -w %d cannot change that (leave -w out)", a->model,
                           model.config.stable_embedding ? "with" : "without", a->stable_embedding);
                goto done;
            }
        } else {
            GPT2Config c;
            if (config_from_descriptor(&c, a->model)) goto done;
            c.stable_embedding = a->stable_embedding != 0;
            if (gpt2_init_random(&model, &c, a->seed)) goto done;
        }
    }
    const GPT2Config *cfg = &model.config;
    if (a->T > cfg->max_seq_len) {
        train_fail("sequence length T=%lld exceeds the model's maxT=%d", (long long)a->T, cfg->max_seq_len);
        goto done;
    }
    if (start >= a->steps) {
        train_fail("%s: the checkpoint is at step %lld, not before the last step %lld (raise -n)", a->out_dir,
                   (long long)start, (long long)a->steps);
        goto done;
    }

    // Data and tokenizer
    if (tokens_load(&train_file, a->train_path) || tokens_check_vocab(&train_file, cfg->vocab_size)) goto done;
    if (have_val && (tokens_load(&val_file, a->val_path) || tokens_check_vocab(&val_file, cfg->vocab_size))) goto done;
    if (have_val && val_file.count < a->B * a->T + 1) {
        train_fail("%s has %lld tokens, fewer than one batch needs (B*T+1 = %lld)", val_file.path,
                   (long long)val_file.count, (long long)(a->B * a->T + 1));
        goto done;
    }
    if (a->tokenizer_path && a->tokenizer_path[0]) {
        if (tokenizer_load(&tok, a->tokenizer_path)) goto done;
        if (tok.vocab_size != cfg->vocab_size) {
            if (a->verbose)
                printf("note: %s has %d tokens, the model %d: samples are printed as ids\n", a->tokenizer_path,
                       tok.vocab_size, cfg->vocab_size);
            tokenizer_free(&tok);
        }
    }

    // The model's device, where the optimizer finds each tensor, the optimizer.
    Placement place;
    if (loader_init(&loader, &train_file, a->B, a->T)) goto done;
    if (on_gpu) {
        if (gpu_open(&gpu, &model, flash, a->release, a->recompute, a->B, a->T)) goto done;
        gpu_placement(&gpu, &model, &place);
    } else if (gpt2_alloc_acts(&model, a->B, a->T) || cpu_placement(&model, flash, &place)) goto done;
    if (optimizer_build(&opt, &model, &place, recipe, oc, lr, wd, a->map, a->blocksize, state_bytes)) goto done;

    Rng rng = {a->seed};
    if (start > 0) {
        checkpoint_path(path, sizeof path, a->out_dir, "optim", start, ".bin");
        if (bnb8_optimizer_load(opt, path)) { train_fail("%s", bnb8_last_error()); goto done; }
        if (st.position > train_file.count) {
            train_fail("%s: data position %lld is past the end of %s", a->out_dir, (long long)st.position, train_file.path);
            goto done;
        }
        loader.position = st.position;
        rng.s = st.rng;
    }
    // flash: the optimizer's bf16 weights are the truth (a checkpoint's file holds them exactly;
    // importing its fp32 masters alone may move a few by a bf16 ulp); the CPU's working copy follows.
    if (flash && !on_gpu) flash_weights_to_fp32(&model);

    int64_t end = a->steps;
    if (a->stop_after > 0 && a->stop_after < end) end = a->stop_after;
    if (a->verbose) {
        if (on_gpu) printf("bnb8 train_gpt2_8bit: GPU %s (%s model)\n", gpu.name, flash ? "bf16" : "fp32");
        else {
#ifdef _OPENMP
            int threads = omp_get_max_threads();
#else
            int threads = 1;
#endif
            printf("bnb8 train_gpt2_8bit: CPU, %d OpenMP threads\n", threads);
        }
        printf("model    %s: L=%d C=%d NH=%d V=%d (padded %d) maxT=%d, %lld parameters, StableEmbedding %s\n",
               model_path, cfg->num_layers, cfg->channels, cfg->num_heads, cfg->vocab_size,
               cfg->padded_vocab_size, cfg->max_seq_len, (long long)model.num_parameters,
               cfg->stable_embedding ? "on" : "off");
        printf("data     %s (%lld tokens), val %s (%lld tokens)\n", train_file.path, (long long)train_file.count,
               have_val ? val_file.path : "none", (long long)val_file.count);
        printf("recipe   %s: %s%s", recipe->name, recipe->about, a->release ? "; gradient release" : "");
        if (recipe->format == BNB8_STATE_8BIT && a->blocksize) printf(" (%s map, blocks of %lld)",
                   a->map == BNB8_MAP_LINEAR ? "linear" : "dynamic", (long long)a->blocksize);
        if (recipe->format == BNB8_STATE_8BIT && !a->blocksize) printf(" (%s map, one absmax per tensor)",
                   a->map == BNB8_MAP_LINEAR ? "linear" : "dynamic");
        printf("\n");
        printf("optim    %s, lr %.3g (warm-up %lld, cosine to %.3g), weight decay %.3g on matrices, clip %.3g\n",
               oc->name, (double)lr, (long long)a->warmup, (double)(lr * a->final_lr_frac), (double)wd,
               (double)a->grad_clip);
        char micro[64] = "";
        if (a->accum > 1) snprintf(micro, sizeof micro, ", %lld micro-batches per step", (long long)a->accum);
        printf("train    B=%lld T=%lld%s, steps %lld..%lld of %lld%s\n", (long long)a->B, (long long)a->T, micro,
               (long long)start + 1, (long long)end, (long long)a->steps, start > 0 ? " (resumed)" : "");
        print_memory(&model, &gpu, opt, state_bytes, recipe);
        fflush(stdout);
    }

    float val_first = NAN, val_last = NAN;
    if (have_val && a->eval_every > 0 && start == 0) {
        val_first = val_last = evaluate(&model, &gpu, &val_file, a->B, a->T, a->val_batches);
        if (a->verbose) printf("step %5d | val loss %.4f\n", 0, (double)val_first);
    }
    double train_time = 0.0;
    int64_t trained = 0;
    float first_loss = NAN, last_loss = NAN;
    for (int64_t s = start + 1; s <= end; s++) {
        double t0 = now_seconds();
        float step_lr = lr_schedule(a, lr, s), loss = 0.0f;
        double norm = NAN;
        int skipped = 0;
        // A micro-batches: their gradients add up (A times the mean gradient), the loss is their mean
        for (int64_t micro = 0; micro < a->accum; micro++) {
            loader_next(&loader);
            float micro_loss = NAN;
            if (on_gpu) {
                if (gpu_forward_backward(&gpu, &model, opt, loader.inputs, loader.targets, a->B, a->T, micro > 0,
                                         step_lr, &micro_loss)) goto done;
            } else {
                micro_loss = gpt2_forward(&model, loader.inputs, loader.targets, a->B, a->T);
                if (micro == 0) gpt2_zero_grad(&model);
                gpt2_backward(&model);   // adds to the gradients
            }
            loss += micro_loss / (float)a->accum;
        }
        if (on_gpu) {
            if (gpu_optimizer_step(&gpu, opt, step_lr, a->grad_clip, a->accum, &norm, &skipped)) goto done;
        } else {
            if (train_after_backward) train_after_backward(&model, opt, s);
            norm = grad_norm(&model) / (double)a->accum;
            skipped = !isfinite(norm);
            if (!skipped) {
                float scale = step_scale(norm, a->grad_clip, a->accum);
                if (flash) flash_grads_to_bf16(&model);   // the norm is the fp32 gradients'
                if (bnb8_optimizer_step(opt, step_lr, scale, NULL)) { train_fail("optimizer step: %s", bnb8_last_error()); goto done; }
                if (flash) flash_weights_to_fp32(&model);
            }
        }
        if (!skipped) {
            int64_t bad = bnb8_optimizer_take_nonfinite(opt);
            if (bad && a->verbose) printf("step %lld: %lld non-finite gradient elements left unchanged\n", (long long)s, (long long)bad);
        } else {
            res->skipped_steps++;
            if (a->verbose)
                printf("step %lld: non-finite gradient norm (%g), update skipped: weights and optimizer state unchanged\n",
                       (long long)s, norm);
        }
        double dt = now_seconds() - t0;
        if (s > start + 1 || end == start + 1) { train_time += dt; trained++; }   // the first step warms up
        if (s == start + 1) first_loss = loss;
        last_loss = loss;
        if (res->losses) res->losses[s - 1] = loss;
        if (a->verbose) {
            printf("step %5lld/%lld | loss %.4f | lr %.3e | norm %6.3f | %7.1f ms | %7.0f tok/s\n", (long long)s,
                   (long long)a->steps, (double)loss, (double)step_lr, norm, 1e3 * dt, (double)(a->B * a->T * a->accum) / dt);
            fflush(stdout);
        }
        if (have_val && a->eval_every > 0 && (s % a->eval_every == 0 || s == a->steps)) {
            val_last = evaluate(&model, &gpu, &val_file, a->B, a->T, a->val_batches);
            if (a->verbose) printf("step %5lld | val loss %.4f\n", (long long)s, (double)val_last);
        }
        if (a->verbose && a->sample_every > 0 && s % a->sample_every == 0 && s != a->steps)
            print_sample(&model, &gpu, &rng, &tok, a->gen_tokens);
        if (has_out && ((a->ckpt_every > 0 && s % a->ckpt_every == 0) || s == a->steps || s == a->stop_after)) {
            TrainerState save = {s, loader.position, a->B, a->T, ri, oi, cfg->stable_embedding, a->steps, rng.s, a->seed,
                                 a->release, a->accum};
            // The model file holds fp32 weights: on the GPU fetched into the host copy; for flash on
            // the CPU the masters, decoded into the free gradient buffer.
            if (on_gpu && gpu_fetch_weights(&gpu, &model, opt)) goto done;
            if (flash && !on_gpu) {
                if (flash_export_masters(&model, opt, 0, model.grads_memory)) goto done;
                model.master = model.grads_memory;
            }
            int failed = checkpoint_save(a->out_dir, &model, opt, &save);
            model.master = NULL;
            if (failed) goto done;
            if (a->verbose) printf("step %5lld | checkpoint in %s\n", (long long)s, a->out_dir);
        }
    }

    if (have_val && isnan(val_last) && end == a->steps)
        val_last = evaluate(&model, &gpu, &val_file, a->B, a->T, a->val_batches);
    res->first_step = start + 1;
    res->last_step = end;
    res->first_loss = first_loss;
    res->last_loss = last_loss;
    res->val_loss = val_last;
    res->tokens_per_second = train_time > 0.0 ? (double)(trained * a->B * a->T * a->accum) / train_time : 0.0;
    res->memory = bnb8_optimizer_memory(opt, !a->release);
    res->on_gpu = on_gpu;
    if (on_gpu) {
        res->gpu_computed = gpu_bytes_computed(&gpu, opt);
        res->gpu_measured = (double)(gpu.used_peak - gpu.used_before);
    }
    if (res->final_params && res->final_params_count == model.num_parameters) {   // flash: the masters
        if (on_gpu) {
            if (gpu_fetch_weights(&gpu, &model, opt)) goto done;
            memcpy(res->final_params, model.params_memory, sizeof(float) * (size_t)model.num_parameters);
        } else if (flash) {
            if (flash_export_masters(&model, opt, 0, res->final_params)) goto done;
        } else memcpy(res->final_params, model.params_memory, sizeof(float) * (size_t)model.num_parameters);
    }

    if (a->verbose) {
        printf("\n==== report ====\n");
        print_memory(&model, &gpu, opt, state_bytes, recipe);
        double peak = peak_resident_bytes();
        if (peak > 0) { printf("  peak resident memory of the process (VmHWM): "); print_bytes(peak); printf("\n"); }
        printf("speed    %.0f tokens/s (%lld steps of %lld tokens in %.1f s, after the first step)\n", res->tokens_per_second,
               (long long)trained, (long long)(a->B * a->T * a->accum), train_time);
        printf("loss     train %.4f (step %lld) -> %.4f (step %lld)", (double)first_loss, (long long)(start + 1),
               (double)last_loss, (long long)end);
        if (have_val && !isnan(val_first)) printf("; val %.4f -> %.4f", (double)val_first, (double)val_last);
        else if (have_val) printf("; val %.4f (none at the start: -v 0 or a resumed run)", (double)val_last);
        printf("\n");
        if (res->skipped_steps)
            printf("skipped  %lld steps whose gradients held NaN or Inf (no update made)\n", (long long)res->skipped_steps);
        if (a->gen_tokens > 0) print_sample(&model, &gpu, &rng, &tok, a->gen_tokens);
    }
    status = 0;
done:
    bnb8_optimizer_free(opt);
    gpu_close(&gpu);
    loader_free(&loader);
    tokenizer_free(&tok);
    free(train_file.tokens);
    free(val_file.tokens);
    gpt2_free(&model);
    return status;
}

// ------------------------------------------------------------------------------------------------
// Command line

static void usage(FILE *f) {
    TrainArgs d;
    train_args_default(&d);
    fprintf(f,
        "usage: train_gpt2_8bit [-flag value]...   trains GPT-2 on the CPU with bnb8's optimizers\n"
        "  -i <file>   training tokens, llm.c format   (default %s)\n"
        "  -j <file>   validation tokens, \"\" for none  (default %s)\n"
        "  -z <file>   tokenizer, \"\" for none          (default %s)\n"
        "  -e <model>  descriptor dL[cC][hH][vV][tT] (d12 = GPT-2 124M, d4c128h4, ...) or an llm.c\n"
        "              model .bin (fp32 v3 or bf16 v5)  (default %s)\n"
        "  -o <dir>    output directory for checkpoints (default none)\n"
        "  -r <name>   recipe: fp32 | 8bit | flash (bf16 weights + int8 correction, 8-bit states)  (default %s)\n"
        "  -p <name>   optimizer: adamw | lion | sgd  (default %s)\n"
        "  -M <name>   8bit: the states' quantization map, dynamic | linear (ablation)  (default dynamic)\n"
        "  -K <int>    8bit: block size, a power of two 64..4096, or 0 = one absmax per tensor (ablation)\n"
        "              (default %lld)\n"
        "  -D <name>   device: auto (the GPU when this build has one and it is there) | cpu | gpu  (default auto)\n"
        "  -R <0|1>    gradient release (GPU, flash, -g 0): each layer is stepped inside backward, as soon\n"
        "              as its gradients are final, and no full gradient buffer exists (default 0)\n"
        "  -C <0|1>    GPU: activation recomputation, each layer's activations recomputed in backward from its\n"
        "              input (a fraction of the memory, one more forward) (default 0)\n"
        "  -w <0|1>    StableEmbedding (the paper's recipe for 8-bit training): layernorm after the token\n"
        "              embedding, Xavier init, 32-bit optimizer state for wte (default: on for a descriptor,\n"
        "              as recorded in a .bin model)\n"
        "  -b <int>    batch size B                     (default %lld)\n"
        "  -t <int>    sequence length T                (default %lld)\n"
        "  -n <int>    training steps                   (default %lld)\n"
        "  -A <int>    micro-batches of B x T per step (gradient accumulation; not with -R 1)  (default 1)\n"
        "  -l <float>  peak learning rate (default per optimizer: adamw %g, lion %g, sgd %g)\n"
        "  -u <int>    warm-up steps, then cosine decay (default %lld)\n"
        "  -q <float>  final learning rate, fraction of -l (default %g)\n"
        "  -c <float>  weight decay on matrices (default per optimizer: adamw %g, lion %g, sgd %g)\n"
        "  -g <float>  clip the global gradient norm at this, 0 = off (default %g)\n"
        "  -v <int>    evaluate the validation loss every this many steps, 0 = never (default %lld)\n"
        "  -m <int>    at most this many validation batches (default %lld)\n"
        "  -s <int>    print a sample every this many steps, 0 = only at the end (default %lld)\n"
        "  -G <int>    tokens per sample, 0 = none      (default %lld)\n"
        "  -k <int>    checkpoint every this many steps (and at the end) into -o (default %lld = end only)\n"
        "  -y <0|1>    resume from the newest complete checkpoint in -o (default %d)\n"
        "  -x <int>    stop after this step, checkpointing it; the schedule still spans -n (default off)\n"
        "  -d <int>    random seed (initialization and sampling) (default %llu)\n"
        "  -h          this text\n"
        "On the GPU, flags left out take the GPU's defaults: -e d12 -r flash -R 1 -g 0 (release for flash\n"
        "only) -b 16 -t 1024 -n 200 -v 25, and -l the optimizer's default / 5 (adamw 6e-4).\n"
        "threads: OMP_NUM_THREADS (default: all cores)\n",
        d.train_path, d.val_path, d.tokenizer_path, d.model, d.recipe, d.optimizer, (long long)d.blocksize,
        (long long)d.B, (long long)d.T, (long long)d.steps, (double)optimizers[0].lr, (double)optimizers[1].lr,
        (double)optimizers[2].lr, (long long)d.warmup, (double)d.final_lr_frac, (double)optimizers[0].weight_decay,
        (double)optimizers[1].weight_decay, (double)optimizers[2].weight_decay, (double)d.grad_clip,
        (long long)d.eval_every, (long long)d.val_batches, (long long)d.sample_every, (long long)d.gen_tokens,
        (long long)d.ckpt_every, d.resume, (unsigned long long)d.seed);
}

static int parse_int(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return train_fail("%s expects an integer in %lld..%lld, got '%s'", flag, (long long)lo, (long long)hi, s);
    *out = v;
    return 0;
}
static int parse_float(const char *flag, const char *s, double lo, double hi, float *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return train_fail("%s expects a number in [%g, %g], got '%s'", flag, lo, hi, s);
    *out = (float)v;
    return 0;
}

// Returns 0 (run), 1 (-h: usage printed) or -1 (bad flag: message in train_error_text). given[c] is
// set for each flag -c on the command line.
static int parse_args(int argc, char **argv, TrainArgs *a, char given[128]) {
    train_args_default(a);
    memset(given, 0, 128);
    for (int i = 1; i < argc; i += 2) {
        const char *f = argv[i];
        if (strcmp(f, "-h") == 0 || strcmp(f, "--help") == 0) return 1;
        if (f[0] != '-' || !f[1] || f[2]) return train_fail("unexpected argument '%s' (flags are -x value)", f);
        if (!strchr("ijzeorpMKDRCwbtnAluqcgvmsGkyxd", f[1])) return train_fail("unknown flag '%s'", f);
        if (i + 1 >= argc) return train_fail("%s needs a value", f);
        const char *v = argv[i + 1];
        int64_t n = 0;
        int st = 0;
        given[(unsigned char)f[1] & 127] = 1;
        switch (f[1]) {
        case 'i': a->train_path = v; break;
        case 'j': a->val_path = v; break;
        case 'z': a->tokenizer_path = v; break;
        case 'e': a->model = v; break;
        case 'o': a->out_dir = v; break;
        case 'r': a->recipe = v; if (find_recipe(v) < 0) st = train_fail("-r: unknown recipe '%s' (fp32, 8bit, flash)", v); break;
        case 'p': a->optimizer = v; if (find_optimizer(v) < 0) st = train_fail("-p: unknown optimizer '%s' (adamw, lion, sgd)", v); break;
        case 'D':
            if (strcmp(v, "auto") == 0) a->device = 0;
            else if (strcmp(v, "cpu") == 0) a->device = 1;
            else if (strcmp(v, "gpu") == 0) a->device = 2;
            else st = train_fail("-D: unknown device '%s' (auto, cpu, gpu)", v);
            break;
        case 'R': st = parse_int(f, v, 0, 1, &n); a->release = (int)n; break;
        case 'C': st = parse_int(f, v, 0, 1, &n); a->recompute = (int)n; break;
        case 'M':
            if (strcmp(v, "dynamic") == 0) a->map = BNB8_MAP_DYNAMIC;
            else if (strcmp(v, "linear") == 0) a->map = BNB8_MAP_LINEAR;
            else st = train_fail("-M: unknown map '%s' (dynamic, linear)", v);
            break;
        case 'K': st = parse_int(f, v, 0, 4096, &a->blocksize); break;
        case 'w': st = parse_int(f, v, 0, 1, &n); a->stable_embedding = (int)n; break;
        case 'b': st = parse_int(f, v, 1, 1 << 20, &a->B); break;
        case 't': st = parse_int(f, v, 1, 1 << 20, &a->T); break;
        case 'n': st = parse_int(f, v, 1, INT64_C(1) << 40, &a->steps); break;
        case 'A': st = parse_int(f, v, 1, 1 << 20, &a->accum); break;
        case 'l': st = parse_float(f, v, 1e-12, 1e3, &a->lr); break;
        case 'u': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->warmup); break;
        case 'q': st = parse_float(f, v, 0.0, 1.0, &a->final_lr_frac); break;
        case 'c': st = parse_float(f, v, 0.0, 1e3, &a->weight_decay); break;
        case 'g': st = parse_float(f, v, 0.0, 1e9, &a->grad_clip); break;
        case 'v': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->eval_every); break;
        case 'm': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->val_batches); break;
        case 's': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->sample_every); break;
        case 'G': st = parse_int(f, v, 0, 1 << 20, &a->gen_tokens); break;
        case 'k': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->ckpt_every); break;
        case 'y': st = parse_int(f, v, 0, 1, &n); a->resume = (int)n; break;
        case 'x': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->stop_after); break;
        case 'd': st = parse_int(f, v, 0, INT64_MAX, &n); a->seed = (uint64_t)n; break;
        default: return train_fail("unknown flag '%s'", f);
        }
        if (st) return -1;
    }
    return 0;
}

// On the GPU, what `make train` shows by default: GPT-2 124M with the flash recipe and gradient
// release, B=16 x T=1024 (flags given on the command line win).
static void apply_gpu_defaults(TrainArgs *a, const char given[128]) {
    if (!given['e']) a->model = "d12";
    if (!given['r']) a->recipe = "flash";
    if (!given['R']) a->release = strcmp(a->recipe, "flash") == 0 && (!given['g'] || a->grad_clip == 0.0f);
    if (!given['g'] && a->release) a->grad_clip = 0.0f;
    if (!given['b']) a->B = 16;
    if (!given['t']) a->T = 1024;
    if (!given['n']) a->steps = 200;
    if (!given['v']) a->eval_every = 25;
    if (!given['l']) a->lr = optimizers[find_optimizer(a->optimizer)].lr / 5.0f;
}

#ifndef TRAIN_NO_MAIN
int main(int argc, char **argv) {
    TrainArgs args;
    char given[128];
    int p = parse_args(argc, argv, &args, given);
    if (p == 1) { usage(stdout); return 0; }
    if (p < 0) {
        fprintf(stderr, "error: %s\n\n", train_error_text);
        usage(stderr);
        return 1;
    }
    if (args.device == 2 || (args.device == 0 && gpu_available())) {
        args.device = 2;
        apply_gpu_defaults(&args, given);
    }
    if (train_run(&args, NULL)) {
        fflush(stdout);
        fprintf(stderr, "error: %s\n", train_error_text);
        return 1;
    }
    return 0;
}
#endif
