"""``lamina checkpoint ls | verify | diff | export`` on checkpoints that real 2-rank jobs
(DP and ZeRO-3) saved through CheckpointManager, intact and damaged by hand."""

from __future__ import annotations

import datetime
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import lamina
from files_for_tests import flip_byte
from lamina.checkpoint import CheckpointManager
from lamina.checkpoint.inspect import (
    bitwise_equal,
    diff_states,
    export_model,
    format_age,
    load_flat,
    resolve_step,
    safetensors_ready,
    verify_step,
)
from lamina.cli.main import main
from lamina.errors import ConfigError
from lamina.testing import run_ranks
from lamina.testing.cli import run_lamina


def _save_three_steps(base: str) -> None:
    """On each rank of a 2-rank job: for dp and then zero3, 3 AdamW steps of a small model,
    each saved through CheckpointManager (keep=2), then rank 0 writes the final full state
    (the model's own names) beside the checkpoints as ``<root>.expected.pt``."""
    rt = lamina.init()
    for strategy in ("dp", "zero3"):
        root = f"{base}/{strategy}"
        torch.manual_seed(0)
        options = {"example_inputs": (torch.randn(4, 8),)} if strategy == "dp" else {}
        net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        m = lamina.distribute(net, strategy, **options)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        mgr = CheckpointManager(root, keep=2)
        for s in range(1, 4):
            m(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(s, m, opt, extra={"pos": s})
        full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
        if rt.is_main:
            names = {k: v.detach().clone() for k, v in full.items()}
            torch.save(names, root + ".expected.pt")
    lamina.shutdown()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{'dp': root, 'zero3': root}: a real 2-rank job committed steps 2 and 3 of each
    (keep=2)."""
    base = tmp_path_factory.mktemp("checkpoints")
    run_ranks(_save_three_steps, 2, args=(str(base),), timeout=150)
    return {name: base / name for name in ("dp", "zero3")}


def _copy(saved: dict[str, Path], tmp_path: Path, name: str = "dp") -> Path:
    return Path(shutil.copytree(saved[name], tmp_path / name))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["checkpoint", *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- ls --------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_ls_shows_committed_incomplete_and_bad_steps(saved: dict[str, Path], tmp_path: Path):
    root = _copy(saved, tmp_path)
    # step 3 written 3 minutes ago: the age shown does not depend on how fast this runs
    manifest = root / "step-3" / "manifest.json"
    data = json.loads(manifest.read_text())
    then = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=3, seconds=5)
    data["created"] = then.isoformat(timespec="seconds")
    manifest.write_text(json.dumps(data))
    (root / "step-4.incomplete").mkdir()
    (root / "step-4.incomplete" / "__0_0.distcp").write_bytes(b"x" * 10)
    (root / "step-5").mkdir()
    (root / "step-5" / "manifest.json").write_text("{not json")
    result = run_lamina("checkpoint", "ls", str(root))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["step", "state"]
    rows = lines[1:]
    assert [r.split()[0] for r in rows] == ["2", "3", "4", "5"]
    assert "complete" in rows[0] and " 2 " in rows[0] and "dp" in rows[0]
    assert "KiB" in rows[1] and "3 min ago" in rows[1], rows[1]
    assert "incomplete (never committed)" in rows[2]
    assert "bad manifest: not readable JSON" in rows[3]


def test_ls_of_a_missing_directory_is_one_line(tmp_path: Path):
    result = run_lamina("checkpoint", "ls", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


# -- verify ----------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_verify_ok(saved: dict[str, Path], capsys: pytest.CaptureFixture[str]):
    code, out, _ = _cli(capsys, "verify", str(saved["dp"]))
    assert code == 0
    assert out.startswith("OK step-3: 5 files, ")
    code, out, _ = _cli(capsys, "verify", str(saved["zero3"]), "--step", "2")
    assert code == 0 and out.startswith("OK step-2: 5 files")
    code, out, _ = _cli(capsys, "verify", str(saved["dp"] / "step-2"))
    assert code == 0 and out.startswith("OK step-2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: flip_byte(d / "__1_0.distcp"), "__1_0.distcp does not match its sha256"),
        (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-7]),
         "__0_0.distcp has"),
        (lambda d: (d / "rank-1.pt").unlink(), "rank-1.pt is missing"),
        (lambda d: flip_byte(d / ".metadata"), ".metadata does not match"),
        (lambda d: (d / "notes.txt").write_text("hi"), "notes.txt is not in the manifest"),
        (lambda d: (d / "manifest.json").write_text("[]"), "'format' is not"),
    ],
)  # fmt: skip
def test_verify_names_the_damaged_file(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], damage, expected
):
    root = _copy(saved, tmp_path)
    damage(root / "step-3")
    code, out, err = _cli(capsys, "verify", str(root))
    assert code == 1 and out == ""
    assert expected in err and err.count("\n") == 1
    # the other step is intact
    assert _cli(capsys, "verify", str(root), "--step", "2")[0] == 0


@pytest.mark.timeout(300)
def test_verify_bad_inputs(saved: dict[str, Path], tmp_path: Path, capsys):
    cases = [
        ([str(tmp_path / "nope")], "does not exist"),
        ([str(tmp_path)], "has no committed step"),
        ([str(saved["dp"]), "--step", "1"], "no committed step 1; its steps are 2, 3"),
        ([str(saved["dp"] / "step-2"), "--step", "3"], "is step 2, not --step 3"),
    ]
    for args, expected in cases:
        code, _, err = _cli(capsys, "verify", *args)
        assert code == 2 and expected in err and err.count("\n") == 1, (args, err)
    incomplete = tmp_path / "step-9.incomplete"
    incomplete.mkdir()
    code, _, err = _cli(capsys, "verify", str(incomplete))
    assert code == 2 and "never committed" in err


# -- diff ------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_diff_with_itself_is_bitwise_equal(saved: dict[str, Path], capsys):
    code, out, _ = _cli(capsys, "diff", str(saved["dp"]), str(saved["dp"] / "step-3"))
    assert code == 0, out
    assert "model.0.weight" in out and "optim.state.1.bias.exp_avg_sq" in out
    assert out.splitlines()[-1].endswith("identical")
    code, out, _ = _cli(capsys, "diff", str(saved["zero3"]), str(saved["zero3"]), "--step", "2")
    assert code == 0 and "equal (bitwise)" in out


@pytest.mark.timeout(300)
def test_diff_of_two_steps_reports_the_differences(saved: dict[str, Path], capsys):
    code, out, _ = _cli(capsys, "diff", str(saved["dp"] / "step-2"), str(saved["dp"] / "step-3"))
    assert code == 1
    weight = next(line for line in out.splitlines() if line.split()[0] == "model.0.weight")
    assert float(weight.split()[-1]) > 0
    assert "rank-0.extra.pos" in out and "2 vs 3" in out
    assert "largest: model." in out.splitlines()[-1]
    # and in the library: rows per name
    a_dir, b_dir = saved["dp"] / "step-2", saved["dp"] / "step-3"
    rows = diff_states(load_flat(a_dir, verify_step(a_dir)), load_flat(b_dir, verify_step(b_dir)))
    by_name = {r.name: r for r in rows}
    assert by_name["model.0.weight"].status == "differs"
    assert by_name["optim.param_groups.0.lr"].equal


@pytest.mark.timeout(300)
def test_zero3_shards_are_joined(saved: dict[str, Path]):
    directory = resolve_step(saved["zero3"])
    flat = load_flat(directory, verify_step(directory))
    assert flat["model.0.weight"].shape == (8, 8)
    assert flat["optim.state.0.weight.exp_avg"].shape == (8, 8)
    assert flat["rank-1.extra.pos"] == 3


@pytest.mark.timeout(300)
def test_diff_of_a_corrupted_checkpoint_is_an_error(saved: dict[str, Path], tmp_path: Path):
    root = _copy(saved, tmp_path)
    flip_byte(root / "step-3" / ".metadata")
    result = run_lamina("checkpoint", "diff", str(saved["dp"]), str(root))
    assert result.returncode == 2
    assert ".metadata does not match its sha256" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


# -- export ----------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_export_writes_the_models_parameters(
    saved: dict[str, Path], tmp_path: Path, capsys, strategy: str
):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    code, printed, err = _cli(capsys, "export", str(saved[strategy]), "--step", "3", str(out))
    assert code == 0, err
    assert "4 tensors" in printed
    exported = load_file(str(out))
    expected = torch.load(str(saved[strategy]) + ".expected.pt", weights_only=True)
    assert sorted(exported) == ["0.bias", "0.weight", "1.bias", "1.weight"] == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.timeout(300)
def test_export_without_safetensors(saved: dict[str, Path], tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    directory = resolve_step(saved["dp"])
    with pytest.raises(ConfigError, match=r"pip install 'lamina-core\[export\]'"):
        export_model(directory, verify_step(directory), tmp_path / "m.safetensors")


@pytest.mark.timeout(300)
def test_export_of_a_damaged_step_writes_nothing(saved, tmp_path: Path, capsys):
    root = _copy(saved, tmp_path)
    (root / "step-3" / "rank-0.pt").unlink()
    out = tmp_path / "m.safetensors"
    code, _, err = _cli(capsys, "export", str(root), str(out))
    assert code == 2 and "rank-0.pt is missing" in err
    assert not out.exists()


# -- pure helpers ----------------------------------------------------------------------------
def test_bitwise_equal_and_diff_rows():
    nan = torch.tensor([float("nan"), 1.0])
    assert bitwise_equal(nan, nan.clone())
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    rows = diff_states(
        {"a": torch.zeros(2), "b": torch.zeros(2), "c": 1, "d": torch.zeros(2)},
        {"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.int64), "c": 2, "e": 0},
    )
    assert [(r.name, r.status) for r in rows] == [
        ("a", "shape differs"),
        ("b", "dtype differs"),
        ("c", "differs"),
        ("d", "only in A"),
        ("e", "only in B"),
    ]


def test_safetensors_ready_unties_shared_tensors():
    shared = torch.arange(6.0).reshape(2, 3)
    ready = safetensors_ready({"a": shared, "b": shared, "c": shared.t()})
    pointers = {t.untyped_storage().data_ptr() for t in ready.values()}
    assert len(pointers) == 3 and all(t.is_contiguous() for t in ready.values())
    assert torch.equal(ready["c"], shared.t())


def test_format_age():
    now = datetime.datetime(2025, 1, 1, 12, tzinfo=datetime.timezone.utc)
    ago = [now - datetime.timedelta(seconds=s) for s in (1, 42, 200, 3 * 3600, 5 * 86400)]
    assert [format_age(t, now) for t in ago] == [
        "just now",
        "42 s ago",
        "3 min ago",
        "3 h ago",
        "5 days ago",
    ]


@pytest.mark.timeout(300)
def test_a_manifest_naming_another_step_is_refused(saved: dict[str, Path], tmp_path: Path):
    root = _copy(saved, tmp_path)
    path = root / "step-3" / "manifest.json"
    data = json.loads(path.read_text())
    data["step"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="says step 7"):
        verify_step(root / "step-3")
