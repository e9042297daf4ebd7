# pdserve — the one front door.
#   make              build build/pdserve (CUDA=auto|0|1: auto builds the CUDA code only when a GPU is
#                     present -- /dev/nvidia0 or `nvidia-smi -L` -- and nvcc is found; CUDA=1 forces it)
#   make deps         install the missing Debian packages and npm test clients (tools/deps.sh)
#   make test         install missing packages, build, run every CPU test tier
#   make run          install missing packages, build, start the embedded default and answer a sample
#                     request (RUN_ARGS=--exit-after-sample: exit after the answer)
#   make test-asan    unit + golden + integration tiers under AddressSanitizer/UBSan (CUDA=0)
#   make test-tsan    the tests that run threads under ThreadSanitizer (CUDA=0, see TSAN_TESTS)
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

# CUDA=auto: the GPU decides, not the compiler (a machine with nvcc but no GPU builds CPU-only).
ifeq ($(CUDA),auto)
  HAVE_GPU := $(shell { [ -e /dev/nvidia0 ] || nvidia-smi -L 2>/dev/null | grep -q '^GPU'; } && echo 1)
  ifeq ($(HAVE_GPU),1)
    ifneq ($(NVCC),)
      CUDA := 1
    else
      $(warning a GPU is present but nvcc was not found: building CPU-only (CUDA=0))
      CUDA := 0
    endif
  else
    CUDA := 0
  endif
endif

# Libraries, by pkg-config module (tools/deps.sh installs their Debian packages). Flags come from
# pkg-config only: openblas.pc points at Debian's openblas-pthread include directory, whose cblas.h
# declares openblas_set_num_threads (a reference-BLAS cblas.h does not).
PKGS     := jansson libpcre2-8 libevent libevent_pthreads libxxhash openblas libutf8proc libcrypto liburing hiredis ucx libnats
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wno-unused-parameter -fPIC -pthread -fopenmp \
               -Isrc $(PKG_CFLAGS)
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
LDLIBS  := $(PKG_LIBS) -lm -lpthread -fopenmp

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

.PHONY: all deps test test-asan test-tsan run fuzz fuzz-run gpu-test clean check-deps tests pkgcheck
all: $(BUILD)/pdserve

# Every compile needs the pkg-config modules: say which are missing instead of failing on a header.
pkgcheck:
	@pkg-config --exists $(PKGS) 2>/dev/null || { echo "missing pkg-config modules (run 'make deps'):" >&2; \
	  for m in $(PKGS); do pkg-config --exists $$m || echo "  $$m" >&2; done; exit 1; }
$(LIB_OBJ) $(CMD_OBJ) $(HELPER_OBJ): | pkgcheck

# The backend registry is the one file that knows whether CUDA is compiled in.
$(BUILD)/obj/src/backend/registry.o: CFLAGS += $(if $(filter 1,$(CUDA)),-DPD_USE_CUDA)
$(BUILD)/obj/src/backend/registry.o: $(BUILD)/cuda-flag-$(CUDA)

$(BUILD)/cuda-flag-$(CUDA):
	@mkdir -p $(BUILD) && rm -f $(BUILD)/cuda-flag-* && touch $@

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

# ptxas reports wgmma instructions it had to serialise (C7510-C7520: "Potential Performance Loss:
# wgmma..." or "warpgroup.wait is injected"; the asynchronous tensor-core pipeline is then lost).
# With WERROR=1 such a report fails the build (tools/gpu/build.sh passes it).
$(BUILD)/obj/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -MMD -MP -c $< -o $@ 2>$@.log; rc=$$?; cat $@.log >&2; [ $$rc = 0 ] || { rm -f $@; exit $$rc; }
ifeq ($(WERROR),1)
	@if grep -q 'Performance Loss: wgmma\|warpgroup.wait is injected' $@.log; then \
	  echo "$<: ptxas serialised wgmma instructions (see above); WERROR=1 refuses it" >&2; rm -f $@; exit 1; fi
endif

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

