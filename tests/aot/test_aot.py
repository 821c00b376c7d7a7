"""Ahead-of-time TPU compiles on this CPU host: topology names, the report's numbers, the
programs' implementation following the mesh (no CPU kernels in a TPU program), presets."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxvrl.aot import cost_model
from jaxvrl.aot import report as rep
from jaxvrl.aot.__main__ import main
from jaxvrl.aot.plan import Plan
from jaxvrl.config import load_config
from jaxvrl.models import PRESETS, Model, preset_names
from jaxvrl.models.qwen2_5_vl import Qwen2_5_VLConfig
from jaxvrl.parallel import topology as T
from jaxvrl.trainer import setup

pytest.importorskip("libtpu", reason="the TPU compiler: pip install -e '.[tpu]'")


@pytest.mark.parametrize(
    "name,chips,topology,hosts",
    [
        ("v5p-16", 8, "v5p:2x2x2", 2),
        ("v5p-8", 4, "v5p:2x2x1", 1),
        ("v4-8", 4, "v4:2x2x1", 1),
        ("v5litepod-8", 8, "v5e:2x4", 1),
        ("v5e-16", 16, "v5e:4x4", 4),
        ("v6e-8", 8, "v6e:2x4", 1),
        ("V6E-256", 256, "v6e:16x16", 64),
    ],
)
def test_accelerator_types_map_to_slices(name, chips, topology, hosts):
    s = T.parse(name)
    assert (s.chips, s.topology, s.hosts) == (chips, topology, hosts)


@pytest.mark.parametrize("name", ["v5p-7", "v7-8", "v5e-12", "tpu"])
def test_unknown_topology_lists_the_known_ones(name):
    with pytest.raises(ValueError, match="v5p-16.*v6e-8|v5e-4") as e:
        T.parse(name)
    assert name.lower() in str(e.value).lower()


def test_slice_devices_are_chips():
    for name in ("v4-8", "v5p-16", "v5e-8"):
        s = T.parse(name)
        devices = T.tpu_devices(s)
        assert len(devices) == s.chips and devices[0].platform == "tpu"
        assert len({d.process_index for d in devices}) == s.hosts
    # one-step-off's split of a multi-host slice: each host gives the sampler a slab of its
    # chips (x = 1 on v5p's 2x2x1 hosts) and keeps its first for the train step
    devices = T.tpu_devices(T.parse("v5p-32"))
    assert setup.split_sizes(devices) == [8]
    train, roll = setup.device_split(load_config("configs/grpo.py", ["rollout.devices=8"]), devices)
    assert sorted(d.coords[0] for d in roll) == [1] * 8 and len(train) == 8
    assert {d.process_index for d in roll} == {d.process_index for d in train} == {0, 1, 2, 3}
    assert {d.id for d in train} >= {0, 4, 8, 12}


def test_missing_tpu_compiler_says_how_to_install(monkeypatch):
    from jax.experimental import topologies

    def fail(*a, **k):
        raise RuntimeError("no libtpu")

    monkeypatch.setattr(topologies, "get_topology_desc", fail)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[tpu\]'"):
        T.tpu_devices(T.parse("v5e-4"))


def test_largest_arrays_reads_buffers_outside_fusions():
    hlo = """HloModule m

%fused_computation.1 (p: f32[8,128]) -> f32[64,64,64] {
  %p = f32[8,128]{1,0} parameter(0)
  %big = f32[64,64,64]{2,1,0} broadcast(%p), dimensions={}
}

