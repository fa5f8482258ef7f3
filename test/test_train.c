/*
test_train.c — the GPT-2 trainer (DESIGN.md §8, §12): gradients against finite differences of an
independent double-precision forward, training lowers the loss and every recipe (8bit, flash, 8bit-int8,
8bit-sr, 4bit-int8, 4bit-sr and the ablations 8bit-rn, 4bit-rn) stays within 2% of fp32 with the bytes
per parameter of its formats; the 4-bit ablations' flags (-M linear, -V rank1) reach the library's
records, resume with them is bit-exact, misuse is refused; resume is bit-exact, every loader refuses bad
files with a message naming the file, and what the CPU build reaches of checkpoints over NCCL (rank
files' names, every rank's file, the trainer state's ranks, another number of ranks refused).

The tests reach the trainer, its model and its loaders through their headers (the trainer is
linked, built with -DTRAIN_NO_MAIN). Models here are tiny (2 layers, C = 32, V = 64) and the data is
a synthetic 64-token language, so the whole group runs in seconds, under ASan too. BNB8_TEST_VERBOSE=1 prints the
measured numbers (gradient errors, losses, the 8-bit vs fp32 gap).
*/
#define _POSIX_C_SOURCE 200809L
#include "trainer/trainer.h"
#include "trainer/settings.h"
#include "trainer/tensors.h"
#include "trainer/checkpoint.h"
#include "trainer/clip.h"
#include "trainer/device.h"
#include "test/checkpoint_bytes.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>
#include "test.h"

static int tverbose;
static char tdir[64];

static void tpath(char *path, size_t size, const char *name) { snprintf(path, size, "%s/%s", tdir, name); }


// Writes an llm.c tokens file with its own code (not the trainer's), header fields as given.
static void write_tokens(const char *path, const uint16_t *tokens, int64_t count, int32_t magic, int32_t version,
                         int32_t header_count) {
    FILE *f = fopen(path, "wb");
    if (!f) { EXPECT(0, "cannot create %s", path); return; }
    int32_t h[256] = {0};
    h[0] = magic; h[1] = version; h[2] = header_count;
    fwrite(h, 4, 256, f);
    if (count) fwrite(tokens, 2, (size_t)count, f);
    fclose(f);
}

// A 64-token language with structure to learn: each token mostly follows from the previous one
// (a fixed permutation), sometimes at random; documents start with token 63 (end-of-text here).
static void make_language(uint16_t *out, int64_t n, uint64_t seed) {
    Rng r = {seed};
    int b = 2;
    for (int64_t i = 0; i < n; i++) {
        int t;
        if (i % 40 == 0) t = 63;
        else if (rng_uniform(&r) < 0.85f) t = (17 * b + 5) % 62;
        else t = (int)(rng_u64(&r) % 62);
        out[i] = (uint16_t)t;
        b = t;
    }
}

static void make_data_files(void) {
    int64_t n = 40000, nv = 4000;
    uint16_t *tok = (uint16_t *)malloc(2 * (size_t)n);
    if (!tok) return;
    char path[256];
    make_language(tok, n, 11);
    tpath(path, sizeof path, "train.bin");
    write_tokens(path, tok, n, TOKENS_MAGIC, 1, (int32_t)n);
    make_language(tok, nv, 12);
    tpath(path, sizeof path, "val.bin");
    write_tokens(path, tok, nv, TOKENS_MAGIC, 1, (int32_t)nv);
    free(tok);
}

// ------------------------------------------------------------------------------------------------
// Double-precision reference forward, written from the math (not from the trainer's kernels).

static void ref_layernorm(double *out, const double *x, const double *w, const double *b, int64_t C) {
    double m = 0.0, v = 0.0;
    for (int64_t i = 0; i < C; i++) m += x[i];
    m /= (double)C;
    for (int64_t i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
    v /= (double)C;
    double s = 1.0 / sqrt(v + 1e-5);
    for (int64_t i = 0; i < C; i++) out[i] = (x[i] - m) * s * w[i] + b[i];
}

// y (OC) = W (OC, K) x (K) + bias (OC, may be NULL)
static void ref_linear(double *y, const double *x, const double *W, const double *bias, int64_t K, int64_t OC) {
    for (int64_t o = 0; o < OC; o++) {
        double s = bias ? bias[o] : 0.0;
        for (int64_t k = 0; k < K; k++) s += W[o * K + k] * x[k];
        y[o] = s;
    }
}

// Mean cross-entropy of the model whose parameters (in the trainer's layout) are p.
static double ref_loss(const GPT2Config *c, const double *p, const int *in, const int *tg, int64_t B, int64_t T) {
    int64_t sizes[GPT2_NUM_PARAMS], off[GPT2_NUM_PARAMS], o = 0;
    gpt2_param_sizes(c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) { off[i] = o; o += sizes[i]; }
    const double *wte = p + off[0], *wpe = p + off[1], *ln1w = p + off[2], *ln1b = p + off[3], *qkvw = p + off[4];
    const double *qkvb = p + off[5], *apw = p + off[6], *apb = p + off[7], *ln2w = p + off[8], *ln2b = p + off[9];
    const double *fcw = p + off[10], *fcb = p + off[11], *fpw = p + off[12], *fpb = p + off[13];
    const double *lnfw = p + off[14], *lnfb = p + off[15], *lnew = p + off[16], *lneb = p + off[17];
    int64_t C = c->channels, L = c->num_layers, NH = c->num_heads, hs = C / NH, V = c->vocab_size, BT = B * T;
    double *x = (double *)malloc(sizeof(double) * (size_t)(BT * C)), *h = (double *)malloc(sizeof(double) * (size_t)(BT * C));
    double *qkv = (double *)malloc(sizeof(double) * (size_t)(BT * 3 * C)), *y = (double *)malloc(sizeof(double) * (size_t)(BT * C));
    double *f = (double *)malloc(sizeof(double) * (size_t)(4 * C)), *tmp = (double *)malloc(sizeof(double) * (size_t)(4 * C + V + T));
    double loss = 0.0;
    if (!x || !h || !qkv || !y || !f || !tmp) { EXPECT(0, "out of memory"); goto out; }
    for (int64_t bt = 0; bt < BT; bt++) {
        const double *e = wte + in[bt] * C;
        if (c->stable_embedding) { ref_layernorm(tmp, e, lnew, lneb, C); e = tmp; }
        for (int64_t i = 0; i < C; i++) x[bt * C + i] = e[i] + wpe[(bt % T) * C + i];
    }
    for (int64_t l = 0; l < L; l++) {
        for (int64_t bt = 0; bt < BT; bt++) {
            ref_layernorm(h + bt * C, x + bt * C, ln1w + l * C, ln1b + l * C, C);
            ref_linear(qkv + bt * 3 * C, h + bt * C, qkvw + l * 3 * C * C, qkvb + l * 3 * C, C, 3 * C);
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t hd = 0; hd < NH; hd++) {
                    const double *q = qkv + (b * T + t) * 3 * C + hd * hs;
                    double *sc = tmp, mx = -INFINITY, sum = 0.0;
                    for (int64_t t2 = 0; t2 <= t; t2++) {
                        const double *k = qkv + (b * T + t2) * 3 * C + C + hd * hs;
                        double s = 0.0;
                        for (int64_t i = 0; i < hs; i++) s += q[i] * k[i];
                        sc[t2] = s / sqrt((double)hs);
                        if (sc[t2] > mx) mx = sc[t2];
                    }
                    for (int64_t t2 = 0; t2 <= t; t2++) { sc[t2] = exp(sc[t2] - mx); sum += sc[t2]; }
                    double *yo = y + (b * T + t) * C + hd * hs;
                    for (int64_t i = 0; i < hs; i++) {
                        double s = 0.0;
                        for (int64_t t2 = 0; t2 <= t; t2++) s += sc[t2] / sum * qkv[(b * T + t2) * 3 * C + 2 * C + hd * hs + i];
                        yo[i] = s;
                    }
                }
        for (int64_t bt = 0; bt < BT; bt++) {
            ref_linear(tmp, y + bt * C, apw + l * C * C, apb + l * C, C, C);
            for (int64_t i = 0; i < C; i++) x[bt * C + i] += tmp[i];
            ref_layernorm(h + bt * C, x + bt * C, ln2w + l * C, ln2b + l * C, C);
            ref_linear(f, h + bt * C, fcw + l * 4 * C * C, fcb + l * 4 * C, C, 4 * C);
            for (int64_t i = 0; i < 4 * C; i++)
                f[i] = 0.5 * f[i] * (1.0 + tanh(sqrt(2.0 / 3.141592653589793) * (f[i] + 0.044715 * f[i] * f[i] * f[i])));
            ref_linear(tmp, f, fpw + l * 4 * C * C, fpb + l * C, 4 * C, C);
            for (int64_t i = 0; i < C; i++) x[bt * C + i] += tmp[i];
        }
    }
    for (int64_t bt = 0; bt < BT; bt++) {
        ref_layernorm(h + bt * C, x + bt * C, lnfw, lnfb, C);
        ref_linear(tmp, h + bt * C, wte, NULL, C, V);    // the tied LM head, real rows only
        double mx = -INFINITY, sum = 0.0;
        for (int64_t v = 0; v < V; v++) if (tmp[v] > mx) mx = tmp[v];
        for (int64_t v = 0; v < V; v++) sum += exp(tmp[v] - mx);
        loss += log(sum) + mx - tmp[tg[bt]];
    }
    loss /= (double)BT;
out:
    free(x); free(h); free(qkv); free(y); free(f); free(tmp);
    return loss;
}

// Every parameter at a scale where all paths carry signal (GPT-2's 0.02 init leaves attention
// almost uniform): matrices ~ 1/sqrt(fan-in), embeddings 0.5, layernorm weights 1 +- 0.2, biases 0.2.
static void randomize_params(GPT2 *m, Rng *r) {
    int64_t C = m->config.channels;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        float *p = gpt2_param(&m->params, i);
        float scale = i <= 1 ? 0.5f : gpt2_param_is_matrix[i] ? 1.0f / sqrtf((float)(i == 12 ? 4 * C : C)) : 0.2f;
        int ln_weight = i == 2 || i == 8 || i == 14 || i == 16;
        for (int64_t j = 0; j < m->param_sizes[i]; j++) p[j] = (ln_weight ? 1.0f : 0.0f) + scale * rng_normal(r);
    }
}

// gpt2_backward's callback: the groups in the order they were finished.
typedef struct { int order[16], n; } ready_record;
static int record_ready(void *ctx, int which, struct CUstream_st *stream) {
    ready_record *r = (ready_record *)ctx;
    if (r->n < 16) r->order[r->n] = which;
    r->n++;
    return stream != NULL;   // the CPU model passes no stream
}

static void grad_check(int stable) {
    GPT2Config c;
    EXPECT(gpt2_config_from_descriptor(&c, "d2c32h2v64t8") == 0, "descriptor: %s", train_error_text);
    c.stable_embedding = stable;
    GPT2 m;
    if (gpt2_init_random(&m, &c, 5)) { EXPECT(0, "%s", train_error_text); return; }
    int64_t B = 2, T = 8, BT = B * T;
    if (gpt2_alloc_acts(&m, B, T)) { EXPECT(0, "%s", train_error_text); gpt2_free(&m); return; }
    Rng r = {stable ? 77u : 78u};
    randomize_params(&m, &r);
    int in[16], tg[16];
    for (int64_t i = 0; i < BT; i++) { in[i] = (int)(rng_u64(&r) % 64); tg[i] = (int)(rng_u64(&r) % 64); }
    float loss = gpt2_forward(&m, in, tg, B, T);
    int64_t n = m.num_parameters;
    float *grads = (float *)malloc(sizeof(float) * (size_t)n);
    double *p = (double *)malloc(sizeof(double) * (size_t)n);
    if (!p || !grads) { EXPECT(0, "out of memory"); free(p); free(grads); gpt2_free(&m); return; }
    for (int64_t i = 0; i < n; i++) grads[i] = NAN;   // accumulate = 0 overwrites every element
    ready_record rec = {{0}, 0};
    EXPECT(gpt2_backward(&m, grads, 0, record_ready, &rec) == 0, "backward: %s", train_error_text);
    EXPECT(rec.n == c.num_layers + 2 && rec.order[0] == GPT2_GRADS_LNF && rec.order[1] == 1 && rec.order[2] == 0 &&
           rec.order[3] == GPT2_GRADS_EMBED, "grads_ready: %d calls, order %d %d %d %d", rec.n, rec.order[0],
           rec.order[1], rec.order[2], rec.order[3]);

    for (int64_t i = 0; i < n; i++) p[i] = m.params_memory[i];
    double ref = ref_loss(&c, p, in, tg, B, T);
    EXPECT(fabs(loss - ref) <= 1e-5 * fabs(ref), "forward: float loss %.9g vs double %.9g", (double)loss, ref);
    if (tverbose) printf("    stable %d: loss float %.9f double %.9f\n", stable, (double)loss, ref);

    // Central differences in double, h = 1e-5: truncation ~h^2 and rounding ~1e-16/h, both far
    // below the 1e-3 bar. rel = |analytic - numeric| / max(|analytic|, |numeric|, floor) where
    // floor = 1e-3 of the tensor's largest sampled gradient: an entry a thousand times smaller than
    // its neighbours carries float32 rounding of their size, which no fp32 backward avoids.
    const int SAMPLES = 24;
    const double h = 1e-5;
    int64_t off = 0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        int64_t size = m.param_sizes[i];
        if (!size) continue;
        int64_t idx[24];
        double num[24], ana[24], gmax = 0.0, worst = 0.0;
        int count = size < SAMPLES ? (int)size : SAMPLES;
        for (int s = 0; s < count; s++) {
            int64_t j = size <= SAMPLES ? s : (int64_t)(rng_u64(&r) % (uint64_t)size);
            idx[s] = off + j;
            double keep = p[idx[s]];
            p[idx[s]] = keep + h;
            double lp = ref_loss(&c, p, in, tg, B, T);
            p[idx[s]] = keep - h;
            double lm = ref_loss(&c, p, in, tg, B, T);
            p[idx[s]] = keep;
            num[s] = (lp - lm) / (2.0 * h);
            ana[s] = grads[idx[s]];
            if (fabs(num[s]) > gmax) gmax = fabs(num[s]);
        }
        for (int s = 0; s < count; s++) {
            double den = fmax(fmax(fabs(ana[s]), fabs(num[s])), 1e-3 * gmax);
            double rel = den > 0.0 ? fabs(ana[s] - num[s]) / den : 0.0;
            if (rel > worst) worst = rel;
            EXPECT(rel <= 1e-3, "stable %d: %s[%lld]: analytic %.9g, numeric %.9g, rel %.2e", stable, gpt2_param_names[i],
                   (long long)(idx[s] - off), ana[s], num[s], rel);
        }
        EXPECT(gmax > 0.0, "%s: every sampled gradient is 0", gpt2_param_names[i]);
        if (tverbose) printf("    stable %d: %-9s %2d samples, max |grad| %.3e, worst rel error %.2e\n", stable,
                             gpt2_param_names[i], count, gmax, worst);
        off += size;
    }
    free(p);
    free(grads);
    gpt2_free(&m);
}

static void test_gradients(void) { grad_check(0); }
static void test_gradients_stable(void) { grad_check(1); }

