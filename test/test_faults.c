/*
test_faults.c — reliability (DESIGN.md §11): the trainer killed at random points while it
writes checkpoints, a full disk during a save, NaN and Inf in gradients and in loaded weights, and
the size limits of the API.

Kills and full disks need a process to kill: this test program runs itself again (/proc/self/exe)
with BNB8_TEST_CHILD=train in its environment, and main hands that child to test_faults_child(),
which trains with the real trainer (train_run, resuming from the newest complete checkpoint,
checkpointing every step) and exits. Every checkpoint the children leave is compared byte for byte
with the one an uninterrupted run wrote for the same step, so a resumed run that drifted by one bit
would show.

`make test` kills the trainer a few times; `make test-full` (BNB8_TEST_FULL=1) 100 times with the
8-bit recipe and 30 with the flash recipe.
BNB8_TEST_VERBOSE=1 prints the counts and the messages.
*/
#define BNB8_INTERNAL   // bnb8_bits_f32: a quiet NaN of given bits
#define _POSIX_C_SOURCE 200809L
#include "trainer/trainer.h"
#include "trainer/settings.h"
#include "trainer/tensors.h"
#include "trainer/checkpoint.h"
#include "trainer/clip.h"
#include "trainer/device.h"
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>
#include <time.h>
#include "test.h"
#include <signal.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <sys/resource.h>

extern char **environ;

static int fverbose, ffull;
static char fdir[64];                      // this group's scratch directory
static char ftokens[128];                  // the training tokens every child reads

#define CHILD_MODEL "d1c32h2v128t16"       // ~17.5k parameters: wte, fcw and fcprojw get 8-bit states
#define CHILD_B 2
#define CHILD_T 16

static void fpath(char *path, size_t size, const char *name) { snprintf(path, size, "%s/%s", fdir, name); }


static int same_file(const char *a, const char *b) {
    size_t na, nb;
    uint8_t *x = test_slurp(a, &na), *y = test_slurp(b, &nb);
    int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x); free(y);
    return same;
}

static int64_t file_size(const char *path) { struct stat st; return stat(path, &st) == 0 ? (int64_t)st.st_size : -1; }

// A 128-token language with some structure (each token mostly follows from the previous one).
static void write_token_file(const char *path, int64_t n, uint64_t seed) {
    uint16_t *t = (uint16_t *)malloc(2 * (size_t)n);
    if (!t) return;
    Rng r = {seed};
    int prev = 1;
    for (int64_t i = 0; i < n; i++) {
        int v = rng_uniform(&r) < 0.8f ? (31 * prev + 7) % 127 : (int)(rng_u64(&r) % 127);
        t[i] = (uint16_t)(i % 50 == 0 ? 127 : v);
        prev = t[i];
    }
    FILE *f = fopen(path, "wb");
    int32_t h[256] = {0};
    h[0] = TOKENS_MAGIC; h[1] = 1; h[2] = (int32_t)n;
    EXPECT(f && fwrite(h, 4, 256, f) == 256 && fwrite(t, 2, (size_t)n, f) == (size_t)n, "cannot write %s", path);
    if (f) fclose(f);
    free(t);
}

static void child_args(TrainArgs *a, const char *dir, const char *recipe, int64_t steps) {
    train_args_default(a);
    a->train_path = ftokens; a->val_path = ""; a->tokenizer_path = "";
    a->model = CHILD_MODEL; a->stable_embedding = 0;
    a->B = CHILD_B; a->T = CHILD_T; a->steps = steps; a->warmup = 2;
    a->recipe = recipe; a->optimizer = "adamw"; a->lr = 1e-2f;
    a->eval_every = 0; a->gen_tokens = 0; a->verbose = 0;
    a->out_dir = dir; a->ckpt_every = 1; a->resume = 1;
}

// ------------------------------------------------------------------------------------------------
// The child: BNB8_CHILD_DIR, _TOKENS, _RECIPE, _STEPS, optional _STOP (stop after that step) and
// _FSIZE (RLIMIT_FSIZE in bytes, SIGXFSZ ignored: writes past it fail with EFBIG, as on a full disk).

int test_faults_child(void) {
    const char *dir = getenv("BNB8_CHILD_DIR"), *tokens = getenv("BNB8_CHILD_TOKENS");
    const char *recipe = getenv("BNB8_CHILD_RECIPE"), *steps = getenv("BNB8_CHILD_STEPS");
    const char *stop = getenv("BNB8_CHILD_STOP"), *fsize = getenv("BNB8_CHILD_FSIZE");
    if (!dir || !tokens || !recipe || !steps) { fprintf(stderr, "test child: missing settings\n"); return 2; }
    if (fsize) {
        struct rlimit rl = {(rlim_t)strtoll(fsize, NULL, 10), (rlim_t)strtoll(fsize, NULL, 10)};
        signal(SIGXFSZ, SIG_IGN);
        if (setrlimit(RLIMIT_FSIZE, &rl) != 0) { perror("test child: setrlimit"); return 2; }
    }
    snprintf(ftokens, sizeof ftokens, "%s", tokens);
    TrainArgs a;
    child_args(&a, dir, recipe, strtoll(steps, NULL, 10));
    if (stop) a.stop_after = strtoll(stop, NULL, 10);
    if (train_run(&a, NULL) != 0) {
        fprintf(stderr, "error: %s\n", train_error_text);
        return 1;
    }
    return 0;
}

typedef struct { const char *dir, *recipe; int64_t steps, stop, fsize; const char *err; } child_spec;

