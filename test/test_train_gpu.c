/*
test_train_gpu.c — the trainer on the GPU (train_gpt2_8bit.c built with -DTRAIN_CUDA) against the
same trainer on the CPU: `make test-gpt2-gpu` runs it after the model's own test (test_gpt2_cuda.cu).

  parity   fp32 recipe on the fp32 parity model (-P fp32), one SGD step: loss and every tensor's
           update (W1 - W0) on the GPU within 1e-4 relative of the CPU's (SGD: the update is the
           gradient, so this checks the gradients; Adam's first step is sign(g) and would turn
           rounding noise into full-size differences);
  bf16     every recipe on the bf16 model (bf16 weights + master on the GPU, fp32 compute on the
           CPU): every loss of 20 steps within 1% of the CPU's; 8-bit block-wise states within twice
           the CPU's own sensitivity (its 8bit vs 8bit-int8 runs: loss spikes move with the master);
  release  each recipe with gradient release equals itself without it bit for bit (clipping off):
           the per-layer slices are stepped inside backward with the same per-element math;
  clip     the prev and est clipping rules (-N prev, -N est, clipping some steps): flash and 8bit with
           release equal themselves without it bit for bit (losses, masters, norms, steps clipped);
           their norms equal the exact rule's within the rounding of gpt2_cuda_grad_norm's float sums;
  recompute  flash with activation recomputation (-C 1) equals flash without, bit for bit;
  accum    B=2 x 2 micro-batches (-A 2) trains as B=4 on the GPU (fp32 parity model + SGD within 1e-4,
           flash within 1%, bf16 gradient sums); release refuses -A 2 and -N exact (even at -g 0);
  resume   stop at step 3, resume to 6: bit-identical to a run that never stopped, for fp32, 8bit,
           8bit-int8, flash, flash + release (-N est, its profile in the checkpoint), and 8bit on the
           fp32 parity model; each checkpoint's bytes
           equal the formats' (fp32 and 8bit: an fp32 master and no bf16 weights; about 12, 6.03,
           5.03, 5.125 bytes per parameter);
  nccl     the data parallel path (trainer/nccl.c) with one rank (BNB8_RANKS=1): every recipe, 8 steps
           of -N prev and -N est (each without and with gradient release) and of -N exact, with some
           clipped, equals the plain GPU path bit for bit (losses, norms, masters, steps clipped); -N
           exact with release is refused over NCCL with a message; checkpoints with one rank: its file
           optim_s.rank0of1.bin, stop at 3 + resume to 6 bit-exact (flash, 8bit, flash + release), a damaged or missing
           rank file falls back to the checkpoint before, a resume by another number of ranks (a single
           process) refused, saying how;
  memory   d12 (-w 0, B=16, T=1024): persistent bytes per parameter 16, 10.031, 7.031, 7.125 for fp32,
           8bit, 8bit-int8, flash, and 14, 8.031, 5.031, 5.125 with release (no gradient buffer), and
           the device memory measured by cudaMemGetInfo within 5% of the computed total; tokens/s
           printed (measured, not asserted).

Data: the embedded fortunes files. The last line is "N passed, M failed"; exit status 1 on failure.
*/
#define _POSIX_C_SOURCE 200809L   // setenv
#include "trainer/trainer.h"
#include "trainer/settings.h"
#include "trainer/tensors.h"
#include "trainer/checkpoint.h"
#include "trainer/clip.h"
#include "trainer/device.h"
#include "test/checkpoint_bytes.h"
#include "test/test.h"
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *scratch = "build/test_train_gpu.tmp";

static void small_args(TrainArgs *a, const char *recipe, const char *optimizer, int64_t steps, int device) {
    train_args_default(a);
    a->model = "d2c64h2";           // GPT-2's vocabulary: the fortunes tokens as they are
    a->val_path = ""; a->tokenizer_path = "";
    a->B = 4; a->T = 64; a->steps = steps; a->warmup = 2;
    a->recipe = recipe; a->optimizer = optimizer; a->device = device;
    a->stable_embedding = 0;
    a->eval_every = 0; a->gen_tokens = 0; a->verbose = 0;
}

static int64_t num_params(const char *desc) {
    GPT2Config c;
    if (gpt2_config_from_descriptor(&c, desc)) return -1;
    c.stable_embedding = 0;
    int64_t s[GPT2_NUM_PARAMS], n = 0;
    gpt2_param_sizes(&c, s);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += s[i];
    return n;
}

