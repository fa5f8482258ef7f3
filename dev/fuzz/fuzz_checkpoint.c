/*
fuzz_checkpoint.c — libFuzzer harness for the trainer's checkpoint directory: the scan for the
newest complete checkpoint (checkpoint_latest) and resuming from it (train_run with -y 1: the
trainer state file, the optimizer state file with every weight, or in the older layout of trainer
state version 1 the model file beside them, and the checks between them).

Input: an archive of directory entries, each [u8 kind][u8 step][u16 length, little-endian][bytes]:
  kind % 8 = 0 DONE_<step>, 1 model_<step>.bin, 2 optim_<step>.bin, 3 state_<step>.bin (the bytes
  are the file), 4 a file whose name is the bytes (letters, digits, '_' and '.' kept), 5 a leftover
  temporary <model|optim|state>_<step>.bin.tmp (odd steps: .bin.tmp.4242.0, bnb8_write_atomically's form), 6 DONE_<u32 of the bytes, at least 8 digits>, 7 a directory
  DONE_<step>.
The harness makes that directory, checks checkpoint_latest against its own reading of the names,
then resumes to one step past it (-x; B, T, recipe and optimizer as the trainer state file says, when
they are sane; -n and the other flags the trainer state records left out) on a fixed tokens file. A resume that works must start from a complete checkpoint (the
newest, or an earlier one when the newer are damaged) and leave a complete checkpoint one step on.
*/
#define _POSIX_C_SOURCE 200809L
#include "../../trainer/trainer.h"
#include "../../trainer/settings.h"
#include "../../trainer/checkpoint.h"
#include <sys/stat.h>
#include "fuzz_util.h"
#include "../../test/test.h"

static char tokens_path[256];


static void put_file(const char *dir, const char *name, const uint8_t *data, size_t size) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return;                  // e.g. a name that is already a directory
    if (size) fwrite(data, 1, size, f);
    fclose(f);
}

// The step a DONE marker names: "DONE_" and at least 8 digits without extra leading zeros, at
// most 13 (the trainer's rule, written again), else 0.
static int64_t done_step(const char *name) {
    size_t len = strlen(name);
    if (strncmp(name, "DONE_", 5) != 0 || len < 13 || len > 18 || (len > 13 && name[5] == '0')) return 0;
    int64_t v = 0;
    for (size_t i = 5; i < len; i++) {
        if (name[i] < '0' || name[i] > '9') return 0;
        v = 10 * v + (name[i] - '0');
    }
    return v;
}

// The tokens of the seeds' runs and of every resume (a resume on other tokens is refused): 4096 of a
// 16-token vocabulary, the harness's model's. Returns the file's path.
static const char *write_tokens(const char *name) {
    static uint8_t tokens[1024 + 2 * 4096];
    int32_t h[3] = {TOKENS_MAGIC, 1, 4096};
    memcpy(tokens, h, sizeof h);
    for (int i = 0; i < 4096; i++) { uint16_t t = (uint16_t)(i * 7 % 16); memcpy(tokens + 1024 + 2 * i, &t, 2); }
    return fuzz_write_file(name, tokens, sizeof tokens);
}

// Appends one archive entry.
static size_t pack(uint8_t *out, size_t at, int kind, int step, const uint8_t *bytes, size_t len) {
    out[at] = (uint8_t)kind; out[at + 1] = (uint8_t)step;
    out[at + 2] = (uint8_t)(len & 255); out[at + 3] = (uint8_t)(len >> 8);
    if (len) memcpy(out + at + 4, bytes, len);
    return at + 4 + len;
}

static size_t pack_file(uint8_t *out, size_t at, const char *dir, int kind, int step) {
    static const char *kinds[4] = {"DONE", "model", "optim", "state"};
    char path[512];
    checkpoint_path(path, sizeof path, dir, kinds[kind], step, kind ? ".bin" : "");
    size_t size;
    uint8_t *d = fuzz_slurp(path, &size);
    if (!d || size > 65535) { fprintf(stderr, "seed: %s missing or too big\n", path); exit(1); }
    at = pack(out, at, kind, step, d, size);
    free(d);
    return at;
}

