/*
test_gpt2_cuda.cu — the GPU GPT-2 model (gpt2_cuda.cu) against the trainer's CPU model, on the device:
`make test-gpt2-gpu`. Last line: "N passed, M failed".

  parity  fp32 mode, the CPU model's weights (perturbed so that no bias is 0 and no LayerNorm weight
          1) and tokens: logits, losses, every gradient tensor, and the weights after one SGD step
          (the library's optimizer, CPU vs GPU), each within 1e-4 relative per tensor
          (max |gpu - cpu| / max |cpu|); gradients overwrite a NaN-poisoned buffer; accumulate = 1
          doubles them; gradient release (per-layer slices reused, a callback per layer) gives the
          same gradients, with the callbacks in order LNF, L-1 .. 0, EMBED.
  bf16    the same weights in bf16: forward loss within 1% of fp32, then 20 steps of AdamW (bnb8,
          32-bit states; the bf16 model's weights rounded from fp32 masters each step) side by side
          with the fp32 model, every step's loss within 1%.
  recompute  activation recomputation (config recompute = 1) against none, from the same weights and
          tokens, fp32 and bf16 (small; d4 too): loss, logits and every gradient tensor the same bits
          (memcmp), into NaN-poisoned buffers, also after accumulate = 1 and under gradient release
          (callbacks in the same order); the activation allocation smaller, and its report listing
          the one-layer buffers.
  clip    the -N est rule's device path (gpt2_cuda_clip_group): each group's sum of squares of the
          finite elements of 1..16 tensors (bf16, fp32; NaN and Inf left out) vs a long double sum,
          each call's scale vs the formula from the device's sums bit for bit, refusals, and (not
          with GPT2_TEST_QUICK) a bf16 tensor of 2^31 + 1000 elements whose sum is exact.
  d12     GPT-2 124M (L=12, C=768, NH=12, Vp=50304), B=16, T=1024, bf16: forward + backward ms,
          tokens/s, a per-phase breakdown (CUDA events) and the memory; then the same with recompute
          (time and activations next to the run without; the loss the same bits).

GPT2_TEST_QUICK=1: the small configurations only (for compute-sanitizer). The harness is test/test.h's:
random weights and tokens from TEST_SEED (printed; set it to repeat a run), TEST_ONLY=text picks tests.
*/
#include "trainer/gpt2_cuda.h"
#include "bnb8.h"
#include "test/gpt2_cpu_ref.h"
#include "test/test.h"
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <vector>
#include <algorithm>

// a model call that must succeed: on failure the test cannot go on
#define MUST(call) do { if ((call) != 0) { EXPECT(0, "%s: %s", #call, gpt2_cuda_last_error()); return; } } while (0)

static const char *names[18] = {"wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b",
                                "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb", "lnew", "lneb"};

static test_rng rng;   // the run's random weights and tokens (test.h: TEST_SEED repeats them)
static uint64_t next_u64(void) { return test_u64(&rng); }
static float randn(void) { return (float)test_randn(&rng); }

// max |a - ref| / max |ref| (max |a| when ref is all 0); inf when a holds a non-finite value.
static double rel_err(const float *a, const float *ref, int64_t n) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        num = fmax(num, fabs((double)a[i] - (double)ref[i]));
        den = fmax(den, fabs((double)ref[i]));
    }
    return den > 0.0 ? num / den : num;
}

static GPT2CudaConfig config_of(const int cfg[7]) {
    GPT2CudaConfig c = {cfg[0], cfg[1], cfg[2], cfg[3], cfg[4], cfg[5], cfg[6], 0};
    return c;
}

// Tensor offsets in the flat layout.
static void offsets_of(const int64_t sizes[18], int64_t off[18]) {
    int64_t o = 0;
    for (int i = 0; i < 18; i++) { off[i] = o; o += sizes[i]; }
}

// Training data: the embedded fortunes tokens (llm.c format), or random tokens below V if absent.
static std::vector<int> data_tokens(int V, int64_t want) {
    std::vector<int> out;
    FILE *f = fopen("dev/data/fortunes/fortunes_train.bin", "rb");
    int32_t h[256];
    if (f && fread(h, 4, 256, f) == 256 && h[0] == 20240520) {
        std::vector<uint16_t> t((size_t)h[2]);
        if (fread(t.data(), 2, t.size(), f) == t.size())
            for (size_t i = 0; i < t.size() && (int64_t)out.size() < want; i++) if (t[i] < V) out.push_back(t[i]);
    }
    if (f) fclose(f);
    while ((int64_t)out.size() < want) out.push_back((int)(next_u64() % (uint64_t)V));
    return out;
}

// ------------------------------------------------------------------------------------------------
// fp32 parity with the CPU model

typedef struct {
    int order[256], n;
    char *full;                   // device, the full gradient layout
    size_t es;                    // bytes per gradient element
    GPT2CudaGrads *slices;
    int64_t sizes[18], off[18];
    int L;
} ReleaseCtx;

// Gradient release as a consumer sees it: copy layer `which`'s slices out before they are reused.
static int release_ready(void *ctx, int which, struct CUstream_st *stream) {
    ReleaseCtx *r = (ReleaseCtx *)ctx;
    if (r->n < 256) r->order[r->n++] = which;
    if (which < 0) return 0;      // LNF, EMBED: written in place in the full buffer
    for (int i = GPT2_FIRST_LAYER_PARAM; i <= GPT2_LAST_LAYER_PARAM; i++) {
        int64_t slice = r->sizes[i] / r->L;
        if (cudaMemcpyAsync(r->full + r->es * (size_t)(r->off[i] + which * slice), r->slices->tensor[i], r->es * (size_t)slice,
                            cudaMemcpyDeviceToDevice, (cudaStream_t)stream) != cudaSuccess) return 1;
    }
    return 0;
}

// Backward of the last forward under gradient release, into full (device, the full layout in dtype,
// poisoned here): per-layer slices reused, copied out by release_ready. Returns 0, or -1 (message in
// gpt2_cuda_last_error). *order_ok: the callbacks came in order LNF, L-1 .. 0, EMBED.
static int release_backward(GPT2Cuda *m, int L, void *full, int dtype, ReleaseCtx *rc, int *order_ok) {
    int64_t sizes[18], off[18], n = gpt2_cuda_num_parameters(m), slice_total = 0;
    gpt2_cuda_param_sizes(m, sizes);
    offsets_of(sizes, off);
    size_t es = dtype == GPT2_CUDA_BF16 ? 2 : 4;
    for (int i = GPT2_FIRST_LAYER_PARAM; i <= GPT2_LAST_LAYER_PARAM; i++) slice_total += sizes[i] / L;
    void *slices = NULL;
    CUDA_CHECK(cudaMemset(full, 0xff, es * (size_t)n));
    CUDA_CHECK(cudaMalloc(&slices, es * (size_t)slice_total));
    GPT2CudaGrads rel;
    gpt2_cuda_grads_point(m, &rel, full, dtype);
    rel.reuse_layer_slice = 1;
    char *s = (char *)slices;
    for (int i = GPT2_FIRST_LAYER_PARAM; i <= GPT2_LAST_LAYER_PARAM; i++) { rel.tensor[i] = s; s += es * (size_t)(sizes[i] / L); }
    memset(rc, 0, sizeof *rc);
    rc->full = (char *)full; rc->es = es; rc->slices = &rel; rc->L = L;
    memcpy(rc->sizes, sizes, sizeof sizes);
    memcpy(rc->off, off, sizeof off);
    int status = gpt2_cuda_backward(m, &rel, 0, release_ready, rc);
    CUDA_CHECK(cudaDeviceSynchronize());
    cudaFree(slices);
    *order_ok = rc->n == L + 2 && rc->order[0] == GPT2_GRADS_LNF && rc->order[L + 1] == GPT2_GRADS_EMBED;
    for (int k = 1; k <= L && *order_ok; k++) *order_ok = rc->order[k] == L - k;
    return status;
}