static int run(TrainArgs *a, float *losses, float *params, int64_t n, TrainResult *r) {
    TrainResult local = {0};
    if (!r) r = &local;
    double *norms = r->norms;
    memset(r, 0, sizeof *r);
    r->norms = norms;
    r->losses = losses;
    r->final_params = params;
    r->final_params_count = n;
    int s = train_run(a, r);
    if (s) printf("  train_run (%s, %s%s, %s): %s\n", a->recipe, a->device == 2 ? "GPU" : "CPU",
                  a->parity ? " fp32 parity model" : "", a->release ? "release" : "no release", train_error_text);
    return s;
}

static void test_parity_fp32(void) {
    int64_t n = num_params("d2c64h2");
    float *w0 = malloc(4 * (size_t)n), *cpu = malloc(4 * (size_t)n), *gpu = malloc(4 * (size_t)n);
    float lc[1], lg[1];
    TrainArgs a;
    GPT2 m0;
    GPT2Config c;
    gpt2_config_from_descriptor(&c, "d2c64h2");
    c.stable_embedding = 0;
    small_args(&a, "fp32", "sgd", 1, 1);
    a.parity = 1;   // fp32 weights and gradients on both devices
    int ok = w0 && cpu && gpu && gpt2_init_random(&m0, &c, a.seed) == 0;
    if (ok) { memcpy(w0, m0.params_memory, 4 * (size_t)n); gpt2_free(&m0); }
    memset(gpu, 0xff, 4 * (size_t)n);   // poison: NaN unless written
    ok = ok && run(&a, lc, cpu, n, NULL) == 0;
    a.device = 2;
    ok = ok && run(&a, lg, gpu, n, NULL) == 0;
    EXPECT(ok, "parity runs");
    if (ok) {
        EXPECT(fabsf(lg[0] - lc[0]) <= 1e-4f * fabsf(lc[0]), "loss GPU %.7f CPU %.7f", (double)lg[0], (double)lc[0]);
        int64_t sizes[GPT2_NUM_PARAMS], off = 0;
        gpt2_param_sizes(&c, sizes);
        double worst = 0.0;
        for (int i = 0; i < GPT2_NUM_PARAMS; off += sizes[i], i++) {
            if (!sizes[i]) continue;
            double dmax = 0.0, emax = 0.0;
            for (int64_t j = off; j < off + sizes[i]; j++) {
                double dc = (double)cpu[j] - w0[j], dg = (double)gpu[j] - w0[j];
                dmax = fmax(dmax, fabs(dc));
                emax = isfinite(dg) ? fmax(emax, fabs(dg - dc)) : INFINITY;
            }
            double rel = dmax > 0.0 ? emax / dmax : emax;
            worst = fmax(worst, rel);
            EXPECT(rel <= 1e-4, "tensor %s: update differs by %.3g of its largest (bar 1e-4)", gpt2_param_names[i], rel);
        }
        printf("  parity: fp32 SGD step, loss %.6f vs %.6f, worst tensor update difference %.2e (bar 1e-4)\n",
               (double)lg[0], (double)lc[0], worst);
    }
    free(w0); free(cpu); free(gpu);
}

static const char *all_recipes[4] = {"fp32", "8bit", "8bit-int8", "flash"};

// Each recipe on the GPU's bf16 model against the CPU's fp32 compute, 20 steps at lr 3e-3. The bar is
// 1% per step, except for 8-bit block-wise states: this short run's loss spikes (steps 15 and 19)
// move with any perturbation there, so their bar is twice the CPU's own sensitivity, the largest
// per-step gap between its 8bit and 8bit-int8 runs (masters 1e-4 apart), and at least 1%.
static void test_bf16_losses(void) {
    float lc[4][20], lg[4][20];
    int ok[4];
    for (int k = 0; k < 4; k++) {
        TrainArgs a;
        small_args(&a, all_recipes[k], "adamw", 20, 1);
        ok[k] = run(&a, lc[k], NULL, 0, NULL) == 0;
        a.device = 2;
        ok[k] = ok[k] && run(&a, lg[k], NULL, 0, NULL) == 0;
        EXPECT(ok[k], "bf16 runs (%s)", all_recipes[k]);
    }
    double sensitivity = 0.0;
    for (int s = 0; ok[1] && ok[2] && s < 20; s++) sensitivity = fmax(sensitivity, fabs((double)lc[2][s] - lc[1][s]) / lc[1][s]);
    printf("  bf16: the CPU's 8bit vs 8bit-int8, 20 steps: largest per-step gap %.3f%%\n", 100 * sensitivity);
    for (int k = 0; k < 4; k++) {
        if (!ok[k]) continue;
        double worst = 0.0, bar = k == 1 || k == 2 ? fmax(0.01, 2.0 * sensitivity) : 0.01;
        for (int s = 0; s < 20; s++) worst = fmax(worst, fabs((double)lg[k][s] - lc[k][s]) / lc[k][s]);
        EXPECT(worst <= bar, "%s: a GPU loss differs from the CPU's by %.3f%% (bar %.3f%%)", all_recipes[k], 100 * worst, 100 * bar);
        printf("  bf16: %-9s on the GPU (bf16 model) vs the CPU, 20 steps: loss %.4f -> %.4f vs %.4f -> %.4f, worst gap "
               "%.3f%% (bar %.3f%%)\n", all_recipes[k], (double)lg[k][0], (double)lg[k][19], (double)lc[k][0], (double)lc[k][19],
               100 * worst, 100 * bar);
    }
}

