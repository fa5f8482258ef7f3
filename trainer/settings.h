/*
trainer/settings.h — what a run is asked to do: the recipes, optimizers and scale dtypes it offers
(tables of rows that drive both devices), the command line (flags, defaults, usage), the learning
rate schedule, and the check of a run's settings. Apart from the run so that a new recipe or flag is
one row or one case here, read by the tests without running anything.
*/
#ifndef TRAINER_SETTINGS_H
#define TRAINER_SETTINGS_H

#include "trainer.h"

extern const Recipe recipes[];
extern const int num_recipes;
int find_recipe(const char *name);   // index, or -1
#define RECIPE_NAMES "fp32, 8bit, 8bit-int8, flash, 8bit-sr, 4bit-int8, 4bit-sr, 8bit-rn, 4bit-rn"

extern const OptimizerChoice optimizers[];
extern const int num_optimizers;
int find_optimizer(const char *name);

extern const ScaleDtype scale_dtypes[];
extern const int num_scale_dtypes;
int find_scale_dtype(const char *name);

extern const char *const clip_rule_names[3];   // -N's values: "exact", "prev", "est"

#define DEFAULT_DATA_DIR "dev/data/fortunes/"
#define DEFAULT_GEN_TOKENS 48   // -G left out: tokens per sample, or T - 1 when less

void train_args_default(TrainArgs *a);
// 0 (run), 1 (-h: print usage) or -1 (bad flag: message in train_error_text). given[c] is set for
// each flag -c on the command line, and so is a->given[c] (a resumed run reads it).
int parse_args(int argc, char **argv, TrainArgs *a, char given[128]);
// On the GPU, the flags left out take the GPU's defaults (d12, flash + release, B=16, T=1024, ...).
void apply_gpu_defaults(TrainArgs *a, const char given[128]);
void usage(FILE *f);
// A bad command line: the error (train_error_text) and a line that says where the flags are, not the
// whole usage text, which would scroll the error away. main exits 1 after it.
void print_flag_error(FILE *f, const char *program);
// Learning rate of step s (1-based): linear warm-up, then cosine from lr to final_lr_frac * lr.
float lr_schedule(const TrainArgs *a, float lr, int64_t s);

// What a run keeps, from the recipe, the device and -P (the one place they meet).
Layout run_layout(const Recipe *r, int on_gpu, int parity);
const char *dtype_name(bnb8_dtype d);   // "fp32", "bf16", "fp16"
// The settings of t->a checked and turned into the run's: its recipe, optimizer, learning rate and
// decay, layout on the device chosen (on_gpu), scale dtype and clipping rule.
int check_settings(Trainer *t, int on_gpu);

#endif // TRAINER_SETTINGS_H
