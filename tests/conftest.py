"""Shared pytest setup: float32 everywhere, quiet logs, one XLA compilation cache per session."""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The tests run on the CPU. With libtpu installed (the test extra has it, for the ahead-of-time
# TPU compiles of tests/aot) jax would otherwise try to start a TPU backend in every process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA cache for the whole session, inherited by the subprocesses the tests start
# (multi-device and multi-process runs, the CLI): the same tiny programs are compiled again by
# many tests (every train run builds its own jitted step). Compile counts in the tests come
# from the jit caches, which a persistent-cache hit still fills.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _xla_cache = tempfile.mkdtemp(prefix="jaxvrl-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# The tests' programs are tiny: compiling them costs far more than running them. XLA:CPU's
# newer fusion emitters (MLIR) and LLVM's optimisation passes are most of a CPU compile, so
# the tests take the classic elemental emitters without LLVM's optimisation (not XLA's graph
# passes, and never float semantics: no fast math). A tiny TPRL train step compiles in about a
# third of the CPU time; the rounding differs from the default emitters' in the last bits only
# (the step's loss by ~1e-6 of itself), inside every tolerance. Subprocesses inherit the flags.
# XLA aborts the process on a flag it does not know (jaxlib 0.11 has no fusion-emitter switch),
# so each flag is tried once in a throwaway process and kept only where it starts a backend.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_llvm_disable_expensive_passes=true",
    # one LLVM module per program: the split (for codegen on many threads) costs more CPU than
    # it saves with two workers on two cores (a tiny TPRL step: 2.0 -> 1.7 CPU-s, same loss)
    "--xla_cpu_parallel_codegen_split_count=1",
)


def _xla_knows(flag: str) -> bool:
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


if "JAXVRL_TEST_XLA_FLAGS" not in os.environ:  # decided once; workers inherit the decision
    _flags = os.environ.get("XLA_FLAGS", "")
    _new = [f for f in _FAST_COMPILE if f.split("=")[0] not in _flags]
    if _new and not _xla_knows(" ".join(_new)):  # all at once, else one by one
        _new = [f for f in _new if _xla_knows(f)]
    _flags = " ".join([_flags, *_new]).strip()
    os.environ["XLA_FLAGS"] = os.environ["JAXVRL_TEST_XLA_FLAGS"] = _flags

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Tracing allocates many short-lived objects, and with the default thresholds Python's cyclic
# collector runs often, walking the whole heap that jax, flax, torch and transformers leave: the
# objects alive now are frozen out of it and it runs less often (measured: a first tiny train
# run 13-17% faster, a second one 3-4%). Reference counting still frees at once what holds no
# cycle; tests that need a collection at a given point call gc.collect().
gc.freeze()
gc.set_threshold(50_000, 20, 20)
# the processes the tests start collect as seldom (tests/subprocess_site/sitecustomize.py)
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "subprocess_site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_SITE, os.environ.get("PYTHONPATH")) if p
    )


# The files that take 10 s or more (up to three minutes) on the 2-core CI machine, longest
# first, as the last `.ci/run` measured them. `pytest -n 2 --dist loadfile` hands whole files
# to the two workers in collection order (with `--no-loadscope-reorder`, pyproject.toml;
# xdist's own order is by test count), so a long file collected last leaves one worker idle
# while the other finishes it; the long ones first (longest-processing-time scheduling) keep
# both busy to the end. A long file missing here is collected after all of them (three were:
# 34-50 s each).
LONG_FILES = (  # measured: .ci/run prints each file's total
    "trainer/test_train.py",
    "parallel/test_mesh_main_job.py",
    "trainer/test_families.py",
    "trainer/test_packing.py",
    "sampling/test_engine.py",
    "parallel/test_multihost.py",
    "aot/test_aot.py",
    "parallel/test_mesh_step.py",
    "parallel/test_sequence_parallel.py",
    "trainer/test_step.py",
    "trainer/test_video_rows.py",
    "models/test_cached_kernels.py",
    "sampling/test_sampler.py",
    "models/test_scan_layers.py",
    "trainer_infra/test_resume_damage.py",
    "trainer/test_build.py",
    "models/test_qwen2_5_vl_parity.py",
    "parallel/test_sharding.py",
    "trainer_infra/test_remote.py",
    "trainer_infra/test_export.py",
    "models/test_attention.py",
    "trainer/test_updates.py",
    "parallel/test_remat_precision.py",
    "trainer/test_experience.py",
    "trainer/test_ppo.py",
    "models/test_qwen3_vl_parity.py",
    "trainer/test_partial.py",
    "trainer/test_passes.py",
    "sampling/test_prefill.py",
    "trainer/test_text_models.py",
    "models/test_qwen2_5_vl_stats_io.py",
    "models/test_text_families.py",
    "sampling/test_cpu_kernels.py",
    "models/test_qwen3_vl_moe.py",
    "models/test_lora.py",
    "parallel/test_runtime.py",
    "models/test_qwen2_vl_parity.py",
    "trainer/test_diagnostics.py",
    "trainer_infra/test_hub.py",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = str(item.path).replace(os.sep, "/")
        for i, name in enumerate(LONG_FILES):
            if path.endswith("tests/" + name):
                return i
        return len(LONG_FILES)

    items.sort(key=rank)  # stable: tests keep their order within a file


# Each file's total time (setup, call and teardown of its tests, as the workers report them),
# printed after pytest's own `--durations` list when that is asked for (`.ci/run` asks for the
# 25 slowest tests), so that a file's growth shows in every run's log.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


@pytest.hookimpl(trylast=True)  # after pytest's own list
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("durations", None) is None or not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"seconds per file (all workers: {total:.0f} s)")
    for path, secs in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{secs:8.1f} s  {path}")
