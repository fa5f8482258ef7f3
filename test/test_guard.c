/*
test_guard.c — what the trainer and the library refuse or stop on: activation sizes that would
overflow, shapes past their limits, runs whose loss stays non-finite, files that are not regular
files, trainer state fields, -v 0, stale temporaries; the weight decay of the trainer's tensors, the LAMB / LARS trust ratio, the ECC code
of a negative tie, the trainer's clip scale. BNB8_TEST_VERBOSE=1 prints the messages.
*/
#define BNB8_INTERNAL   // bnb8_trust_ratio, bnb8_ecc_code, bnb8_ecc8_code_fast: the library's per-element math
#define _POSIX_C_SOURCE 200809L   // mkdtemp, mkfifo
#include "trainer/trainer.h"
#include "trainer/settings.h"
#include "trainer/tensors.h"
#include "trainer/checkpoint.h"
#include "trainer/clip.h"
#include "trainer/device.h"
#include "test.h"
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <dirent.h>

static int gverbose;
static char gdir[64];

static void gpath(char *path, size_t size, const char *name) { snprintf(path, size, "%s/%s", gdir, name); }

// Expects the last call to have failed with a message that holds want (and names none of avoid).
static void expect_message(int status, const char *want, const char *label) {
    EXPECT(status != 0 && strstr(train_error_text, want), "%s: status %d, message '%s' lacks '%s'", label, status,
           train_error_text, want);
    if (gverbose) printf("    %-34s -> %s\n", label, train_error_text);
}

// n tokens of a 64-token vocabulary.
static void write_tokens(const char *path, int64_t n) {
    uint16_t *t = (uint16_t *)malloc(2 * (size_t)n);
    int32_t h[256] = {0};
    h[0] = TOKENS_MAGIC; h[1] = 1; h[2] = (int32_t)n;
    test_rng r = test_rng_new();
    for (int64_t i = 0; t && i < n; i++) t[i] = (uint16_t)(test_u64(&r) % 64);
    FILE *f = fopen(path, "wb");
    EXPECT(t && f && fwrite(h, 4, 256, f) == 256 && fwrite(t, 2, (size_t)n, f) == (size_t)n, "cannot write %s", path);
    if (f) fclose(f);
    free(t);
}

static void small_args(TrainArgs *a, int64_t steps) {
    static char train[128], val[128];
    gpath(train, sizeof train, "train.bin");
    gpath(val, sizeof val, "val.bin");
    train_args_default(a);
    a->train_path = train; a->val_path = val; a->tokenizer_path = "";
    a->model = "d1c32h2v64t16"; a->stable_embedding = 0;
    a->B = 2; a->T = 16; a->steps = steps; a->warmup = 1;
    a->recipe = "fp32"; a->optimizer = "adamw"; a->lr = 1e-3f;
    a->eval_every = 0; a->gen_tokens = 0; a->verbose = 0;
}

// A train_run for test_stdout_in.
typedef struct { const TrainArgs *args; TrainResult *result; } Run;
static int train_run_of(void *ctx) { const Run *r = (const Run *)ctx; return train_run(r->args, r->result); }

// train_run with its stdout in gdir/name; *text (free it): what it printed.
static int run_logged(const TrainArgs *a, TrainResult *r, const char *name, char **text) {
    char log[128];
    Run run = {a, r};
    gpath(log, sizeof log, name);
    return test_stdout_in(log, train_run_of, &run, text);
}

static int count_done(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) n += strncmp(e->d_name, "DONE_", 5) == 0;
    if (d) closedir(d);
    return n;
}