ENTRY %main.5 (a: f32[1024,1024]) -> f32[8,8] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %s = bf16[4,7,4096,4096]{3,2,1,0} fusion(%a), kind=kLoop, calls=%fused_computation.1
  %d = f32[512,512]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %b = f32[512,512]{1,0} bitcast(%d)
  ROOT %r = f32[8,8]{1,0} slice(%d), slice={[0:8], [0:8]}
}
"""
    got = rep.largest_arrays(hlo, k=3)
    assert got == [
        ("bf16[4,7,4096,4096]", 4 * 7 * 4096 * 4096 * 2, "fusion"),
        ("f32[512,512]", 512 * 512 * 4, "dot"),
        ("f32[8,8]", 256, "slice"),
    ]


def _published_params(d, layers, heads, kv, inter, vocab, tied, v_inter):
    """Qwen2.5-VL parameter count by hand: text decoder (q/k/v with bias, o, gated MLP, two
    RMSNorms per layer, embeddings and untied head, final norm) and the vision tower (32
    blocks of width 1280 with 16 heads: qkv and proj with bias, gated MLP with bias, two
    norms; 3 x 2 x 14 x 14 patch embedding; 2 x 2 merger into the text width)."""
    kvd = kv * (d // heads)
    layer = (d * d + d) + 2 * (d * kvd + kvd) + d * d + 3 * d * inter + 2 * d
    text = layers * layer + vocab * d * (1 if tied else 2) + d
    h, m = 1280, 1280 * 4
    block = (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * v_inter + v_inter) + (v_inter * h + h)
    vision = 3 * 2 * 14 * 14 * h + 32 * (block + 2 * h) + h + (m * m + m) + (m * d + d)
    return text + vision


PUBLISHED = {  # hidden, layers, heads, kv heads, intermediate, vocab, tied, vision MLP
    "qwen2.5-vl-3b": (2048, 36, 16, 2, 11008, 151936, True, 3420),
    "qwen2.5-vl-7b": (3584, 28, 28, 4, 18944, 152064, False, 3420),
    "qwen2.5-vl-32b": (5120, 64, 40, 8, 27648, 152064, False, 3456),
    "qwen2.5-vl-72b": (8192, 80, 64, 8, 29568, 152064, False, 3456),
}


def test_presets_have_the_published_parameter_counts():
    """Every preset holds the published sizes; the model built from the 3B (tied head) and
    7B (untied) presets has the hand count's parameters (32B and 72B differ from them only in
    those sizes, so their abstract builds, a minute here, would prove nothing more)."""
    want = {k: _published_params(*v) for k, v in PUBLISHED.items()}
    assert round(want["qwen2.5-vl-7b"] / 1e9, 2) == 8.29  # the model card's 8.29B
    assert set(want) == {n for n in preset_names() if n.startswith("qwen2.5-vl-")}
    for name, n in want.items():
        with open(f"{PRESETS}/{name}.json") as f:
            cfg = Qwen2_5_VLConfig.from_hf_dict(json.load(f))
        t, v = cfg.text, cfg.vision
        sizes = (t.hidden_size, t.num_hidden_layers, t.num_attention_heads)
        sizes += (t.num_key_value_heads, t.intermediate_size, t.vocab_size)
        sizes += (cfg.tie_word_embeddings, v.intermediate_size)
        assert sizes == PUBLISHED[name], name
        assert (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size) == (
            32,
            1280,
            16,
            t.hidden_size,
        )
        if name in ("qwen2.5-vl-3b", "qwen2.5-vl-7b"):
            model = nnx.eval_shape(lambda c=cfg: Model(c, rngs=nnx.Rngs(0)))
            params = jax.tree.leaves(nnx.state(model, nnx.Param))
            assert sum(math.prod(x.shape) for x in params) == n, name


def _json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


ARGS = [
    "--config",
    "configs/vgr.py:runlocal",
    "--topology=v5e-4",
    "--config.model.dtype=bfloat16",
    "--config.prompts_per_step=4",  # 2 updates of 2 prompts x 2 samples per rollout batch
]


@pytest.fixture(scope="module")
def tiny_report():
    """The tiny model's VGR train step (attention statistics), sampler and decode step,
    compiled for a v5e-4 slice through the command line's own entry point."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(ARGS)
    return code, buf.getvalue()