// Every recipe: the per-layer slices (8-bit blocks of 256 and 4-bit blocks of 128 align with them) step
// as the whole tensors do; weights rounded stochastically are sliced with release and without (their
// random bits follow the tensor's name: trainer/tensors.c).
static void test_release_equal(void) {
    static const char *recipes_[] = {"fp32", "8bit", "8bit-int8", "flash", "8bit-sr", "4bit-int8", "4bit-sr"};
    int64_t n = num_params("d2c64h2");
    float *p0 = malloc(4 * (size_t)n), *p1 = malloc(4 * (size_t)n), l0[5], l1[5];
    for (int k = 0; k < (int)(sizeof recipes_ / sizeof recipes_[0]) && p0 && p1; k++) {
        const char *recipe = recipes_[k];
        TrainArgs a;
        small_args(&a, recipe, "adamw", 5, 2);
        a.grad_clip = 0.0f;
        int ok = run(&a, l0, p0, n, NULL) == 0;
        a.release = 1;
        ok = ok && run(&a, l1, p1, n, NULL) == 0;
        EXPECT(ok, "release runs (%s)", recipe);
        if (!ok) continue;
        EXPECT(memcmp(l0, l1, sizeof l0) == 0, "%s release: losses differ", recipe);
        EXPECT(memcmp(p0, p1, 4 * (size_t)n) == 0, "%s release: the masters after 5 steps differ from the run without "
               "release", recipe);
        printf("  release: %-9s with gradient release = without, 5 steps: %s\n", recipe,
               memcmp(p0, p1, 4 * (size_t)n) == 0 ? "bit-identical" : "DIFFERENT");
    }
    free(p0); free(p1);
}

// The prev and est clipping rules (-N prev, -N est) on the bf16 model, flash and 8bit: with release
// each equals itself without release bit for bit (losses, masters, each step's norm, the steps
// clipped), at a clip that clips some steps (the unclipped run's median norm); and its norms (the
// optimizer's sums as it reads the gradients; est's group sums, double per thread) equal the exact
// rule's (gpt2_cuda_grad_norm: float sums of at most ceil(n / 2^18) terms per thread and 8 levels
// per block) within that sum's rounding.
static void test_release_clip(void) {
    const char *rec[2] = {"flash", "8bit"};
    const int S = 8;
    int64_t n = num_params("d2c64h2");
    float *p0 = malloc(4 * (size_t)n), *p1 = malloc(4 * (size_t)n), l0[8], l1[8];
    double e[8], sorted[8], n0[8], n1[8];
    for (int k = 0; k < 4 && p0 && p1; k++) {
        int rule = k < 2 ? CLIP_PREV : CLIP_EST;
        TrainArgs a;
        small_args(&a, rec[k % 2], "adamw", S, 2);
        TrainResult rx = {0}, r0 = {0}, r1 = {0};
        a.grad_clip = 0.0f; a.clip_rule = CLIP_EXACT;
        rx.norms = e;
        int ok = run(&a, l0, p0, n, &rx) == 0;
        a.clip_rule = rule;
        r0.norms = n0;
        ok = ok && run(&a, l0, p0, n, &r0) == 0;
        double bar = ((double)((n + 262143) / 262144) + 8.0) * 0x1p-24;
        for (int s = 0; ok && s < S; s++)
            EXPECT(fabs(n0[s] - e[s]) <= bar * e[s], "%s step %d: %s rule's norm %.9g, exact rule's %.9g (bar %.3g rel)",
                   rec[k % 2], s + 1, clip_rule_names[rule], n0[s], e[s], bar);
        memcpy(sorted, e, sizeof sorted);
        for (int i = 1; i < S; i++)
            for (int j = i; j > 0 && sorted[j - 1] > sorted[j]; j--) { double x = sorted[j]; sorted[j] = sorted[j - 1]; sorted[j - 1] = x; }
        a.grad_clip = (float)sorted[S / 2];
        r0.norms = n0; r1.norms = n1;
        ok = ok && run(&a, l0, p0, n, &r0) == 0;
        a.release = 1;
        ok = ok && run(&a, l1, p1, n, &r1) == 0;
        const char *rn = clip_rule_names[rule];
        EXPECT(ok, "-N %s runs (%s): %s", rn, rec[k % 2], train_error_text);
        if (!ok) continue;
        int same = memcmp(l0, l1, sizeof l0) == 0 && memcmp(p0, p1, 4 * (size_t)n) == 0 && memcmp(n0, n1, sizeof n0) == 0 &&
                   r0.clipped_steps == r1.clipped_steps;
        EXPECT(same, "%s -N %s: release differs from no release (losses, masters, norms or %lld vs %lld steps clipped)",
               rec[k % 2], rn, (long long)r1.clipped_steps, (long long)r0.clipped_steps);
        EXPECT(r0.clipped_steps > 0, "%s -N %s -g %g: no step clipped", rec[k % 2], rn, (double)a.grad_clip);
        printf("  clip: %-5s -N %-4s -g %.3f, %lld of %d steps clipped: release = without, %s; norms vs exact within %.2g\n",
               rec[k % 2], rn, (double)a.grad_clip, (long long)r1.clipped_steps, S, same ? "bit-identical" : "DIFFERENT", bar);
    }
    free(p0); free(p1);
}