// The test weights: the CPU model's, perturbed so that no bias is 0 and no LayerNorm weight 1, and
// the padding rows of wte nonzero (they must be ignored).
static void perturb(float *p, const int64_t sizes[18], const int64_t off[18], const GPT2CudaConfig *c) {
    for (int i = 0; i < 18; i++) {
        int matrix = i == 0 || i == 1 || i == 4 || i == 6 || i == 10 || i == 12;
        for (int64_t j = 0; j < sizes[i]; j++)
            if (!matrix) p[off[i] + j] += 0.05f * randn();
            else if (i == 0 && j >= (int64_t)c->vocab_size * c->channels) p[off[i] + j] = 0.02f * randn();
    }
}

static void parity(const char *desc, int stable, int B, int T) {
    void *ref = NULL;
    int cfg[7];
    if (ref_create(&ref, desc, stable, 1234, B, T, cfg)) { EXPECT(0, "ref_create %s: %s", desc, ref_error()); return; }
    GPT2CudaConfig c = config_of(cfg);
    int64_t n = ref_num_params(ref), sizes[18], off[18], BT = (int64_t)B * T, Vp = c.padded_vocab_size, L = c.num_layers;
    ref_param_sizes(ref, sizes);
    offsets_of(sizes, off);
    printf("model %s: L=%d C=%d NH=%d V=%d Vp=%d maxT=%d StableEmbedding %s, %lld parameters; B=%d T=%d\n", desc,
           c.num_layers, c.channels, c.num_heads, c.vocab_size, c.padded_vocab_size, c.max_seq_len,
           c.stable_embedding ? "on" : "off", (long long)n, B, T);
    float *p = ref_params(ref);
    perturb(p, sizes, off, &c);
    std::vector<int> in(BT), tg(BT);
    for (int64_t i = 0; i < BT; i++) { in[i] = (int)(next_u64() % (uint64_t)c.vocab_size); tg[i] = (int)(next_u64() % (uint64_t)c.vocab_size); }

    // CPU: the trainer's forward and backward
    std::vector<float> logits_cpu(BT * Vp), losses_cpu(BT), p0(p, p + n);
    float loss_cpu = ref_forward(ref, in.data(), tg.data(), B, T, logits_cpu.data(), losses_cpu.data());
    ref_backward(ref);
    const float *g_cpu = ref_grads(ref);

    // GPU, allocated for twice the T when it fits: the forward runs at a smaller T than allocated
    GPT2Cuda *m = NULL;
    int Talloc = 2 * T <= c.max_seq_len ? 2 * T : T;
    float *d_grads = NULL, *d_full = NULL;
    std::vector<float> logits(BT * Vp), losses(BT), g(n), g2(n), pg(n);
    double worst = 0.0;
    float loss = 0.0f;
    if (gpt2_cuda_create(&m, &c, GPT2_CUDA_FP32, B, Talloc)) { EXPECT(0, "create: %s", gpt2_cuda_last_error()); goto out; }
    if (gpt2_cuda_set_params(m, p0.data()) || gpt2_cuda_forward(m, in.data(), tg.data(), B, T, 0) ||
        gpt2_cuda_loss(m, &loss, losses.data()) || gpt2_cuda_get_logits(m, logits.data(), 0, BT)) {
        EXPECT(0, "forward: %s", gpt2_cuda_last_error());
        goto out;
    }
    {
        double el = rel_err(logits.data(), logits_cpu.data(), BT * Vp), es = rel_err(losses.data(), losses_cpu.data(), BT);
        double eloss = fabs((double)loss - loss_cpu) / fabs((double)loss_cpu);
        printf("  forward   logits %.2e   losses %.2e   loss %.6f vs cpu %.6f (%.2e)\n", el, es, loss, loss_cpu, eloss);
        EXPECT(el <= 1e-4 && es <= 1e-4 && eloss <= 1e-4, "forward outside 1e-4: logits %.2e losses %.2e loss %.2e", el, es, eloss);
    }

    // backward into a NaN-poisoned buffer: every element must be written
    CUDA_CHECK(cudaMalloc(&d_grads, 4 * (size_t)n));
    CUDA_CHECK(cudaMemset(d_grads, 0xff, 4 * (size_t)n));
    GPT2CudaGrads grads;
    if (gpt2_cuda_grads_point(m, &grads, d_grads, GPT2_CUDA_FP32) || gpt2_cuda_forward(m, in.data(), tg.data(), B, T, 1) ||
        gpt2_cuda_backward(m, &grads, 0, NULL, NULL)) {
        EXPECT(0, "backward: %s", gpt2_cuda_last_error());
        goto out;
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(g.data(), d_grads, 4 * (size_t)n, cudaMemcpyDeviceToHost));

    // one SGD step with the library's optimizer on both sides (lr 0.1, no momentum)
    {
        bnb8_config oc = bnb8_config_default(BNB8_SGD);
        oc.momentum = 0.0f; oc.lr = 0.1f; oc.weight_decay = 0.0f; oc.format = BNB8_STATE_32BIT;
        bnb8_optimizer *ocpu = NULL, *ogpu = NULL;
        int ok = bnb8_optimizer_create(&ocpu, BNB8_SGD, &oc) == 0 && bnb8_optimizer_create(&ogpu, BNB8_SGD, &oc) == 0;
        for (int i = 0; i < 18 && ok; i++) {
            if (!sizes[i]) continue;
            ok &= bnb8_optimizer_add(ocpu, names[i], p + off[i], BNB8_F32, (void *)(g_cpu + off[i]), BNB8_F32, sizes[i], NULL) == 0;
            ok &= bnb8_optimizer_add(ogpu, names[i], gpt2_cuda_param_tensor(m, i), BNB8_F32, grads.tensor[i], BNB8_F32, sizes[i], NULL) == 0;
        }
        ok = ok && bnb8_optimizer_step(ocpu, 0.1f, 1.0f, NULL) == 0 && bnb8_optimizer_step(ogpu, 0.1f, 1.0f, gpt2_cuda_stream(m)) == 0;
        EXPECT(ok, "optimizer: %s", bnb8_last_error());
        bnb8_optimizer_free(ocpu);
        bnb8_optimizer_free(ogpu);
        if (!ok || gpt2_cuda_get_params(m, pg.data())) { EXPECT(0, "sgd step: %s", gpt2_cuda_last_error()); goto out; }
    }
    printf("  %-9s %12s %12s %12s   (relative: max|gpu-cpu| / max|cpu| per tensor)\n", "tensor", "gradient", "sgd weights", "sgd update");
    for (int i = 0; i < 18; i++) {
        if (!sizes[i]) continue;
        std::vector<float> du(sizes[i]), dc(sizes[i]);
        for (int64_t j = 0; j < sizes[i]; j++) { du[j] = pg[off[i] + j] - p0[off[i] + j]; dc[j] = p[off[i] + j] - p0[off[i] + j]; }
        double eg = rel_err(g.data() + off[i], g_cpu + off[i], sizes[i]);
        double ew = rel_err(pg.data() + off[i], p + off[i], sizes[i]);
        double eu = rel_err(du.data(), dc.data(), sizes[i]);
        printf("  %-9s %12.2e %12.2e %12.2e\n", names[i], eg, ew, eu);
        EXPECT(eg <= 1e-4 && ew <= 1e-4, "%s: gradient %.2e, weights after SGD %.2e (bar 1e-4)", names[i], eg, ew);
        worst = fmax(worst, eg);
    }
    printf("  worst gradient tensor %.2e\n", worst);

    // accumulate = 1 adds a second copy: 2 g (restore the weights first: the SGD step moved them)
    if (gpt2_cuda_set_params(m, p0.data()) || gpt2_cuda_forward(m, in.data(), tg.data(), B, T, 1) ||
        gpt2_cuda_backward(m, &grads, 0, NULL, NULL) || gpt2_cuda_backward(m, &grads, 1, NULL, NULL)) {
        EXPECT(0, "accumulate: %s", gpt2_cuda_last_error());
        goto out;
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(g2.data(), d_grads, 4 * (size_t)n, cudaMemcpyDeviceToHost));
    {
        std::vector<float> twice(n);
        for (int64_t j = 0; j < n; j++) twice[j] = 2.0f * g[j];
        double e = rel_err(g2.data(), twice.data(), n);
        printf("  accumulate: backward twice = 2 x once within %.2e\n", e);
        EXPECT(e <= 1e-5, "accumulate: %.2e", e);
    }

    // gradient release: layer tensors in one reused slice each, copied out by the callback
    {
        CUDA_CHECK(cudaMalloc(&d_full, 4 * (size_t)n));
        ReleaseCtx rc;
        int order_ok = 0;
        if (release_backward(m, (int)L, d_full, GPT2_CUDA_FP32, &rc, &order_ok)) { EXPECT(0, "release: %s", gpt2_cuda_last_error()); goto out; }
        CUDA_CHECK(cudaMemcpy(g2.data(), d_full, 4 * (size_t)n, cudaMemcpyDeviceToHost));
        double e = rel_err(g2.data(), g.data(), n);
        printf("  release: per-layer slices give the full gradients within %.2e; %d callbacks, order %s\n", e, rc.n,
               order_ok ? "LNF, L-1..0, EMBED" : "WRONG");
        EXPECT(e <= 1e-6 && order_ok, "release: %.2e, order ok %d", e, order_ok);
        double norm = 0.0, ref_norm = 0.0;
        for (int64_t j = 0; j < n; j++) ref_norm += (double)g_cpu[j] * g_cpu[j];
        ref_norm = sqrt(ref_norm);
        if (gpt2_cuda_grad_norm(m, &grads, &norm)) { EXPECT(0, "grad_norm: %s", gpt2_cuda_last_error()); goto out; }
        // grads now holds the accumulated 2 g
        printf("  grad norm %.6f vs cpu %.6f\n", norm / 2, ref_norm);
        EXPECT(fabs(norm / 2 - ref_norm) <= 1e-4 * ref_norm, "grad norm %.6g vs %.6g", norm / 2, ref_norm);
    }
out:
    cudaFree(d_grads); cudaFree(d_full);
    gpt2_cuda_free(m);
    ref_free(ref);
}