// Starts the child: this program again, its stderr into c->err. Everything is prepared before the
// fork; between fork and exec only async-signal-safe calls.
static pid_t child_start(const child_spec *c) {
    static char vars[6][1100];
    snprintf(vars[0], sizeof vars[0], "BNB8_TEST_CHILD=train");
    snprintf(vars[1], sizeof vars[1], "BNB8_CHILD_DIR=%s", c->dir);
    snprintf(vars[2], sizeof vars[2], "BNB8_CHILD_TOKENS=%s", ftokens);
    snprintf(vars[3], sizeof vars[3], "BNB8_CHILD_RECIPE=%s", c->recipe);
    snprintf(vars[4], sizeof vars[4], "BNB8_CHILD_STEPS=%lld", (long long)c->steps);
    snprintf(vars[5], sizeof vars[5], "BNB8_CHILD_STOP=%lld", (long long)c->stop);
    static char fsize[64];
    snprintf(fsize, sizeof fsize, "BNB8_CHILD_FSIZE=%lld", (long long)c->fsize);
    size_t n = 0;
    while (environ[n]) n++;
    char **env = (char **)calloc(n + 9, sizeof(char *));
    if (!env) return -1;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "BNB8_CHILD_", 11) != 0 && strncmp(environ[i], "BNB8_TEST_CHILD=", 16) != 0) env[k++] = environ[i];
    for (int i = 0; i < 6; i++) if (i != 5 || c->stop > 0) env[k++] = vars[i];
    if (c->fsize > 0) env[k++] = fsize;
    env[k] = NULL;
    char *argv[2] = {(char *)"test_cpu (fault child)", NULL};
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(c->err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) { dup2(fd, 2); close(fd); }
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0) { dup2(null, 1); close(null); }
        execve("/proc/self/exe", argv, env);
        _exit(127);
    }
    free(env);
    return pid;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Waits for the child (killing it after timeout seconds): its exit code, or -signal.
static int child_wait(pid_t pid, double timeout) {
    double t0 = now_seconds();
    int status = 0;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) break;
        if (r < 0) return -1000;
        if (now_seconds() - t0 > timeout) { kill(pid, SIGKILL); waitpid(pid, &status, 0); return -2000; }
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? -WTERMSIG(status) : -1000;
}

static int child_run(const child_spec *c) {
    pid_t pid = child_start(c);
    return pid > 0 ? child_wait(pid, 300.0) : -1000;
}

static void sleep_seconds(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

// The checkpoint of step s in dir equals the reference's: the optimizer state (with every weight)
// and the trainer state.
static int same_checkpoint(const char *dir, const char *ref, int64_t s) {
    static const char *kinds[2] = {"optim", "state"};
    for (int k = 0; k < 2; k++) {
        char a[512], b[512];
        checkpoint_path(a, sizeof a, dir, kinds[k], s, ".bin");
        checkpoint_path(b, sizeof b, ref, kinds[k], s, ".bin");
        if (!same_file(a, b)) return 0;
    }
    return 1;
}

// Whether dir holds a temporary file (a write in progress: name.tmp.<pid>.<n>).
static int tmp_files(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d))) {
        found = strstr(e->d_name, ".tmp.") != NULL;
    }
    closedir(d);
    return found;
}

// Files in dir that a checkpoint write in progress leaves: *.tmp.*, or a step's files without DONE.
static int partial_files(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int partial = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *n = e->d_name;
        size_t len = strlen(n);
        if (strstr(n, ".tmp.")) { partial++; continue; }
        long long s;
        char kind[8];
        if (sscanf(n, "%5[a-z]_%lld.bin", kind, &s) == 2 && len == 18) {
            char done[512];
            checkpoint_path(done, sizeof done, dir, "DONE", s, "");
            if (file_size(done) < 0) partial++;
        }
    }
    closedir(d);
    return partial;
}

// ------------------------------------------------------------------------------------------------
// 1. SIGKILL at random points while the trainer checkpoints every step

// The scratch of a fault test called name: name_ref (the uninterrupted run), name_run (the run
// under test), both emptied, and name_child.err (the children's messages).
static void fault_paths(const char *name, char ref[256], char dir[256], char err[256]) {
    char leaf[64];
    snprintf(leaf, sizeof leaf, "%s_ref", name);
    fpath(ref, 256, leaf);
    snprintf(leaf, sizeof leaf, "%s_run", name);
    fpath(dir, 256, leaf);
    snprintf(leaf, sizeof leaf, "%s_child.err", name);
    fpath(err, 256, leaf);
    test_remove_tree(ref, 1);
    test_remove_tree(dir, 1);
}

