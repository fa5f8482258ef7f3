/*
gpt2_cpu_ref.c — the trainer's CPU model as the reference of the GPU model's test; see gpt2_cpu_ref.h.
Compiled by the C compiler with the library's CFLAGS and linked into build/test_gpt2_cuda.
*/
#define TRAIN_NO_MAIN
#pragma GCC diagnostic ignored "-Wunused-function"   // the trainer's main-only helpers
#include "train_gpt2_8bit.c"
#include "test/gpt2_cpu_ref.h"

int ref_create(void **out, const char *descriptor, int stable_embedding, uint64_t seed, int B, int T, int config[7]) {
    *out = NULL;
    GPT2Config c;
    if (config_from_descriptor(&c, descriptor)) return -1;
    c.stable_embedding = stable_embedding != 0;
    GPT2 *m = (GPT2 *)calloc(1, sizeof(GPT2));
    if (!m) return train_fail("out of memory");
    if (gpt2_init_random(m, &c, seed) || (B > 0 && gpt2_alloc_acts(m, B, T))) { gpt2_free(m); free(m); return -1; }
    int cfg[7] = {c.max_seq_len, c.vocab_size, c.padded_vocab_size, c.num_layers, c.num_heads, c.channels,
                  c.stable_embedding};
    memcpy(config, cfg, sizeof cfg);
    *out = m;
    return 0;
}

void ref_free(void *h) { if (h) { gpt2_free((GPT2 *)h); free(h); } }
const char *ref_error(void) { return train_error_text; }
int64_t ref_num_params(void *h) { return ((GPT2 *)h)->num_parameters; }
void ref_param_sizes(void *h, int64_t sizes[18]) { memcpy(sizes, ((GPT2 *)h)->param_sizes, sizeof(int64_t) * 18); }
float *ref_params(void *h) { return ((GPT2 *)h)->params_memory; }
float *ref_grads(void *h) { return ((GPT2 *)h)->grads_memory; }

float ref_forward(void *h, const int *inputs, const int *targets, int B, int T, float *logits, float *losses) {
    GPT2 *m = (GPT2 *)h;
    float loss = gpt2_forward(m, inputs, targets, B, T);
    int64_t BT = (int64_t)B * T;
    // the logits again (gpt2_forward turned them into probabilities): lnf is unchanged
    if (logits) matmul_forward(logits, m->acts.lnf, m->params.wte, NULL, BT, m->config.channels, m->config.padded_vocab_size);
    if (losses && targets) memcpy(losses, m->acts.losses, sizeof(float) * (size_t)BT);
    return loss;
}

void ref_backward(void *h) {
    gpt2_zero_grad((GPT2 *)h);
    gpt2_backward((GPT2 *)h);
}
