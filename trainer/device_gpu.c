/*
trainer/device_gpu.c — the GPU row of the device table (device.h): gpt2_cuda.cu's model (the same
tensors in the same layout), bnb8's optimizer on the device, gradient release, and the ranks of
nccl.c when there are several. Linked with gpt2_cuda.o in the TRAIN_CUDA build; in the CPU-only
build the gpt2_cuda functions are weak and NULL, so gpu_open says the GPU is not available and the
run stays on the CPU.
*/
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "device.h"
#include "optimizer.h"
#include "tensors.h"
#include "clip.h"
#include "nccl.h"

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
#pragma weak gpt2_cuda_clip_group
#pragma weak gpt2_cuda_clip_scale
#pragma weak gpt2_cuda_clip_sums
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

int gpu_available(void) {
    return gpu_linked() && gpt2_cuda_device(NULL, 0, NULL, NULL) == 0;
}

// The one place the device is chosen: -D gpu, or -D auto with a GPU this build can train on.
int gpu_wanted(const TrainArgs *a) {
    return a->device == 2 || (a->device == 0 && gpu_available());
}

// The model on the GPU from the host model's fp32 weights: the bf16 model (bf16 weights and
// gradients: flash holds 2 + 1 + 2 + 2.125 bytes per parameter, fp32 2 + 4 + 2 + 8), or the fp32
// parity model (-P fp32: fp32 weights and gradients, no master).
static int gpu_open(Trainer *t) {
    Gpu *g = &t->gpu;
    GPT2 *m = &t->model;
    size_t free_bytes = 0;
    if (!gpu_linked()) return train_fail("this trainer was built without the GPU model (make on a machine with nvcc)");
    if (gpt2_cuda_device(g->name, sizeof g->name, &free_bytes, &g->total_bytes))
        return train_fail("GPU: %s", gpt2_cuda_last_error());
    g->used_before = g->used_peak = g->total_bytes - free_bytes;
    int bf16 = t->lay.weights == BNB8_BF16;
    snprintf(t->where, sizeof t->where, "GPU %s (%s model)", g->name, bf16 ? "bf16" : "fp32 parity");
    const GPT2Config *c = &m->config;
    GPT2CudaConfig gc = {c->max_seq_len, c->vocab_size, c->padded_vocab_size, c->num_layers, c->num_heads,
                         c->channels, c->stable_embedding, t->a.recompute};
    int precision = bf16 ? GPT2_CUDA_BF16 : GPT2_CUDA_FP32;
    g->logits = (float *)malloc(sizeof(float) * (size_t)c->padded_vocab_size);
    if (!g->logits) return train_fail("out of memory");
    if (gpt2_cuda_create(&g->model, &gc, precision, (int)t->a.B, (int)t->a.T) ||
        gpt2_cuda_set_params(g->model, m->params_memory) ||
        gpt2_cuda_grads_alloc(g->model, &g->grads, precision, t->a.release, &g->grads_bytes))
        return train_fail("GPU model: %s", gpt2_cuda_last_error());
    m->batch_size = t->a.B;
    m->seq_len = t->a.T;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++)
        if (m->param_sizes[i]) { t->param[i] = gpt2_cuda_param_tensor(g->model, i); t->grad[i] = g->grads.tensor[i]; }
    t->scale_at = gpt2_cuda_clip_scale(g->model);
    if (nccl_open(t)) return -1;
    return optimizer_open(t);
}

// Device memory in use now, kept as the peak when it is the most so far.
static void gpu_note_memory(Gpu *g) {
    size_t free_bytes = 0, total = 0;
    if (gpt2_cuda_device(NULL, 0, &free_bytes, &total) == 0 && total - free_bytes > g->used_peak) g->used_peak = total - free_bytes;
}

// The est rule's group g on the GPU, in stream order: its sum of squares and the scale the
// optimizer reads, on the device (no wait).
static int gpu_clip_group(Trainer *t, int g, void *const *grads, const int64_t *n, int count) {
    int dtype = t->lay.grads == BNB8_BF16 ? GPT2_CUDA_BF16 : GPT2_CUDA_FP32;
    if (gpt2_cuda_clip_group(t->gpu.model, grads, n, count, dtype, g, t->shares[g], t->a.grad_clip, t->a.accum))
        return train_fail("GPU clipping: %s", gpt2_cuda_last_error());
    return 0;
}

