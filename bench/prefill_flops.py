"""The rollout phase's prefill, one per prompt against every row prefilling its prompt, as the
TPU compiler counts it: the sampler's first program (`jaxvrl.sampling.sampler.prefill`: the
vision tower and the prompts' prefill) compiled ahead of time for a TPU slice on this host,
in the rollout's layout, for the step's R prompts (G samples each start from one prefill)
and for its R x G rows (each row prefilled, what the rollout does where the mesh's row
shards do not divide the prompts). Prints the compiler's FLOPs and estimated time per device.
With `--config.rollout.mesh.sequence=S` the prefill runs on its mesh (each prompt's tokens
split over S devices).

    python bench/prefill_flops.py --config configs/tprl.py --topology=v5p-16 \
      --config.model.preset=qwen2.5-vl-7b --config.prompts_per_step=4 \
      --config.optim.micro_batches=4 --config.model.dtype=bfloat16 \
      --config.model.remat_policy=full --config.data.max_prompt_length=1024 \
      --config.data.max_image_side=784 --config.data.max_pixels=614656 \
      --config.rollout.max_new_tokens=1024

Needs libtpu (`pip install -e '.[tpu]'`), as `python -m jaxvrl.aot` does; no TPU.
"""

from __future__ import annotations

import functools
import sys
import time

import jax


def main(argv: list[str]) -> None:
    jax.config.update("jax_platforms", "cpu")  # the host only traces; the programs are TPU's
    from jaxvrl.aot.plan import Plan
    from jaxvrl.config import load_config, parse_argv
    from jaxvrl.sampling import layout
    from jaxvrl.sampling import sampler as S
    from jaxvrl.trainer import setup

    topology = [a.split("=", 1)[1] for a in argv if a.startswith("--topology=")]
    if not topology:
        raise SystemExit("give --topology=NAME (e.g. v5p-16), as for python -m jaxvrl.aot")
    c = load_config(*parse_argv([a for a in argv if not a.startswith("--topology=")]))
    plan = Plan.build(c, topology[0])
    sampler = plan.sampler()
    ready = sampler.prepare(plan.init.state.params)
    mesh = sampler.prefill_mesh  # the rollout mesh, its data groups joined by rollout.mesh.sequence
    params = layout.onto(ready.params, mesh)
    g = c.rollout.num_generations
    runs = (("one prefill per prompt", plan.rows // g, True), ("every row", plan.rows, False))
    flops = []
    for name, rows, once in runs:
        p = plan.prompts(False, rows)
        fn = jax.jit(
            functools.partial(
                S.prefill,
                ready.graphdef,
                cfg=sampler.cfg,
                num_samples=g if once else 1,
                prefill_once=once,
            )
        )
        t = time.perf_counter()
        with jax.set_mesh(mesh), setup.matmul_precision(c.model.matmul_precision):
            args = (p["input_ids"], p["attention_mask"], p["position_ids"], p["deltas"])
            compiled = fn.lower(params, *args, plan._rng(mesh), images=p["images"])
            compiled = compiled.compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        flops.append(cost["flops"])
        print(
            f"{name}: {rows} rows prefilled, {cost['flops']:.4e} FLOPs per device, estimated "
            f"{cost['optimal_seconds'] * 1e3:.1f} ms (compiled in {time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    print(f"ratio {flops[0] / flops[1]:.4f} (1/G = {1 / g:.4f})")


if __name__ == "__main__":
    main(sys.argv[1:])