// Results do not depend on the number of threads (the resume and parity guarantees rest on it).
static void test_thread_independence(void) {
#ifdef _OPENMP
    GPT2Config c;
    gpt2_config_from_descriptor(&c, "d2c40h4v70t12");   // sizes off the kernels' tiles: exercises every tail
    GPT2 m;
    if (gpt2_init_random(&m, &c, 9) || gpt2_alloc_acts(&m, 3, 11)) { EXPECT(0, "%s", train_error_text); gpt2_free(&m); return; }
    Rng r = {3};
    randomize_params(&m, &r);
    int in[33], tg[33];
    for (int i = 0; i < 33; i++) { in[i] = (int)(rng_u64(&r) % 70); tg[i] = (int)(rng_u64(&r) % 70); }
    int64_t n = m.num_parameters;
    float *g1 = (float *)malloc(sizeof(float) * (size_t)n), *g2 = (float *)malloc(sizeof(float) * (size_t)n);
    int threads = omp_get_max_threads();
    float l1 = 0.0f, l2 = 0.0f;
    for (int run = 0; run < 2 && g1 && g2; run++) {
        omp_set_num_threads(run == 0 ? 1 : 3);
        float l = gpt2_forward(&m, in, tg, 3, 11);
        gpt2_backward(&m, run == 0 ? g1 : g2, 0, NULL, NULL);
        if (run == 0) l1 = l;
        else l2 = l;
    }
    omp_set_num_threads(threads);
    EXPECT(g1 && g2 && memcmp(&l1, &l2, 4) == 0, "loss differs between 1 and 3 threads: %.9g vs %.9g", (double)l1, (double)l2);
    EXPECT(g1 && g2 && memcmp(g1, g2, sizeof(float) * (size_t)n) == 0, "gradients differ between 1 and 3 threads");
    // accumulate = 1 adds the same gradients again (backward used up the forward's probabilities: a
    // forward again first): twice them, up to fp32 rounding of sums of 33 rows (~1e-6 of the largest)
    if (g1 && g2) { gpt2_forward(&m, in, tg, 3, 11); gpt2_backward(&m, g2, 1, NULL, NULL); }
    double gmax = 0.0;
    for (int64_t i = 0; g1 && i < n; i++) gmax = fmax(gmax, fabs((double)g1[i]));
    int64_t off = -1;
    for (int64_t i = 0; g1 && g2 && i < n && off < 0; i++) if (fabs((double)g2[i] - 2.0 * g1[i]) > 1e-5 * gmax) off = i;
    EXPECT(g1 && g2 && gmax > 0.0 && off < 0, "accumulated gradient %lld is %g, not twice %g", (long long)off,
           off >= 0 ? (double)g2[off] : 0.0, off >= 0 ? (double)g1[off] : 0.0);
    free(g1);
    free(g2);
    gpt2_free(&m);
#endif
}

// ------------------------------------------------------------------------------------------------
// Training

static void tiny_args(TrainArgs *a, const char *recipe, const char *optimizer, int64_t steps) {
    static char train[256], val[256];
    train_args_default(a);
    tpath(train, sizeof train, "train.bin");
    tpath(val, sizeof val, "val.bin");
    a->train_path = train; a->val_path = val; a->tokenizer_path = "";
    a->model = "d2c64h4v64t16";   // every matrix >= 4096 elements: 8-bit states under the 8bit recipe
    a->B = 4; a->T = 16; a->steps = steps; a->warmup = 5;
    a->recipe = recipe; a->optimizer = optimizer;
    a->stable_embedding = 0;     // wte with 8-bit states too: the recipes differ on every matrix
    a->lr = strcmp(optimizer, "adamw") == 0 ? 1e-2f : strcmp(optimizer, "lion") == 0 ? 3e-3f : -1.0f;   // sgd: the optimizer's
    a->eval_every = steps; a->val_batches = 20; a->gen_tokens = 0;
    a->verbose = 0;
}

// Persistent bytes of a recipe on the CPU by the formats (DESIGN.md §8.6), tensor by tensor: fp32
// weights and gradients where the master is fp32 (they are one), else bf16 weights + an int8
// correction (none under stochastic rounding) + bf16 gradients; per state 4 bytes an element (32-bit states, and every tensor under
// 4096 elements), 8-bit codes + an fp32 absmax per 256, flash codes + a bf16 scale per 32, or 4-bit
// codes (half a byte) + an fp32 absmax per 128.
static bnb8_memory expected_memory(const char *recipe, const GPT2Config *c) {
    int r = find_recipe(recipe);
    int wide = recipes[r].correction_bytes == 4, master = wide ? 0 : recipes[r].correction_bytes > 0 ? recipes[r].correction_bytes : 0;
    int64_t sizes[GPT2_NUM_PARAMS];
    gpt2_param_sizes(c, sizes);
    bnb8_memory m = {0};
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        double n = (double)sizes[i];
        m.params += sizes[i];
        m.weights += (wide ? 4 : 2) * n;
        m.gradients += (wide ? 4 : 2) * n;
        m.correction += master * n;
        double per_state = sizes[i] < 4096 || recipes[r].states == BNB8_STATE_32BIT ? 4 * n
                         : recipes[r].states == BNB8_STATE_8BIT ? n + 4.0 * (double)((sizes[i] + 255) / 256)
                         : recipes[r].states == BNB8_STATE_4BIT ? (double)((sizes[i] + 1) / 2) + 4.0 * (double)((sizes[i] + 127) / 128)
                         : n + 2.0 * (double)((sizes[i] + 31) / 32);
        m.states += 2 * per_state;   // AdamW: m and v
    }
    return m;
}

static void test_training(void) {
    enum { R = 9 };
    const char *rec[R] = {"fp32", "8bit", "flash", "8bit-int8", "8bit-sr", "4bit-int8", "4bit-sr", "8bit-rn", "4bit-rn"};
    float val[R] = {0};
    for (int k = 0; k < R; k++) {
        TrainArgs a;
        tiny_args(&a, rec[k], "adamw", 50);
        float losses[50];
        TrainResult res = {0};
        res.losses = losses;
        if (train_run(&a, &res)) { EXPECT(0, "%s: %s", rec[k], train_error_text); return; }
        float first = 0, last = 0;
        for (int i = 0; i < 5; i++) { first += losses[i] / 5; last += losses[45 + i] / 5; }
        EXPECT(last < first - 1.0f, "%s: loss did not fall: first 5 steps %.4f, last 5 %.4f", rec[k], (double)first, (double)last);
        EXPECT(res.val_loss < 0.7f * logf(64.0f), "%s: val loss %.4f, ln 64 = %.4f", rec[k], (double)res.val_loss, log(64.0));
        val[k] = res.val_loss;
        if (tverbose) printf("    %s: train loss %.4f -> %.4f (mean of 5 steps), val %.4f, %.3f bytes/param of states\n",
                             rec[k], (double)first, (double)last, (double)res.val_loss, res.memory.states / (double)res.memory.params);
        if (k == 2) {   // flash: bf16 weights + int8 correction + bf16 gradients, from the library's accounting
            double P = (double)res.memory.params;
            EXPECT(res.memory.weights == 2 * P && res.memory.correction == P && res.memory.gradients == 2 * P,
                   "flash: weights %.3f, correction %.3f, gradients %.3f bytes/param", res.memory.weights / P,
                   res.memory.correction / P, res.memory.gradients / P);
        }
        GPT2Config c;
        gpt2_config_from_descriptor(&c, a.model);
        c.stable_embedding = 0;
        bnb8_memory want = expected_memory(rec[k], &c), got = res.memory;
        double P = (double)got.params, bpp = (got.weights + got.correction + got.gradients + got.states) / P;
        EXPECT(got.params == want.params && got.weights == want.weights && got.correction == want.correction &&
               got.gradients == want.gradients && got.states == want.states,
               "%s: %.4f + %.4f + %.4f + %.4f bytes/param, expected %.4f + %.4f + %.4f + %.4f", rec[k], got.weights / P,
               got.correction / P, got.gradients / P, got.states / P, want.weights / P, want.correction / P,
               want.gradients / P, want.states / P);
        if (tverbose) printf("    %s: weights %.3f + master %.3f + gradients %.3f + states %.3f = %.3f bytes/param\n", rec[k],
                             got.weights / P, got.correction / P, got.gradients / P, got.states / P, bpp);
    }
    for (int k = 1; k < R; k++) {
        double gap = (val[k] - val[0]) / val[0];
        EXPECT(fabs(gap) <= 0.02, "%s val loss %.5f vs fp32 %.5f: gap %.2f%%", rec[k], (double)val[k], (double)val[0], 100 * gap);
        printf("    %-9s vs fp32 after 50 steps: val loss %.5f vs %.5f, gap %+.3f%%\n", rec[k], (double)val[k], (double)val[0],
               100 * gap);
    }
    // The other optimizers and StableEmbedding learn too.
    const char *opts[2] = {"lion", "sgd"};
    for (int k = 0; k < 3; k++) {
        TrainArgs a;
        tiny_args(&a, "8bit", k < 2 ? opts[k] : "adamw", 30);
        if (k == 2) a.stable_embedding = 1;
        float losses[30];
        TrainResult res = {0};
        res.losses = losses;
        if (train_run(&a, &res)) { EXPECT(0, "%s: %s", a.optimizer, train_error_text); continue; }
        EXPECT(losses[29] < losses[0] - 0.5f, "%s%s: loss %.4f -> %.4f", a.optimizer, k == 2 ? " + StableEmbedding" : "",
               (double)losses[0], (double)losses[29]);
        if (tverbose) printf("    8bit %s%s: loss %.4f -> %.4f\n", a.optimizer, k == 2 ? " + StableEmbedding" : "",
                             (double)losses[0], (double)losses[29]);
    }
}

static void spit(const char *path, const uint8_t *d, int64_t size);
static uint8_t *slurp(const char *path, int64_t *size);

// The checkpoint of step k in dir rewritten in the version 1 layout (trainer state version 1), into
// old: model_k.bin (the fp32 masters, llm.c version 3), optim_k.bin as a version 1 optimizer file
// (test_state_file_v1), state_k.bin as the 16 words of version 1, DONE_k. 1 on success.
static int write_old_layout(const char *dir, const char *old, int64_t k, const GPT2Config *c, const float *masters) {
    char from[512], to[512];
    mkdir(old, 0700);
    int64_t size;
    size_t size1;
    checkpoint_path(to, sizeof to, old, "model", k, ".bin");
    int ok = gpt2_save_params(c, masters, to, 0) == 0;
    checkpoint_path(from, sizeof from, dir, "optim", k, ".bin");
    checkpoint_path(to, sizeof to, old, "optim", k, ".bin");
    uint8_t *d = slurp(from, &size), *v1 = d ? test_state_file_v1(d, (size_t)size, &size1) : NULL;
    if (v1) spit(to, v1, (int64_t)size1);
    ok &= v1 != NULL;
    free(d); free(v1);
    checkpoint_path(from, sizeof from, dir, "state", k, ".bin");
    checkpoint_path(to, sizeof to, old, "state", k, ".bin");
    d = slurp(from, &size);
    ok &= d && size == 8 * STATE_WORDS;
    if (d && size == 8 * STATE_WORDS) {
        int64_t w[16];
        memcpy(w, d, sizeof w);
        w[1] = 1; w[15] = 0;
        spit(to, (const uint8_t *)w, sizeof w);
    }
    free(d);
    checkpoint_path(to, sizeof to, old, "DONE", k, "");
    spit(to, (const uint8_t *)"", 0);
    return ok;
}

