/*
gpt2_cuda.h — the GPT-2 model on one NVIDIA GPU (gpt2_cuda.cu), for train_gpt2_8bit.c.

The same model as the CPU one in gpt2_cpu.c (pre-LayerNorm GPT-2, GELU-tanh, tied wte /
lm_head, learned positions, optional StableEmbedding), with the same 18 parameter tensors in the
same order and layout, so weights copy from a CPU model with one call. Two precisions, chosen at
creation:
  GPT2_CUDA_FP32  fp32 weights, activations and math (cuBLASLt, CUBLAS_COMPUTE_32F, no TF32):
                  the mode for parity with the CPU model;
  GPT2_CUDA_BF16  bf16 weights and activations, fp32 accumulation and LayerNorm statistics.

Allocations: one for the parameters, one for the activations (with every scratch buffer and the
cuBLASLt workspace); the gradients live in a buffer the caller gives to gpt2_cuda_backward, so the
caller decides their dtype (fp32, or bf16 for a bf16 model) and whether a full buffer exists at all
(gradient release: see GPT2CudaGrads). Every call returns 0 or -1; gpt2_cuda_last_error() says what
failed and where. Nothing here prints or exits. Work runs on the model's stream
(gpt2_cuda_stream); calls that return values to the host synchronize it.

Plain C; the CUDA stream is passed as struct CUstream_st * (a cudaStream_t), as in bnb8.h.
*/
#ifndef GPT2_CUDA_H
#define GPT2_CUDA_H

#include <stdint.h>
#include <stddef.h>
#include "gpt2.h"   // GPT2Config's fields, the parameter tensors, the grads_ready callback

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;

// Field for field gpt2.h's GPT2Config, then this model's options (0: off, so a zero-initialized config
// gets today's model).
typedef struct {
    int max_seq_len;          // maxT: rows of wpe
    int vocab_size;           // V
    int padded_vocab_size;    // Vp >= V: rows of wte
    int num_layers;           // L
    int num_heads;            // NH
    int channels;             // C
    int stable_embedding;     // 1: LayerNorm (lnew, lneb) right after the token embedding
    int recompute;            // 1: activation recomputation: forward keeps each layer's output (the
                              // residual stream) and backward re-runs each layer's forward into one
                              // layer's buffers before its backward: far less activation memory for
                              // about one more forward of the layers, the same bits (same kernels, inputs)
} GPT2CudaConfig;

// Precision of the model (weights, activations) and dtype of a gradient buffer.
enum { GPT2_CUDA_FP32 = 0, GPT2_CUDA_BF16 = 1 };

// The parameter tensors: gpt2.h's (GPT2_WTE .. GPT2_LNEB), in the CPU model's order and layout.

typedef struct GPT2Cuda GPT2Cuda;

// The message of the last failure on this thread (the call, the file:line, CUDA's or cuBLAS's word).
const char *gpt2_cuda_last_error(void);

// The current GPU's name and memory (cudaMemGetInfo: free and total bytes; either may be NULL);
// -1 with the reason when there is no usable GPU.
int gpt2_cuda_device(char *name, size_t name_size, size_t *free_bytes, size_t *total_bytes);

// Creates a model of config c and precision on the current device, its activations sized for
// batches up to (B, T) (T <= maxT). Parameters start at 0: load them with gpt2_cuda_set_params.
// A shape past gpt2.h's limits, or activations above GPT2_MAX_ACT_BYTES, is refused (by name)
// before any device memory is allocated.
int gpt2_cuda_create(GPT2Cuda **out, const GPT2CudaConfig *c, int precision, int B, int T);
void gpt2_cuda_free(GPT2Cuda *m);

