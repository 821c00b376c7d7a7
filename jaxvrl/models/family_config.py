"""What every vision-language family's config shares: the special token ids, the tied head,
bos/eos, the keys of `config.json` it does not read (kept so that export writes them back),
and the HF I/O around them. A family's config subclasses `VLConfig`, adds `text` and `vision`,
and reads and writes their parts of `config.json` itself."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxvrl.config import ConfigError
from jaxvrl.models.config import freeze, jsonable, thaw

# the special tokens' ids with Qwen's values as defaults
SPECIAL_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
# top-level keys of config.json that VLConfig reads
SHARED_KEYS = {"text_config", "vision_config", "model_type", "tie_word_embeddings", *SPECIAL_IDS}


@dataclasses.dataclass(frozen=True)
class VLConfig:
    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""  # the transformers class config.json names
    image_token_id: int = SPECIAL_IDS["image_token_id"]
    video_token_id: int = SPECIAL_IDS["video_token_id"]
    vision_start_token_id: int = SPECIAL_IDS["vision_start_token_id"]
    vision_end_token_id: int = SPECIAL_IDS["vision_end_token_id"]
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] | None = 151645
    # Anything else in config.json (kept so that export writes it back).
    extra: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def check_type(cls, d: dict, source: str) -> None:
        if d.get("model_type") != cls.model_type:
            raise ConfigError(
                f"{source}: model_type {d.get('model_type')!r} is not {cls.model_type!r}"
            )

    @classmethod
    def shared_from_hf(cls, d: dict, text_d: dict, known: set, bos=None) -> dict:
        """The shared fields' values from config.json `d` and its text part `text_d`; keys of
        `d` outside `known` and SHARED_KEYS are kept in `extra`. bos: the default bos id."""
        known = known | SHARED_KEYS
        extra = sorted((k, v) for k, v in d.items() if k not in known and jsonable(v))
        eos = text_d.get("eos_token_id", d.get("eos_token_id", 151645))
        tie = d.get("tie_word_embeddings", False) or text_d.get("tie_word_embeddings", False)
        return dict(
            **{k: int(d.get(k, v)) for k, v in SPECIAL_IDS.items()},
            tie_word_embeddings=bool(tie),
            bos_token_id=text_d.get("bos_token_id", d.get("bos_token_id", bos)),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            extra=tuple((k, freeze(v)) for k, v in extra),
        )

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json"):
        raise NotImplementedError

    @property
    def eos_json(self):
        """eos_token_id as config.json writes it (a list for several)."""
        eos = self.eos_token_id
        return list(eos) if isinstance(eos, tuple) else eos

    def shared_to_hf(self) -> dict:
        """The kept keys, then the architecture, model type, special ids and tied head."""
        d = {k: thaw(v) for k, v in self.extra}
        d.update(architectures=[self.architecture], model_type=self.model_type)
        d.update({k: getattr(self, k) for k in SPECIAL_IDS})
        d["tie_word_embeddings"] = self.tie_word_embeddings
        return d
