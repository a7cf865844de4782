# make test: create .venv if missing, install the package editable with its test extras, lint, run pytest.
# make test-fast: the same without runner processes, packaging, tools and slow tests (markers by kind,
#   from the folder a test lives in, tests/{sql,schedules,runner,packaging,tools}/; and slow).
# make freeze REV=NNNN: at a release, copy sql/src's code files into sql/NNNN/code/ (docs/design.md).
# make expected: rewrite the schedule traces tests/expected/*/*.out (then review git diff).
# Extra pytest arguments: make test PYTEST_ARGS="-k migrations -x"
PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DEMO_ARGS ?=
STORM_ARGS ?=

FAST_MARKERS := not runner and not packaging and not tools and not slow

.PHONY: test test-fast lint format expected clean demo freeze storm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,metrics]'
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check runner tests alembic
	$(BIN)/ruff format --check runner tests alembic

format: $(STAMP)
	$(BIN)/ruff check --fix runner tests alembic
	$(BIN)/ruff format runner tests alembic

test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

test-fast: lint
	$(BIN)/pytest -q -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

expected: $(STAMP)
	$(BIN)/pytest -q -m "schedules or sql" --update-expected $(PYTEST_ARGS)

freeze:
	@test -n "$(REV)" || { echo "make freeze REV=NNNN" >&2; exit 2; }
	@test -f sql/$(REV)/up.sql || { echo "sql/$(REV)/up.sql: no such revision to freeze" >&2; exit 2; }
	@test ! -e sql/$(REV)/code || { echo "sql/$(REV)/code exists: revision $(REV) is frozen already" >&2; exit 2; }
	mkdir sql/$(REV)/code
	cp $$(ls sql/src/[0-9][0-9]_*.sql | grep -v '/01_schema.sql$$') sql/$(REV)/code/

# make storm: app clients and runners at once, then every invariant (docs/storm.md). STORM_ARGS="--seconds 300"
storm: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m lab.storm $(STORM_ARGS)

# make demo: lockstep vs the naive jobs on the example (docs/demo.md). make demo DEMO_ARGS="--parents 5000"
demo: | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[demo]'
	$(BIN)/lockstep demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) dist build .pytest_cache .ruff_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
