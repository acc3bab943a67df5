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

# Two pytest-xdist workers: the suite leaves a third of 2 cores idle run serially (one-process
# phases of multi-process tests); tests/conftest.py keeps on one worker what must not run
# beside itself (its scheduler groups by module).
TEST_WORKERS ?= 2

test: setup lint chart ## lint, stub drift check, chart check, then the whole test suite
	$(PY) -m pytest -q -n $(TEST_WORKERS)

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

# One Dockerfile, built once per service (make image-<service> builds one); trainer and
# inference start from CUDA_BASE, the others from the Dockerfile's slim Python
# (BASE_IMAGE_<service>=... changes one; FLAVOR=cpu with an Ubuntu base: CPU inference).
SERVICES  := reconciler envs inference trainer evals
CUDA_BASE ?= nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04
BASE_IMAGE_trainer   ?= $(CUDA_BASE)
BASE_IMAGE_inference ?= $(CUDA_BASE)

images: $(SERVICES:%=image-%) ## build the five service images (docker; REGISTRY=... TAG=... to name them)

image-%:
	docker build --build-arg SERVICE=$* $(if $(BASE_IMAGE_$*),--build-arg BASE_IMAGE=$(BASE_IMAGE_$*)) \
	  $(if $(FLAVOR),--build-arg FLAVOR=$(FLAVOR)) -t $(or $(REGISTRY),etude)/etude-$*:$(or $(TAG),dev) .

clean: ## remove the venv and local run state
	rm -rf $(VENV) .etude .mypy_cache .ruff_cache .pytest_cache
