"""rollout.slots=auto (`setup.rollout_slots`): the slots engine where its decode steps read
pages in place (TPUs' paged kernel) or rows are carried across steps, a slot per row of the
step, or as many as fit beside the decode weights in rollout.memory_fraction of a device's
memory (checked against the bytes written out by hand), else the static sampler."""

from __future__ import annotations

import pytest

from jaxvrl.config import ConfigError, load_config
from jaxvrl.models.config import TextConfig
from jaxvrl.parallel import sharding as S
from jaxvrl.parallel import topology as T
from jaxvrl.trainer.setup import rollout_slots

# 2 layers, 2 KV heads of 8, hidden 16, 4 query heads, MLP 32, vocabulary 64
TEXT = TextConfig(
    hidden_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    intermediate_size=32,
    vocab_size=64,
)
KEYS = ["prompts_per_step=4", "rollout.num_generations=4", "data.max_prompt_length=20",
        "rollout.max_new_tokens=30", "rollout.page_size=8", "model.dtype=float32"]  # fmt: skip


def config(*more):
    return load_config("configs/grpo.py", [*KEYS, *more])


@pytest.fixture(scope="module")
def tpu_mesh():
    """A rollout mesh of 4 TPU chips (compile-only devices): rows over data 2, tensor 2."""
    return S.make_mesh(data=2, fsdp=1, tensor=2, devices=T.tpu_devices(T.parse("v5e-4")))


def by_hand(c, tensor: int) -> tuple[float, float]:
    """(fixed, slot): a device's bytes beside its slots' own pages (the decode weights over
    tensor, the prompts' pages), and one slot's pages; in bfloat16 (the rollout's dtype on
    TPUs), the pages split over the KV heads."""
    d, q, kv, f, v, layers = 16, 4 * 8, 2 * 8, 32, 64, 2
    weights = (layers * (d * (q + 2 * kv) + q * d + 3 * d * f) + d * v) * 2
    position = 2 * layers * kv * 2 / tensor  # K and V of every layer, a device's heads
    prompts = c.prompts_per_step * 24  # 20 positions in pages of 8
    if c.rollout.partial:  # each carried row a prompt of its own: prompt + completion
        prompts = 8 * 4 * 56  # oversample 2 x 4 prompts x 4 rows, 50 positions in pages of 8
    return weights / tensor + prompts * position, 32 * position  # 30 positions a slot


def test_a_set_count_is_kept_and_auto_is_static_where_pages_are_gathered(tpu_mesh):
    assert rollout_slots(config("rollout.slots=3"), TEXT, tpu_mesh) == 3
    assert rollout_slots(config("rollout.slots=0"), TEXT, tpu_mesh) == 0
    # the CPU's decode steps gather pages: the static sampler, unless rows are carried
    assert rollout_slots(config(), TEXT) == 0
    assert rollout_slots(config("rollout.partial=true"), TEXT) == 16
    # the dense form asked for on TPUs gathers pages too
    assert rollout_slots(config("rollout.decode_attention=dense"), TEXT, tpu_mesh) == 0


def test_auto_on_tpus_is_a_slot_per_row_of_every_process(tpu_mesh):
    assert rollout_slots(config(), TEXT, tpu_mesh, hbm=16 * 2**30) == 16
    assert rollout_slots(config(), TEXT, tpu_mesh, processes=2, hbm=16 * 2**30) == 32
    assert rollout_slots(config(), TEXT, tpu_mesh) == 16  # no memory figure: no cap


@pytest.mark.parametrize("partial", [False, True])
def test_auto_fits_the_slots_in_the_memory_share(tpu_mesh, partial):
    c = config(f"rollout.partial={partial}", "rollout.memory_fraction=0.25")
    fixed, slot = by_hand(c, 2)
    for fit in (1, 2, 5, 11):
        hbm = (fixed + (fit + 0.5) * slot) / 0.25
        want = fit // 2 * 2 if fit >= 2 else fit  # a multiple of the 2 row groups
        assert rollout_slots(c, TEXT, tpu_mesh, hbm=hbm) == want, fit
    assert rollout_slots(c, TEXT, tpu_mesh, hbm=(fixed + 40 * slot) / 0.25) == 16  # the rows
    with pytest.raises(ConfigError, match=r"rollout.slots=auto: one slot.*memory_fraction"):
        rollout_slots(c, TEXT, tpu_mesh, hbm=(fixed + 0.5 * slot) / 0.25)


def test_auto_and_counts_parse_and_bad_values_are_refused():
    assert config().rollout.slots == "auto"
    assert config("rollout.slots=8").rollout.slots == 8
    for bad in ("many", "-1", "2.5"):
        with pytest.raises(ConfigError, match=r"config.rollout.slots=.*'auto' or a whole"):
            config(f"rollout.slots={bad}")
    with pytest.raises(
        ConfigError,
        match=r"rollout.partial=True.*expected false unless rollout.slots is auto or > 0",
    ):
        config("rollout.slots=0", "rollout.partial=true")