static void test_parity_small(void) { parity("d2c64h4v100t64", 1, 4, 32); }
static void test_parity_small_plain(void) { parity("d2c64h4v100t64", 0, 4, 32); }
static void test_parity_d4(void) { parity("d4", 1, 4, 64); }

// ------------------------------------------------------------------------------------------------
// Activation recomputation: the same bits as keeping every layer's activations

// Tensors of two gradient buffers (host copies, the full layout) that differ in any bit: EXPECT per
// tensor, and the count.
static int compare_bits(const char *what, const std::vector<char> &a, const std::vector<char> &b, const int64_t sizes[18],
                        size_t es) {
    int differ = 0;
    size_t o = 0;
    for (int i = 0; i < 18; o += es * (size_t)sizes[i], i++) {
        if (!sizes[i] || memcmp(a.data() + o, b.data() + o, es * (size_t)sizes[i]) == 0) continue;
        int64_t first = 0;
        while (memcmp(a.data() + o + es * first, b.data() + o + es * first, es) == 0) first++;
        EXPECT(0, "%s: %s differs, first at element %lld", what, names[i], (long long)first);
        differ++;
    }
    return differ;
}

// Elements of a host gradient buffer (dtype) that are not finite: a write that never happened shows
// as the poison (NaN), in both runs alike.
static int64_t not_finite(const std::vector<char> &g, int64_t n, size_t es) {
    int64_t bad = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = es == 2 ? bnb8_bf16_to_f32(((const uint16_t *)g.data())[j]) : ((const float *)g.data())[j];
        bad += !isfinite(v);
    }
    return bad;
}

// One model with recompute = r from weights p and tokens (in, tg), allocated for (B, Talloc), run at
// (B, T): logits and loss of a forward, the gradients of a backward into a NaN-poisoned buffer, the
// same after a second backward with accumulate = 1, and under gradient release (callbacks in order).
typedef struct {
    std::vector<float> logits, losses;
    float loss, loss_b;
    std::vector<char> once, twice, released;
    int order[256], norder, order_ok;
    size_t act_bytes;
} RecomputeRun;

static int recompute_run(GPT2CudaConfig c, int recompute, int precision, const float *p, const int *in, const int *tg,
                         int B, int T, int Talloc, RecomputeRun *out) {
    GPT2Cuda *m = NULL;
    void *d_grads = NULL, *d_full = NULL;
    int64_t n = 0, BT = (int64_t)B * T;
    size_t es = precision == GPT2_CUDA_BF16 ? 2 : 4;
    GPT2CudaGrads grads;
    ReleaseCtx rc;
    int status = -1;
    c.recompute = recompute;
    if (gpt2_cuda_create(&m, &c, precision, B, Talloc) || gpt2_cuda_set_params(m, p)) goto out;
    n = gpt2_cuda_num_parameters(m);
    out->act_bytes = gpt2_cuda_act_bytes(m);
    out->logits.resize(BT * c.padded_vocab_size);
    out->losses.resize(BT);
    if (gpt2_cuda_forward(m, in, tg, B, T, 0) || gpt2_cuda_loss(m, &out->loss, out->losses.data()) ||
        gpt2_cuda_get_logits(m, out->logits.data(), 0, BT))
        goto out;
    CUDA_CHECK(cudaMalloc(&d_grads, es * (size_t)n));
    CUDA_CHECK(cudaMalloc(&d_full, es * (size_t)n));
    CUDA_CHECK(cudaMemset(d_grads, 0xff, es * (size_t)n));
    if (gpt2_cuda_grads_point(m, &grads, d_grads, precision) || gpt2_cuda_forward(m, in, tg, B, T, 1) ||
        gpt2_cuda_loss(m, &out->loss_b, NULL) || gpt2_cuda_backward(m, &grads, 0, NULL, NULL))
        goto out;
    out->once.resize(es * (size_t)n);
    CUDA_CHECK(cudaMemcpy(out->once.data(), d_grads, es * (size_t)n, cudaMemcpyDeviceToHost));
    // the second backward starts where the first left the one-layer buffers: at layer 0, not L-1
    if (gpt2_cuda_backward(m, &grads, 1, NULL, NULL)) goto out;
    out->twice.resize(es * (size_t)n);
    CUDA_CHECK(cudaMemcpy(out->twice.data(), d_grads, es * (size_t)n, cudaMemcpyDeviceToHost));
    if (release_backward(m, c.num_layers, d_full, precision, &rc, &out->order_ok)) goto out;
    out->released.resize(es * (size_t)n);
    CUDA_CHECK(cudaMemcpy(out->released.data(), d_full, es * (size_t)n, cudaMemcpyDeviceToHost));
    memcpy(out->order, rc.order, sizeof rc.order);
    out->norder = rc.n;
    status = 0;
out:
    cudaFree(d_grads); cudaFree(d_full);
    gpt2_cuda_free(m);
    return status;
}

