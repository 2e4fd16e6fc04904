"""``docker compose config`` accepts deploy/docker-compose.yml (skipped where Docker Compose is absent)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="docker compose is not installed")
def test_compose_config_is_valid() -> None:
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