// Activation recomputation (-C 1) changes where activations live, not one bit of the training.
static void test_recompute_equal(void) {
    int64_t n = num_params("d2c64h2");
    float *p0 = malloc(4 * (size_t)n), *p1 = malloc(4 * (size_t)n), l0[5], l1[5];
    TrainArgs a;
    small_args(&a, "flash", "adamw", 5, 2);
    int ok = p0 && p1 && run(&a, l0, p0, n, NULL) == 0;
    a.recompute = 1;
    ok = ok && run(&a, l1, p1, n, NULL) == 0;
    EXPECT(ok, "recompute runs");
    if (ok) {
        int same = memcmp(l0, l1, sizeof l0) == 0 && memcmp(p0, p1, 4 * (size_t)n) == 0;
        EXPECT(same, "recompute: losses or masters after 5 steps differ from the run without it");
        printf("  recompute: flash with -C 1 = flash without, 5 steps: %s\n", same ? "bit-identical" : "DIFFERENT");
    }
    free(p0); free(p1);
}

// Gradient accumulation on the GPU: B=2 x 2 micro-batches (the second backward adds to the
// gradients) trains as B=4, fp32 recipe on the fp32 parity model with SGD (which sees a gradient A
// times too large) and flash with AdamW (bf16 gradients summed in bf16); release with -A 2 is refused.
static void test_accumulation(void) {
    const char *rec[2] = {"fp32", "flash"}, *opt[2] = {"sgd", "adamw"};
    const double bar[2] = {1e-4, 1e-2};   // fp32: summation order only; flash: bf16 gradient sums
    for (int k = 0; k < 2; k++) {
        float l4[6], l22[6];
        TrainArgs a;
        small_args(&a, rec[k], opt[k], 6, 2);
        a.parity = k == 0;   // fp32 sums: only their order differs
        int ok = run(&a, l4, NULL, 0, NULL) == 0;
        a.B = 2; a.accum = 2;
        ok = ok && run(&a, l22, NULL, 0, NULL) == 0;
        EXPECT(ok, "%s accumulation runs", rec[k]);
        if (!ok) continue;
        double worst = 0.0;
        for (int s = 0; s < 6; s++) worst = fmax(worst, fabs((double)l22[s] - l4[s]) / l4[s]);
        EXPECT(worst <= bar[k], "%s %s: B=2 A=2 vs B=4: loss gap %.2e > %.0e", rec[k], opt[k], worst, bar[k]);
        printf("  accumulation: %s %s on the GPU, B=2 x 2 micro-batches vs B=4, 6 steps: worst loss gap %.1e (bar %.0e)\n",
               rec[k], opt[k], worst, bar[k]);
    }
    TrainArgs a;
    small_args(&a, "flash", "adamw", 2, 2);
    a.release = 1; a.grad_clip = 0.0f; a.accum = 2;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "-A 1"), "release with -A 2: '%s'", train_error_text);
    // -N exact, even unclipped: its norm pass needs every layer's gradients, which release never holds
    // (refused before the first step, not at step 1's norm)
    a.accum = 1; a.clip_rule = CLIP_EXACT;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "not with -N exact"), "release with -N exact -g 0: '%s'",
           train_error_text);
}

