# mnemo: build, install, deps, demo, test.
#   make              build ./mnemo (CUDA parts too when nvcc is found)
#   make CUDA=0       CPU-only build
#   make deps         install missing Debian packages (non-interactive)
#   make demo         deps + build + the default experiment on synthetic data
#   make python       the PyTorch bridge's native library (build/libmnemo_torch.so)
#   make test         deps + build + every test this machine can run
#   make bench-tools  the C benchmark tools of tests/bench (build/bench/nvrtc_time)
#   make install PREFIX=/usr/local   (the binary and the man page docs/mnemo.1)

PREFIX ?= /usr/local
BUILD  ?= build
BIN    ?= mnemo
CC     ?= gcc

# Debian packages the build, the tests and the demo need.
DEB_PACKAGES = build-essential pkg-config liblua5.4-dev libhdf5-dev hdf5-tools \
               libopenblas-dev libreadline-dev python3 python3-torch python3-h5py \
               python3-numpy gnuplot-nox base-files groff-base clang libomp-dev

# Recursively expanded on purpose: pkg-config must be asked after `make deps`.
PKGS     = lua5.4 hdf5-serial openblas readline
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   = $(shell pkg-config --libs $(PKGS) 2>/dev/null)

CFLAGS  ?= -O2 -g
# -Werror=switch: a switch over a rule enum has no default, so a new row of
# model/rule.def that some switch forgets stops the build.
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror=switch -MMD -MP -fPIC -fopenmp
LDLIBS   = $(PKG_LIBS) -lm -lpthread -fopenmp

# CUDA: auto-detected; the binary links the runtime, cuBLAS and NVRTC, never
# libcuda, so it starts on machines without a driver.
NVCC_FOUND := $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
ifeq ($(origin CUDA), undefined)
CUDA := $(if $(NVCC_FOUND),1,0)
endif
NVCC      ?= $(if $(NVCC_FOUND),$(NVCC_FOUND),nvcc)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC_FOUND))
CUDA_ARCH ?= -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90
NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC,-Wall -lineinfo

