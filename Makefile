# make test: create .venv if missing, install the package editable with its test extras, lint, run pytest.
# Extra pytest arguments: make test PYTEST_ARGS="-k migrations -x"
PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DEMO_ARGS ?=

.PHONY: test lint clean demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,metrics]'
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check runner tests alembic

test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

# make demo: lockstep vs the naive jobs on the example (docs/demo.md). make demo DEMO_ARGS="--parents 5000"
demo: | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[demo]'
	$(BIN)/lockstep demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) dist build .pytest_cache .ruff_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
