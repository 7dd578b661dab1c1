"""Every core test starts clean, on the cpu backend; a test meant to run on the device asks
for ``device_backend`` (``$LAMINA_TEST_BACKEND``, cpu when unset: ``requested_backend.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lamina.testing.harness import preload
from requested_backend import usable_requested_backend

# The fine-tuning and Trainer tests' ranks build transformers models with peft adapters:
# imported once in the forkserver instead of in each of their ranks (skipped where not
# installed). Lightning is not: the forkserver grows by it and every rank forked from it
# started slower (test_tensor_parallel.py alone: 55-67 s with it, 50-56 s without), for
# the 6 ranks that need it.
preload("transformers", "peft")


@pytest.fixture(scope="session", autouse=True)
def _core_jobs_on_cpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``LAMINA_BACKEND=cpu`` for the whole session, so that module-scoped jobs (set up
        before any function-scoped fixture) also start their ranks on cpu, whatever
        accelerator backend is installed beside core; compiled steps' artifacts in a session
    directory (``LAMINA_COMPILE_CACHE``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAMINA_BACKEND", "cpu")
        # compiled steps keep their artifacts for the session only, not in ~/.cache
        compiled = tmp_path_factory.mktemp("compiled-artifacts")
        patch.setenv("LAMINA_COMPILE_CACHE", str(compiled))
        yield


@pytest.fixture(autouse=True)
def _core_tests_on_cpu(lamina_clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Core tests pin ``LAMINA_BACKEND=cpu`` so that they mean the same thing in every nox
    session, whatever accelerator backend is installed beside core (``lamina_clean``
    removes launcher variables first)."""
    monkeypatch.setenv("LAMINA_BACKEND", "cpu")


@pytest.fixture(scope="session")
def device_backend() -> str:
    """The backend ``$LAMINA_TEST_BACKEND`` asks the device tests to run on (cpu when unset;
    one named but missing or unable to run here fails the test). Such a test starts its
    ranks on it by name, since ``LAMINA_BACKEND`` stays cpu, and checks that it ran there."""
    return usable_requested_backend()


#: The slowest modules, slowest first (seconds of one module's tests alone on 2 cores:
#: compiled_step 334, emulate 255, checkpoint 149, tensor_parallel 117, pipeline 100,
#: finetuning 64, checkpoint_cli 61, ..., measured 2026-12-01 to 12-04; in the whole suite
#: on 2026-12-05: emulate 178, compiled_step 147, checkpoint 146, examples 102, cli_plan
#: 92, gpu_suite 84, pipeline 84, tensor_parallel 51, the Trainer and Lightning tests ~30;
#: on 2026-12-06 the compiled step's newer modules: compile_once 106 (before its two
#: file jobs became one), compiled_tensor_parallel 70, compiled_codecs 50,
#: compiled_pipeline 35).
#: pytest-xdist hands whole modules (``--dist loadfile``) to its workers in collection
#: order (``--no-loadscope-reorder``, noxfile.py), so these start first and the short
#: modules fill the gaps: a long module started last would end the session alone. The
#: emulator's tests mostly wait (shaped links, timeouts, a failed host's grace), which the
#: other workers' tests fill. A module missing here only runs later, in file order.
SLOWEST_FIRST = (
    "test_emulate.py",
    "test_checkpoint.py",
    "test_compiled_step.py",
    "test_compile_once.py",
    "test_examples.py",
    "test_cli_plan.py",
    "test_gpu_suite.py",
    "test_tensor_parallel.py",
    "test_pipeline.py",
    "test_compiled_tensor_parallel.py",
    "test_compiled_codecs.py",
    "test_compiled_pipeline.py",
    "test_context_parallel.py",
    "test_hf_trainer.py",
    "test_lightning.py",
    "test_pipeline_models_today.py",
    "test_finetuning.py",
    "test_checkpoint_cli.py",
    "test_cli_run.py",
    "test_zero3_finetune.py",
    "test_plugin_new.py",
    "test_fp8_training.py",
    "test_bench_collectives.py",
    "test_harness.py",
    "test_conformance_kit.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the modules of ``SLOWEST_FIRST`` first, in its order (the rest keep theirs)."""
    rank = {name: k for k, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