// A shape whose activations overflow (L=512, NH=128, B=128, T=maxT=2^20: L B NH T^2 = 2^63) is
// refused naming the limit, before the weights (1 GB) or the 2^27-token file are touched (the
// token file named does not exist); under UBSan no product overflows. Shapes past a limit name it.
static void test_activation_overflow(void) {
    TrainArgs a;
    small_args(&a, 1);
    a.model = "d512c128h128v64t1048576"; a.B = 128; a.T = 1048576; a.train_path = "/nonexistent/tokens.bin";
    expect_message(train_run(&a, NULL), "2^52", "activation sizes past 2^52 bytes");
    EXPECT(!strstr(train_error_text, "tokens.bin"), "the token file was opened first: '%s'", train_error_text);
    GPT2Config c;
    int64_t sizes[NUM_ACT_TENSORS];
    EXPECT(gpt2_config_from_descriptor(&c, "d512c128h128v64t1048576") == 0, "%s", train_error_text);
    expect_message(gpt2_act_sizes(&c, 128, 1048576, sizes), "2^52", "gpt2_act_sizes, a batch past 2^52 bytes");
    expect_message(gpt2_act_sizes(&c, INT64_C(1) << 40, INT64_C(1) << 40, sizes), "2^52", "gpt2_act_sizes, B = T = 2^40");
    EXPECT(gpt2_act_sizes(&c, 1, 16, sizes) == 0 && sizes[10] == 512 * 128 * 16 * 16, "a small batch: %s", train_error_text);
    // every limit by name (the old message blamed "C a multiple of NH, Vp >= V" for all of them)
    struct { const char *desc, *want; } shapes[] = {
        {"d1c65537h1", "C must be in 1..65536"}, {"d4097c64h1", "L must be in 1..4096"},
        {"d1c64h1t1048577", "maxT must be in 1..1048576"}, {"d1c64h3", "NH must"}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        expect_message(gpt2_config_from_descriptor(&c, shapes[i].desc), shapes[i].want, shapes[i].desc);
    EXPECT(gpt2_config_from_descriptor(&c, "d1c64h1") == 0, "%s", train_error_text);
    c.vocab_size = c.padded_vocab_size = (1 << 24) + 1;
    expect_message(gpt2_config_check(&c, "V 2^24 + 1"), "V must be in 1..16777216", "V 2^24 + 1");
}

// A model whose every weight is 3e38 (finite: it loads) gives a NaN loss at every
// step: the run stops after TRAIN_MAX_BAD_STEPS with an error and writes no checkpoint. A run whose
// gradients turn NaN from step 4 skips steps 4..13 (each checkpoint of them holds the weights of
// step 3, whose loss is finite) and stops at 13. A run whose gradients become 1e36 at step 4 (SGD,
// no clipping: the weights jump to about 1e33, finite) writes no checkpoint from step 4 on (the
// weights after it give a non-finite loss), and stops at 14: the newest checkpoint is step 3's.
static int64_t poison_from;
static float poison_value;
static void poison_grads(GPT2 *m, float *grads, bnb8_optimizer *opt, int64_t step) {
    (void)opt;
    if (step >= poison_from) for (int64_t i = 0; i < m->num_parameters; i++) grads[i] = poison_value;
}
static void test_divergence_stops(void) {
    char model[128], out[128];
    gpath(model, sizeof model, "huge.bin");
    gpath(out, sizeof out, "diverged");
    GPT2 m;
    GPT2Config c;
    EXPECT(gpt2_config_from_descriptor(&c, "d1c32h2v64t16") == 0 && gpt2_init_random(&m, &c, 3) == 0, "%s", train_error_text);
    for (int64_t i = 0; i < m.num_parameters; i++) m.params_memory[i] = 3e38f;
    EXPECT(gpt2_save(&m, model, 0) == 0, "%s", train_error_text);
    gpt2_free(&m);
    TrainArgs a;
    TrainResult r = {0};
    small_args(&a, 30);
    a.model = model; a.out_dir = out; a.ckpt_every = 1;
    a.eval_every = 5; a.verbose = 1;             // the validation loss at step 0 is NaN: printed as such
    char *text = NULL;
    expect_message(run_logged(&a, &r, "huge_stdout.txt", &text), "in a row", "weights of 3e38");
    EXPECT(text && strstr(text, "| val loss") && strstr(text, "nan (not finite)"), "the NaN validation loss is not reported as such: %s",
           text ? text : "(no output)");
    free(text);
    EXPECT(strstr(train_error_text, "steps 1..10"), "stopped at the wrong step: '%s'", train_error_text);
    EXPECT(count_done(out) == 0, "%d checkpoints written from weights whose loss is NaN", count_done(out));
    test_remove_tree(out, 1);
    small_args(&a, 30);
    a.out_dir = out; a.ckpt_every = 1;
    poison_from = 4;
    poison_value = NAN;
    train_after_backward = poison_grads;
    expect_message(train_run(&a, &r), "in a row", "NaN gradients from step 4");
    train_after_backward = NULL;
    EXPECT(strstr(train_error_text, "steps 4..13"), "stopped at the wrong step: '%s'", train_error_text);
    EXPECT(count_done(out) == 12 && r.skipped_steps == 10, "%d checkpoints, %lld skipped: expected 12, 10", count_done(out),
           (long long)r.skipped_steps);
    test_remove_tree(out, 1);
    // the prev rule steps the finite elements and leaves the NaN ones unchanged (no step skipped):
    // ten such steps in a row stop the run too
    small_args(&a, 30);
    a.clip_rule = CLIP_PREV;
    train_after_backward = poison_grads;
    expect_message(train_run(&a, &r), "in a row", "NaN gradients from step 4 under -N prev");
    train_after_backward = NULL;
    EXPECT(strstr(train_error_text, "steps 4..13") && r.skipped_steps == 0, "stopped at the wrong step or skipped %lld: '%s'",
           (long long)r.skipped_steps, train_error_text);
    small_args(&a, 30);
    a.out_dir = out; a.ckpt_every = 1; a.optimizer = "sgd"; a.grad_clip = 0.0f;
    poison_value = 1e36f;
    train_after_backward = poison_grads;
    expect_message(train_run(&a, &r), "in a row", "gradients of 1e36 from step 4");
    train_after_backward = NULL;
    EXPECT(strstr(train_error_text, "steps 5..14"), "stopped at the wrong step: '%s'", train_error_text);
    EXPECT(count_done(out) == 3 && checkpoint_latest(out) == 3, "%d checkpoints, newest %lld: expected 1..3", count_done(out),
           (long long)checkpoint_latest(out));
    test_remove_tree(out, 1);
}

// Files that are not regular files are refused at once, naming what they are, by the
// trainer and by the library (bnb8_open_regular, which the trainer wraps; a FIFO
// would block fopen forever: here a writer is held open, so that a regression shows as a failure, not a hang);
// -R 1 on the CPU names -D gpu; a trainer state field out of range is named; -v 0 never evaluates;
// temporaries of an interrupted run are removed at start; -l x -c >= 1 is refused naming the flags.
static void test_inputs_and_fields(void) {
    char fifo[128], path[128];
    gpath(fifo, sizeof fifo, "fifo");
    EXPECT(mkfifo(fifo, 0600) == 0, "mkfifo");
    int rd = open(fifo, O_RDONLY | O_NONBLOCK), wr = open(fifo, O_WRONLY | O_NONBLOCK);
    TokenFile tf;
    expect_message(tokens_load(&tf, fifo), "a FIFO", "tokens: a FIFO");
    Tokenizer tok;
    expect_message(tokenizer_load(&tok, gdir), "a directory", "tokenizer: a directory");
    GPT2 m;
    expect_message(gpt2_load(&m, "/dev/null"), "a device", "model: /dev/null");
    bnb8_optimizer *opt = NULL;
    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, NULL) == 0, "%s", bnb8_last_error());
    EXPECT(bnb8_optimizer_load(opt, fifo) == BNB8_ERR_IO && strstr(bnb8_last_error(), "is a FIFO, not a regular file"),
           "optimizer state: a FIFO: '%s'", bnb8_last_error());
    EXPECT(bnb8_optimizer_load(opt, gdir) == BNB8_ERR_IO && strstr(bnb8_last_error(), "is a directory, not a regular file"),
           "optimizer state: a directory: '%s'", bnb8_last_error());
    EXPECT(bnb8_optimizer_load(opt, "/dev/null") == BNB8_ERR_IO && strstr(bnb8_last_error(), "is a device or socket"),
           "optimizer state: /dev/null: '%s'", bnb8_last_error());
    bnb8_optimizer_free(opt);
    if (rd >= 0) close(rd);
    if (wr >= 0) close(wr);
    remove(fifo);
    TrainArgs a;
    small_args(&a, 2);
    a.release = 1; a.device = 1; a.recipe = "flash"; a.grad_clip = 0.0f;
    expect_message(train_run(&a, NULL), "-D gpu", "-R 1 on the CPU");
    small_args(&a, 2);
    a.lr = 0.5f; a.weight_decay = 2.0f;
    expect_message(train_run(&a, NULL), "-l 0.5 x -c 2", "-l 0.5 -c 2");
    // a trainer state whose recipe is 99: the message names the recipe
    TrainerState s = {.step = 3, .B = 2, .T = 16, .recipe = 99, .steps = 30, .rng = 7, .seed = 1, .accum = 1,
                      .weight_bytes = 4, .version = STATE_VERSION};
    gpath(path, sizeof path, "state.bin");
    EXPECT(write_atomically(path, state_writer, &s) == 0, "%s", train_error_text);
    TrainerState back;
    expect_message(state_load(&back, path), "recipe is 99", "state: recipe 99");
    // -v 0: never evaluated, not even at the end
    small_args(&a, 2);
    TrainResult r = {0};
    EXPECT(train_run(&a, &r) == 0 && isnan(r.val_loss), "-v 0: val loss %g, %s", (double)r.val_loss, train_error_text);
    a.eval_every = 2;
    EXPECT(train_run(&a, &r) == 0 && isfinite(r.val_loss), "-v 2: val loss %g, %s", (double)r.val_loss, train_error_text);
    // temporary files left by a killed run (the older name, and name.tmp.<pid>.<n>) go at the next start
    char out[128], stale[2][160];
    gpath(out, sizeof out, "stale");
    mkdir(out, 0755);
    snprintf(stale[0], sizeof stale[0], "%s/model_00000001.bin.tmp", out);
    snprintf(stale[1], sizeof stale[1], "%s/optim_00000001.bin.tmp.12345.0", out);
    for (int k = 0; k < 2; k++) {
        FILE *f = fopen(stale[k], "wb");
        if (f) { fputs("half a model", f); fclose(f); }
    }
    small_args(&a, 1);
    a.out_dir = out;
    EXPECT(train_run(&a, NULL) == 0 && access(stale[0], F_OK) != 0 && access(stale[1], F_OK) != 0,
           "a stale temporary is still there: %s", train_error_text);
    test_remove_tree(out, 1);
}