// Stop after k steps, resume: the later losses and the final weights equal an uninterrupted run's.
// With old_layout, the checkpoint rewritten in the version 1 layout resumes the same; without its
// model file it is refused, saying so. rule: -N (-1: the default, exact without release).
static void resume_case(const char *recipe, const char *optimizer, int stable, int old_layout, int rule) {
    const int64_t N = 12, K = 5;
    char dir_a[256], dir_b[256];
    snprintf(dir_a, sizeof dir_a, "%s/run_a_%s_%s_%d_%d", tdir, recipe, optimizer, stable, rule);
    snprintf(dir_b, sizeof dir_b, "%s/run_b_%s_%s_%d_%d", tdir, recipe, optimizer, stable, rule);
    TrainArgs a;
    tiny_args(&a, recipe, optimizer, N);
    a.stable_embedding = stable;
    a.eval_every = 4;
    a.clip_rule = rule;
    int flash = strcmp(recipe, "flash") == 0;
    // flash in the old layout: made with bf16 scales (-S bf16), as checkpoints before e6m10 were
    if (flash && old_layout) a.scale_dtype = find_scale_dtype("bf16");
    GPT2Config c;
    gpt2_config_from_descriptor(&c, a.model);
    c.stable_embedding = stable;
    int64_t sizes[GPT2_NUM_PARAMS], n = 0;
    gpt2_param_sizes(&c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += sizes[i];
    float la[12], lb[12];
    float *wa = (float *)malloc(sizeof(float) * (size_t)n), *wb = (float *)malloc(sizeof(float) * (size_t)n);
    float *wk = (float *)malloc(sizeof(float) * (size_t)n);
    if (!wa || !wb || !wk) { EXPECT(0, "out of memory"); free(wa); free(wb); free(wk); return; }
    for (int i = 0; i < 12; i++) la[i] = lb[i] = NAN;

    TrainResult ra = {0};
    ra.losses = la; ra.final_params = wa; ra.final_params_count = n;
    a.out_dir = dir_a;
    EXPECT(train_run(&a, &ra) == 0, "uninterrupted run: %s", train_error_text);

    TrainResult rb = {0};
    rb.losses = lb; rb.final_params = wk; rb.final_params_count = n;
    a.out_dir = dir_b;
    a.stop_after = K;
    EXPECT(train_run(&a, &rb) == 0 && rb.last_step == K, "first part: %s", train_error_text);
    rb.final_params = wb;
    if (old_layout) {
        char dir_c[300], model[512];
        snprintf(dir_c, sizeof dir_c, "%s_old", dir_b);
        EXPECT(write_old_layout(dir_b, dir_c, K, &c, wk), "%s: cannot write the old layout", recipe);
        TrainArgs o = a;
        o.out_dir = dir_c; o.stop_after = 0; o.resume = 1;
        o.scale_dtype = -1;      // version 1 + flash: bf16 scales without -S
        float lc[12];
        float *wc = (float *)malloc(sizeof(float) * (size_t)n);
        TrainResult rc = {0};
        rc.losses = lc; rc.final_params = wc; rc.final_params_count = n;
        for (int i = 0; i < 12; i++) lc[i] = la[i];
        for (int i = (int)K; i < 12; i++) lc[i] = NAN;
        EXPECT(wc && train_run(&o, &rc) == 0 && rc.first_step == K + 1, "%s: resume of the old layout: %s", recipe,
               train_error_text);
        EXPECT(wc && memcmp(la, lc, sizeof la) == 0 && memcmp(wa, wc, sizeof(float) * (size_t)n) == 0 &&
               memcmp(&ra.val_loss, &rc.val_loss, 4) == 0, "%s %s: the old layout's resume differs from never stopping",
               recipe, optimizer);
        if (flash) {             // version 1 records no scale dtype: -S names it, and the library checks it
            test_remove_tree(dir_c, 0);
            EXPECT(write_old_layout(dir_b, dir_c, K, &c, wk), "%s: cannot write the old layout", recipe);
            o.scale_dtype = find_scale_dtype("e6m10");
            EXPECT(train_run(&o, NULL) != 0 && strstr(train_error_text, "saved with bf16 group scales"),
                   "%s: the old layout with -S e6m10: '%s'", recipe, train_error_text);
        }
        test_remove_tree(dir_c, 0);
        EXPECT(write_old_layout(dir_b, dir_c, K, &c, wk), "%s: cannot write the old layout", recipe);
        checkpoint_path(model, sizeof model, dir_c, "model", K, ".bin");
        remove(model);
        EXPECT(train_run(&o, NULL) != 0 && strstr(train_error_text, "older layout") && strstr(train_error_text, model),
               "%s: old layout without its model file: '%s'", recipe, train_error_text);
        if (tverbose) printf("    %s %s: the checkpoint in the version 1 layout resumed bit-exactly; without its model "
                             "file: %s\n", recipe, optimizer, train_error_text);
        free(wc);
        test_remove_tree(dir_c, 1);
    }
    for (int i = (int)K; i < 12; i++) lb[i] = NAN;
    a.stop_after = 0;
    a.resume = 1;
    a.scale_dtype = -1;          // the checkpoint's (word 24)
    EXPECT(train_run(&a, &rb) == 0 && rb.first_step == K + 1 && rb.last_step == N, "resumed part: %s (steps %lld..%lld)",
           train_error_text, (long long)rb.first_step, (long long)rb.last_step);
    for (int i = 0; i < 12; i++)
        EXPECT(memcmp(&la[i], &lb[i], 4) == 0, "%s %s stable %d: step %d loss %.9g vs resumed %.9g", recipe, optimizer,
               stable, i + 1, (double)la[i], (double)lb[i]);
    EXPECT(memcmp(wa, wb, sizeof(float) * (size_t)n) == 0, "%s %s stable %d: final weights differ after resume",
           recipe, optimizer, stable);
    EXPECT(memcmp(&ra.val_loss, &rb.val_loss, 4) == 0, "%s: val loss %.9g vs resumed %.9g", recipe, (double)ra.val_loss,
           (double)rb.val_loss);
    if (flash) {                 // a resume that asks for other group scales than the checkpoint's
        TrainArgs other = a;
        other.scale_dtype = old_layout ? find_scale_dtype("e6m10") : find_scale_dtype("fp32");
        other.steps = N + 5;
        const char *have = old_layout ? "are bf16" : "are e6m10", *want = old_layout ? "asks for e6m10" : "asks for fp32";
        EXPECT(train_run(&other, NULL) != 0 && strstr(train_error_text, have) && strstr(train_error_text, want) &&
               strstr(train_error_text, "-S"), "%s: resume with -S %s: '%s'", recipe, scale_dtypes[other.scale_dtype].name,
               train_error_text);
    }
    if (rule == CLIP_PREV || rule == CLIP_EST) {   // the rule acted; the resumed run clipped with the checkpoint's state
        EXPECT(ra.clipped_steps > 0, "%s -N %s: no step clipped (the test would not see the rule)", recipe, clip_rule_names[rule]);
        TrainArgs exact = a;
        exact.clip_rule = CLIP_EXACT;
        exact.steps = N + 5;
        EXPECT(train_run(&exact, &rb) != 0 && strstr(train_error_text, "clipping rule"), "resume -N %s with exact: '%s'",
               clip_rule_names[rule], train_error_text);
    }
    // The checkpoint of the stopped run is complete and the newest.
    EXPECT(checkpoint_latest(dir_b) == N, "newest checkpoint in %s is %lld", dir_b, (long long)checkpoint_latest(dir_b));
    // Asking to resume a finished run is an error that says so.
    EXPECT(train_run(&a, &rb) != 0 && strstr(train_error_text, "the last of its run (-n 12): nothing to train"),
           "resume past the end: '%s'", train_error_text);
    // A different recipe cannot resume this checkpoint.
    TrainArgs other = a;
    other.recipe = strcmp(recipe, "fp32") == 0 ? "8bit" : "fp32";
    other.steps = N + 5;
    EXPECT(train_run(&other, &rb) != 0 && strstr(train_error_text, "recipe"), "resume with another recipe: '%s'", train_error_text);
    // Nor can the fp32 parity model resume a checkpoint of bf16 weights (a correction recipe's).
    other = a;
    other.parity = 1;
    other.steps = N + 5;
    if (recipes[find_recipe(recipe)].correction_bytes != 4)
        EXPECT(train_run(&other, &rb) != 0 && strstr(train_error_text, "bf16 weights"), "resume with -P fp32: '%s'",
               train_error_text);
    if (tverbose) printf("    %s %s stable %d: steps %lld..%lld resumed bit-exactly, final loss %.6f\n", recipe, optimizer,
                         stable, (long long)K + 1, (long long)N, (double)la[11]);
    free(wa); free(wb); free(wk);
    test_remove_tree(dir_a, 1);
    test_remove_tree(dir_b, 1);
}

// -l 0 changes no weight (the checks that compare final weights across layouts use it): the masters
// after 1 and after 3 steps at lr 0 are equal bit for bit, and 1 step at lr 1e-2 moves them.
static void test_zero_lr(void) {
    const char *rec[3] = {"fp32", "8bit", "flash"};
    for (int k = 0; k < 3; k++) {
        float *p[3] = {0};
        int64_t n = 0;
        const int64_t steps[3] = {1, 3, 1};
        const float lrs[3] = {0.0f, 0.0f, 1e-2f};
        for (int i = 0; i < 3; i++) {
            TrainArgs a;
            tiny_args(&a, rec[k], "adamw", steps[i]);
            a.lr = lrs[i];
            GPT2Config c;
            gpt2_config_from_descriptor(&c, a.model);
            int64_t sizes[GPT2_NUM_PARAMS];
            gpt2_param_sizes(&c, sizes);
            n = 0;
            for (int j = 0; j < GPT2_NUM_PARAMS; j++) n += sizes[j];
            TrainResult res = {0};
            res.final_params = p[i] = malloc((size_t)n * sizeof(float));
            res.final_params_count = n;
            for (int64_t e = 0; e < n; e++) p[i][e] = NAN;   // poisoned: the run must write every element
            if (train_run(&a, &res)) EXPECT(0, "%s lr %g: %s", rec[k], (double)lrs[i], train_error_text);
        }
        int64_t same13 = 0, moved = 0;
        for (int64_t e = 0; e < n; e++) {
            same13 += memcmp(&p[0][e], &p[1][e], sizeof(float)) == 0 && !isnan(p[0][e]);
            moved += memcmp(&p[0][e], &p[2][e], sizeof(float)) != 0;
        }
        EXPECT(same13 == n, "%s: lr 0, 1 step vs 3 steps: %lld of %lld masters equal", rec[k], (long long)same13, (long long)n);
        EXPECT(moved > n / 2, "%s: lr 1e-2 moved %lld of %lld masters", rec[k], (long long)moved, (long long)n);
        for (int i = 0; i < 3; i++) free(p[i]);
    }
    const char *zero[] = {"t", "-l", "0"};
    TrainArgs a;
    char given[128];
    EXPECT(parse_args(3, (char **)zero, &a, given) == 0 && a.lr == 0.0f, "-l 0: %s", train_error_text);
    parse_args(1, (char **)zero, &a, given);
    EXPECT(a.lr < 0.0f, "-l left out: the optimizer's (negative), got %g", (double)a.lr);
}

// Checkpoint sizes (DESIGN.md §8.4), measured from the files of each recipe on the CPU against the
// bytes its formats give, tensor by tensor (test/checkpoint_bytes.h); the trainer state's STATE_WORDS
// words, an empty DONE. A tensor of a multiple of 256 elements (wte, 4096) costs exactly the recipe's
// target per parameter: 12, 6.03125, 5.03125, 5.125, 4.03125, 4.0625, 3.0625, 4.03125, 3.0625.
static void test_checkpoint_sizes(void) {
    enum { R = 9 };
    const char *rec[R] = {"fp32", "8bit", "8bit-int8", "flash", "8bit-sr", "4bit-int8", "4bit-sr", "8bit-rn", "4bit-rn"};
    const double target[R] = {12.0, 6.03125, 5.03125, 5.125, 4.03125, 4.0625, 3.0625, 4.03125, 3.0625};
    for (int k = 0; k < R; k++) {
        char dir[256], path[512];
        snprintf(dir, sizeof dir, "%s/sizes_%s", tdir, rec[k]);
        TrainArgs a;
        tiny_args(&a, rec[k], "adamw", 2);
        a.out_dir = dir;
        TrainResult r = {0};
        if (train_run(&a, &r)) { EXPECT(0, "%s: %s", rec[k], train_error_text); continue; }
        GPT2Config c;
        gpt2_config_from_descriptor(&c, a.model);
        int64_t sizes[GPT2_NUM_PARAMS], P = 0;
        gpt2_param_sizes(&c, sizes);
        for (int i = 0; i < GPT2_NUM_PARAMS; i++) P += sizes[i];
        double wte_payload = 0.0, want = checkpoint_optimizer_bytes(a.model, rec[k], 0, 0, &wte_payload);
        checkpoint_path(path, sizeof path, dir, "optim", 2, ".bin");
        struct stat st;
        double optim = stat(path, &st) == 0 ? (double)st.st_size : -1;
        checkpoint_path(path, sizeof path, dir, "state", 2, ".bin");
        double state = stat(path, &st) == 0 ? (double)st.st_size : -1;
        checkpoint_path(path, sizeof path, dir, "DONE", 2, "");
        double done = stat(path, &st) == 0 ? (double)st.st_size : -1;
        checkpoint_path(path, sizeof path, dir, "model", 2, ".bin");
        EXPECT(stat(path, &st) != 0, "%s: a model file in the checkpoint", rec[k]);
        EXPECT(optim == want && state == 8 * STATE_WORDS && done == 0, "%s: optimizer file %.0f bytes (expected %.0f), "
               "trainer state %.0f (%d), DONE %.0f (0)", rec[k], optim, want, state, 8 * STATE_WORDS, done);
        EXPECT((double)r.checkpoint_bytes == optim + state, "%s: the trainer reports %lld bytes, the files hold %.0f",
               rec[k], (long long)r.checkpoint_bytes, optim + state);
        EXPECT(wte_payload / (double)sizes[GPT2_WTE] == target[k], "%s: wte's record %.5f bytes per parameter, target %.5f",
               rec[k], wte_payload / (double)sizes[GPT2_WTE], target[k]);
        printf("    %-9s checkpoint %8.0f bytes for %lld parameters: %.4f bytes per parameter (wte: %.5f; target %.5f)\n",
               rec[k], optim + state, (long long)P, (optim + state) / (double)P, wte_payload / (double)sizes[GPT2_WTE], target[k]);
        test_remove_tree(dir, 1);
    }
}

// The format word and block size field of the first record (wte) of the optimizer file of step k in
// dir (DESIGN.md §7: after its name, n, and in versions 3 and 4 the shard's offset and total). 1 on success.
static int first_record(const char *dir, int64_t k, uint32_t *format, int64_t *block) {
    char path[512];
    checkpoint_optim_path(path, sizeof path, dir, k, 0, 0);
    int64_t size = 0;
    uint8_t *d = slurp(path, &size);
    uint32_t version = 0, len = 0;
    if (d && size > 28) { memcpy(&version, d + 8, 4); memcpy(&len, d + 24, 4); }
    size_t at = 28 + (size_t)len + 8 + (version >= 3 ? 16 : 0);
    int ok = d && size > 28 && (int64_t)at + 16 <= size;
    if (ok) { memcpy(format, d + at, 4); memcpy(block, d + at + 8, 8); }
    EXPECT(ok, "%s: no first record", path);
    free(d);
    return ok;
}

// The 4-bit ablations reach the library: -M linear sets the 4-bit records' map (format bits 8..15),
// -V rank1 the matrices' row size (wte's block field 128 + C 2^16) and the state bytes of a hand count
// (v's rows' and columns' maxima in place of an absmax per 128); the -rn recipes keep bf16 weights
// and no master (correction field 0), 4bit-sr stochastic rounding (0x80). A run with -V rank1 -M
// linear stopped and resumed with both left out continues bit for bit; given with another value
// they are refused. -V with 8-bit recipes or without a second moment, -M with flash, -K with 4-bit
// recipes and an unknown -V are refused, naming what they need.
static void test_four_ablations(void) {
    const char *rec[3] = {"4bit-int8", "4bit-sr", "4bit-rn"};
    const uint32_t master[3] = {1, 0x80, 0};
    GPT2Config c;
    for (int k = 0; k < 3; k++) {
        char dir[256];
        snprintf(dir, sizeof dir, "%s/ablate_%s", tdir, rec[k]);
        TrainArgs a;
        tiny_args(&a, rec[k], "adamw", 2);
        a.out_dir = dir;
        a.map = BNB8_MAP_LINEAR;
        a.rank1 = 1;
        TrainResult r = {0};
        uint32_t format = 0;
        int64_t block = 0;
        EXPECT(train_run(&a, &r) == 0 && isfinite(r.last_loss), "%s -M linear -V rank1: %s", rec[k], train_error_text);
        gpt2_config_from_descriptor(&c, a.model);
        c.stable_embedding = 0;
        if (first_record(dir, 2, &format, &block))
            EXPECT((format & 0xff) == BNB8_STATE_4BIT && ((format >> 8) & 0xff) == BNB8_MAP_LINEAR &&
                   ((format >> 16) & 0xff) == master[k] && format >> 24 == BNB8_BF16 && block == 128 + (int64_t)c.channels * 65536,
                   "%s: wte's record has format 0x%08x, block field %lld", rec[k], format, (long long)block);
        bnb8_memory want = expected_memory(rec[k], &c);
        int64_t sizes[GPT2_NUM_PARAMS];
        gpt2_param_sizes(&c, sizes);
        // v of each 4-bit matrix: its rows' and columns' maxima; a slice (checkpoint_slices: a stochastically
        // rounded recipe's layer tensors) is a matrix of its own, a whole tensor its L layers stacked
        for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
            if (!gpt2_param_is_matrix[i] || sizes[i] < 4096) continue;
            int64_t cols = (int64_t)c.channels * (i == GPT2_FCPROJW ? 4 : 1);
            int64_t slices = checkpoint_slices(&c, rec[k], 0, 0, i), n = sizes[i] / slices;
            want.states += (double)slices * (4.0 * (double)(n / cols + cols) - 4.0 * (double)((n + 127) / 128));
        }
        EXPECT(r.memory.states == want.states, "%s -V rank1: %.0f state bytes, the hand count %.0f", rec[k],
               r.memory.states, want.states);
        test_remove_tree(dir, 1);
    }
    // 8bit-rn keeps bf16 weights rounded to nearest, no master: its records say so.
    char dir[256], dir_b[256];
    snprintf(dir, sizeof dir, "%s/ablate_8bit-rn", tdir);
    TrainArgs a;
    tiny_args(&a, "8bit-rn", "adamw", 2);
    a.out_dir = dir;
    uint32_t format = 0;
    int64_t block = 0;
    EXPECT(train_run(&a, NULL) == 0, "8bit-rn: %s", train_error_text);
    if (first_record(dir, 2, &format, &block))
        EXPECT(format == ((uint32_t)BNB8_STATE_8BIT | (uint32_t)BNB8_BF16 << 24) && block == 256, "8bit-rn: wte's record "
               "has format 0x%08x, block field %lld", format, (long long)block);
    test_remove_tree(dir, 1);
    // Stop at 3 and resume with -V and -M left out: the checkpoint's, the bits of 6 straight steps.
    snprintf(dir, sizeof dir, "%s/ablate_a", tdir);
    snprintf(dir_b, sizeof dir_b, "%s/ablate_b", tdir);
    float la[6], lb[6];
    TrainResult ra = {0}, rb = {0};
    ra.losses = la; rb.losses = lb;
    tiny_args(&a, "4bit-sr", "adamw", 6);
    a.map = BNB8_MAP_LINEAR; a.rank1 = 1;
    a.out_dir = dir;
    EXPECT(train_run(&a, &ra) == 0, "6 steps straight: %s", train_error_text);
    a.out_dir = dir_b; a.stop_after = 3;
    EXPECT(train_run(&a, &rb) == 0, "first part: %s", train_error_text);
    TrainArgs b = a;
    b.stop_after = 0; b.resume = 1;
    b.rank1 = 0; b.given['V'] = 1;
    EXPECT(train_run(&b, NULL) != 0 && strstr(train_error_text, "-V rank1") && strstr(train_error_text, "-V block"),
           "resume with -V block: '%s'", train_error_text);
    b.rank1 = 1; b.given['V'] = 0;
    b.map = BNB8_MAP_DYNAMIC; b.given['M'] = 1;
    EXPECT(train_run(&b, NULL) != 0 && strstr(train_error_text, "-M linear") && strstr(train_error_text, "-M dynamic"),
           "resume with -M dynamic: '%s'", train_error_text);
    b.map = BNB8_MAP_DYNAMIC; b.rank1 = 0; b.given['M'] = 0;   // left out: the checkpoint's
    EXPECT(train_run(&b, &rb) == 0 && rb.first_step == 4, "resumed: %s", train_error_text);
    EXPECT(memcmp(la, lb, sizeof la) == 0 && memcmp(&ra.val_loss, &rb.val_loss, 4) == 0,
           "-V rank1 -M linear: stop at 3 + resume to 6 differs from 6 straight steps");
    test_remove_tree(dir, 1);
    test_remove_tree(dir_b, 1);
    // Misuse, refused with what it needs.
    struct { const char *recipe, *optimizer; int map, rank1; int64_t blocksize; const char *want; } bad[] = {
        {"8bit", "adamw", 0, 1, 256, "-V rank1 normalizes the 4-bit"}, {"8bit-sr", "adamw", 0, 1, 256, "-r 4bit-int8"},
        {"4bit-int8", "lion", 0, 1, 256, "-p adamw"}, {"4bit-sr", "sgd", 0, 1, 256, "-p adamw"},
        {"flash", "adamw", 1, 0, 256, "-M sets"}, {"4bit-sr", "adamw", 0, 0, 512, "-K sets"}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        tiny_args(&a, bad[k].recipe, bad[k].optimizer, 2);
        a.map = bad[k].map; a.rank1 = bad[k].rank1; a.blocksize = bad[k].blocksize;
        EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, bad[k].want), "%s %s -M %d -V %d -K %lld: '%s'",
               bad[k].recipe, bad[k].optimizer, bad[k].map, bad[k].rank1, (long long)bad[k].blocksize, train_error_text);
    }
    char given[128];
    const char *v_bad[] = {"t", "-V", "rank2"}, *v_good[] = {"t", "-r", "4bit-sr", "-V", "rank1", "-M", "linear"};
    EXPECT(parse_args(3, (char **)v_bad, &a, given) < 0 && strstr(train_error_text, "block, rank1"), "-V rank2: '%s'", train_error_text);
    EXPECT(parse_args(7, (char **)v_good, &a, given) == 0 && a.rank1 == 1 && a.map == BNB8_MAP_LINEAR && given['V'],
           "-r 4bit-sr -V rank1 -M linear: %s", train_error_text);
}

