# pdserve — the one front door.
#   make              build build/pdserve (CUDA auto-detected: CUDA=auto|0|1)
#   make test         install missing packages, build, run every CPU test tier
#   make run          install missing packages, build, start the embedded default and answer a sample request
#   make test-asan    the unit + golden tiers under AddressSanitizer/UBSan
#   make fuzz         build the libFuzzer targets (clang); make fuzz-run FUZZ_SECONDS=300 runs each
#   make gpu-test     build with CUDA and run the GPU tests (needs a GPU; 2 GPUs: also tools/gpu/test_disagg_gpu.sh)
#   make SAN=address,undefined DEBUG=1 ...
#
# Sources are found by wildcard: every src/**/*.c except src/cmd/ goes into build/libpdserve.a,
# src/cmd/*.c into the binary, every tests/{unit,golden,ops}/test_*.c into its own test binary.

CC      ?= cc
NVCC    ?= $(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
CUDA    ?= auto
CUDA_ARCHS ?= 90
BUILD   ?= build
SAN     ?=
DEBUG   ?= 0
WERROR  ?= 0

ifeq ($(CUDA),auto)
  ifneq ($(NVCC),)
    CUDA := 1
  else
    CUDA := 0
  endif
endif

PKGS     := jansson libpcre2-8 libevent xxhash openblas libutf8proc
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wno-unused-parameter -fPIC -pthread -fopenmp \
               -Isrc -I/usr/include/x86_64-linux-gnu/openblas-pthread $(shell pkg-config --cflags libutf8proc 2>/dev/null)
ifeq ($(DEBUG),1)
  CFLAGS_OPT := -O0 -g -DPD_DEBUG
else
  CFLAGS_OPT := -O2 -g -march=x86-64-v2
endif
ifneq ($(SAN),)
  CFLAGS_OPT += -fsanitize=$(SAN) -fno-omit-frame-pointer
  LDFLAGS_SAN := -fsanitize=$(SAN)
endif
ifeq ($(WERROR),1)
  CFLAGS_OPT += -Werror
endif
CFLAGS  += $(CFLAGS_BASE) $(CFLAGS_OPT)
LDLIBS  := -ljansson -lpcre2-8 -levent -levent_pthreads -lxxhash -lopenblas $(shell pkg-config --libs libutf8proc) -lm -lpthread -fopenmp

CUDA_HOME ?= /usr/local/cuda
ifeq ($(CUDA),1)
  CFLAGS  += -I$(CUDA_HOME)/include
  LDLIBS  += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart_static -ldl -lrt -lstdc++
  NVFLAGS := -O3 -std=c++17 -Isrc --use_fast_math -Xcompiler -fPIC,-Wall \
             $(foreach a,$(subst ;, ,$(CUDA_ARCHS)),-gencode arch=compute_$(a)$(if $(filter 90,$(a)),a),code=sm_$(a)$(if $(filter 90,$(a)),a))
endif

LIB_SRC  := $(filter-out src/cmd/%,$(shell find src -name '*.c' | sort))
ifneq ($(CUDA),1)
  LIB_SRC := $(filter-out src/backend/cuda/%,$(LIB_SRC))
endif
CU_SRC   := $(if $(filter 1,$(CUDA)),$(shell find src -name '*.cu' | sort))
CMD_SRC  := $(wildcard src/cmd/*.c)
TEST_SRC := $(sort $(wildcard tests/unit/test_*.c tests/golden/test_*.c tests/ops/test_*.c))
TEST_HELPER_SRC := $(wildcard tests/helpers/*.c)

LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o) $(CU_SRC:%.cu=$(BUILD)/obj/%.cu.o)
CMD_OBJ  := $(CMD_SRC:%.c=$(BUILD)/obj/%.o)
TEST_BIN := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))
HELPER_OBJ := $(TEST_HELPER_SRC:%.c=$(BUILD)/obj/%.o)

.PHONY: all deps test test-asan run fuzz fuzz-run gpu-test clean check-deps tests
all: $(BUILD)/pdserve

# The backend registry is the one file that knows whether CUDA is compiled in.
$(BUILD)/obj/src/backend/registry.o: CFLAGS += $(if $(filter 1,$(CUDA)),-DPD_USE_CUDA)
$(BUILD)/obj/src/backend/registry.o: $(BUILD)/cuda-flag-$(CUDA)

$(BUILD)/cuda-flag-$(CUDA):
	@mkdir -p $(BUILD) && rm -f $(BUILD)/cuda-flag-* && touch $@

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libpdserve.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/pdserve: $(CMD_OBJ) $(BUILD)/libpdserve.a
	$(CC) $(CFLAGS) $(LDFLAGS_SAN) -o $@ $(CMD_OBJ) $(BUILD)/libpdserve.a $(LDLIBS)

$(BUILD)/tests/%: tests/%.c $(BUILD)/libpdserve.a $(HELPER_OBJ) tests/test.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests $(LDFLAGS_SAN) -o $@ $< $(HELPER_OBJ) $(BUILD)/libpdserve.a $(LDLIBS)

# Corpus replay: each fuzz target linked with tests/fuzz/replay_main.c (no libFuzzer needed).
REPLAY_BIN := $(patsubst tests/fuzz/fuzz_%.c,$(BUILD)/tests/fuzz/replay_%,$(wildcard tests/fuzz/fuzz_*.c))
TEST_BIN += $(REPLAY_BIN)
$(BUILD)/tests/fuzz/replay_%: tests/fuzz/fuzz_%.c tests/fuzz/replay_main.c $(BUILD)/libpdserve.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DFUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION -DPD_FUZZ_TARGET=fuzz_$* $(LDFLAGS_SAN) -o $@ $< tests/fuzz/replay_main.c $(BUILD)/libpdserve.a $(LDLIBS)

tests: $(BUILD)/pdserve $(TEST_BIN)

# Packages: installed with apt only when missing (fresh Debian/Ubuntu machines).
deps:
	@sh tools/deps.sh

test: deps
	@$(MAKE) --no-print-directory tests
	@sh tools/run_tests.sh $(BUILD) $(TEST_BIN)

test-asan: deps
	@$(MAKE) --no-print-directory BUILD=build/asan SAN=address,undefined CUDA=0 tests
	@ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  sh tools/run_tests.sh build/asan $(patsubst $(BUILD)/%,build/asan/%,$(TEST_BIN))

run: deps
	@$(MAKE) --no-print-directory all
	@sh tools/run.sh $(BUILD)/pdserve

# libFuzzer targets: tests/fuzz/fuzz_*.c, built with clang against the library sources.
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_BIN := $(patsubst tests/fuzz/%.c,build/fuzz/%,$(FUZZ_SRC))
FUZZ_SECONDS ?= 300
fuzz: deps
	@$(MAKE) --no-print-directory $(FUZZ_BIN)
build/fuzz/%: tests/fuzz/%.c $(filter-out src/backend/cuda/%,$(LIB_SRC))
	@mkdir -p build/fuzz
	clang $(CFLAGS_BASE) -O1 -g -DFUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION -fsanitize=fuzzer,address,undefined -fno-omit-frame-pointer \
	  -o $@ $< $(filter-out src/backend/cuda/% src/backend/registry.c,$(LIB_SRC)) src/backend/registry.c $(LDLIBS)
fuzz-run: fuzz
	@for f in $(FUZZ_BIN); do n=$$(basename $$f); mkdir -p tests/fuzz/corpus/$$n; \
	  echo "== $$n ($(FUZZ_SECONDS)s)"; \
	  $$f -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=4096 tests/fuzz/corpus/$$n || exit 1; done

gpu-test:
	@$(MAKE) --no-print-directory CUDA=1 tests
	@PD_GPU_TESTS=1 sh tools/run_tests.sh $(BUILD) $(TEST_BIN)
	@# the decode attention merging every split launch's partials with the combine kernel
	@PD_CUDA_ATTN_FOLD=0 $(BUILD)/tests/ops/test_backend_ops > /dev/null && \
	  echo "test_backend_ops with PD_CUDA_ATTN_FOLD=0: PASS" || { echo "test_backend_ops with PD_CUDA_ATTN_FOLD=0: FAIL"; exit 1; }
	@# disaggregation on two GPUs (cuda-ipc and nccl): outputs identical to colocated
	@if [ "$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ]; then \
	  PD_BIN=$(CURDIR)/$(BUILD)/pdserve sh tools/gpu/test_disagg_gpu.sh; \
	else echo "test_disagg_gpu: skipped (needs 2 GPUs)"; fi

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