// A resumed run continues its checkpoint's model, RNG and data position. An -e
// (descriptor or .bin) of another shape, a -w of the other StableEmbedding and an -i of other tokens
// (the same count, or another) are refused, naming the flag; an -e left out (or of the same shape)
// takes the checkpoint's model; a -d of another seed is noted, the checkpoint's RNG continues (the
// same losses as without it) and the next checkpoint records the run's seed. -x at or below the
// checkpoint's step is refused (with -X it exports the checkpoint as it is, on any -i), -x without
// -o too.
// Each refusal leaves the directory as it was.
static void test_resume_flags(void) {
    char out[128], other[128], other_count[128], model[128], state[256];
    gpath(out, sizeof out, "resume_flags");
    gpath(other, sizeof other, "other_train.bin");
    gpath(other_count, sizeof other_count, "other_count.bin");
    gpath(model, sizeof model, "other_shape.bin");
    write_tokens(other, 4096);
    write_tokens(other_count, 4095);
    TrainArgs a;
    small_args(&a, 6);
    a.out_dir = out; a.stop_after = 2;
    EXPECT(train_run(&a, NULL) == 0 && checkpoint_latest(out) == 2, "first part: %s", train_error_text);
    small_args(&a, 6);
    a.out_dir = out; a.resume = 1;
    GPT2 m;
    GPT2Config c;
    EXPECT(gpt2_config_from_descriptor(&c, "d1c64h2v64t16") == 0 && gpt2_init_random(&m, &c, 3) == 0 &&
           gpt2_save(&m, model, 1) == 0, "%s", train_error_text);
    gpt2_free(&m);
    struct { const char *label, *model, *train, *want; int stable; int64_t stop; } refused[] = {
        {"-e of another depth", "d2c32h2v64t16", NULL, "-e d2c32h2v64t16 is L=2 C=32", 0, 0},
        {"-e of another maxT", "d1c32h2v64t32", NULL, "maxT=32; the checkpoint of step 2", 0, 0},
        {"-e .bin of another width", model, NULL, "L=1 C=64 NH=2", 0, 0},
        {"-w 1 on a checkpoint without", NULL, NULL, "-w 1 cannot change that", 1, 0},
        {"-i of other tokens, same count", NULL, other, "resume on the same training data", 0, 0},
        {"-i of another token count", NULL, other_count, "holds 4095", 0, 0},
        {"-x at the checkpoint's step", NULL, NULL, "-x 2 stops at or before it", 0, 2},
        {"-x below the checkpoint's step", NULL, NULL, "-x 1 stops at or before it", 0, 1},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        TrainArgs b = a;
        if (refused[i].model) { b.model = refused[i].model; b.given['e'] = 1; }
        if (refused[i].train) b.train_path = refused[i].train;
        b.stable_embedding = refused[i].stable;
        b.stop_after = refused[i].stop;
        expect_message(train_run(&b, NULL), refused[i].want, refused[i].label);
        EXPECT(checkpoint_latest(out) == 2 && count_done(out) == 1, "%s: the directory changed", refused[i].label);
    }
    // -x at the checkpoint's step with -X: the checkpoint exported as it is, no step run (and so
    // whatever -i says: no data is trained on)
    char exported[128];
    gpath(exported, sizeof exported, "exported.bin");
    TrainArgs b = a;
    TrainResult r = {0};
    b.stop_after = 2; b.export_path = exported; b.train_path = other;
    EXPECT(train_run(&b, &r) == 0 && r.last_step == 2 && access(exported, F_OK) == 0 && checkpoint_latest(out) == 2,
           "-x 2 -X from the checkpoint of step 2: %s (last step %lld)", train_error_text, (long long)r.last_step);
    // -e left out (another descriptor, not given) or given with the checkpoint's shape: resumed
    b = a;
    b.model = "d3c96h3"; b.stop_after = 3;
    EXPECT(train_run(&b, &r) == 0 && r.first_step == 3, "-e not given: %s", train_error_text);
    float losses[2][6];
    memset(losses, 0, sizeof losses);
    for (int seed = 0; seed < 2; seed++) {   // -d 99 from the checkpoint of step 3: noted, the same losses
        b = a;
        b.given['e'] = 1; b.verbose = 1; b.eval_every = 0;
        if (seed) b.seed = 99;
        char *text = NULL;
        TrainResult rr = {0};
        rr.losses = losses[seed];
        int status = run_logged(&b, &rr, "resume_flags.txt", &text);
        EXPECT(status == 0 && rr.first_step == 4, "resume with -d %llu: %s", (unsigned long long)b.seed, train_error_text);
        const char *note = strstr(text ? text : "", "note: resuming");
        EXPECT(seed ? note && strstr(note, "seed 1337); -d 99 is not used") : !note, "-d %llu: the note is %s",
               (unsigned long long)b.seed, note ? note : "missing");
        if (seed) {
            checkpoint_path(state, sizeof state, out, "state", 6, ".bin");
            TrainerState st;
            EXPECT(state_load(&st, state) == 0 && st.seed == 1337, "the checkpoint after -d 99 records seed %llu",
                   (unsigned long long)st.seed);
        }
        free(text);
        // back to the checkpoint of step 3 for the other run
        for (int64_t s = 4; s <= 6; s++) {
            const char *kinds[3] = {"DONE", "optim", "state"};
            for (int k = 0; k < 3; k++) {
                checkpoint_path(state, sizeof state, out, kinds[k], s, k ? ".bin" : "");
                remove(state);
            }
        }
    }
    EXPECT(memcmp(losses[0] + 3, losses[1] + 3, 3 * sizeof(float)) == 0, "-d 99 changed the resumed losses");
    // -x without -o
    small_args(&a, 6);
    a.stop_after = 2;
    expect_message(train_run(&a, NULL), "needs an output directory (-o)", "-x without -o");
    test_remove_tree(out, 1);
    remove(other); remove(other_count); remove(model); remove(exported);
}