static void kill_run(const char *recipe, int kills_wanted) {
    const int64_t N = 30;
    char ref[256], dir[256], err[256];
    fault_paths("kill", ref, dir, err);
    // The uninterrupted run: every step's checkpoint, and how long a step takes.
    child_spec c = {ref, recipe, N, 0, 0, err};
    double t0 = now_seconds();
    int rc = child_run(&c);
    double run_time = now_seconds() - t0;
    EXPECT(rc == 0 && checkpoint_latest(ref) == N, "%s reference run: exit %d, newest checkpoint %lld", recipe, rc,
           (long long)checkpoint_latest(ref));
    if (rc != 0) return;
    // Start-up of a child (exec, load the newest checkpoint) and one step with its checkpoint.
    c.dir = dir; c.steps = 2; c.stop = 0;
    t0 = now_seconds();
    rc = child_run(&c);
    double startup = now_seconds() - t0;
    EXPECT(rc == 0, "a 2-step child: exit %d", rc);
    test_remove_tree(dir, 0);
    double per_step = run_time / (double)N;
    double window = startup + 4.0 * per_step;   // kill anywhere from start-up to a few steps in
    test_rng rng = test_rng_new();
    int kills = 0, finished = 0, mid_write = 0, restarts = 0, tries = 0, checked = 0;
    int64_t max_latest = 0;
    c.steps = N;
    while (kills < kills_wanted && tries++ < 20 * kills_wanted && test_failures() == 0) {
        if (checkpoint_latest(dir) == N) { test_remove_tree(dir, 0); restarts++; }
        pid_t pid = child_start(&c);
        if (pid <= 0) { EXPECT(0, "fork failed"); break; }
        if (tries % 2) {
            sleep_seconds(test_uniform(&rng) * window);   // anywhere: start-up, a step, a write
        } else {                                           // inside a write: once a .tmp file shows
            double t0 = now_seconds();
            siginfo_t info;
            for (;;) {
                memset(&info, 0, sizeof info);   // the child exited (not reaped here): stop waiting
                if (tmp_files(dir) || now_seconds() - t0 > 10.0 * window ||
                    waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == pid)
                    break;
                sleep_seconds(0.0005);
            }
            sleep_seconds(test_uniform(&rng) * 0.002);
        }
        int killed = kill(pid, SIGKILL) == 0;
        rc = child_wait(pid, 300.0);
        if (rc == -SIGKILL && killed) kills++;
        else if (rc == 0) finished++;
        else { EXPECT(0, "child exit %d (expected a kill or a finished run)", rc); break; }
        // The newest complete checkpoint is the uninterrupted run's, bit for bit, and so is every
        // other complete one; a kill may leave the files of a checkpoint in progress, never a DONE.
        int64_t latest = checkpoint_latest(dir);
        max_latest = latest > max_latest ? latest : max_latest;
        for (int64_t s = 1; s <= latest; s++) {
            char done[512];
            checkpoint_path(done, sizeof done, dir, "DONE", s, "");
            if (file_size(done) < 0) continue;
            EXPECT(same_checkpoint(dir, ref, s), "after kill %d: checkpoint %lld differs from the uninterrupted run's",
                   kills, (long long)s);
            checked++;
        }
        mid_write += rc != 0 && partial_files(dir) > 0;
    }
    EXPECT(kills == kills_wanted, "%s: %d kills of %d (%d runs finished first)", recipe, kills, kills_wanted, finished);
    // Resume from whatever the last kill left, to the end: the final checkpoint is the reference's.
    c.steps = N;
    rc = child_run(&c);
    EXPECT(rc == 0 && checkpoint_latest(dir) == N && same_checkpoint(dir, ref, N),
           "%s: final resume: exit %d, newest %lld, same as uninterrupted: %d", recipe, rc, (long long)checkpoint_latest(dir),
           same_checkpoint(dir, ref, N));
    if (fverbose || ffull)
        printf("    %s: %d SIGKILLs (%d during a checkpoint write, leaving partial files), %d runs finished, %d "
               "restarts from scratch; %d complete checkpoints compared, all bit-identical; kill window %.0f ms "
               "(start-up %.0f ms, %.1f ms per step with its checkpoint)\n", recipe, kills, mid_write, finished,
               restarts, checked, 1e3 * window, 1e3 * startup, 1e3 * per_step);
    test_remove_tree(ref, 1);
    test_remove_tree(dir, 1);
    remove(err);
}

// The 8-bit recipe (8-bit and 32-bit states, fp32 weights) and the flash recipe (companded states, bf16
// weights with their int8 correction): every weight in the optimizer file.
static void test_kill_during_checkpoints(void) {
    kill_run("8bit", ffull ? 100 : 4);
    kill_run("flash", ffull ? 30 : 2);
}

// ------------------------------------------------------------------------------------------------
// 2. A full disk (or an unwritable file) during a checkpoint: the run stops with a message naming
//    the file, the previous checkpoint stays the newest and intact, the failed step leaves nothing,
//    and resuming later continues bit-exactly.

// The names and bytes of every file in dir, as one comparable blob.
static char *dir_snapshot(const char *dir) {
    size_t cap = 1 << 20, len = 0;
    char *out = (char *)malloc(cap);
    if (!out) return NULL;
    out[0] = 0;
    char *names[256];
    int count = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) && count < 256)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) names[count++] = strdup(e->d_name);
    if (d) closedir(d);
    for (int i = 0; i < count; i++)           // sorted: readdir's order is the file system's
        for (int j = i + 1; j < count; j++)
            if (strcmp(names[j], names[i]) < 0) { char *t = names[i]; names[i] = names[j]; names[j] = t; }
    for (int i = 0; i < count; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
            if (len + 600 < cap) len += (size_t)snprintf(out + len, cap - len, "%s (not a file)\n", names[i]);
            free(names[i]);
            continue;
        }
        size_t size = 0;
        uint8_t *data = test_slurp(path, &size);
        uint32_t h = 2166136261u;
        for (size_t k = 0; data && k < size; k++) h = (h ^ data[k]) * 16777619u;
        free(data);
        if (len + 600 < cap) len += (size_t)snprintf(out + len, cap - len, "%s %zu %08x\n", names[i], size, h);
        free(names[i]);
    }
    return out;
}

static void test_full_disk(void) {
    const int64_t K = 3, N = 6;
    char ref[256], dir[256], err[256];
    fault_paths("disk", ref, dir, err);
    // fp32: the optimizer file (weights and states, 12 bytes per parameter) is far larger than the
    // trainer state (256 bytes): a file-size limit of half the optimizer file stops it alone.
    child_spec c = {ref, "fp32", N, 0, 0, err};
    EXPECT(child_run(&c) == 0 && checkpoint_latest(ref) == N, "reference run");
    c.dir = dir; c.stop = K;
    EXPECT(child_run(&c) == 0 && checkpoint_latest(dir) == K, "first part");
    char optim[512];
    checkpoint_path(optim, sizeof optim, dir, "optim", K, ".bin");
    int64_t optim_bytes = file_size(optim);
    EXPECT(optim_bytes > 4096, "optimizer file: %lld bytes", (long long)optim_bytes);
    if (test_failures()) return;
    struct { const char *what, *blocked, *message; int64_t fsize; } faults[3] = {
        {"optimizer file hits the size limit", NULL, "disk full", optim_bytes / 2},
        {"optimizer file cannot be put in place", "optim", "cannot rename", 0},
        {"trainer state file cannot be put in place", "state", "cannot rename", 0},
    };
    for (int f = 0; f < 3; f++) {
        char *before = dir_snapshot(dir), blocked[512] = "";
        if (faults[f].blocked) {   // a directory, not empty, under the file's name: the rename fails
            char inside[600];
            checkpoint_path(blocked, sizeof blocked, dir, faults[f].blocked, K + 1, ".bin");
            snprintf(inside, sizeof inside, "%s/x", blocked);
            FILE *x = mkdir(blocked, 0700) == 0 ? fopen(inside, "wb") : NULL;
            EXPECT(x && fclose(x) == 0, "cannot make %s", inside);
            free(before);
            before = dir_snapshot(dir);
        }
        c.stop = K + 1; c.fsize = faults[f].fsize;
        int rc = child_run(&c);
        size_t n = 0;
        char *msg = (char *)test_slurp(err, &n);
        char *after = dir_snapshot(dir);
        char step_tmp[32];
        snprintf(step_tmp, sizeof step_tmp, "_%08lld", (long long)(K + 1));
        EXPECT(rc == 1, "%s: child exit %d (expected 1: a clean failure)", faults[f].what, rc);
        EXPECT(msg && strstr(msg, faults[f].message) && strstr(msg, step_tmp), "%s: message '%s'", faults[f].what,
               msg ? msg : "(none)");
        EXPECT(checkpoint_latest(dir) == K, "%s: newest checkpoint %lld", faults[f].what, (long long)checkpoint_latest(dir));
        EXPECT(before && after && strcmp(before, after) == 0, "%s: the directory changed:\n%s-- to --\n%s", faults[f].what,
               before ? before : "", after ? after : "");
        if (fverbose) printf("    %-36s -> %s", faults[f].what, msg ? msg : "(none)\n");
        free(msg); free(before); free(after);
        if (blocked[0]) test_remove_tree(blocked, 1);
        c.fsize = 0;
    }
    EXPECT(same_checkpoint(dir, ref, K), "the previous checkpoint is no longer the uninterrupted run's");
    // With space again, the run resumes from step K and ends where the uninterrupted one did.
    c.stop = 0;
    int rc = child_run(&c);
    EXPECT(rc == 0 && checkpoint_latest(dir) == N && same_checkpoint(dir, ref, N), "resume after the failures: exit %d", rc);
    test_remove_tree(ref, 1);
    test_remove_tree(dir, 1);
    remove(err);
}

