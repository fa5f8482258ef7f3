/*
test_messages.c — what the trainer says and keeps: flags it refuses and the message a bad command
line prints, what the est rule's step line says was clipped, llm.c's version 1 tokenizer files, and
-L, which removes old checkpoints and nothing else.

The runs are tiny (one layer, C = 32, V = 64, random tokens), so the group takes seconds.
*/
#define _POSIX_C_SOURCE 200809L   // mkdtemp, fileno, dup
#include "trainer/trainer.h"
#include "trainer/settings.h"
#include "trainer/checkpoint.h"
#include "trainer/clip.h"
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include "test.h"

static char mdir[64];

static void mpath(char *path, size_t size, const char *name) { snprintf(path, size, "%s/%s", mdir, name); }

static int parse(int argc, const char **argv, TrainArgs *a) {
    char given[128];
    return parse_args(argc, (char **)argv, a, given);
}

// ------------------------------------------------------------------------------------------------
// Flags

// A negative zero is a negative value: each float flag that refuses negative values refuses it.
static void test_negative_zero(void) {
    const char *flags[] = {"-l", "-q", "-c", "-g"};
    const char *zeros[] = {"-0", "-0.0", "-0e0", "-0x0p+0"};
    TrainArgs a;
    for (int f = 0; f < 4; f++) {
        for (int z = 0; z < 4; z++) {
            const char *argv[] = {"t", flags[f], zeros[z]};
            int s = parse(3, argv, &a);
            EXPECT(s == -1 && strstr(train_error_text, flags[f]) && strstr(train_error_text, zeros[z]),
                   "%s %s: status %d, message '%s'", flags[f], zeros[z], s, train_error_text);
        }
        const char *zero[] = {"t", flags[f], "0"};
        EXPECT(parse(3, zero, &a) == 0, "%s 0 refused: %s", flags[f], train_error_text);
    }
}

// A settings check of a's (on the CPU), and the run's settings after it.
static int check(const TrainArgs *a, Trainer *t) {
    memset(t, 0, sizeof *t);
    t->a = *a;
    return check_settings(t, 0);
}

// -G counts the tokens a sample generates after the end-of-text token it starts from, in the model's
// T positions: at most T - 1. A larger -G is refused naming -G and the bound; left out, it is 48, or
// T - 1 when that is less.
static void test_sample_length(void) {
    Trainer *t = (Trainer *)calloc(1, sizeof(Trainer));
    TrainArgs a;
    if (!t) { EXPECT(0, "out of memory"); return; }
    const char *over[] = {"t", "-t", "16", "-G", "16"};
    EXPECT(parse(5, over, &a) == 0, "%s", train_error_text);
    EXPECT(check(&a, t) != 0 && strstr(train_error_text, "-G 16") && strstr(train_error_text, "15"),
           "-t 16 -G 16: '%s'", train_error_text);
    const char *after[] = {"t", "-G", "100", "-t", "64"};   // the order of the flags does not matter
    EXPECT(parse(5, after, &a) == 0 && check(&a, t) != 0 && strstr(train_error_text, "-G 100"), "-G 100 -t 64: '%s'",
           train_error_text);
    const char *most[] = {"t", "-t", "16", "-G", "15"};
    EXPECT(parse(5, most, &a) == 0 && check(&a, t) == 0 && t->a.gen_tokens == 15, "-t 16 -G 15: %s", train_error_text);
    const char *none[] = {"t", "-t", "1", "-G", "0"};
    EXPECT(parse(5, none, &a) == 0 && check(&a, t) == 0 && t->a.gen_tokens == 0, "-t 1 -G 0: %s", train_error_text);
    const char *short_t[] = {"t", "-t", "16"};
    EXPECT(parse(3, short_t, &a) == 0 && check(&a, t) == 0 && t->a.gen_tokens == 15,
           "-t 16, -G left out: %lld tokens (%s)", (long long)t->a.gen_tokens, train_error_text);
    const char *defaults[] = {"t"};
    EXPECT(parse(1, defaults, &a) == 0 && check(&a, t) == 0 && t->a.gen_tokens == 48,
           "defaults: %lld tokens (%s)", (long long)t->a.gen_tokens, train_error_text);
    free(t);
}