// Mutation gap: weight decay reaches the matrices and the embeddings (gpt2_param_is_matrix) and
// nothing else. One AdamW step with every gradient zero (m = v = 0: the update is 0 / eps = 0):
// a matrix becomes exactly p (1 - lr wd) in float, every bias and LayerNorm parameter stays.
static void zero_grads(GPT2 *m, float *grads, bnb8_optimizer *opt, int64_t step) {
    (void)opt; (void)step;
    memset(grads, 0, sizeof(float) * (size_t)m->num_parameters);
}
static void test_decay_reaches_matrices_only(void) {
    for (int stable = 0; stable < 2; stable++) {
        TrainArgs a;
        small_args(&a, 1);
        a.weight_decay = 0.1f; a.lr = 1e-2f; a.stable_embedding = stable;
        GPT2 m;
        GPT2Config c;
        EXPECT(gpt2_config_from_descriptor(&c, a.model) == 0, "%s", train_error_text);
        c.stable_embedding = stable;
        if (gpt2_init_random(&m, &c, a.seed)) { EXPECT(0, "%s", train_error_text); return; }
        float *after = (float *)malloc(sizeof(float) * (size_t)m.num_parameters);
        TrainResult r = {0};
        r.final_params = after; r.final_params_count = m.num_parameters;
        train_after_backward = zero_grads;
        EXPECT(after && train_run(&a, &r) == 0, "%s", train_error_text);
        train_after_backward = NULL;
        float decay = (float)(1.0 - (double)lr_schedule(&a, a.lr, 1) * a.weight_decay);
        int64_t off = 0, wrong = 0;
        for (int i = 0; i < GPT2_NUM_PARAMS && after; off += m.param_sizes[i], i++)
            for (int64_t j = 0; j < m.param_sizes[i]; j++) {
                float p = m.params_memory[off + j], want = gpt2_param_is_matrix[i] ? p * decay : p;
                if (after[off + j] != want && wrong++ < 3)
                    EXPECT(0, "StableEmbedding %d: %s[%lld] = %.9g after a zero-gradient step from %.9g, expected %.9g",
                           stable, gpt2_param_names[i], (long long)j, (double)after[off + j], (double)p, (double)want);
            }
        EXPECT(wrong == 0, "StableEmbedding %d: %lld weights wrong", stable, (long long)wrong);
        free(after);
        gpt2_free(&m);
    }
}

