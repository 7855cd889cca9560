"""The production tools the deploy artifacts are checked with (helm, promtool), as
deploy/bin/os-deps installs them."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not on PATH: deploy/bin/os-deps installs it")
    return path


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
