/*
gpt2.h — what the two GPT-2 models (gpt2_cpu.c, gpt2_cuda.cu) and the trainer share: the shape of
a model, its 18 parameter tensors by name and size, the callback that hands finished gradients
to an optimizer during backward, and the trainer's random numbers. Plain C, header only.

The model is llm.c's GPT-2 (pre-LayerNorm, GELU-tanh, tied wte / LM head, learned positions) with
one extension, StableEmbedding: a LayerNorm (lnew, lneb) right after the token embedding.
*/
#ifndef GPT2_H
#define GPT2_H

#include <stdint.h>
#include <math.h>

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;   // cudaStream_t: the GPU model's callbacks get its stream, the CPU model's NULL

typedef struct {
    int max_seq_len;          // maxT: rows of wpe
    int vocab_size;           // V
    int padded_vocab_size;    // Vp >= V: rows of wte (llm.c pads to a multiple of 64/128)
    int num_layers;           // L
    int num_heads;            // NH
    int channels;             // C
    int stable_embedding;     // 1: StableEmbedding's LayerNorm after the token embedding
} GPT2Config;

// Shape limits (doc/trainer.md, "Models"): with them every parameter size product stays below 2^47. A
// batch (B, T) whose activations would take more than GPT2_MAX_ACT_BYTES is refused before anything
// is allocated (gpt2_act_sizes, gpt2_cuda_create): the models' int64 size products then cannot overflow.
#define GPT2_MAX_SEQ_LEN (1 << 20)
#define GPT2_MAX_VOCAB (1 << 24)
#define GPT2_MAX_LAYERS 4096
#define GPT2_MAX_CHANNELS (1 << 16)
#define GPT2_MAX_ACT_BYTES (INT64_C(1) << 52)

// What is wrong with shape c, as the limit it breaks; NULL when nothing is.
static inline const char *gpt2_shape_problem(const GPT2Config *c) {
    if (c->max_seq_len < 1 || c->max_seq_len > GPT2_MAX_SEQ_LEN) return "maxT must be in 1..1048576 (2^20)";
    if (c->vocab_size < 1 || c->vocab_size > GPT2_MAX_VOCAB) return "V must be in 1..16777216 (2^24)";
    if (c->padded_vocab_size < c->vocab_size || c->padded_vocab_size > GPT2_MAX_VOCAB)
        return "Vp must be in V..16777216 (2^24)";
    if (c->num_layers < 1 || c->num_layers > GPT2_MAX_LAYERS) return "L must be in 1..4096";
    if (c->channels < 1 || c->channels > GPT2_MAX_CHANNELS) return "C must be in 1..65536 (2^16)";
    if (c->num_heads < 1 || c->channels % c->num_heads != 0) return "NH must be at least 1 and divide C";
    if (c->stable_embedding != 0 && c->stable_embedding != 1) return "the StableEmbedding flag must be 0 or 1";
    return 0;
}

// The parameter tensors, in llm.c's file order, then StableEmbedding's pair (0 elements when off).
// Both models keep them in this order in one allocation. The per-layer tensors (GPT2_LN1W ..
// GPT2_FCPROJB) hold L slices of size / L elements, layer after layer.
enum {
    GPT2_WTE,        // (Vp, C)       token embedding, tied with the LM head
    GPT2_WPE,        // (maxT, C)     position embedding
    GPT2_LN1W,       // (L, C)
    GPT2_LN1B,       // (L, C)
    GPT2_QKVW,       // (L, 3C, C)
    GPT2_QKVB,       // (L, 3C)
    GPT2_ATTPROJW,   // (L, C, C)
    GPT2_ATTPROJB,   // (L, C)
    GPT2_LN2W,       // (L, C)
    GPT2_LN2B,       // (L, C)
    GPT2_FCW,        // (L, 4C, C)
    GPT2_FCB,        // (L, 4C)
    GPT2_FCPROJW,    // (L, C, 4C)
    GPT2_FCPROJB,    // (L, C)
    GPT2_LNFW,       // (C)
    GPT2_LNFB,       // (C)
    GPT2_LNEW,       // (C) StableEmbedding's LayerNorm weight
    GPT2_LNEB,       // (C) and bias
    GPT2_NUM_PARAMS
};
#define GPT2_FIRST_LAYER_PARAM GPT2_LN1W
#define GPT2_LAST_LAYER_PARAM GPT2_FCPROJB

static const char *const gpt2_param_names[GPT2_NUM_PARAMS] = {
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b",
    "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb", "lnew", "lneb"};
static const char *const gpt2_param_shapes[GPT2_NUM_PARAMS] = {
    "(Vp, C)", "(maxT, C)", "(L, C)", "(L, C)", "(L, 3C, C)", "(L, 3C)", "(L, C, C)", "(L, C)", "(L, C)",
    "(L, C)", "(L, 4C, C)", "(L, 4C)", "(L, C, 4C)", "(L, C)", "(C)", "(C)", "(C)", "(C)"};
// Matrices (and the embeddings) get weight decay; biases and LayerNorm parameters do not.
static const int gpt2_param_is_matrix[GPT2_NUM_PARAMS] = {1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0};

static inline int gpt2_param_is_layer(int i) { return i >= GPT2_FIRST_LAYER_PARAM && i <= GPT2_LAST_LAYER_PARAM; }
static inline int gpt2_param_is_ln_weight(int i) {
    return i == GPT2_LN1W || i == GPT2_LN2W || i == GPT2_LNFW || i == GPT2_LNEW;
}

// Elements of each parameter tensor of a model of shape c.
static inline void gpt2_param_sizes(const GPT2Config *c, int64_t s[GPT2_NUM_PARAMS]) {
    int64_t Vp = c->padded_vocab_size, C = c->channels, L = c->num_layers, maxT = c->max_seq_len;
    int64_t st = c->stable_embedding ? C : 0;
    int64_t sizes[GPT2_NUM_PARAMS] = {Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
                                      L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C, st, st};
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) s[i] = sizes[i];
}
static inline int64_t gpt2_num_parameters(const GPT2Config *c) {
    int64_t s[GPT2_NUM_PARAMS], n = 0;
    gpt2_param_sizes(c, s);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += s[i];
    return n;
}

// Called by a model's backward, in order, each time a group of gradients is final: which =
// GPT2_GRADS_LNF (lnfw, lnfb), then layer L-1 .. 0 (that layer's slices of the per-layer tensors),
// then GPT2_GRADS_EMBED (wte, wpe, lnew, lneb: the tied wte is final only after the encoder's
// backward). The GPU model passes its stream (enqueue the consumer there), the CPU model NULL.
// A nonzero return stops backward, which then fails.
#define GPT2_GRADS_LNF (-1)
#define GPT2_GRADS_EMBED (-2)
typedef int (*gpt2_grads_ready)(void *ctx, int which, struct CUstream_st *stream);

// Random numbers of the trainer and the CPU model's initialization: splitmix64, one 64-bit state (a
// checkpoint saves it in one word).
typedef struct { uint64_t s; } Rng;
static inline uint64_t rng_u64(Rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline float rng_uniform(Rng *r) { return (float)(rng_u64(r) >> 40) * 0x1.0p-24f; }   // [0, 1)
static inline float rng_normal(Rng *r) {                                                     // Box-Muller
    double u1 = ((double)(rng_u64(r) >> 11) + 1.0) * 0x1.0p-53, u2 = (double)(rng_u64(r) >> 11) * 0x1.0p-53;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

#ifdef __cplusplus
}
#endif
#endif // GPT2_H
