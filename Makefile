# README's two commands: `make serve` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup sysdeps serve test bench gpu-check clean

setup: $(STAMP)

# Every package from the hash-locked requirements/dev.lock (requirements/compile.sh writes it),
# then the project itself, editable, with nothing more resolved or fetched.
$(STAMP): pyproject.toml requirements/dev.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r requirements/dev.lock
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check
	touch $(STAMP)

serve: setup
	$(BIN)/softmoe serve

test: setup sysdeps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The suite as a machine without AVX-512 runs it (docs/design.md, "Determinism, as a guarantee"): torch's own kernels, oneDNN,
# MKL and numpy held to AVX2 by their documented switches. ONNX Runtime has no such switch (MLAS
# reads CPUID); `make test-haswell` runs the CPU-sensitive tests, ONNX Runtime's included, under
# qemu-user's Haswell CPU (no AVX-512), which every library sees.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
	NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
CPU_SENSITIVE := tests/models/test_batch_invariance.py tests/export/test_token_mean.py \
	tests/server/test_routing.py::test_shipped_profile_is_reproducible tests/server/test_startup_line.py
.PHONY: test-avx2 pytest-avx2 test-haswell
# Haswell less the system features qemu's TCG does not emulate (each would print a warning).
HASWELL := Haswell-noTSX,-pcid,-x2apic,-tsc-deadline,-invpcid
test-avx2: setup sysdeps
	@$(MAKE) --no-print-directory pytest-avx2
# The same without the set-up (tests/test_other_cpu.py runs the CPU-sensitive tests this way).
pytest-avx2:
	$(AVX2_ENV) $(BIN)/python -m pytest $(PYTEST_ARGS)

test-haswell: setup
	@command -v qemu-x86_64 >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-user >/dev/null)
	qemu-x86_64 -cpu $(HASWELL) $(BIN)/python -m pytest -p no:cacheprovider $(CPU_SENSITIVE) $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m loadtests.bench

# GPU tests, parity, determinism and timings, ending with one JSON line (loadtests/gpu_check.py).
# Installs nothing except, with WHEELS=DIR, the wheels in DIR (offline). Without a CUDA device the
# check prints one line and exits 77; make reports that as its own failure ("Error 77", status 2).
# GPU_PY: an interpreter with a CUDA build of torch (default: the venv's, else $(PY)).
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
gpu-check:
	@$(GPU_PY) -m loadtests.gpu_check $(if $(WHEELS),--wheels $(WHEELS))

clean:
	rm -rf $(VENV) build *.egg-info

# System tools the tests use (Debian): Prometheus server + promtool for the real-Prometheus tests,
# chromium and its driver for the page test (tests/server/test_page.py).
SYSDEPS := prometheus chromium chromium-driver
sysdeps:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 && \
	  command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSDEPS) >/dev/null)

# Locks and images (docs/gpu-stack.md). `lock` regenerates requirements/*.lock and constraints.txt;
# `base-image` makes softmoe-base/debian:bookworm from Debian packages (no image registry needed);
# `image-check` builds both images with BuildKit and checks them (needs a Docker engine).
.PHONY: lock base-image image-check
lock: setup
	requirements/compile.sh

base-image:
	deploy/images/make-base.sh

image-check:
	deploy/images/check.sh
