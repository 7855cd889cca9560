import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "ragkit"))
from ragkit import RerankerV2 as TritonPythonModel  # noqa: F401