// ------------------------------------------------------------------------------------------------
// 3. NaN and Inf in the gradients: the trainer skips the step (weights, optimizer state and step
//    counts unchanged), says so, and trains on. (The optimizer's own rule for non-finite elements,
//    DESIGN.md §5.2, is test_optim.c's "non-finite gradients keep params and states".)

#define NAN_STEPS 10
typedef struct {
    float *weights[NAN_STEPS + 1];   // [s]: the weights at the backward pass of step s (after step s-1)
    int64_t opt_steps[NAN_STEPS + 1];
    int inject;
} nan_record;
static nan_record nan_rec;

static void nan_hook(GPT2 *m, float *grads, bnb8_optimizer *opt, int64_t s) {
    if (s > NAN_STEPS) return;
    nan_rec.weights[s] = (float *)malloc(sizeof(float) * (size_t)m->num_parameters);
    if (nan_rec.weights[s]) memcpy(nan_rec.weights[s], m->params_memory, sizeof(float) * (size_t)m->num_parameters);
    nan_rec.opt_steps[s] = 0;
    for (int i = 0; i < bnb8_optimizer_count(opt); i++) nan_rec.opt_steps[s] += bnb8_optimizer_step_count(opt, i);
    if (!nan_rec.inject) return;
    // Step 4: one NaN in qkvw's gradient; step 7: +Inf in wte's and -Inf in a layernorm bias's.
    ParameterTensors g;
    gpt2_point_params(&g, grads, m->param_sizes);
    if (s == 4) g.qkvw[123] = NAN;
    if (s == 7) { g.wte[5] = INFINITY; g.lnfb[0] = -INFINITY; }
}

static void nan_free(void) {
    for (int s = 0; s <= NAN_STEPS; s++) free(nan_rec.weights[s]);
    memset(&nan_rec, 0, sizeof nan_rec);
}

static void test_nonfinite_gradients(void) {
    TrainArgs a;
    child_args(&a, "", "8bit", NAN_STEPS);
    a.ckpt_every = 0; a.resume = 0;
    float la[NAN_STEPS], lb[NAN_STEPS];
    TrainResult ra = {0}, rb = {0};
    ra.losses = la; rb.losses = lb;
    train_after_backward = nan_hook;
    nan_free();
    EXPECT(train_run(&a, &ra) == 0 && ra.skipped_steps == 0, "clean run: %s, %lld skipped", train_error_text,
           (long long)ra.skipped_steps);
    float *clean[NAN_STEPS + 1];
    memcpy(clean, nan_rec.weights, sizeof clean);
    memset(nan_rec.weights, 0, sizeof nan_rec.weights);
    nan_rec.inject = 1;
    EXPECT(train_run(&a, &rb) == 0, "run with NaN / Inf gradients: %s", train_error_text);
    EXPECT(rb.skipped_steps == 2, "%lld steps skipped, expected 2 (steps 4 and 7)", (long long)rb.skipped_steps);
    GPT2Config cfg;
    gpt2_config_from_descriptor(&cfg, CHILD_MODEL);
    int64_t sizes[GPT2_NUM_PARAMS], np = 0;
    gpt2_param_sizes(&cfg, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) np += sizes[i];
    size_t bytes = sizeof(float) * (size_t)np;
    for (int s = 1; s <= NAN_STEPS; s++) {
        if (!nan_rec.weights[s] || !clean[s]) { EXPECT(0, "no record of step %d", s); break; }
        if (s <= 4) {   // up to the first fault both runs are the same
            EXPECT(memcmp(nan_rec.weights[s], clean[s], bytes) == 0, "weights at step %d differ from the clean run's", s);
            EXPECT(memcmp(&la[s - 1], &lb[s - 1], 4) == 0, "loss of step %d: %g vs %g", s, (double)la[s - 1], (double)lb[s - 1]);
        }
        if (s == 5 || s == 8) {   // the step before was skipped: nothing moved, no step was counted
            EXPECT(memcmp(nan_rec.weights[s], nan_rec.weights[s - 1], bytes) == 0, "step %d was skipped but the weights changed", s - 1);
            EXPECT(nan_rec.opt_steps[s] == nan_rec.opt_steps[s - 1], "step %d was skipped but the optimizer counted %lld steps",
                   s - 1, (long long)(nan_rec.opt_steps[s] - nan_rec.opt_steps[s - 1]));
        } else if (s > 1) {
            EXPECT(memcmp(nan_rec.weights[s], nan_rec.weights[s - 1], bytes) != 0, "step %d made no update", s - 1);
        }
    }
    int finite = 1;
    for (int64_t i = 0; nan_rec.weights[NAN_STEPS] && i < np; i++) finite &= isfinite(nan_rec.weights[NAN_STEPS][i]) != 0;
    EXPECT(finite && isfinite(rb.last_loss), "the run did not stay finite (last loss %g)", (double)rb.last_loss);
    for (int s = 0; s <= NAN_STEPS; s++) free(clean[s]);
    nan_free();
    // The message, as the trainer prints it (stdout into a file for the run).
    char out[256];
    fpath(out, sizeof out, "nan_stdout.txt");
    fflush(stdout);
    int saved = dup(1), fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (saved >= 0 && fd >= 0) {
        dup2(fd, 1);
        close(fd);
        nan_rec.inject = 1;
        a.verbose = 1;
        int rc = train_run(&a, &rb);
        fflush(stdout);
        dup2(saved, 1);
        close(saved);
        size_t n;
        char *text = (char *)test_slurp(out, &n);
        EXPECT(rc == 0 && text && strstr(text, "step 4: non-finite gradient norm") && strstr(text, "step 7: non-finite") &&
               strstr(text, "update skipped") && strstr(text, "skipped  2 steps"), "the trainer's output does not say "
               "which steps it skipped");
        if (fverbose && text) {
            char *line = strstr(text, "step 4: non-finite");
            if (line) printf("    %.*s\n", (int)strcspn(line, "\n"), line);
        }
        free(text);
    } else EXPECT(0, "cannot redirect stdout");
    remove(out);
    nan_free();
    train_after_backward = NULL;
}