// Gradient accumulation: A = 2 micro-batches of B = 4 read the same tokens as one batch of B = 8,
// and the mean of their two mean gradients is the batch's mean gradient: the same training but
// for the order of float sums. B = 4 alone shows that the second micro-batch counts. A resumed
// A = 2 run is bit-exact; resuming it with another A is refused.
static void test_accumulation(void) {
    // SGD too: Adam hardly notices gradients A times too large, SGD does
    const char *rec[4] = {"fp32", "8bit", "flash", "8bit"}, *opt[4] = {"adamw", "adamw", "adamw", "sgd"};
    enum { N = 8 };
    for (int k = 0; k < 4; k++) {
        TrainArgs a;
        tiny_args(&a, rec[k], opt[k], N);
        float l8[N], l44[N], l4[N];
        TrainResult r8 = {0}, r44 = {0}, r4 = {0};
        r8.losses = l8; r44.losses = l44; r4.losses = l4;
        a.B = 8;
        EXPECT(train_run(&a, &r8) == 0, "%s B=8: %s", rec[k], train_error_text);
        a.B = 4; a.accum = 2;
        EXPECT(train_run(&a, &r44) == 0, "%s B=4 A=2: %s", rec[k], train_error_text);
        a.accum = 1;
        EXPECT(train_run(&a, &r4) == 0, "%s B=4: %s", rec[k], train_error_text);
        double worst = 0.0;
        for (int i = 0; i < N; i++) worst = fmax(worst, fabs((double)l44[i] - l8[i]) / l8[i]);
        EXPECT(worst <= 1e-4, "%s: B=4 A=2 vs B=8: loss gap %.2e > 1e-4", rec[k], worst);
        // the validation batches are B x T: B=4 A=2 and B=4 alone see the same ones
        EXPECT(fabs((double)r4.val_loss - r44.val_loss) > 1e-2, "%s: B=4 alone validates as B=4 A=2 (%.6f vs %.6f): "
               "the second micro-batch is not seen", rec[k], (double)r4.val_loss, (double)r44.val_loss);
        if (tverbose)
            printf("    %s %s: B=4 A=2 vs B=8, %d steps: worst loss gap %.1e; val B=4 A=2 %.6f, B=4 alone %.6f\n",
                   rec[k], opt[k], N, worst, (double)r44.val_loss, (double)r4.val_loss);
    }
    // stop at step 3 and resume to 6 with A = 2: the same bits as 6 straight steps
    char dir_a[256], dir_b[256];
    tpath(dir_a, sizeof dir_a, "accum_a");
    tpath(dir_b, sizeof dir_b, "accum_b");
    TrainArgs a;
    tiny_args(&a, "8bit", "adamw", 6);
    a.accum = 2;
    float la[6], lb[6];
    TrainResult ra = {0}, rb = {0};
    ra.losses = la; rb.losses = lb;
    a.out_dir = dir_a;
    EXPECT(train_run(&a, &ra) == 0, "A=2 straight: %s", train_error_text);
    a.out_dir = dir_b; a.stop_after = 3;
    EXPECT(train_run(&a, &rb) == 0, "A=2 first part: %s", train_error_text);
    a.stop_after = 0; a.resume = 1;
    EXPECT(train_run(&a, &rb) == 0 && rb.first_step == 4, "A=2 resumed: %s", train_error_text);
    EXPECT(memcmp(la, lb, sizeof la) == 0 && memcmp(&ra.val_loss, &rb.val_loss, 4) == 0,
           "A=2: stop at 3 + resume to 6 differs from 6 straight steps");
    a.steps = 9; a.accum = 3;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "A=2"), "resume with -A 3: '%s'", train_error_text);
    test_remove_tree(dir_a, 1);
    test_remove_tree(dir_b, 1);
}

static void test_resume(void) {
    resume_case("fp32", "adamw", 0, 1, -1);
    resume_case("8bit", "adamw", 0, 1, -1);
    resume_case("8bit", "lion", 1, 0, -1);
    resume_case("fp32", "sgd", 1, 0, -1);
    resume_case("flash", "adamw", 0, 1, -1);   // the final weights compared are the decoded fp32 masters
    resume_case("flash", "lion", 1, 0, -1);
    resume_case("flash", "sgd", 0, 0, -1);
    resume_case("8bit-int8", "adamw", 0, 1, -1);
    resume_case("8bit-int8", "lion", 1, 0, -1);
    resume_case("8bit-sr", "adamw", 0, 0, -1);   // the rounding's seed travels in the optimizer file
    resume_case("8bit-sr", "sgd", 1, 0, -1);
    resume_case("4bit-int8", "adamw", 0, 1, -1);
    resume_case("4bit-int8", "lion", 1, 0, -1);
    resume_case("4bit-sr", "adamw", 0, 0, -1);
    resume_case("4bit-sr", "lion", 1, 0, -1);
    resume_case("8bit-rn", "adamw", 0, 0, -1);
    resume_case("4bit-rn", "sgd", 0, 0, -1);
    resume_case("flash", "adamw", 0, 0, CLIP_PREV);   // the previous norm travels in the trainer state
    resume_case("8bit", "adamw", 1, 0, CLIP_PREV);
    resume_case("flash", "adamw", 0, 0, CLIP_EST);     // the est rule's profile travels in the trainer state
    resume_case("8bit", "sgd", 1, 0, CLIP_EST);
}

// ------------------------------------------------------------------------------------------------
// Files

static uint8_t *slurp(const char *path, int64_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *d = (uint8_t *)malloc((size_t)*size + 1);
    if (d && fread(d, 1, (size_t)*size, f) != (size_t)*size) { free(d); d = NULL; }
    fclose(f);
    return d;
}
static void spit(const char *path, const uint8_t *d, int64_t size) {
    FILE *f = fopen(path, "wb");
    if (!f) { EXPECT(0, "cannot create %s", path); return; }
    fwrite(d, 1, (size_t)size, f);
    fclose(f);
}
// A copy of data (size bytes) written to path with int32 word `word` of the header set to value
// (word < 0: unchanged), cut or extended to new_size bytes.
static void variant(const char *path, const uint8_t *data, int64_t size, int word, int32_t value, int64_t new_size) {
    uint8_t *d = (uint8_t *)calloc((size_t)(new_size > size ? new_size : size) + 1, 1);
    if (!d) return;
    memcpy(d, data, (size_t)size);
    if (word >= 0) memcpy(d + 4 * word, &value, 4);
    spit(path, d, new_size);
    free(d);
}

typedef int (*loader_fn)(const char *path);
static int load_model_file(const char *path) { GPT2 m; int s = gpt2_load(&m, path); if (!s) gpt2_free(&m); return s; }
static int load_tokens_file(const char *path) { TokenFile t; int s = tokens_load(&t, path); free(t.tokens); return s; }
static int load_tokenizer_file(const char *path) { Tokenizer t; int s = tokenizer_load(&t, path); if (!s) tokenizer_free(&t); return s; }
static int load_state_file(const char *path) { TrainerState s; return state_load(&s, path); }

// The loader refuses path, and its message names the file and contains `what`.
static void expect_refused(loader_fn load, const char *path, const char *what, const char *label) {
    train_error_text[0] = 0;
    int s = load(path);
    EXPECT(s != 0, "%s: accepted", label);
    EXPECT(s == 0 || strstr(train_error_text, path) != NULL, "%s: message does not name %s: '%s'", label, path, train_error_text);
    EXPECT(s == 0 || !what || strstr(train_error_text, what) != NULL, "%s: message lacks '%s': '%s'", label, what, train_error_text);
    if (tverbose && s) printf("    %-28s -> %s\n", label, train_error_text);
}

static void test_model_files(void) {
    GPT2Config c;
    gpt2_config_from_descriptor(&c, "d2c32h2v60t16");   // Vp = 64 > V: padding rows in the file
    for (int stable = 0; stable < 2; stable++) {
        c.stable_embedding = stable;
        GPT2 m, back;
        if (gpt2_init_random(&m, &c, 4)) { EXPECT(0, "%s", train_error_text); return; }
        char p32[256], p16[256], bad[256];
        tpath(p32, sizeof p32, "model32.bin");
        tpath(p16, sizeof p16, "model16.bin");
        tpath(bad, sizeof bad, "bad_model.bin");
        EXPECT(gpt2_save(&m, p32, 0) == 0 && gpt2_save(&m, p16, 1) == 0, "save: %s", train_error_text);
        // fp32 round trip is exact; bf16 gives each weight rounded to nearest even
        if (gpt2_load(&back, p32) == 0) {
            EXPECT(memcmp(&back.config, &m.config, sizeof m.config) == 0, "fp32 file: config differs");
            EXPECT(back.num_parameters == m.num_parameters &&
                   memcmp(back.params_memory, m.params_memory, sizeof(float) * (size_t)m.num_parameters) == 0,
                   "fp32 file: weights differ");
            gpt2_free(&back);
        } else EXPECT(0, "%s", train_error_text);
        if (gpt2_load(&back, p16) == 0) {
            int64_t diff = 0;
            for (int64_t i = 0; i < m.num_parameters; i++)
                diff += back.params_memory[i] != bnb8_bf16_to_f32(bnb8_f32_to_bf16(m.params_memory[i]));
            EXPECT(diff == 0, "bf16 file: %lld weights are not their bf16 rounding", (long long)diff);
            EXPECT(back.config.stable_embedding == stable, "bf16 file: StableEmbedding flag lost");
            gpt2_free(&back);
        } else EXPECT(0, "%s", train_error_text);
        gpt2_free(&m);
        if (stable) continue;
        int64_t size;
        uint8_t *d = slurp(p32, &size);
        if (!d) { EXPECT(0, "cannot read %s", p32); return; }
        variant(bad, d, size, 0, 20240327, size);  expect_refused(load_model_file, bad, "magic", "model: wrong magic");
        variant(bad, d, size, 1, 4, size);         expect_refused(load_model_file, bad, "version", "model: wrong version");
        variant(bad, d, size, 1, 5, size);         expect_refused(load_model_file, bad, "oversized", "model: v3 data as bf16");
        variant(bad, d, size, 6, 64, size);        expect_refused(load_model_file, bad, "truncated", "model: header C too big");
        variant(bad, d, size, 4, 1, size);         expect_refused(load_model_file, bad, "oversized", "model: header L too small");
        variant(bad, d, size, 5, 3, size);         expect_refused(load_model_file, bad, "bad model shape", "model: C % NH != 0");
        variant(bad, d, size, 7, 50, size);        expect_refused(load_model_file, bad, "bad model shape", "model: Vp < V");
        variant(bad, d, size, 8, 2, size);         expect_refused(load_model_file, bad, "header[8]", "model: bad extension flag");
        variant(bad, d, size, 6, 1 << 30, size);   expect_refused(load_model_file, bad, "bad model shape", "model: absurd C");
        variant(bad, d, size, -1, 0, size - 1);    expect_refused(load_model_file, bad, "truncated", "model: truncated by 1 byte");
        variant(bad, d, size, -1, 0, size + 4);    expect_refused(load_model_file, bad, "oversized", "model: 4 extra bytes");
        variant(bad, d, size, -1, 0, 100);         expect_refused(load_model_file, bad, "truncated", "model: truncated header");
        variant(bad, d, size, -1, 0, 0);           expect_refused(load_model_file, bad, "truncated", "model: empty file");
        tpath(bad, sizeof bad, "no_such_model.bin");
        expect_refused(load_model_file, bad, "cannot open", "model: missing file");
        free(d);
        remove(p32); remove(p16);
        tpath(bad, sizeof bad, "bad_model.bin");
        remove(bad);
    }
}

// The mean loss of a model over the first `batches` batches of (B, T) of a tokens file, as the trainer's
// evaluate forms it (each batch's mean loss, summed in double); with grads, also the gradient of that
// mean (num_parameters floats).
static float eval_model(GPT2 *m, const TokenFile *val, int64_t B, int64_t T, int64_t batches, float *grads) {
    int64_t n = (val->count - 1) / (B * T);
    if (n > batches) n = batches;
    int *in = (int *)malloc(sizeof(int) * (size_t)(2 * B * T)), *tg = in + B * T;
    if (!in || gpt2_alloc_acts(m, B, T)) { free(in); return NAN; }
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *p = val->tokens + i * B * T;
        for (int64_t j = 0; j < B * T; j++) { in[j] = p[j]; tg[j] = p[j + 1]; }
        sum += gpt2_forward(m, in, tg, B, T);
        if (grads) gpt2_backward(m, grads, i > 0, NULL, NULL);
    }
    for (int64_t j = 0; grads && j < m->num_parameters; j++) grads[j] /= (float)n;
    free(in);
    return (float)(sum / (double)n);
}