// A bad command line prints the error and where the flags are: two lines, not the usage text.
static void test_bad_flag_message(void) {
    TrainArgs a;
    const char *argv[] = {"t", "-Q", "3"};
    EXPECT(parse(3, argv, &a) == -1 && strstr(train_error_text, "-Q"), "-Q: '%s'", train_error_text);
    FILE *f = tmpfile();
    if (!f) { EXPECT(0, "tmpfile failed"); return; }
    print_flag_error(f, "./build/train_gpt2_8bit");
    char text[4096] = "";
    rewind(f);
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    int lines = 0;
    for (size_t i = 0; i < n; i++) lines += text[i] == '\n';
    EXPECT(strcmp(text, "error: unknown flag '-Q'\nrun ./build/train_gpt2_8bit -h for the flags\n") == 0,
           "printed %d lines: '%s'", lines, text);
}

// -L: parsed, in the usage text, and refused without -o as -k is.
static void test_keep_flag(void) {
    TrainArgs a;
    const char *keep[] = {"t", "-L", "3"};
    EXPECT(parse(3, keep, &a) == 0 && a.keep_checkpoints == 3, "-L 3: %s", train_error_text);
    const char *negative[] = {"t", "-L", "-1"};
    EXPECT(parse(3, negative, &a) == -1 && strstr(train_error_text, "-L"), "-L -1: '%s'", train_error_text);
    EXPECT(parse(1, keep, &a) == 0 && a.keep_checkpoints == 0, "-L left out: %lld", (long long)a.keep_checkpoints);
    Trainer *t = (Trainer *)calloc(1, sizeof(Trainer));
    EXPECT(t && parse(3, keep, &a) == 0 && check(&a, t) != 0 && strstr(train_error_text, "-o"), "-L without -o: '%s'",
           train_error_text);
    free(t);
    FILE *f = tmpfile();
    char text[16384] = "";
    if (f) { usage(f); rewind(f); text[fread(text, 1, sizeof text - 1, f)] = 0; fclose(f); }
    EXPECT(strstr(text, "\n  -L <int>"), "the usage text has no -L line");
}

// ------------------------------------------------------------------------------------------------
// The est rule's step line

// clip_step_end's note on a step of the est rule, whose groups' sums and shares are given, its return
// (the step clipped by its exact norm, the embeddings') and *groups, how many groups were clipped.
// Each group g is stepped with the norm sqrt((sums[0] + .. + sums[g]) / shares[g]), written out below.
static int est_note(int L, const double *sums, const double *shares, float clip, char *text, size_t size, int *groups) {
    Trainer *t = (Trainer *)calloc(1, sizeof(Trainer));
    if (!t) return -1;
    t->rule = CLIP_EST;
    t->a.grad_clip = clip;
    t->a.accum = 1;
    t->model.config.num_layers = L;
    t->group_sums = (double *)sums;
    t->shares = (double *)shares;
    t->est_lo = 0.5; t->est_hi = 0.75;
    int clipped = clip_step_end(t, 1.0, 0, text, size);   // 1.0: the embeddings' norm, the exact one, of both cases
    *groups = est_groups_clipped(t);
    free(t);
    return clipped;
}