// ------------------------------------------------------------------------------------------------
// 4. NaN / Inf weights: a model file or checkpoint holding them is refused, naming the tensor and
//    the element; a checkpoint is never written from them (the newest stays the last good one).

// Writes a NaN into element 100 of the first record's weights (wte's, fp32: the 8bit recipe on the
// CPU) of an optimizer state file and makes the record's CRC right. 1 on success.
static int nan_weight(const char *path) {
    size_t size;
    uint8_t *d = test_slurp(path, &size);
    uint32_t name_len = 0;
    if (d && size > 28) memcpy(&name_len, d + 24, 4);
    size_t fields = 28 + name_len, data = fields + 40;   // record 0 is wte's: its fp32 weights end the payload
    int64_t n = 0;
    uint64_t bytes = 0;
    if (d && data + 4 <= size) { memcpy(&n, d + fields, 8); memcpy(&bytes, d + fields + 32, 8); }
    int ok = d && name_len == 3 && memcmp(d + 28, "wte", 3) == 0 && data + bytes + 4 <= size && bytes >= 4 * (uint64_t)n && n > 100;
    if (ok) {
        float nan = NAN;
        memcpy(d + data + bytes - 4 * (uint64_t)n + 4 * 100, &nan, 4);
        uint32_t crc = test_crc32(d + 24, data + bytes - 24);
        memcpy(d + data + bytes, &crc, 4);
        FILE *f = fopen(path, "wb");
        ok = f && fwrite(d, 1, size, f) == size;
        if (f) ok &= fclose(f) == 0;
    }
    free(d);
    return ok;
}

static void test_nonfinite_weights(void) {
    GPT2Config c;
    gpt2_config_from_descriptor(&c, "d1c16h2v64t8");
    c.stable_embedding = 1;
    GPT2 m, back;
    if (gpt2_init_random(&m, &c, 3)) { EXPECT(0, "%s", train_error_text); return; }
    char path[512], ckdir[256];
    fpath(path, sizeof path, "nan_model.bin");
    fpath(ckdir, sizeof ckdir, "nan_ckpt");
    struct { float *where; float value; const char *tensor; } cases[3] = {
        {m.params.qkvw + 17, NAN, "'qkvw' element 17"}, {m.params.lnfb + 3, INFINITY, "'lnfb' element 3"},
        {m.params.lneb + 0, -INFINITY, "'lneb' element 0"}};
    for (int k = 0; k < 3; k++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            float old = *cases[k].where;
            *cases[k].where = cases[k].value;
            EXPECT(gpt2_save(&m, path, bf16) == 0, "save: %s", train_error_text);
            train_error_text[0] = 0;
            int s = gpt2_load(&back, path);
            EXPECT(s != 0 && strstr(train_error_text, path) && strstr(train_error_text, cases[k].tensor),
                   "%s (%s file): load gave %d, '%s'", cases[k].tensor, bf16 ? "bf16" : "fp32", s, train_error_text);
            if (s == 0) gpt2_free(&back);
            if (fverbose && !bf16) printf("    %s\n", train_error_text);
            // checkpoint_save refuses, and writes nothing
            test_remove_tree(ckdir, 1);
            EXPECT(mkdir(ckdir, 0700) == 0, "mkdir %s", ckdir);
            TrainerState st = {5, 0, 1, 4, 1, 0, 1, 10, 1, 1, 0, 1, 4, STATE_VERSION, m.config, 5, CLIP_EXACT, NAN, .train_tokens = 0};
            train_error_text[0] = 0;
            s = checkpoint_save(ckdir, m.params_memory, NULL, &st, NULL);
            char *listing = dir_snapshot(ckdir);
            EXPECT(s != 0 && strstr(train_error_text, "not finite") && strstr(train_error_text, cases[k].tensor) &&
                   listing && listing[0] == 0, "checkpoint_save of %s: %d, '%s', files '%s'", cases[k].tensor, s,
                   train_error_text, listing ? listing : "");
            free(listing);
            *cases[k].where = old;
        }
    EXPECT(gpt2_save(&m, path, 0) == 0 && gpt2_load(&back, path) == 0, "a finite model: %s", train_error_text);
    gpt2_free(&back);
    gpt2_free(&m);
    remove(path);
    test_remove_tree(ckdir, 1);
    // A checkpoint whose optimizer file was given a NaN weight after it was written (its CRC made
    // right, its trainer state's digest too): resume falls back to the checkpoint before; with that one damaged too, it is refused,
    // naming the newest's file, the tensor and the element.
    char dir[256], err[256];
    fpath(dir, sizeof dir, "nan_resume");
    fpath(err, sizeof err, "nan_child.err");
    for (int both = 0; both < 2; both++) {
        test_remove_tree(dir, 1);
        TrainArgs a;
        child_args(&a, dir, "8bit", 4);
        a.stop_after = 2;
        EXPECT(train_run(&a, NULL) == 0 && checkpoint_latest(dir) == 2, "first part: %s", train_error_text);
        for (int64_t s = 2 - both; s <= 2; s++) {   // the trainer state bound to the changed file again
            TrainerState st;
            char state[512];
            checkpoint_path(path, sizeof path, dir, "optim", s, ".bin");
            checkpoint_path(state, sizeof state, dir, "state", s, ".bin");
            EXPECT(nan_weight(path), "%s does not parse as a state file whose first record is wte", path);
            EXPECT(state_load(&st, state) == 0 && checkpoint_state_save(dir, &st, 0) == 0, "rebinding %s: %s", state,
                   train_error_text);
        }
        a.stop_after = 0;
        train_error_text[0] = 0;
        TrainResult r = {0};
        int rc = train_run(&a, &r);
        if (!both)
            EXPECT(rc == 0 && r.first_step == 2 && r.last_step == 4, "resume past a checkpoint with a NaN weight: %d, "
                   "steps %lld..%lld, '%s'", rc, (long long)r.first_step, (long long)r.last_step, train_error_text);
        else
            EXPECT(rc != 0 && strstr(train_error_text, path) && strstr(train_error_text, "'wte' element 100") &&
                   strstr(train_error_text, "no earlier"), "resume from two checkpoints with a NaN weight: '%s'", train_error_text);
    }
    test_remove_tree(dir, 1);
    remove(err);
}

