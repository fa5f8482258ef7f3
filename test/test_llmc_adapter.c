/*
test_llmc_adapter.c — adapters/llmc/bnb8_llmc.h, the file llm.c's train_gpt2.cu includes, on the CPU:
llm.c's parameter layout (16 tensors in one buffer, tensors 2..13 stacked over the layers) with bf16
weights in host memory, stepped the way llm.c's gpt2_update calls it. Under llm.c's ZeRO-1 each of N
ranks steps its own part of every layer's slice and llm.c then all-gathers the weights; here N
adapters, each on its own copy of the buffer, stand for the ranks, and their parts gathered after
every step must equal one unsharded adapter's weights bit for bit, for every recipe; and each rank's
state, written and read back as llm.c's state file holds it, restores its parts.
*/
#define _POSIX_C_SOURCE 200809L   // setenv
#include "adapters/llmc/bnb8_llmc.h"
#include "test/test.h"
#include <stdlib.h>
#include <string.h>

// A small GPT-2 in llm.c's order: wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b,
// fcw, fcb, fcprojw, fcprojb, lnfw, lnfb. Sizes chosen so every slice halves on a block boundary.
enum { V = 512, MAXT = 64, C = 64, L = 2, RANKS = 2, STEPS = 4 };

static void llmc_elements(size_t e[BNB8_LLMC_TENSORS]) {
    const size_t sizes[BNB8_LLMC_TENSORS] = {
        (size_t)V * C, (size_t)MAXT * C, (size_t)L * C, (size_t)L * C, (size_t)L * 3 * C * C, (size_t)L * 3 * C,
        (size_t)L * C * C, (size_t)L * C, (size_t)L * C, (size_t)L * C, (size_t)L * 4 * C * C, (size_t)L * 4 * C,
        (size_t)L * C * 4 * C, (size_t)L * C, C, C};
    memcpy(e, sizes, sizeof sizes);
}

// llm.c decays the matrices (wte, wpe, qkvw, attprojw, fcw, fcprojw) and not the biases or norms.
static float llmc_decay(int i) { return i == 0 || i == 1 || i == 4 || i == 6 || i == 10 || i == 12 ? 0.1f : 0.0f; }

// One llm.c update of every tensor (its step number t, a cosine-like lr, a clip factor below 1).
static void llmc_update(Bnb8Llmc *b, int t) {
    for (int i = 0; i < BNB8_LLMC_TENSORS; i++)
        bnb8_llmc_step(b, i, 6e-4f * (1.0f - 0.1f * (float)t), 0.9f, 0.95f, 1e-8f, llmc_decay(i), 0.8f, t, NULL);
}

// Rank r's part of tensor i's slice l, in elements of the buffer: [*at, *at + *n).
static void rank_part(const size_t e[BNB8_LLMC_TENSORS], int i, int l, int r, size_t *at, size_t *n) {
    size_t offset = 0;
    for (int k = 0; k < i; k++) offset += e[k];
    int layers = i < 2 || i > 13 ? 1 : L;
    size_t slice = e[i] / (size_t)layers;
    *n = slice / RANKS;
    *at = offset + (size_t)l * slice + (size_t)r * *n;
}

