"""The trainer tests' tiny checkpoint (tests/models/hf_tiny.py), saved and loaded once per
module."""

import pytest

from jaxvrl.models import qwen2_5_vl as q
from tests.models import hf_tiny as T


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("step_model")
    T.build(path, seed=11)
    return path


@pytest.fixture(scope="module")
def model(ckpt):
    return q.load(ckpt)
