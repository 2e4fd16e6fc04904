"""deploy/Dockerfile copies what ``pip install .`` builds from: every package pyproject.toml lists (the worker
image once lacked ``worker/``, so ``pagedserve worker`` died on an ImportError) and the readme it names; base
image pinned; both images run unprivileged. (Building the images needs Docker: see test_compose.py.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()


def test_every_package_and_the_readme_are_copied() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in patterns}
    assert all((ROOT / p / "__init__.py").exists() or (ROOT / p).is_dir() for p in packages)
    copied = set(re.findall(r"^COPY (\S+) \./\1$", DOCKERFILE, re.MULTILINE))
    assert packages <= copied, sorted(packages - copied)
    assert re.search(rf"^COPY pyproject\.toml .*{project['project']['readme']}", DOCKERFILE, re.MULTILINE)


def test_base_image_is_pinned_and_images_run_unprivileged() -> None:
    (base,) = re.findall(r"^FROM (\S+) AS base$", DOCKERFILE, re.MULTILINE)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base), base
    stages = DOCKERFILE.split("\nFROM ")[1:]
    for stage in stages:
        if stage.split()[2] in ("api", "worker"):
            assert "\nUSER 10001\n" in stage, stage.split()[2]  # deploy/k8s runs them as uid 10001