static void recompute_same(const char *desc, int stable, int B, int T, int precision) {
    void *ref = NULL;
    int cfg[7];
    if (ref_create(&ref, desc, stable, 777, 0, 0, cfg)) { EXPECT(0, "ref_create %s: %s", desc, ref_error()); return; }
    GPT2CudaConfig c = config_of(cfg);
    int64_t n = ref_num_params(ref), sizes[18], off[18], BT = (int64_t)B * T;
    ref_param_sizes(ref, sizes);
    offsets_of(sizes, off);
    perturb(ref_params(ref), sizes, off, &c);
    size_t es = precision == GPT2_CUDA_BF16 ? 2 : 4;
    int Talloc = 2 * T <= c.max_seq_len ? 2 * T : T;
    printf("model %s: L=%d C=%d NH=%d V=%d, StableEmbedding %s, %s, B=%d T=%d (allocated for T=%d)\n", desc, c.num_layers,
           c.channels, c.num_heads, c.vocab_size, stable ? "on" : "off", precision == GPT2_CUDA_BF16 ? "bf16" : "fp32", B, T, Talloc);
    std::vector<int> in(BT), tg(BT);
    for (int64_t i = 0; i < BT; i++) { in[i] = (int)(next_u64() % (uint64_t)c.vocab_size); tg[i] = (int)(next_u64() % (uint64_t)c.vocab_size); }
    RecomputeRun r[2];
    for (int k = 0; k < 2; k++)
        if (recompute_run(c, k, precision, ref_params(ref), in.data(), tg.data(), B, T, Talloc, &r[k])) {
            EXPECT(0, "recompute = %d: %s", k, gpt2_cuda_last_error());
            ref_free(ref);
            return;
        }
    ref_free(ref);

    int same_fwd = memcmp(&r[0].loss, &r[1].loss, sizeof(float)) == 0 && memcmp(&r[0].loss_b, &r[1].loss_b, sizeof(float)) == 0 &&
                   memcmp(r[0].logits.data(), r[1].logits.data(), sizeof(float) * r[0].logits.size()) == 0 &&
                   memcmp(r[0].losses.data(), r[1].losses.data(), sizeof(float) * (size_t)BT) == 0;
    printf("  loss %.6f / %.6f (recompute off / on), logits and per-position losses %s\n", r[0].loss, r[1].loss,
           same_fwd ? "the same bits" : "DIFFER");
    EXPECT(same_fwd, "forward differs with recompute");
    int d1 = compare_bits("backward", r[0].once, r[1].once, sizes, es);
    int d2 = compare_bits("accumulate = 1", r[0].twice, r[1].twice, sizes, es);
    int d3 = compare_bits("release", r[0].released, r[1].released, sizes, es);
    printf("  gradients: tensors differing in any bit: backward %d, accumulated %d, release %d (of %d)\n", d1, d2, d3,
           stable ? 18 : 16);
    int64_t bad = not_finite(r[1].once, n, es) + not_finite(r[1].twice, n, es) + not_finite(r[1].released, n, es);
    EXPECT(bad == 0, "%lld gradient elements not finite (not written?)", (long long)bad);
    int same_order = r[0].norder == r[1].norder && memcmp(r[0].order, r[1].order, sizeof(int) * (size_t)r[0].norder) == 0;
    printf("  release callbacks: %d, order %s, %s with recompute off\n", r[1].norder, r[1].order_ok ? "LNF, L-1..0, EMBED" : "WRONG",
           same_order ? "the same" : "NOT the same");
    EXPECT(r[0].order_ok && r[1].order_ok && same_order, "release order: off ok %d, on ok %d, same %d", r[0].order_ok,
           r[1].order_ok, same_order);
    printf("  activations: %.3f MB with recompute off, %.3f MB on (%.1f%%)\n", r[0].act_bytes / 1e6, r[1].act_bytes / 1e6,
           100.0 * r[1].act_bytes / r[0].act_bytes);
    EXPECT(r[1].act_bytes < r[0].act_bytes, "recompute does not shrink the activations: %zu vs %zu", r[1].act_bytes, r[0].act_bytes);
}

static void test_recompute_small_fp32(void) { recompute_same("d2c64h4v100t64", 1, 4, 32, GPT2_CUDA_FP32); }
static void test_recompute_small_bf16(void) { recompute_same("d2c64h4v100t64", 1, 4, 32, GPT2_CUDA_BF16); }
static void test_recompute_d4_fp32(void) { recompute_same("d4", 0, 4, 64, GPT2_CUDA_FP32); }
static void test_recompute_d4_bf16(void) { recompute_same("d4", 0, 4, 64, GPT2_CUDA_BF16); }

// The activation report of a model: which tensors have bytes, by recompute.
static void test_recompute_report(void) {
    GPT2CudaConfig c = {64, 100, 128, 3, 4, 64, 1, 0};
    GPT2Cuda *m[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        c.recompute = k;
        MUST(gpt2_cuda_create(&m[k], &c, GPT2_CUDA_BF16, 2, 16));
    }
    for (int k = 0; k < 2; k++) {
        size_t sum = 0;
        int layers = 0, one = 0;
        printf("  recompute %d: %.1f KB\n", k, gpt2_cuda_act_bytes(m[k]) / 1e3);
        for (int i = 0; i < gpt2_cuda_num_act_tensors(); i++) {
            size_t b = gpt2_cuda_act_tensor_bytes(m[k], i);
            const char *name = gpt2_cuda_act_name(i);
            if (!b) continue;
            printf("    %-30s %10zu\n", name, b);
            sum += b;
            layers += strstr(name, "(L,") != NULL;
            one += strstr(name, "one layer") != NULL;
        }
        // off: the 13 per-layer tensors (L, ...); on: only residual3 per layer, the 12 others one layer's
        EXPECT(k ? layers == 1 && one == 12 : layers == 13 && one == 0, "recompute %d: %d (L, ...) tensors, %d one-layer ones",
               k, layers, one);
        EXPECT(sum <= gpt2_cuda_act_bytes(m[k]), "the tensors add up to more than the allocation");
    }
    gpt2_cuda_free(m[0]);
    gpt2_cuda_free(m[1]);
}

// ------------------------------------------------------------------------------------------------
// bf16 against fp32

// the bf16 model's weights from its fp32 master copy (mixed precision: the optimizer steps the masters)
__global__ static void round_to_bf16(__nv_bfloat16 *out, const float *in, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(in[i]);
}