// Seeds: the checkpoints of real runs of a tiny model stopped at step 3 of 6 (every step
// checkpointed), as a whole, with the newest one incomplete, and with leftovers and stray names. (No
// model files: the trainer writes none since trainer state version 2; the fuzzer reaches the older
// layout by mutation.)
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    const char *seeds = getenv("FUZZ_WRITE_SEEDS");
    if (!seeds) return 0;
    static const struct { const char *recipe, *optimizer; int stable; int64_t B, T; } runs[4] = {
        {"8bit", "adamw", 1, 1, 4}, {"fp32", "lion", 0, 2, 3}, {"8bit", "sgd", 0, 1, 8}, {"flash", "adamw", 0, 1, 4}};
    char tok[256], dir[256];
    snprintf(tok, sizeof tok, "%s", write_tokens("seed_tokens.bin"));
    snprintf(dir, sizeof dir, "%s", fuzz_path("seed_ckpt"));
    uint8_t *out = (uint8_t *)malloc(1 << 20);
    if (!out) exit(1);
    for (int r = 0; r < 4; r++) {
        test_remove_tree(dir, 1);
        TrainArgs a;
        train_args_default(&a);
        a.train_path = tok; a.val_path = ""; a.tokenizer_path = ""; a.model = "d1c8h1v16t8";
        a.out_dir = dir; a.steps = 6; a.stop_after = 3; a.ckpt_every = 1; a.B = runs[r].B; a.T = runs[r].T;
        a.recipe = runs[r].recipe; a.optimizer = runs[r].optimizer; a.stable_embedding = runs[r].stable;
        a.eval_every = 0; a.gen_tokens = 0; a.verbose = 0;
        if (train_run(&a, NULL)) { fprintf(stderr, "seed run: %s\n", train_error_text); exit(1); }
        for (int variant = 0; variant < 3; variant++) {
            size_t at = 0;
            for (int step = 1; step <= 3; step++)
                for (int kind = 2; kind <= 4; kind++) {
                    if (kind == 4 && step == 3 && variant == 1) continue;     // newest without DONE
                    at = pack_file(out, at, dir, kind % 4, step);
                }
            if (variant == 2) {
                at = pack(out, at, 5, 4, (const uint8_t *)"partial", 7);        // a leftover .tmp
                at = pack(out, at, 4, 0, (const uint8_t *)"DONE_0000004x", 13);  // a stray name
                at = pack(out, at, 4, 0, (const uint8_t *)"DONE_000000009", 14);
            }
            char name[64];
            snprintf(name, sizeof name, "run%d_variant%d", r, variant);
            fuzz_put_seed(seeds, name, out, at);
        }
    }
    test_remove_tree(dir, 1);
    remove(tok);
    free(out);
    exit(0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!tokens_path[0]) snprintf(tokens_path, sizeof tokens_path, "%s", write_tokens("tokens.bin"));
    char dir[256];
    snprintf(dir, sizeof dir, "%s", fuzz_path("ckpt"));
    test_remove_tree(dir, 1);
    if (mkdir(dir, 0700) != 0) { fprintf(stderr, "cannot make %s\n", dir); abort(); }

    int64_t expected = 0;
    size_t at = 0;
    while (at + 4 <= size) {
        int kind = data[at] % 8, step = data[at + 1];
        size_t len = (size_t)data[at + 2] | (size_t)data[at + 3] << 8;
        at += 4;
        if (len > size - at) len = size - at;
        const uint8_t *bytes = data + at;
        at += len;
        char name[64];
        static const char *kinds[3] = {"model", "optim", "state"};
        switch (kind) {
        case 0: snprintf(name, sizeof name, "DONE_%08d", step); break;
        case 1: case 2: case 3: snprintf(name, sizeof name, "%s_%08d.bin", kinds[kind - 1], step); break;
        case 4: {
            size_t k = 0;
            for (size_t i = 0; i < len && k < 40; i++) {
                char ch = (char)bytes[i];
                if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '.')
                    name[k++] = ch;
            }
            name[k] = 0;
            if (k == 0 || strcmp(name, ".") == 0 || strcmp(name, "..") == 0) continue;
            len = 0;
            break;
        }
        case 5: snprintf(name, sizeof name, "%s_%08d.bin.tmp%s", kinds[step % 3], step, step & 1 ? ".4242.0" : ""); break;
        case 6: {
            uint32_t v = 0;
            memcpy(&v, bytes, len < 4 ? len : 4);
            snprintf(name, sizeof name, "DONE_%08u", v);   // up to 10 digits: steps past 10^8 too
            len = 0;
            break;
        }
        default: {
            snprintf(name, sizeof name, "DONE_%08d", step);
            char path[512];
            snprintf(path, sizeof path, "%s/%s", dir, name);
            mkdir(path, 0700);
            int64_t v = done_step(name);
            struct stat st;
            if (stat(path, &st) == 0 && v > expected) expected = v;
            continue;
        }
        }
        put_file(dir, name, bytes, len);
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, name);
        struct stat st;
        int64_t v = done_step(name);
        if (stat(path, &st) == 0 && v > expected) expected = v;
    }

    int64_t latest = checkpoint_latest(dir);
    if (latest != expected) {
        fprintf(stderr, "checkpoint_latest = %lld, the names say %lld\n", (long long)latest, (long long)expected);
        abort();
    }
    if (latest > 0) {
        TrainArgs a;
        train_args_default(&a);
        a.train_path = tokens_path; a.val_path = ""; a.tokenizer_path = "";
        a.model = "d1c8h1v16t8";
        a.out_dir = dir; a.resume = 1; a.stop_after = latest + 1;   // -n left out: the checkpoint's
        a.B = 1; a.T = 4; a.eval_every = 0; a.gen_tokens = 0; a.verbose = 0;
        // Settings as the trainer state file says, when they are small and known: the resume then
        // gets past the settings check to the model and optimizer files. (Words 0..15 mean the same
        // in both versions.)
        char path[512];
        checkpoint_path(path, sizeof path, dir, "state", latest, ".bin");
        FILE *f = fopen(path, "rb");
        int64_t w[16];
        if (f && fread(w, sizeof w, 1, f) == 1) {
            if (w[5] >= 1 && w[6] >= 1 && w[5] <= 4 && w[6] <= 16) { a.B = w[5]; a.T = w[6]; }
            if (w[7] >= 0 && w[7] < num_recipes) a.recipe = recipes[w[7]].name;
            if (w[8] >= 0 && w[8] < num_optimizers) a.optimizer = optimizers[w[8]].name;
        }
        if (f) fclose(f);
        train_error_text[0] = 0;
        TrainResult r = {0};
        int rc = train_run(&a, &r);
        if (getenv("FUZZ_DEBUG"))   // FUZZ_DEBUG=1 ./fuzz_checkpoint input...: what each resume did
            fprintf(stderr, "checkpoint %lld, %s %s B=%lld T=%lld: %s\n", (long long)latest, a.recipe, a.optimizer,
                    (long long)a.B, (long long)a.T, rc ? train_error_text : "resumed");
        if (rc == 0) {   // from the newest complete checkpoint, or one before it when that one is damaged,
                         // to -x or to the -n of the checkpoint it resumed, when that comes first
            char done[512], last[512];
            checkpoint_path(done, sizeof done, dir, "DONE", r.first_step - 1, "");
            checkpoint_path(last, sizeof last, dir, "DONE", r.last_step, "");
            struct stat st;
            int64_t newest = r.last_step > latest ? r.last_step : latest;
            if (r.first_step < 2 || r.first_step > latest + 1 || r.last_step < r.first_step || r.last_step > latest + 1 ||
                stat(done, &st) != 0 || stat(last, &st) != 0 || checkpoint_latest(dir) != newest) {
                fprintf(stderr, "resumed steps %lld..%lld from checkpoint %lld; newest now %lld\n", (long long)r.first_step,
                        (long long)r.last_step, (long long)latest, (long long)checkpoint_latest(dir));
                abort();
            }
        } else if (!train_error_text[0]) {
            fprintf(stderr, "a failed resume left no message\n");
            abort();
        }
    }
    test_remove_tree(dir, 1);
    return 0;
}