// Mutation gap: the LAMB / LARS trust ratio, directly (limit / unorm only above the limit, 1 at or
// below it, and when off or the update is 0 or NaN) and in a step that is not clipped (|p| large)
// and one that is (|p| tiny), each against the update computed in double.
static void test_trust_ratio(void) {
    EXPECT(bnb8_trust_ratio(1.0f, 4.0f, 16.0f) == 0.5f, "above the limit: %g", (double)bnb8_trust_ratio(1.0f, 4.0f, 16.0f));
    EXPECT(bnb8_trust_ratio(1.0f, 16.0f, 4.0f) == 1.0f, "below the limit: %g", (double)bnb8_trust_ratio(1.0f, 16.0f, 4.0f));
    EXPECT(bnb8_trust_ratio(0.5f, 16.0f, 4.0f) == 1.0f, "at the limit: %g", (double)bnb8_trust_ratio(0.5f, 16.0f, 4.0f));
    EXPECT(bnb8_trust_ratio(0.0f, 1.0f, 100.0f) == 1.0f && bnb8_trust_ratio(1.0f, 1.0f, 0.0f) == 1.0f &&
           bnb8_trust_ratio(1.0f, 1.0f, NAN) == 1.0f, "off, a zero update, a NaN norm: 1");
    const int64_t n = 1000;
    float p[1000], g[1000];
    double p0[1000], u[1000];
    test_rng rng = test_rng_new();
    for (int lars = 0; lars < 2; lars++)
        for (int big = 0; big < 2; big++) {
            bnb8_optim kind = lars ? BNB8_LARS : BNB8_LAMB;
            bnb8_config c = bnb8_config_default(kind);
            c.format = BNB8_STATE_32BIT; c.weight_decay = 0.0f;
            double p2 = 0.0, u2 = 0.0;
            for (int64_t i = 0; i < n; i++) {
                p[i] = (float)((big ? 10.0 : 1e-3) * (1.0 + 0.1 * test_randn(&rng)));
                g[i] = (float)(1e-3 * test_randn(&rng));
                p0[i] = p[i];
                // step 1: LAMB's m / (sqrt(v) / sqrt(bc2) + eps) with m = (1 - b1) g, v = (1 - b2) g^2, over bc1
                // in the step size; LARS's buffer is g itself
                double gd = g[i], b1 = c.beta1, b2 = c.beta2;
                u[i] = lars ? gd : (1 - b1) * gd / (sqrt((1 - b2) * gd * gd) / sqrt(1 - b2) + c.eps);
                p2 += p0[i] * p0[i];
                u2 += u[i] * u[i];
            }
            double limit = c.max_unorm * sqrt(p2), trust = sqrt(u2) > limit ? limit / sqrt(u2) : 1.0;
            double step = lars ? c.lr : c.lr / (1.0 - c.beta1);
            bnb8_optimizer *opt = NULL;
            EXPECT(bnb8_optimizer_create(&opt, kind, &c) == 0 && bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, BNB8_F32, n, NULL) == 0 &&
                   bnb8_optimizer_step(opt, c.lr, 1.0f, NULL) == 0, "%s", bnb8_last_error());
            bnb8_optimizer_free(opt);
            EXPECT(big ? trust == 1.0 : trust < 0.1, "%s %s: the case's own trust %g", lars ? "LARS" : "LAMB", big ? "big" : "tiny", trust);
            int64_t wrong = 0;
            for (int64_t i = 0; i < n; i++) {
                double want = p0[i] - step * trust * u[i], tol = 4.0 * fabs(p0[i]) * 0x1p-23 + 1e-3 * step * trust * fabs(u[i]);
                if (fabs(p[i] - want) > tol && wrong++ < 3)
                    EXPECT(0, "%s |p| %s, element %lld: %.9g, expected %.9g (trust %g)", lars ? "LARS" : "LAMB", big ? "10" : "1e-3",
                           (long long)i, (double)p[i], want, trust);
            }
        }
}

