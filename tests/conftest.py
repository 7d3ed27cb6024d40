import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    return write_model_dir(ModelCfg(), tmp_path_factory.mktemp("model"))


@pytest.fixture
def tiny_model(model_dir):
    from prl.model.build import build_model

    return build_model(model_dir, seed=0)


def prl_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "prl", *map(str, args)]
