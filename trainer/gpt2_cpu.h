/*
gpt2_cpu.h — the GPT-2 model on the CPU (gpt2_cpu.c): fp32 weights, activations and math, OpenMP.

The same model as gpt2_cuda.h's GPU one, with the same parameter tensors in the same layout
(gpt2.h), behind the same shape of interface: a config, one parameter allocation with named
tensors, one activation allocation sized for batches up to (B, T), forward, and a backward that
writes into gradients the caller owns and calls gpt2_grads_ready as each group of them is final.
Loads and saves llm.c's model files. Errors: 0 or -1, the message in train_error_text
(gpt2_data.h); nothing here prints or exits.

Determinism: each output element is computed by one thread in a fixed order, so results do not
depend on the number of threads (DESIGN.md §9).
*/
#ifndef GPT2_CPU_H
#define GPT2_CPU_H

#include "gpt2.h"
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// The parameter tensors as named pointers (gpt2.h's order and shapes); gpt2_param(p, i) is tensor i.
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
float *gpt2_param(const ParameterTensors *p, int i);
// Points p's tensors into memory, laid out back to back by sizes (an empty tensor gets NULL).
void gpt2_point_params(ParameterTensors *p, float *memory, const int64_t sizes[GPT2_NUM_PARAMS]);

// Activations and the backward pass's scratch for a batch of (B, T): one allocation.
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
// datt rows for attention's backward live at the end of dqkv's region (see gpt2_act_sizes).
const char *gpt2_act_name(int i);   // the report's name of activation tensor i

typedef struct {
    GPT2Config config;
    ParameterTensors params;        // views into params_memory
    int64_t param_sizes[GPT2_NUM_PARAMS];
    float *params_memory;
    int64_t num_parameters;
    ActivationTensors acts;         // views into acts_memory
    int64_t act_sizes[NUM_ACT_TENSORS];
    float *acts_memory;
    int64_t num_activations;
    int64_t batch_size, seq_len;    // what the activations were allocated for (0: not yet)
    int64_t B, T;                   // of the last forward
    int *inputs, *targets;          // (B, T) of the last forward; targets[0] < 0: none
    float mean_loss;                // of the last forward with targets
} GPT2;

// Checks a shape's ranges (where names it in the message).
int gpt2_config_check(const GPT2Config *c, const char *where);
// A shape from a descriptor: "dL" is llm.c's depth-L GPT-2 (d6 384 channels / 6 heads, d12 768/12 =
// GPT-2 124M, d24 1024/16, d36 1280/20, d48 1600/25, d60 1920/30, d72 2880/30); any other L gets
// 64 L channels and L heads. Letters after it set the rest: c channels, h heads, v vocabulary, t
// maxT; e.g. "d4c128h4" or "d2c32h2v64t16". V defaults to GPT-2's 50257, maxT to 1024; Vp is V
// rounded up to a multiple of 64 (50304 for GPT-2, as llm.c). StableEmbedding is left off.
int gpt2_config_from_descriptor(GPT2Config *c, const char *desc);

// A model of shape c with zero weights (to be filled: a checkpoint's optimizer file); no activations.
int gpt2_create(GPT2 *m, const GPT2Config *c);
// A model of shape c with GPT-2's initialization from seed (the same bits on any number of
// threads); no activations yet.
int gpt2_init_random(GPT2 *m, const GPT2Config *c, uint64_t seed);
// The model file's versions (header[1], DESIGN.md §8.1): llm.c's fp32 and bf16, and bnb8's own for a
// StableEmbedding model, which llm.c refuses: it has no layernorm after the token embedding, so it
// would run another network from the weights.
#define MODEL_VERSION_FP32 3
#define MODEL_VERSION_BF16 5
#define MODEL_VERSION_STABLE_FP32 8003
#define MODEL_VERSION_STABLE_BF16 8005
// The version gpt2_save writes for a model of shape c (bf16 1: its weights rounded to bf16).
int gpt2_model_file_version(const GPT2Config *c, int bf16);
// A model from a model file: fp32 (version 3 or 8003) or bf16 (version 5 or 8005), every field
// checked, non-finite weights refused with the tensor's name. StableEmbedding is 8003 / 8005, or
// header[8] = 1 in a version 3 or 5 file (written before those versions).
int gpt2_load(GPT2 *m, const char *path);
// The shape of a model file, from its header (checked as gpt2_load does), no weights read.
int gpt2_load_config(GPT2Config *c, const char *path);
// Writes m's weights as a model file, atomically, of version gpt2_model_file_version: without
// StableEmbedding an llm.c model file, fp32 version 3 or bf16 version 5.
int gpt2_save(const GPT2 *m, const char *path, int bf16);
// The same for fp32 weights held elsewhere (num_parameters of them, in the layout of c).
int gpt2_save_params(const GPT2Config *c, const float *params, const char *path, int bf16);
// The first non-finite weight of params (layout of c) as "tensor 'name' element i is nan" in buf;
// 0 when every weight is finite.
int gpt2_params_nonfinite(const GPT2Config *c, const float *params, char *buf, size_t size);
// The elements of each activation tensor for batches (B, T), or -1 with a message when B or T is
// below 1 or they would take more than GPT2_MAX_ACT_BYTES (checked before anything is allocated).
int gpt2_act_sizes(const GPT2Config *c, int64_t B, int64_t T, int64_t s[NUM_ACT_TENSORS]);
// Activations for batches up to (B, T) (T <= maxT), replacing earlier ones.
int gpt2_alloc_acts(GPT2 *m, int64_t B, int64_t T);
void gpt2_free(GPT2 *m);

// Forward of inputs (B, T) (token ids < V) through the final LayerNorm (acts.lnf), no logits.
void gpt2_forward_hidden(GPT2 *m, const int *inputs, int64_t B, int64_t T);
// The full forward: the logits become probabilities, and with targets (may be NULL) the mean loss
// is returned and kept for backward (else -1).
float gpt2_forward(GPT2 *m, const int *inputs, const int *targets, int64_t B, int64_t T);
// Logits of rows row0 .. row0+count-1 of the last forward (recomputed from acts.lnf: gpt2_forward
// turned its own into probabilities), into out (count, Vp).
void gpt2_get_logits(GPT2 *m, float *out, int64_t row0, int64_t count);
// Gradients of the mean loss of the last forward (which had targets) into grads (num_parameters
// floats in the parameter layout): accumulate = 0 overwrites them, 1 adds to them. ready (may be
// NULL) is called as each group is final; its nonzero return stops backward with -1.
int gpt2_backward(GPT2 *m, float *grads, int accumulate, gpt2_grads_ready ready, void *ctx);

// Softmax over the first V of Vp columns of logits (N, Vp), in place (padding columns get 0); with
// targets, losses (N) = -log p[target]. The trainer samples with it.
void gpt2_softmax_forward(float *logits, float *losses, const int *targets, int64_t N, int64_t V, int64_t Vp);
// exp(x) for x <= 0 within 2 ulp, vectorizable (the softmax's); NaN stays NaN.
float gpt2_exp_nonpositive(float x);

#ifdef __cplusplus
}
#endif
#endif // GPT2_CPU_H