// Mutation gap: the correction of a weight exactly a quarter ulp below its bf16 value is the tie
// t = -0.5, which rounds half away from zero: -64 (int8), -16384 (int16); +64 above. The GPU's fast
// form (bnb8_ecc8_code_fast, shared) agrees and vouches for it.
static void test_ecc_negative_tie(void) {
    const float n = 1.5f, quarter = 0x1p-9f;               // bf16 1.5: ulp 2^-7, 2^L = 2^-8
    uint16_t bits = bnb8_f32_to_bf16(n);
    for (int sign = -1; sign <= 1; sign += 2) {
        float x = n + (float)sign * quarter;
        EXPECT(bnb8_f32_to_bf16(x) == bits, "RNE(%g) is not 1.5", (double)x);
        int32_t q8 = bnb8_ecc_code(x, bits, BNB8_BF16, 127), q16 = bnb8_ecc_code(x, bits, BNB8_BF16, 32767);
        int ok = 1;
        int32_t fast = bnb8_ecc8_code_fast(x, bits, &ok);
        EXPECT(q8 == 64 * sign && q16 == 16384 * sign && fast == 64 * sign && ok,
               "tie t = %+.1f: int8 %d, int16 %d, fast %d (ok %d), expected %d, %d", 0.5 * sign, q8, q16, fast, ok, 64 * sign,
               16384 * sign);
    }
}

// Mutation gap: the trainer's clip scale for a norm above, equal to and below the threshold
// (equal: not clipped), with and without accumulation, and clipping off.
static void test_clip_scale(void) {
    EXPECT(step_scale(2.0, 1.0f, 1) == 0.5f, "above: %g", (double)step_scale(2.0, 1.0f, 1));
    EXPECT(step_scale(1.0, 1.0f, 1) == 1.0f, "equal: %g", (double)step_scale(1.0, 1.0f, 1));
    EXPECT(step_scale(0.5, 1.0f, 1) == 1.0f, "below: %g", (double)step_scale(0.5, 1.0f, 1));
    EXPECT(step_scale(4.0, 1.0f, 2) == 0.125f && step_scale(1.0, 1.0f, 4) == 0.25f, "accumulation: %g %g",
           (double)step_scale(4.0, 1.0f, 2), (double)step_scale(1.0, 1.0f, 4));
    EXPECT(step_scale(1e9, 0.0f, 1) == 1.0f, "clipping off: %g", (double)step_scale(1e9, 0.0f, 1));
}

// A file's contents, or "" when it cannot be read (free it).
static char *contents(const char *path) {
    size_t n;
    char *d = (char *)test_slurp(path, &n);
    return d ? d : (char *)calloc(1, 1);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    EXPECT(f && fputs(text, f) >= 0, "cannot write %s", path);
    if (f) fclose(f);
}

// -o may be a directory other programs use too: at start the run removes the temporaries of its own
// checkpoint files that a killed run left (name.tmp.<pid>.<n> and name.tmp, regular files) and
// nothing else: not a name that only holds ".tmp", nor a symlink or a directory named as a temporary.
static void test_removes_only_own_temporaries(void) {
    char out[128], target[128], path[256];
    gpath(out, sizeof out, "shared");
    gpath(target, sizeof target, "linked.txt");
    mkdir(out, 0755);
    write_text(target, "another program's file");
    const char *kept[] = {"report.tmpl", "x.tmp", "notes.tmp.1.2", "optim_00000001.bin.tmpx", "optim_1.bin.tmp.5.0",
                          "state_00000001.bin.tmp.5", "optim_00000001.bin.tmp.12.0"};   // the last: a symlink
    const char *stale[] = {"optim_00000001.bin.tmp.12345.0", "state_00000001.bin.tmp", "DONE_00000001.tmp.7.3",
                           "optim_00000001.rank1of2.bin.tmp.9.1"};
    const int nk = (int)(sizeof kept / sizeof kept[0]), ns = (int)(sizeof stale / sizeof stale[0]);
    for (int k = 0; k < nk - 1; k++) { snprintf(path, sizeof path, "%s/%s", out, kept[k]); write_text(path, "keep"); }
    snprintf(path, sizeof path, "%s/%s", out, kept[nk - 1]);
    EXPECT(symlink(target, path) == 0, "symlink %s", path);
    snprintf(path, sizeof path, "%s/state_00000002.bin.tmp.12.1", out);   // a directory named as a temporary
    mkdir(path, 0755);
    for (int k = 0; k < ns; k++) { snprintf(path, sizeof path, "%s/%s", out, stale[k]); write_text(path, "half a checkpoint"); }
    TrainArgs a;
    small_args(&a, 1);
    a.out_dir = out;
    EXPECT(train_run(&a, NULL) == 0, "%s", train_error_text);
    struct stat st;
    for (int k = 0; k < nk; k++) {
        snprintf(path, sizeof path, "%s/%s", out, kept[k]);
        EXPECT(lstat(path, &st) == 0, "-o removed %s, not a temporary of its own", path);
    }
    snprintf(path, sizeof path, "%s/state_00000002.bin.tmp.12.1", out);
    EXPECT(lstat(path, &st) == 0 && S_ISDIR(st.st_mode), "-o removed the directory %s", path);
    char *text = contents(target);
    EXPECT(strcmp(text, "another program's file") == 0, "the symlink's target changed: '%s'", text);
    free(text);
    for (int k = 0; k < ns; k++) {
        snprintf(path, sizeof path, "%s/%s", out, stale[k]);
        EXPECT(access(path, F_OK) != 0, "the stale temporary %s is still there", path);
    }
    test_remove_tree(out, 1);
    remove(target);
}

