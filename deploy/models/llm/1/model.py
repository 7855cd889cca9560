import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "ragkit"))
from ragkit import LlmV1 as TritonPythonModel  # noqa: E402,F401