// Stop at step 3 and resume to 6 equals 6 straight steps, bit for bit, for every recipe (the lean ones
// too: stochastic rounding draws from (seed, step, tensor, element), which the checkpoint keeps), and
// the checkpoint holds the bytes its formats give (test/checkpoint_bytes.h) and the trainer state.
static void test_resume(void) {
    // release: clipped at 1 by est (the default under release), whose profile is in the checkpoint
    static const struct { const char *recipe; int release, parity; } cases[] = {
        {"fp32", 0, 0}, {"8bit", 0, 0}, {"8bit-int8", 0, 0}, {"flash", 0, 0}, {"flash", 1, 0}, {"8bit", 0, 1},
        {"8bit-sr", 0, 0}, {"4bit-int8", 0, 0}, {"4bit-sr", 0, 0}, {"4bit-sr", 1, 0}};
    int64_t n = num_params("d2c64h2");
    float *p0 = malloc(4 * (size_t)n), *p1 = malloc(4 * (size_t)n);
    for (int k = 0; k < (int)(sizeof cases / sizeof cases[0]) && p0 && p1; k++) {
        float l0[6], l1[6];
        const char *recipe = cases[k].recipe;
        const char *what = cases[k].release ? " + release" : cases[k].parity ? " (fp32 parity model)" : "";
        TrainArgs a;
        small_args(&a, recipe, "adamw", 6, 2);
        a.release = cases[k].release;
        a.parity = cases[k].parity;
        test_remove_tree(scratch, 1);
        a.out_dir = scratch;
        TrainResult r0;
        int ok = run(&a, l0, p0, n, &r0) == 0;
        double want = checkpoint_optimizer_bytes("d2c64h2", recipe, a.parity, a.release, NULL) + 8.0 * STATE_WORDS;
        EXPECT(!ok || (double)r0.checkpoint_bytes == want, "%s%s: checkpoint of %lld bytes, the formats give %.0f",
               recipe, what, (long long)r0.checkpoint_bytes, want);
        if (ok) printf("  checkpoint: %s%s: %lld bytes, %.4f bytes per parameter (%.0f by the formats)\n", recipe, what,
                       (long long)r0.checkpoint_bytes, (double)r0.checkpoint_bytes / (double)n, want);
        test_remove_tree(scratch, 1);
        memset(l1, 0, sizeof l1);
        a.stop_after = 3;
        ok = ok && run(&a, l1, NULL, 0, NULL) == 0;
        a.stop_after = 0; a.resume = 1;
        memset(p1, 0xff, 4 * (size_t)n);
        ok = ok && run(&a, l1, p1, n, NULL) == 0;
        EXPECT(ok, "resume runs (%s)", recipe);
        if (!ok) continue;
        int same = memcmp(l0, l1, sizeof l0) == 0 && memcmp(p0, p1, 4 * (size_t)n) == 0;
        EXPECT(same, "%s%s: stop at 3 + resume to 6 differs from 6 straight steps", recipe, what);
        printf("  resume: %s%s, stop at step 3 and resume to 6: %s\n", recipe, what, same ? "bit-identical" : "DIFFERENT");
    }
    test_remove_tree(scratch, 1);
    free(p0); free(p1);
}

// Under release bnb8_memory leaves the gradients out (the per-layer slices are scratch, reported apart).
static void test_memory_d12(void) {
    const double expected[8] = {16.0, 10.031, 7.031, 7.125, 14.0, 8.031, 5.031, 5.125};
    for (int k = 0; k < 8; k++) {
        const char *recipe = all_recipes[k % 4];
        TrainArgs a;
        small_args(&a, recipe, "adamw", 12, 2);
        a.model = "d12"; a.B = 16; a.T = 1024;
        if (k >= 4) { a.release = 1; a.grad_clip = 0.0f; }
        TrainResult r = {0};   // run() keeps r->norms: it must not be garbage
        const char *rel = k >= 4 ? " + release" : "";
        if (run(&a, NULL, NULL, 0, &r)) { EXPECT(0, "d12 %s%s", recipe, rel); continue; }
        bnb8_memory m = r.memory;
        double bpp = (m.weights + m.correction + m.gradients + m.states) / (double)m.params;
        EXPECT(fabs(bpp - expected[k]) < 0.0005, "d12 %s%s: %.4f bytes per parameter, expected %.3f", recipe, rel, bpp,
               expected[k]);
        double gap = (r.gpu_measured - r.gpu_computed) / r.gpu_computed;
        EXPECT(fabs(gap) <= 0.05, "d12 %s%s: measured device memory %.3f GB vs computed %.3f GB (%+.1f%%, bar 5%%)",
              recipe, rel, r.gpu_measured / 1e9, r.gpu_computed / 1e9, 100 * gap);
        printf("  d12 B=16 T=1024 %-9s%-10s %7.3f bytes/param, device memory computed %6.2f GB, measured %6.2f GB "
               "(%+.1f%%), %8.0f tokens/s, loss %.3f -> %.3f\n", recipe, rel, bpp, r.gpu_computed / 1e9,
               r.gpu_measured / 1e9, 100 * gap, r.tokens_per_second, (double)r.first_loss, (double)r.last_loss);
    }
}


