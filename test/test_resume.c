/*
test_resume.c — what a resume checks before it continues a run (DESIGN.md §8.4, §8.5): the trainer
state's version 3 and 4 words (the run's -l, -u, -q, -c, -g, -M, -K, -V and the digest of its optimizer
files), each refused out of its range; a flag left out takes the checkpoint's value, one given with
another value is refused naming both; version 3 still loads (-V block); versions 2 and 1 still load
and resume, their missing fields
unchecked; an optimizer file of another run at the same step (a backup restored into the wrong
directory) is not resumed with the trainer state, and the resume falls back; a directory in place of
the optimizer file; bnb8_optimizer_file_digest against a digest computed here from DESIGN.md §7.
BNB8_TEST_VERBOSE=1 prints the messages.
*/
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#include "trainer/trainer.h"
#include "trainer/settings.h"
#include "trainer/checkpoint.h"
#include "test.h"
#include <stdlib.h>
#include <fcntl.h>
#include <sys/stat.h>

static int rverbose;
static char rdir[64];

static void rpath(char *path, size_t size, const char *name) { snprintf(path, size, "%s/%s", rdir, name); }

// FNV-1a, 64 bits, written here from its definition: len bytes at p folded into *h.
static void fnv_fold(uint64_t *h, const void *p, size_t len) {
    for (size_t i = 0; i < len; i++) *h = (*h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
}

// A run of the tiny model on rdir's tokens (64-token vocabulary), 8-bit states, the settings that
// define the run away from their defaults; checkpoints into dir.
static void tiny_run(TrainArgs *a, const char *dir, int64_t steps) {
    static char train[128];
    rpath(train, sizeof train, "train.bin");
    train_args_default(a);
    a->train_path = train; a->val_path = ""; a->tokenizer_path = "";
    a->model = "d1c32h2v64t16"; a->stable_embedding = 0; a->B = 2; a->T = 16; a->steps = steps;
    a->recipe = "8bit"; a->optimizer = "adamw";
    a->lr = 2e-3f; a->warmup = 3; a->final_lr_frac = 0.5f; a->weight_decay = 0.05f; a->grad_clip = 0.5f;
    a->map = BNB8_MAP_LINEAR; a->blocksize = 128;
    a->eval_every = 0; a->gen_tokens = 0; a->verbose = 0; a->out_dir = dir;
}

// The same run's flags all left at their defaults, resuming from dir (the checkpoint gives them).
static void defaults_resuming(TrainArgs *a, const char *dir) {
    TrainArgs run;
    tiny_run(&run, dir, 1);
    train_args_default(a);
    a->train_path = run.train_path; a->val_path = ""; a->tokenizer_path = "";
    a->model = run.model; a->stable_embedding = 0; a->B = 2; a->T = 16; a->recipe = "8bit"; a->optimizer = "adamw";
    a->eval_every = 0; a->gen_tokens = 0; a->verbose = 0; a->out_dir = dir; a->resume = 1;
}

// A train_run for test_stdout_in.
typedef struct { const TrainArgs *args; TrainResult *result; } Run;
static int train_run_of(void *ctx) { const Run *r = (const Run *)ctx; return train_run(r->args, r->result); }

// train_run with its stdout in rdir/run.txt; *text (free it): what it printed.
static int run_logged(const TrainArgs *a, TrainResult *r, char **text) {
    char log[128];
    Run run = {a, r};
    rpath(log, sizeof log, "run.txt");
    return test_stdout_in(log, train_run_of, &run, text);
}

static int64_t model_params(const char *descriptor) {
    GPT2Config c;
    int64_t sizes[GPT2_NUM_PARAMS], n = 0;
    gpt2_config_from_descriptor(&c, descriptor);
    c.stable_embedding = 0;
    gpt2_param_sizes(&c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) n += sizes[i];
    return n;
}

static int copy_file(const char *from, const char *to) {
    size_t n = 0;
    uint8_t *d = test_slurp(from, &n);
    FILE *f = d ? fopen(to, "wb") : NULL;
    int ok = f && fwrite(d, 1, n, f) == n;
    if (f) ok &= fclose(f) == 0;
    free(d);
    return ok;
}

static void put_bytes(const char *path, const void *d, size_t n) {
    FILE *f = fopen(path, "wb");
    EXPECT(f && fwrite(d, 1, n, f) == n, "cannot write %s", path);
    if (f) fclose(f);
}

// The words of a trainer state file, the checksum made right (words > 16) over the words before the last.
static void put_state_words(const char *path, int64_t *w, int words) {
    uint64_t h = 0xcbf29ce484222325ull;
    fnv_fold(&h, w, 8 * (size_t)(words - 1));
    if (words > 16) w[words - 1] = (int64_t)h;
    put_bytes(path, w, 8 * (size_t)words);
}

// The trainer state of step in dir rewritten as version 2: its first 31 words, version 2, the checksum in word 31.
static int state_as_version2(const char *dir, int64_t step) {
    char path[512];
    size_t n = 0;
    checkpoint_path(path, sizeof path, dir, "state", step, ".bin");
    int64_t *w = (int64_t *)test_slurp(path, &n);
    int ok = w && n == 8 * STATE_WORDS;
    if (ok) { w[1] = 2; put_state_words(path, w, 32); }
    free(w);
    return ok;
}

static void expect_refused(int status, const char *want, const char *label) {
    EXPECT(status != 0 && strstr(train_error_text, want), "%s: status %d, message '%s' lacks '%s'", label, status,
           train_error_text, want);
    if (rverbose) printf("    %-36s -> %s\n", label, train_error_text);
}

static int state_file_refused(const char *path) { TrainerState s; return state_load(&s, path); }

// ------------------------------------------------------------------------------------------------
// The trainer state file

// A trainer state of the tiny model with every version 3 and 4 field away from zero.
static TrainerState sample_state(void) {
    GPT2Config c;
    gpt2_config_from_descriptor(&c, "d1c32h2v64t16");
    c.stable_embedding = 0;
    TrainerState s = {.step = 7, .position = 64, .B = 2, .T = 16, .recipe = 1, .optimizer = 0, .steps = 20, .rng = 5,
                      .seed = 1, .accum = 1, .weight_bytes = 4, .version = STATE_VERSION, .config = c, .opt_steps = 7,
                      .clip_rule = CLIP_EXACT, .prev_norm = NAN, .est_profile = {NAN, NAN, NAN}, .lr = (double)3e-3f,
                      .final_lr_frac = 0.25, .weight_decay = 0.5, .grad_clip = 2.0, .warmup = 4, .map = BNB8_MAP_LINEAR,
                      .blocksize = 128, .optim_digest = 0x0123456789abcdefll, .rank1 = 1};
    return s;
}

// s written to path by the trainer's writer, and the words of the file: 1 when it has STATE_WORDS.
static int written_words(const TrainerState *s, const char *path, int64_t w[STATE_WORDS]) {
    size_t n = 0;
    EXPECT(write_atomically(path, state_writer, s) == 0, "%s", train_error_text);
    uint8_t *d = test_slurp(path, &n);
    int ok = d && n == 8 * STATE_WORDS;
    EXPECT(ok, "%s: %zu bytes, expected %d", path, n, 8 * STATE_WORDS);
    if (ok) memcpy(w, d, n);
    free(d);
    return ok;
}

// Version 4 lays the run's settings out in words 31..39 (DESIGN.md §8.5) and reads them back; each
// out of its range is refused, naming it, with the checksum made right so that it is the field that
// fails: a learning rate that is NaN, negative or infinite, a negative warm-up, a final fraction past
// 1, a negative decay, a NaN clip, an unknown map, a block size that is not 0 or a power of two in
// 64..4096, a -V that is not 0 or 1, and total steps below the step.
static void test_state_version4_words(void) {
    char path[128];
    rpath(path, sizeof path, "state_v4.bin");
    TrainerState s = sample_state(), back;
    int64_t w[STATE_WORDS];
    EXPECT(STATE_VERSION == 4 && STATE_WORDS == 41, "version %d of %d words", STATE_VERSION, STATE_WORDS);
    if (!written_words(&s, path, w)) return;
    const double doubles[4] = {s.lr, 0.25, 0.5, 2.0};
    const int at[4] = {31, 33, 34, 35};
    for (int k = 0; k < 4; k++) EXPECT(memcmp(&w[at[k]], &doubles[k], 8) == 0, "word %d: not the double's bits", at[k]);
    EXPECT(w[1] == 4 && w[32] == 4 && w[36] == BNB8_MAP_LINEAR && w[37] == 128 && w[38] == 0x0123456789abcdefll && w[39] == 1,
           "words 1, 32, 36..39: %lld %lld %lld %lld %llx %lld", (long long)w[1], (long long)w[32], (long long)w[36],
           (long long)w[37], (unsigned long long)w[38], (long long)w[39]);
    EXPECT(state_load(&back, path) == 0 && back.version == 4 && back.lr == s.lr && back.final_lr_frac == 0.25 &&
           back.weight_decay == 0.5 && back.grad_clip == 2.0 && back.warmup == 4 && back.map == BNB8_MAP_LINEAR &&
           back.blocksize == 128 && back.optim_digest == s.optim_digest && back.steps == 20 && back.rank1 == 1,
           "version 4 round trip: %s", train_error_text);
    const double nan = NAN, inf = INFINITY, minus = -1e-3, past = 1.5;
    struct { int word; const double *d; int64_t v; const char *want, *label; } forged[] = {
        {31, &nan, 0, "peak learning rate (-l) is nan", "a NaN learning rate"},
        {31, &minus, 0, "peak learning rate (-l)", "a negative learning rate"},
        {31, &inf, 0, "peak learning rate (-l)", "an infinite learning rate"},
        {32, NULL, -1, "warm-up (-u)", "a negative warm-up"},
        {33, &past, 0, "final learning rate fraction (-q)", "a final fraction of 1.5"},
        {34, &minus, 0, "weight decay (-c)", "a negative weight decay"},
        {35, &nan, 0, "clip norm (-g)", "a NaN clip"},
        {36, NULL, 2, "map (-M) is 2", "map 2"}, {36, NULL, -1, "map (-M)", "map -1"},
        {37, NULL, 100, "block size (-K) is 100", "block size 100"}, {37, NULL, 32, "block size (-K)", "block size 32"},
        {37, NULL, 8192, "block size (-K)", "block size 8192"}, {37, NULL, -256, "block size (-K)", "block size -256"},
        {39, NULL, 2, "normalization (-V) is 2", "-V 2"}, {39, NULL, -1, "normalization (-V)", "-V -1"},
        {11, NULL, 6, "total steps (-n) is 6", "6 total steps at step 7"}};
    char bad[128];
    rpath(bad, sizeof bad, "state_v4_bad.bin");
    for (size_t k = 0; k < sizeof forged / sizeof forged[0]; k++) {
        int64_t v[STATE_WORDS];
        memcpy(v, w, sizeof v);
        if (forged[k].d) memcpy(&v[forged[k].word], forged[k].d, 8);
        else v[forged[k].word] = forged[k].v;
        put_state_words(bad, v, STATE_WORDS);
        train_error_text[0] = 0;
        expect_refused(state_file_refused(bad), forged[k].want, forged[k].label);
        EXPECT(strstr(train_error_text, bad), "%s: the message does not name the file: '%s'", forged[k].label, train_error_text);
    }
    const int64_t blocks[3] = {0, 64, 4096};   // one absmax per tensor, and the ends of the range
    for (int k = 0; k < 3; k++) {
        int64_t v[STATE_WORDS];
        memcpy(v, w, sizeof v);
        v[37] = blocks[k];
        put_state_words(bad, v, STATE_WORDS);
        EXPECT(state_load(&back, bad) == 0 && back.blocksize == blocks[k], "block size %lld: %s", (long long)blocks[k],
               train_error_text);
    }
    remove(path);
    remove(bad);
}

// sample_state's file rewritten as an older version of the given words (its checksum made right in
// its last word) loads into *back (1 when it does); at this version's size it is refused as oversized.
static int load_as_version(int version, int words, TrainerState *back) {
    char path[128], label[64];
    rpath(path, sizeof path, "state_old.bin");
    TrainerState s = sample_state();
    int64_t w[STATE_WORDS];
    if (!written_words(&s, path, w)) return 0;
    w[1] = version;
    put_state_words(path, w, words);
    int ok = state_load(back, path) == 0;
    w[1] = version;
    put_state_words(path, w, STATE_WORDS);
    snprintf(label, sizeof label, "version %d at version %d's size", version, STATE_VERSION);
    expect_refused(state_file_refused(path), "oversized", label);
    remove(path);
    return ok;
}

// Version 3 (40 words, words 0..38 as in version 4, its checksum in word 39) still loads: its fields,
// and -V block (0), all a version 3 run had.
static void test_state_version3_loads(void) {
    TrainerState s = sample_state(), back;
    EXPECT(load_as_version(3, 40, &back) && back.version == 3 && back.step == 7 && back.lr == s.lr && back.blocksize == 128 &&
           back.optim_digest == s.optim_digest && back.rank1 == 0, "version 3: %s (-V %lld)", train_error_text,
           (long long)back.rank1);
}

// Version 2 (32 words, words 0..30 as in version 3, its checksum in word 31) still loads: its fields,
// and none of version 3's (the learning rate NaN: not recorded).
static void test_state_version2_loads(void) {
    TrainerState back;
    EXPECT(load_as_version(2, 32, &back) && back.version == 2 && back.step == 7 && back.position == 64 && back.rng == 5 &&
           back.steps == 20 && back.config.channels == 32 && isnan(back.lr) && isnan(back.grad_clip),
           "version 2: %s (lr %g)", train_error_text, back.lr);
}

// ------------------------------------------------------------------------------------------------
// Resume: the flags that define the run

// A run stopped at step 3 and resumed with every flag left out (their defaults differ from the run's:
// -n 150, -l 3e-3, -u 10, -q 0.1, -c 0.1, -g 1, -M dynamic, -K 256) continues with the checkpoint's:
// the losses and weights of a run that never stopped, to its -n.
static void test_resume_takes_the_checkpoint_settings(void) {
    char da[128], db[128];
    rpath(da, sizeof da, "taken_a");
    rpath(db, sizeof db, "taken_b");
    const int64_t N = 7, n = model_params("d1c32h2v64t16");
    float la[7], lb[7], *wa = (float *)malloc(sizeof(float) * (size_t)n), *wb = (float *)malloc(sizeof(float) * (size_t)n);
    if (!wa || !wb) { EXPECT(0, "out of memory"); free(wa); free(wb); return; }
    TrainArgs a;
    TrainResult ra = {0}, rb = {0};
    ra.losses = la; ra.final_params = wa; ra.final_params_count = n;
    tiny_run(&a, da, N);
    EXPECT(train_run(&a, &ra) == 0, "uninterrupted: %s", train_error_text);
    tiny_run(&a, db, N);
    a.stop_after = 3;
    EXPECT(train_run(&a, NULL) == 0, "first part: %s", train_error_text);
    for (int i = 0; i < 7; i++) lb[i] = NAN;
    rb.losses = lb; rb.final_params = wb; rb.final_params_count = n;
    defaults_resuming(&a, db);
    EXPECT(train_run(&a, &rb) == 0 && rb.first_step == 4 && rb.last_step == N, "resumed with the flags left out: %s "
           "(steps %lld..%lld)", train_error_text, (long long)rb.first_step, (long long)rb.last_step);
    for (int i = 3; i < 7; i++)
        EXPECT(memcmp(&la[i], &lb[i], 4) == 0, "step %d: loss %.9g, resumed %.9g", i + 1, (double)la[i], (double)lb[i]);
    EXPECT(memcmp(wa, wb, sizeof(float) * (size_t)n) == 0, "the resumed run's final weights differ from the uninterrupted");
    free(wa); free(wb);
    test_remove_tree(da, 1);
    test_remove_tree(db, 1);
}

// Each flag that defines the run, given with another value than the checkpoint's, is refused before
// anything is loaded, naming the flag, both values and what to do (-K and -M too: not a damaged
// checkpoint); the directory stays as it was. All of them given with the checkpoint's values resume.
static void test_resume_refuses_changed_flags(void) {
    char dir[128];
    rpath(dir, sizeof dir, "changed");
    TrainArgs a;
    tiny_run(&a, dir, 8);
    a.stop_after = 3;
    EXPECT(train_run(&a, NULL) == 0 && checkpoint_latest(dir) == 3, "first part: %s", train_error_text);
    struct { char flag; const char *kept, *run; } cases[] = {
        {'n', "-n 8", "-n 9"}, {'l', "-l 0.002", "-l 0.001"}, {'u', "-u 3", "-u 10"}, {'q', "-q 0.5", "-q 0.25"},
        {'c', "-c 0.05", "-c 0.1"}, {'g', "-g 0.5", "-g 1"}, {'M', "-M linear", "-M dynamic"}, {'K', "-K 128", "-K 64"}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        TrainArgs b = a;
        b.resume = 1; b.stop_after = 0;
        switch (cases[k].flag) {
        case 'n': b.steps = 9; break;
        case 'l': b.lr = 1e-3f; break;
        case 'u': b.warmup = 10; break;
        case 'q': b.final_lr_frac = 0.25f; break;
        case 'c': b.weight_decay = 0.1f; break;
        case 'g': b.grad_clip = 1.0f; break;
        case 'M': b.map = BNB8_MAP_DYNAMIC; break;
        default: b.blocksize = 64; break;
        }
        b.given[(int)cases[k].flag] = 1;
        char label[32], leave[32];
        snprintf(label, sizeof label, "resume with %s", cases[k].run);
        snprintf(leave, sizeof leave, "leave -%c out", cases[k].flag);
        train_error_text[0] = 0;
        int status = train_run(&b, NULL);
        expect_refused(status, cases[k].kept, label);
        EXPECT(strstr(train_error_text, cases[k].run) && strstr(train_error_text, leave) &&
               strstr(train_error_text, "another -o") && !strstr(train_error_text, "no earlier"),
               "%s: '%s'", label, train_error_text);
        EXPECT(checkpoint_latest(dir) == 3 && checkpoint_before(dir, 3) == 0, "%s: the directory changed", label);
    }
    TrainArgs same = a;   // every one given, with the checkpoint's values: resumed
    same.resume = 1; same.stop_after = 4;
    const char flags[] = "nluqcgMK";
    for (int k = 0; flags[k]; k++) same.given[(int)flags[k]] = 1;
    TrainResult r = {0};
    EXPECT(train_run(&same, &r) == 0 && r.first_step == 4 && r.last_step == 4, "resume with the same flags given: %s",
           train_error_text);
    test_remove_tree(dir, 1);
}

// A checkpoint of trainer state version 2 resumes: with the run's flags given as they were, the same
// bits as a run that never stopped, and a note that its -l .. -K are not checked. -n, which version
// 2 records, is still compared; -l, which it does not, is not.
static void test_resume_version2_checkpoint(void) {
    char da[128], db[128];
    rpath(da, sizeof da, "v2_a");
    rpath(db, sizeof db, "v2_b");
    const int64_t N = 6, n = model_params("d1c32h2v64t16");
    float *wa = (float *)malloc(sizeof(float) * (size_t)n), *wb = (float *)malloc(sizeof(float) * (size_t)n);
    if (!wa || !wb) { EXPECT(0, "out of memory"); free(wa); free(wb); return; }
    TrainArgs a;
    TrainResult ra = {0}, rb = {0};
    ra.final_params = wa; ra.final_params_count = n;
    tiny_run(&a, da, N);
    EXPECT(train_run(&a, &ra) == 0, "uninterrupted: %s", train_error_text);
    tiny_run(&a, db, N);
    a.stop_after = 3;
    EXPECT(train_run(&a, NULL) == 0 && state_as_version2(db, 3), "first part, made version 2: %s", train_error_text);
    TrainArgs b = a;
    b.resume = 1; b.stop_after = 0; b.steps = 7; b.given['n'] = 1;
    expect_refused(train_run(&b, NULL), "-n 6", "version 2, another -n");
    b = a;
    b.resume = 1; b.stop_after = 4; b.lr = 1e-3f; b.given['l'] = 1;
    EXPECT(train_run(&b, NULL) == 0, "version 2 with another -l (not recorded, so not compared): %s", train_error_text);
    const char *kinds[3] = {"DONE", "optim", "state"};   // back to the version 2 checkpoint of step 3
    for (int k = 0; k < 3; k++) {
        char path[512];
        checkpoint_path(path, sizeof path, db, kinds[k], 4, k ? ".bin" : "");
        remove(path);
    }
    b = a;
    b.resume = 1; b.stop_after = 0; b.verbose = 1;
    rb.final_params = wb; rb.final_params_count = n;
    char *text = NULL;
    int status = run_logged(&b, &rb, &text);
    EXPECT(status == 0 && rb.first_step == 4, "version 2 resume: %s", train_error_text);
    EXPECT(memcmp(wa, wb, sizeof(float) * (size_t)n) == 0, "version 2 resume: the final weights differ from never stopping");
    const char *note = strstr(text, "trainer state version 2");
    EXPECT(note && strstr(note, "unchecked"), "version 2 resume: no note that -l .. -K are unchecked");
    if (rverbose && note) printf("    %.*s\n", (int)strcspn(note, "\n"), note);
    free(text);
    free(wa); free(wb);
    test_remove_tree(da, 1);
    test_remove_tree(db, 1);
}

// ------------------------------------------------------------------------------------------------
// Resume: the files of one checkpoint belong together

// Two runs of other seeds to the same steps in two directories; run B's optimizer file of step 3
// copied over run A's (a backup restored into the wrong directory). A's trainer state of step 3 does
// not take it: the resume falls back to step 2, saying why. Without an earlier checkpoint the resume
// is refused with that message.
static void test_resume_refuses_another_runs_optimizer_file(void) {
    char da[128], db[128], from[512], to[512];
    rpath(da, sizeof da, "bound_a");
    rpath(db, sizeof db, "bound_b");
    for (int earlier = 1; earlier >= 0; earlier--) {
        TrainArgs a;
        tiny_run(&a, da, 6);
        a.stop_after = 3; a.ckpt_every = earlier;
        EXPECT(train_run(&a, NULL) == 0, "run A: %s", train_error_text);
        TrainArgs b = a;
        b.out_dir = db; b.seed = 99;
        EXPECT(train_run(&b, NULL) == 0, "run B: %s", train_error_text);
        checkpoint_path(from, sizeof from, db, "optim", 3, ".bin");
        checkpoint_path(to, sizeof to, da, "optim", 3, ".bin");
        EXPECT(copy_file(from, to), "cannot copy %s", from);
        a.stop_after = 0; a.resume = 1; a.verbose = 1;
        TrainResult r = {0};
        char *text = NULL;
        int status = run_logged(&a, &r, &text);
        if (earlier) {
            const char *warning = strstr(text, "warning: checkpoint 3 cannot be resumed");
            EXPECT(status == 0 && r.first_step == 3 && warning && strstr(warning, "files of different checkpoints") &&
                   strstr(warning, to), "resume past another run's optimizer file: %d from step %lld, '%s'", status,
                   (long long)r.first_step, train_error_text);
            if (rverbose && warning) printf("    %.*s\n", (int)strcspn(warning, "\n"), warning);
        } else {
            expect_refused(status, "files of different checkpoints", "another run's optimizer file, no earlier checkpoint");
            EXPECT(strstr(train_error_text, "no earlier complete checkpoint") && r.last_step == 0, "'%s'", train_error_text);
        }
        free(text);
        test_remove_tree(da, 1);
        test_remove_tree(db, 1);
    }
}

// A directory in place of the checkpoint's optimizer file is refused as not a regular file (not by
// the size a stat gives it), from a trainer state of this version and of version 2.
static void test_resume_refuses_directory_for_optimizer_file(void) {
    char dir[128], optim[512];
    rpath(dir, sizeof dir, "optim_dir");
    const int versions[2] = {STATE_VERSION, 2};
    for (int v = 0; v < 2; v++) {
        const int version = versions[v];
        TrainArgs a;
        tiny_run(&a, dir, 6);
        a.stop_after = 3;
        EXPECT(train_run(&a, NULL) == 0 && (version == STATE_VERSION || state_as_version2(dir, 3)), "first part: %s",
               train_error_text);
        checkpoint_path(optim, sizeof optim, dir, "optim", 3, ".bin");
        EXPECT(remove(optim) == 0 && mkdir(optim, 0755) == 0, "cannot put a directory at %s", optim);
        a.stop_after = 0; a.resume = 1;
        char label[64];
        snprintf(label, sizeof label, "a directory for the optimizer file, state v%d", version);
        expect_refused(train_run(&a, NULL), "is a directory, not a regular file", label);
        EXPECT(strstr(train_error_text, optim) && !strstr(train_error_text, "too few"), "%s: '%s'", label, train_error_text);
        rmdir(optim);
        test_remove_tree(dir, 1);
    }
}

// ------------------------------------------------------------------------------------------------
// The library's digest of a state file

// The digest as DESIGN.md §7 describes it, computed here from the file's bytes: FNV-1a over the
// header's version, kind and count, then per record the fields before its payload and its CRC. *ok:
// the records end exactly at the end of the file.
static uint64_t reference_digest(const uint8_t *d, size_t size, int *ok) {
    uint64_t h = 0xcbf29ce484222325ull;
    uint32_t version = 0, count = 0;
    *ok = size >= 24;
    if (!*ok) return 0;
    memcpy(&version, d + 8, 4);
    memcpy(&count, d + 16, 4);
    fnv_fold(&h, d + 8, 12);
    size_t at = 24;
    for (uint32_t i = 0; i < count && *ok; i++) {
        uint32_t name_len = 0;
        uint64_t bytes = 0;
        *ok = at + 4 <= size;
        if (*ok) memcpy(&name_len, d + at, 4);
        size_t head = 4 + (size_t)name_len + 8 + (version >= 3 ? 16 : 0) + 4 + 4 + 8 + 8 + 8;
        *ok = *ok && at + head <= size;
        if (*ok) memcpy(&bytes, d + at + head - 8, 8);
        *ok = *ok && bytes <= size - at - head && at + head + bytes + 4 <= size;
        if (!*ok) break;
        fnv_fold(&h, d + at, head);
        fnv_fold(&h, d + at + head + bytes, 4);
        at += head + (size_t)bytes + 4;
    }
    *ok = *ok && at == size;
    return h;
}

// A state file of three 8-bit AdamW tensors (the second a shard of a larger tensor when shard:
// version 3), steps steps taken, saved to path.
static int save_state_file(const char *path, int shard, int steps) {
    enum { N = 5000 };
    static float w[3][N], g[3][N];
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < N; i++) { w[k][i] = 0.01f * (float)((i * (k + 3)) % 97 - 48); g[k][i] = 0.5f * w[k][i]; }
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW), part = cfg;
    part.shard_offset = 4096; part.shard_total = N + 4096;
    bnb8_optimizer *opt = NULL;
    const char *names[3] = {"a", "b", "c"};
    bnb8_status s = bnb8_optimizer_create(&opt, BNB8_ADAMW, &cfg);
    if (!s && shard) s = bnb8_optimizer_override(opt, "b", &part);
    for (int k = 0; k < 3 && !s; k++) s = bnb8_optimizer_add(opt, names[k], w[k], BNB8_F32, g[k], BNB8_F32, N, NULL);
    for (int k = 0; k < steps && !s; k++) s = bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL);
    if (!s) s = bnb8_optimizer_save(opt, path);
    EXPECT(s == BNB8_OK, "state file %s: %s", path, bnb8_last_error());
    bnb8_optimizer_free(opt);
    return s == BNB8_OK;
}

