/*
test_export.c — the model files -X writes (DESIGN.md §8.1) and what -X leaves behind: a StableEmbedding
model's file has a version llm.c refuses (it would compute another network from versions 3 and 5),
reads back into this trainer with the flag and the same weights, and the files written before with
the flag in a version 3 or 5 header still load; a model without StableEmbedding is written byte for
byte as before; the run says what the file is; the temporaries a killed export left are removed at
start, and only those. BNB8_TEST_VERBOSE=1 prints the messages.
*/
#define _POSIX_C_SOURCE 200809L   // mkdtemp, symlink
#include "trainer/trainer.h"
#include "trainer/settings.h"
#include "trainer/checkpoint.h"
#include "test.h"
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

static int xverbose;
static char xdir[64];

static void xpath(char *path, size_t size, const char *name) { snprintf(path, size, "%s/%s", xdir, name); }

// bf16 round to nearest even of a finite float, on its bits (the test's own, not the library's).
static uint16_t bits_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The bytes of a model file as DESIGN.md §8.1 lays it out, made here without the trainer's writer
// (free them): magic, version, maxT, V, L, NH, C, Vp, header[8] = flag, zeros to 256 words; then
// every parameter in the model's order, fp32 or its bf16 rounding.
static uint8_t *model_file_bytes(const GPT2 *m, int32_t version, int32_t flag, int bf16, size_t *size) {
    const GPT2Config *c = &m->config;
    int32_t h[256] = {20240326, version, c->max_seq_len, c->vocab_size, c->num_layers, c->num_heads, c->channels,
                      c->padded_vocab_size, flag};
    *size = sizeof h + (size_t)m->num_parameters * (bf16 ? 2 : 4);
    uint8_t *d = (uint8_t *)malloc(*size);
    if (!d) return NULL;
    memcpy(d, h, sizeof h);
    for (int64_t i = 0; i < m->num_parameters; i++) {
        uint16_t b = bits_to_bf16(m->params_memory[i]);
        if (bf16) memcpy(d + sizeof h + 2 * i, &b, 2);
        else memcpy(d + sizeof h + 4 * i, &m->params_memory[i], 4);
    }
    return d;
}

static void write_bytes(const char *path, const uint8_t *d, size_t size) {
    FILE *f = fopen(path, "wb");
    int ok = f && d && fwrite(d, 1, size, f) == size;
    if (f) ok &= fclose(f) == 0;
    EXPECT(ok, "cannot write %s", path);
}

// The file at path loads as m's shape, StableEmbedding as m has it, and its weights: m's (fp32) or
// their bf16 rounding.
static void expect_loads_as(const char *path, const GPT2 *m, int bf16, const char *what) {
    GPT2 back;
    if (gpt2_load(&back, path)) { EXPECT(0, "%s: %s", what, train_error_text); return; }
    EXPECT(memcmp(&back.config, &m->config, sizeof m->config) == 0, "%s: the shape or the StableEmbedding flag differs "
           "(flag %d, expected %d)", what, back.config.stable_embedding, m->config.stable_embedding);
    int64_t differ = back.num_parameters == m->num_parameters ? 0 : -1;
    for (int64_t i = 0; differ >= 0 && i < m->num_parameters; i++) {
        float want = m->params_memory[i];
        if (bf16) { uint32_t u = (uint32_t)bits_to_bf16(want) << 16; memcpy(&want, &u, 4); }
        differ += memcmp(&back.params_memory[i], &want, 4) != 0;
    }
    EXPECT(differ == 0, "%s: %lld weights differ (-1: the count)", what, (long long)differ);
    GPT2Config shape;
    EXPECT(gpt2_load_config(&shape, path) == 0 && memcmp(&shape, &m->config, sizeof shape) == 0,
           "%s: gpt2_load_config gives another shape or flag: %s", what, train_error_text);
    gpt2_free(&back);
}