// The NCCL path with one rank: the gradients pass through the exchange buffer (reduce-scatter of
// one rank: the same values), the optimizer holds every tensor whole as its one shard, the weights
// come back through the all-gather; nothing may change a bit, under -N prev (the optimizer's sums)
// and -N exact (the sum of squares of the rank's part of the exchange buffer, gpt2_cuda_sum_squares:
// gpt2_cuda_grad_norm's arithmetic), with a clip that clips some steps.
static void nccl_env(int on) {
    if (on) { setenv("BNB8_RANKS", "1", 1); setenv("BNB8_RANK", "0", 1); setenv("BNB8_NCCL_ID", "build/test_train_gpu.nccl.id", 1); }
    else { unsetenv("BNB8_RANKS"); unsetenv("BNB8_RANK"); unsetenv("BNB8_NCCL_ID"); }
}
static void test_nccl_one_rank(void) {
    const int S = 8;
    int64_t n = num_params("d2c64h2");
    float *p0 = malloc(4 * (size_t)n), *p1 = malloc(4 * (size_t)n), l0[8], l1[8];
    double n0[8], n1[8];
    for (int c = 0; c < 20 && p0 && p1; c++) {
        // every recipe: -N prev, prev + release, exact, est + release, est
        int k = c % 4, mode = c / 4, release = mode == 1 || mode == 3;
        TrainArgs a;
        small_args(&a, all_recipes[k], k == 3 ? "lion" : "adamw", S, 2);
        a.clip_rule = mode < 2 ? CLIP_PREV : mode == 2 ? CLIP_EXACT : CLIP_EST;
        a.grad_clip = 1.0f;
        a.release = release;
        TrainResult r0 = {0}, r1 = {0};
        r0.norms = n0; r1.norms = n1;
        nccl_env(0);
        int ok = 1;
        if (mode >= 2) {   // exact, est: clip at the unclipped run's median norm, so that some steps are clipped
            a.grad_clip = 0.0f;
            ok = run(&a, l0, p0, n, &r0) == 0;
            double sorted[8];
            memcpy(sorted, n0, sizeof sorted);
            for (int i = 1; i < S; i++)
                for (int j = i; j > 0 && sorted[j - 1] > sorted[j]; j--) { double x = sorted[j]; sorted[j] = sorted[j - 1]; sorted[j - 1] = x; }
            a.grad_clip = (float)sorted[S / 2];
        }
        ok = ok && run(&a, l0, p0, n, &r0) == 0;
        nccl_env(1);
        memset(p1, 0xff, 4 * (size_t)n);
        ok = ok && run(&a, l1, p1, n, &r1) == 0;
        const char *what = mode == 0 ? "-N prev" : mode == 1 ? "-N prev + release" : mode == 2 ? "-N exact"
                         : mode == 3 ? "-N est + release" : "-N est";
        EXPECT(ok, "%s %s: %s", all_recipes[k], what, train_error_text);
        int same = ok && memcmp(l0, l1, sizeof l0) == 0 && memcmp(n0, n1, sizeof n0) == 0 && memcmp(p0, p1, 4 * (size_t)n) == 0 &&
                   r0.clipped_steps == r1.clipped_steps;
        EXPECT(same, "%s %s: the NCCL path with one rank differs from the plain path (loss at step 8: %.9g vs %.9g, norm "
               "%.17g vs %.17g, %lld vs %lld steps clipped)", all_recipes[k], what, (double)l1[S - 1], (double)l0[S - 1],
               n1[S - 1], n0[S - 1], (long long)r1.clipped_steps, (long long)r0.clipped_steps);
        EXPECT(!ok || mode < 2 || r0.clipped_steps > 0, "%s %s: no step clipped at -g %g", all_recipes[k], what, (double)a.grad_clip);
        printf("  nccl: %-9s %-17s one rank = the plain GPU path: %s (last loss %.6f, %lld steps clipped)\n", all_recipes[k],
               what, same ? "bit-identical" : "DIFFERENT", (double)l1[S - 1], (long long)r1.clipped_steps);
        if (c != 0) continue;
        // the host copy of the weights is gone once the GPU model and the optimizer hold them (over NCCL
        // every rank drops it at the end of its turn to open: one host holds one copy, not one a rank)
        Trainer *t = calloc(1, sizeof *t);
        int opened = t && trainer_open(t, &a) == 0;
        EXPECT(opened && t->model.params_memory == NULL && t->model.params.wte == NULL,
               "NCCL, one rank: the host copy of the weights is still there after opening (%s)", opened ? "opened" : train_error_text);
        if (t) trainer_free(t);
        free(t);
        // what the path does not do is refused, saying so
        a.clip_rule = CLIP_EXACT; a.release = 1; a.grad_clip = 0.0f;   // (a clip with -N exact -R 1 is refused anywhere)
        EXPECT(run(&a, l1, NULL, 0, NULL) != 0 && strstr(train_error_text, "-N exact"), "-N exact -R 1 over NCCL: '%s'",
               train_error_text);
    }
    nccl_env(0);
    free(p0); free(p1);
}

