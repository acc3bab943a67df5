# Etude: `make` lists the targets. CI runs `make test` and nothing else.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PY     := $(VENV)/bin/python
ETUDE  := $(VENV)/bin/etude
CONFIG ?= configs/local.toml
STAMP  := $(VENV)/.etude-setup

.PHONY: help setup run test lint proto bench chart images clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv with pinned dependencies (+ redis-server, bubblewrap via apt when root)

$(STAMP): pyproject.toml tools/setup.sh
	tools/setup.sh $(VENV)
	@touch $(STAMP)

run: setup ## start Redis, the object store and the five services (configs/local.toml)
	$(ETUDE) run --config $(CONFIG)

test: setup lint chart ## lint, stub drift check, chart check, then the whole test suite
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

chart: setup ## render + lint + validate the Helm chart
	$(PY) tools/chart_check.py

images: ## build the five service images (docker; REGISTRY=... TAG=... to name them)
	for svc in reconciler envs inference trainer evals; do \
	  docker build -f services/$$svc/Dockerfile -t $(or $(REGISTRY),etude)/etude-$$svc:$(or $(TAG),dev) . || exit 1; \
	done

clean: ## remove the venv and local run state
	rm -rf $(VENV) .etude .mypy_cache .ruff_cache .pytest_cache
