# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell md5sum pyproject.toml | cut -c1-8)

.PHONY: demo test lint unit integration e2e bench screenshots os-deps clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[fleet,dev]'
	@rm -f $(VENV)/.installed-* && touch $@

os-deps:
	@deploy/bin/os-deps

demo: $(STAMP) os-deps
	@deploy/bin/demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	DEBUG=true $(BIN)/mypy .

unit: $(STAMP)
	$(BIN)/pytest -n 2 tests/unit

# The integration tests mostly wait on real services: three files at a time, each worker with a
# fleet, a Redis, a Celery worker and a database of its own; then those that measure the host.
integration: $(STAMP) os-deps
	$(BIN)/pytest -n 3 --dist loadfile -m "not alone" tests/integration
	$(BIN)/pytest -m alone tests/integration

e2e: $(STAMP) os-deps
	$(BIN)/pytest -n 2 --dist loadfile tests/e2e

# One run per layer, each saying its time and its slowest tests; the browser tests beside the
# integration tests, three files at a time (they mostly wait on their services): tests/layers.
test: $(STAMP) os-deps lint
	tests/layers

# The README's pictures, taken by the browser tests that check those pages (tests/support/browser.py).
screenshots: $(STAMP) os-deps
	README_SCREENSHOTS=1 $(BIN)/pytest tests/e2e/test_login.py tests/e2e/test_registry.py \
		tests/e2e/test_metrics_page.py

# Figures that count are taken on PostgreSQL, as production runs; BENCH_DATABASE_URL overrides.
BENCH_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
# The pages' server time first, in a session of its own: after the other benchmarks their
# fleets and Prometheus still share the machine's cores (overview 186 ms then, 123 ms alone).
bench: $(STAMP) os-deps
	DATABASE_URL=$(BENCH_DATABASE_URL) $(BIN)/pytest tests/bench/test_pages.py -p no:cacheprovider -s
	DATABASE_URL=$(BENCH_DATABASE_URL) $(BIN)/pytest tests/bench -p no:cacheprovider -s \
		--ignore=tests/bench/test_pages.py

clean:
	rm -rf var/devfleet var/test-* var/screenshots
