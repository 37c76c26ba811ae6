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

bench: setup
	$(BIN)/python -m loadtests.bench

# GPU tests, parity, determinism and timings, ending with one JSON line (loadtests/gpu_check.py).
# Installs nothing except, with WHEELS=DIR, the wheels in DIR (offline). Without a CUDA device it
# prints one line and exits 77. GNU make exits 2 on any failed recipe, so for this goal only the
# Makefile compiles and loads loadtests/make/exit_status.c, which gives make an $(exit-status N)
# function; with no C compiler, make falls back to its own "Error 77" and status 2.
# GPU_PY: an interpreter with a CUDA build of torch (default: the venv's, else $(PY)).
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
GPU_CHECK_RC := build/gpu-check.rc
ifneq ($(filter gpu-check,$(MAKECMDGOALS)),)
EXIT_SO := build/make-exit-status.so
-load $(EXIT_SO)(exit_status_gmk_setup)
$(EXIT_SO): loadtests/make/exit_status.c
	@mkdir -p $(@D) && ($(CC) -shared -fPIC -O2 -o $@ $< 2>/dev/null || rm -f $@)
endif
.PHONY: gpu-check-run
gpu-check-run:
	@mkdir -p $(dir $(GPU_CHECK_RC)); rm -f $(GPU_CHECK_RC)
	@$(GPU_PY) -m loadtests.gpu_check $(if $(WHEELS),--wheels $(WHEELS)); echo $$? > $(GPU_CHECK_RC)
gpu-check: gpu-check-run
	@$(if $(filter $(EXIT_SO),$(.LOADED)),$(exit-status $(file < $(GPU_CHECK_RC))),exit $$(cat $(GPU_CHECK_RC)))

clean:
	rm -rf $(VENV) build *.egg-info

# System tools the tests use (Debian): Prometheus server + promtool for the real-Prometheus tests.
sysdeps:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null)

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
