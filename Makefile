# Etude: `make` lists the targets. CI runs `make test` and nothing else.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PY     := $(VENV)/bin/python
ETUDE  := $(VENV)/bin/etude
CONFIG ?= configs/local.toml
STAMP  := $(VENV)/.etude-setup

.PHONY: help setup run test lint proto bench chart clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv with pinned dependencies (+ redis-server, bubblewrap via apt when root)

$(STAMP): pyproject.toml tools/setup.sh
	tools/setup.sh $(VENV)
	@touch $(STAMP)

run: setup ## start Redis, the object store and the five services (configs/local.toml)
	$(ETUDE) run --config $(CONFIG)

test: setup lint ## lint, stub drift check, then the whole test suite
	$(PY) -m pytest -q

lint: setup ## ruff, mypy, generated-stub drift check
	$(VENV)/bin/ruff check services tests tools
	$(VENV)/bin/ruff format --check services tests tools
	$(VENV)/bin/mypy
	$(PY) tools/protogen.py --check

proto: setup ## regenerate services/api/v1 from proto/
	$(PY) tools/protogen.py

bench: setup ## run every benchmark (etude bench <name> --json)
	$(ETUDE) bench all --json

chart: ## render + lint + validate the Helm chart
	@if [ ! -d deploy/helm/etude ]; then \
	  echo "deploy/helm/etude does not exist yet: the chart is its own issue ([helm])." >&2; exit 1; fi

clean: ## remove the venv and local run state
	rm -rf $(VENV) .etude .mypy_cache .ruff_cache .pytest_cache