def test_tiny_model_compiles_for_a_tpu_slice(tiny_report):
    code, out = tiny_report
    assert code == 0, out
    r = _json(out)
    assert r["topology"] == "v5e-4" and r["fits"] and r["mesh"]["fsdp"] == 4
    assert set(r["programs"]) == {"train_step", "sampler", "decode_step"}
    for name, p in r["programs"].items():
        assert p["compile_s"] > 0 and p["flops"] > 0 and p["bytes_accessed"] > 0, name
        assert p["argument_bytes"] > 0 and p["estimate_s"] > 0 and p["model_flops"] > 0, name
        assert 0 < p["peak_bytes"] <= p["hbm_bytes"] == 16 * 2**30, name
        # the compiler's own peak of HBM (its heap packing), not the sum of what it reports
        assert p["peak_bytes"] == p["compiler_peak_bytes"] >= p["argument_bytes"], name
        live = p["peak_bytes"] - p["argument_bytes"] - p["output_bytes"] + p["alias_bytes"]
        assert p["peak_temp_bytes"] == live, name
        assert p["largest"] and p["largest"][0]["bytes"] > 0, name
        assert f"{name}: compiled in" in out
        peak, bw = 197e12, 819e9  # v5e
        assert p["loop_factor"] >= 1.0 and p["matmul_flops"] > 0, name
        if p["optimal_s"] is None and not p["decode_steps"]:
            want = p["loop_factor"] * max(p["flops"] / peak, p["bytes_accessed"] / bw)
            assert p["estimate_s"] == pytest.approx(want, rel=1e-9), name
        assert p["mfu"] == pytest.approx(p["model_flops"] / (p["estimate_s"] * peak)), name
    step = r["programs"]["train_step"]
    assert step["breakdown"]["params"] > 0 and step["breakdown"]["optimizer"] > 0
    assert step["alias_bytes"] > 0  # the state is donated
    decode, sampler = r["programs"]["decode_step"], r["programs"]["sampler"]
    assert decode["bound_s"] > 0
    steps = sampler["decode_steps"]  # the sampler's time: its prefill and every decode step
    assert steps == 8 and sampler["decode_step_s"] == decode["estimate_s"]
    assert 0 < sampler["prefill_s"] == sampler["fixed_s"]
    assert sampler["estimate_s"] == pytest.approx(
        sampler["prefill_s"] + steps * decode["estimate_s"]
    )
    assert sampler["decode_bound_s"] == decode["bound_s"]
    # the VGR step scans over 2 policy updates after one pass over the batch's experience,
    # and the vision tower's blocked attention and the attention statistics' blocked pass
    # loop over blocks: XLA's count of one loop body is scaled up
    assert step["loop_factor"] > 1.2


def test_programs_compiled_for_a_tpu_use_no_cpu_kernels():
    """A decode step for one CPU device runs the CPU kernels (custom calls `jaxvrl_*`); the
    same step traced on this CPU host for a TPU mesh must be the TPU program, without them:
    its cached attention is the Pallas kernel (a Mosaic call), over keys by slot."""
    import functools

    from jaxvrl.sampling import static
    from jaxvrl.sampling.cpu import kernels as cpu_kernels

    plan = Plan.build(load_config("configs/grpo.py:runlocal", []), "v5e-4")
    lower, *_ = plan._decode_step()
    tpu = lower().as_text()
    assert "@jaxvrl_" not in tpu
    assert "@tpu_custom_call" in tpu and 'kernel_name = "jaxvrl_decode_attention"' in tpu
    cfg, config = plan.sampling_config(), plan.model.config
    with jax.set_mesh(plan.rollout[0]):
        assert (
            static.abstract_loop_state(config, 2, 8, cfg, np.float32)["cache"].key_layout == "BKSH"
        )
    assert static.abstract_loop_state(config, 2, 8, cfg, np.float32)["cache"].key_layout == "BKHS"
    if cpu_kernels.available():  # the same step for this host's CPU does use them
        state = static.abstract_loop_state(config, 2, 8, cfg, np.float32)
        fn = jax.jit(functools.partial(static.decode_step, plan.init.model_graphdef, cfg=cfg))
        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plan.init.state.params
        )
        start = jax.ShapeDtypeStruct((2,), np.int32)
        text = fn.lower(params, state, start, jax.random.key(0)).as_text()
        assert "@jaxvrl_" in text