// The softmax of logits holding NaN (a positive NaN got past exp_nonpositive's clamp into an
// undefined float-to-int conversion; found by fuzz_model): the NaN comes out, nothing else breaks.
static void test_nonfinite_logits(void) {
    float logits[3][64];
    float losses[3];
    int targets[3] = {1, 2, 3};
    uint32_t qnan = 0x7fc00000u, snan_neg = 0xffc00001u;
    for (int r = 0; r < 3; r++)
        for (int i = 0; i < 64; i++) logits[r][i] = 0.01f * (float)(i - 30);
    memcpy(&logits[0][7], &qnan, 4);           // positive NaN
    memcpy(&logits[1][9], &snan_neg, 4);       // negative NaN: clamped to -87 like -inf (probability ~0)
    logits[2][0] = INFINITY;                   // +Inf: the max; Inf - Inf = NaN
    gpt2_softmax_forward(&logits[0][0], losses, targets, 3, 60, 64);
    EXPECT(isnan(losses[0]) && !isfinite(losses[2]), "losses %g, %g, expected NaN and non-finite", (double)losses[0],
           (double)losses[2]);
    float e = gpt2_exp_nonpositive(bnb8_bits_f32(qnan));
    EXPECT(isnan(e), "gpt2_exp_nonpositive(+NaN) = %g, expected NaN", (double)e);
    EXPECT(gpt2_exp_nonpositive(0.0f) == 1.0f && gpt2_exp_nonpositive(-INFINITY) < 1e-37f, "exp_nonpositive at 0 and -inf");
}

// ------------------------------------------------------------------------------------------------
// 5. Sizes at and past the API's limits (test_quant.c and test_state.c check NULL, negative sizes,
//    dtypes and block sizes), and regressions of what the fuzzers found in the state file loader.

static uint32_t crc32_of(const uint8_t *p, size_t len) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < len; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return ~c;
}

