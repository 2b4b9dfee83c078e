# One-command set-up: `make demo` and `make test` create the virtual environment when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DIR ?= demo

.PHONY: venv test test-fast demo clean-demo help

help:
	@echo "make test   - create $(VENV) if missing, install cxrdr[dev,offline], run the test suite"
	@echo "make demo   - create $(VENV) if missing, run the offline end-to-end demo into $(DEMO_DIR)/ (made afresh)"
	@echo "variables: VENV=path (default .venv), DEMO_DIR=path (default demo), TEST_WORKERS=n (default 2)"

venv: $(VENV)/.installed

# Re-install whenever pyproject.toml changes. torch>=2.14 comes from the package registry
# (the local 2.13 CPU wheel breaks torchvision/open_clip); the registry build also runs on CPU.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[dev,offline]"
	touch $@

# Test files spread over TEST_WORKERS processes (pytest-xdist; one torch thread each, tests/conftest.py):
# a file's tests stay together, so a module's fixtures (one Ray, one build) are made once.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# A demo run starts from an empty folder: the shards of a previous run already hold its added teacher,
# and a build refuses a folder made with other settings.
demo: venv clean-demo
	PATH="$(abspath $(BIN)):$$PATH" bash scripts/demo.sh $(DEMO_DIR)

clean-demo:
	rm -rf $(DEMO_DIR)