int gpt2_cuda_precision(const GPT2Cuda *m);
struct CUstream_st *gpt2_cuda_stream(const GPT2Cuda *m);
int64_t gpt2_cuda_num_parameters(const GPT2Cuda *m);
void gpt2_cuda_param_sizes(const GPT2Cuda *m, int64_t sizes[GPT2_NUM_PARAMS]);
// The parameter allocation (fp32 or bf16 by precision: num_parameters elements in the CPU layout)
// and tensor i of it (NULL for an empty tensor). For the optimizer: bnb8_optimizer_add(param).
void *gpt2_cuda_params(GPT2Cuda *m);
void *gpt2_cuda_param_tensor(GPT2Cuda *m, int i);
// All parameters from / to fp32 host memory in the CPU layout (bf16: rounded to nearest even).
int gpt2_cuda_set_params(GPT2Cuda *m, const float *host);
int gpt2_cuda_get_params(GPT2Cuda *m, float *host);

// Forward of inputs (B, T) (host memory, token ids < V) through the logits. With targets (host,
// may be NULL) the per-position losses are computed too (gpt2_cuda_loss reads them). for_backward:
// with targets, the fused softmax + cross-entropy writes d(mean loss)/d(logits) over the logits,
// ready for gpt2_cuda_backward; otherwise the logits stay readable (gpt2_cuda_get_logits).
// Does not wait for the GPU.
int gpt2_cuda_forward(GPT2Cuda *m, const int *inputs, const int *targets, int B, int T, int for_backward);
// Waits for the forward; mean loss of the last forward with targets (summed in double, in order)
// and, when losses is not NULL, the (B, T) per-position losses.
int gpt2_cuda_loss(GPT2Cuda *m, float *mean_loss, float *losses);
// Rows row0 .. row0+count-1 of the (B*T, Vp) logits of the last forward (for_backward = 0), as fp32.
int gpt2_cuda_get_logits(GPT2Cuda *m, float *host, int64_t row0, int64_t count);

// Where backward writes each tensor's gradient, in dtype (GPT2_CUDA_FP32; GPT2_CUDA_BF16 for a bf16
// model only). tensor[i] has the shape of parameter i; with reuse_layer_slice = 1, the per-layer tensors hold
// ONE layer's slice (size / L elements) that every layer writes in turn: gradient release, where the
// caller consumes each layer's gradients in the grads_ready callback before the next layer
// overwrites them (stream order guarantees it for work the callback enqueues on the given stream).
typedef struct {
    void *tensor[GPT2_NUM_PARAMS];
    int dtype;
    int reuse_layer_slice;
    void *memory;             // the allocation of gpt2_cuda_grads_alloc (NULL: the caller's memory)
} GPT2CudaGrads;
// Points g at one full buffer of num_parameters elements of dtype, in the parameter layout.
int gpt2_cuda_grads_point(const GPT2Cuda *m, GPT2CudaGrads *g, void *memory, int dtype);
// Allocates g's buffer on the device (zeroed): every tensor in full, or with reuse_layer_slice = 1
// the release layout (the per-layer tensors one layer's slice, the others in full). *bytes: its size.
int gpt2_cuda_grads_alloc(const GPT2Cuda *m, GPT2CudaGrads *g, int dtype, int reuse_layer_slice, size_t *bytes);
void gpt2_cuda_grads_free(GPT2CudaGrads *g);

// Backward calls gpt2.h's gpt2_grads_ready in stream order as each group of gradients is final, with
// the model's stream: enqueue the consumer (an optimizer step, a copy) there.

// Gradients of the mean loss of the last forward (which had targets and for_backward = 1) into g:
// accumulate = 0 overwrites every element of g (no zeroing needed), 1 adds to it (micro-batches).
// ready may be NULL. Does not wait for the GPU. With recompute, backward reads layer l's parameters
// again to recompute it: they must be the forward's until then (a callback may update layer l's, or
// LNF's, as soon as they are final: the layers below read only their own).
int gpt2_cuda_backward(GPT2Cuda *m, const GPT2CudaGrads *g, int accumulate, gpt2_grads_ready ready,
                       void *ctx);