// bf16 round to nearest even of a finite float, on its bits (the test's own).
static uint16_t rne_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Model export (SPEC §7, DESIGN.md §8.1): a run of the fp32 recipe writes its final weights with -X -F
// fp32; the same checkpoint, exported without training (-y 1, -n 1), with -F bf16; and a flash run
// with each. Each file: the header (magic, version, maxT, V, L, NH, C, Vp), exactly 1024 + 4 or 2
// bytes per parameter, the 16 tensors at the offsets llm.c's order gives (computed here from the
// shapes), wte padded to Vp rows with zeros, fp32 = the run's masters, bf16 = their RNE. Loaded back:
// the v3 file gives the run's val loss bit for bit (fp32 recipe: the weights are the masters); the v5
// file within the bar derived from the rounding: |L(w + dw) - L(w)| <= 2 sum |g_i| |dw_i|, g the
// gradient of the val loss at w: the first-order term is at most the sum, and the second-order
// term of relative changes of 2^-9 is far below it (the factor 2).
static void check_model_file(const char *path, const GPT2Config *c, const float *masters, int bf16, const char *what) {
    int64_t size;
    uint8_t *d = slurp(path, &size);
    int64_t C = c->channels, L = c->num_layers, V = c->vocab_size, Vp = c->padded_vocab_size, T = c->max_seq_len;
    // llm.c's order and shapes
    const int64_t shape[16] = {Vp * C, T * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C, L * C, L * C,
                               L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C};
    int64_t P = 0;
    for (int i = 0; i < 16; i++) P += shape[i];
    int64_t es = bf16 ? 2 : 4;
    EXPECT(d && size == 1024 + es * P, "%s: %lld bytes, expected %lld", what, (long long)size, (long long)(1024 + es * P));
    if (!d || size != 1024 + es * P) { free(d); return; }
    int32_t h[256];
    memcpy(h, d, sizeof h);
    const int32_t want[9] = {20240326, bf16 ? 5 : 3, (int32_t)T, (int32_t)V, (int32_t)L, c->num_heads, (int32_t)C, (int32_t)Vp, 0};
    for (int k = 0; k < 9; k++) EXPECT(h[k] == want[k], "%s: header[%d] = %d, expected %d", what, k, h[k], want[k]);
    int64_t bad = 0, off = 0, pad = 0;
    for (int i = 0; i < 16; i++) {
        for (int64_t j = 0; j < shape[i]; j++) {
            const uint8_t *e = d + 1024 + es * (off + j);
            if (bf16) { uint16_t b; memcpy(&b, e, 2); bad += b != rne_bf16(masters[off + j]); }
            else bad += memcmp(e, &masters[off + j], 4) != 0;
            if (i == 0 && j >= V * C) { uint32_t z = 0; pad += memcmp(e, &z, (size_t)es) != 0; }
        }
        off += shape[i];
    }
    EXPECT(bad == 0, "%s: %lld weights differ from the run's %s", what, (long long)bad, bf16 ? "masters rounded to bf16" : "masters");
    EXPECT(pad == 0, "%s: %lld of wte's padding elements are not zero", what, (long long)pad);
    free(d);
}

static void test_export(void) {
    char dir[256], v3[256], v5[256], val[256];
    tpath(dir, sizeof dir, "export_run");
    tpath(v3, sizeof v3, "export_v3.bin");
    tpath(v5, sizeof v5, "export_v5.bin");
    tpath(val, sizeof val, "val.bin");
    test_remove_tree(dir, 1);
    const char *rec[2] = {"fp32", "flash"};
    for (int k = 0; k < 2; k++) {
        TrainArgs a;
        tiny_args(&a, rec[k], "adamw", 8);
        a.model = "d2c64h4v65t16";   // Vp = 128 > V = 65: wte has padding rows
        a.out_dir = dir; a.export_path = v3; a.export_bf16 = 0;
        GPT2Config c;
        gpt2_config_from_descriptor(&c, a.model);
        c.stable_embedding = 0;
        int64_t sizes[GPT2_NUM_PARAMS], n = 0;
        gpt2_param_sizes(&c, sizes);
        for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += sizes[i];
        float *w = (float *)malloc(sizeof(float) * (size_t)n), *g = (float *)malloc(sizeof(float) * (size_t)n);
        TrainResult r = {0}, r5 = {0};
        r.final_params = w; r.final_params_count = n;
        if (!w || !g || train_run(&a, &r)) { EXPECT(0, "%s run: %s", rec[k], train_error_text); free(w); free(g); return; }
        check_model_file(v3, &c, w, 0, "fp32 export (version 3)");
        // From the checkpoint, without training: bf16.
        a.export_path = v5; a.export_bf16 = 1; a.resume = 1; a.stop_after = 1;
        EXPECT(train_run(&a, &r5) == 0 && r5.first_step == 9 && r5.last_step == 8, "%s: export from the checkpoint: %s",
               rec[k], train_error_text);
        EXPECT(memcmp(&r5.val_loss, &r.val_loss, 4) == 0, "%s: the checkpoint's val loss %.9g, the run's %.9g", rec[k],
               (double)r5.val_loss, (double)r.val_loss);
        check_model_file(v5, &c, w, 1, "bf16 export (version 5)");
        // Loaded back: val losses.
        TokenFile vf;
        GPT2 m3, m5;
        if (tokens_load(&vf, val) || gpt2_load(&m3, v3) || gpt2_load(&m5, v5)) { EXPECT(0, "%s", train_error_text); free(w); free(g); return; }
        float l3 = eval_model(&m3, &vf, a.B, a.T, a.val_batches, g);
        float l5 = eval_model(&m5, &vf, a.B, a.T, a.val_batches, NULL);
        double bound = 0.0, first = 0.0;   // the bar, and the first-order estimate of the change (printed)
        for (int64_t i = 0; i < n; i++) {
            double dw = (double)m5.params_memory[i] - (double)m3.params_memory[i];
            bound += fabs((double)g[i]) * fabs(dw);
            first += (double)g[i] * dw;
        }
        bound *= 2.0;
        if (k == 0)
            EXPECT(memcmp(&l3, &r.val_loss, 4) == 0, "fp32: the v3 file's val loss %.9g, the run's %.9g", (double)l3, (double)r.val_loss);
        EXPECT(fabs((double)l5 - (double)l3) <= bound && bound < 0.01 * l3, "%s: the v5 file's val loss %.9g, the v3 file's "
               "%.9g: |difference| %.3g, bar %.3g", rec[k], (double)l5, (double)l3, fabs((double)l5 - (double)l3), bound);
        printf("    %-5s export: run val %.6f; v3 file %.6f, v5 file %.6f (v5 - v3 %+.2e, first-order g.dw %+.2e, bar "
               "2 sum|g||dw| %.2e)\n", rec[k], (double)r.val_loss, (double)l3, (double)l5, (double)l5 - (double)l3, first, bound);
        gpt2_free(&m3); gpt2_free(&m5); free(vf.tokens);
        free(w); free(g);
        test_remove_tree(dir, 1);
        remove(v3); remove(v5);
    }
}

static void test_tokens_files(void) {
    uint16_t tok[100];
    for (int i = 0; i < 100; i++) tok[i] = (uint16_t)(i * 7 % 64);
    char good[256], bad[256];
    tpath(good, sizeof good, "tokens.bin");
    tpath(bad, sizeof bad, "bad_tokens.bin");
    write_tokens(good, tok, 100, TOKENS_MAGIC, 1, 100);
    TokenFile t;
    EXPECT(tokens_load(&t, good) == 0 && t.count == 100 && memcmp(t.tokens, tok, 200) == 0, "good file: %s", train_error_text);
    EXPECT(tokens_check_vocab(&t, 64) == 0, "vocabulary check: %s", train_error_text);
    EXPECT(tokens_check_vocab(&t, 60) != 0 && strstr(train_error_text, good), "token outside vocabulary: '%s'", train_error_text);
    DataLoader dl;
    EXPECT(loader_init(&dl, &t, 10, 10) != 0 && strstr(train_error_text, good), "too few tokens for a batch: '%s'", train_error_text);
    loader_free(&dl);
    free(t.tokens);
    write_tokens(bad, tok, 100, 20240521, 1, 100);  expect_refused(load_tokens_file, bad, "magic", "tokens: wrong magic");
    write_tokens(bad, tok, 100, TOKENS_MAGIC, 2, 100); expect_refused(load_tokens_file, bad, "version", "tokens: wrong version");
    write_tokens(bad, tok, 99, TOKENS_MAGIC, 1, 100); expect_refused(load_tokens_file, bad, "truncated", "tokens: one token short");
    write_tokens(bad, tok, 100, TOKENS_MAGIC, 1, 99); expect_refused(load_tokens_file, bad, "oversized", "tokens: one token extra");
    write_tokens(bad, tok, 100, TOKENS_MAGIC, 1, -5); expect_refused(load_tokens_file, bad, "negative", "tokens: negative count");
    write_tokens(bad, tok, 100, TOKENS_MAGIC, 1, 2000000000); expect_refused(load_tokens_file, bad, "truncated", "tokens: huge count");
    int64_t size;
    uint8_t *d = slurp(good, &size);
    if (d) { variant(bad, d, size, -1, 0, 17); expect_refused(load_tokens_file, bad, "truncated", "tokens: truncated header"); }
    free(d);
    tpath(bad, sizeof bad, "no_such_tokens.bin");
    expect_refused(load_tokens_file, bad, "cannot open", "tokens: missing file");
    remove(good);
    tpath(bad, sizeof bad, "bad_tokens.bin");
    remove(bad);
}

static void test_tokenizer_files(void) {
    char good[256], bad[256];
    tpath(good, sizeof good, "tok.bin");
    tpath(bad, sizeof bad, "bad_tok.bin");
    // 3 tokens: "a", "bc", "<eot>"
    uint8_t body[] = {1, 'a', 2, 'b', 'c', 5, '<', 'e', 'o', 't', '>'};
    int32_t h[256] = {0};
    h[0] = TOKENIZER_MAGIC; h[1] = 2; h[2] = 3; h[3] = 2;
    uint8_t file[1024 + sizeof body];
    memcpy(file, h, 1024);
    memcpy(file + 1024, body, sizeof body);
    int64_t size = (int64_t)sizeof file;
    spit(good, file, size);
    Tokenizer t;
    if (tokenizer_load(&t, good) == 0) {
        EXPECT(t.vocab_size == 3 && t.eot == 2 && t.data[t.offset[1]] == 'b' && t.data[t.offset[1] - 1] == 2, "parsed wrongly");
        tokenizer_free(&t);
    } else EXPECT(0, "good tokenizer: %s", train_error_text);
    variant(bad, file, size, 0, 20240329, size);  expect_refused(load_tokenizer_file, bad, "magic", "tokenizer: wrong magic");
    variant(bad, file, size, 1, 1, size);         expect_refused(load_tokenizer_file, bad, "version", "tokenizer: wrong version");
    variant(bad, file, size, 2, 4, size);         expect_refused(load_tokenizer_file, bad, "truncated", "tokenizer: vocab too big");
    variant(bad, file, size, 2, 2, size);         expect_refused(load_tokenizer_file, bad, "header", "tokenizer: eot >= vocab");
    variant(bad, file, size, 2, 0, size);         expect_refused(load_tokenizer_file, bad, "header", "tokenizer: empty vocabulary");
    variant(bad, file, size, -1, 0, size - 1);    expect_refused(load_tokenizer_file, bad, "truncated", "tokenizer: truncated by 1 byte");
    variant(bad, file, size, -1, 0, size + 1);    expect_refused(load_tokenizer_file, bad, "oversized", "tokenizer: 1 extra byte");
    variant(bad, file, size, -1, 0, 1000);        expect_refused(load_tokenizer_file, bad, "truncated", "tokenizer: truncated header");
    uint8_t zero[sizeof file];
    memcpy(zero, file, sizeof file);
    zero[1024 + 2] = 0;                           // "bc" gets length 0
    spit(bad, zero, size);                        expect_refused(load_tokenizer_file, bad, "length 0", "tokenizer: zero-length token");
    tpath(bad, sizeof bad, "no_such_tok.bin");
    expect_refused(load_tokenizer_file, bad, "cannot open", "tokenizer: missing file");
    remove(good);
    tpath(bad, sizeof bad, "bad_tok.bin");
    remove(bad);
}

// A trainer state file (DESIGN.md §8.5) written here, word by word: version 3 (STATE_WORDS words) or
// 2 (32) with the model's shape and the FNV-1a checksum of the words before the last in the last, or
// version 1 (16 words, no shape, no checksum).
static void write_state_words(const char *path, const int64_t *w, int words, int fix_checksum) {
    int64_t v[STATE_WORDS];
    memcpy(v, w, 8 * (size_t)words);
    if (fix_checksum && words > 16) {
        uint64_t h = 0xcbf29ce484222325ull;
        for (size_t i = 0; i < 8 * (size_t)(words - 1); i++) h = (h ^ ((const uint8_t *)v)[i]) * 0x100000001b3ull;
        v[words - 1] = (int64_t)h;
    }
    spit(path, (const uint8_t *)v, 8 * words);
}

