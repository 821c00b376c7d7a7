"""Shared pytest setup: float32 everywhere, quiet logs, one XLA compilation cache per session."""

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
# The tests' programs are tiny: compiling them costs far more than running them. LLVM's
# optimisation passes (not XLA's graph passes, and never float semantics: no fast math) are
# most of a CPU compile, so the tests skip them; subprocesses inherit the flag.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# The files that take longest (half a minute to a few minutes each on the 2-core CI machine),
# longest first. `pytest -n 2 --dist loadfile` hands whole files to the two workers in
# collection order (with `--no-loadscope-reorder`, pyproject.toml; xdist's own order is by
# test count), so a long file collected last leaves one worker idle while the other finishes
# it; the long ones first (longest-processing-time scheduling) keep both busy to the end.
LONG_FILES = (
    "trainer/test_train.py",
    "trainer/test_build.py",
    "parallel/test_mesh_main_job.py",
    "parallel/test_mesh_step.py",
    "trainer/test_step.py",
    "trainer/test_updates.py",
    "aot/test_aot.py",
    "parallel/test_runtime.py",
    "parallel/test_multihost.py",
    "trainer/test_ppo.py",
    "sampling/test_engine.py",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = str(item.path).replace(os.sep, "/")
        for i, name in enumerate(LONG_FILES):
            if path.endswith("tests/" + name):
                return i
        return len(LONG_FILES)

    items.sort(key=rank)  # stable: tests keep their order within a file