// Gradient release: backward calls this as each group's gradients become final (the final
// LayerNorm, then layer L-1 .. 0, then the embeddings); their tensors are stepped right there, on
// the model's stream, before backward overwrites the shared slices with the next layer's.
// A step that fails there keeps its own message (failed = 1).
typedef struct { Trainer *t; float lr, scale; int failed; } ReleaseStep;
static int gpu_grads_ready(void *ctx, int which, struct CUstream_st *stream) {
    ReleaseStep *r = (ReleaseStep *)ctx;
    int g = group_of(r->t, which);
    r->failed = r->t->nccl ? nccl_release_group(r->t, g, r->lr, r->scale, stream) != 0 : step_group(r->t, g, r->lr, r->scale, stream) != 0;
    return r->failed;
}

// Waits for the loss; with release each layer is stepped inside backward (at lr, clipped with the
// previous step's norm or this step's estimated: check_settings allows only these rules with release).
static int gpu_micro_step(Trainer *t, const int *inputs, const int *targets, int accumulate, float lr, float *loss) {
    Gpu *g = &t->gpu;
    ReleaseStep r = {t, lr, step_scale(t->prev_norm, t->a.grad_clip, t->a.accum), 0};
    if (gpt2_cuda_forward(g->model, inputs, targets, (int)t->a.B, (int)t->a.T, 1) ||
        gpt2_cuda_backward(g->model, &g->grads, accumulate, t->a.release ? gpu_grads_ready : NULL, &r))
        return r.failed ? -1 : train_fail("GPU step: %s", gpt2_cuda_last_error());
    if (gpt2_cuda_loss(g->model, loss, NULL)) return train_fail("GPU loss: %s", gpt2_cuda_last_error());
    return 0;
}

// exact: the norm after backward, then one launch (skipped when the norm is not finite). prev: one
// launch clipped with the previous norm, or under release the layers were stepped in backward; the
// optimizer summed this step's norm as it read the gradients. est: group by group in backward's
// order, as under release (where backward stepped them). Then the device memory in use.
static int gpu_step(Trainer *t, float lr, double *norm, int *skipped) {
    Gpu *g = &t->gpu;
    *norm = NAN;
    *skipped = 0;
    if (t->nccl) {   // several GPUs: the exchanges and the steps (est: group by group), the norm but est's
        if (nccl_step(t, lr, norm, skipped)) return -1;
    } else {
        if (t->rule == CLIP_EXACT) {
            if (gpt2_cuda_grad_norm(g->model, &g->grads, norm)) return train_fail("GPU gradient norm: %s", gpt2_cuda_last_error());
            *norm /= (double)t->a.accum;
            *skipped = !isfinite(*norm);
        }
        for (int k = 0; t->rule == CLIP_EST && !t->a.release && k < t->model.config.num_layers + 2; k++)
            if (step_group(t, k, lr, 1.0f, gpt2_cuda_stream(g->model))) return -1;
        if (!t->a.release && !*skipped && t->rule != CLIP_EST &&
            bnb8_optimizer_step(t->opt, lr, step_scale(clip_norm(t, *norm), t->a.grad_clip, t->a.accum), gpt2_cuda_stream(g->model)))
            return train_fail("optimizer step: %s", bnb8_last_error());
        if (t->rule == CLIP_PREV && prev_rule_norm(t, norm)) return -1;
    }
    if (t->rule == CLIP_EST) {
        if (gpt2_cuda_clip_sums(g->model, t->group_sums)) return train_fail("GPU clipping: %s", gpt2_cuda_last_error());
        est_finish(t, norm);
    }
    gpu_note_memory(g);
    return 0;
}