static void bf16_vs_fp32(const char *desc, int B, int T, int steps) {
    void *ref = NULL;
    int cfg[7];
    if (ref_create(&ref, desc, 1, 99, 0, 0, cfg)) { EXPECT(0, "ref_create: %s", ref_error()); return; }
    GPT2CudaConfig c = config_of(cfg);
    int64_t n = ref_num_params(ref), sizes[18], BT = (int64_t)B * T;
    ref_param_sizes(ref, sizes);
    printf("model %s: L=%d C=%d NH=%d V=%d, %lld parameters; B=%d T=%d, AdamW lr 1e-3 after 10 warmup steps (beta2 0.95), %d steps\n", desc,
           c.num_layers, c.channels, c.num_heads, c.vocab_size, (long long)n, B, T, steps);
    std::vector<int> data = data_tokens(c.vocab_size, BT * steps + 1);
    GPT2Cuda *m32 = NULL, *m16 = NULL;
    void *g32 = NULL, *g16 = NULL, *g16f = NULL;
    float *master = NULL;   // (n,) fp32 master weights of the bf16 model
    bnb8_optimizer *o32 = NULL, *o16 = NULL;
    GPT2CudaGrads gr32, gr16, gr16f;
    std::vector<float> h32(n), h16(n), h16f(n);
    float l32 = 0.0f, l16 = 0.0f, first32 = 0.0f, first16 = 0.0f, last32 = 0.0f, last16 = 0.0f;
    double gap, worst_gap = 0.0, sum_gap = 0.0, worst_grad = 0.0;
    if (gpt2_cuda_create(&m32, &c, GPT2_CUDA_FP32, B, T) || gpt2_cuda_create(&m16, &c, GPT2_CUDA_BF16, B, T) ||
        gpt2_cuda_set_params(m32, ref_params(ref)) || gpt2_cuda_set_params(m16, ref_params(ref))) {
        EXPECT(0, "create: %s", gpt2_cuda_last_error());
        goto out;
    }
    CUDA_CHECK(cudaMalloc(&g32, 4 * (size_t)n));
    CUDA_CHECK(cudaMalloc(&g16, 2 * (size_t)n));
    CUDA_CHECK(cudaMalloc(&g16f, 4 * (size_t)n));
    CUDA_CHECK(cudaMalloc(&master, 4 * (size_t)n));
    CUDA_CHECK(cudaMemcpy(master, ref_params(ref), 4 * (size_t)n, cudaMemcpyHostToDevice));
    gpt2_cuda_grads_point(m32, &gr32, g32, GPT2_CUDA_FP32);
    gpt2_cuda_grads_point(m16, &gr16, g16, GPT2_CUDA_BF16);
    gpt2_cuda_grads_point(m16, &gr16f, g16f, GPT2_CUDA_FP32);

    // forward loss, then the gradients of the first batch (bf16 into bf16 and into fp32 buffers)
    if (gpt2_cuda_forward(m32, data.data(), data.data() + 1, B, T, 1) || gpt2_cuda_loss(m32, &l32, NULL) ||
        gpt2_cuda_forward(m16, data.data(), data.data() + 1, B, T, 1) || gpt2_cuda_loss(m16, &l16, NULL) ||
        gpt2_cuda_backward(m32, &gr32, 0, NULL, NULL) || gpt2_cuda_backward(m16, &gr16, 0, NULL, NULL) ||
        gpt2_cuda_backward(m16, &gr16f, 0, NULL, NULL)) {
        EXPECT(0, "step 0: %s", gpt2_cuda_last_error());
        goto out;
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    gap = fabs((double)l16 - l32) / l32;
    printf("  forward loss: fp32 %.5f, bf16 %.5f, gap %.3f%%\n", l32, l16, 100.0 * gap);
    EXPECT(gap <= 0.01, "bf16 forward loss gap %.3f%% > 1%%", 100.0 * gap);
    {
        std::vector<uint16_t> raw(n);
        CUDA_CHECK(cudaMemcpy(h32.data(), g32, 4 * (size_t)n, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(raw.data(), g16, 2 * (size_t)n, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(h16f.data(), g16f, 4 * (size_t)n, cudaMemcpyDeviceToHost));
        for (int64_t j = 0; j < n; j++) h16[j] = bnb8_bf16_to_f32(raw[j]);
        printf("  bf16 gradients vs fp32 (informative; relative per tensor), bf16 buffer / fp32 buffer:\n   ");
        int64_t o = 0;
        for (int i = 0; i < 18; i++) {
            if (!sizes[i]) continue;
            double a = rel_err(h16.data() + o, h32.data() + o, sizes[i]), b = rel_err(h16f.data() + o, h32.data() + o, sizes[i]);
            printf(" %s %.1e/%.1e", names[i], a, b);
            if (i == 8) printf("\n   ");
            worst_grad = fmax(worst_grad, fmax(a, b));
            o += sizes[i];
        }
        printf("\n");
        EXPECT(isfinite(worst_grad), "bf16 gradients not finite");
    }

    // training side by side: AdamW with 32-bit states on fp32 weights; the bf16 model computes in bf16
    // from fp32 masters (gradients into fp32), so only the arithmetic differs. Without masters, updates
    // below half a bf16 ulp are lost: LayerNorm gains at 1.0 (ulp 2^-7) never move at lr 1e-3.
    {
        bnb8_config oc = bnb8_config_default(BNB8_ADAMW);
        oc.lr = 1e-3f; oc.beta2 = 0.95f; oc.weight_decay = 0.0f; oc.format = BNB8_STATE_32BIT;
        int ok = bnb8_optimizer_create(&o32, BNB8_ADAMW, &oc) == 0 && bnb8_optimizer_create(&o16, BNB8_ADAMW, &oc) == 0;
        int64_t o = 0;
        for (int i = 0; i < 18 && ok; i++) {
            if (!sizes[i]) continue;
            ok &= bnb8_optimizer_add(o32, names[i], gpt2_cuda_param_tensor(m32, i), BNB8_F32, gr32.tensor[i], BNB8_F32, sizes[i], NULL) == 0;
            ok &= bnb8_optimizer_add(o16, names[i], master + o, BNB8_F32, gr16f.tensor[i], BNB8_F32, sizes[i], NULL) == 0;
            o += sizes[i];
        }
        if (!ok) { EXPECT(0, "optimizer: %s", bnb8_last_error()); goto out; }
    }
    for (int s = 0; s < steps; s++) {
        const int *x = data.data() + (int64_t)s * BT;
        if (gpt2_cuda_forward(m32, x, x + 1, B, T, 1) || gpt2_cuda_backward(m32, &gr32, 0, NULL, NULL) ||
            gpt2_cuda_forward(m16, x, x + 1, B, T, 1) || gpt2_cuda_backward(m16, &gr16f, 0, NULL, NULL) ||
            gpt2_cuda_loss(m32, &l32, NULL) || gpt2_cuda_loss(m16, &l16, NULL)) {
            EXPECT(0, "step %d: %s", s + 1, gpt2_cuda_last_error());
            goto out;
        }
        // 10 steps of linear warmup, as the trainer: at 1e-3 from step 1 the fp32 run spiked at step 13
        // (loss up 0.09 where bf16's fell) and the two runs parted by 1.8% from 0.013% the step before.
        float lr = 1e-3f * (s < 10 ? (float)(s + 1) / 10.0f : 1.0f);
        if (bnb8_optimizer_step(o32, lr, 1.0f, gpt2_cuda_stream(m32)) || bnb8_optimizer_step(o16, lr, 1.0f, gpt2_cuda_stream(m16))) {
            EXPECT(0, "optimizer step: %s", bnb8_last_error());
            goto out;
        }
        for (int64_t i = 0, o = 0; i < 18; o += sizes[i], i++)
            if (sizes[i])
                round_to_bf16<<<256, 256, 0, gpt2_cuda_stream(m16)>>>((__nv_bfloat16 *)gpt2_cuda_param_tensor(m16, i), master + o, sizes[i]);
        CUDA_CHECK(cudaGetLastError());
        gap = fabs((double)l16 - l32) / l32;
        worst_gap = fmax(worst_gap, gap);
        sum_gap += gap;
        if (s == 0) { first32 = l32; first16 = l16; }
        last32 = l32; last16 = l16;
        printf("  step %2d  loss fp32 %.5f  bf16 %.5f  gap %.3f%%\n", s + 1, l32, l16, 100.0 * gap);
    }
    printf("  %d steps: fp32 %.4f -> %.4f, bf16 %.4f -> %.4f, gap at the end %.3f%%, mean %.3f%%, largest %.3f%% (bar 1%%)\n",
           steps, first32, last32, first16, last16, 100.0 * gap, 100.0 * sum_gap / steps, 100.0 * worst_gap);
    EXPECT(worst_gap <= 0.01, "bf16 loss gap %.3f%% > 1%%", 100.0 * worst_gap);
    EXPECT(last32 < first32 && last16 < first16, "the loss did not fall");
out:
    bnb8_optimizer_free(o32); bnb8_optimizer_free(o16);
    cudaFree(g32); cudaFree(g16); cudaFree(g16f); cudaFree(master);
    gpt2_cuda_free(m32); gpt2_cuda_free(m16);
    ref_free(ref);
}

static int quick;
static void test_bf16(void) {
    if (quick) bf16_vs_fp32("d2c64h4v100t64", 4, 32, 3);
    else bf16_vs_fp32("d4", 8, 64, 20);
}

// ------------------------------------------------------------------------------------------------
// d12 throughput

static void print_mb(const char *what, double bytes) { printf("  %-44s %10.1f MB\n", what, bytes / 1e6); }

// Forward + backward of one batch, iters times after 2 warmups: the medians (ms) of the forward, the
// backward and both (ms[0..2]), and the last loss. 0, or -1 (message in gpt2_cuda_last_error).
static int time_fwd_bwd(GPT2Cuda *m, const GPT2CudaGrads *g, const int *data, int B, int T, int iters, double ms[3],
                        float *loss) {
    cudaEvent_t e0, e1, e2;
    CUDA_CHECK(cudaEventCreate(&e0)); CUDA_CHECK(cudaEventCreate(&e1)); CUDA_CHECK(cudaEventCreate(&e2));
    std::vector<float> tf, tb, tt;
    int status = 0;
    cudaStream_t s = (cudaStream_t)gpt2_cuda_stream(m);
    for (int it = 0; it < iters + 2 && status == 0; it++) {
        CUDA_CHECK(cudaEventRecord(e0, s));
        status = gpt2_cuda_forward(m, data, data + 1, B, T, 1);
        CUDA_CHECK(cudaEventRecord(e1, s));
        if (status == 0) status = gpt2_cuda_backward(m, g, 0, NULL, NULL);
        CUDA_CHECK(cudaEventRecord(e2, s));
        if (status == 0) status = gpt2_cuda_loss(m, loss, NULL);
        float a = 0.0f, b = 0.0f;
        CUDA_CHECK(cudaEventSynchronize(e2));
        CUDA_CHECK(cudaEventElapsedTime(&a, e0, e1));
        CUDA_CHECK(cudaEventElapsedTime(&b, e1, e2));
        if (it >= 2) { tf.push_back(a); tb.push_back(b); tt.push_back(a + b); }
    }
    cudaEventDestroy(e0); cudaEventDestroy(e1); cudaEventDestroy(e2);
    if (status) return -1;
    std::sort(tf.begin(), tf.end()); std::sort(tb.begin(), tb.end()); std::sort(tt.begin(), tt.end());
    ms[0] = tf[iters / 2]; ms[1] = tb[iters / 2]; ms[2] = tt[iters / 2];
    printf("  forward %.2f ms + backward %.2f ms = %.2f ms (median of %d; min %.2f, max %.2f)\n", ms[0], ms[1], ms[2],
           iters, tt[0], tt[iters - 1]);
    return 0;
}

// Per-phase breakdown of one forward + backward (CUDA events around each phase).
static int print_breakdown(GPT2Cuda *m, const GPT2CudaGrads *g, const int *data, int B, int T) {
    const char *pn[64];
    double pms[64];
    int pc[64];
    if (gpt2_cuda_profile(m, 1) || gpt2_cuda_forward(m, data, data + 1, B, T, 1) || gpt2_cuda_backward(m, g, 0, NULL, NULL))
        return -1;
    int k = gpt2_cuda_profile_read(m, pn, pms, pc, 64);
    if (k < 0 || gpt2_cuda_profile(m, 0)) return -1;
    double sum = 0.0;
    std::vector<int> idx;
    for (int i = 0; i < k; i++) { sum += pms[i]; idx.push_back(i); }
    std::sort(idx.begin(), idx.end(), [&](int a, int b) { return pms[a] > pms[b]; });
    printf("  breakdown of one forward + backward (events around each phase; %.2f ms in all):\n", sum);
    for (int i : idx) printf("    %-26s %8.3f ms %5.1f%%  (%d)\n", pn[i], pms[i], 100.0 * pms[i] / sum, pc[i]);
    return 0;
}

// The activation allocation and its largest tensors.
static void print_acts(const GPT2Cuda *m, int top) {
    print_mb("activations (one allocation, all of these)", (double)gpt2_cuda_act_bytes(m));
    std::vector<int> idx;
    for (int i = 0; i < gpt2_cuda_num_act_tensors(); i++) idx.push_back(i);
    std::sort(idx.begin(), idx.end(), [&](int a, int b) { return gpt2_cuda_act_tensor_bytes(m, a) > gpt2_cuda_act_tensor_bytes(m, b); });
    for (int k = 0; k < top && k < (int)idx.size(); k++) {
        char label[80];
        snprintf(label, sizeof label, "  %s", gpt2_cuda_act_name(idx[k]));
        print_mb(label, (double)gpt2_cuda_act_tensor_bytes(m, idx[k]));
    }
}

static void bench_d12(void) {
    const int B = 16, T = 1024, iters = 10;
    void *ref = NULL;
    int cfg[7];
    if (ref_create(&ref, "d12", 1, 7, 0, 0, cfg)) { EXPECT(0, "ref_create: %s", ref_error()); return; }
    GPT2CudaConfig c = config_of(cfg);
    int64_t n = ref_num_params(ref), sizes[18], BT = (int64_t)B * T;
    ref_param_sizes(ref, sizes);
    std::vector<int> data = data_tokens(c.vocab_size, BT + 1);
    GPT2Cuda *m = NULL;
    void *gmem = NULL;
    GPT2CudaGrads g;
    bnb8_optimizer *opt = NULL;
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0)); CUDA_CHECK(cudaEventCreate(&e1));
    double ms[3], ms_re[3];
    float loss = 0.0f, loss_re = 0.0f;
    size_t free0 = 0, free1 = 0, total = 0, acts = 0;
    CUDA_CHECK(cudaMemGetInfo(&free0, &total));
    if (gpt2_cuda_create(&m, &c, GPT2_CUDA_BF16, B, T) || gpt2_cuda_set_params(m, ref_params(ref))) {
        EXPECT(0, "create: %s", gpt2_cuda_last_error());
        goto out;
    }
    CUDA_CHECK(cudaMalloc(&gmem, 2 * (size_t)n));
    gpt2_cuda_grads_point(m, &g, gmem, GPT2_CUDA_BF16);
    printf("model d12: L=%d C=%d NH=%d V=%d Vp=%d, %lld parameters, StableEmbedding on; bf16, B=%d T=%d (%lld tokens)\n",
           c.num_layers, c.channels, c.num_heads, c.vocab_size, c.padded_vocab_size, (long long)n, B, T, (long long)BT);
    if (time_fwd_bwd(m, &g, data.data(), B, T, iters, ms, &loss)) { EXPECT(0, "forward + backward: %s", gpt2_cuda_last_error()); goto out; }
    CUDA_CHECK(cudaMemGetInfo(&free1, &total));
    printf("  loss at init %.4f (ln V = %.4f)\n", loss, log((double)c.vocab_size));
    printf("  THROUGHPUT d12 bf16 B=16 T=1024 forward+backward: %.0f tokens/s\n", (double)BT / (ms[2] / 1e3));
    EXPECT(isfinite(loss), "loss not finite");
    if (print_breakdown(m, &g, data.data(), B, T)) { EXPECT(0, "profile: %s", gpt2_cuda_last_error()); goto out; }
    // the optimizer step that would follow: bnb8 8-bit AdamW on bf16 weights and gradients
    {
        bnb8_config oc = bnb8_config_default(BNB8_ADAMW);
        oc.beta2 = 0.95f;
        int ok = bnb8_optimizer_create(&opt, BNB8_ADAMW, &oc) == 0;
        for (int i = 0; i < 18 && ok; i++)
            if (sizes[i]) ok &= bnb8_optimizer_add(opt, names[i], gpt2_cuda_param_tensor(m, i), BNB8_BF16, g.tensor[i], BNB8_BF16, sizes[i], NULL) == 0;
        std::vector<float> to;
        cudaStream_t s = (cudaStream_t)gpt2_cuda_stream(m);
        for (int it = 0; it < 7 && ok; it++) {
            CUDA_CHECK(cudaEventRecord(e0, s));
            ok &= bnb8_optimizer_step(opt, 1e-4f, 1.0f, gpt2_cuda_stream(m)) == 0;
            CUDA_CHECK(cudaEventRecord(e1, s));
            CUDA_CHECK(cudaEventSynchronize(e1));
            float a = 0.0f;
            CUDA_CHECK(cudaEventElapsedTime(&a, e0, e1));
            if (it >= 2) to.push_back(a);
        }
        EXPECT(ok, "optimizer: %s", bnb8_last_error());
        if (ok) {
            std::sort(to.begin(), to.end());
            double step = ms[2] + to[2];
            printf("  bnb8 8-bit AdamW step (bf16 weights + grads): %.3f ms; whole step %.2f ms = %.0f tokens/s\n", to[2],
                   step, (double)BT / (step / 1e3));
        }
    }
    printf("  memory:\n");
    print_mb("parameters (bf16)", (double)gpt2_cuda_param_bytes(m));
    print_mb("gradients (bf16, caller's buffer)", 2.0 * (double)n);
    print_acts(m, 8);
    print_mb("device memory in use by the test (cudaMemGetInfo)", (double)(free0 - free1));
    acts = gpt2_cuda_act_bytes(m);

    // the same with activation recomputation, from the same weights (the optimizer moved m's: a new model)
    bnb8_optimizer_free(opt);
    opt = NULL;
    gpt2_cuda_free(m);
    m = NULL;
    c.recompute = 1;
    if (gpt2_cuda_create(&m, &c, GPT2_CUDA_BF16, B, T) || gpt2_cuda_set_params(m, ref_params(ref))) {
        EXPECT(0, "create with recompute: %s", gpt2_cuda_last_error());
        goto out;
    }
    gpt2_cuda_grads_point(m, &g, gmem, GPT2_CUDA_BF16);
    printf("  with recompute = 1:\n");
    if (time_fwd_bwd(m, &g, data.data(), B, T, iters, ms_re, &loss_re)) { EXPECT(0, "recompute: %s", gpt2_cuda_last_error()); goto out; }
    CUDA_CHECK(cudaMemGetInfo(&free1, &total));
    printf("  RECOMPUTE d12 bf16 B=16 T=1024 forward+backward: %.2f ms (%.2f without, %+.1f%%), %.0f tokens/s; activations "
           "%.1f MB (%.1f without, %.1f%%); loss %.6f, %s\n", ms_re[2], ms[2], 100.0 * (ms_re[2] / ms[2] - 1.0),
           (double)BT / (ms_re[2] / 1e3), gpt2_cuda_act_bytes(m) / 1e6, acts / 1e6, 100.0 * gpt2_cuda_act_bytes(m) / acts,
           loss_re, memcmp(&loss, &loss_re, sizeof loss) == 0 ? "the same bits" : "NOT the same bits");
    EXPECT(memcmp(&loss, &loss_re, sizeof loss) == 0, "loss with recompute %.9g vs %.9g", loss_re, loss);
    if (print_breakdown(m, &g, data.data(), B, T)) { EXPECT(0, "profile: %s", gpt2_cuda_last_error()); goto out; }
    print_acts(m, 8);
    print_mb("device memory in use by the test (cudaMemGetInfo)", (double)(free0 - free1));
out:
    bnb8_optimizer_free(opt);
    cudaFree(gmem);
    gpt2_cuda_free(m);
    ref_free(ref);
    cudaEventDestroy(e0); cudaEventDestroy(e1);
}

// ------------------------------------------------------------------------------------------------
// The est rule's clipping on the device (gpt2_cuda_clip_group, DESIGN.md §6.4)

// gpt2_cuda.h's scale for the norm sqrt(prefix / share) / accum, in its words.
static float clip_scale_of(double prefix, double share, float clip, int64_t accum) {
    double norm = sqrt(prefix / share) / (double)accum;
    float f = clip > 0.0f && norm > clip ? (float)(clip / norm) : 1.0f;
    return f / (float)accum;
}

// Groups 0..L+1 of 1 to 16 (the limit) device tensors, both dtypes, sizes around a block's stride
// (128 x 256) and past it, random values of a scale per group, NaN and +-Inf here and there (left
// out), FLT_MAX and bf16's largest (kept: their squares are finite in double). Each group's sum
// against a long double sum of the finite squares, within the rounding of double sums of positive
// terms in any order (about n 2^-53 relative: each square is exact in double); the scale each call
// leaves (read before the next call overwrites it) against the formula from the device's own sums
// in order, bit for bit, at a clip between the groups' norms (some clipped, some not), share < 1,
// accum 2. Then a bf16 tensor of 2^31 + 1000 elements (int64 indexing; 4.3 GB, skipped if it does
// not fit, or under GPT2_TEST_QUICK): every element v = 191/256 but a 2.0 and a NaN past 2^31,
// whose sum is exact in double ((n - 2) v^2 + 4: multiples of 2^-16 below 2^31); its time printed.
static void test_clip_group(void) {
    GPT2CudaConfig c = {64, 100, 128, 2, 4, 64, 0, 0};
    GPT2Cuda *m = NULL;
    MUST(gpt2_cuda_create(&m, &c, GPT2_CUDA_BF16, 2, 16));
    const int L = 2, G = L + 2;
    const int counts[G] = {2, 16, 3, 1}, dtypes[G] = {GPT2_CUDA_BF16, GPT2_CUDA_FP32, GPT2_CUDA_BF16, GPT2_CUDA_FP32};
    const double shares[G] = {0.25, 0.5, 0.875, 1.0};
    const int64_t accum = 2;
    std::vector<int64_t> n[G];
    std::vector<void *> bufs[G];
    long double want[G] = {0};
    int64_t terms[G] = {0};
    for (int k = 0; k < G; k++) {
        size_t es = dtypes[k] == GPT2_CUDA_BF16 ? 2 : 4;
        double scale = pow(4.0, k) * 1e-2;
        for (int i = 0; i < counts[k]; i++) {
            int64_t len = k == 0 ? (i == 0 ? 1 : 257) : k == 1 ? (i == 7 ? 70001 : 1 + (int64_t)(next_u64() % 5000))
                        : k == 2 ? 32768 + i * 33000 : (1 << 20) + 3;
            std::vector<float> x((size_t)len);
            for (auto &v : x) v = (float)(randn() * scale);
            if (len > 10) { x[(size_t)len / 3] = NAN; x[(size_t)len / 2] = INFINITY; x[(size_t)len - 1] = -INFINITY; }
            if (k == G - 1) x[5] = 0x1.fffffep127f;                     // FLT_MAX: finite, kept
            if (k == 2 && i == 1) x[6] = bnb8_bf16_to_f32(0x7f7f);       // bf16's largest
            std::vector<uint16_t> h((size_t)len);
            for (size_t e = 0; e < x.size(); e++) {
                if (es == 2) { h[e] = bnb8_f32_to_bf16(x[e]); x[e] = bnb8_bf16_to_f32(h[e]); }
                if (isfinite(x[e])) { want[k] += (long double)x[e] * x[e]; terms[k]++; }
            }
            void *d = NULL;
            CUDA_CHECK(cudaMalloc(&d, es * (size_t)len));
            CUDA_CHECK(cudaMemcpy(d, es == 2 ? (void *)h.data() : (void *)x.data(), es * (size_t)len, cudaMemcpyHostToDevice));
            bufs[k].push_back(d);
            n[k].push_back(len);
        }
    }
    // the clip: between the second and third of the groups' norms (as the reference sums give them)
    double norms[G], sorted[G];
    long double prefix = 0.0L;
    for (int k = 0; k < G; k++) { prefix += want[k]; norms[k] = sorted[k] = sqrt((double)prefix / shares[k]) / (double)accum; }
    std::sort(sorted, sorted + G);
    float clip = (float)sqrt(sorted[1] * sorted[2]);
    float got[G];
    for (int k = 0; k < G; k++) {
        MUST(gpt2_cuda_clip_group(m, bufs[k].data(), n[k].data(), counts[k], dtypes[k], k, shares[k], clip, accum));
        CUDA_CHECK(cudaMemcpy(&got[k], gpt2_cuda_clip_scale(m), sizeof(float), cudaMemcpyDeviceToHost));
    }
    double sums[G];
    for (int k = 0; k < G; k++) sums[k] = NAN;
    MUST(gpt2_cuda_clip_sums(m, sums));
    double dev_prefix = 0.0;
    int clipped = 0, unclipped = 0;
    for (int k = 0; k < G; k++) {
        // the device's rounding ((terms - 1) 2^-53 and its second order) plus the long double sum's
        // (terms 2^-64 at most, 2^-11 of the first)
        double bar = (double)(terms[k] + 1) * 0x1p-53 * (1.0 + 0x1p-10) * (double)want[k];
        EXPECT(fabs(sums[k] - (double)want[k]) <= bar, "group %d: sum %.17g, long double %.17Lg (bar %.3g, %lld finite terms)",
               k, sums[k], want[k], bar, (long long)terms[k]);
        dev_prefix += sums[k];
        float expect = clip_scale_of(dev_prefix, shares[k], clip, accum);
        EXPECT(memcmp(&got[k], &expect, sizeof expect) == 0, "group %d: scale %.9g, the formula from the device's sums %.9g",
               k, (double)got[k], (double)expect);
        clipped += norms[k] > clip; unclipped += norms[k] <= clip;
        printf("  group %d: %2d %s tensors, %8lld finite terms, sum %.6e (vs long double %.1e rel), norm %.4g, scale %.6g\n",
               k, counts[k], dtypes[k] == GPT2_CUDA_BF16 ? "bf16" : "fp32", (long long)terms[k], sums[k],
               want[k] > 0 ? fabs(sums[k] - (double)want[k]) / (double)want[k] : 0.0, norms[k], (double)got[k]);
    }
    EXPECT(clipped > 0 && unclipped > 0, "clip %g: %d groups clipped, %d not", (double)clip, clipped, unclipped);
    for (int k = 0; k < G; k++) for (void *d : bufs[k]) cudaFree(d);
    // refusals: 17 tensors, a group past L + 1, share 0
    int64_t one = 1;
    void *any = NULL;
    CUDA_CHECK(cudaMalloc(&any, 4));
    void *many[17];
    int64_t many_n[17];
    for (int i = 0; i < 17; i++) { many[i] = any; many_n[i] = 1; }
    EXPECT(gpt2_cuda_clip_group(m, many, many_n, 17, GPT2_CUDA_FP32, 0, 1.0, 1.0f, 1) == -1, "17 tensors accepted");
    EXPECT(gpt2_cuda_clip_group(m, &any, &one, 1, GPT2_CUDA_FP32, G, 1.0, 1.0f, 1) == -1, "group L + 2 accepted");
    EXPECT(gpt2_cuda_clip_group(m, &any, &one, 1, GPT2_CUDA_FP32, 0, 0.0, 1.0f, 1) == -1, "share 0 accepted");
    cudaFree(any);

    // past 2^31 elements
    const int64_t big = ((int64_t)1 << 31) + 1000;
    size_t free_bytes = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    if (quick || free_bytes < 2 * (size_t)big + ((size_t)1 << 30)) {
        printf("  2^31 + 1000 bf16 elements: skipped (%s, %.1f GB free)\n", quick ? "GPT2_TEST_QUICK" : "memory", free_bytes / 1e9);
        gpt2_cuda_free(m);
        return;
    }
    uint16_t *x = NULL, two = 0x4000, nan = 0x7fc0;
    CUDA_CHECK(cudaMalloc(&x, 2 * (size_t)big));
    CUDA_CHECK(cudaMemset(x, 0x3f, 2 * (size_t)big));   // 0x3f3f: 191/256
    CUDA_CHECK(cudaMemcpy(x + ((int64_t)1 << 31) + 5, &two, 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(x + big - 1, &nan, 2, cudaMemcpyHostToDevice));
    double v = 191.0 / 256.0, exact = (double)(big - 2) * (v * v) + 4.0, s = NAN;
    void *xp = x;
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0)); CUDA_CHECK(cudaEventCreate(&e1));
    CUDA_CHECK(cudaEventRecord(e0, gpt2_cuda_stream(m)));
    MUST(gpt2_cuda_clip_group(m, &xp, &big, 1, GPT2_CUDA_BF16, 0, 1.0, 0.0f, 1));
    CUDA_CHECK(cudaEventRecord(e1, gpt2_cuda_stream(m)));
    MUST(gpt2_cuda_clip_sums(m, sums));
    s = sums[0];
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    EXPECT(s == exact, "2^31 + 1000 bf16 elements: sum %.17g, exact %.17g", s, exact);
    printf("  2^31 + 1000 bf16 elements (a 2.0 and a NaN past 2^31): sum %.17g, exact %.17g; %.2f ms, %.0f GB/s\n", s, exact,
           (double)ms, 2.0 * (double)big / (ms * 1e6));
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    cudaFree(x);
    gpt2_cuda_free(m);
}