static void expect_digest_refused(const char *path, bnb8_status want, const char *text, const char *label) {
    uint64_t digest = 0;
    bnb8_status s = bnb8_optimizer_file_digest(path, &digest);
    EXPECT(s == want && strstr(bnb8_last_error(), text) && strstr(bnb8_last_error(), path),
           "%s: status %d (expected %d), '%s'", label, (int)s, (int)want, bnb8_last_error());
    if (rverbose) printf("    %-36s -> %s\n", label, bnb8_last_error());
}

// bnb8_optimizer_file_digest equals the reference digest (version 2, a shard's version 3, the
// committed version 1 file); the same file, or a copy, gives the same digest; one data byte changed
// with its record's CRC rewritten gives another; a truncated file, trailing bytes, a file that is not
// a state file, a directory, a missing file and NULL are refused.
static void test_optimizer_file_digest(void) {
    char path[128], other[128];
    rpath(path, sizeof path, "digest.bin");
    rpath(other, sizeof other, "digest_other.bin");
    for (int shard = 0; shard < 2; shard++) {
        if (!save_state_file(path, shard, 1)) return;
        size_t size = 0;
        uint8_t *d = test_slurp(path, &size);
        uint32_t version = 0;
        if (d && size > 24) memcpy(&version, d + 8, 4);
        int ok = 0;
        uint64_t want = d ? reference_digest(d, size, &ok) : 0, got = 0, again = 0, copy = 0;
        EXPECT(d && ok && version == (shard ? 3u : 2u), "the saved file does not parse (version %u)", version);
        EXPECT(bnb8_optimizer_file_digest(path, &got) == BNB8_OK && got == want, "version %u: digest %016llx, reference "
               "%016llx: %s", version, (unsigned long long)got, (unsigned long long)want, bnb8_last_error());
        EXPECT(bnb8_optimizer_file_digest(path, &again) == BNB8_OK && again == got, "the same file, another digest");
        EXPECT(copy_file(path, other) && bnb8_optimizer_file_digest(other, &copy) == BNB8_OK && copy == got,
               "a copy, another digest");
        if (!d || !ok) { free(d); continue; }
        // record 1 ("b"): a byte of its payload changed, its CRC made right
        uint32_t name_len;
        memcpy(&name_len, d + 24, 4);
        uint64_t bytes0;
        size_t head = 4 + name_len + 8 + (version >= 3 ? 16 : 0) + 32;
        memcpy(&bytes0, d + 24 + head - 8, 8);
        size_t r1 = 24 + head + (size_t)bytes0 + 4, h1 = 4 + 1 + 8 + (version >= 3 ? 16 : 0) + 32;
        uint64_t bytes1;
        memcpy(&bytes1, d + r1 + h1 - 8, 8);
        d[r1 + h1 + bytes1 / 2] ^= 0x40;
        uint64_t unchanged_crc = 0, changed = 0;
        put_bytes(other, d, size);   // its CRC left as it was: the digest reads no data, so it cannot tell
        EXPECT(bnb8_optimizer_file_digest(other, &unchanged_crc) == BNB8_OK && unchanged_crc == got,
               "a data byte changed, the CRC not: the digest changed");
        uint32_t crc = test_crc32(d + r1, h1 + (size_t)bytes1);
        memcpy(d + r1 + h1 + bytes1, &crc, 4);
        put_bytes(other, d, size);
        uint64_t ref = reference_digest(d, size, &ok);
        EXPECT(bnb8_optimizer_file_digest(other, &changed) == BNB8_OK && changed != got && changed == ref,
               "a data byte changed with its CRC: digest %016llx, before %016llx, reference %016llx",
               (unsigned long long)changed, (unsigned long long)got, (unsigned long long)ref);
        put_bytes(other, d, size - 1);
        expect_digest_refused(other, BNB8_ERR_FORMAT, "truncated", "digest: truncated by a byte");
        put_bytes(other, d, size - 4 - (size_t)bytes1 / 2);
        expect_digest_refused(other, BNB8_ERR_FORMAT, "truncated", "digest: truncated in a payload");
        put_bytes(other, d, 16);
        expect_digest_refused(other, BNB8_ERR_FORMAT, "truncated in its header", "digest: truncated in the header");
        free(d);
        FILE *f = copy_file(path, other) ? fopen(other, "ab") : NULL;   // a byte after a whole file
        if (f) { fputc(0, f); fclose(f); }
        expect_digest_refused(other, BNB8_ERR_FORMAT, "bytes after its last tensor", "digest: a trailing byte");
    }
    int ok = 0;
    size_t size = 0;
    uint8_t *v1 = test_slurp(test_data_path("state_adamw_v1.bin"), &size);
    uint64_t want = v1 ? reference_digest(v1, size, &ok) : 0, got = 0;
    EXPECT(v1 && ok && bnb8_optimizer_file_digest(test_data_path("state_adamw_v1.bin"), &got) == BNB8_OK && got == want,
           "the version 1 file: digest %016llx, reference %016llx: %s", (unsigned long long)got, (unsigned long long)want,
           bnb8_last_error());
    free(v1);
    char tokens[128];
    rpath(tokens, sizeof tokens, "train.bin");
    expect_digest_refused(tokens, BNB8_ERR_FORMAT, "not a bnb8 optimizer state file", "digest: a tokens file");
    expect_digest_refused(rdir, BNB8_ERR_IO, "a directory, not a regular file", "digest: a directory");
    rpath(other, sizeof other, "no_such_file.bin");
    expect_digest_refused(other, BNB8_ERR_IO, "cannot open", "digest: a missing file");
    uint64_t digest;
    EXPECT(bnb8_optimizer_file_digest(NULL, &digest) == BNB8_ERR_NULL && bnb8_optimizer_file_digest(path, NULL) == BNB8_ERR_NULL,
           "NULL arguments");
    remove(path);
    rpath(other, sizeof other, "digest_other.bin");
    remove(other);
}

