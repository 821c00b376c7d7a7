"""The TPU tables of docs/scaling.md, from the TPU compiler (`python -m jaxvrl.aot`).

    python docs/aot_table.py run [--only SUBSTRING]   # compile the rows not stored yet (or
                                                      # those matching), keep their JSON
        [--programs sampler,decode_step]              # ... only these programs, replacing
                                                      # theirs in the stored rows
    python docs/aot_table.py render                   # the markdown table docs/scaling.md holds
    python docs/aot_table.py write                    # ... put into docs/scaling.md

`run` compiles every row's programs for its slice on this machine (no TPU needed, minutes per
row for a 7B model) and stores the tool's JSON line per row in docs/aot_results.jsonl;
`render` prints the tables from that file, each row with the command that made it.
tests/aot/test_aot_table.py checks that docs/scaling.md holds the current rendering.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "aot_results.jsonl")
GiB = 2**30

# The workload: a realistic RL batch per data-parallel group (8 prompts x 8 samples), prompts of
# 1,024 tokens holding a 784 x 784 image (784 vision tokens), 1,024-token completions, bf16
# compute with float32 master weights, remat full.
WORKLOAD = (
    "--config.model.dtype=bfloat16 --config.model.remat_policy=full "
    "--config.data.max_prompt_length=1024 --config.data.max_image_side=784 "
    "--config.data.max_pixels=614656 --config.rollout.max_new_tokens=1024"
)


# A text-only model's workload (the math GRPO example): 512-token prompts, 4,096 new tokens.
TEXT_WORKLOAD = (
    "--config.model.dtype=bfloat16 --config.model.remat_policy=full "
    "--config.data.max_prompt_length=512 --config.rollout.max_new_tokens=4096"
)


def _row(config, preset, topology, prompts, micro, workload=WORKLOAD):
    cmd = (
        f"python -m jaxvrl.aot --config configs/{config}.py --topology={topology} "
        f"--config.model.preset={preset} --config.prompts_per_step={prompts} "
        f"--config.optim.micro_batches={micro} {workload}"
    )
    key = f"{preset} {config} {topology} m{micro}"
    return dict(key=key, cmd=cmd, model=preset, config=config, topology=topology, micro=micro)


# prompts_per_step is per host: 8 prompts x 8 samples per step over the slice's hosts; tprl,
# dapo and vgr make 2 policy updates per step (32 rows each), split into `micro` micro-batches
ROWS = [
    _row("tprl", "qwen2.5-vl-7b", "v5p-16", 4, 4),
    _row("tprl", "qwen2.5-vl-3b", "v5e-16", 2, 8),  # 4-row micro-batches on 16 chips: no fit
    _row("tprl", "qwen2.5-vl-3b", "v5e-16", 2, 2),
    _row("vgr", "qwen2.5-vl-7b", "v5p-16", 4, 4),
    _row("grpo", "qwen2.5-vl-7b", "v5p-16", 4, 4),
    _row("grpo", "qwen2.5-vl-3b", "v5e-16", 2, 2),
    _row("vgr", "qwen2.5-vl-3b", "v5e-16", 2, 2),
    _row("tprl", "qwen2.5-vl-3b", "v6e-8", 8, 4),
    _row("tprl", "qwen2.5-vl-7b", "v6e-16", 2, 2),
    _row("tprl", "qwen3-vl-8b", "v5p-16", 4, 4),  # the other families, the 7B row's workload
    _row("tprl", "qwen2-vl-7b", "v5p-16", 4, 4),
    _row("math_grpo", "qwen3-8b", "v5p-16", 4, 4, TEXT_WORKLOAD),  # text-only, 2 PPO epochs
]


def load() -> dict:
    out = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    out[r["key"]] = r
    return out


def run(only: str | None, programs: str | None = None) -> None:
    results = load()
    for row in ROWS:
        if (only and only not in row["key"]) or (not only and row["key"] in results):
            if not (programs and row["key"] in results and (not only or only in row["key"])):
                continue  # a stored row is compiled again only when named by --only/--programs
        cmd = row["cmd"] + (f" --programs={programs}" if programs else "")
        print(f"== {row['key']}: {cmd}", flush=True)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
        p = subprocess.run(cmd.split(), capture_output=True, text=True, env=env)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
            continue
        print("\n".join(ln for ln in p.stdout.splitlines() if not ln.startswith("{")))
        report = json.loads(lines[-1])
        if programs and row["key"] in results:  # the other programs' figures are kept
            kept = results[row["key"]]["report"]
            kept["programs"].update(report["programs"])
            report = dict(kept, **{k: v for k, v in report.items() if k.startswith("rollout")})
        results[row["key"]] = dict(row, report=report)
        with open(RESULTS, "w") as f:
            for key in [r["key"] for r in ROWS if r["key"] in results]:
                f.write(json.dumps(results[key]) + "\n")


def _gib(x) -> str:
    return f"{x / GiB:.1f}"


def _ms(x) -> str:
    return f"{x * 1e3:,.0f}" if x >= 0.01 else f"{x * 1e3:.2f}"


def render() -> str:
    results = load()
    head = (
        "| model | config | slice | mesh | micro-batches | train step: HBM / chip (GiB) | "
        "compile (s) | est. step (ms) | MFU | sampler: HBM (GiB) | compile (s) | est. (ms) | "
        "decode step: est. / bound (ms) | command |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for row in ROWS:
        r = results.get(row["key"])
        if r is None:
            continue
        rep = r["report"]
        p = rep["programs"]
        mesh = " x ".join(f"{k} {v}" for k, v in rep["mesh"].items() if v > 1) or "1"
        cells = [row["model"], row["config"], row["topology"], mesh, str(row["micro"])]
        t = p.get("train_step")
        if t:
            fit = "" if t["fits"] else " **does not fit**"
            cells += [
                f"{_gib(t['peak_bytes'])} / {_gib(t['hbm_bytes'])}{fit}",
                f"{t['compile_s']:.0f}",
                _ms(t["estimate_s"]) if not t.get("error") else "-",
                f"{100 * t['mfu']:.0f}%" if not t.get("error") else "-",
            ]
        else:
            cells += ["-"] * 4
        s = p.get("sampler")
        if s:
            cells += [_gib(s["peak_bytes"]), f"{s['compile_s']:.0f}", _ms(s["estimate_s"])]
        else:
            cells += ["-"] * 3
        d = p.get("decode_step")
        rmesh = rep.get("rollout_mesh")
        where = ""
        if rmesh:  # the rollout's layout (before it had one: the training mesh)
            where = " (" + " x ".join(f"{k} {v}" for k, v in rmesh.items() if v > 1) + ")"
        cells += [f"{_ms(d['estimate_s'])} / {_ms(d['bound_s'])}{where}" if d else "-"]
        cells += [f"`{row['cmd']}`"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def write() -> None:
    """Put the current rendering into docs/scaling.md in place of the table there."""
    path = os.path.join(HERE, "scaling.md")
    with open(path) as f:
        lines = f.read().split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| model | config | slice"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = render().rstrip("\n").split("\n")
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
        progs = sys.argv[sys.argv.index("--programs") + 1] if "--programs" in sys.argv else None
        run(only, progs)
    elif len(sys.argv) > 1 and sys.argv[1] == "write":
        write()
    else:
        sys.stdout.write(render())