# ASan + UBSan over unit, golden, corpus replay and integration (the servers the scripts start are
# the instrumented build/asan/pdserve). UBSan findings abort: a report is a failure.
# UCX's libucm patches malloc/mmap at load time (for its registration cache); under a sanitizer's
# own interceptors that crashed every TSan binary at exit (SIGSEGV, even with no UCX call). The
# sanitizer tiers turn those hooks off; UCX works without them (no registration cache).
SAN_UCX_ENV := UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_EVENTS=no
test-asan: deps
	@$(MAKE) --no-print-directory BUILD=build/asan SAN=address,undefined CUDA=0 tests
	@$(SAN_UCX_ENV) PD_TEST_TIME_SCALE=4 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  sh tools/run_tests.sh build/asan $(patsubst $(BUILD)/%,build/asan/%,$(TEST_BIN))

# ThreadSanitizer over the tests that run threads: the engine thread, the KV transfer threads, the
# HTTP/API event loops and the router. libgomp is not instrumented (its barriers look like races),
# so OMP_THREAD_LIMIT=1 runs every OpenMP region on its calling thread; tools/tsan.supp holds the
# (commented, narrow) suppressions. TSan reports make the process exit 66: a report is a failure.
TSAN_TESTS ?= unit/test_engine unit/test_disagg unit/test_api_server unit/test_api_prep unit/test_http \
              unit/test_http_client unit/test_router_core unit/test_router_wire unit/test_kvtier unit/test_kvtier_redis \
              unit/test_kvconn_tiers
# engine + xfer threads (disagg), router, API + engine under load (test_api.sh: ~7 min under TSan).
# test_kv_faults.sh (issue 13's fault suite): 4.0 min under TSan on the 2-core VM (load ~1) with
# 1,000 connect/close cycles (PD_KV_FAULT_CYCLES below; the plain tier runs the full 10,000, ~2 min).
# test_shutdown.sh: 4.9 min under TSan on the same VM at load 7-9 (~2 min plain).
# test_kv_tiers.sh: the engine, tier and xfer threads with real tiers (~80 s under TSan).
# test_kv_pool.sh: Redis's keyspace-notification thread, failover onto the pool (~40-70 s under TSan).
# test_nats_queue.sh: the JetStream prefill queue and its redelivery (libnats' threads, the fetch
# thread, the engine's enqueue), 13-22 s under TSan, 3 of 3 clean; test_nats_faults.sh: the NATS
# control plane under attack (router + workers + nkey auth), 65 s under TSan, clean.
TSAN_SCRIPTS ?= test_disagg.sh test_router_fake.sh test_api.sh test_kv_faults.sh test_shutdown.sh test_kv_tiers.sh \
                test_kv_pool.sh test_nats_queue.sh test_nats_faults.sh
test-tsan: deps
	@$(MAKE) --no-print-directory BUILD=build/tsan SAN=thread CUDA=0 $(addprefix build/tsan/tests/,$(TSAN_TESTS)) build/tsan/pdserve
	@$(SAN_UCX_ENV) PD_TEST_TIME_SCALE=10 OMP_THREAD_LIMIT=1 TSAN_OPTIONS="suppressions=$(CURDIR)/tools/tsan.supp halt_on_error=1 exitcode=66 second_deadlock_stack=1" \
	  PD_KV_FAULT_CYCLES=1000 PD_INTEGRATION="$(TSAN_SCRIPTS)" sh tools/run_tests.sh build/tsan $(addprefix build/tsan/tests/,$(TSAN_TESTS))

RUN_ARGS ?=
run: deps
	@$(MAKE) --no-print-directory all
	@sh tools/run.sh $(BUILD)/pdserve $(RUN_ARGS)

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

# On a GPU machine nothing may be skipped: PD_NO_SKIP=1 counts a skipped test as failed.
gpu-test:
	@$(MAKE) --no-print-directory CUDA=1 tests
	@PD_NO_SKIP=1 sh tools/run_tests.sh $(BUILD) $(TEST_BIN)
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
