# Builds the CPU reference trainer, the CUDA trainer, the tests and the kernel benchmarks.
# Detected, never required: nvcc (without it the CUDA targets are skipped with a message), MPI
# (mpicxx / mpicc --showme: train_gpt_cpu and train_gpt become multi-process trainers for mpirun)
# and NCCL (nccl.h + libnccl under NCCL_HOME, the CUDA toolkit, or a Python wheel's nvidia/nccl;
# train_gpt uses it only together with MPI, which bootstraps it). Without them both trainers are
# single-process programs that refuse to run as N copies under mpirun.
#   make ... USE_MPI=0        build without MPI even where it is installed
#   make train_gpt_cpu        CPU reference build (g++, OpenMP, fp32)
#   make train_gpt            CUDA build: for the local GPU(s) when nvidia-smi sees one, else one fat binary for
#                             sm_80 sm_86 sm_89 sm_90a (+ PTX of sm_80: it runs on any newer card);
#                             GPU_ARCH=sm_86 (or a list: GPU_ARCH="sm_80 sm_89") to choose;
#                             PRECISION=fp16 the fp16 build (loss scaling) for cards without bf16:
#                             make train_gpt PRECISION=fp16 GPU_ARCH=sm_75 (T4, RTX 20xx)
#   make test                 CPU tests + compile checks of every CUDA target (what CI runs)
#   make fuzz                 seeded mutation fuzz of the shard and checkpoint readers (ASan+UBSan)
#   make reference            regenerate test/data/ref_*.bin with PyTorch (scripts/reference.mk)
#   make tools                the Python tools' venv (.venv-tools/: export_hf, plot, BPE; scripts/tools.mk)
CXX       ?= g++
CXXFLAGS  ?= -O3 -march=native
CXXFLAGS  += -std=c++17 -fopenmp -Wall -Wextra -Wno-comment -I.
NVCC      ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
# The cards: GPU_ARCH is a list of sm_XX (SASS for that card) or compute_XX (PTX only: the driver
# compiles it for whatever card runs it, as the device check does for sm_80 code on an H200).
# Default: the local GPUs' compute capabilities (Hopper as sm_90a: wgmma / setmaxnreg available),
# else the cards our users rent or own: A100 (sm_80), RTX 3090 / A6000 (sm_86), RTX 4090 / L4 (sm_89),
# H100 / H200 (sm_90a). The lowest real arch also gets its PTX, so the binary runs on newer cards.
# The kernel benchmarks and the device check's single-GPU trainer are built for one card: the
# highest of the list (BENCH_ARCH).
comma     := ,
GPU_FAT_ARCHS  := sm_80 sm_86 sm_89 sm_90a
LOCAL_GPU_ARCH := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sort -u | \
                    sed -E 's/^9\.0$$/sm_90a/; t; s/^([0-9]+)\.([0-9]+)$$/sm_\1\2/')
GPU_ARCH  ?= $(if $(strip $(LOCAL_GPU_ARCH)),$(LOCAL_GPU_ARCH),$(GPU_FAT_ARCHS))
GPU_ARCHS := $(shell printf '%s\n' $(subst $(comma), ,$(GPU_ARCH)) | sort -uV)
# The element type of the CUDA build (params, activations, gradients; master weights and Adam moments
# are fp32 either way): PRECISION=bf16 (default, sm_80 and newer) or PRECISION=fp16 (-DLLMC_FP16: fp16
# with dynamic loss scaling, for cards without bf16: sm_75 T4 / RTX 20xx; it builds for sm_80+ too)
PRECISION ?= bf16
PRECISION_FLAGS := $(if $(filter fp16,$(PRECISION)),-DLLMC_FP16)
# a wrong GPU_ARCH or PRECISION stops the CUDA targets only (the CPU build never needs them)
GPU_ARCH_ERROR := $(strip \
  $(if $(filter-out bf16 fp16,$(PRECISION)),PRECISION=$(PRECISION): expected bf16 or fp16) \
  $(if $(and $(filter bf16,$(PRECISION)),$(filter sm_75 compute_75,$(GPU_ARCHS))),GPU_ARCH=$(GPU_ARCH): sm_75 has no bf16: build with PRECISION=fp16 (make train_gpt PRECISION=fp16 GPU_ARCH=sm_75)) \
  $(if $(filter sm_70 compute_70 sm_72 compute_72,$(GPU_ARCHS)),GPU_ARCH=$(GPU_ARCH): sm_70 (V100) has no bf16 and no m16n8k8 tensor-core shape (the attention kernels need sm_75 with PRECISION=fp16 or sm_80+)) \
  $(if $(filter-out sm_% compute_%,$(GPU_ARCHS)),GPU_ARCH=$(GPU_ARCH): expected sm_XX or compute_XX entries (sm_75 with PRECISION=fp16$(comma) sm_80 sm_86 sm_89 sm_90a ...)))
