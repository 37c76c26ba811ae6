# README's two commands: `make serve` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup sysdeps serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

serve: setup
	$(BIN)/softmoe serve

test: setup sysdeps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m loadtests.bench

clean:
	rm -rf $(VENV) build *.egg-info

# System tools the tests use (Debian): Prometheus server + promtool for the real-Prometheus tests.
sysdeps:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null)
