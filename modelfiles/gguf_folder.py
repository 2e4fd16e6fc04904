"""A GGUF file's config and tokenizer unpacked into a folder that HF loaders read (``config.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``), without torch.

The metadata is read with the ``gguf`` package; the config follows transformers' GGUF mapping and the
tokenizer is rebuilt by ``modelfiles.gguf_tokenizer``, so the folder is the one transformers' own GGUF
reader would write (the tests compare them). Files of an architecture or tokenizer model not covered here
go through transformers' reader, which needs torch (an engine node), as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from modelfiles.gguf_tokenizer import SUPPORTED_TOKENIZER_MODELS, build_gguf_tokenizer, tokenizer_model

# Bumped when what this module writes changes, so that folders written by an older version are not reused.
FOLDER_FORMAT = 2
# The metadata (vocabulary included) sits at the start of a GGUF; 16 MiB holds it for vocabularies up to
# ~260k tokens, and hashing it takes ~20 ms.
KEY_PREFIX_BYTES = 16 << 20

# general.architecture -> the metadata keys (after "<arch>.") transformers maps into its config
_COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# rope.dimension_count is the head size only in llama/mistral files (transformers' note)
CONFIG_KEYS: dict[str, dict[str, str]] = {
    "llama": {**_COMMON_KEYS, "rope.dimension_count": "head_dim"},
    "mistral": {**_COMMON_KEYS, "rope.dimension_count": "head_dim"},
    "qwen2": _COMMON_KEYS,
    "qwen3": _COMMON_KEYS,
}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


def content_key(gguf_path: Path) -> str:
    """A key from the file's size and its first bytes (not its path or mtime: pip sets the mtime at install
    time, and nodes that share a cache volume install at different times and places)."""
    digest = hashlib.sha256(f"pagedserve-gguf-folder-v{FOLDER_FORMAT}:{gguf_path.stat().st_size}:".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(KEY_PREFIX_BYTES))
    return digest.hexdigest()[:16]


def gguf_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """The unpacked folder of ``gguf_path`` under ``cache_dir``, written once (atomically: a rename)."""
    folder = cache_dir / f"{gguf_path.stem}-{content_key(gguf_path)}"
    if (folder / "done").is_file():
        return folder
    # unique across the nodes that share a cache volume (a pid alone is not)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_gguf_folder(gguf_path, tmp)
    (tmp / "done").write_text(json.dumps({"gguf": str(gguf_path), "format": FOLDER_FORMAT}))
    try:
        tmp.rename(folder)
    except OSError:  # another process won the race; its folder is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def write_gguf_folder(gguf_path: Path, folder: Path) -> None:
    metadata, tensor_names = read_metadata(gguf_path)
    architecture = str(metadata["general.architecture"])
    if architecture not in CONFIG_KEYS or tokenizer_model(metadata) not in SUPPORTED_TOKENIZER_MODELS:
        _write_with_transformers_reader(gguf_path, folder, architecture, tokenizer_model(metadata))
        return
    from transformers import CONFIG_MAPPING

    config_dict = gguf_config_dict(metadata, tensor_names)
    config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    config.save_pretrained(folder)
    built = build_gguf_tokenizer(metadata)
    _tokenizer_class(config)(tokenizer_object=built.tokenizer, **built.config).save_pretrained(folder)


def _tokenizer_class(config: Any) -> Any:
    """The class transformers' GGUF path wraps the tokenizer in (Qwen2's own, or the generic fast one): it is
    recorded in tokenizer_config.json, and ``AutoTokenizer`` loads the folder through it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    cls = TOKENIZER_MAPPING.get(type(config), PreTrainedTokenizerFast)
    if isinstance(cls, tuple):  # transformers 4: (slow, fast)
        cls = cls[1] or PreTrainedTokenizerFast
    # a GGUF is not in Mistral's own format, so transformers falls back to the generic class there
    return PreTrainedTokenizerFast if cls is None or cls.__name__ == "MistralCommonBackend" else cls


def read_metadata(gguf_path: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Every metadata key with its full value, and the tensor names (the ``gguf`` package; no torch)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    return metadata, tuple(tensor.name for tensor in reader.tensors)


def gguf_config_dict(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    """The config transformers' GGUF reader derives (``load_gguf_checkpoint``), for the families above."""
    architecture = str(metadata["general.architecture"])
    # transformers renames a llama file to mistral only when general.name is exactly "mistral"
    model_type = "mistral" if architecture == "llama" and metadata.get("general.name") == "mistral" else architecture
    config: dict[str, Any] = {
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "model_type": model_type,
    }
    if "general.name" in metadata:
        config["_model_name_or_path"] = metadata["general.name"]
    for suffix, name in CONFIG_KEYS[model_type].items():
        if f"{architecture}.{suffix}" in metadata:
            config[name] = metadata[f"{architecture}.{suffix}"]
    for key, name in _TOKEN_ID_KEYS.items():
        if key in metadata:
            config[name] = metadata[key]
    config.setdefault("vocab_size", len(metadata["tokenizer.ggml.tokens"]))
    return config


def _write_with_transformers_reader(
    gguf_path: Path, folder: Path, architecture: str, tokenizer_model: str | None
) -> None:
    """The files transformers' GGUF reader writes: any architecture it knows, but it imports torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{gguf_path.name}: GGUF architecture {architecture!r} with tokenizer model {tokenizer_model!r} "
            f"is unpacked by transformers' GGUF reader, which needs torch (not installed on API nodes). "
            f"Without torch: architectures {sorted(CONFIG_KEYS)}, tokenizer models {list(SUPPORTED_TOKENIZER_MODELS)}; "
            "or start a worker (with torch) on the same PAGEDSERVE_CACHE first"
        ) from None
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(folder)