static void test_api_limits(void) {
    const int64_t too_big[3] = {BNB8_MAX_ELEMENTS + 1, INT64_MAX - 10, INT64_MAX};
    float code[256], x[64] = {0}, absmax[2], absmax2[2], mean, out[64];
    uint8_t q[64], q2[2];
    int64_t nonfinite;
    bnb8_map_dynamic(1, code);
    bnb8_optimizer *opt = NULL;
    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, NULL) == 0, "create: %s", bnb8_last_error());
    if (!opt) return;
    for (int k = 0; k < 3; k++) {
        int64_t n = too_big[k];
        struct { const char *what; int status; } calls[8] = {
            {"quantize", bnb8_quantize_blockwise(x, BNB8_F32, n, code, 64, q, absmax)},
            {"quantize_ex", bnb8_quantize_blockwise_ex(x, BNB8_F32, n, code, 4096, q, absmax, &nonfinite)},
            {"dequantize", bnb8_dequantize_blockwise(q, absmax, n, code, 64, out, BNB8_F16)},
            {"nest_absmax", bnb8_nest_absmax(absmax, n, 64, q2, absmax2, &mean)},
            {"unnest_absmax", bnb8_unnest_absmax(q2, absmax2, 0.0f, n, 64, absmax)},
            {"map_quantile", bnb8_map_quantile(x, n, code)},
            {"optimizer_add", bnb8_optimizer_add(opt, "w", x, BNB8_F32, out, BNB8_F32, n, NULL)},
            {"optimizer_add bf16", bnb8_optimizer_add(opt, "w", x, BNB8_BF16, out, BNB8_F16, n, NULL)},
        };
        for (int i = 0; i < 8; i++)
            EXPECT(calls[i].status == BNB8_ERR_SIZE, "%s with n = %lld: status %d (%s)", calls[i].what, (long long)n,
                   calls[i].status, bnb8_last_error());
    }
    EXPECT(bnb8_optimizer_count(opt) == 0, "a refused add registered a tensor");
    // Names: up to BNB8_MAX_NAME bytes, which the state file holds; one byte more is refused at add,
    // since its file could not be loaded back.
    char *name = (char *)malloc(BNB8_MAX_NAME + 2);
    memset(name, 'n', BNB8_MAX_NAME + 1);
    name[BNB8_MAX_NAME + 1] = 0;
    float p[100] = {0}, g[100];
    for (int i = 0; i < 100; i++) g[i] = 0.01f * (float)(i % 9 - 4);
    EXPECT(bnb8_optimizer_add(opt, name, p, BNB8_F32, g, BNB8_F32, 100, NULL) == BNB8_ERR_ARG &&
           strstr(bnb8_last_error(), "4097"), "a name of 4097 bytes: '%s'", bnb8_last_error());
    name[BNB8_MAX_NAME] = 0;
    char path[256];
    fpath(path, sizeof path, "limits.bin");
    EXPECT(bnb8_optimizer_add(opt, name, p, BNB8_F32, g, BNB8_F32, 100, NULL) == 0 && bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0 &&
           bnb8_optimizer_save(opt, path) == 0 && bnb8_optimizer_load(opt, path) == 0, "a name of 4096 bytes: %s", bnb8_last_error());
    free(name);
    bnb8_optimizer_free(opt);
    // A state file whose step count is forged (CRC made right): counts that stepping would
    // overflow are refused. (The record: u32 name length, name, i64 n, u32 format, u32 states,
    // i64 block, i64 step, ...)
    opt = NULL;
    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, NULL) == 0 && bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, BNB8_F32, 100, NULL) == 0 &&
           bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0 && bnb8_optimizer_save(opt, path) == 0, "%s", bnb8_last_error());
    size_t size;
    uint8_t *file = test_slurp(path, &size);
    const size_t rec = 24, step_at = rec + 4 + 1 + 8 + 4 + 4 + 8, bytes_at = step_at + 8;
    uint64_t bytes = 0;
    if (file && size > bytes_at + 8) memcpy(&bytes, file + bytes_at, 8);
    const size_t crc_at = bytes_at + 8 + (size_t)bytes;
    EXPECT(file && file[rec] == 1 && file[rec + 4] == 'w' && crc_at + 4 == size, "unexpected state file layout");
    if (file && crc_at + 4 == size) {
        const int64_t steps[4] = {INT64_MAX, INT64_MAX - 1, BNB8_MAX_ELEMENTS + 1, 7};
        for (int k = 0; k < 4; k++) {
            memcpy(file + step_at, &steps[k], 8);
            uint32_t c = crc32_of(file + rec, crc_at - rec);
            memcpy(file + crc_at, &c, 4);
            char forged[256];
            fpath(forged, sizeof forged, "limits_forged.bin");
            FILE *f = fopen(forged, "wb");
            if (f) { fwrite(file, 1, size, f); fclose(f); }
            int s = bnb8_optimizer_load(opt, forged);
            if (k < 3) EXPECT(s == BNB8_ERR_FORMAT && strstr(bnb8_last_error(), "step count"), "step count %lld: %d '%s'",
                              (long long)steps[k], s, bnb8_last_error());
            else EXPECT(s == 0 && bnb8_optimizer_step_count(opt, 0) == 7 && bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0,
                        "step count 7: %d '%s'", s, bnb8_last_error());
            remove(forged);
        }
    }
    free(file);
    bnb8_optimizer_free(opt);
    // A tensor without any state (SGD without momentum): its record is empty, and loads.
    bnb8_config c = bnb8_config_default(BNB8_SGD);
    c.momentum = 0.0f;
    opt = NULL;
    EXPECT(bnb8_optimizer_create(&opt, BNB8_SGD, &c) == 0 && bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, BNB8_F32, 100, NULL) == 0 &&
           bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0 && bnb8_optimizer_save(opt, path) == 0 &&
           bnb8_optimizer_load(opt, path) == 0 && bnb8_optimizer_step_count(opt, 0) == 1, "stateless SGD: %s", bnb8_last_error());
    bnb8_optimizer_free(opt);
    remove(path);
}

// ------------------------------------------------------------------------------------------------

// ------------------------------------------------------------------------------------------------
// 5. The checkpoint directory's rules: a fresh run into a directory with
//    checkpoints is refused; one directory, one run (a lock); files of different checkpoints are
//    found (and resume falls back past them); steps past 10^8 are found; -o paths longer than the old
//    1024-byte buffers work, longer than the limit are refused; an unwritable -o is found at start.

static void copy_file(const char *from, const char *to) {
    size_t n;
    uint8_t *d = test_slurp(from, &n);
    FILE *f = d ? fopen(to, "wb") : NULL;
    EXPECT(f && fwrite(d, 1, n, f) == n, "cannot copy %s to %s", from, to);
    if (f) fclose(f);
    free(d);
}

