# Builds the CPU reference trainer, the CUDA trainer, the tests and the kernel benchmarks.
# nvcc, NCCL and MPI are detected; what is missing is skipped with a message, never an error.
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

.PHONY: all test test_gpu clean reference
all: train_gpt_cpu train_gpt

train_gpt_cpu: train_gpt.cu $(HEADERS)
	$(CXX) $(CXXFLAGS) -DLLMC_CPU -x c++ train_gpt.cu -o $@

ifeq ($(NVCC),)
train_gpt:
	@echo "train_gpt: nvcc not found (install the CUDA toolkit or set NVCC=/path/to/nvcc); skipping the GPU build"
else
train_gpt: train_gpt.cu $(HEADERS)
	$(NVCC) $(NVCCFLAGS) train_gpt.cu $(CUDA_LIBS) -o $@
endif

TEST_SOURCES := test/test_main.cpp test/test_ops.cpp test/test_model.cpp test/test_reference.cpp
test/test_cpu: $(TEST_SOURCES) train_gpt.cu $(HEADERS)
	$(CXX) $(CXXFLAGS) $(TEST_SOURCES) -o $@

test: test/test_cpu train_gpt_cpu train_gpt
	OMP_NUM_THREADS=2 ./test/test_cpu
	@echo "make test: all CPU tests passed"

clean:
	rm -f train_gpt train_gpt_cpu test/test_cpu test/test_gpu

include scripts/reference.mk
