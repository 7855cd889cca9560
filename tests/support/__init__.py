"""Helpers the tests share: imported from here, never from another test module. Fixtures stay in
the conftest.py files."""

from pathlib import Path

ROOT = Path(__file__).parents[2]
REPOSITORY = ROOT / "deploy" / "models"  # the demo repository
