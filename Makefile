# Builds the CPU reference trainer, the CUDA trainer, the tests and the kernel benchmarks.
# nvcc is detected: without it the CUDA targets are skipped with a message, never an error.
# (MPI and NCCL are not used yet: the multi-process build comes with data/pipeline parallelism.)
#   make train_gpt_cpu        CPU reference build (g++, OpenMP, fp32)
#   make train_gpt            CUDA build (GPU_ARCH=sm_90 by default: make train_gpt GPU_ARCH=sm_80)
#   make test                 CPU tests + compile checks of every CUDA target (what CI runs)
#   make reference            regenerate test/data/ref_*.bin with PyTorch (scripts/reference.mk)
CXX       ?= g++
CXXFLAGS  ?= -O3 -march=native
CXXFLAGS  += -std=c++17 -fopenmp -Wall -Wextra -Wno-comment -I.
GPU_ARCH  ?= sm_90
NVCC      ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
NVCCFLAGS ?= -O3 -std=c++17 -arch=$(GPU_ARCH) --use_fast_math -Xcompiler -fopenmp -I.
CUDA_LIBS := -lcublasLt -lcublas

HEADERS   := $(wildcard llmc/*.h llmc/*.cuh llmc/cpu/*.h)
# doctest's header: the system one, or a copy in .deps/ (the GPU machine has none; see
# scripts/device_check.sh --prepare)
DOCTEST_INC := $(if $(wildcard .deps/doctest/doctest.h),-I.deps,)

.PHONY: all test test_gpu dev_cuda cuda_targets clean reference
all: train_gpt_cpu train_gpt

train_gpt_cpu: train_gpt.cu $(HEADERS)
	$(CXX) $(CXXFLAGS) -DLLMC_CPU -x c++ train_gpt.cu -o $@

DEV_CUDA_BINS := $(patsubst dev/cuda/%.cu,dev/cuda/bin/%,$(wildcard dev/cuda/*.cu))
ifeq ($(NVCC),)
train_gpt test/test_gpu dev_cuda dev/cuda/bin/libllmc_attention.so:
	@echo "$@: nvcc not found (install the CUDA toolkit or set NVCC=/path/to/nvcc); skipping the GPU build"
else
train_gpt: train_gpt.cu $(HEADERS)
	$(NVCC) $(NVCCFLAGS) train_gpt.cu $(CUDA_LIBS) -o $@

# GPU tests: every op vs its CPU twin, the CUDA trainer vs the CPU trainer (needs a GPU to run)
test/test_gpu: test/test_gpu.cu $(wildcard test/gpu/*.cuh) train_gpt.cu $(HEADERS)
	$(NVCC) $(NVCCFLAGS) $(DOCTEST_INC) test/test_gpu.cu $(CUDA_LIBS) -o $@

# kernel benchmarks: dev/cuda/<name>.cu -> dev/cuda/bin/<name>
dev/cuda/bin/%: dev/cuda/%.cu dev/cuda/common.cuh $(HEADERS)
	@mkdir -p dev/cuda/bin
	$(NVCC) $(NVCCFLAGS) $< $(CUDA_LIBS) -o $@
dev_cuda: $(DEV_CUDA_BINS)

# the attention ops as a shared library for scripts/bench_attention.py (ctypes; --lib PATH)
dev/cuda/bin/libllmc_attention.so: dev/cuda/attention_lib.cu $(HEADERS)
	@mkdir -p dev/cuda/bin
	$(NVCC) $(NVCCFLAGS) -Xcompiler -fPIC -shared -DLLMC_ATTENTION_LIB $< -o $@
endif

test_gpu: test/test_gpu
	./test/test_gpu

# every CUDA target; in CI (no GPU) this is the compile check
cuda_targets: train_gpt test/test_gpu dev_cuda

TEST_SOURCES := test/test_main.cpp test/test_ops.cpp test/test_model.cpp test/test_reference.cpp test/test_moe.cpp
test/test_cpu: $(TEST_SOURCES) test/test_util.h train_gpt.cu $(HEADERS)
	$(CXX) $(CXXFLAGS) $(TEST_SOURCES) -o $@

test:
	$(MAKE) -j2 test/test_cpu train_gpt_cpu cuda_targets
	OMP_NUM_THREADS=2 ./test/test_cpu
	./test/test_gpu
	@echo "make test: all CPU tests passed, CUDA targets compile"

clean:
	rm -rf train_gpt train_gpt_cpu test/test_cpu test/test_gpu dev/cuda/bin .prebuilt

include scripts/reference.mk
