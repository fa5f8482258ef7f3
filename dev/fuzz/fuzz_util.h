/*
fuzz_util.h — what the libFuzzer harnesses share: the input written to a per-process temporary file
(the loaders take a path), and a per-process temporary directory.

Each harness is one C file built with clang -fsanitize=fuzzer,address,undefined (`make fuzz`).
*/
#ifndef BNB8_FUZZ_UTIL_H
#define BNB8_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// Where scratch files go: $FUZZ_TMPDIR, else /dev/shm (memory: no disk traffic for the fsyncs of
// the savers), else /tmp.
static inline const char *fuzz_tmpdir(void) {
    const char *d = getenv("FUZZ_TMPDIR");
    if (d && d[0]) return d;
    return access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
}

// The path of this process's scratch file NAME (libFuzzer may run several processes). The text
// lives in one of 8 rotating buffers: valid until 8 more calls.
static inline const char *fuzz_path(const char *name) {
    static char paths[8][256];
    static int next;
    char *path = paths[next++ & 7];
    snprintf(path, 256, "%s/bnb8_fuzz_%ld_%s", fuzz_tmpdir(), (long)getpid(), name);
    return path;
}

// Writes data to the scratch file NAME and returns its path; aborts if /tmp cannot take it (that
// is the harness's problem, not the loader's).
static inline const char *fuzz_write_file(const char *name, const uint8_t *data, size_t size) {
    const char *path = fuzz_path(name);
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) {
        fprintf(stderr, "fuzz harness: cannot write %s\n", path);
        abort();
    }
    return path;
}

// Seeds: run a harness with FUZZ_WRITE_SEEDS=DIR and its LLVMFuzzerInitialize writes valid inputs,
// made with the library's and the trainer's own writers, into DIR and exits (`make fuzz` does this).
static inline void fuzz_put_seed(const char *dir, const char *name, const void *data, size_t size) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) {
        fprintf(stderr, "fuzz harness: cannot write seed %s\n", path);
        exit(1);
    }
}

// The whole file at path, or NULL.
static inline uint8_t *fuzz_slurp(const char *path, size_t *size) {
    *size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *d = (uint8_t *)malloc(len > 0 ? (size_t)len : 1);
    if (d && len > 0 && fread(d, 1, (size_t)len, f) != (size_t)len) { free(d); d = NULL; }
    fclose(f);
    if (d) *size = len > 0 ? (size_t)len : 0;
    return d;
}

// Seeds a file from a path (written by the code under test) under the seed name.
static inline void fuzz_seed_from_file(const char *dir, const char *name, const char *path) {
    size_t size;
    uint8_t *d = fuzz_slurp(path, &size);
    if (!d) { fprintf(stderr, "fuzz harness: cannot read %s\n", path); exit(1); }
    fuzz_put_seed(dir, name, d, size);
    free(d);
}

#endif
