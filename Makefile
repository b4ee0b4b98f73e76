# The two commands a newcomer needs: `make demo` (the main job) and `make test`; while working,
# `make test-fast` runs the tests that start no process (`make test` before landing a change).
# Each creates .venv on first use and installs torch==2.13.0, then paratron: the demo only
# what paratron needs to run, the tests its test extras too (pytest, ruff and the references
# the tests compare with: megatron-core, transformers, peft, the openai client, lm-evaluation-harness).

PYTHON ?= python3
TEST_WORKERS ?= 2
# (`make test` runs the suite on TEST_WORKERS processes: most tests wait on process start-up and on each other's
# ranks, so two workers share two cores well)
VENV   := .venv
PY     := $(VENV)/bin/python
RUN_STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo finetune-demo vlm-demo test test-fast lint format bench docs setup clean

setup: $(TEST_STAMP)

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

demo: $(RUN_STAMP)
	$(VENV)/bin/paratron train --config demo

finetune-demo: $(RUN_STAMP)
	$(PY) scripts/finetune_demo.py

vlm-demo: $(RUN_STAMP)
	$(PY) scripts/vlm_demo.py

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not spawns"

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests bench scripts
	$(VENV)/bin/ruff format --check src tests bench scripts

format: $(TEST_STAMP)
	$(VENV)/bin/ruff check --fix src tests bench scripts
	$(VENV)/bin/ruff format src tests bench scripts

bench: $(RUN_STAMP)
	$(PY) bench/step_time.py

docs: $(RUN_STAMP)
	$(PY) -c "from paratron.config.arguments import markdown_reference; print(markdown_reference(), end='')" > docs/.flags.md.tmp
	mv docs/.flags.md.tmp docs/flags.md
	$(PY) -c "from paratron.config.arguments import refresh_megatron_doc; refresh_megatron_doc('docs/megatron.md')"

clean:
	rm -rf runs .pytest_cache
