/*
gpt2_cpu_ref.c — the CPU model (gpt2_cpu.h) as the reference of the GPU model's test; see
gpt2_cpu_ref.h. Compiled by the C compiler with the library's CFLAGS and linked into
build/test_gpt2_cuda with gpt2_cpu.c and gpt2_data.c.
*/
#include "trainer/gpt2_cpu.h"
#include "trainer/gpt2_data.h"
#include "test/gpt2_cpu_ref.h"
#include <stdlib.h>
#include <string.h>

typedef struct { GPT2 m; float *grads; } Ref;

int ref_create(void **out, const char *descriptor, int stable_embedding, uint64_t seed, int B, int T, int config[7]) {
    *out = NULL;
    GPT2Config c;
    if (gpt2_config_from_descriptor(&c, descriptor)) return -1;
    c.stable_embedding = stable_embedding != 0;
    Ref *r = (Ref *)calloc(1, sizeof(Ref));
    if (!r) return train_fail("out of memory");
    if (gpt2_init_random(&r->m, &c, seed) || (B > 0 && gpt2_alloc_acts(&r->m, B, T)) ||
        !(r->grads = (float *)calloc((size_t)r->m.num_parameters, sizeof(float)))) {
        ref_free(r);
        return train_fail("%s", train_error_text[0] ? train_error_text : "out of memory");
    }
    int cfg[7] = {c.max_seq_len, c.vocab_size, c.padded_vocab_size, c.num_layers, c.num_heads, c.channels,
                  c.stable_embedding};
    memcpy(config, cfg, sizeof cfg);
    *out = r;
    return 0;
}

void ref_free(void *h) {
    Ref *r = (Ref *)h;
    if (!r) return;
    gpt2_free(&r->m);
    free(r->grads);
    free(r);
}
const char *ref_error(void) { return train_error_text; }
int64_t ref_num_params(void *h) { return ((Ref *)h)->m.num_parameters; }
void ref_param_sizes(void *h, int64_t sizes[GPT2_NUM_PARAMS]) { memcpy(sizes, ((Ref *)h)->m.param_sizes, sizeof(int64_t) * GPT2_NUM_PARAMS); }
float *ref_params(void *h) { return ((Ref *)h)->m.params_memory; }
float *ref_grads(void *h) { return ((Ref *)h)->grads; }

float ref_forward(void *h, const int *inputs, const int *targets, int B, int T, float *logits, float *losses) {
    GPT2 *m = &((Ref *)h)->m;
    float loss = gpt2_forward(m, inputs, targets, B, T);
    int64_t BT = (int64_t)B * T;
    if (logits) gpt2_get_logits(m, logits, 0, BT);   // the logits again: gpt2_forward made probabilities of them
    if (losses && targets) memcpy(losses, m->acts.losses, sizeof(float) * (size_t)BT);
    return loss;
}

void ref_backward(void *h) { gpt2_backward(&((Ref *)h)->m, ((Ref *)h)->grads, 0, NULL, NULL); }
