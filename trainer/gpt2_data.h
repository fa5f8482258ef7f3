/*
gpt2_data.h — the data side of the trainer (gpt2_data.c): llm.c's tokens and tokenizer files, the
data loader that cuts them into batches, the helpers every file of the trainer reads and writes
with, and the error convention of the trainer, the CPU model and this file.

Errors: every function that can fail returns 0 or -1 and leaves a message (naming the file or
the argument) in train_error_text; nothing here prints or exits. Loaders validate every header
field and the file's size before they allocate. Formats: DESIGN.md §8.
*/
#ifndef GPT2_DATA_H
#define GPT2_DATA_H

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

// The message of the last failure, and the function that sets it (printf-style; returns -1).
extern char train_error_text[1024];
int train_fail(const char *fmt, ...);

// llm.c's files: a header of 256 little-endian int32 (magic, version, ...), then the payload.
#define MODEL_MAGIC 20240326
#define TOKENS_MAGIC 20240520
#define TOKENIZER_MAGIC 20240328
#define HEADER_INTS 256

int host_is_little_endian(void);
// Size of an open file (then rewound).
int file_size_of(FILE *f, const char *path, int64_t *size);
// Opens the input file path for reading: a regular file only, else NULL with train_error_text set
// ("what file: path is a FIFO, not a regular file"; bnb8_open_regular, which it wraps).
FILE *open_input(const char *path, const char *what);
// The 256-int header of an llm.c file of kind what ("model", ...) and the file's size.
int read_header(FILE *f, const char *path, const char *what, int32_t h[HEADER_INTS], int64_t *size);
// Writes path through writer into a temporary of its own (path.tmp.<pid>.<n>), flushes it to disk,
// then renames it: a crash never leaves a half-written file under path (bnb8_write_atomically, with
// the message in train_error_text). A writer returns 0, or -1 when a write failed.
typedef int (*file_writer)(FILE *f, const void *ctx);
int write_atomically(const char *path, file_writer writer, const void *ctx);

// Tokens file: header[2] = count, then count uint16 tokens; the size is exactly 1024 + 2 count.
typedef struct {
    char path[512];
    uint16_t *tokens;
    int64_t count;
} TokenFile;
int tokens_load(TokenFile *t, const char *path);
// Refuses a file with a token outside a vocabulary of V, naming the first one.
int tokens_check_vocab(const TokenFile *t, int V);
// A 64-bit digest of every token (FNV-1a over 8-byte words), never 0: the trainer state records it,
// so that a resume on other training data is refused.
int64_t tokens_digest(const TokenFile *t);

// Tokenizer file: header[1] = version 2, header[2] = vocabulary size, header[3] = end-of-text id;
// then per token a length byte (1..255) and its bytes, exactly to the end of the file. Version 1
// has no end-of-text id: as llm.c, it is read only for GPT-2's vocabulary, with GPT-2's id.
#define TOKENIZER_V1_VOCAB 50257
#define TOKENIZER_V1_EOT 50256
typedef struct {
    int vocab_size, eot;
    uint8_t *data;        // the file's payload
    int64_t *offset;      // (vocab_size) start of each token's bytes in data
} Tokenizer;
int tokenizer_load(Tokenizer *t, const char *path);
void tokenizer_free(Tokenizer *t);
// Prints a token's bytes; control bytes other than newline and tab are shown as '?'.
void tokenizer_print(const Tokenizer *t, int id, FILE *out);

// Batches of B sequences of T+1 consecutive tokens, read in order and wrapping around; position is
// where the next batch starts (a checkpoint saves it).
typedef struct {
    const TokenFile *file;
    int64_t B, T, position;
    int *inputs, *targets;     // (B, T)
} DataLoader;
int loader_init(DataLoader *d, const TokenFile *file, int64_t B, int64_t T);
void loader_free(DataLoader *d);
void loader_next(DataLoader *d);

#ifdef __cplusplus
}
#endif
#endif // GPT2_DATA_H