static int64_t file_size(const char *path) { struct stat st; return stat(path, &st) == 0 ? (int64_t)st.st_size : -1; }

// Checkpoints over NCCL with one rank (-o): its optimizer file is optim_s.rank0of1.bin (no
// optim_s.bin), the bytes reported are the files'; stop at step 3 and resume to 6 equals 6 straight
// steps bit for bit (flash and 8bit with -N exact, flash + release with -N prev; clipping); a damaged or missing rank file makes the
// resume fall back to the checkpoint before (which re-joins NCCL); a resume by a single process of
// the ranks' checkpoint, and by a rank of a single process's, is refused saying how.
static void test_nccl_resume(void) {
    const char *rec[3] = {"flash", "8bit", "flash+R"};
    int64_t n = num_params("d2c64h2");
    float *p0 = malloc(4 * (size_t)n), *p1 = malloc(4 * (size_t)n);
    char path[512], state[512];
    for (int k = 0; k < 3 && p0 && p1; k++) {
        float l0[10], l1[10];   // -n 9: a checkpoint at 6 is not the run's last (a damaged one falls back)
        TrainArgs a;
        small_args(&a, k == 1 ? "8bit" : "flash", "adamw", 9, 2);
        a.stop_after = 6;
        a.release = k == 2;   // each backward group's weights all-gathered on resume
        a.grad_clip = 0.5f;   // -N exact, the default over NCCL (-N prev with release)
        a.out_dir = scratch;
        test_remove_tree(scratch, 1);
        nccl_env(1);
        TrainResult r0 = {0};
        int ok = run(&a, l0, p0, n, &r0) == 0;
        checkpoint_optim_path(path, sizeof path, scratch, 6, 0, 1);
        checkpoint_path(state, sizeof state, scratch, "state", 6, ".bin");
        int64_t own = file_size(path), st = file_size(state);
        char plain[512];
        checkpoint_optim_path(plain, sizeof plain, scratch, 6, 0, 0);
        EXPECT(ok && own > 0 && st == 8 * STATE_WORDS && file_size(plain) < 0 && r0.checkpoint_bytes == own + st,
               "%s: one rank's checkpoint: %s %lld bytes, %s %lld, optim_*.bin %lld (none expected), reported %lld",
               rec[k], path, (long long)own, state, (long long)st, (long long)file_size(plain), (long long)r0.checkpoint_bytes);
        test_remove_tree(scratch, 1);
        a.stop_after = 3;
        ok = ok && run(&a, l1, NULL, 0, NULL) == 0;
        a.stop_after = 6; a.resume = 1;
        memset(p1, 0xff, 4 * (size_t)n);
        TrainResult r1 = {0};
        ok = ok && run(&a, l1, p1, n, &r1) == 0;
        EXPECT(ok, "%s: one rank, stop and resume: %s", rec[k], train_error_text);
        int same = ok && memcmp(l0, l1, 6 * sizeof(float)) == 0 && memcmp(p0, p1, 4 * (size_t)n) == 0 && r1.first_step == 4;
        EXPECT(same, "%s: one rank, stop at 3 + resume to 6 differs from 6 straight steps", rec[k]);
        printf("  nccl resume: %-7s one rank (-o, -N %s, %lld steps clipped), stop at 3 and resume to 6: %s; checkpoint %lld "
               "bytes\n", rec[k], a.release ? "prev" : "exact", (long long)r0.clipped_steps, same ? "bit-identical" : "DIFFERENT", (long long)r0.checkpoint_bytes);
        // checkpoints at 3 and 6 in scratch: one at 6 damaged, then missing, falls back to 3
        checkpoint_optim_path(path, sizeof path, scratch, 6, 0, 1);
        FILE *f = fopen(path, "r+b");
        if (f) { fseek(f, 100, SEEK_SET); fputc(0x5a, f); fseek(f, -20, SEEK_END); fputc(0xa5, f); fclose(f); }
        a.stop_after = 0;
        memset(p1, 0xff, 4 * (size_t)n);
        r1.first_step = 0;
        ok = run(&a, l1, NULL, 0, &r1) == 0;
        EXPECT(ok && r1.first_step == 4, "%s: a damaged rank file at step 6: resumed at step %lld (%s)", rec[k],
               (long long)r1.first_step - 1, train_error_text);
        remove(path);   // that run wrote step 9; step 6's rank file gone: its DONE is there
        checkpoint_path(path, sizeof path, scratch, "DONE", 9, "");
        remove(path);
        r1.first_step = 0;
        ok = run(&a, l1, NULL, 0, &r1) == 0;
        EXPECT(ok && r1.first_step == 4, "%s: step 6's rank file missing: resumed at step %lld (%s)", rec[k],
               (long long)r1.first_step - 1, train_error_text);
        // another number of ranks: a single process refuses the ranks' checkpoint, saying how
        nccl_env(0);
        EXPECT(run(&a, l1, NULL, 0, NULL) != 0 && strstr(train_error_text, "BNB8_RANKS=1") &&
               strstr(train_error_text, "a single process"), "%s: one process resuming one rank's checkpoint: '%s'", rec[k],
               train_error_text);
        test_remove_tree(scratch, 1);
        a.resume = 0; a.steps = 3;
        ok = run(&a, l1, NULL, 0, NULL) == 0;
        nccl_env(1);
        a.resume = 1; a.steps = 6;
        EXPECT(ok && run(&a, l1, NULL, 0, NULL) != 0 && strstr(train_error_text, "a single process") &&
               strstr(train_error_text, "1 ranks"), "%s: one rank resuming a single process's checkpoint: '%s'", rec[k], train_error_text);
        nccl_env(0);
    }
    test_remove_tree(scratch, 1);
    free(p0); free(p1);
}