static void test_est_clipped_groups(void) {
    // 2 layers: groups 0 (final LayerNorm), 1, 2 (the layers), 3 (the embeddings, share 1: the exact norm)
    const double shares[4] = {0.1, 0.4, 0.7, 1.0};
    const double low[4] = {0.001, 0.003, 0.003, 0.993};   // norms 0.1, 0.1, 0.1, 1
    const double mixed[4] = {0.2, 0.2, 0.1, 0.5};         // norms sqrt(2), 1, sqrt(0.5 / 0.7) = 0.845, 1
    struct { const double *sums; float clip; int clipped, groups; const char *note; } cases[] = {
        {low, 2.0f, 0, 0, " (est 0.500..0.750)"},
        {low, 0.5f, 1, 1, " (est 0.500..0.750) clipped: embeddings"},
        {low, 0.05f, 1, 4, " (est 0.500..0.750) clipped: all 4 groups"},
        {mixed, 1.2f, 0, 1, " (est 0.500..0.750) clipped: 1 of 4 groups, not the embeddings"},
        {mixed, 0.9f, 1, 3, " (est 0.500..0.750) clipped: 3 of 4 groups, the embeddings among them"},
        {mixed, 0.0f, 0, 0, " (est 0.500..0.750)"},   // -g 0: nothing is clipped
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[192];
        int groups = -1, clipped = est_note(2, cases[i].sums, shares, cases[i].clip, text, sizeof text, &groups);
        EXPECT(clipped == cases[i].clipped && groups == cases[i].groups && strcmp(text, cases[i].note) == 0,
               "case %zu, clip %g: %d, %d groups '%s', expected %d, %d '%s'", i, (double)cases[i].clip, clipped, groups, text,
               cases[i].clipped, cases[i].groups, cases[i].note);
    }
}

// 4000 tokens of a 64-token vocabulary, an llm.c tokens file written with the test's own code.
static void write_tokens(const char *path) {
    static struct { int32_t header[256]; uint16_t tokens[4000]; } file = {{20240520, 1, 4000}, {0}};
    for (int i = 0; i < 4000; i++) file.tokens[i] = (uint16_t)((37 * i + i / 64) % 64);
    FILE *f = fopen(path, "wb");
    EXPECT(f && fwrite(&file, sizeof file, 1, f) == 1, "cannot write %s", path);
    if (f) fclose(f);
}

// A tiny run's settings, from a command line (more flags after these in extra, count of them).
static void small_args(TrainArgs *a, int steps, const char **extra, int count) {
    static char train[128], n[16];
    mpath(train, sizeof train, "train.bin");
    snprintf(n, sizeof n, "%d", steps);
    const char *argv[48] = {"t", "-e", "d1c32h2v64t16", "-w", "0", "-i", train, "-j", "", "-z", "", "-b", "2", "-t", "16",
                            "-n", n, "-u", "1", "-r", "fp32", "-l", "1e-3", "-v", "0", "-G", "0"};
    int argc = 27;
    for (int i = 0; i < count && argc < 48; i++) argv[argc++] = extra[i];
    EXPECT(parse(argc, argv, a) == 0, "%s", train_error_text);
    a->verbose = 0;
}

// train_run of a, printing (verbose) into text through a temporary file in place of stdout.
static int run_printing(TrainArgs *a, char *text, size_t size) {
    FILE *log = tmpfile();
    text[0] = 0;
    if (!log) return train_fail("tmpfile failed");
    a->verbose = 1;
    fflush(stdout);
    int saved = dup(1);
    dup2(fileno(log), 1);
    int status = train_run(a, NULL);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    rewind(log);
    text[fread(text, 1, size - 1, log)] = 0;
    fclose(log);
    return status;
}

// A run's step line says what was clipped: under est, which groups (a clip far below every norm
// clips all 3 of the tiny model's); under exact, the step.
static void test_step_line_clipped(void) {
    const char *rules[2] = {"est", "exact"}, *want[2] = {") clipped: all 3 groups |", " clipped |"};
    static char text[65536];
    for (int k = 0; k < 2; k++) {
        const char *extra[] = {"-N", rules[k], "-g", "1e-6"};
        TrainArgs a;
        small_args(&a, 1, extra, 4);
        EXPECT(run_printing(&a, text, sizeof text) == 0, "-N %s: %s", rules[k], train_error_text);
        const char *line = strstr(text, "step     1/1 |");
        EXPECT(line && strstr(line, want[k]) && (k == 0 || !strstr(line, "clipped:")), "-N %s step line: %.200s", rules[k],
               line ? line : "(none)");
        EXPECT(k == 1 || strstr(text, "1 of 1 steps clipped, 1 with one group clipped or more\n"), "est report: %s", text);
    }
}

