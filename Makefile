# Front door. Each target installs the Debian packages it needs when they are
# missing (and does nothing, needing no root, when they are all there).
#
#   make          release build in build/
#   make test     release build + its tests, then the sanitized test build in build-asan/ + its tests
#   make demo     release build, then the demo
#   make bench    release build, then the benchmarks, kiln against PyTorch
#   make clean

BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= 2
CMAKE_ARGS ?=

DEPS       := cmake pkg-config build-essential llvm-19-dev libopenblas-dev check python3-numpy
BENCH_DEPS := python3-torch python3-matplotlib

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

.PHONY: all build deps bench-deps configure test test-release test-asan demo bench clean

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

.PHONY: release-build asan-build

build: deps
	$(MAKE) --no-print-directory release-build

test: deps
	$(MAKE) --no-print-directory release-build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)
	$(MAKE) --no-print-directory asan-build
	cd $(ASAN_BUILD) && ctest --output-on-failure -j$(JOBS)

demo: deps
	$(MAKE) --no-print-directory release-build
	@if [ -x examples/demo.sh ]; then BUILD=$(BUILD) examples/demo.sh; \
	 else $(BUILD)/examples/mlp_train; fi

bench: bench-deps
	$(MAKE) --no-print-directory release-build
	BUILD=$(BUILD) bench/run.sh

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