int main(void) {
    printf("bnb8 GPU trainer tests, TEST_SEED=%llu\n", (unsigned long long)test_seed());
    if (!gpu_available()) { printf("test_train_gpu: no GPU found (%s)\n0 passed, 1 failed\n", gpt2_cuda_last_error()); return 1; }
    test_run("trainer: fp32 SGD step on the GPU (fp32 parity model) = the CPU's within 1e-4", test_parity_fp32);
    test_run("trainer: every recipe (bf16 model) losses as the CPU's (1%; 8-bit states: 2x the CPU's sensitivity)", test_bf16_losses);
    test_run("trainer: every recipe + release = without, bit for bit", test_release_equal);
    test_run("trainer: -N prev, -N est: release + clip = without release, bit for bit; the norm = the exact one", test_release_clip);
    test_run("trainer: flash + recompute = flash, bit for bit", test_recompute_equal);
    test_run("trainer: B=2 x 2 micro-batches trains as B=4; release refuses -A 2 and -N exact", test_accumulation);
    test_run("trainer: stop and resume is bit-exact (every recipe, flash + release, 8bit -P fp32)", test_resume);
#ifdef TRAIN_NCCL
    test_run("trainer: the NCCL path with one rank = the plain GPU path, bit for bit, -N prev, exact and est", test_nccl_one_rank);
    test_run("trainer: NCCL checkpoints, one rank: stop and resume bit-exact, fall back, another N refused", test_nccl_resume);
#else
    printf("skip trainer: the NCCL path (this build has no NCCL: make looks for it in NCCL_HOME, the CUDA toolkit and "
           "pip's nvidia-nccl)\n");
#endif
    test_run("trainer: d12 bytes per parameter, device memory within 5%", test_memory_d12);
    return test_summary();
}