MODEL_SRC = $(wildcard model/*.c)
DSL_SRC   = $(wildcard dsl/*.c)
REPL_SRC  = $(wildcard repl/*.c)
LUA_SRC   = $(sort $(wildcard dsl/*.lua))

ifeq ($(CUDA),1)
KERNEL_C_SRC  = $(wildcard kernels/*.c)
KERNEL_CU_SRC = $(wildcard kernels/*.cu)
CFLAGS  += -DMN_HAVE_CUDA -I$(CUDA_HOME)/include
LDLIBS  += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublas -lcublasLt -lnvrtc -lstdc++
else
KERNEL_C_SRC  =
KERNEL_CU_SRC =
endif

ENGINE_OBJ = $(MODEL_SRC:%.c=$(BUILD)/%.o) $(KERNEL_C_SRC:%.c=$(BUILD)/%.o) \
             $(KERNEL_CU_SRC:%.cu=$(BUILD)/%.cu.o)
FRONT_OBJ  = $(DSL_SRC:%.c=$(BUILD)/%.o) $(REPL_SRC:%.c=$(BUILD)/%.o) $(BUILD)/embedded_lua.o
ENGINE_LIB = $(BUILD)/libmnemo_engine.a

# The kernel templates of kernels/ are compiled into the engine as strings
# (kernels/codegen.c fills their hooks and NVRTC compiles them at run time).
ifeq ($(CUDA),1)
CUDA_TEMPLATES = model/param_layout.h $(sort $(wildcard kernels/*.cuh))
ENGINE_OBJ += $(BUILD)/embedded_cuda.o
endif

UNIT_SRC   = $(wildcard tests/unit/test_*.c)
UNIT_BIN   = $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)

.PHONY: all deps demo test install clean check-cuda python
all: $(BIN) $(UNIT_BIN)

$(BIN): $(FRONT_OBJ) $(ENGINE_LIB)
	$(CC) $(LDFLAGS) -o $@ $(FRONT_OBJ) $(ENGINE_LIB) $(LDLIBS)

$(ENGINE_LIB): $(ENGINE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# GCC 12 at -O2 does not vectorise the elementwise loops without this
# (measured: relu 1 -> 17 GB/s on the CPU backend).
$(BUILD)/model/cpu.o $(BUILD)/model/engine_cpu.o $(BUILD)/model/mlp_cpu.o: CFLAGS += -fvect-cost-model=dynamic

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(PKG_CFLAGS) -c $< -o $@

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -Imodel -c $< -o $@

# The Lua sources of dsl/ are compiled into the binary as strings.
$(BUILD)/embedded_lua.c: $(LUA_SRC) dsl/embed_sources.sh
	@mkdir -p $(dir $@)
	sh dsl/embed_sources.sh lua $(LUA_SRC) > $@.tmp && mv $@.tmp $@

$(BUILD)/embedded_lua.o: $(BUILD)/embedded_lua.c
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/embedded_cuda.c: $(CUDA_TEMPLATES) dsl/embed_sources.sh
	@mkdir -p $(dir $@)
	sh dsl/embed_sources.sh cuda $(CUDA_TEMPLATES) > $@.tmp && mv $@.tmp $@

$(BUILD)/embedded_cuda.o: $(BUILD)/embedded_cuda.c
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/tests/%: tests/unit/%.c $(ENGINE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(PKG_CFLAGS) -Imodel -Itests/unit $< $(ENGINE_LIB) $(LDLIBS) -o $@

# Benchmark tools written in C (tests/bench/*.c; not tests): the CUDA ones
# need a CUDA build, none a GPU.
ifeq ($(CUDA),1)
BENCH_BIN = $(BUILD)/bench/nvrtc_time
endif
.PHONY: bench-tools
bench-tools: $(BENCH_BIN)
$(BUILD)/bench/%: tests/bench/%.c $(ENGINE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(PKG_CFLAGS) -Imodel $< $(ENGINE_LIB) $(LDLIBS) -o $@

# The PyTorch bridge (python/mnemo_torch) loads this with ctypes: the engine
# and a small C shim, no Lua (--as-needed drops the REPL's libraries).
TORCH_LIB = $(BUILD)/libmnemo_torch.so
python: $(TORCH_LIB)
$(TORCH_LIB): python/native/mnemo_torch.c $(ENGINE_LIB)
	$(CC) $(filter-out -MMD -MP,$(CFLAGS)) $(PKG_CFLAGS) -shared -o $@.tmp $< $(ENGINE_LIB) -Wl,--as-needed $(LDLIBS) && mv $@.tmp $@

# Missing packages only; apt-get runs only when something is missing.
deps:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "make deps: installing$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "make deps: all packages present"; fi

demo: deps
	$(MAKE) all
	@mkdir -p $(BUILD)/demo
	$(abspath $(BIN)) examples/titans_mlp.lua full $(BUILD)/demo

test: deps
	$(MAKE) all python
	$(if $(filter 1,$(SANITIZE)),$(MAKE) sanitize-build)
	$(if $(filter 1,$(FUZZ)),$(MAKE) fuzz-build)
	MNEMO=$(abspath $(BIN)) BUILD=$(BUILD) $(if $(filter 1,$(SANITIZE)),SAN_BUILD=$(SAN_BUILD)) \
	  $(if $(filter 1,$(FUZZ)),FUZZ_BUILD=$(FUZZ_BUILD) FUZZ_SECONDS=$(FUZZ_TEST_SECONDS)) sh tests/run.sh

install: $(BIN)
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 755 $(BIN) $(DESTDIR)$(PREFIX)/bin/mnemo
	install -d $(DESTDIR)$(PREFIX)/share/man/man1
	install -m 644 docs/mnemo.1 $(DESTDIR)$(PREFIX)/share/man/man1/mnemo.1

clean:
	rm -rf $(BUILD) $(BIN) $(SAN_BUILD) $(FUZZ_BUILD)

-include $(ENGINE_OBJ:.o=.d) $(FRONT_OBJ:.o=.d) $(UNIT_BIN:%=%.d) $(BENCH_BIN:%=%.d)

# ---- Robustness (issue 17): sanitizers and fuzzers -------------------------
# SANITIZER_BUILD=1 (set by `make sanitize-build`, never by hand) turns this
# build into the CPU engine under AddressSanitizer and UndefinedBehaviorSanitizer;
# it lives in its own folder so it never mixes with the normal objects.
# `make test` builds it too and tests/run.sh runs the unit tests, the Lua tests
# and the bad-input catalogue (tests/badinput/) under it (SANITIZE=0 skips).
# `make fuzz` runs each libFuzzer target of tests/fuzz/ for FUZZ_SECONDS;
# `make test` runs each for FUZZ_TEST_SECONDS (FUZZ=0 skips).
SANITIZE ?= 1
SAN_BUILD = build-san
SAN_FLAGS = -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
ifeq ($(SANITIZER_BUILD),1)
CFLAGS += $(SAN_FLAGS)
LDLIBS += -fsanitize=address,undefined
endif
FUZZ ?= 1
FUZZ_SECONDS ?= 60
FUZZ_TEST_SECONDS ?= 20
FUZZ_BUILD = build-fuzz
FUZZ_CC ?= clang
FUZZ_TARGETS = $(patsubst tests/fuzz/%.c,$(FUZZ_BUILD)/%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_CFLAGS = -O1 -g -std=c11 -D_GNU_SOURCE -fsanitize=fuzzer-no-link,address,undefined \
              -fno-sanitize-recover=undefined -fno-omit-frame-pointer -fopenmp -MMD -MP
FUZZ_OBJ = $(MODEL_SRC:%.c=$(FUZZ_BUILD)/%.o)

.PHONY: sanitize-build fuzz-build fuzz
sanitize-build:
	$(MAKE) CUDA=0 SANITIZER_BUILD=1 BUILD=$(SAN_BUILD) BIN=$(SAN_BUILD)/mnemo all

# The fuzzers link the model sources compiled by clang with coverage (not
# the gcc archive).
fuzz-build: $(FUZZ_TARGETS)
$(FUZZ_BUILD)/model/%.o: model/%.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(PKG_CFLAGS) -c $< -o $@
$(FUZZ_BUILD)/fuzz_%: tests/fuzz/fuzz_%.c $(FUZZ_OBJ)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer $(PKG_CFLAGS) -Imodel $< $(FUZZ_OBJ) $(PKG_LIBS) -lm -lpthread -o $@
.SECONDARY: $(FUZZ_OBJ)
-include $(FUZZ_OBJ:.o=.d)

fuzz: deps fuzz-build
	FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_BUILD=$(FUZZ_BUILD) sh tests/fuzz/run_fuzz.sh