// Two trainer states' fields (memcmp would compare the padding after config too, which state_load
// leaves as it was).
static int same_state(const TrainerState *a, const TrainerState *b) {
    size_t head = offsetof(TrainerState, config) + sizeof(GPT2Config), rest = offsetof(TrainerState, opt_steps);
    return memcmp(a, b, head) == 0 && memcmp((const char *)a + rest, (const char *)b + rest, sizeof *a - rest) == 0;
}
static void test_state_files(void) {
    char good[256], bad[256];
    tpath(good, sizeof good, "state.bin");
    tpath(bad, sizeof bad, "bad_state.bin");
    GPT2Config c;
    gpt2_config_from_descriptor(&c, "d2c32h2v60t16");
    c.stable_embedding = 1;
    TrainerState s = {7, 1234, 4, 16, 1, 0, 1, 20, 0x1234567890abcdefull, 42, 1, 3, 2, STATE_VERSION, c, 6, CLIP_PREV, 1.5, 0,
                     .train_tokens = 5000, .train_digest = -0x123456789abcdefll}, back;
    EXPECT(write_atomically(good, state_writer, &s) == 0, "%s", train_error_text);
    EXPECT(state_load(&back, good) == 0 && same_state(&back, &s), "state round trip: %s", train_error_text);
    int64_t size;
    uint8_t *d = slurp(good, &size);
    if (!d) { EXPECT(0, "cannot read %s", good); return; }
    // The words as DESIGN.md §8.5 lays them out.
    const int64_t bytes = 8 * STATE_WORDS;
    int64_t w[STATE_WORDS], want[24] = {STATE_MAGIC, STATE_VERSION, 7, 1234, (int64_t)0x1234567890abcdefull, 4, 16, 1, 0, 1, 42, 20, 1, 3, 2,
                               16, 60, 64, 2, 2, 32, 6, CLIP_PREV, 0x3ff8000000000000ll};   // 1.5's bits
    EXPECT(size == bytes, "version %d state file: %lld bytes, expected %lld", STATE_VERSION, (long long)size, (long long)bytes);
    if (size == bytes) memcpy(w, d, (size_t)bytes);
    for (int k = 0; k < 24 && size == bytes; k++) EXPECT(w[k] == want[k], "word %d is %lld, expected %lld", k, (long long)w[k], (long long)want[k]);
    EXPECT(size != bytes || (w[25] == 5000 && w[26] == -0x123456789abcdefll), "words 25, 26 (the training tokens): %lld, %lld",
           (long long)w[25], (long long)w[26]);
    EXPECT(size != bytes || w[27] == 0, "word 27 (a single process's checkpoint): %lld", (long long)w[27]);
    free(d);
    if (size != bytes) return;
    // Every field refused by the loader, the checksum made right so that it is the field that fails.
    struct { int word; int64_t value; const char *what, *label; } forged[] = {
        {0, 1, "magic", "wrong magic"}, {1, 9, "version", "wrong version"}, {2, -1, "step", "negative step"},
        {7, 99, "inconsistent", "bad recipe"}, {13, -1, "inconsistent", "negative micro-batches"},
        {14, 3, "inconsistent", "3-byte weights"}, {14, 0, "inconsistent", "no weight size"},
        {9, 2, "inconsistent", "StableEmbedding 2"}, {19, 3, "bad model shape", "C not a multiple of NH"},
        {17, 50, "bad model shape", "Vp < V"}, {20, 1ll << 40, "out of range", "C of 2^40"}, {18, 0, "bad model shape", "L = 0"},
        {21, 8, "inconsistent", "more optimizer steps than steps"}, {21, -1, "inconsistent", "negative optimizer steps"},
        {22, 3, "inconsistent", "clipping rule 3"}, {23, (int64_t)0xbff0000000000000ull, "inconsistent", "a norm of -1"},
        {25, -1, "training token count", "a negative token count"},
        {24, 1, "scale dtype", "bf16 scales for the 8bit recipe"}, {24, -1, "scale dtype", "scale dtype -1"},
        {27, -1, "ranks", "negative ranks"}, {27, 1 << 21, "ranks", "2^21 ranks"}, {39, 2, "(-V) is 2", "-V 2"},
        {3, -1, "data position", "a negative data position"}};
    for (size_t k = 0; k < sizeof forged / sizeof forged[0]; k++) {
        int64_t v[STATE_WORDS];
        memcpy(v, w, sizeof v);
        v[forged[k].word] = forged[k].value;
        write_state_words(bad, v, STATE_WORDS, 1);
        char label[96];
        snprintf(label, sizeof label, "state: %s", forged[k].label);
        expect_refused(load_state_file, bad, forged[k].what, label);
    }
    int64_t v[STATE_WORDS];
    // The est rule's profile: words 28..30, the doubles' bits; shares below 0 or adding up past 1 refused.
    TrainerState e = s;
    e.clip_rule = CLIP_EST;
    e.est_profile[0] = 0.015625; e.est_profile[1] = 0.375; e.est_profile[2] = 0.25;
    EXPECT(write_atomically(good, state_writer, &e) == 0 && state_load(&back, good) == 0 && same_state(&back, &e),
           "est state round trip: %s", train_error_text);
    d = slurp(good, &size);
    EXPECT(d && size == bytes && memcmp(d + 8 * 28, e.est_profile, 24) == 0 && ((int64_t *)d)[22] == CLIP_EST,
           "est: words 22 and 28..30");
    int64_t ew[STATE_WORDS];
    if (d && size == bytes) memcpy(ew, d, (size_t)bytes);
    free(d);
    const double bad_profile[][3] = {{-0.25, 0.5, 0.25}, {0.5, 0.5, 0.25}, {NAN, 0.5, 0.25}, {0.25, INFINITY, 0.0}};
    for (int k = 0; k < 4 && size == bytes; k++) {
        memcpy(v, ew, sizeof v);
        memcpy(&v[28], bad_profile[k], 24);
        write_state_words(bad, v, STATE_WORDS, 1);
        expect_refused(load_state_file, bad, "est rule's shares", "state: est profile");
    }
    memcpy(v, ew, sizeof v);
    const double none[3] = {NAN, NAN, NAN};
    memcpy(&v[28], none, 24);
    write_state_words(bad, v, STATE_WORDS, 1);
    EXPECT(state_load(&back, bad) == 0 && isnan(back.est_profile[0]) && isnan(back.est_profile[2]), "est, no profile yet: %s",
           train_error_text);
    memcpy(v, w, sizeof v);
    v[3] ^= 1;                                // a damaged word, the checksum left as it was
    write_state_words(bad, v, STATE_WORDS, 0); expect_refused(load_state_file, bad, "checksum", "state: a flipped bit");
    write_state_words(bad, w, STATE_WORDS - 1, 0); expect_refused(load_state_file, bad, "truncated", "state: truncated");
    spit(bad, (const uint8_t *)w, 12);        expect_refused(load_state_file, bad, "truncated", "state: 12 bytes");
    memcpy(v, w, sizeof v);
    v[STATE_WORDS - 1] = 0;
    write_state_words(bad, v, STATE_WORDS, 0);
    FILE *f = fopen(bad, "ab");
    if (f) { fwrite(v, 8, 1, f); fclose(f); }
    expect_refused(load_state_file, bad, "oversized", "state: oversized");
    // Version 1 (16 words): loads, with the fields it has; oversized at 32 words.
    memcpy(v, w, sizeof v);
    v[1] = 1; v[14] = 0; v[15] = 0;
    write_state_words(bad, v, 16, 0);
    EXPECT(state_load(&back, bad) == 0 && back.version == 1 && back.step == 7 && back.rng == s.rng && back.accum == 3 &&
           back.weight_bytes == 0 && back.clip_rule == CLIP_EXACT && isnan(back.prev_norm) && isnan(back.est_profile[1]),
           "version 1 state file (the exact rule, no previous norm): %s", train_error_text);
    write_state_words(bad, v, 32, 0);         expect_refused(load_state_file, bad, "oversized", "state: version 1 of 32 words");
    // Word 24, the flash recipe's group scale dtype: every one round-trips, 0 is e6m10 (the version 2
    // files written before the word, with e6m10 scales), 4 is none; version 1 with flash is bf16.
    TrainerState fl = s;
    fl.recipe = find_recipe("flash");
    for (int k = 0; k < num_scale_dtypes; k++) {
        fl.scale_dtype = k;
        EXPECT(write_atomically(bad, state_writer, &fl) == 0 && state_load(&back, bad) == 0 &&
               same_state(&back, &fl), "flash state with %s scales: %s", scale_dtypes[k].name, train_error_text);
    }
    EXPECT(scale_dtypes[0].dtype == BNB8_E6M10, "word 24 = 0: e6m10");
    memcpy(v, w, sizeof v);
    v[7] = fl.recipe; v[24] = num_scale_dtypes;
    write_state_words(bad, v, STATE_WORDS, 1);         expect_refused(load_state_file, bad, "scale dtype", "state: flash, scale dtype 4");
    v[1] = 1; v[14] = 0; v[15] = 0;
    write_state_words(bad, v, 16, 0);
    EXPECT(state_load(&back, bad) == 0 && back.version == 1 && scale_dtypes[back.scale_dtype].dtype == BNB8_BF16,
           "version 1 flash state: bf16 scales (%lld): %s", (long long)back.scale_dtype, train_error_text);
    // The optimizer's state file is the library's; its refusal reaches the trainer with the path.
    TrainArgs a;
    train_args_default(&a);
    a.model = "d1c32h1t8"; a.B = 1; a.T = 8; a.recipe = "8bit"; a.optimizer = "adamw"; a.lr = 1e-3f;
    a.weight_decay = 0.1f; a.device = 1; a.val_path = ""; a.tokenizer_path = ""; a.verbose = 0;
    Trainer t;
    if (trainer_open(&t, &a) == 0) {
        bnb8_optimizer *opt = t.opt;
        char op[256];
        tpath(op, sizeof op, "optim.bin");
        EXPECT(bnb8_optimizer_save(opt, op) == 0, "%s", bnb8_last_error());
        if ((d = slurp(op, &size))) {
            variant(bad, d, size, -1, 0, size - 3);
            EXPECT(bnb8_optimizer_load(opt, bad) != 0 && strstr(bnb8_last_error(), bad), "optimizer file: '%s'", bnb8_last_error());
            free(d);
        }
        remove(op);
    } else EXPECT(0, "%s", train_error_text);
    trainer_free(&t);
    remove(good);
    remove(bad);
}

// The committed data loads, decodes, and a tiny GPT-2-vocabulary model runs a few steps on it and
// samples (the path `make train` takes, at a size that fits a test).
static void test_fortunes_smoke(void) {
    Tokenizer tok;
    if (tokenizer_load(&tok, DEFAULT_DATA_DIR "gpt2_tokenizer.bin")) { EXPECT(0, "%s", train_error_text); return; }
    EXPECT(tok.vocab_size == 50257 && tok.eot == 50256, "tokenizer: vocab %d, eot %d", tok.vocab_size, tok.eot);
    EXPECT(tok.data[tok.offset[50256] - 1] == 13 && memcmp(tok.data + tok.offset[50256], "<|endoftext|>", 13) == 0,
           "token 50256 is not <|endoftext|>");
    EXPECT(memcmp(tok.data + tok.offset[464] - 1, "\3The", 4) == 0, "token 464 is not 'The'");
    TrainArgs a;
    train_args_default(&a);
    a.model = "d1c32h1"; a.B = 2; a.T = 16; a.steps = 3; a.eval_every = 3; a.val_batches = 2; a.verbose = 0;
    TrainResult r = {0};
    EXPECT(train_run(&a, &r) == 0, "%s", train_error_text);
    EXPECT(r.first_loss > 10.0f && r.first_loss < 11.5f, "first loss %.4f, expected about ln 50257 = 10.8", (double)r.first_loss);
    EXPECT(isfinite(r.val_loss), "val loss %g", (double)r.val_loss);
    a.model = "d1c32h1t16"; a.B = 1; a.T = 16; a.seed = 2; a.device = 1;
    a.val_path = ""; a.tokenizer_path = "";
    Trainer t;
    if (trainer_open(&t, &a) == 0) {
        int ids[16];
        t.rng.s = 5;
        int64_t n = generate(&t, tok.eot, 40, ids);
        EXPECT(n == 16 && ids[0] == 50256, "generated %lld tokens", (long long)n);
        for (int64_t i = 0; i < n; i++) EXPECT(ids[i] >= 0 && ids[i] < 50257, "token %d", ids[i]);
    } else EXPECT(0, "%s", train_error_text);
    trainer_free(&t);
    tokenizer_free(&tok);
}