// -X is checked before the first step, as -o is: a directory that cannot be written into, or a
// path that is a directory, is refused with no step run; a writable one is probed without a file
// left behind (only the export is there at the end).
static void test_export_path_checked_before_training(void) {
    char dir[128], bad[3][256], path[256];
    gpath(dir, sizeof dir, "exports");
    mkdir(dir, 0755);
    snprintf(bad[0], sizeof bad[0], "%s/missing/m.bin", gdir);
    snprintf(bad[1], sizeof bad[1], "%s/train.bin/m.bin", gdir);   // a file as the directory
    snprintf(bad[2], sizeof bad[2], "%s", dir);
    const char *want[3] = {"cannot write", "cannot write", "a directory"};
    TrainArgs a;
    for (int k = 0; k < 3; k++) {
        small_args(&a, 2);
        a.export_path = bad[k];
        TrainResult r = {0};
        train_error_text[0] = 0;
        EXPECT(train_run(&a, &r) != 0 && strstr(train_error_text, want[k]) && r.last_step == 0,
               "-X %s: steps to %lld, '%s'", bad[k], (long long)r.last_step, train_error_text);
        if (gverbose) printf("    -X %s -> %s\n", bad[k], train_error_text);
    }
    small_args(&a, 2);
    snprintf(path, sizeof path, "%s/m.bin", dir);
    a.export_path = path;
    EXPECT(train_run(&a, NULL) == 0 && access(path, F_OK) == 0, "-X %s: %s", path, train_error_text);
    DIR *d = opendir(dir);
    struct dirent *e;
    int others = 0;
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "m.bin")) {
            others++;
            EXPECT(0, "the export's directory holds %s", e->d_name);
        }
    if (d) closedir(d);
    EXPECT(others == 0, "%d files beside the export", others);
    test_remove_tree(dir, 1);
}

// -X never names the run's own files: a checkpoint file of -o (of a step written or to come, by its
// directory, however spelled), an input (-i, -j, -z, a .bin -e; by identity, however spelled). Each
// is refused before training, and the file stays as it was; another name in -o exports.
static void test_export_refuses_own_files(void) {
    char out[128], path[256], model[128];
    gpath(out, sizeof out, "xo");
    gpath(model, sizeof model, "model.bin");
    TrainArgs a;
    small_args(&a, 2);
    a.export_path = model;
    EXPECT(train_run(&a, NULL) == 0, "model file: %s", train_error_text);
    small_args(&a, 4);
    a.out_dir = out; a.stop_after = 3;
    EXPECT(train_run(&a, NULL) == 0 && checkpoint_latest(out) == 3, "checkpoint: %s", train_error_text);
    char names[4][256];
    snprintf(names[0], sizeof names[0], "%s/optim_00000003.bin", out);
    snprintf(names[1], sizeof names[1], "%s/./state_00000003.bin", out);
    snprintf(names[2], sizeof names[2], "%s/../xo/optim_00000004.bin", out);   // the step to come
    snprintf(names[3], sizeof names[3], "%s/DONE_00000004", out);
    char *before = contents(names[0]);
    for (int k = 0; k < 4; k++) {
        small_args(&a, 4);
        a.out_dir = out; a.resume = 1; a.export_path = names[k];
        TrainResult r = {0};
        train_error_text[0] = 0;
        EXPECT(train_run(&a, &r) != 0 && strstr(train_error_text, "-o") && r.last_step == 0 && checkpoint_latest(out) == 3,
               "-X %s: '%s'", names[k], train_error_text);
        if (gverbose) printf("    -X %s -> %s\n", names[k], train_error_text);
    }
    char *after = contents(names[0]);
    EXPECT(strcmp(before, after) == 0 && before[0], "the checkpoint's optimizer file changed");
    free(before); free(after);
    char train_alias[256];
    small_args(&a, 2);
    snprintf(train_alias, sizeof train_alias, "%s/../%s/./train.bin", gdir, strrchr(gdir, '/') + 1);
    char tok[128];   // a copy of the tokenizer: on a regression the export replaces it, not the repository's
    gpath(tok, sizeof tok, "tokenizer.bin");
    size_t n;
    uint8_t *bytes = test_slurp(DEFAULT_DATA_DIR "gpt2_tokenizer.bin", &n);
    FILE *f = bytes ? fopen(tok, "wb") : NULL;
    EXPECT(f && fwrite(bytes, 1, n, f) == n, "cannot copy the tokenizer to %s", tok);
    if (f) fclose(f);
    free(bytes);
    const char *inputs[4] = {train_alias, a.val_path, tok, model};
    const char *flags[4] = {"-i", "-j", "-z", "-e"};
    for (int k = 0; k < 4; k++) {
        small_args(&a, 2);
        if (k == 2) a.tokenizer_path = inputs[2];
        if (k == 3) a.model = model;
        a.export_path = inputs[k];
        char *was = contents(inputs[k]);
        TrainResult r = {0};
        train_error_text[0] = 0;
        EXPECT(train_run(&a, &r) != 0 && strstr(train_error_text, flags[k]) && r.last_step == 0,
               "-X %s, the run's %s: '%s'", inputs[k], flags[k], train_error_text);
        char *now = contents(inputs[k]);
        EXPECT(strcmp(was, now) == 0, "-X replaced the input %s", inputs[k]);
        free(was); free(now);
        if (gverbose) printf("    -X the run's %s -> %s\n", flags[k], train_error_text);
    }
    small_args(&a, 4);
    a.out_dir = out; a.resume = 1;
    snprintf(path, sizeof path, "%s/final.bin", out);
    a.export_path = path;
    EXPECT(train_run(&a, NULL) == 0 && access(path, F_OK) == 0 && checkpoint_latest(out) == 4, "-X %s: %s", path,
           train_error_text);
    test_remove_tree(out, 1);
    remove(model);
    remove(tok);
}

