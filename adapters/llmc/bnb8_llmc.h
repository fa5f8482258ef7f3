/*
bnb8_llmc.h — bnb8's optimizers inside llm.c's train_gpt2.cu, through bnb8.h alone.
Copyright (c) 2026 the bnb8 authors, MIT licence (LICENSE). doc/your_trainer.md is the guide: what
to copy, the lines train_gpt2.cu gets, the Makefile rule.

llm.c keeps its 16 parameter tensors in one buffer, the layers' tensors stacked (L layers each), and
steps them in gpt2_update with its AdamW: fp32 m and v, and an fp32 master copy of the bf16 weights
(12 bytes per parameter, besides the weights and gradients). With BNB8_RECIPE set in the
environment, this file registers every layer's slice of every tensor with one bnb8 optimizer, llm.c
allocates none of m, v and master, and each tensor's AdamW step is bnb8's, at the learning rate,
betas, eps, weight decay, clip factor and step number llm.c passes:

  BNB8_RECIPE     states               master of the bf16 weights   bytes per parameter (states + master)
  8bit-int8       8-bit block-wise     int8 correction               ~3.03
  8bit-fp32       8-bit block-wise     fp32 master                   ~6.03
  flash           flash (companded)    int8 correction               ~3.13
  fp32            32-bit               fp32 master                   12 (llm.c's own layout, for parity checks)
  unset, adamw    llm.c's own AdamW

A slice is one bnb8 tensor, so a layer's small tensors (layernorms, biases, under min_8bit_size)
keep 32-bit states, as in frameworks that hold layers apart. Under llm.c's ZeRO-1 (-z 1, several
processes) each rank registers its part of every slice (bnb8 shards: cfg.shard_offset / shard_total)
where llm.c steps it, and llm.c's all-gather of the weights follows as before; a part that does not
start on a boundary of bnb8's blocks is refused at start with a message. The optimizer state
(states, masters and the weights they correct) goes into llm.c's own state file, in place of m, v and
the master copy. Every failure prints a message and exits, as llm.c's own checks do.
*/
#ifndef BNB8_LLMC_H
#define BNB8_LLMC_H

#include "bnb8.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BNB8_LLMC_TENSORS 16   // llm.c's NUM_PARAMETER_TENSORS
#define BNB8_LLMC_MAX_LAYERS 256

typedef struct {
    bnb8_optimizer *opt;       // NULL: llm.c's own AdamW
    const char *recipe;
    bnb8_config cfg;           // the configuration the optimizer was created with
    int layers[BNB8_LLMC_TENSORS];                          // slices of tensor i (1 or L)
    int ids[BNB8_LLMC_TENSORS][BNB8_LLMC_MAX_LAYERS];       // the optimizer id of each slice
} Bnb8Llmc;

static void bnb8_llmc_check(bnb8_status status, const char *what) {
    if (status == BNB8_OK) return;
    fprintf(stderr, "bnb8: %s: %s\n", what, bnb8_last_error());
    exit(EXIT_FAILURE);
}

// The recipe's configuration (BNB8_RECIPE); 0 when the variable asks for llm.c's own AdamW.
static int bnb8_llmc_config(const char *recipe, bnb8_config *cfg) {
    *cfg = bnb8_config_default(BNB8_ADAMW);
    if (!recipe || !recipe[0] || strcmp(recipe, "adamw") == 0) return 0;
    if (strcmp(recipe, "8bit-int8") == 0) { cfg->format = BNB8_STATE_8BIT; cfg->correction_bytes = 1; }
    else if (strcmp(recipe, "8bit-fp32") == 0) { cfg->format = BNB8_STATE_8BIT; cfg->correction_bytes = 4; }
    else if (strcmp(recipe, "flash") == 0) { cfg->format = BNB8_STATE_FLASH; cfg->correction_bytes = 1; }
    else if (strcmp(recipe, "fp32") == 0) { cfg->format = BNB8_STATE_32BIT; cfg->correction_bytes = 4; }
    else {
        fprintf(stderr, "bnb8: BNB8_RECIPE=%s: unknown (8bit-int8, 8bit-fp32, flash, fp32, or adamw for llm.c's own)\n", recipe);
        exit(EXIT_FAILURE);
    }
    return 1;
}