// Descriptors, flags, settings the trainer refuses, the schedule.
// The prev clipping rule (-N prev). Its arithmetic: step_scale against a double computation, the
// norm above, equal to and below the clip, none known (NAN), clipping off, two micro-batches. In a
// run (8bit keeps fp32 gradients on the CPU, which the optimizer reads): each step's norm is the
// double norm of the gradients the hook sees, within the summation bound; the steps clipped are
// those whose previous step's norm exceeds the clip; step 1 is not clipped (its loss and step 2's
// equal an unclipped run's, bit for bit: the per-layer slices the rule registers step the same).
static double direct_norm[40];
static void record_norm(GPT2 *m, float *grads, bnb8_optimizer *opt, int64_t step) {
    (void)opt;
    double s = 0.0;
    for (int64_t i = 0; i < m->num_parameters; i++) s += (double)grads[i] * grads[i];
    direct_norm[step - 1] = sqrt(s);
}
static void test_clip_rule(void) {
    const struct { double norm; float clip; int64_t accum; } c[] = {
        {2.0, 1.0f, 1}, {1.0, 1.0f, 1}, {0.5, 1.0f, 1}, {NAN, 1.0f, 1}, {5.0, 0.0f, 1}, {3.0, 1.5f, 2}, {1.0000001, 1.0f, 1}};
    for (int k = 0; k < (int)(sizeof c / sizeof c[0]); k++) {
        double want = (c[k].clip > 0.0f && c[k].norm > (double)c[k].clip ? (double)(float)((double)c[k].clip / c[k].norm) : 1.0)
                      / (double)c[k].accum;
        float got = step_scale(c[k].norm, c[k].clip, c[k].accum);
        EXPECT((double)got == (double)(float)want, "step_scale(%g, %g, %lld) = %.9g, expected %.9g", c[k].norm,
               (double)c[k].clip, (long long)c[k].accum, (double)got, want);
    }
    EXPECT(step_scale(2.0, 1.0f, 1) == 0.5f && step_scale(1.0, 1.0f, 1) == 1.0f && step_scale(0.5, 1.0f, 1) == 1.0f,
           "above / equal / below the clip");
    const int64_t N = 30;
    TrainArgs a;
    tiny_args(&a, "8bit", "adamw", N);
    a.grad_clip = 0.0f;
    float l0[30], l1[30];
    double norms[30], sorted[30];
    TrainResult r0 = {0}, r1 = {0};
    r0.losses = l0; r0.norms = sorted;
    EXPECT(train_run(&a, &r0) == 0, "unclipped: %s", train_error_text);
    for (int i = 1; i < N; i++)   // insertion sort: the unclipped run's median norm is the clip
        for (int j = i; j > 0 && sorted[j - 1] > sorted[j]; j--) { double x = sorted[j]; sorted[j] = sorted[j - 1]; sorted[j - 1] = x; }
    float clip = (float)sorted[N / 2];
    a.clip_rule = CLIP_PREV;
    r1.losses = l1; r1.norms = norms;
    for (int i = 0; i < 40; i++) direct_norm[i] = NAN;
    a.grad_clip = clip;   // inside the run's norms: some steps clipped, some not
    train_after_backward = record_norm;
    EXPECT(train_run(&a, &r1) == 0, "-N prev: %s", train_error_text);
    train_after_backward = NULL;
    int64_t n = 0, expected = 0;
    GPT2Config cfg;
    gpt2_config_from_descriptor(&cfg, a.model);
    int64_t sizes[GPT2_NUM_PARAMS];
    gpt2_param_sizes(&cfg, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += sizes[i];
    for (int s = 0; s < N; s++) {
        double bound = 2.0 * (double)n * 0x1p-53 * direct_norm[s];   // sqrt halves the sums' relative bound
        EXPECT(fabs(norms[s] - direct_norm[s]) <= bound, "step %d: norm %.17g, direct %.17g", s + 1, norms[s], direct_norm[s]);
        if (s > 0) expected += direct_norm[s - 1] > (double)clip;
    }
    EXPECT(r1.clipped_steps == expected && expected > 0 && expected < N - 1, "%lld steps clipped, expected %lld of %lld",
           (long long)r1.clipped_steps, (long long)expected, (long long)N);
    EXPECT(memcmp(l0, l1, 2 * sizeof(float)) == 0, "steps 1-2 with -N prev: %.9g %.9g, unclipped %.9g %.9g", (double)l1[0],
           (double)l1[1], (double)l0[0], (double)l0[1]);
    EXPECT(memcmp(l0, l1, sizeof l0) != 0, "-N prev -g %g trained as unclipped", (double)clip);
    if (tverbose) printf("    -N prev -g %.4f: %lld of %lld steps clipped; norms %.4f .. %.4f\n", (double)clip,
                         (long long)r1.clipped_steps, (long long)N, norms[0], norms[N - 1]);
}

// The est clipping rule (-N est). Its arithmetic against direct double computations: est_shares (a
// profile, none yet: the parameters' shares; an odd L, so the halves differ) as the running sum of the
// expected per-group shares in long double; est_update (first step, then the running mean). In a run
// on the CPU (fp32 recipe + SGD: the first step moves each weight by lr x scale x g, exactly in
// double, so the scale each group took is read off the weights): the scale of every group is
// step_scale of sqrt(prefix / F(j)) from the direct sums of the gradients the hook sees; the clip is
// the median of those norms, so some groups are clipped and some not; each step's norm is the
// direct one; the steps clipped are those whose norm exceeds the clip.
static double est_grads[3][200000];
static int64_t est_n;
static void record_grads(GPT2 *m, float *grads, bnb8_optimizer *opt, int64_t step) {
    (void)opt;
    est_n = m->num_parameters;
    if (step <= 3 && est_n <= 200000) for (int64_t i = 0; i < est_n; i++) est_grads[step - 1][i] = grads[i];
    record_norm(m, grads, opt, step);
}
// The est group of element e of parameter i: 0 the final LayerNorm, 1..L layers L-1..0, L+1 the embeddings.
static int est_group_of(const int64_t *sizes, int L, int i, int64_t e) {
    if (gpt2_param_is_layer(i)) return L - (int)(e / (sizes[i] / L));
    return i == GPT2_LNFW || i == GPT2_LNFB ? 0 : L + 1;
}
static void test_est_rule(void) {
    GPT2Config c;
    gpt2_config_from_descriptor(&c, "d5c32h2v64t16");
    int L = c.num_layers, top = 3;
    int64_t sizes[GPT2_NUM_PARAMS], total = 0, layers = 0;
    gpt2_param_sizes(&c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) { total += sizes[i]; layers += gpt2_param_is_layer(i) ? sizes[i] : 0; }
    double got[7], poison = NAN;
    const double profiles[2][3] = {{NAN, NAN, NAN}, {0.03125, 0.4, 0.17}};
    for (int k = 0; k < 2; k++) {
        for (int j = 0; j < L + 2; j++) got[j] = poison;
        est_shares(profiles[k], &c, got);
        long double p0 = k ? profiles[k][0] : (long double)(sizes[GPT2_LNFW] + sizes[GPT2_LNFB]) / total;
        long double lt = k ? profiles[k][1] / top : (long double)layers / total / L;   // per layer, top half
        long double lb = k ? profiles[k][2] / (L - top) : (long double)layers / total / L;
        long double f = p0;
        for (int j = 0; j <= L + 1; j++) {
            if (j >= 1 && j <= L) f += j <= top ? lt : lb;
            double want = j == L + 1 ? 1.0 : (double)f;
            EXPECT(fabs(got[j] - want) <= 8 * 0x1p-53 * want, "est_shares profile %d group %d: %.17g, direct %.17g", k, j,
                   got[j], want);
        }
    }
    double sums[7] = {0.5, 3.0, 2.0, 1.25, 0.75, 0.5, 12.0}, prof[3] = {NAN, NAN, NAN};
    long double tot = 0.0L;
    for (int j = 0; j < 7; j++) tot += sums[j];
    long double x[3] = {sums[0] / tot, (sums[1] + sums[2] + sums[3]) / tot, (sums[4] + sums[5]) / tot};
    est_update(prof, sums, L);
    for (int k = 0; k < 3; k++) EXPECT(fabs(prof[k] - (double)x[k]) <= 4 * 0x1p-53 * x[k], "est_update first: %.17g vs %.17Lg", prof[k], x[k]);
    double before[3] = {prof[0], prof[1], prof[2]}, s2[7] = {1.0, 0.5, 0.25, 8.0, 0.0, 2.0, 1.0};
    tot = 0.0L;
    for (int j = 0; j < 7; j++) tot += s2[j];
    long double y[3] = {s2[0] / tot, (s2[1] + s2[2] + s2[3]) / tot, (s2[4] + s2[5]) / tot};
    est_update(prof, s2, L);
    for (int k = 0; k < 3; k++) {
        long double want = EST_DECAY * (long double)before[k] + (1.0L - EST_DECAY) * y[k];
        EXPECT(fabs(prof[k] - (double)want) <= 8 * 0x1p-53 * want, "est_update mean: %.17g vs %.17Lg", prof[k], want);
    }
    double zeros[7] = {0}, keep[3] = {prof[0], prof[1], prof[2]};
    est_update(prof, zeros, L);
    EXPECT(memcmp(prof, keep, sizeof keep) == 0, "est_update of an all-zero step changes the profile");

    // A run on the CPU: fp32 + SGD, one step from the same start clipped (-N est) and not (-g 0).
    TrainArgs a;
    tiny_args(&a, "fp32", "sgd", 1);
    a.model = "d5c32h2v64t16"; a.eval_every = 0; a.warmup = 0;
    gpt2_config_from_descriptor(&c, a.model);
    gpt2_param_sizes(&c, sizes);
    int64_t n = 0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += sizes[i];
    float *w0 = malloc(4 * (size_t)n), *w1 = malloc(4 * (size_t)n);
    if (!w0 || !w1 || n > 200000) { EXPECT(0, "out of memory or a model too large (%lld)", (long long)n); free(w0); free(w1); return; }
    TrainResult r0 = {0}, r1 = {0};
    r0.final_params = w0; r0.final_params_count = n;
    a.grad_clip = 0.0f; a.clip_rule = CLIP_EST;
    train_after_backward = record_grads;
    EXPECT(train_run(&a, &r0) == 0, "-N est -g 0: %s", train_error_text);
    // the direct groups: sums of squares in backward's order, prefixes, norms with the parameters' shares
    double S[7] = {0}, norm[7] = {0}, sorted[7] = {0}, share[7] = {0};
    est_shares(profiles[0], &c, share);
    for (int i = 0, off = 0; i < GPT2_NUM_PARAMS; off += (int)sizes[i++])
        for (int64_t e = 0; e < sizes[i]; e++) S[est_group_of(sizes, L, i, e)] += est_grads[0][off + e] * est_grads[0][off + e];
    double prefix = 0.0;
    for (int g = 0; g < L + 2; g++) { prefix += S[g]; norm[g] = sqrt(prefix / share[g]); sorted[g] = norm[g]; }
    for (int i = 1; i < L + 2; i++)
        for (int j = i; j > 0 && sorted[j - 1] > sorted[j]; j--) { double t = sorted[j]; sorted[j] = sorted[j - 1]; sorted[j - 1] = t; }
    a.grad_clip = (float)sorted[(L + 2) / 2];
    r1.final_params = w1; r1.final_params_count = n;
    EXPECT(train_run(&a, &r1) == 0, "-N est -g %g: %s", (double)a.grad_clip, train_error_text);
    float lr = lr_schedule(&a, optimizers[2].lr, 1);
    int clipped = 0, unclipped = 0;
    for (int g = 0; g < L + 2; g++) {   // the scale each group took: 1 - sum(dw g) / (lr sum(g^2)), least squares
        double num = 0.0, den = 0.0;
        for (int i = 0, off = 0; i < GPT2_NUM_PARAMS; off += (int)sizes[i++])
            for (int64_t e = 0; e < sizes[i]; e++) {
                if (est_group_of(sizes, L, i, e) != g) continue;
                double gr = est_grads[0][off + e];
                num += ((double)w1[off + e] - w0[off + e]) * gr;
                den += gr * gr;
            }
        double took = 1.0 - num / ((double)lr * den), want = step_scale(norm[g], a.grad_clip, 1);
        EXPECT(fabs(took - want) <= 1e-4, "group %d: took scale %.6f, direct %.6f (norm %.6f, clip %.6f)", g, took, want,
               norm[g], (double)a.grad_clip);
        clipped += want < 1.0; unclipped += want == 1.0;
    }
    EXPECT(clipped > 0 && unclipped > 0, "groups clipped %d, not %d: the clip does not split them", clipped, unclipped);
    // A longer run: each step's norm is the direct one; the steps clipped are those above the clip.
    const int64_t N = 12;
    double norms[12];
    TrainResult r2 = {0};
    r2.norms = norms;
    tiny_args(&a, "8bit", "adamw", N);
    a.clip_rule = CLIP_EST; a.grad_clip = 0.0f;
    for (int i = 0; i < 40; i++) direct_norm[i] = NAN;
    EXPECT(train_run(&a, &r2) == 0, "-N est: %s", train_error_text);
    a.grad_clip = (float)direct_norm[N / 2];
    EXPECT(train_run(&a, &r2) == 0, "-N est -g %g: %s", (double)a.grad_clip, train_error_text);
    train_after_backward = NULL;
    int64_t expected = 0, np = 0;
    gpt2_config_from_descriptor(&c, a.model);
    gpt2_param_sizes(&c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) np += sizes[i];
    for (int s = 0; s < N; s++) {
        double bound = 2.0 * (double)np * 0x1p-53 * direct_norm[s];
        EXPECT(fabs(norms[s] - direct_norm[s]) <= bound, "step %d: norm %.17g, direct %.17g", s + 1, norms[s], direct_norm[s]);
        expected += direct_norm[s] > (double)a.grad_clip;
    }
    EXPECT(r2.clipped_steps == expected && expected > 0, "%lld steps clipped, expected %lld", (long long)r2.clipped_steps,
           (long long)expected);
    if (tverbose) printf("    -N est: first step %d groups clipped, %d not (clip %.4f); %lld of %lld steps clipped\n", clipped,
                         unclipped, (double)a.grad_clip, (long long)r2.clipped_steps, (long long)N);
    free(w0); free(w1);
}

// Checkpoints over NCCL (trainer/nccl.c) by what the CPU build reaches: the rank files' names, the
// check that every rank's file is there, the trainer state's word 27 (the ranks), and a resume with
// another number of ranks refused with a message that says how to resume (a checkpoint made as by
// 2 ranks, resumed by this single process); asking for ranks without NCCL built is refused.
static void test_ranks_checkpoint(void) {
    char path[512], dir[256], want[512];
    snprintf(dir, sizeof dir, "%s/ranks", tdir);
    checkpoint_optim_path(path, sizeof path, dir, 12, 0, 0);
    snprintf(want, sizeof want, "%s/optim_00000012.bin", dir);
    EXPECT(strcmp(path, want) == 0, "a single process's optimizer file: %s", path);
    checkpoint_optim_path(path, sizeof path, dir, 12, 1, 4);
    snprintf(want, sizeof want, "%s/optim_00000012.rank1of4.bin", dir);
    EXPECT(strcmp(path, want) == 0, "rank 1 of 4: %s", path);
    checkpoint_optim_path(path, sizeof path, dir, 123456789, 7, 8);
    snprintf(want, sizeof want, "%s/optim_123456789.rank7of8.bin", dir);
    EXPECT(strcmp(path, want) == 0, "rank 7 of 8, step 123456789: %s", path);
    // every rank's file is needed: missing ones named, the lowest first
    test_remove_tree(dir, 1);
    mkdir(dir, 0755);
    EXPECT(checkpoint_missing_rank(dir, 5, 3) == 0, "no file: rank 0 missing");
    const int order[3] = {2, 0, 1}, missing[3] = {0, 1, -1};
    for (int k = 0; k < 3; k++) {
        checkpoint_optim_path(path, sizeof path, dir, 5, order[k], 3);
        spit(path, (const uint8_t *)"x", 1);
        EXPECT(checkpoint_missing_rank(dir, 5, 3) == missing[k], "after rank %d's file: missing %d, expected %d", order[k],
               checkpoint_missing_rank(dir, 5, 3), missing[k]);
    }
    EXPECT(checkpoint_missing_rank(dir, 5, 4) == 0, "ranks of 4: the files of 3 ranks are not theirs");
    EXPECT(checkpoint_missing_rank(dir, 6, 3) == 0, "another step's files");
    EXPECT(checkpoint_missing_rank(dir, 5, 0) == -1, "a single process needs no rank file");
    test_remove_tree(dir, 1);
    // a checkpoint whose trainer state says 2 ranks: this single process refuses it, saying how to resume
    TrainArgs a;
    tiny_args(&a, "flash", "adamw", 2);
    a.out_dir = dir;
    TrainerState st;
    checkpoint_path(path, sizeof path, dir, "state", 2, ".bin");
    int ok = train_run(&a, NULL) == 0 && state_load(&st, path) == 0;
    EXPECT(ok && st.ranks == 0, "a single process's checkpoint: ranks %lld (%s)", ok ? (long long)st.ranks : -1LL, train_error_text);
    st.ranks = 2;
    ok = ok && write_atomically(path, state_writer, &st) == 0;
    a.steps = 4; a.resume = 1;
    EXPECT(ok && train_run(&a, NULL) != 0 && strstr(train_error_text, "2 ranks") && strstr(train_error_text, "BNB8_RANKS=2") &&
           strstr(train_error_text, "a single process") && !strstr(train_error_text, "no earlier"),
           "resume of 2 ranks' checkpoint by one process: '%s'", train_error_text);
    test_remove_tree(dir, 1);
    setenv("BNB8_RANKS", "2", 1);
    setenv("BNB8_RANK", "0", 1);
    a.resume = 0;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "BNB8_RANKS=2") && strstr(train_error_text, "without NCCL"),
           "ranks without NCCL: '%s'", train_error_text);
    unsetenv("BNB8_RANKS");
    unsetenv("BNB8_RANK");
}