check_gpu_arch = $(if $(GPU_ARCH_ERROR),$(error $(GPU_ARCH_ERROR)))
GPU_SASS  := $(filter sm_%,$(GPU_ARCHS))
# -gencode per entry; the lowest real arch with its PTX too
gencode   = $(foreach a,$(1),-gencode arch=$(subst sm_,compute_,$(a)),code=$(a)) \
            $(foreach a,$(firstword $(filter sm_%,$(1))),-gencode arch=$(subst sm_,compute_,$(a)),code=$(subst sm_,compute_,$(a)))
BENCH_ARCH ?= $(lastword $(GPU_ARCHS))
NVCC_BASE := -O3 -std=c++17 --use_fast_math -Xcompiler -fopenmp -I.
NVCCFLAGS ?= $(NVCC_BASE) $(PRECISION_FLAGS) $(call gencode,$(GPU_ARCHS))
NVCCFLAGS_BENCH ?= $(NVCC_BASE) $(PRECISION_FLAGS) $(call gencode,$(BENCH_ARCH))
CUDA_LIBS := -lcublasLt -lcublas

HEADERS   := $(wildcard llmc/*.h llmc/*/*.h llmc/*/*.cuh llmc/ops/cpu/*.h)

# MPI: the compile and link flags its wrapper would add
USE_MPI   ?= 1
MPI_SHOW  := $(if $(filter 1,$(USE_MPI)),$(shell (mpicxx --showme 2>/dev/null || mpicc --showme 2>/dev/null) | head -n1))
MPI_FLAGS := $(filter -I% -L% -l% -pthread -Wl%,$(wordlist 2,1000,$(MPI_SHOW)))
ifneq ($(MPI_FLAGS),)
MPI_CFLAGS := -DLLMC_MPI -DOMPI_SKIP_MPICXX -DMPICH_SKIP_MPICXX $(filter -I%,$(MPI_FLAGS))
MPI_LIBS   := $(filter -L% -l% -Wl%,$(MPI_FLAGS))
endif
# NCCL: a folder with include/nccl.h and lib/libnccl.so*
CUDA_HOME ?= /usr/local/cuda
NCCL_HOME ?= $(firstword $(foreach d,$(CUDA_HOME) $(wildcard $(HOME)/.local/lib/python3*/site-packages/nvidia/nccl /usr/local/lib/python3*/dist-packages/nvidia/nccl),$(if $(and $(wildcard $(d)/include/nccl.h),$(wildcard $(d)/lib*/libnccl.so*)),$(d))))
ifneq ($(and $(NCCL_HOME),$(MPI_FLAGS)),)
NCCL_CFLAGS := -DLLMC_NCCL -I$(NCCL_HOME)/include
NCCL_LIBS   := -L$(NCCL_HOME)/lib -L$(NCCL_HOME)/lib64 -Xlinker -rpath=$(NCCL_HOME)/lib -lnccl
endif
# nvcc passes -pthread / -Wl flags to the host compiler
NVCC_MPI_LIBS := $(patsubst -Wl%,-Xlinker %,$(filter-out -pthread,$(MPI_LIBS)))
# The CUDA flags of the last build (a stamp rewritten only when they change): a binary built with other
# flags (GPU_ARCH, USE_MPI, NCCL_HOME, ...) is rebuilt, never shipped as if it were this build
BUILD_FLAGS := dev/cuda/bin/.build_flags
CUDA_FLAGS_NOW := $(NVCC) $(NVCCFLAGS) | $(NVCCFLAGS_BENCH) | $(MPI_CFLAGS) $(MPI_LIBS) | $(NCCL_CFLAGS) $(NCCL_LIBS)
ifneq ($(NVCC),)
ifneq ($(shell cat $(BUILD_FLAGS) 2>/dev/null),$(strip $(CUDA_FLAGS_NOW)))
$(shell mkdir -p dev/cuda/bin && echo '$(strip $(CUDA_FLAGS_NOW))' > $(BUILD_FLAGS))
endif
endif
# ptxas' report of a target: dev/cuda/bin/<name>.ptxas (train_gpt), <target>.ptxas for a target under dev/cuda/bin/
ptxas_log = $(if $(findstring /,$@),$@.ptxas,dev/cuda/bin/$@.ptxas)
# a trainer's nvcc with ptxas' report of every kernel, checked against dev/cuda/kernel_resources/<arch>.txt
# (registers, spills: scripts/kernel_resources.sh); ptxas' other output (warnings) is shown as usual
define nvcc_checked
$(check_gpu_arch)
@mkdir -p dev/cuda/bin
@echo "$(1)"
@$(1) --resource-usage 2> $(ptxas_log); rc=$$?; \
	grep -vE '^ptxas info|^    [0-9]+ bytes stack frame' $(ptxas_log) >&2; \
	[ $$rc = 0 ] || exit $$rc
