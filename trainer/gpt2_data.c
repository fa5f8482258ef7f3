/*
gpt2_data.c — llm.c's token and tokenizer files, the data loader, and the file helpers the
model files and checkpoints use; see gpt2_data.h.
*/
#define _POSIX_C_SOURCE 200809L   // fseeko
#include "gpt2_data.h"
#include "bnb8.h"
#include <stdlib.h>
#include <stdarg.h>
#include <string.h>

char train_error_text[1024];

int train_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(train_error_text, sizeof train_error_text, fmt, ap);
    va_end(ap);
    return -1;
}

int host_is_little_endian(void) { uint16_t one = 1; uint8_t b; memcpy(&b, &one, 1); return b == 1; }

FILE *open_input(const char *path, const char *what) {
    char who[64];
    snprintf(who, sizeof who, "%s file", what);
    FILE *f = bnb8_open_regular(path, who);
    if (!f) train_fail("%s", bnb8_last_error());
    return f;
}

int file_size_of(FILE *f, const char *path, int64_t *size) {
    if (fseeko(f, 0, SEEK_END) != 0) return train_fail("%s: cannot seek", path);
    off_t s = ftello(f);
    if (s < 0 || fseeko(f, 0, SEEK_SET) != 0) return train_fail("%s: cannot seek", path);
    *size = (int64_t)s;
    return 0;
}

int read_header(FILE *f, const char *path, const char *what, int32_t h[HEADER_INTS], int64_t *size) {
    if (!host_is_little_endian()) return train_fail("%s: big-endian hosts are not supported", path);
    if (file_size_of(f, path, size)) return -1;
    if (*size < (int64_t)sizeof(int32_t) * HEADER_INTS || fread(h, sizeof(int32_t), HEADER_INTS, f) != HEADER_INTS)
        return train_fail("%s: truncated %s file: %lld bytes, shorter than its 1024-byte header", path, what, (long long)*size);
    return 0;
}

int write_atomically(const char *path, file_writer writer, const void *ctx) {
    return bnb8_write_atomically(path, writer, ctx) ? train_fail("%s", bnb8_last_error()) : 0;
}

int tokens_load(TokenFile *t, const char *path) {
    memset(t, 0, sizeof *t);
    snprintf(t->path, sizeof t->path, "%s", path);
    FILE *f = open_input(path, "tokens");
    if (!f) return -1;
    int32_t h[HEADER_INTS];
    int64_t size;
    int status = read_header(f, path, "tokens", h, &size);
    if (!status && h[0] != TOKENS_MAGIC)
        status = train_fail("%s: not an llm.c tokens file (magic %d, expected %d)", path, h[0], TOKENS_MAGIC);
    if (!status && h[1] != 1) status = train_fail("%s: tokens file version %d, expected 1", path, h[1]);
    if (!status && h[2] < 0) status = train_fail("%s: negative token count %d", path, h[2]);
    if (!status && size != 1024 + 2 * (int64_t)h[2])
        status = train_fail("%s: %s tokens file has %lld bytes, its header says %d tokens (%lld bytes)", path,
                            size < 1024 + 2 * (int64_t)h[2] ? "truncated" : "oversized", (long long)size, h[2],
                            (long long)(1024 + 2 * (int64_t)h[2]));
    if (!status) {
        t->count = h[2];
        t->tokens = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(t->count > 0 ? t->count : 1));
        if (!t->tokens) status = train_fail("out of memory for %s", path);
        else if (fread(t->tokens, 2, (size_t)t->count, f) != (size_t)t->count)
            status = train_fail("%s: truncated tokens file (read failed)", path);
    }
    fclose(f);
    if (status) { free(t->tokens); t->tokens = NULL; }
    return status;
}

int tokens_check_vocab(const TokenFile *t, int V) {
    for (int64_t i = 0; i < t->count; i++)
        if (t->tokens[i] >= V)
            return train_fail("%s: token %lld is %d, outside the model's vocabulary of %d", t->path, (long long)i,
                              t->tokens[i], V);
    return 0;
}

int64_t tokens_digest(const TokenFile *t) {
    uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)t->count;
    for (int64_t i = 0; i < t->count; i += 4) {
        uint64_t w = 0;
        for (int64_t k = 0; k < 4 && i + k < t->count; k++) w |= (uint64_t)t->tokens[i + k] << (16 * k);
        h = (h ^ w) * 0x100000001b3ull;
    }
    return h ? (int64_t)h : 1;
}

void tokenizer_free(Tokenizer *t) { free(t->data); free(t->offset); memset(t, 0, sizeof *t); }