// gpt2_allocate_state, in place of m, v and the master copy: 0 when BNB8_RECIPE leaves llm.c's
// AdamW in charge; else 1, with every slice registered. params and grads: llm.c's buffers;
// elements[i]: tensor i's elements (all layers); weight_bytes: sizeof(floatX); rank of ranks and
// zero_stage: llm.c's multi_gpu_config.
static int bnb8_llmc_open(Bnb8Llmc *b, void *params, void *grads, const size_t elements[BNB8_LLMC_TENSORS],
                          size_t weight_bytes, int num_layers, int rank, int ranks, int zero_stage) {
    memset(b, 0, sizeof *b);
    b->recipe = getenv("BNB8_RECIPE");
    if (!bnb8_llmc_config(b->recipe, &b->cfg)) return 0;
    if (num_layers > BNB8_LLMC_MAX_LAYERS) { fprintf(stderr, "bnb8: more than %d layers\n", BNB8_LLMC_MAX_LAYERS); exit(EXIT_FAILURE); }
    bnb8_dtype dtype = weight_bytes == 4 ? BNB8_F32 : weight_bytes == 2 ? BNB8_BF16 : (bnb8_dtype)-1;
    bnb8_llmc_check(bnb8_optimizer_create(&b->opt, BNB8_ADAMW, &b->cfg), "create");
    int sharded = zero_stage == 1 && ranks > 1;
    size_t offset = 0;
    for (int i = 0; i < BNB8_LLMC_TENSORS; i++) {
        b->layers[i] = i < 2 || i > 13 ? 1 : num_layers;   // llm.c's stacked tensors: 2..13
        size_t slice = elements[i] / (size_t)b->layers[i], part = sharded ? slice / (size_t)ranks : slice;
        for (int l = 0; l < b->layers[i]; l++) {
            char name[32];
            snprintf(name, sizeof name, "%d.%d", i, l);
            size_t at = offset + (size_t)l * slice + (sharded ? (size_t)rank * part : 0);
            if (sharded) {   // this rank's part of the slice, where llm.c's ZeRO-1 steps it
                bnb8_config c = b->cfg;
                c.shard_offset = (int64_t)((size_t)rank * part);
                c.shard_total = (int64_t)slice;
                bnb8_llmc_check(bnb8_optimizer_override(b->opt, name, &c), "ZeRO-1 shard");
            }
            bnb8_llmc_check(bnb8_optimizer_add(b->opt, name, (char *)params + at * weight_bytes, dtype,
                                               (char *)grads + at * weight_bytes, dtype, (int64_t)part, &b->ids[i][l]),
                            "a tensor of llm.c's (under -z 1, try -z 0)");
        }
        offset += elements[i];
    }
    bnb8_memory m = bnb8_optimizer_memory(b->opt, 1);
    if (rank == 0)
        printf("bnb8: recipe %s: optimizer states %.0f MiB + master %.0f MiB (%.2f bytes per parameter) in place of "
               "llm.c's m, v and master\n", b->recipe, m.states / 1048576.0, m.correction / 1048576.0,
               (m.states + m.correction) / (double)m.params);
    return 1;
}

// gpt2_update, in place of tensor i's adamw_update: its slices (this rank's parts) stepped with
// llm.c's hyperparameters, its step number t and its clip factor grad_scale, on stream.
static void bnb8_llmc_step(Bnb8Llmc *b, int i, float lr, float beta1, float beta2, float eps, float weight_decay,
                           float grad_scale, int t, struct CUstream_st *stream) {
    bnb8_config c = b->cfg;   // the creation config, changed only in its hyperparameters
    c.beta1 = beta1; c.beta2 = beta2; c.eps = eps; c.weight_decay = weight_decay;
    bnb8_llmc_check(bnb8_optimizer_override(b->opt, NULL, &c), "hyperparameters");
    for (int l = 0; l < b->layers[i]; l++)
        bnb8_llmc_check(bnb8_optimizer_set_step_count(b->opt, b->ids[i][l], t - 1), "step count");
    bnb8_llmc_check(bnb8_optimizer_step_tensors(b->opt, b->ids[i], b->layers[i], lr, grad_scale, stream), "step");
}

// save_state / load_state, in place of m, v and the master copy: the optimizer's state at the
// stream's position of llm.c's state file.
static void bnb8_llmc_write(const Bnb8Llmc *b, FILE *f) { bnb8_llmc_check(bnb8_optimizer_write(b->opt, f), "writing the state"); }
static void bnb8_llmc_read(Bnb8Llmc *b, FILE *f) { bnb8_llmc_check(bnb8_optimizer_read(b->opt, f), "reading the state"); }

static void bnb8_llmc_free(Bnb8Llmc *b) { bnb8_optimizer_free(b->opt); b->opt = NULL; }

#endif // BNB8_LLMC_H
