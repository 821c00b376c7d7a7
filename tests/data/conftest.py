"""Fixtures and helpers shared by the data tests."""

from __future__ import annotations

import io

import pytest
from PIL import Image


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from jaxvrl.data import default_tokenizer_path

    return AutoTokenizer.from_pretrained(default_tokenizer_path())


def png(color=(255, 0, 0), size=(40, 40)) -> bytes:
    """A one-colour PNG image's bytes."""
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()
