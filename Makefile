# The two commands a newcomer needs: `make demo` (the main job) and `make test`.
# Each creates .venv on first use and installs torch==2.13.0, then paratron.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo finetune-demo test lint format bench docs setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/paratron train --config demo

finetune-demo: $(STAMP)
	$(PY) scripts/finetune_demo.py

test: lint
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench scripts
	$(VENV)/bin/ruff format --check src tests bench scripts

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests bench scripts
	$(VENV)/bin/ruff format src tests bench scripts

bench: $(STAMP)
	$(PY) bench/step_time.py

docs: $(STAMP)
	$(PY) -c "from paratron.config.arguments import markdown_reference; print(markdown_reference(), end='')" > docs/.flags.md.tmp
	mv docs/.flags.md.tmp docs/flags.md
	$(PY) -c "from paratron.config.arguments import refresh_megatron_doc; refresh_megatron_doc('docs/megatron.md')"

clean:
	rm -rf runs .pytest_cache
