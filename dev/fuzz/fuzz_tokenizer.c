/*
fuzz_tokenizer.c — libFuzzer harness for the trainer's llm.c tokenizer loader (tokenizer_load). The
input is the file; a tokenizer that loads prints every token (to /dev/null) and ids out of range.
*/
#define _POSIX_C_SOURCE 200809L
#include "../../trainer/gpt2_data.h"
#include "fuzz_util.h"

// Seeds: a 1-token and an 8-token vocabulary (bytes of every kind, one 255-byte token), and a
// version 1 file (no end-of-text id: GPT-2's vocabulary only) of one-byte tokens.
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    const char *dir = getenv("FUZZ_WRITE_SEEDS");
    if (!dir) return 0;
    for (int k = 0; k < 3; k++) {
        static uint8_t file[1024 + 2 * TOKENIZER_V1_VOCAB];
        memset(file, 0, sizeof file);
        int vocab = k == 2 ? TOKENIZER_V1_VOCAB : k ? 8 : 1;
        int32_t h[4] = {TOKENIZER_MAGIC, k == 2 ? 1 : 2, vocab, k == 2 ? 0 : vocab - 1};
        memcpy(file, h, sizeof h);
        size_t at = 1024;
        for (int i = 0; i < vocab; i++) {
            int len = k == 2 ? 1 : i == 5 ? 255 : 1 + i;
            file[at++] = (uint8_t)len;
            for (int j = 0; j < len; j++) file[at++] = (uint8_t)(i == 3 ? j : 'a' + (i + j) % 26);
        }
        char name[32];
        snprintf(name, sizeof name, "tokenizer_%d", vocab);
        fuzz_put_seed(dir, name, file, at);
    }
    exit(0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static FILE *sink;
    if (!sink) sink = fopen("/dev/null", "w");
    const char *path = fuzz_write_file("tokenizer.bin", data, size);
    train_error_text[0] = 0;
    Tokenizer t;
    if (tokenizer_load(&t, path) != 0) {
        if (t.data || t.offset || !strstr(train_error_text, path)) { fprintf(stderr, "bad refusal: %s\n", train_error_text); abort(); }
        return 0;
    }
    for (int i = -1; i <= t.vocab_size; i++) tokenizer_print(&t, i, sink);
    tokenizer_print(&t, t.eot, sink);
    tokenizer_free(&t);
    return 0;
}
