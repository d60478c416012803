# The README's two commands are `make demo` and `make test`; both set up
# .venv from the pinned requirements when it is missing.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast lint model-store clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m packrat_plugin.cli demo

# The suites start hundreds of Python processes (test workers, TorchServe workers, controllers, CLIs), and
# each one compiles every repo module it imports unless its bytecode is cached: so the tests write bytecode
# even where the environment says not to (collecting the unit tests: 19 s without the cache, 12.5 s with it).
test test-fast: export PYTHONDONTWRITEBYTECODE :=

# The unit tests run on the machine's cores (at most four processes: 2:48-3:08 against 4:26-4:30 in one
# process on the 2-vCPU VM); the serving tests in one, since they time loads and pin workers to cores.
# Both always run; the target fails if either did.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q --durations=15 -n auto --maxprocesses 4 tests/unit; unit=$$?; \
	$(BIN)/python -m pytest -q --durations=25 tests/gpu tests/serving; serving=$$?; \
	test $$unit -eq 0 && test $$serving -eq 0

# The unit tests a developer reruns dozens of times an hour: no TorchServe, no Java, no GPU, and none
# marked slow (those compile, train or start processes; `make test` runs them). Budget: 3 min on 2 cores.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q tests/unit -m "not slow" -n auto --maxprocesses 4

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

model-store: $(STAMP)
	$(BIN)/packrat archive --all

clean:
	rm -rf model_store/archives logs .pytest_cache