// Over N ranks the trainer state binds every rank's file: the digests of optim_s.rank<r>of<N>.bin
// folded in rank order (FNV-1a of their 8 bytes each), computed here; two ranks' files swapped give
// another; a single process's is its file's digest; a missing rank file is refused, naming it.
static void test_ranks_digest(void) {
    char dir[128], path[512], src[3][128];
    rpath(dir, sizeof dir, "ranks");
    mkdir(dir, 0755);
    uint64_t one[3] = {0, 0, 0}, want = 0xcbf29ce484222325ull;
    for (int r = 0; r < 3; r++) {
        char name[32];
        snprintf(name, sizeof name, "rank_src%d.bin", r);
        rpath(src[r], sizeof src[r], name);
        if (!save_state_file(src[r], r == 1, 1 + r)) return;   // three files unlike each other
        EXPECT(bnb8_optimizer_file_digest(src[r], &one[r]) == BNB8_OK, "%s", bnb8_last_error());
    }
    EXPECT(one[0] != one[1] && one[1] != one[2] && one[0] != one[2], "the rank files' digests are not all different");
    for (int r = 0; r < 3; r++) {
        checkpoint_optim_path(path, sizeof path, dir, 4, r, 3);
        EXPECT(copy_file(src[r], path), "copy to %s", path);
        fnv_fold(&want, &one[r], 8);
    }
    int64_t got = 0, swapped = 0, single = 0;
    EXPECT(checkpoint_optim_digest(dir, 4, 3, &got) == 0 && (uint64_t)got == want, "3 ranks: %016llx, expected %016llx: %s",
           (unsigned long long)got, (unsigned long long)want, train_error_text);
    checkpoint_optim_path(path, sizeof path, dir, 4, 0, 3);
    EXPECT(copy_file(src[1], path), "copy");
    checkpoint_optim_path(path, sizeof path, dir, 4, 1, 3);
    EXPECT(copy_file(src[0], path), "copy");
    EXPECT(checkpoint_optim_digest(dir, 4, 3, &swapped) == 0 && swapped != got, "ranks 0 and 1 swapped: the same digest");
    checkpoint_optim_path(path, sizeof path, dir, 4, 0, 0);
    EXPECT(copy_file(src[2], path), "copy");
    EXPECT(checkpoint_optim_digest(dir, 4, 0, &single) == 0 && (uint64_t)single == one[2], "a single process: %016llx, "
           "expected %016llx", (unsigned long long)single, (unsigned long long)one[2]);
    checkpoint_optim_path(path, sizeof path, dir, 4, 2, 3);
    remove(path);
    expect_refused(checkpoint_optim_digest(dir, 4, 3, &got), "optim_00000004.rank2of3.bin", "a missing rank's file");
    test_remove_tree(dir, 1);
    for (int r = 0; r < 3; r++) remove(src[r]);
}