// -N prev over micro-batches: the norm it reports (and the next step clips with) is the norm of the
// mean gradient, not of the sum the micro-batches leave, against a direct one of the gradients the
// hook sees (their sum, halved).
static void test_prev_rule_norm_of_mean(void) {
    const int64_t N = 6;
    TrainArgs a;
    tiny_args(&a, "8bit", "adamw", N);
    a.accum = 2; a.clip_rule = CLIP_PREV; a.grad_clip = 1.0f; a.eval_every = 0;
    double norms[6];
    TrainResult r = {0};
    r.norms = norms;
    for (int i = 0; i < 40; i++) direct_norm[i] = NAN;
    train_after_backward = record_norm;
    EXPECT(train_run(&a, &r) == 0, "-N prev -A 2: %s", train_error_text);
    train_after_backward = NULL;
    GPT2Config cfg;
    int64_t sizes[GPT2_NUM_PARAMS], n = 0;
    gpt2_config_from_descriptor(&cfg, a.model);
    gpt2_param_sizes(&cfg, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += sizes[i];
    for (int s = 0; s < N; s++) {
        double mean = direct_norm[s] / 2.0, bound = 2.0 * (double)n * 0x1p-53 * mean;
        EXPECT(fabs(norms[s] - mean) <= bound, "step %d: norm %.17g, direct norm of the mean %.17g", s + 1, norms[s], mean);
    }
}

// -N prev counts a step as clipped by the norm it clipped with (the previous step's), not by its own.
static void test_prev_rule_counts_by_the_norm_it_clipped_with(void) {
    static Trainer t;
    char text[64];
    t.rule = CLIP_PREV; t.a.grad_clip = 1.0f;
    t.prev_norm = 2.0;
    EXPECT(clip_step_end(&t, 0.5, 0, text, sizeof text) == 1 && t.prev_norm == 0.5,
           "previous norm 2, this step's 0.5, clip 1: not counted as clipped");
    EXPECT(clip_step_end(&t, 3.0, 0, text, sizeof text) == 0 && t.prev_norm == 3.0,
           "previous norm 0.5, this step's 3, clip 1: counted as clipped");
    t.prev_norm = NAN;
    EXPECT(clip_step_end(&t, 3.0, 0, text, sizeof text) == 0, "no previous norm (the first step): counted as clipped");
    t.rule = CLIP_EXACT; t.prev_norm = NAN;
    EXPECT(clip_step_end(&t, 3.0, 0, text, sizeof text) == 1 && clip_step_end(&t, 3.0, 1, text, sizeof text) == 0,
           "exact: this step's norm; a skipped step is not clipped");
}

// A trainer state that says another step than its checkpoint's (its checksum right) is of another
// checkpoint: the resume passes it over for the one before.
static void test_resume_refuses_state_of_another_step(void) {
    char dir[256], path[512];
    snprintf(dir, sizeof dir, "%s/otherstep", tdir);
    test_remove_tree(dir, 1);
    TrainArgs a;
    tiny_args(&a, "8bit", "adamw", 2);
    a.out_dir = dir; a.ckpt_every = 1; a.eval_every = 0;
    TrainerState st;
    checkpoint_path(path, sizeof path, dir, "state", 2, ".bin");
    int ok = train_run(&a, NULL) == 0 && state_load(&st, path) == 0;
    EXPECT(ok, "%s", train_error_text);
    st.step = 3;   // the optimizer's step counts are still step 2's
    ok = ok && write_atomically(path, state_writer, &st) == 0;
    a.resume = 1;
    TrainResult r = {0};
    EXPECT(ok && train_run(&a, &r) == 0 && r.first_step == 2, "resume with step 2's state saying step 3: steps from %lld, '%s'",
           (long long)r.first_step, train_error_text);
    test_remove_tree(dir, 1);
}

// The ZeRO-1 layout pads no more than it must (the per-GPU memory rests on it): each tensor takes
// the least multiple of 4096 that holds it, and S is the least multiple of 4096 whose ranks hold them
// all; sizes that are multiples of 4096 take no padding.
static void test_shard_layout_least_padding(void) {
    test_rng rng = test_rng_new();
    enum { T = 6 };
    for (int trial = 0; trial < 200; trial++) {
        int64_t n[T], at[T], end = 0;
        for (int j = 0; j < T; j++) {
            int64_t u = 1 + (int64_t)(test_uniform(&rng) * 5);
            n[j] = trial % 2 ? 4096 * u : 1 + (int64_t)(test_uniform(&rng) * 4096 * u);
        }
        int ranks = 1 + (int)(test_uniform(&rng) * 8);
        int64_t S = shard_layout(n, T, ranks, at);
        for (int j = 0; j < T; j++) {
            EXPECT(at[j] == end, "trial %d: tensor %d at %lld, expected %lld", trial, j, (long long)at[j], (long long)end);
            end += (n[j] + 4095) / 4096 * 4096;
        }
        int64_t least = (end / 4096 + ranks - 1) / ranks * 4096;
        EXPECT(S == least && S * ranks >= end && (S - 4096) * ranks < end, "trial %d, %d ranks: S %lld, least %lld (end %lld)",
               trial, ranks, (long long)S, (long long)least, (long long)end);
        if (test_failures()) break;
    }
}

static void test_settings(void) {
    GPT2Config c;
    EXPECT(gpt2_config_from_descriptor(&c, "d12") == 0 && c.channels == 768 && c.num_heads == 12 && c.num_layers == 12 &&
           c.vocab_size == 50257 && c.padded_vocab_size == 50304 && c.max_seq_len == 1024, "d12");
    EXPECT(gpt2_config_from_descriptor(&c, "d72") == 0 && c.channels == 2880 && c.num_heads == 30, "d72");
    EXPECT(gpt2_config_from_descriptor(&c, "d48") == 0 && c.channels == 1600 && c.num_heads == 25, "d48");
    EXPECT(gpt2_config_from_descriptor(&c, "d4c128h4") == 0 && c.channels == 128 && c.num_heads == 4 && c.num_layers == 4, "d4c128h4");
    EXPECT(gpt2_config_from_descriptor(&c, "d2c32h2v64t16") == 0 && c.vocab_size == 64 && c.padded_vocab_size == 64 &&
           c.max_seq_len == 16, "tiny");
    const char *bad[] = {"", "d", "x12", "d12x", "d2c30h4", "d0", "dd2", "d2c32c32", "c32d2", "d2h0", "12"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        EXPECT(gpt2_config_from_descriptor(&c, bad[i]) != 0, "descriptor '%s' accepted", bad[i]);
    struct { int argc; const char *argv[4]; const char *what; } cases[] = {
        {2, {"t", "-Q"}, "unknown flag"}, {3, {"t", "-Q", "1"}, "unknown flag"}, {2, {"t", "-b"}, "needs a value"},
        {3, {"t", "-b", "0"}, "-b"}, {3, {"t", "-b", "x"}, "-b"}, {3, {"t", "-l", "-1"}, "-l"},
        {3, {"t", "-r", "4bit"}, "recipe"}, {3, {"t", "-p", "adam"}, "optimizer"}, {2, {"t", "file.bin"}, "unexpected"},
        {3, {"t", "-y", "2"}, "-y"}, {3, {"t", "-bb", "2"}, "unexpected"}, {3, {"t", "-D", "tpu"}, "device"},
        {3, {"t", "-R", "2"}, "-R"}, {3, {"t", "-M", "log"}, "map"}, {3, {"t", "-K", "8192"}, "-K"},
        {3, {"t", "-A", "0"}, "-A expects"}, {3, {"t", "-C", "2"}, "-C expects"}, {3, {"t", "-P", "fp16"}, "-P"},
        {3, {"t", "-r", "8bit-int16"}, "8bit-int8"}, {3, {"t", "-F", "fp16"}, "-F"}, {2, {"t", "-X"}, "needs a value"},
        {3, {"t", "-S", "e5m10"}, "e6m10, bf16, fp16, fp32"}};
    TrainArgs a;
    char given[128];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int s = parse_args(cases[i].argc, (char **)cases[i].argv, &a, given);
        EXPECT(s == -1 && strstr(train_error_text, cases[i].what), "case %zu: %d '%s'", i, s, train_error_text);
    }
    FILE *null = fopen("/dev/null", "w");
    if (null) { usage(null); fclose(null); }
    const char *help[] = {"t", "-h"};
    EXPECT(parse_args(2, (char **)help, &a, given) == 1, "-h");
    const char *good[] = {"t", "-b", "4", "-r", "fp32", "-p", "lion", "-n", "7", "-l", "1e-3", "-w", "1"};
    EXPECT(parse_args(13, (char **)good, &a, given) == 0 && a.B == 4 && a.steps == 7 && a.stable_embedding == 1 &&
           strcmp(a.optimizer, "lion") == 0 && a.lr == 1e-3f, "good flags: %s", train_error_text);
    EXPECT(given['b'] && given['r'] && given['w'] && !given['e'] && !given['g'], "flags given");
    const char *export_flags[] = {"t", "-X", "m.bin", "-F", "fp32"};
    EXPECT(parse_args(5, (char **)export_flags, &a, given) == 0 && strcmp(a.export_path, "m.bin") == 0 && a.export_bf16 == 0,
           "-X m.bin -F fp32: %s", train_error_text);
    parse_args(1, (char **)export_flags, &a, given);
    EXPECT(a.export_path[0] == 0 && a.export_bf16 == 1, "-X and -F default: none, bf16");
    const char *scales[] = {"t", "-S", "fp16"};
    EXPECT(parse_args(3, (char **)scales, &a, given) == 0 && scale_dtypes[a.scale_dtype].dtype == BNB8_F16, "-S fp16: %s",
           train_error_text);
    parse_args(1, (char **)scales, &a, given);
    EXPECT(a.scale_dtype == -1, "-S default: -1 (e6m10, or the checkpoint's)");
    const char *more[] = {"t", "-A", "3", "-C", "1"};
    EXPECT(parse_args(5, (char **)more, &a, given) == 0 && a.accum == 3 && a.recompute == 1, "-A 3 -C 1: %s", train_error_text);
    const char *parity[] = {"t", "-r", "8bit-int8", "-P", "fp32"};
    EXPECT(parse_args(5, (char **)parity, &a, given) == 0 && a.parity == 1 && strcmp(a.recipe, "8bit-int8") == 0,
           "-r 8bit-int8 -P fp32: %s", train_error_text);
    // The GPU's defaults fill what the command line left out, and only that.
    const char *gpu_flags[] = {"t", "-r", "8bit", "-n", "9"};
    EXPECT(parse_args(5, (char **)gpu_flags, &a, given) == 0, "%s", train_error_text);
    apply_gpu_defaults(&a, given);
    EXPECT(strcmp(a.model, "d12") == 0 && strcmp(a.recipe, "8bit") == 0 && a.release == 0 && a.grad_clip == 1.0f &&
           a.steps == 9 && a.B == 16 && a.T == 1024 && a.lr == 6e-4f, "GPU defaults with -r 8bit");
    parse_args(1, (char **)gpu_flags, &a, given);
    apply_gpu_defaults(&a, given);
    EXPECT(strcmp(a.recipe, "flash") == 0 && a.release == 1 && a.grad_clip == 1.0f && a.clip_rule == -1,
           "GPU defaults: flash + release, clipped (prev, check_settings's default under release)");
    const char *exact[] = {"t", "-N", "exact"};
    EXPECT(parse_args(3, (char **)exact, &a, given) == 0 && a.clip_rule == CLIP_EXACT, "-N exact: %s", train_error_text);
    apply_gpu_defaults(&a, given);
    EXPECT(a.release == 0, "GPU defaults with -N exact: no release");
    const char *bad_rule[] = {"t", "-N", "maybe"};
    EXPECT(parse_args(3, (char **)bad_rule, &a, given) < 0 && strstr(train_error_text, "exact, prev"), "-N maybe: '%s'",
           train_error_text);
    // The ablations' options reach the optimizer: a linear map, one absmax per tensor (the state
    // file's records, checked by the library's tests, say which); only for the 8bit recipe.
    tiny_args(&a, "8bit", "adamw", 3);
    TrainResult blocks = {0}, ab = {0};
    EXPECT(train_run(&a, &blocks) == 0, "%s", train_error_text);
    a.map = BNB8_MAP_LINEAR; a.blocksize = 0;
    EXPECT(train_run(&a, &ab) == 0 && isfinite(ab.last_loss), "linear map, one block: '%s'", train_error_text);
    EXPECT(ab.memory.states < blocks.memory.states, "one absmax per tensor: %.0f state bytes, blocks of 256: %.0f",
           ab.memory.states, blocks.memory.states);
    a.blocksize = 100;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "blocksize 100"), "-K 100: '%s'", train_error_text);
    tiny_args(&a, "fp32", "adamw", 3);
    a.map = BNB8_MAP_LINEAR;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "-r 8bit"), "-M with fp32: '%s'", train_error_text);
    tiny_args(&a, "flash", "adamw", 3);
    a.blocksize = 512;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "-r 8bit"), "-K with flash: '%s'", train_error_text);
    // -S sets the flash recipe's group scales: refused with another recipe
    for (int k = 0; k < 3; k++) {
        const char *rec[3] = {"fp32", "8bit", "8bit-int8"};
        tiny_args(&a, rec[k], "adamw", 3);
        a.scale_dtype = 1;
        EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "-S") && strstr(train_error_text, "-r flash"),
               "-S bf16 with %s: '%s'", rec[k], train_error_text);
    }
    // 8bit-int8 has the 8-bit states of 8bit: the ablations apply; its weights carry the correction
    tiny_args(&a, "8bit-int8", "adamw", 3);
    a.map = BNB8_MAP_LINEAR; a.blocksize = 0;
    EXPECT(train_run(&a, &ab) == 0 && isfinite(ab.last_loss) && ab.memory.correction == (double)ab.memory.params,
           "8bit-int8, linear map, one block: '%s'", train_error_text);
    // the fp32 parity model (-P fp32) keeps fp32 weights and gradients and no master, on the CPU too
    tiny_args(&a, "8bit-int8", "adamw", 3);
    a.parity = 1;
    EXPECT(train_run(&a, &ab) == 0 && ab.memory.weights == 4.0 * (double)ab.memory.params && ab.memory.correction == 0.0 &&
           ab.memory.gradients == 4.0 * (double)ab.memory.params, "8bit-int8 -P fp32: '%s'", train_error_text);
    // Gradient release is the GPU's (every recipe), without clipping; a CPU-only build has no GPU.
    tiny_args(&a, "flash", "adamw", 3);
    a.release = 1;
    a.device = 1;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "GPU only"), "release on the CPU: '%s'", train_error_text);
    a.release = 0; a.recompute = 1;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "-C 1"), "recompute on the CPU: '%s'", train_error_text);
    a.recompute = 0;
    if (!gpu_available()) {
        tiny_args(&a, "8bit", "adamw", 3);
        a.device = 2;
        EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "GPU"), "-D gpu without one: '%s'", train_error_text);
    }
    tiny_args(&a, "flash", "adamw", 3);
    EXPECT(train_run(&a, NULL) == 0, "flash: '%s'", train_error_text);
    tiny_args(&a, "8bit", "adamw", 3);
    a.ckpt_every = 1;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "-o"), "checkpoints without -o: '%s'", train_error_text);
    tiny_args(&a, "8bit", "adamw", 3);
    a.T = 17;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "maxT"), "T > maxT: '%s'", train_error_text);
    // Every schedule value: warm-up rises linearly, cosine ends at final_lr_frac * lr.
    tiny_args(&a, "8bit", "adamw", 100);
    a.warmup = 10; a.final_lr_frac = 0.1f;
    EXPECT(lr_schedule(&a, 1.0f, 1) == 0.1f && lr_schedule(&a, 1.0f, 10) == 1.0f, "warm-up");
    EXPECT(fabsf(lr_schedule(&a, 1.0f, 100) - 0.1f) < 1e-7f && lr_schedule(&a, 1.0f, 55) < 0.56f &&
           lr_schedule(&a, 1.0f, 55) > 0.54f, "cosine");
}

void tests_train(void) {
    tverbose = getenv("BNB8_TEST_VERBOSE") != NULL;
    snprintf(tdir, sizeof tdir, "/tmp/bnb8_train_XXXXXX");
    if (!mkdtemp(tdir)) { printf("test_train: mkdtemp failed\n"); return; }
    make_data_files();
    test_run("train: gradients vs finite differences of a double forward", test_gradients);
    test_run("train: the same with StableEmbedding", test_gradients_stable);
    test_run("train: forward and backward give the same bits on 1 and 3 threads", test_thread_independence);
    test_run("train: 50 steps lower the loss; every recipe within 2% of fp32; bytes per parameter", test_training);
    test_run("train: stop and resume is bit-exact (every recipe; adamw, lion, sgd; the version 1 layout)",
             test_resume);
    test_run("train: checkpoint sizes by the formats: fp32 12, 8bit 6.03, 8bit-int8 5.03, flash 5.125, 8bit-sr 4.03, 4bit-int8 4.0625, "
             "4bit-sr 3.0625 bytes/param",
             test_checkpoint_sizes);
    test_run("train: gradient accumulation: B=4 x 2 micro-batches trains as B=8; resume", test_accumulation);
    test_run("train: -M linear and -V rank1 reach the 4-bit records; -rn keeps no master; resume with them; misuse refused",
             test_four_ablations);
    test_run("train: -N prev: step_scale's arithmetic; the norm vs a direct one; the steps it clips", test_clip_rule);
    test_run("train: -N est: its shares and profile vs direct ones; each group's scale and norm in a run", test_est_rule);
    test_run("train: model files (fp32 v3, bf16 v5) round trip; bad ones refused", test_model_files);
    test_run("train: export to llm.c model files (fp32 v3, bf16 v5): layout, loss when loaded back", test_export);
    test_run("train: -l 0 changes no weight; 1 step at lr 1e-2 moves most", test_zero_lr);
    test_run("train: tokens files: bad ones refused, naming the file", test_tokens_files);
    test_run("train: tokenizer files: bad ones refused, naming the file", test_tokenizer_files);
    test_run("train: trainer and optimizer state files: bad ones refused", test_state_files);
    test_run("train: the embedded fortunes data, a few steps and a sample", test_fortunes_smoke);
    test_run("train: descriptors, flags, schedule", test_settings);
    test_run("train: checkpoints of several ranks: file names, every rank's file, word 27, another N refused", test_ranks_checkpoint);
    test_run("train: -N prev over 2 micro-batches: the norm of the mean gradient vs a direct one", test_prev_rule_norm_of_mean);
    test_run("train: -N prev counts a step clipped by the norm it clipped with", test_prev_rule_counts_by_the_norm_it_clipped_with);
    test_run("train: resume passes over a trainer state of another step for the checkpoint before",
             test_resume_refuses_state_of_another_step);
    test_run("train: the ZeRO-1 layout pads each tensor and each rank's part to the least multiple of 4096",
             test_shard_layout_least_padding);
    test_remove_tree(tdir, 1);
}