// gpt2_save of a model with or without StableEmbedding, fp32 and bf16: the bytes of §8.1's layout
// with the version it names and header[8] = the flag; loaded back, the shape, the flag and the weights.
static void check_saved_files(int stable) {
    GPT2Config c;
    GPT2 m;
    gpt2_config_from_descriptor(&c, "d2c32h2v60t16");   // Vp = 64 > V
    c.stable_embedding = stable;
    if (gpt2_init_random(&m, &c, 5)) { EXPECT(0, "%s", train_error_text); return; }
    char path[256], what[64];
    xpath(path, sizeof path, "saved.bin");
    for (int bf16 = 0; bf16 < 2; bf16++) {
        snprintf(what, sizeof what, "%s file %s StableEmbedding", bf16 ? "bf16" : "fp32", stable ? "with" : "without");
        int32_t version = stable ? (bf16 ? 8005 : 8003) : (bf16 ? 5 : 3), written = 0;
        EXPECT(gpt2_save(&m, path, bf16) == 0, "%s: %s", what, train_error_text);
        size_t size = 0, want_size = 0;
        uint8_t *got = test_slurp(path, &size), *want = model_file_bytes(&m, version, stable, bf16, &want_size);
        if (got && size >= 8) memcpy(&written, got + 4, 4);
        EXPECT(!stable || (written != 3 && written != 5), "%s: version %d, which llm.c reads as a GPT-2 without the "
               "layernorm", what, written);
        EXPECT(got && want && size == want_size && memcmp(got, want, size) == 0, "%s: not the bytes of DESIGN.md §8.1 "
               "with version %d and header[8] = %d (its version: %d)", what, version, stable, written);
        free(got); free(want);
        expect_loads_as(path, &m, bf16, what);
    }
    gpt2_free(&m);
    remove(path);
}

// A StableEmbedding model is written as version 8003 (fp32) or 8005 (bf16), with header[8] = 1: never
// llm.c's 3 or 5, which llm.c would load as a GPT-2 without the layernorm.
static void test_stable_versions_llmc_refuses(void) { check_saved_files(1); }

// A model without StableEmbedding: llm.c's file, version 3 or 5 with header[8] = 0, byte for byte.
static void test_plain_files_unchanged(void) { check_saved_files(0); }

// Files written before bnb8's versions: StableEmbedding as header[8] = 1 in a version 3 or 5 header.
// They load with the flag and their weights. A version 8003 / 8005 file that says header[8] = 0
// contradicts itself and is refused, naming the file and header[8].
static void test_old_stable_files_load(void) {
    GPT2Config c;
    GPT2 m, back;
    gpt2_config_from_descriptor(&c, "d1c16h2v40t8");
    c.stable_embedding = 1;
    if (gpt2_init_random(&m, &c, 7)) { EXPECT(0, "%s", train_error_text); return; }
    char path[256];
    xpath(path, sizeof path, "old_stable.bin");
    for (int bf16 = 0; bf16 < 2; bf16++) {
        size_t size;
        uint8_t *d = model_file_bytes(&m, bf16 ? 5 : 3, 1, bf16, &size);
        write_bytes(path, d, size);
        free(d);
        expect_loads_as(path, &m, bf16, bf16 ? "version 5 file with header[8] = 1" : "version 3 file with header[8] = 1");
        d = model_file_bytes(&m, bf16 ? 8005 : 8003, 0, bf16, &size);
        write_bytes(path, d, size);
        free(d);
        train_error_text[0] = 0;
        int s = gpt2_load(&back, path);
        EXPECT(s != 0 && strstr(train_error_text, path) && strstr(train_error_text, "header[8]"),
               "version %d with header[8] = 0: load gave %d, '%s'", bf16 ? 8005 : 8003, s, train_error_text);
        if (s == 0) gpt2_free(&back);
        if (xverbose) printf("    %s\n", train_error_text);
    }
    gpt2_free(&m);
    remove(path);
}

// stdout into the file log until stdout_back(the returned descriptor).
static int stdout_to(const char *log) {
    fflush(stdout);
    int saved = dup(1), fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (saved >= 0 && fd >= 0) dup2(fd, 1);
    if (fd >= 0) close(fd);
    return saved;
}
static void stdout_back(int saved) {
    fflush(stdout);
    if (saved >= 0) { dup2(saved, 1); close(saved); }
}

// train_run with its stdout in log; *text (free it): what it printed.
static int run_printing(const TrainArgs *a, const char *log, char **text) {
    int saved = stdout_to(log), status = train_run(a, NULL);
    stdout_back(saved);
    size_t n;
    *text = (char *)test_slurp(log, &n);
    return status;
}

// The line of text that starts with prefix, as its own string (free it), or NULL.
static char *line_starting(const char *text, const char *prefix) {
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (strncmp(p, prefix, strlen(prefix)) == 0) {
            size_t n = strchr(p, '\n') ? (size_t)(strchr(p, '\n') - p) : strlen(p);
            char *line = (char *)malloc(n + 1);
            if (line) { memcpy(line, p, n); line[n] = 0; }
            return line;
        }
    return NULL;
}

