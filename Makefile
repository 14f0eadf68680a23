# Front door. Each target installs the Debian packages it needs when they are
# missing (and does nothing, needing no root, when they are all there).
#
#   make          release build in build/
#   make test     release build + its tests, then the sanitized test build in build-asan/ + its tests,
#                 then the tests that start threads under ThreadSanitizer in build-tsan/
#   make demo     release build, then the demo
#   make bench    release build, then the benchmarks: kiln against PyTorch, torch.compile and JAX
#                 (their Python packages go into build/venv once, from PyPI: bench/venv.sh)
#   make torch-roundtrip  release build, then the GPT's weights saved by PyTorch loaded into kiln and
#                 back, the logits compared (bench/torch_roundtrip.py; PyTorch from build/venv)
#   make test-cross  release build, then test_export's exported models built for AArch64 with
#                 Debian's cross compiler and run under qemu-user (CROSS_DEPS), docs/deploy.md
#   make install  release build, then cmake --install into PREFIX (default /usr/local;
#                 make install PREFIX=$HOME/.local), docs/install.md
#   make clean

BUILD      ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
# The tests that start threads, the only ones worth ThreadSanitizer's slowdown
# (test_gpt: a compile of many kernels, whose groups LLVM compiles on threads;
# test_codegen_cnn: conv and pool kernels split over the pool, compiled and eager).
TSAN_TESTS := test_stress test_threads test_capture_replay test_pool test_gpt test_codegen_cnn test_winograd
JOBS       ?= 2
CMAKE_ARGS ?=
PREFIX     ?= /usr/local

# Open MPI: the collectives of data-parallel training (docs/scaling.md); kiln builds
# without it too (KILN_MPI=OFF), but `make test` runs the MPI tests.
DEPS       := cmake pkg-config build-essential llvm-19-dev libopenblas-dev libcjson-dev check python3-numpy \
              openmpi-bin libopenmpi-dev
# The bench's Python packages (PyTorch 2.x, JAX, matplotlib) come from PyPI into build/venv
# (bench/venv.sh); Debian gives the venv module and the Python headers torch.compile's C++ includes.
BENCH_DEPS := python3-venv python3-dev

# $(call apt_ensure,packages): apt-get install whatever of them is not installed.
define apt_ensure
@missing=""; \
for p in $(1); do \
  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
done; \
if [ -n "$$missing" ]; then \
  sudo=""; \
  if [ "$$(id -u)" -ne 0 ]; then \
    if command -v sudo >/dev/null 2>&1; then sudo=sudo; \
    else echo "missing packages:$$missing (run as root, or install sudo)" >&2; exit 1; fi; \
  fi; \
  echo "installing:$$missing"; \
  $$sudo apt-get update && \
  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
fi
endef

.PHONY: all build deps bench-deps configure test test-release test-asan demo bench torch-roundtrip install clean

all: build

deps:
	$(call apt_ensure,$(DEPS))

# One apt-get run for both lists, so a fresh machine updates the index once.
bench-deps:
	$(call apt_ensure,$(DEPS) $(BENCH_DEPS))

# The build rules themselves do not depend on deps, so that `bench` can bring
# in its own packages first; the user-facing targets below order them.
$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)

$(ASAN_BUILD)/CMakeCache.txt:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON $(CMAKE_ARGS)

release-build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

asan-build: $(ASAN_BUILD)/CMakeCache.txt
	cmake --build $(ASAN_BUILD) -j$(JOBS)

$(TSAN_BUILD)/CMakeCache.txt:
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKILN_TSAN=ON $(CMAKE_ARGS)

tsan-build: $(TSAN_BUILD)/CMakeCache.txt
	cmake --build $(TSAN_BUILD) -j$(JOBS) --target $(TSAN_TESTS)

.PHONY: release-build asan-build tsan-build

build: deps
	$(MAKE) --no-print-directory release-build

test: deps
	$(MAKE) --no-print-directory release-build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)
	$(MAKE) --no-print-directory asan-build
	cd $(ASAN_BUILD) && ctest --output-on-failure -j$(JOBS)
	$(MAKE) --no-print-directory tsan-build
	cd $(TSAN_BUILD) && ctest --output-on-failure -j$(JOBS) -R '^($(subst $() ,|,$(TSAN_TESTS)))$$'

demo: deps
	$(MAKE) --no-print-directory release-build
	@if [ -x examples/demo.sh ]; then BUILD=$(BUILD) examples/demo.sh; \
	 else $(BUILD)/examples/mlp_train; fi

bench: bench-deps
	$(MAKE) --no-print-directory release-build
	BUILD=$(BUILD) bench/run.sh

# The GPT's weights from PyTorch into kiln and back, the logits compared (bench/torch_roundtrip.py);
# PyTorch comes from the bench's venv, so CI's `make test` never runs it.
torch-roundtrip: bench-deps
	$(MAKE) --no-print-directory release-build
	py=$$(bench/venv.sh $(BUILD)/venv) && $$py bench/torch_roundtrip.py $(BUILD)

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# ---- cross targets: an export for AArch64 (kiln_export_options.target), its program built with
# the cross compiler and libkiln_rt from source without OpenBLAS, run under qemu-user.
CROSS_DEPS   := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
CROSS_CC     ?= aarch64-linux-gnu-gcc
CROSS_RUN    ?= qemu-aarch64 -L /usr/aarch64-linux-gnu
CROSS_TARGET ?= aarch64-linux-gnu

cross-deps:
	$(call apt_ensure,$(DEPS) $(CROSS_DEPS))

test-cross: cross-deps
	$(MAKE) --no-print-directory release-build
	cd $(BUILD) && KILN_CROSS_CC='$(CROSS_CC)' KILN_CROSS_RUN='$(CROSS_RUN)' KILN_CROSS_TARGET='$(CROSS_TARGET)' \
	  ctest --output-on-failure -R '^test_export$$'

.PHONY: cross-deps test-cross

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD)

# ---- fuzzing: the libFuzzer targets of tests/fuzz, built with clang-19 in build-fuzz/
#
#   make fuzz-ci    each target FUZZ_CI_SECONDS (45) or 25000 inputs after its seed corpus, seed 1:
#                   bounded and repeatable, for CI
#   make fuzz       each target FUZZ_SECONDS (600)

FUZZ_BUILD      ?= build-fuzz
FUZZ_SECONDS    ?= 600
FUZZ_CI_SECONDS ?= 45
FUZZ_TARGETS    ?= fuzz_irtext fuzz_eager fuzz_compile fuzz_kcache fuzz_safetensors
FUZZ_DEPS       := clang-19 libclang-rt-19-dev

fuzz-deps:
	$(call apt_ensure,$(DEPS) $(FUZZ_DEPS))

$(FUZZ_BUILD)/CMakeCache.txt:
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKILN_FUZZ=ON -DCMAKE_C_COMPILER=clang-19 $(CMAKE_ARGS)

fuzz-build: $(FUZZ_BUILD)/CMakeCache.txt
	cmake --build $(FUZZ_BUILD) -j$(JOBS) --target kiln_fuzzers

fuzz: fuzz-deps
	$(MAKE) --no-print-directory fuzz-build
	tests/fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

fuzz-ci: fuzz-deps
	$(MAKE) --no-print-directory fuzz-build
	FUZZ_SEED=1 FUZZ_RUNS=25000 tests/fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_CI_SECONDS) $(FUZZ_TARGETS)

.PHONY: fuzz fuzz-ci fuzz-deps fuzz-build
