"""``loadtest/gpu_session.sh``'s card guard: with REQUIRE_CARD set and another card (here none), the script stops
before any work, so a device call lent the wrong card costs only the machine's start."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "loadtest" / "gpu_session.sh"


def test_a_required_card_that_is_not_there_stops_the_script(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "REQUIRE_CARD": "NoSuchCard", "OUT": str(out)}
    done = subprocess.run(["bash", str(SCRIPT), "xc"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "not a NoSuchCard: stopped before any work"
    assert not out.exists()  # stopped before making its output folder, so before any stage