int tokenizer_load(Tokenizer *t, const char *path) {
    memset(t, 0, sizeof *t);
    FILE *f = open_input(path, "tokenizer");
    if (!f) return -1;
    int32_t h[HEADER_INTS];
    int64_t size, n = 0;
    int status = read_header(f, path, "tokenizer", h, &size);
    if (!status && h[0] != TOKENIZER_MAGIC)
        status = train_fail("%s: not an llm.c tokenizer file (magic %d, expected %d)", path, h[0], TOKENIZER_MAGIC);
    if (!status && h[1] != 1 && h[1] != 2) status = train_fail("%s: tokenizer file version %d, expected 1 or 2", path, h[1]);
    // Version 1 has no end-of-text id: llm.c takes GPT-2's, 50256, and accepts only GPT-2's
    // vocabulary, where that id is right; so does this loader.
    if (!status && h[1] == 1 && h[2] != TOKENIZER_V1_VOCAB)
        status = train_fail("%s: tokenizer file version 1 has no end-of-text id, which is GPT-2's (%d) only for GPT-2's "
                            "vocabulary of %d tokens; this one has %d: write it as version 2, with its end-of-text id",
                            path, TOKENIZER_V1_EOT, TOKENIZER_V1_VOCAB, h[2]);
    if (!status && h[1] == 1) h[3] = TOKENIZER_V1_EOT;
    if (!status && (h[2] < 1 || h[2] > (1 << 24) || h[3] < 0 || h[3] >= h[2]))
        status = train_fail("%s: bad tokenizer header: vocabulary %d, end-of-text id %d", path, h[2], h[3]);
    if (!status && size - 1024 < 2 * (int64_t)h[2])   // before allocating: each token takes >= 2 bytes
        status = train_fail("%s: truncated tokenizer file: %lld bytes after the header cannot hold %d tokens", path,
                            (long long)(size - 1024), h[2]);
    if (!status) {
        n = size - 1024;
        t->vocab_size = h[2];
        t->eot = h[3];
        t->data = (uint8_t *)malloc((size_t)(n > 0 ? n : 1));
        t->offset = (int64_t *)malloc(sizeof(int64_t) * (size_t)t->vocab_size);
        if (!t->data || !t->offset) status = train_fail("out of memory for %s", path);
        else if (fread(t->data, 1, (size_t)n, f) != (size_t)n) status = train_fail("%s: read failed", path);
    }
    int64_t pos = 0;
    for (int i = 0; !status && i < t->vocab_size; i++) {
        if (pos >= n) { status = train_fail("%s: truncated tokenizer file: ends at token %d of %d", path, i, t->vocab_size); break; }
        int len = t->data[pos];
        if (len == 0) { status = train_fail("%s: token %d has length 0", path, i); break; }
        if (pos + 1 + len > n) { status = train_fail("%s: truncated tokenizer file: token %d runs past the end", path, i); break; }
        t->offset[i] = pos + 1;
        pos += 1 + len;
    }
    if (!status && pos != n)
        status = train_fail("%s: oversized tokenizer file: %lld bytes after the last token", path, (long long)(n - pos));
    fclose(f);
    if (status) tokenizer_free(t);
    return status;
}

void tokenizer_print(const Tokenizer *t, int id, FILE *out) {
    if (!t->data || id < 0 || id >= t->vocab_size) { fprintf(out, "<%d>", id); return; }
    const uint8_t *s = t->data + t->offset[id];
    int len = s[-1];
    for (int i = 0; i < len; i++) fputc(s[i] < 32 && s[i] != '\n' && s[i] != '\t' ? '?' : s[i], out);
}

int loader_init(DataLoader *d, const TokenFile *file, int64_t B, int64_t T) {
    memset(d, 0, sizeof *d);
    if (file->count < B * T + 1)
        return train_fail("%s has %lld tokens, fewer than one batch needs (B*T+1 = %lld)", file->path,
                          (long long)file->count, (long long)(B * T + 1));
    d->file = file; d->B = B; d->T = T;
    d->inputs = (int *)malloc(sizeof(int) * (size_t)(B * T));
    d->targets = (int *)malloc(sizeof(int) * (size_t)(B * T));
    if (!d->inputs || !d->targets) return train_fail("out of memory for a batch");
    return 0;
}
void loader_free(DataLoader *d) { free(d->inputs); free(d->targets); memset(d, 0, sizeof *d); }

void loader_next(DataLoader *d) {
    int64_t n = d->B * d->T;
    if (d->position + n + 1 > d->file->count) d->position = 0;
    const uint16_t *p = d->file->tokens + d->position;
    for (int64_t i = 0; i < n; i++) { d->inputs[i] = p[i]; d->targets[i] = p[i + 1]; }
    d->position += n;
}