// The -o lock is a file descriptor like any other: with stdin closed it may be fd 0, and it is
// released all the same (when a run ends, and when a resume falls back past a damaged checkpoint),
// so that the next run, or the fallback, does not find the directory "in use by another run".
static void test_lock_released_on_fd_zero(void) {
    char out[128], path[256];
    gpath(out, sizeof out, "fd0");
    fflush(stdout);
    int saved = dup(0);
    close(0);
    TrainArgs a;
    small_args(&a, 4);
    a.out_dir = out; a.ckpt_every = 1; a.stop_after = 2;
    int s1 = train_run(&a, NULL);
    EXPECT(s1 == 0, "first run: %s", train_error_text);
    a.stop_after = 3; a.resume = 1;
    int s2 = s1 ? -1 : train_run(&a, NULL);
    EXPECT(s1 || s2 == 0, "a second run with stdin closed: '%s'", train_error_text);
    checkpoint_path(path, sizeof path, out, "state", 3, ".bin");
    truncate(path, 9);   // the newest checkpoint damaged: the resume falls back to step 2
    a.stop_after = 0;
    TrainResult r = {0};
    int s3 = train_run(&a, &r);
    EXPECT(s3 == 0 && r.first_step == 3, "fallback with stdin closed: steps from %lld, '%s'", (long long)r.first_step,
           train_error_text);
    if (saved >= 0) { dup2(saved, 0); close(saved); }
    test_remove_tree(out, 1);
}

// A clip far below the norm (-g 1e-45, the least positive float; over 2 micro-batches) gives a
// scale that rounds to 0 in float: the scale is kept positive, so the run trains (by almost nothing) instead of the library
// refusing its step.
static void test_tiny_clip_keeps_scale_positive(void) {
    EXPECT(step_scale(5.0, 1e-45f, 1) > 0.0f && step_scale(1e300, 1.0f, 4) > 0.0f, "scales %g, %g",
           (double)step_scale(5.0, 1e-45f, 1), (double)step_scale(1e300, 1.0f, 4));
    const int rules[3] = {CLIP_EXACT, CLIP_PREV, CLIP_EST};
    for (int k = 0; k < 3; k++) {
        TrainArgs a;
        small_args(&a, 3);
        a.grad_clip = 1e-45f; a.clip_rule = rules[k]; a.accum = 2;   // the mean of 2: half the least float
        TrainResult r = {0};
        EXPECT(train_run(&a, &r) == 0 && r.last_step == 3, "-g 1e-45 -N %d: '%s'", rules[k], train_error_text);
    }
}

void tests_guard(void) {
    gverbose = getenv("BNB8_TEST_VERBOSE") != NULL;
    snprintf(gdir, sizeof gdir, "/tmp/bnb8_guard_XXXXXX");
    if (!mkdtemp(gdir)) { printf("test_guard: mkdtemp failed\n"); return; }
    char path[128];
    gpath(path, sizeof path, "train.bin");
    write_tokens(path, 4096);
    gpath(path, sizeof path, "val.bin");
    write_tokens(path, 1024);
    test_run("guard: activation sizes past 2^52 bytes and shapes past a limit are refused, naming it", test_activation_overflow);
    test_run("guard: a loss not finite 10 steps in a row stops the run; no checkpoint from it", test_divergence_stops);
    test_run("guard: FIFO, directory and device inputs, -R 1 on the CPU, state fields, -v 0, stale .tmp", test_inputs_and_fields);
    test_run("guard: resume refuses -e, -w, -i of another model or data, notes -d; -x at or below it, -x without -o",
             test_resume_flags);
    test_run("guard: weight decay reaches the matrices and embeddings only", test_decay_reaches_matrices_only);
    test_run("guard: LAMB / LARS trust ratio: clipped and unclipped steps", test_trust_ratio);
    test_run("guard: ECC code of a tie t = -0.5 is -64 (exact and fast forms)", test_ecc_negative_tie);
    test_run("guard: the trainer's clip scale above, at and below the threshold", test_clip_scale);
    test_run("guard: -o removes its own checkpoint temporaries only (regular files, by their exact names)",
             test_removes_only_own_temporaries);
    test_run("guard: -X is checked writable before the first step, leaving no file behind", test_export_path_checked_before_training);
    test_run("guard: -X naming a checkpoint file of -o or an input of the run is refused before training",
             test_export_refuses_own_files);
    test_run("guard: the -o lock on fd 0 (stdin closed) is released: a second run and a fallback resume",
             test_lock_released_on_fd_zero);
    test_run("guard: -g 1e-45 keeps the clip scale positive: every rule trains", test_tiny_clip_keeps_scale_positive);
    test_remove_tree(gdir, 1);
}