static void tiny_run(TrainArgs *a, const char *model, const char *export_path) {
    train_args_default(a);
    a->val_path = ""; a->tokenizer_path = "";   // the fortunes training tokens: V = GPT-2's 50257
    a->model = model; a->given['e'] = 1;
    a->B = 2; a->T = 8; a->steps = 1; a->warmup = 1; a->recipe = "fp32";
    a->eval_every = 0; a->gen_tokens = 0; a->verbose = 1;
    a->export_path = export_path;
}

// -X of a StableEmbedding model says at start, and on the export's line, that llm.c refuses the file
// and this trainer reads it; -e reads it back. Without StableEmbedding the export's line is the
// llm.c model file's, with no note.
static void test_run_says_what_the_file_is(void) {
    char model[256], log[256], *text = NULL;
    xpath(model, sizeof model, "run_stable.bin");
    xpath(log, sizeof log, "run.log");
    TrainArgs a;
    tiny_run(&a, "d1c32h2t8", model);   // StableEmbedding on: the default for a descriptor
    EXPECT(run_printing(&a, log, &text) == 0, "StableEmbedding run with -X: %s", train_error_text);
    char *note = text ? line_starting(text, "note: -X") : NULL, *line = text ? line_starting(text, "export ") : NULL;
    EXPECT(note && strstr(note, model) && strstr(note, "8005") && strstr(note, "llm.c refuses it") &&
           strstr(note, "-w 0"), "the note at start: '%s'", note ? note : "(none)");
    EXPECT(line && strstr(line, "version 8005") && strstr(line, "StableEmbedding") &&
           strstr(line, "this trainer reads it (-e); llm.c refuses it (train with -w 0 for a model llm.c runs)"),
           "the export's line: '%s'", line ? line : "(none)");
    EXPECT(!note || !line || strstr(text, note) < strstr(text, line), "the note does not come before the export's line");
    if (xverbose) printf("    %s\n    %s\n", note ? note : "", line ? line : "");
    free(note); free(line); free(text);
    // -e reads the file back: its model, StableEmbedding on
    tiny_run(&a, model, "");
    a.stable_embedding = 1;
    EXPECT(run_printing(&a, log, &text) == 0, "-e %s: %s", model, train_error_text);
    free(text);
    // -w 0: llm.c's file, version 5, no note
    tiny_run(&a, "d1c32h2t8", model);
    a.stable_embedding = 0;
    EXPECT(run_printing(&a, log, &text) == 0, "-w 0 run with -X: %s", train_error_text);
    line = text ? line_starting(text, "export ") : NULL;
    EXPECT(line && strstr(line, "llm.c model file version 5 (bf16)") && !strstr(line, "refuses"),
           "the export's line without StableEmbedding: '%s'", line ? line : "(none)");
    EXPECT(text && !strstr(text, "note: -X"), "a note without StableEmbedding");
    free(line); free(text);
    remove(model); remove(log);
}

// A pid no process has: a child's, after it exited and was reaped.
static long gone_pid(void) {
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    if (pid > 0) waitpid(pid, NULL, 0);
    return (long)pid;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    EXPECT(f && fputs(text, f) >= 0, "cannot write %s", path);
    if (f) fclose(f);
}

