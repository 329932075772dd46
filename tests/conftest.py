import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
AIMET_DATA = SHARED / "data" / "aimet"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"reference data missing: {path} (the team's shared/ folder must sit beside the repo)")
    return path


@pytest.fixture(scope="session")
def golden():
    from safetensors.torch import load_file

    tensors = load_file(_need(AIMET_DATA / "golden_seed0.safetensors"))
    meta = json.loads(_need(AIMET_DATA / "golden_seed0.json").read_text())
    return meta, tensors


@pytest.fixture(scope="session")
def analyzer_ref():
    from safetensors.torch import load_file

    tensors = load_file(_need(AIMET_DATA / "analyzers_seed0.safetensors"))
    meta = json.loads(_need(AIMET_DATA / "analyzers_seed0.json").read_text())
    return meta, tensors
