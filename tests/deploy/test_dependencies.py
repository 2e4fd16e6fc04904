"""The installed dependencies import beside this repo's packages (run from the repo root, as every role is)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_transformers_imports_with_the_repo_on_the_path() -> None:
    """transformers 5.25 imports Hugging Face's ``kernels`` package at start when it is installed, and this
    repo's top-level ``kernels`` shadows it: every worker died at start (a fresh install on 2026-12-03).
    pyproject.toml pins transformers below 5.25; this fails if an install brings that import back."""
    code = "import transformers.activations, transformers.models.llama.configuration_llama"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