// ------------------------------------------------------------------------------------------------

static void test_errors(void) {
    // refusals come back as -1 with a message, never a crash
    GPT2Cuda *m = NULL;
    GPT2CudaConfig bad = {64, 100, 128, 2, 3, 64, 0, 0};    // C not a multiple of NH
    EXPECT(gpt2_cuda_create(&m, &bad, GPT2_CUDA_FP32, 2, 16) == -1 && m == NULL, "bad config accepted");
    printf("  bad config: %s\n", gpt2_cuda_last_error());
    GPT2CudaConfig bad_recompute = {64, 100, 128, 2, 4, 64, 0, 2};
    EXPECT(gpt2_cuda_create(&m, &bad_recompute, GPT2_CUDA_FP32, 2, 16) == -1 && m == NULL, "recompute = 2 accepted");
    // A shape whose activations overflow (L=512 C=128 NH=128, B=128, T=maxT=2^20: L B NH T^2 = 2^63),
    // refused by its activation size before any device memory (1 GB of weights) is allocated; and a
    // shape limit by name
    GPT2CudaConfig huge = {1 << 20, 64, 64, 512, 128, 128, 0, 0};
    EXPECT(gpt2_cuda_create(&m, &huge, GPT2_CUDA_BF16, 128, 1 << 20) == -1 && m == NULL &&
           strstr(gpt2_cuda_last_error(), "2^52"), "activation sizes past 2^52 bytes: '%s'", gpt2_cuda_last_error());
    printf("  huge activations: %s\n", gpt2_cuda_last_error());
    GPT2CudaConfig deep = {64, 100, 128, 4097, 4, 64, 0, 0};
    EXPECT(gpt2_cuda_create(&m, &deep, GPT2_CUDA_FP32, 2, 16) == -1 && m == NULL && strstr(gpt2_cuda_last_error(), "L must"),
           "L = 4097: '%s'", gpt2_cuda_last_error());
    GPT2CudaConfig c = {64, 100, 128, 2, 4, 64, 1, 0};
    MUST(gpt2_cuda_create(&m, &c, GPT2_CUDA_FP32, 2, 16));
    std::vector<int> in(64, 5);
    EXPECT(gpt2_cuda_forward(m, in.data(), NULL, 2, 32, 0) == -1, "T above the allocation accepted");
    in[3] = 100;
    EXPECT(gpt2_cuda_forward(m, in.data(), NULL, 2, 16, 0) == -1, "token id V accepted");
    printf("  bad token: %s\n", gpt2_cuda_last_error());
    in[3] = 7;
    GPT2CudaGrads g;
    memset(&g, 0, sizeof g);
    EXPECT(gpt2_cuda_forward(m, in.data(), NULL, 2, 16, 0) == 0, "forward: %s", gpt2_cuda_last_error());
    EXPECT(gpt2_cuda_backward(m, &g, 0, NULL, NULL) == -1, "backward without targets accepted");
    float x;
    EXPECT(gpt2_cuda_loss(m, &x, NULL) == -1, "loss without targets accepted");
    gpt2_cuda_free(m);
}