// ------------------------------------------------------------------------------------------------
// Tokenizer files of version 1

// A tokenizer file written with the test's own code: the header's magic, version, vocabulary and
// word 3, then token i as the bytes "t<i>" (its length byte first).
static void write_tokenizer(const char *path, int32_t version, int32_t vocab, int32_t word3) {
    FILE *f = fopen(path, "wb");
    int32_t h[256] = {0};
    h[0] = 20240328; h[1] = version; h[2] = vocab; h[3] = word3;
    int ok = f && fwrite(h, 4, 256, f) == 256;
    for (int32_t i = 0; ok && i < vocab; i++) {
        char token[16];
        int len = snprintf(token, sizeof token, "t%d", (int)i);
        ok = fputc(len, f) != EOF && fwrite(token, 1, (size_t)len, f) == (size_t)len;
    }
    EXPECT(ok, "cannot write %s", path);
    if (f) fclose(f);
}

// llm.c reads version 1 (no end-of-text id) for GPT-2's vocabulary of 50257 tokens, taking id 50256,
// whatever word 3 holds; another vocabulary in version 1 has no known id and is refused, saying so.
static void test_tokenizer_version_1(void) {
    char path[128];
    mpath(path, sizeof path, "tokenizer_v1.bin");
    write_tokenizer(path, 1, 50257, 7);
    Tokenizer tok;
    if (tokenizer_load(&tok, path) == 0) {
        EXPECT(tok.vocab_size == 50257 && tok.eot == 50256, "vocabulary %d, end-of-text %d", tok.vocab_size, tok.eot);
        EXPECT(tok.data[tok.offset[50256] - 1] == 6 && memcmp(tok.data + tok.offset[50256], "t50256", 6) == 0 &&
               memcmp(tok.data + tok.offset[7] - 1, "\2t7", 3) == 0, "tokens read wrongly");
        tokenizer_free(&tok);
    } else EXPECT(0, "version 1: %s", train_error_text);
    write_tokenizer(path, 1, 50258, 0);
    EXPECT(tokenizer_load(&tok, path) != 0 && strstr(train_error_text, path) && strstr(train_error_text, "version 1") &&
           strstr(train_error_text, "50257") && strstr(train_error_text, "50258"), "version 1 of 50258 tokens: '%s'",
           train_error_text);
    write_tokenizer(path, 2, 50257, 50256);
    EXPECT(tokenizer_load(&tok, path) == 0 && tok.eot == 50256, "version 2: %s", train_error_text);
    tokenizer_free(&tok);
    write_tokenizer(path, 3, 50257, 50256);
    EXPECT(tokenizer_load(&tok, path) != 0 && strstr(train_error_text, "version 3"), "version 3: '%s'", train_error_text);
    remove(path);
}

// ------------------------------------------------------------------------------------------------
// -L: pruning checkpoints

// The names in dir, sorted, one a line ("" when empty).
static void list_dir(const char *dir, char *out, size_t size) {
    char names[64][64];
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.' && n < 64) snprintf(names[n++], sizeof names[0], "%.63s", e->d_name);
    if (d) closedir(d);
    for (int i = 1; i < n; i++)   // insertion sort
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char swap[64];
            memcpy(swap, names[j], 64); memcpy(names[j], names[j - 1], 64); memcpy(names[j - 1], swap, 64);
        }
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        size_t at = strlen(out);
        snprintf(out + at, size - at, "%s\n", names[i]);
    }
}

static void touch(const char *dir, const char *name) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    EXPECT(f && fputs("not the trainer's\n", f) >= 0, "cannot write %s", path);
    if (f) fclose(f);
}

// The final weights of a run, resumed or not, into params.
static int run_final(TrainArgs *a, float *params, int64_t count) {
    TrainResult r = {0};
    r.final_params = params;
    r.final_params_count = count;
    return train_run(a, &r);
}

