"""``lamina plugin new``: a backend package from the template shipped in lamina-core."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from lamina.cli.main import main
from lamina.errors import ConfigError
from lamina.scaffold import backend_names, render_files
from lamina.testing.cli import run_lamina

REPO_TEMPLATE = Path(__file__).resolve().parents[1] / "plugins" / "template_backend"
#: Build and tool outputs that may sit in a package folder without being part of it.
_NOT_SOURCES = {"__pycache__", "build", "dist", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def _package_files(folder: Path) -> dict[PurePosixPath, bytes]:
    files: dict[PurePosixPath, bytes] = {}
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if any(p in _NOT_SOURCES or p.endswith(".egg-info") for p in parts):
            continue
        if path.is_file():
            files[PurePosixPath(*parts)] = path.read_bytes()
    return files


def test_plugins_template_backend_is_the_shipped_template_rendered() -> None:
    """One source of truth: plugins/template_backend is `lamina plugin new template`."""
    rendered = render_files(backend_names("template"))
    in_repo = _package_files(REPO_TEMPLATE)
    regenerate = (
        "edit core/src/lamina/scaffold/backend_template/ (the source), then regenerate with "
        "`lamina plugin new template --dir /tmp/t && cp -r /tmp/t/. plugins/template_backend/`"
    )
    assert sorted(in_repo) == sorted(rendered), regenerate
    differing = [str(path) for path, content in rendered.items() if in_repo[path] != content]
    assert not differing, f"{differing} differ from the template; {regenerate}"


def test_every_name_changes() -> None:
    files = render_files(backend_names("my_dev"))
    assert set(map(str, files)) == {
        "README.md",
        "pyproject.toml",
        "src/lamina_my_dev/__init__.py",
        "src/lamina_my_dev/backend.py",
        "src/lamina_my_dev/kernels.py",
        "src/lamina_my_dev/plugin.py",
        "src/lamina_my_dev/py.typed",
        "tests/test_conformance_my_dev.py",
        "tests/test_my_dev.py",
    }
    text = "\n".join(content.decode() for content in files.values())
    for old in ("lamina_template", "lamina-backend-template", "Template", '"template"', "{{"):
        assert old not in text, old
    pyproject = files[PurePosixPath("pyproject.toml")].decode()
    assert 'name = "lamina-backend-my_dev"' in pyproject
    assert '[project.entry-points.lamina]\nmy_dev = "lamina_my_dev.plugin"' in pyproject
    backend = files[PurePosixPath("src/lamina_my_dev/backend.py")].decode()
    assert 'BACKEND_NAME = "my_dev"' in backend
    assert "class MyDevBackend(Backend)" in backend and "class MyDevHandle(DeviceHandle)" in backend
    kit = files[PurePosixPath("tests/test_conformance_my_dev.py")].decode()
    assert "class TestMyDevConformance(BackendConformance)" in kit
    assert 'backends = ("my_dev",)' in kit
    for path, content in files.items():
        if path.suffix == ".py":
            compile(content, str(path), "exec")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("MyDev", "not a valid backend name"),
        ("my-dev", "not a valid backend name"),
        ("2dev", "not a valid backend name"),
        ("my__dev", "not a valid backend name"),
        ("dev_", "not a valid backend name"),
        ("", "not a valid backend name"),
        ("cpu", "taken by lamina-core's own backend"),
        ("cuda", "taken by lamina's backend lamina-backend-cuda"),
        ("reference", "taken by the kernel registry"),
    ],
)
def test_bad_names_are_refused_in_one_line(name: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        backend_names(name)
    message = str(info.value)
    assert "\n" not in message
    assert "choose another name" in message or "(e.g. 'mydevice')" in message


def test_a_name_installed_by_another_distribution_is_refused() -> None:
    installed = {"gaudi": "lamina-gaudi-community", "template": "lamina-backend-template"}
    with pytest.raises(ConfigError, match="'gaudi' is taken by lamina-gaudi-community"):
        backend_names("gaudi", installed)
    # the same package may be generated again (e.g. to compare with a newer template)
    assert backend_names("template", installed).distribution == "lamina-backend-template"


def test_cli_never_overwrites_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "backend.py").write_text("my work")
    assert main(["plugin", "new", "demo", "--dir", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and "never overwrites" in err
    assert [p.name for p in target.iterdir()] == ["backend.py"]
    assert (target / "backend.py").read_text() == "my work"


def test_cli_reports_a_bad_name_without_creating_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plugin", "new", "cpu"]) == 2
    assert "backend name 'cpu' is taken" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_default_folder_and_next_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plugin", "new", "demo"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "lamina-backend-demo"
    assert (folder / "src" / "lamina_demo" / "backend.py").is_file()
    assert "created lamina-backend-demo" in out and "tests/test_conformance_demo.py" in out
    assert "pip install -e ./lamina-backend-demo" in out
    assert "pytest -q ./lamina-backend-demo/tests" in out


@pytest.mark.multiprocess
def test_generated_package_installs_and_passes_the_conformance_kit(tmp_path: Path) -> None:
    """What an author does: generate, install (here into a private folder, leaving this
    environment alone), run the package's own tests."""
    pytest.importorskip("setuptools", reason="pip builds the generated package with setuptools")
    package, site = tmp_path / "lamina-backend-demo", tmp_path / "site"
    created = run_lamina("plugin", "new", "demo", "--dir", str(package))
    assert created.returncode == 0, created.stderr
    assert "next steps:" in created.stdout
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q"]
    install = subprocess.run(
        [*pip, "--target", str(site), str(package)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert (site / "lamina_demo" / "plugin.py").is_file()

    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = tests.stdout + tests.stderr
    assert tests.returncode == 0, output
    summary = re.search(r"(\d+) passed", output.splitlines()[-1])
    assert summary and int(summary[1]) >= 30, output[-2000:]
    assert "failed" not in output.splitlines()[-1] and "error" not in output.splitlines()[-1]
    for check in ("test_collective_all_reduce", "test_memory_stats_see_an_allocation"):
        assert f"TestDemoConformance::{check}[demo] PASSED" in output, output[-2000:]
    assert "test_kernel_matches_reference[demo-scale_accumulate@demo] PASSED" in output
    assert "test_lamina_backend_env_selects_demo PASSED" in output
