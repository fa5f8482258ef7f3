/*
fuzz_model.c — libFuzzer harness for the trainer's model loader (gpt2_load: llm.c's fp32 version 3
and bf16 version 5; StableEmbedding as bnb8's versions 8003 / 8005, or as header[8] = 1 in a version
3 or 5 file written before those). The input is the file. A file that loads must run a small forward
pass and survive a save / load round trip bit for bit, and a StableEmbedding model must save with a
version llm.c refuses; everything else must be refused with a message naming the file. ASan / UBSan /
LeakSanitizer catch the rest.
*/
#define _POSIX_C_SOURCE 200809L
#include "../../trainer/gpt2_cpu.h"
#include "../../trainer/gpt2_data.h"
#include "fuzz_util.h"

// The file at path with header[1] = version, under the seed name.
static void put_older_seed(const char *dir, const char *name, const char *path, int32_t version) {
    size_t size;
    uint8_t *d = fuzz_slurp(path, &size);
    if (!d || size < 1024) abort();
    memcpy(d + 4, &version, 4);
    fuzz_put_seed(dir, name, d, size);
    free(d);
}

// Seeds: tiny models as fp32 and bf16 files, with and without StableEmbedding, Vp > V; and the
// StableEmbedding ones in the older form too (version 3 or 5, header[8] = 1).
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    const char *dir = getenv("FUZZ_WRITE_SEEDS");
    if (!dir) return 0;
    const char *descs[2] = {"d1c8h1v16t4", "d2c16h2v60t8"};
    for (int k = 0; k < 2; k++)
        for (int stable = 0; stable < 2; stable++)
            for (int bf16 = 0; bf16 < 2; bf16++) {
                GPT2Config c;
                GPT2 m;
                if (gpt2_config_from_descriptor(&c, descs[k])) abort();
                c.stable_embedding = stable;
                const char *path = fuzz_path("seed.bin");
                if (gpt2_init_random(&m, &c, 7) || gpt2_save(&m, path, bf16)) abort();
                char name[64];
                snprintf(name, sizeof name, "%s_stable%d_%s", descs[k], stable, bf16 ? "bf16" : "fp32");
                fuzz_seed_from_file(dir, name, path);
                if (stable) put_older_seed(dir, strcat(name, "_older"), path, bf16 ? 5 : 3);
                gpt2_free(&m);
                remove(path);
            }
    exit(0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write_file("model.bin", data, size);
    char saved[256];
    snprintf(saved, sizeof saved, "%s", fuzz_path("model_saved.bin"));
    train_error_text[0] = 0;
    GPT2 m;
    if (gpt2_load(&m, path) != 0) {
        if (!strstr(train_error_text, path)) { fprintf(stderr, "message does not name the file: %s\n", train_error_text); abort(); }
        return 0;
    }
    // A model that loads works: one forward of a few positions with in-range tokens.
    int64_t T = m.config.max_seq_len < 4 ? m.config.max_seq_len : 4;
    if (gpt2_alloc_acts(&m, 1, T) == 0) {
        for (int64_t t = 0; t < T; t++) { m.inputs[t] = (int)(t % m.config.vocab_size); m.targets[t] = 0; }
        gpt2_forward(&m, m.inputs, m.targets, 1, T);
    }
    // Save as fp32 and load back: the same configuration and the same bits.
    GPT2 back;
    if (gpt2_save(&m, saved, 0) != 0 || gpt2_load(&back, saved) != 0) {
        fprintf(stderr, "round trip failed: %s\n", train_error_text);
        abort();
    }
    if (memcmp(&back.config, &m.config, sizeof m.config) != 0 || back.num_parameters != m.num_parameters ||
        memcmp(back.params_memory, m.params_memory, sizeof(float) * (size_t)m.num_parameters) != 0) {
        fprintf(stderr, "round trip changed the model\n");
        abort();
    }
    // llm.c reads versions 3 and 5 as a GPT-2 without StableEmbedding's layernorm: never written for one
    int32_t version = 0;
    FILE *f = fopen(saved, "rb");
    if (!f || fseek(f, 4, SEEK_SET) != 0 || fread(&version, 4, 1, f) != 1) abort();
    fclose(f);
    if (m.config.stable_embedding && (version == 3 || version == 5)) {
        fprintf(stderr, "a StableEmbedding model saved as llm.c's version %d\n", version);
        abort();
    }
    gpt2_free(&back);
    gpt2_free(&m);
    remove(saved);
    return 0;
}