static void test_zero1_parts_equal_the_whole(void) {
    static const char *recipes[] = {"8bit-int8", "flash", "8bit-fp32", "fp32"};
    size_t e[BNB8_LLMC_TENSORS], total = 0;
    llmc_elements(e);
    for (int i = 0; i < BNB8_LLMC_TENSORS; i++) total += e[i];
    test_rng rng = test_rng_new();
    uint16_t *init = malloc(total * 2), *whole = malloc(total * 2), *grads = malloc(total * 2);
    uint16_t *ranks[RANKS];
    for (int r = 0; r < RANKS; r++) ranks[r] = malloc(total * 2);
    for (size_t k = 0; k < total; k++) init[k] = bnb8_f32_to_bf16((float)(0.02 * test_randn(&rng)));
    for (size_t k = 0; k < sizeof recipes / sizeof recipes[0]; k++) {
        setenv("BNB8_RECIPE", recipes[k], 1);
        Bnb8Llmc one, part[RANKS];
        memcpy(whole, init, total * 2);
        EXPECT(bnb8_llmc_open(&one, whole, grads, e, 2, L, 0, 1, 0) == 1, "%s: the adapter took llm.c's AdamW", recipes[k]);
        EXPECT(bnb8_optimizer_count(one.opt) == 2 + 12 * L + 2, "%s: %d tensors registered, not one per slice",
               recipes[k], bnb8_optimizer_count(one.opt));
        for (int r = 0; r < RANKS; r++) {
            memcpy(ranks[r], init, total * 2);
            bnb8_llmc_open(&part[r], ranks[r], grads, e, 2, L, r, RANKS, 1);
        }
        int64_t differ = 0;
        for (int t = 1; t <= STEPS; t++) {
            for (size_t j = 0; j < total; j++) grads[j] = bnb8_f32_to_bf16((float)(0.1 * test_randn(&rng)));
            llmc_update(&one, t);
            for (int r = 0; r < RANKS; r++) llmc_update(&part[r], t);
            // llm.c's all-gather: every rank gets every rank's part
            for (int i = 0; i < BNB8_LLMC_TENSORS; i++)
                for (int l = 0; l < (i < 2 || i > 13 ? 1 : L); l++)
                    for (int r = 0; r < RANKS; r++) {
                        size_t at, n;
                        rank_part(e, i, l, r, &at, &n);
                        for (int q = 0; q < RANKS; q++) if (q != r) memcpy(ranks[q] + at, ranks[r] + at, n * 2);
                    }
            for (int r = 0; r < RANKS; r++)
                for (size_t j = 0; j < total; j++) differ += ranks[r][j] != whole[j];
        }
        EXPECT(differ == 0, "%s: %lld weights of the ranks differ from one process's", recipes[k], (long long)differ);
        size_t moved = 0;
        for (size_t j = 0; j < total; j++) moved += whole[j] != init[j];
        EXPECT(moved > total / 2, "%s: only %zu of %zu weights moved", recipes[k], moved, total);
        // each rank's state through a stream, as in llm.c's state file, into a fresh adapter on zeroed weights
        for (int r = 0; r < RANKS; r++) {
            FILE *f = tmpfile();
            Bnb8Llmc back;
            uint16_t *zeroed = calloc(total, 2);
            bnb8_llmc_write(&part[r], f);
            rewind(f);
            bnb8_llmc_open(&back, zeroed, grads, e, 2, L, r, RANKS, 1);
            bnb8_llmc_read(&back, f);
            int64_t lost = 0;
            for (int i = 0; i < BNB8_LLMC_TENSORS; i++)
                for (int l = 0; l < (i < 2 || i > 13 ? 1 : L); l++) {
                    size_t at, n;
                    rank_part(e, i, l, r, &at, &n);
                    lost += memcmp(zeroed + at, ranks[r] + at, n * 2) != 0;
                }
            EXPECT(lost == 0, "%s: rank %d: %lld parts not restored from its state", recipes[k], r, (long long)lost);
            bnb8_llmc_free(&back);
            free(zeroed);
            fclose(f);
        }
        bnb8_llmc_free(&one);
        for (int r = 0; r < RANKS; r++) bnb8_llmc_free(&part[r]);
    }
    unsetenv("BNB8_RECIPE");
    for (int r = 0; r < RANKS; r++) free(ranks[r]);
    free(init); free(whole); free(grads);
}

void tests_llmc_adapter(void) {
    test_run("llm.c adapter: ZeRO-1's parts on 2 ranks, gathered, equal one process's weights, every recipe",
             test_zero1_parts_equal_the_whole);
}
