"""vLLM's ``--generation-config``: request defaults from a checkpoint's ``generation_config.json``.

``auto`` (vLLM's default and this server's) reads the model folder's file, a folder reads that folder's, and
``vllm`` ignores the file (the server's own defaults). As in vLLM only the sampling fields count, and only
where a request leaves them out: what a client sends always wins."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

logger = logging.getLogger(__name__)

# generation_config.json key -> the request field it is the default of
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
Req = TypeVar("Req", bound=BaseModel)


def load_generation_defaults(setting: str, model_folder: Path) -> dict[str, Any]:
    """The request defaults ``setting`` names (``{}`` for ``vllm`` or a file without sampling fields).
    Raises ``ValueError`` for a folder without the file or a file that is not a JSON object."""
    if setting == "vllm":
        return {}
    folder = model_folder if setting == "auto" else Path(setting)
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting == "auto":
            return {}
        raise ValueError(f"--generation-config {setting}: no generation_config.json in that folder")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    defaults = {field: data[key] for key, field in _FIELDS.items() if data.get(key) is not None}
    if defaults:
        logger.info("request defaults from %s: %s (a request's own values win)", path, defaults)
    return defaults


def with_defaults(req: Req, defaults: dict[str, Any]) -> Req:
    """``req`` with the defaults it did not set itself (a chat request's ``max_completion_tokens`` counts as
    setting ``max_tokens``)."""
    given = req.model_fields_set
    fields = type(req).model_fields
    missing = {
        k: v
        for k, v in defaults.items()
        if k in fields and k not in given and not (k == "max_tokens" and "max_completion_tokens" in given)
    }
    return req.model_copy(update=missing) if missing else req
