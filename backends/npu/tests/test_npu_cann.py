"""lamina_npu.cann: the on-disk search for the CANN libraries, with real files in tmp dirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

cann = pytest.importorskip("lamina_npu.cann", reason="lamina-backend-npu is not installed")


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_ld_so_conf_includes_and_comments(tmp_path: Path) -> None:
    conf_d = tmp_path / "ld.so.conf.d"
    (conf_d).mkdir()
    (conf_d / "b.conf").write_text("/opt/b/lib  # trailing comment\n", encoding="utf-8")
    (conf_d / "a.conf").write_text("# only a comment\n/opt/a/lib\n", encoding="utf-8")
    (conf_d / "ignored.txt").write_text("/opt/ignored\n", encoding="utf-8")
    conf = tmp_path / "ld.so.conf"
    conf.write_text("include ld.so.conf.d/*.conf\n/opt/main/lib\n", encoding="utf-8")
    dirs = cann.loader_dirs({"LD_LIBRARY_PATH": "/first::/second"}, str(conf))
    assert dirs[:5] == ["/first", "/second", "/opt/a/lib", "/opt/b/lib", "/opt/main/lib"]
    assert "/opt/ignored" not in dirs
    assert "/usr/lib" in dirs


def test_find_library_follows_the_order(tmp_path: Path) -> None:
    first = _touch(tmp_path / "one" / "libhccl.so")
    _touch(tmp_path / "two" / "libhccl.so")
    dirs = [str(tmp_path / "missing"), str(first.parent), str(tmp_path / "two")]
    assert cann.find_library("libhccl.so", dirs) == str(first)
    assert cann.find_library("libascendcl.so", dirs) is None


def test_toolkit_roots_from_env_install_info_and_home(tmp_path: Path) -> None:
    env_root = tmp_path / "env-root"
    env_root.mkdir()
    info_base = tmp_path / "custom"
    (info_base / "cann").mkdir(parents=True)
    info = tmp_path / "ascend_cann_install.info"
    info.write_text(f"Install_Path={info_base}\nOther=1\n", encoding="utf-8")
    home_root = tmp_path / "home" / "Ascend" / "ascend-toolkit" / "latest"
    home_root.mkdir(parents=True)
    env = {"ASCEND_HOME_PATH": str(env_root), "HOME": str(tmp_path / "home")}
    roots = cann.toolkit_roots(env, str(info))
    assert roots[0] == str(env_root)
    assert str(info_base / "cann") in roots
    assert str(home_root) in roots


def test_probe_reports_usable_toolkit(tmp_path: Path) -> None:
    lib64 = tmp_path / "toolkit" / "lib64"
    for name in cann.REQUIRED_LIBRARIES:
        _touch(lib64 / name)
    env = {"LD_LIBRARY_PATH": str(lib64), "ASCEND_HOME_PATH": str(lib64.parent)}
    probe = cann.probe_cann(env, ld_so_conf=os.devnull, install_info=os.devnull)
    assert probe.usable and probe.reason() == ""
    assert probe.found["libhccl.so"] == str(lib64 / "libhccl.so")
    assert probe.toolkit_root == str(lib64.parent)


def test_probe_installed_but_not_on_the_search_path(tmp_path: Path) -> None:
    root = tmp_path / "cann"
    _touch(root / "lib64" / "libhccl.so")
    _touch(root / "runtime" / "lib64" / "libascendcl.so")
    _touch(root / "set_env.sh")
    probe = cann.probe_cann(
        {"ASCEND_TOOLKIT_HOME": str(root)}, ld_so_conf=os.devnull, install_info=os.devnull
    )
    if probe.found:
        pytest.skip("this machine's loader path holds CANN libraries")
    assert probe.missing == cann.REQUIRED_LIBRARIES
    assert probe.installed_at["libascendcl.so"] == str(
        root / "runtime" / "lib64" / "libascendcl.so"
    )
    reason = probe.reason()
    assert reason.startswith("libhccl.so (Ascend CANN toolkit) is installed at")
    assert f"source {root / 'set_env.sh'}" in reason


def test_probe_reason_when_nothing_is_installed(tmp_path: Path) -> None:
    probe = cann.probe_cann({"HOME": str(tmp_path)}, ld_so_conf=os.devnull)
    if probe.usable or probe.toolkit_root:
        pytest.skip("this machine has a CANN toolkit installed")
    reason = probe.reason()
    assert reason.startswith("libhccl.so and libascendcl.so not found")
    assert "install the Ascend CANN toolkit and source its set_env.sh" in reason
    assert "\n" not in reason