static int gpu_eval(Trainer *t, const int *inputs, const int *targets, float *loss) {
    Gpu *g = &t->gpu;
    if (gpt2_cuda_forward(g->model, inputs, targets, (int)t->a.B, (int)t->a.T, 0) || gpt2_cuda_loss(g->model, loss, NULL))
        return train_fail("GPU forward: %s", gpt2_cuda_last_error());
    return 0;
}

static int gpu_logits(Trainer *t, const int *tokens, int64_t n, float **logits) {
    Gpu *g = &t->gpu;
    if (gpt2_cuda_forward(g->model, tokens, NULL, 1, (int)n, 0) || gpt2_cuda_get_logits(g->model, g->logits, n - 1, 1))
        return train_fail("GPU forward: %s", gpt2_cuda_last_error());
    *logits = g->logits;
    return 0;
}

// Over NCCL each rank drops its host fp32 copy of the weights once the GPU model and the optimizer hold
// them (trainer_open): 8 ranks of a 30e9 model would hold 8 x 120 GB. What needs one again (the
// final weights of a single rank) gets a fresh one here.
void host_weights_drop(GPT2 *m) {
    free(m->params_memory);
    m->params_memory = NULL;
    memset(&m->params, 0, sizeof m->params);
}
static int host_weights_back(GPT2 *m) {
    if (m->params_memory) return 0;
    if (!(m->params_memory = (float *)calloc((size_t)m->num_parameters, sizeof(float))))
        return train_fail("out of memory for the host copy of %lld weights", (long long)m->num_parameters);
    gpt2_point_params(&m->params, m->params_memory, m->param_sizes);
    return 0;
}

// Into the host copy of the weights: bf16 ones' masters (decoded, or the fp32 master), fp32 ones copied.
// Over NCCL every rank's shards are gathered on rank 0; the other ranks send theirs and get NULL.
static int gpu_masters(Trainer *t, float **out) {
    int rank = 0;
    *out = NULL;
    if (t->nccl) {
        nccl_ranks(t, &rank);
        float *host = rank == 0 && host_weights_back(&t->model) == 0 ? t->model.params_memory : NULL;
        if (nccl_gather_masters(t, host)) return -1;
        *out = host;
        return 0;
    }
    if (host_weights_back(&t->model)) return -1;
    *out = t->model.params_memory;
    if (t->lay.weights != BNB8_F32) return optimizer_masters(t, t->model.params_memory);
    if (gpt2_cuda_get_params(t->gpu.model, t->model.params_memory)) return train_fail("GPU weights: %s", gpt2_cuda_last_error());
    return 0;
}

static double gpu_print_activations(Trainer *t) {
    for (int i = 0; i < gpt2_cuda_num_act_tensors(); i++) {
        double b = (double)gpt2_cuda_act_tensor_bytes(t->gpu.model, i);
        if (b == 0.0) continue;
        printf("    %-18s ", gpt2_cuda_act_name(i)); print_bytes(b); printf("\n");
    }
    printf("    %-18s ", "total");
    return (double)gpt2_cuda_act_bytes(t->gpu.model);
}

// Computed: weights, master, gradients (or the release scratch), optimizer states, activations
// (with every scratch buffer and cuBLASLt's workspace); measured: cudaMemGetInfo's most in use
// after a step, less what was in use before the run.
static int gpu_device_memory(Trainer *t, double *computed, double *measured) {
    const Gpu *g = &t->gpu;
    bnb8_memory mem = bnb8_optimizer_memory(t->opt, 0);
    *computed = mem.weights + mem.correction + (double)g->grads_bytes + mem.states + (double)gpt2_cuda_act_bytes(g->model);
    *computed += nccl_extra_bytes(t);
    *measured = (double)(g->used_peak - g->used_before);
    return 1;
}

static void gpu_close(Trainer *t) {
    Gpu *g = &t->gpu;
    if (g->model) { gpt2_cuda_grads_free(&g->grads); gpt2_cuda_free(g->model); }
    free(g->logits);
    memset(g, 0, sizeof *g);
}

const Device device_gpu = {"gpu", gpu_open, gpu_micro_step, gpu_step, gpu_eval, gpu_logits, gpu_masters,
                           gpu_print_activations, gpu_device_memory, gpu_close, gpu_clip_group};