// At start, -X removes the temporaries of its own path that a killed export left: regular files named
// path.tmp.<pid>.<n> whose pid no process has. It keeps a live process's (another run exporting to
// the same path now), the pid-less path.tmp, other names, and a symlink or a directory of such a name;
// it says what it removed.
static void test_removes_stale_temporaries(void) {
    char dir[128], path[1024], target[256], log[256], name[256];
    xpath(dir, sizeof dir, "exports");
    xpath(target, sizeof target, "linked.txt");
    xpath(log, sizeof log, "check.log");
    mkdir(dir, 0755);
    write_text(target, "another program's file");
    long dead = gone_pid(), own = (long)getpid();
    EXPECT(dead > 0 && kill((pid_t)dead, 0) != 0, "no finished child to take a dead pid from");
    char stale[64], kept[9][64], link_name[64], dir_name[64];
    snprintf(stale, sizeof stale, "m.bin.tmp.%ld.0", dead);
    snprintf(kept[0], sizeof kept[0], "m.bin.tmp.%ld.3", own);   // a writer alive
    snprintf(kept[1], sizeof kept[1], "m.bin.tmp");             // names no writer
    snprintf(kept[2], sizeof kept[2], "m.bin.tmp.0.0");         // pid 0 is no process's
    snprintf(kept[3], sizeof kept[3], "other.bin.tmp.%ld.0", dead);
    snprintf(kept[4], sizeof kept[4], "m.bin.tmp.%ld", dead);
    snprintf(kept[5], sizeof kept[5], "m.bin.tmp.%ld.0.x", dead);
    snprintf(kept[6], sizeof kept[6], "m.bin2.tmp.%ld.0", dead);
    snprintf(kept[7], sizeof kept[7], "xm.bin.tmp.%ld.0", dead);
    snprintf(kept[8], sizeof kept[8], "m.bin.tmp.1.0");         // init's: alive (or not ours to signal)
    snprintf(link_name, sizeof link_name, "m.bin.tmp.%ld.1", dead);
    snprintf(dir_name, sizeof dir_name, "m.bin.tmp.%ld.2", dead);
    snprintf(path, sizeof path, "%s/%s", dir, stale);
    write_text(path, "half a model");
    for (int k = 0; k < 9; k++) { snprintf(path, sizeof path, "%s/%s", dir, kept[k]); write_text(path, "keep"); }
    snprintf(path, sizeof path, "%s/%s", dir, link_name);
    EXPECT(symlink(target, path) == 0, "symlink %s", path);
    snprintf(path, sizeof path, "%s/%s", dir, dir_name);
    EXPECT(mkdir(path, 0755) == 0, "mkdir %s", path);
    TrainArgs a;
    snprintf(name, sizeof name, "%s/m.bin", dir);
    tiny_run(&a, "d1c32h2t8", name);
    int saved = stdout_to(log), status = export_check(&a);
    stdout_back(saved);
    EXPECT(status == 0, "export_check: %s", train_error_text);
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, stale);
    EXPECT(lstat(path, &st) != 0, "the stale temporary %s is still there", path);
    for (int k = 0; k < 9; k++) {
        snprintf(path, sizeof path, "%s/%s", dir, kept[k]);
        EXPECT(lstat(path, &st) == 0, "removed %s, which is not a stale temporary of -X", path);
    }
    snprintf(path, sizeof path, "%s/%s", dir, link_name);
    EXPECT(lstat(path, &st) == 0 && S_ISLNK(st.st_mode), "removed the symlink %s", path);
    snprintf(path, sizeof path, "%s/%s", dir, dir_name);
    EXPECT(lstat(path, &st) == 0 && S_ISDIR(st.st_mode), "removed the directory %s", path);
    size_t n;
    char *text = (char *)test_slurp(target, &n), *said = (char *)test_slurp(log, &n);
    EXPECT(text && strcmp(text, "another program's file") == 0, "the symlink's target changed: '%s'", text ? text : "");
    snprintf(path, sizeof path, "note: removed %s/%s,", dir, stale);
    const char *first = said ? strstr(said, "note: removed") : NULL;
    EXPECT(first && strncmp(first, path, strlen(path)) == 0 && !strstr(first + 1, "note: removed"),
           "what it said, expected one line '%s ...': '%s'", path, said ? said : "");
    if (xverbose && said) printf("    %s", said);
    free(text); free(said);
    test_remove_tree(dir, 1);
    remove(target); remove(log);
}

void tests_export(void) {
    xverbose = getenv("BNB8_TEST_VERBOSE") != NULL;
    snprintf(xdir, sizeof xdir, "/tmp/bnb8_export_XXXXXX");
    if (!mkdtemp(xdir)) { printf("test_export: mkdtemp failed\n"); return; }
    test_run("export: a StableEmbedding model file has a version llm.c refuses, and loads back with the flag",
             test_stable_versions_llmc_refuses);
    test_run("export: a model without StableEmbedding is llm.c's version 3 / 5 file, byte for byte",
             test_plain_files_unchanged);
    test_run("export: version 3 / 5 files with header[8] = 1 still load with StableEmbedding", test_old_stable_files_load);
    test_run("export: -X of a StableEmbedding model says llm.c refuses the file, at start and on its line",
             test_run_says_what_the_file_is);
    test_run("export: -X removes its own stale temporaries at start (dead writer, regular file) and nothing else",
             test_removes_stale_temporaries);
    test_remove_tree(xdir, 1);
}