void tests_resume(void) {
    rverbose = getenv("BNB8_TEST_VERBOSE") != NULL;
    snprintf(rdir, sizeof rdir, "/tmp/bnb8_resume_XXXXXX");
    if (!mkdtemp(rdir)) { printf("test_resume: mkdtemp failed\n"); return; }
    char path[128];
    rpath(path, sizeof path, "train.bin");
    static uint8_t tokens[1024 + 2 * 4096];   // 4096 tokens of a 64-token vocabulary, an llm.c tokens file
    int32_t h[3] = {TOKENS_MAGIC, 1, 4096};
    memcpy(tokens, h, sizeof h);
    for (int i = 0; i < 4096; i++) { uint16_t t = (uint16_t)((i * 37 + i / 7) % 64); memcpy(tokens + 1024 + 2 * i, &t, 2); }
    put_bytes(path, tokens, sizeof tokens);
    test_run("resume: trainer state version 4 words; each run setting out of its range refused", test_state_version4_words);
    test_run("resume: trainer state version 3 still loads, -V block", test_state_version3_loads);
    test_run("resume: trainer state version 2 still loads, without version 3's fields", test_state_version2_loads);
    test_run("resume: flags left out take the checkpoint's -n -l -u -q -c -g -M -K (bit-exact)",
             test_resume_takes_the_checkpoint_settings);
    test_run("resume: -n -l -u -q -c -g -M -K of other values refused, naming both", test_resume_refuses_changed_flags);
    test_run("resume: a version 2 checkpoint resumes bit-exactly, its missing fields unchecked (noted)",
             test_resume_version2_checkpoint);
    test_run("resume: another run's optimizer file at the same step is refused; falls back",
             test_resume_refuses_another_runs_optimizer_file);
    test_run("resume: a directory in place of the optimizer file is not a regular file",
             test_resume_refuses_directory_for_optimizer_file);
    test_run("resume: bnb8_optimizer_file_digest against a reference; changed, truncated, foreign files",
             test_optimizer_file_digest);
    test_run("resume: the ranks' optimizer files bound in rank order", test_ranks_digest);
    test_remove_tree(rdir, 1);
}
