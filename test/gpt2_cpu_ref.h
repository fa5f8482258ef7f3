/*
gpt2_cpu_ref.h — the CPU model (gpt2_cpu.h) behind a few plain C calls, for the GPU model's test
(test/test_gpt2_cuda.cu).
*/
#ifndef GPT2_CPU_REF_H
#define GPT2_CPU_REF_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

// A CPU model from a descriptor ("d2c64h4v100t64", "d12", ...) with GPT-2 initialization
// (seed), StableEmbedding on or off; activations for (B, T) unless B = 0 (parameters only).
// config receives maxT, V, Vp, L, NH, C, stable_embedding. 0 = ok, else ref_error() says why.
int ref_create(void **out, const char *descriptor, int stable_embedding, uint64_t seed, int B, int T, int config[7]);
void ref_free(void *h);
const char *ref_error(void);
int64_t ref_num_params(void *h);
void ref_param_sizes(void *h, int64_t sizes[18]);
float *ref_params(void *h);   // (num_params) fp32, the trainer's layout
float *ref_grads(void *h);
// The CPU model's forward (gpt2_forward); logits (B*T, Vp) before the softmax and losses (B*T) when
// not NULL. Returns the mean loss.
float ref_forward(void *h, const int *inputs, const int *targets, int B, int T, float *logits, float *losses);
// The CPU model's backward of the last forward, overwriting the gradients.
void ref_backward(void *h);

#ifdef __cplusplus
}
#endif
#endif