// The global L2 norm of a full gradient buffer (sums in a fixed order: deterministic). Waits.
int gpt2_cuda_grad_norm(GPT2Cuda *m, const GPT2CudaGrads *g, double *norm);
// The sum of squares of count device buffers bufs[i] of n[i] elements of dtype, NaN and Inf included
// (they make it not finite), with gpt2_cuda_grad_norm's arithmetic (which is this over the parameter
// tensors): the same buffers give the same bits. Waits. (The trainer over NCCL: -N exact on its part.)
int gpt2_cuda_sum_squares(GPT2Cuda *m, const void *const *bufs, const int64_t *n, int count, int dtype, double *sum);
// Clipping group by group (the trainer's est rule, DESIGN.md §6.4), in stream order, no wait: the sum
// of squares of the finite elements of count (1..16) device buffers bufs[i] of n[i] elements of dtype
// (one fixed order) goes to the model's sums[k] (k in 0..L+1), then gpt2_cuda_clip_scale's float
// becomes the gnorm_scale that clips at clip (0 = off) the norm sqrt((sums[0] + .. + sums[k]) / share)
// / accum (share in (0, 1]): clip / norm when norm > clip > 0, else 1, divided by accum.
int gpt2_cuda_clip_group(GPT2Cuda *m, void *const *bufs, const int64_t *n, int count, int dtype, int k,
                         double share, float clip, int64_t accum);
// The same over several ranks (nccl.c), on stream, no wait: a rank's GPT2_CUDA_CLIP_PARTIALS partial
// sums of its count (0..16) buffers into partial (device; the unused ones 0, which add nothing exactly);
#define GPT2_CUDA_CLIP_PARTIALS (16 * 128)
int gpt2_cuda_clip_partials(GPT2Cuda *m, void *const *bufs, const int64_t *n, int count, int dtype, double *partial,
                            struct CUstream_st *stream);
// then every rank's (ranks x GPT2_CUDA_CLIP_PARTIALS, in rank order) into sums[k] and the scale, as
// gpt2_cuda_clip_group does with its own partials: one rank gives its bits.
int gpt2_cuda_clip_scale_parts(GPT2Cuda *m, const double *partial, int ranks, int k, double share, float clip,
                               int64_t accum, struct CUstream_st *stream);
float *gpt2_cuda_clip_scale(GPT2Cuda *m);              // device memory (the optimizer's cfg.gnorm_scale_at)
int gpt2_cuda_clip_sums(GPT2Cuda *m, double *host);    // sums[0..L+1] to the host. Waits.

// Memory, for the trainer's report: the parameter allocation, and the activation allocation tensor
// by tensor (index 0 .. gpt2_cuda_num_act_tensors() - 1; scratch and the cuBLASLt workspace included).
// The list is the same for every model, so a model has 0 bytes in the tensors it does not use: the
// StableEmbedding ones without it, and either the (L, ...) or the "one layer" ones by recompute.
size_t gpt2_cuda_param_bytes(const GPT2Cuda *m);
size_t gpt2_cuda_act_bytes(const GPT2Cuda *m);
int gpt2_cuda_num_act_tensors(void);
const char *gpt2_cuda_act_name(int i);
size_t gpt2_cuda_act_tensor_bytes(const GPT2Cuda *m, int i);

// Per-phase timing with CUDA events (off by default; costs an event per phase while on).
// gpt2_cuda_profile(m, 1) starts (and clears) it; gpt2_cuda_profile_read waits and gives up to max
// phases (name, total ms, count) accumulated since; returns their number, -1 on error.
int gpt2_cuda_profile(GPT2Cuda *m, int on);
int gpt2_cuda_profile_read(GPT2Cuda *m, const char **names, double *ms, int *counts, int max);

#ifdef __cplusplus
}
#endif
#endif // GPT2_CUDA_H