static void test_checkpoint_dir_rules(void) {
    char dir[256], path[TRAIN_PATH_MAX], other[TRAIN_PATH_MAX];
    fpath(dir, sizeof dir, "rules");
    test_remove_tree(dir, 1);
    TrainArgs a;
    child_args(&a, dir, "8bit", 3);
    a.resume = 0; a.stop_after = 2;
    EXPECT(train_run(&a, NULL) == 0 && checkpoint_latest(dir) == 2, "first run: %s", train_error_text);
    // A fresh run (no -y 1) would overwrite them step by step: refused, nothing changed.
    char *before = dir_snapshot(dir);
    train_error_text[0] = 0;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "-y 1") && strstr(train_error_text, dir),
           "a fresh run into a directory with checkpoints: '%s'", train_error_text);
    char *after = dir_snapshot(dir);
    EXPECT(before && after && strcmp(before, after) == 0, "the refused fresh run changed the directory");
    if (fverbose) printf("    fresh run into checkpoints -> %s\n", train_error_text);
    free(before); free(after);
    // One directory, one run: while a run holds it, a second is refused at start.
    a.resume = 1; a.stop_after = 0;
    Trainer t;
    EXPECT(trainer_open(&t, &a) == 0, "open: %s", train_error_text);
    train_error_text[0] = 0;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "in use"), "a second run on the same -o: '%s'", train_error_text);
    if (fverbose) printf("    second run -> %s\n", train_error_text);
    trainer_free(&t);
    // Files of different checkpoints: step 1's optimizer file as step 2's. Resume falls back to step
    // 1 and goes on; with step 1 gone too, the mix is refused, named.
    checkpoint_path(path, sizeof path, dir, "optim", 1, ".bin");
    checkpoint_path(other, sizeof other, dir, "optim", 2, ".bin");
    copy_file(path, other);
    TrainResult r = {0};
    EXPECT(train_run(&a, &r) == 0 && r.first_step == 2 && checkpoint_latest(dir) == 3, "resume past a mixed checkpoint: %s, "
           "steps %lld..", train_error_text, (long long)r.first_step);
    checkpoint_path(path, sizeof path, dir, "optim", 2, ".bin");
    checkpoint_path(other, sizeof other, dir, "optim", 3, ".bin");
    copy_file(path, other);
    checkpoint_path(path, sizeof path, dir, "DONE", 2, "");
    remove(path);
    checkpoint_path(path, sizeof path, dir, "DONE", 1, "");
    remove(path);
    a.steps = 4;
    train_error_text[0] = 0;
    EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "different checkpoints") && strstr(train_error_text, other),
           "a mixed checkpoint with none before it: '%s'", train_error_text);
    if (fverbose) printf("    mixed steps -> %s\n", train_error_text);
    test_remove_tree(dir, 0);
    // Steps past 10^8: the names checkpoint_path writes are the ones resume finds.
    int64_t steps[3] = {99999999, 100000000, 1099511627776};
    for (int k = 0; k < 3; k++) {
        checkpoint_path(path, sizeof path, dir, "DONE", steps[k], "");
        FILE *f = fopen(path, "wb");
        if (f) fclose(f);
        EXPECT(checkpoint_latest(dir) == steps[k], "DONE of step %lld: newest %lld", (long long)steps[k],
               (long long)checkpoint_latest(dir));
        const char *leaf = strrchr(path, '/') + 1;
        EXPECT(checkpoint_done_step(leaf) == steps[k], "%s read as step %lld", leaf, (long long)checkpoint_done_step(leaf));
    }
    const char *not_done[] = {"DONE_000000009", "DONE_0000001", "DONE_1234567x", "DONE_00000001.tmp", "DONE_+0000001"};
    for (size_t k = 0; k < sizeof not_done / sizeof not_done[0]; k++)
        EXPECT(checkpoint_done_step(not_done[k]) == 0, "%s read as step %lld", not_done[k], (long long)checkpoint_done_step(not_done[k]));
    test_remove_tree(dir, 1);
    // -o of 1400 bytes (7 directories of 200 characters) works: its checkpoint resumes; 4100 refused.
    char deep[TRAIN_PATH_MAX];
    snprintf(deep, sizeof deep, "%s", dir);
    mkdir(deep, 0700);
    for (int k = 0; k < 7; k++) {
        size_t len = strlen(deep);
        deep[len] = '/';
        memset(deep + len + 1, 'a' + k, 200);
        deep[len + 201] = 0;
        if (k < 6) EXPECT(mkdir(deep, 0700) == 0, "mkdir of a %zu-byte path", strlen(deep));
    }
    child_args(&a, deep, "8bit", 2);
    a.stop_after = 1;
    EXPECT(train_run(&a, NULL) == 0 && checkpoint_latest(deep) == 1, "-o of %zu bytes: %s", strlen(deep), train_error_text);
    a.stop_after = 0;
    r.first_step = 0;
    EXPECT(train_run(&a, &r) == 0 && r.first_step == 2, "resume in -o of %zu bytes: %s", strlen(deep), train_error_text);
    char *longer = (char *)malloc(5000);
    if (longer) {
        snprintf(longer, 5000, "%s/", deep);
        size_t len = strlen(longer);
        memset(longer + len, 'z', 4100 - len);
        longer[4100] = 0;
        child_args(&a, longer, "8bit", 2);
        train_error_text[0] = 0;
        EXPECT(train_run(&a, NULL) != 0 && strstr(train_error_text, "at most"), "-o of 4100 bytes: '%s'", train_error_text);
        free(longer);
    }
    test_remove_tree(dir, 1);
    // An -o that cannot be written: found before training (root writes anywhere chmod allows not:
    // /proc/self is a directory no one can create files in).
    const char *locked = dir;
    mkdir(dir, 0500);
    if (geteuid() == 0) locked = "/proc/self";
    child_args(&a, locked, "8bit", 2);
    a.resume = 0;
    train_error_text[0] = 0;
    TrainResult none = {0};
    EXPECT(train_run(&a, &none) != 0 && strstr(train_error_text, "cannot write") && none.last_step == 0,
           "unwritable -o %s: '%s'", locked, train_error_text);
    if (fverbose) printf("    unwritable -o -> %s\n", train_error_text);
    chmod(dir, 0700);
    test_remove_tree(dir, 1);
}

void tests_faults(void) {
    const char *v = getenv("BNB8_TEST_VERBOSE"), *full = getenv("BNB8_TEST_FULL");
    fverbose = v && *v && *v != '0';
    ffull = full && *full && *full != '0';
    snprintf(fdir, sizeof fdir, "/tmp/bnb8_faults_XXXXXX");
    if (!mkdtemp(fdir)) { printf("test_faults: mkdtemp failed\n"); return; }
    fpath(ftokens, sizeof ftokens, "tokens.bin");
    write_token_file(ftokens, 20000, 5);
    test_run(ffull ? "faults: 100 + 30 SIGKILLs during checkpoint writes (8bit, flash); resume is bit-exact"
                   : "faults: SIGKILLs during checkpoint writes (8bit, flash); resume is bit-exact",
             test_kill_during_checkpoints);
    test_run("faults: full disk during a save: clean failure, the previous checkpoint kept", test_full_disk);
    test_run("faults: NaN/Inf gradients: the trainer skips the step and says so", test_nonfinite_gradients);
    test_run("faults: NaN/Inf weights are refused at load and never checkpointed; resume falls back past them",
             test_nonfinite_weights);
    test_run("faults: NaN logits give a NaN loss (no undefined conversion)", test_nonfinite_logits);
    test_run("faults: checkpoint directories: fresh runs, one run at a time, mixed steps, long paths, steps >= 1e8, "
             "unwritable", test_checkpoint_dir_rules);
    test_run("faults: sizes past 2^52, 4097-byte names, forged step counts", test_api_limits);
    test_remove_tree(fdir, 1);
}

// The trainer's command line is test_train.c's to test; named here so that this copy of it does not
// warn as unused.
void test_faults_unused(void);
void test_faults_unused(void) { (void)usage; (void)parse_args; (void)apply_gpu_defaults; }
