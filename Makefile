# The two commands a newcomer needs: `make serve` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# Re-install only when the dependency list changes.
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# The suite over every core: each file's tests (or a group's, tests/conftest.py)
# on one pytest-xdist worker, so a server a module or group starts is started once.
PARALLEL ?= -n auto --dist loadfile
# Bytecode caches even where the shell turns them off: every test process,
# server and stack role would otherwise compile every module from source, and
# pytest rewrite each test module's asserts, again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install serve test test-fast lint-imports clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=24"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/python -m llm_core.kv.cpu_kernels
	$(BIN)/python -m llm_core.kv.tiers.kv_transfer
	@touch $(STAMP)

serve: install
	@echo "Starting Swallow (default demo model) -- the demo page will be at http://$(HOST):$(PORT)/"
	$(BIN)/swallow serve --host $(HOST) --port $(PORT)

test: install lint-imports
	$(BIN)/python -m pytest -q $(PARALLEL) $(PYTEST_ARGS)

# The unit tier: everything but the files tests/conftest.py names as integration (serial:
# two workers would each spend longer collecting than the tier takes to run).
test-fast: install lint-imports
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The import rules of .importlinter: layers, no cycles, the stack's roles apart.
lint-imports: install
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) .pytest_cache .swallow