int main(void) {
    quick = getenv("GPT2_TEST_QUICK") && atoi(getenv("GPT2_TEST_QUICK")) > 0;
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) { printf("no CUDA device\n0 passed, 1 failed\n"); return 1; }
    printf("device: %s, %d SMs, %.1f GB, TEST_SEED=%llu\n", prop.name, prop.multiProcessorCount, prop.totalGlobalMem / 1e9,
           (unsigned long long)test_seed());
    rng = test_rng_new();
    test_announce(1);        // the tests print a lot: a header line before each
    test_show_failures(8);
    test_run("errors: refusals with a message", test_errors);
    test_run("est clipping: group sums vs long double, scales bit for bit, past 2^31 elements", test_clip_group);
    test_run("fp32 parity, L=2 C=64 NH=4 V=100, StableEmbedding", test_parity_small);
    test_run("fp32 parity, L=2 C=64 NH=4 V=100, plain embedding", test_parity_small_plain);
    if (!quick) test_run("fp32 parity, d4 (L=4 C=256 NH=4 V=50257)", test_parity_d4);
    test_run("recompute: the activation report", test_recompute_report);
    test_run("recompute = 1 vs 0, fp32, L=2 C=64 NH=4 V=100, StableEmbedding: the same bits", test_recompute_small_fp32);
    test_run("recompute = 1 vs 0, bf16, L=2 C=64 NH=4 V=100, StableEmbedding: the same bits", test_recompute_small_bf16);
    if (!quick) test_run("recompute = 1 vs 0, fp32, d4, plain embedding: the same bits", test_recompute_d4_fp32);
    if (!quick) test_run("recompute = 1 vs 0, bf16, d4, plain embedding: the same bits", test_recompute_d4_bf16);
    test_run(quick ? "bf16 vs fp32, small, 3 steps" : "bf16 vs fp32, d4 on fortunes, 20 steps", test_bf16);
    if (!quick) test_run("d12 throughput, bf16, B=16 T=1024", bench_d12);
    return test_summary();
}
