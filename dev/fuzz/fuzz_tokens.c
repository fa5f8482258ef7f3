/*
fuzz_tokens.c — libFuzzer harness for the trainer's llm.c tokens loader (tokens_load) and the checks
that follow it in train_run (tokens_check_vocab, loader_init / loader_next). The input is the file.
*/
#define _POSIX_C_SOURCE 200809L
#include "../../trainer/gpt2_data.h"
#include "fuzz_util.h"

// Seeds: files of 0, 1, 7 and 100 tokens.
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    const char *dir = getenv("FUZZ_WRITE_SEEDS");
    if (!dir) return 0;
    const int counts[4] = {0, 1, 7, 100};
    for (int k = 0; k < 4; k++) {
        uint8_t file[1024 + 200] = {0};
        int32_t h[3] = {TOKENS_MAGIC, 1, counts[k]};
        memcpy(file, h, sizeof h);
        for (int i = 0; i < counts[k]; i++) { uint16_t t = (uint16_t)(i * 977 % 50257); memcpy(file + 1024 + 2 * i, &t, 2); }
        char name[32];
        snprintf(name, sizeof name, "tokens_%d", counts[k]);
        fuzz_put_seed(dir, name, file, 1024 + 2 * (size_t)counts[k]);
    }
    exit(0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write_file("tokens.bin", data, size);
    train_error_text[0] = 0;
    TokenFile t;
    if (tokens_load(&t, path) != 0) {
        if (t.tokens || !strstr(train_error_text, path)) { fprintf(stderr, "bad refusal: %s\n", train_error_text); abort(); }
        return 0;
    }
    if ((int64_t)size != 1024 + 2 * t.count) { fprintf(stderr, "accepted %zu bytes for %lld tokens\n", size, (long long)t.count); abort(); }
    if (tokens_check_vocab(&t, 50257) == 0) {
        // The batches walk the file, wrapping around: every token read lies inside it.
        DataLoader d;
        if (loader_init(&d, &t, 2, 3) == 0)
            for (int i = 0; i < 5; i++) loader_next(&d);
        loader_free(&d);
    }
    free(t.tokens);
    return 0;
}