@bash scripts/kernel_resources.sh $(ptxas_log)
endef
# doctest's header: the system one, or a copy in .deps/ (the GPU machine has none; see
# scripts/device_check.sh --prepare)
DOCTEST_INC := $(if $(wildcard .deps/doctest/doctest.h),-I.deps,)

.DELETE_ON_ERROR:
.PHONY: all test test_gpu test_dist dev_cuda cuda_targets clean reference fuzz
all: train_gpt_cpu train_gpt

train_gpt_cpu: train_gpt.cu $(HEADERS)
	$(CXX) $(CXXFLAGS) $(MPI_CFLAGS) -DLLMC_CPU -x c++ train_gpt.cu $(MPI_LIBS) -o $@
	@echo "train_gpt_cpu: $(if $(MPI_CFLAGS),with MPI (multi-process),single process (no MPI found))"

DEV_CUDA_BINS := $(patsubst dev/cuda/%.cu,dev/cuda/bin/%,$(wildcard dev/cuda/*.cu))
ifeq ($(NVCC),)
train_gpt test/test_gpu dev_cuda dev/cuda/bin/libllmc_attention.so:
	@echo "$@: nvcc not found (install the CUDA toolkit or set NVCC=/path/to/nvcc); skipping the GPU build"
else
train_gpt: train_gpt.cu $(HEADERS) $(BUILD_FLAGS) $(wildcard dev/cuda/kernel_resources/*.txt)
	$(call nvcc_checked,$(NVCC) $(NVCCFLAGS) $(MPI_CFLAGS) $(NCCL_CFLAGS) train_gpt.cu $(CUDA_LIBS) $(NCCL_LIBS) $(NVCC_MPI_LIBS) -o $@)
	@echo "train_gpt: $(if $(NCCL_CFLAGS),with NCCL + MPI (multi-GPU),single GPU ($(if $(MPI_CFLAGS),MPI without NCCL: one rank only; NCCL_HOME=/path/to/nccl for more,no MPI found)))"

# GPU tests: every op vs its CPU twin, the CUDA trainer vs the CPU trainer (needs a GPU to run;
# -lineinfo: compute-sanitizer names the source line of a bad access)
test/test_gpu: test/test_gpu.cu $(wildcard test/gpu/*.cuh) train_gpt.cu $(HEADERS) $(BUILD_FLAGS)
	$(check_gpu_arch)
	$(NVCC) $(NVCCFLAGS) -lineinfo $(DOCTEST_INC) test/test_gpu.cu $(CUDA_LIBS) -o $@

# kernel benchmarks: dev/cuda/<name>.cu -> dev/cuda/bin/<name>
dev/cuda/bin/%: dev/cuda/%.cu $(wildcard dev/cuda/*.cuh) $(HEADERS) $(BUILD_FLAGS)
	$(check_gpu_arch)
	@mkdir -p dev/cuda/bin
	$(NVCC) $(NVCCFLAGS_BENCH) $< $(CUDA_LIBS) -o $@
dev_cuda: $(DEV_CUDA_BINS)

# the single-GPU trainer as the GPU machine builds it (no MPI, no NCCL): compile check only
dev/cuda/bin/train_gpt_single: train_gpt.cu $(HEADERS) $(BUILD_FLAGS) $(wildcard dev/cuda/kernel_resources/*.txt)
	@mkdir -p dev/cuda/bin
	$(call nvcc_checked,$(NVCC) $(NVCCFLAGS_BENCH) train_gpt.cu $(CUDA_LIBS) -o $@)

# the device check's compute_80 PTX test_gpu and single-GPU trainer (scripts/device_check.sh --prepare):
# the sm_80 code path (A100, RTX 3090 / 4090, L4), JIT-compiled by the driver of whatever card runs
# them. Their flags are fixed, so building them never changes the build stamp (which would rebuild
# every other CUDA target)
NVCCFLAGS_jit80 := $(NVCC_BASE) -gencode arch=compute_80,code=compute_80

# the fp16 build for sm_75 (T4, RTX 20xx) as `make train_gpt PRECISION=fp16 GPU_ARCH=sm_75` makes it
# (sm_75 SASS + compute_75 PTX), single GPU (no MPI, no NCCL), apart from the default build (own folder,
# fixed flags: building it never touches the build stamp). make test compiles both (the trainer with
# the resource check against dev/cuda/kernel_resources/sm_75.txt)
NVCCFLAGS_fp16 := $(NVCC_BASE) -DLLMC_FP16 $(call gencode,sm_75)
dev/cuda/bin/fp16/train_gpt: train_gpt.cu $(HEADERS) $(wildcard dev/cuda/kernel_resources/*.txt)
	@mkdir -p dev/cuda/bin/fp16
	$(call nvcc_checked,$(NVCC) $(NVCCFLAGS_fp16) train_gpt.cu $(CUDA_LIBS) -o $@)
# the device check's fp16 binaries (scripts/device_check.sh --prepare): compute_75 PTX only, which the
# H200's driver JIT-compiles, so the sm_75 code path (two m16n8k8 fp16 mma per product, plain copies for
# cp.async) runs on a card we have; without the sm_75 SASS they take half the bytes (the carry limit)
NVCCFLAGS_jit75 := $(NVCC_BASE) -DLLMC_FP16 -gencode arch=compute_75,code=compute_75
# each of these folders' test_gpu (and the PTX-only trainers) with the folder's fixed flags
dev/cuda/bin/jit80/test_gpu dev/cuda/bin/jit75/test_gpu dev/cuda/bin/fp16/test_gpu: dev/cuda/bin/%/test_gpu: \
		test/test_gpu.cu $(wildcard test/gpu/*.cuh) train_gpt.cu $(HEADERS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS_$*) -lineinfo $(DOCTEST_INC) test/test_gpu.cu $(CUDA_LIBS) -o $@
dev/cuda/bin/jit80/train_gpt dev/cuda/bin/jit75/train_gpt: dev/cuda/bin/%/train_gpt: train_gpt.cu $(HEADERS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS_$*) train_gpt.cu $(CUDA_LIBS) -o $@

# the attention ops as a shared library for scripts/bench_attention.py (ctypes; --lib PATH)
dev/cuda/bin/libllmc_attention.so: dev/cuda/attention_lib.cu $(HEADERS) $(BUILD_FLAGS)
	@mkdir -p dev/cuda/bin
	$(NVCC) $(NVCCFLAGS_BENCH) -Xcompiler -fPIC -shared -DLLMC_ATTENTION_LIB $< -o $@
endif

test_gpu: test/test_gpu
	./test/test_gpu

# every CUDA target; in CI (no GPU) this is the compile check
# (and the fp16 build for sm_75: dev/cuda/bin/fp16/)
cuda_targets: train_gpt test/test_gpu dev_cuda $(if $(NVCC),dev/cuda/bin/libllmc_attention.so dev/cuda/bin/fp16/train_gpt \
              dev/cuda/bin/fp16/test_gpu $(if $(MPI_CFLAGS),dev/cuda/bin/train_gpt_single))

TEST_SOURCES := test/test_main.cpp test/test_ops.cpp test/test_model.cpp test/test_reference.cpp test/test_moe.cpp \
                test/test_hardening.cpp test/test_pipeline.cpp test/test_interop.cpp
test/test_cpu: $(TEST_SOURCES) test/test_util.h test/pipeline_sim.h train_gpt.cu $(HEADERS)
	$(CXX) $(CXXFLAGS) $(TEST_SOURCES) -o $@

# tensor parallelism op by op vs the unsplit model, under mpirun (test/test_dist.sh section 8)
test/test_tp: test/test_tp.cpp train_gpt.cu $(HEADERS)
	$(CXX) $(CXXFLAGS) $(MPI_CFLAGS) -DLLMC_CPU -DLLMC_NO_MAIN test/test_tp.cpp $(MPI_LIBS) -o $@

# the comm layer's simulated link and non-blocking requests, under mpirun (test/test_dist.sh section 12)
test/test_comm: test/test_comm.cpp $(HEADERS)
	$(CXX) $(CXXFLAGS) $(MPI_CFLAGS) -DLLMC_CPU test/test_comm.cpp $(MPI_LIBS) -o $@

# multi-process tests of train_gpt_cpu under mpirun (needs the MPI build)
test_dist: train_gpt_cpu test/test_tp test/test_comm
	bash test/test_dist.sh

test:
	$(MAKE) -j2 test/test_cpu test/test_tp test/test_comm train_gpt_cpu cuda_targets test/fuzz_readers dev/bin/forward_logits $(TOOLS_STAMP)
	OMP_NUM_THREADS=2 ./test/test_cpu
	bash test/test_dist.sh
	TOOLS_PYTHON=$(TOOLS_PYTHON) bash test/test_python.sh
	./test/test_gpu
	bash test/test_device_check.sh
	$(MAKE) fuzz
	@echo "make test: all CPU tests passed, fuzzing clean, CUDA targets compile"

# Fuzzing (test/fuzz_readers.cpp): the readers (shards, llm.c model and tokenizer files, checkpoints) under ASan + UBSan, any report fatal; each trial in
# its own child process with an alarm, the whole run under `timeout` (a hang fails the target).
FUZZ_TRIALS            ?= 600
FUZZ_SEED              ?= 20240611
FUZZ_CHECKPOINT_STRICT ?= 1
FUZZ_CXXFLAGS := -O1 -g -std=c++17 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer \
                 -Wall -Wextra -I.
FUZZ_ENV := ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1
test/fuzz_readers: test/fuzz_readers.cpp $(HEADERS)
	$(CXX) $(FUZZ_CXXFLAGS) test/fuzz_readers.cpp -o $@

fuzz: test/fuzz_readers train_gpt_cpu
	$(FUZZ_ENV) timeout 300 ./test/fuzz_readers shard --trials $(FUZZ_TRIALS) --seed $(FUZZ_SEED)
	$(FUZZ_ENV) timeout 300 ./test/fuzz_readers formats --trials $(FUZZ_TRIALS) --seed $(FUZZ_SEED)
	@d=$$(mktemp -d /tmp/llmc_fuzz_seed_XXXXXX) && \
	./test/fuzz_readers make_shard $$d/seed_train_000.bin && \
	./train_gpt_cpu --train "$$d/seed_train_*.bin" --val '' --out_dir $$d/run --n_layer 1 --n_embd 8 --n_head 1 \
	    -b 1 -t 8 --max_steps 1 --sample_len 0 > $$d/train.log 2>&1 || { cat $$d/train.log; exit 1; }; \
	ck=$$(ls -d $$d/run/ckpt_* | tail -n 1); \
	$(FUZZ_ENV) timeout 300 ./test/fuzz_readers checkpoint $$ck --trials $(FUZZ_TRIALS) --seed $(FUZZ_SEED); rc=$$?; \
	rm -rf $$d; \
	if [ $$rc -ne 0 ] && [ "$(FUZZ_CHECKPOINT_STRICT)" = 1 ]; then exit $$rc; fi

clean:
	rm -rf train_gpt train_gpt_cpu test/test_cpu test/test_tp test/test_gpu test/fuzz_readers dev/cuda/bin dev/bin .prebuilt

include scripts/reference.mk
include scripts/tools.mk