// -k 1 -L 2 over 5 steps leaves the checkpoints of steps 4 and 5, whole (a resume from 5 trains step
// 6 to the bits of a run that never stopped), beside the files the run did not write; -L 0 keeps
// every checkpoint.
static void test_keep_newest(void) {
    char out[128], listing[4096];
    mpath(out, sizeof out, "keep2");
    mkdir(out, 0755);
    touch(out, "notes.txt");                 // files of others, some named almost as the trainer's
    touch(out, "optim_00000001.bin.bak");
    touch(out, "DONE_1");
    TrainArgs a, b;
    const char *keep2[] = {"-o", out, "-k", "1", "-L", "2", "-x", "5"};
    small_args(&a, 6, keep2, 8);
    EXPECT(train_run(&a, NULL) == 0, "-k 1 -L 2: %s", train_error_text);
    list_dir(out, listing, sizeof listing);
    EXPECT(strcmp(listing, "DONE_00000004\nDONE_00000005\nDONE_1\nLOCK\nnotes.txt\noptim_00000001.bin.bak\n"
                           "optim_00000004.bin\noptim_00000005.bin\nstate_00000004.bin\nstate_00000005.bin\n") == 0,
           "-o after -k 1 -L 2 over 5 steps:\n%s", listing);
    GPT2Config c;
    int64_t sizes[GPT2_NUM_PARAMS], n = 0;
    EXPECT(gpt2_config_from_descriptor(&c, a.model) == 0, "%s", train_error_text);
    c.stable_embedding = 0;
    gpt2_param_sizes(&c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += sizes[i];
    float *resumed = (float *)malloc(sizeof(float) * (size_t)n), *straight = (float *)malloc(sizeof(float) * (size_t)n);
    const char *resume[] = {"-o", out, "-y", "1"};
    small_args(&a, 6, resume, 4);
    small_args(&b, 6, NULL, 0);
    EXPECT(resumed && run_final(&a, resumed, n) == 0, "resume from step 5: %s", train_error_text);
    EXPECT(straight && run_final(&b, straight, n) == 0, "6 steps: %s", train_error_text);
    EXPECT(resumed && straight && memcmp(resumed, straight, sizeof(float) * (size_t)n) == 0,
           "6 steps resumed from step 5 differ from 6 straight");
    free(resumed);
    free(straight);
    mpath(out, sizeof out, "keep0");
    const char *keep0[] = {"-o", out, "-k", "1", "-L", "0"};
    small_args(&a, 5, keep0, 6);
    EXPECT(train_run(&a, NULL) == 0, "-k 1 -L 0: %s", train_error_text);
    list_dir(out, listing, sizeof listing);
    for (int s = 1; s <= 5; s++) {
        char want[64];
        snprintf(want, sizeof want, "DONE_%08d\n", s);
        EXPECT(strstr(listing, want), "-L 0 lost step %d's checkpoint:\n%s", s, listing);
    }
}

// A resumed run with -L prunes every older checkpoint at its first one, each DONE first: a name that
// is not the run's file (an empty directory in the way) is left, warned about, its checkpoint without
// a DONE, and the run goes on. A complete checkpoint newer than the run's (one a resume passed over)
// and the files of an incomplete one stay.
static void test_prune_resumed(void) {
    char out[128], path[256], listing[4096];
    static char text[65536];
    mpath(out, sizeof out, "resumed");
    TrainArgs a;
    const char *first[] = {"-o", out, "-k", "1", "-x", "3"};
    small_args(&a, 7, first, 6);
    EXPECT(train_run(&a, NULL) == 0, "3 steps: %s", train_error_text);
    snprintf(path, sizeof path, "%s/state_00000001.bin", out);   // a directory where a file was
    remove(path);
    mkdir(path, 0755);
    touch(out, "optim_00000009.bin");        // an incomplete checkpoint's file, after the run's steps
    touch(out, "DONE_00000012");             // a complete checkpoint past the run's steps
    const char *again[] = {"-o", out, "-k", "1", "-x", "5", "-y", "1", "-L", "2"};
    small_args(&a, 7, again, 10);
    EXPECT(run_printing(&a, text, sizeof text) == 0, "resume with -L 2: %s", train_error_text);
    EXPECT(strstr(text, "step     4 | -L 2: removed 2 checkpoints, of steps 1..2") &&
           strstr(text, "step     5 | -L 2: removed the checkpoint of step 3"), "what the run said: %s", text);
    EXPECT(strstr(text, "warning: -L: ") && strstr(text, "state_00000001.bin is not a regular file"),
           "no warning on the directory in the way: %s", text);
    list_dir(out, listing, sizeof listing);
    EXPECT(strcmp(listing, "DONE_00000004\nDONE_00000005\nDONE_00000012\nLOCK\noptim_00000004.bin\noptim_00000005.bin\n"
                           "optim_00000009.bin\nstate_00000001.bin\nstate_00000004.bin\nstate_00000005.bin\n") == 0,
           "-o after a resume with -L 2:\n%s", listing);
}

// The pruning alone, over NCCL's names: every rank's optimizer file of a pruned step goes, and a
// single process's; other files stay.
static void test_prune_rank_files(void) {
    char out[128], listing[4096];
    mpath(out, sizeof out, "ranks");
    mkdir(out, 0755);
    const char *names[] = {"DONE_00000002", "state_00000002.bin", "optim_00000002.rank0of2.bin", "optim_00000002.rank1of2.bin",
                           "optim_00000002.rank2of3.bin", "DONE_00000004", "state_00000004.bin", "optim_00000004.rank0of2.bin",
                           "optim_00000004.rank1of2.bin", "state_00000003.bin", "optim_00000003.rank0of2.bin"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) touch(out, names[i]);
    CheckpointsPruned pruned;
    EXPECT(checkpoint_prune(out, 4, 1, 2, &pruned) == 0 && pruned.count == 1 && pruned.newest == 2 && pruned.oldest == 2,
           "prune: %s (%lld)", train_error_text, (long long)pruned.count);
    list_dir(out, listing, sizeof listing);
    EXPECT(strcmp(listing, "DONE_00000004\noptim_00000002.rank2of3.bin\noptim_00000003.rank0of2.bin\n"
                           "optim_00000004.rank0of2.bin\noptim_00000004.rank1of2.bin\nstate_00000003.bin\nstate_00000004.bin\n") == 0,
           "after pruning to the newest 1 of 2 ranks' checkpoints:\n%s", listing);
    EXPECT(checkpoint_prune(out, 4, 1, 2, &pruned) == 0 && pruned.count == 0, "nothing more to prune: %lld", (long long)pruned.count);
}

void tests_messages(void) {
    snprintf(mdir, sizeof mdir, "/tmp/bnb8_messages_XXXXXX");
    if (!mkdtemp(mdir)) { printf("test_messages: mkdtemp failed\n"); return; }
    char path[128];
    mpath(path, sizeof path, "train.bin");
    write_tokens(path);
    test_run("messages: -l, -q, -c, -g refuse a negative zero", test_negative_zero);
    test_run("messages: -G past T - 1 refused; left out, it fits T", test_sample_length);
    test_run("messages: a bad flag prints the error and a hint, no usage", test_bad_flag_message);
    test_run("messages: -L parsed, in the usage, needs -o", test_keep_flag);
    test_run("messages: est's step line names the groups clipped", test_est_clipped_groups);
    test_run("messages: a run's step line says what was clipped", test_step_line_clipped);
    test_run("messages: llm.c's version 1 tokenizer files load", test_tokenizer_version_1);
    test_run("messages: -k 1 -L 2 keeps steps 4, 5, resumable; -L 0 all", test_keep_newest);
    test_run("messages: -L on resume: DONE first, other files kept", test_prune_resumed);
    test_run("messages: -L removes every rank's files of a pruned step", test_prune_rank_files);
    test_remove_tree(mdir, 1);
}