def test_auto_attention_follows_the_mesh():
    """model.attention="auto" traced for a TPU mesh runs the splash kernel (a Mosaic custom
    call) in the text decoder; the same forward for this CPU host runs the dense form."""
    from jax.sharding import NamedSharding, PartitionSpec

    plan = Plan.build(load_config("configs/grpo.py:runlocal", []), "v5e-4")
    assert plan.c.model.attention == "auto" and "auto: splash" in plan.describe()
    graphdef, params = plan.init.model_graphdef, plan.init.state.params
    fwd = jax.jit(lambda s, i, p: nnx.merge(graphdef, s).forward(i, i, p).hidden)

    def lower(sharding):
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x))  # noqa: E731
        args = (np.zeros((2, 16), np.int32), np.zeros((3, 2, 16), np.int32))
        return fwd.lower(jax.tree.map(spec, params), *map(spec, args)).as_text()

    with jax.set_mesh(plan.mesh):
        tpu = lower(lambda x: getattr(x, "sharding", NamedSharding(plan.mesh, PartitionSpec())))
    assert "tpu_custom_call" in tpu
    assert "tpu_custom_call" not in lower(lambda x: None)


def test_a_program_that_does_not_fit_names_the_knobs(monkeypatch, capsys):
    tiny = T.Chip("TPU v5e", 1e-4, 197, 819, cores_in_name=1, single_host=8)
    monkeypatch.setitem(T.CHIPS, "v5e", tiny)
    code = main(ARGS + ["--programs=decode_step"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out
    assert "a larger slice" in out and "optim.micro_batches" in out  # fsdp spans every chip
    assert _json(out)["fits"] is False


def _loop_programs():
    x = jax.ShapeDtypeStruct((256, 256), np.float32)
    y = jax.ShapeDtypeStruct((64, 256), np.float32)
    n = jax.ShapeDtypeStruct((), np.int32)
    mm = 2 * 256**3

    def scan(x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ x), None), x, None, length=10)[0]

    def nested(x):
        inner = lambda c: jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ x), c)  # noqa: E731
        return jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=5)[0]

    def rect(x, y):
        return jax.lax.fori_loop(0, 7, lambda i, c: jnp.tanh(c @ x), y)

    def dynamic(x, n):  # a data-dependent trip count cannot be read: counted once
        body = lambda s: (jnp.tanh(s[0] @ x), s[1] + 1)  # noqa: E731
        return jax.lax.while_loop(lambda s: s[1] < n, body, (x, 0))[0]

    return [
        (lambda x: jnp.tanh(x @ x), (x,), mm),
        (scan, (x,), 10 * mm),
        (nested, (x,), 15 * mm),
        (rect, (x, y), 7 * mm // 4),
        (dynamic, (x, n), mm),
    ]


@pytest.mark.parametrize("i", range(5))
def test_matmul_flops_count_loop_bodies_per_iteration(i):
    """XLA's cost analysis counts a loop body once; the HLO reading counts it per iteration."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    fn, args, want = _loop_programs()[i]
    mesh = Mesh(np.array(T.tpu_devices(T.parse("v5e-1"))), ("d",))
    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
        for a in args
    ]
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    assert cost_model.matmul_flops(text) == want
    once = rep._cost(compiled)["flops"]
    assert once < 1.01 * cost_model.matmul_flops(text, loops=False) + 1e7  # what XLA prices


# a q projection to 32 heads of 128 as the TPU compiler wrote it in a Qwen3-VL-8B train step:
# the heads are a window of 32 over an input of size 1 padded by 31 on each side, so one tap in
# 32 meets the input; the contraction is the 2 x 512 features
_PADDED_CONV = """HloModule m
ENTRY %main (a: bf16[2,2048,2,512,1], b: bf16[32,128,2,512,1]) -> bf16[2,2048,32,128,1] {
  %a = bf16[2,2048,2,512,1]{4,3,2,1,0} parameter(0)
  %b = bf16[32,128,2,512,1]{4,3,2,1,0} parameter(1)
  ROOT %c = bf16[2,2048,32,128,1]{3,1,4,2,0} convolution(%a, %b), \
window={size=1x32x2 pad=0_0x31_31x0_0 rhs_reversal=0x1x0}, dim_labels=0b2f1_1o2i0->0b1f2
}
"""


def test_matmul_flops_leave_out_the_taps_on_padding():
    assert cost_model.matmul_flops(_PADDED_CONV) == 2 * (2 * 2048 * 32 * 128) * (2 * 512)


def test_loop_factor_prices_work_outside_loops_once():
    """A scan over stacked weights beside a large elementwise update (an optimizer's shape of
    work): the cost model's time for the scanned program times the loop factor is the cost
    model's time for the same program unrolled, where scaling the whole time by the matmul
    FLOPs' factor (10) would count the update ten times."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    chip = T.parse("v5e-1")
    mesh = Mesh(np.array(T.tpu_devices(chip)), ("d",))

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    def program(unroll):
        def f(ws, x, big):
            step = lambda h, w: (jnp.tanh(h @ w), None)  # noqa: E731
            return jax.lax.scan(step, x, ws, unroll=unroll)[0], big * 0.9 + 1.0

        return f

    args = (sds((10, 1024, 1024), jnp.bfloat16), sds((1024, 1024), jnp.bfloat16))
    args += (sds((32 * 2**20,), jnp.float32),)
    seconds, factors = {}, {}
    for name, unroll in (("scan", 1), ("unrolled", True)):
        compiled = jax.jit(program(unroll)).lower(*args).compile()
        text = compiled.as_text()
        seconds[name] = rep._cost(compiled)["optimal_seconds"]
        factors[name] = cost_model.loop_factor(text, T.peak_flops(chip), T.bandwidth(chip))
        flops_factor = cost_model.matmul_flops(text) / cost_model.matmul_flops(text, loops=False)
        if name == "scan":
            assert flops_factor == 10  # the matmuls run 10 times, the update once
    assert factors["unrolled"] == 1.0
    assert cost_model.loop_factor(text, T.peak_flops(chip), T.bandwidth(chip), unread=0) == 1.0
    estimate = seconds["scan"] * factors["scan"]
    assert estimate == pytest.approx(seconds["unrolled"], rel=0.15)
    assert seconds["scan"] * 10 > 3 * seconds["unrolled"]  # what the FLOP factor would say


def test_the_head_runs_vocabulary_parallel_never_whole(tmp_path):
    """The chunked log-probs' loop over token chunks, compiled for 4 TPU chips with fsdp
    splitting the rows: no collective moves the whole head or its whole gradient (before,
    each chip gathered it and all-reduced its gradient; the compiler's own choice did both
    in every chunk, 16 times here). The head's slices move once per pass; what moves per
    chunk is the chunk's hidden states [rows, chunk, D] and [rows, chunk] sums."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxvrl.models import qwen2_5_vl as q
    from jaxvrl.parallel import sharding as S
    from jaxvrl.trainer.passes import completion_logprobs
    from tests.models import hf_tiny

    hf_tiny.build(tmp_path, seed=1)
    model = q.load(tmp_path)
    graphdef, params = nnx.split(model, nnx.Param)
    mesh = S.make_mesh(fsdp=4, devices=T.tpu_devices(T.parse("v5e-4")))
    shardings = S.param_shardings(params, mesh)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
    )
    b, n, d, v = 8, 64, model.config.text.hidden_size, model.config.text.vocab_size
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    hidden = jax.ShapeDtypeStruct((b, n, d), jnp.float32, sharding=rows)
    tokens = jax.ShapeDtypeStruct((b, n), jnp.int32, sharding=rows)

    def loss(p, h, t):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            m = nnx.merge(graphdef, p)
            lp, _ = completion_logprobs(m, h, t, 1.0, entropy="value", chunk=4)
        return jnp.sum(lp)

    step = jax.jit(jax.grad(loss), out_shardings=shardings)
    text = step.lower(params, hidden, tokens).compile().as_text()
    moved = cost_model.collectives(text)
    size = {k: math.prod(int(x) for x in k[1].split("[")[1][:-1].split(",")) for k in moved}
    assert d * v not in size.values(), moved  # never the whole head
    assert d * v // 4 in size.values(), moved  # its slices (and their gradient's)
    per_chunk = {k for k, c in moved.items() if c > 1}
    assert per_chunk and all(size[k] <= b * 4 * d for k in per_chunk), moved


def test_a_loop_of_unread_trip_count_can_be_left_out():
    """A loop run until a condition on data holds (a sampler's decode loop) has no trip count
    in the program: counted once by default, left out with unread=0, so what remains is the
    work around it (the sampler's prefill)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    chip = T.parse("v5e-1")
    mesh = Mesh(np.array(T.tpu_devices(chip)), ("d",))
    rep = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=rep)
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)

    def f(x, n):
        h = jnp.tanh(x @ x)  # before the loop: the "prefill"
        body = lambda s: (jnp.tanh(s[0] @ x), s[1] + 1)  # noqa: E731
        return jax.lax.while_loop(lambda s: s[1] < n, body, (h, 0))[0]

    text = jax.jit(f).lower(x, n).compile().as_text()
    peak, bw = T.peak_flops(chip), T.bandwidth(chip)
    assert cost_model.loop_factor(text, peak, bw) == 1.0  # the loop's body counted once
    left_out = cost_model.loop_factor(text, peak, bw, unread=0)
    assert 0.3 < left_out < 0.7  # one matmul of the two priced once


def test_knobs_offered_leave_out_what_is_already_set():
    """When a program does not fit, the tool names only knobs left to turn: no remat_policy=full
    knob at full or offload, no offload knob once set, a larger slice once every chip holds a share of the state, no
    longer sequence axis once it has every chip."""
    import types

    full = load_config("configs/tprl.py", ["model.remat_policy=full"])
    every = rep.knobs(full, types.SimpleNamespace(shape={"data": 1, "fsdp": 8, "tensor": 1}))
    assert not any("remat_policy=full" in k for k in every) and any(
        "larger slice" in k for k in every
    )
    assert any("remat_policy=offload" in k for k in every)
    assert any("float32 copy" in k for k in every)  # what micro-batches cost beside 1
    assert any("offload_optimizer" in k for k in every)
    assert any("mesh.sequence" in k for k in every)  # long rows over chips fsdp holds
    off = load_config(
        "configs/tprl.py", ["actor.offload_optimizer=true", "model.remat_policy=offload"]
    )
    left = rep.knobs(off, types.SimpleNamespace(shape={"data": 1, "fsdp": 1, "sequence": 8}))
    assert not any("offload" in k or "mesh.sequence" in k or "remat" in k for k in left)
    some = rep.knobs(load_config("configs/tprl.py", ["model.remat_policy=none"]),
                     types.SimpleNamespace(shape={"data": 2, "fsdp": 4, "tensor": 1}))  # fmt: skip
    assert any("remat_policy=full" in k for k in some) and any("mesh.fsdp" in k for k in some)


def test_suggest_splits_rows_over_more_chips_until_the_step_fits(monkeypatch):
    """When no micro-batch count fits, --suggest moves chips from fsdp to the sequence axis
    (one row per device group in each micro-batch) until the step fits (the compiler stubbed:
    fits from sequence 4 on)."""
    import types

    c = load_config("configs/vgr.py:runlocal", ["model.dtype=bfloat16", "prompts_per_step=4"])
    plan = Plan.build(c, "v5e-4")
    assert dict(plan.mesh.shape)["fsdp"] == 4 and plan.mesh.shape["sequence"] == 1
    tried = []

    def compile_(self, name):
        tried.append((dict(self.mesh.shape), self.c.optim.micro_batches))
        return types.SimpleNamespace(fits=self.mesh.shape["sequence"] >= 4, peak_bytes=2**30)

    monkeypatch.setattr(Plan, "compile", compile_)
    got = plan.suggest_sequence()
    assert got == {"mesh.fsdp": 1, "mesh.sequence": 4, "optim.micro_batches": tried[-1][1]}
    assert [(m["fsdp"], m["sequence"]) for m, _ in tried] == [(2, 2), (1, 4)]
    assert tried[0][1] == 2 * tried[-1][1] // 2 * 1 or tried[0][1] >= 1


def test_suggest_offloads_the_optimizer_first_where_its_state_is_the_excess(capsys):
    """--suggest's order: the optimizer state to host memory first when that state alone is
    more than the step is over the chip's memory, else after more micro-batches; rows over
    more chips last. The compiler's peak is the devices' (host arguments taken out)."""
    import types

    from jaxvrl.aot.__main__ import _suggest
    from jaxvrl.aot.report import _device_peak

    def plan(offload_fits, micro=None):
        calls = []
        offload = {"actor.offload_optimizer": True} if offload_fits else None
        return calls, types.SimpleNamespace(
            suggest_offload=lambda lengths: calls.append("offload") or offload,
            suggest_micro_batches=lambda step: calls.append("micro") or micro,
            suggest_sequence=lambda lengths: calls.append("sequence") or None,
        )

    gib = 2**30
    state = types.SimpleNamespace(
        peak_bytes=20 * gib, hbm_bytes=16 * gib, breakdown={"optimizer": 7 * gib}
    )
    calls, p = plan(True)
    assert _suggest(p, state, None) == {"actor.offload_optimizer": True} and calls == ["offload"]
    rows = types.SimpleNamespace(
        peak_bytes=30 * gib, hbm_bytes=16 * gib, breakdown={"optimizer": 7 * gib}
    )
    calls, p = plan(True, micro=4)
    assert _suggest(p, rows, None) == {"optim.micro_batches": 4} and calls == ["micro"]
    calls, p = plan(False)
    assert _suggest(p, rows, None) is None and calls == ["micro", "offload", "sequence"]
    assert "no mesh.sequence fits either" in capsys.readouterr().out

    mem = types.SimpleNamespace(peak_memory_in_bytes=22 * gib, host_argument_size_in_bytes=8 * gib)
    assert _device_peak(mem) == 14 * gib
    assert _device_peak(types.SimpleNamespace(peak_memory_in_bytes=0)) == 0


def test_suggest_offload_adds_the_layer_inputs_when_the_optimizer_alone_is_not_enough(
    monkeypatch,
):
    """suggest_offload tries the optimizer state in host memory, then the layers' inputs too
    (the compiler stubbed: fits only with both); nothing the config already set."""
    import types

    c = load_config("configs/vgr.py:runlocal", ["model.dtype=bfloat16", "prompts_per_step=4"])
    tried = []

    def compile_(self, name):
        both = (self.c.actor.offload_optimizer, self.c.model.remat_policy)
        tried.append(both)
        return types.SimpleNamespace(fits=both == (True, "offload"), peak_bytes=2**30)

    monkeypatch.setattr(Plan, "compile", compile_)
    got = Plan.build(c, "v5e-4").suggest_offload()
    assert got == {"actor.offload_optimizer": True, "model.remat_policy": "offload"}
    assert tried == [(True, c.model.remat_policy), (True, "offload")]
    tried.clear()
    both = ["actor.offload_optimizer=true", "model.remat_policy=offload"]
    done = load_config(
        "configs/vgr.py:runlocal", ["model.dtype=bfloat16", "prompts_per_step=4", *both]
    )
    assert Plan.build(done, "v5e-4").suggest_offload() is None and tried == []
