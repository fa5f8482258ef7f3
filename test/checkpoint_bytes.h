// checkpoint_bytes.h: a checkpoint's optimizer file by the formats (DESIGN.md §8.4), for the trainer's
// tests on the CPU (test_train.c) and on the GPU (test_train_gpu.c). Needs trainer/trainer.h and
// trainer/settings.h before it.
//
// Tensor by tensor as the trainer registers them at the -N exact rule (StableEmbedding off: every
// tensor by the recipe's rule; under release, and whenever the weights round stochastically, each
// per-layer tensor as L slices "name.l"): per record 4 + name + a header of
// 40 bytes (64 when the weights round stochastically: the rounding's shard and seed) + payload + 4.
// The payload is the weights as kept and AdamW's two states. The weights: fp32 for an fp32 master (its
// bf16 weights are RNE(master)) or the fp32 parity model, bf16 + the correction for an int8 or int16
// correction, bf16 alone otherwise. The states: 32-bit under 4096 elements; 8-bit codes + an fp32
// absmax per 256; 4-bit codes (two per byte) + an fp32 absmax per 128; flash codes + a 2-byte scale
// per 32. The file's 24-byte header is counted; *wte_payload, when given, gets wte's payload.
#ifndef TEST_CHECKPOINT_BYTES_H
#define TEST_CHECKPOINT_BYTES_H
#include <stdio.h>
#include <string.h>

// The optimizer tensors of parameter tensor i as the trainer registers it at the -N exact rule: L layer
// slices under release and whenever the weights round stochastically (not the fp32 parity model's), else one.
static int64_t checkpoint_slices(const GPT2Config *c, const char *recipe, int parity, int release, int i) {
    int stochastic = !parity && recipes[find_recipe(recipe)].correction_bytes == BNB8_CORRECTION_STOCHASTIC;
    return (release || stochastic) && gpt2_param_is_layer(i) ? c->num_layers : 1;
}

static double checkpoint_optimizer_bytes(const char *desc, const char *recipe, int parity, int release,
                                         double *wte_payload) {
    GPT2Config c;
    gpt2_config_from_descriptor(&c, desc);
    c.stable_embedding = 0;
    int64_t sizes[GPT2_NUM_PARAMS];
    gpt2_param_sizes(&c, sizes);
    const Recipe *r = &recipes[find_recipe(recipe)];
    const int cb = r->correction_bytes, stochastic = !parity && cb == BNB8_CORRECTION_STOCHASTIC;
    double bytes = 24.0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        if (!sizes[i]) continue;
        int64_t slices = checkpoint_slices(&c, recipe, parity, release, i), n = sizes[i] / slices;
        for (int64_t l = 0; l < slices; l++) {
            char name[64];
            if (slices > 1) snprintf(name, sizeof name, "%s.%lld", gpt2_param_names[i], (long long)l);
            else snprintf(name, sizeof name, "%s", gpt2_param_names[i]);
            double weights = parity || cb == 4 ? 4.0 * (double)n : (cb == 1 || cb == 2 ? 2.0 + cb : 2.0) * (double)n;
            double per_state = sizes[i] < 4096 || r->states == BNB8_STATE_32BIT ? 4.0 * (double)n
                             : r->states == BNB8_STATE_8BIT ? (double)n + 4.0 * (double)((n + 255) / 256)
                             : r->states == BNB8_STATE_4BIT ? (double)((n + 1) / 2) + 4.0 * (double)((n + 127) / 128)
                             : (double)n + 2.0 * (double)((n + 31) / 32);
            double payload = weights + 2 * per_state;
            if (i == GPT2_WTE && wte_payload) *wte_payload = payload;
            bytes += 4 + (double)strlen(name) + (stochastic ? 64 : 40) + payload + 4;
        }
    }
    return bytes;
}
#endif
