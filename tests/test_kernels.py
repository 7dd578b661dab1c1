"""Named kernels: registry, launcher, geometry, built-in references and the CPU implementations."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.backends.cpu_kernels import (
    pack_bucket_cat,
    register_cpu_kernels,
    scale_accumulate_add,
)
from lamina.device.kernels import (
    REFERENCE,
    Dim3,
    KernelLauncher,
    KernelRegistry,
    KernelSpec,
    LaunchConfig,
    builtin_registry,
    elementwise_geometry,
)
from lamina.errors import KernelError

pytestmark = pytest.mark.portable

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.complex64,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities and denormals included) of ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in logical order, for a bit-exact comparison."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def cpu_launcher() -> KernelLauncher:
    registry = builtin_registry()
    register_cpu_kernels(registry)
    return KernelLauncher(registry, "cpu")


def check_round_trip(tensors: list[torch.Tensor]) -> None:
    ref = KernelLauncher(builtin_registry(), "nothing-registered")
    cpu = cpu_launcher()
    assert ref.implementation_name("pack_bucket") == REFERENCE
    assert cpu.implementation_name("pack_bucket") == "cpu"
    shapes = [t.shape for t in tensors]
    total = sum(t.numel() for t in tensors)

    packed_ref = ref.launch("pack_bucket", tensors)
    packed_cpu = cpu.launch("pack_bucket", tensors)
    assert packed_ref.shape == (total,)
    assert bits_equal(packed_ref, packed_cpu)
    assert bits_equal(packed_ref, cpu.reference("pack_bucket", tensors))
    if tensors:
        expected = torch.cat([t.reshape(-1) for t in tensors])
        assert bits_equal(packed_ref, expected)

    for launcher, packed in ((ref, packed_ref), (cpu, packed_cpu)):
        views = launcher.launch("unpack_bucket", packed, shapes)
        copies = launcher.launch(
            "unpack_bucket", packed, shapes, out=[torch.empty_like(t) for t in tensors]
        )
        for original, view, copy in zip(tensors, views, copies, strict=True):
            assert bits_equal(view, original)
            assert bits_equal(copy, original)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_unpack_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1234)
    shapes: list[tuple[int, ...]] = [(3, 5), (), (0,), (7,), (2, 3, 4), (1, 0, 2)]
    check_round_trip([random_tensor(s, dtype, gen) for s in shapes])


@settings(max_examples=150, deadline=None)
@given(
    shapes=st.lists(
        st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple), min_size=1, max_size=6
    ),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip_property(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    check_round_trip([random_tensor(s, dtype, gen) for s in shapes])


def test_pack_flattens_non_contiguous_tensors_in_logical_order() -> None:
    a = torch.arange(6.0).reshape(2, 3).t()
    b = torch.arange(10.0, 20.0)[::3]
    for launcher in (KernelLauncher(builtin_registry(), "none"), cpu_launcher()):
        packed = launcher.launch("pack_bucket", [a, b])
        assert torch.equal(packed, torch.cat([a.reshape(-1), b]))


@pytest.mark.parametrize("use_cpu", [False, True], ids=["reference", "cpu"])
def test_pack_into_out_returns_out_and_zeroes_tail(use_cpu: bool) -> None:
    launcher = cpu_launcher() if use_cpu else KernelLauncher(builtin_registry(), "none")
    tensors = [torch.ones(2, 2), torch.full((3,), 2.0)]
    out = torch.full((10,), float("nan"))
    result = launcher.launch("pack_bucket", tensors, out=out)
    assert result is out
    assert torch.equal(out, torch.tensor([1.0, 1, 1, 1, 2, 2, 2, 0, 0, 0]))
    exact = torch.full((7,), -1.0)
    assert launcher.launch("pack_bucket", tensors, exact) is exact
    assert torch.equal(exact, torch.tensor([1.0, 1, 1, 1, 2, 2, 2]))


def test_pack_into_strided_out() -> None:
    tensors = [torch.arange(3.0), torch.arange(4.0)]
    for launcher in (KernelLauncher(builtin_registry(), "none"), cpu_launcher()):
        base = torch.full((20,), -1.0)
        out = base[::2]
        launcher.launch("pack_bucket", tensors, out=out)
        assert torch.equal(out, torch.tensor([0.0, 1, 2, 0, 1, 2, 3, 0, 0, 0]))
        assert torch.equal(base[1::2], torch.full((10,), -1.0))


def test_pack_does_not_record_autograd() -> None:
    w = torch.randn(3, requires_grad=True)
    for launcher in (KernelLauncher(builtin_registry(), "none"), cpu_launcher()):
        packed = launcher.launch("pack_bucket", [w, torch.randn(2)])
        assert packed.grad_fn is None
        assert torch.equal(packed[:3], w.detach())


# --------------------------------------------------------------------------- unpack


def test_unpack_without_out_returns_views_of_flat() -> None:
    launcher = KernelLauncher(builtin_registry(), "cpu")
    flat = torch.arange(12.0)
    views = launcher.launch("unpack_bucket", flat, [torch.Size([2, 3]), (4,), (), (0, 5)])
    assert [tuple(v.shape) for v in views] == [(2, 3), (4,), (), (0, 5)]
    for v in views:
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    views[0][1, 2] = -1.0
    views[1][0] = -2.0
    views[2].fill_(-3.0)
    assert flat[5].item() == -1.0
    assert flat[6].item() == -2.0
    assert flat[10].item() == -3.0
    assert flat[11].item() == 11.0  # beyond the shapes: untouched


def test_unpack_with_out_copies() -> None:
    launcher = KernelLauncher(builtin_registry(), "cpu")
    flat = torch.arange(10.0)
    out = [torch.zeros(2, 2), torch.zeros(3)]
    result = launcher.launch("unpack_bucket", flat, [(2, 2), (3,)], out=out)
    assert result == out
    assert result[0] is out[0] and result[1] is out[1]
    assert torch.equal(out[0], torch.tensor([[0.0, 1], [2, 3]]))
    assert torch.equal(out[1], torch.tensor([4.0, 5, 6]))
    out[0].fill_(99.0)
    assert torch.equal(flat, torch.arange(10.0))


def test_unpack_of_strided_flat() -> None:
    launcher = KernelLauncher(builtin_registry(), "cpu")
    flat = torch.arange(20.0)[::2]
    (view,) = launcher.launch("unpack_bucket", flat, [(2, 3)])
    assert torch.equal(view, torch.tensor([[0.0, 2, 4], [6, 8, 10]]))


# --------------------------------------------------------------------------- scale_accumulate


@pytest.mark.parametrize("scale", [0.0, 1.0, -2.7, 0.1, 1 / 3, 1e-3, 3])
def test_scale_accumulate_matches_reference_exactly(scale: float) -> None:
    gen = torch.Generator().manual_seed(7)
    dst = torch.randn(1003, generator=gen)
    src = torch.randn(1003, generator=gen)
    ref_dst = dst.clone()
    ref = KernelLauncher(builtin_registry(), "none").launch("scale_accumulate", ref_dst, src, scale)
    cpu = cpu_launcher()
    assert cpu.implementation_name("scale_accumulate") == "cpu"
    cpu_dst = dst.clone()
    result = cpu.launch("scale_accumulate", cpu_dst, src, scale)
    assert ref is ref_dst and result is cpu_dst
    torch.testing.assert_close(cpu_dst, ref_dst, rtol=0, atol=0)
    torch.testing.assert_close(ref_dst, dst + scale * src, rtol=1e-5, atol=1e-6)


def test_scale_accumulate_in_place_on_leaf_that_requires_grad() -> None:
    p = torch.zeros(4, requires_grad=True)
    cpu_launcher().launch("scale_accumulate", p, torch.ones(4), 0.5)
    assert torch.equal(p.detach(), torch.full((4,), 0.5))
    assert p.grad_fn is None


# --------------------------------------------------------------------------- errors


def test_unknown_kernel_lists_known_names() -> None:
    launcher = KernelLauncher(builtin_registry(), "cpu")
    with pytest.raises(KernelError) as info:
        launcher.launch("no_such_kernel", torch.ones(1))
    assert str(info.value) == (
        "unknown kernel 'no_such_kernel'; known kernels: fp8_dequantize, fp8_quantize, "
        "pack_bucket, scale_accumulate, unpack_bucket"
    )
    assert isinstance(info.value, LookupError)
    for call in (
        lambda: builtin_registry().spec("nope"),
        lambda: builtin_registry().implementation("nope", "cpu"),
        lambda: builtin_registry().backends_for("nope"),
        lambda: launcher.implementation_name("nope"),
        lambda: launcher.reference("nope"),
    ):
        with pytest.raises(KernelError, match="known kernels: fp8_dequantize, "):
            call()
    with pytest.raises(KernelError, match=r"known kernels: \(none\)"):
        KernelRegistry().spec("x")


@pytest.mark.parametrize("use_cpu", [False, True], ids=["reference", "cpu"])
def test_pack_errors(use_cpu: bool) -> None:
    launcher = cpu_launcher() if use_cpu else KernelLauncher(builtin_registry(), "none")
    f32 = torch.zeros(3)
    with pytest.raises(KernelError, match=r"tensors\[2\] has dtype torch\.float16"):
        launcher.launch("pack_bucket", [f32, f32, f32.half(), f32.double()])
    with pytest.raises(KernelError, match="tensors is empty"):
        launcher.launch("pack_bucket", [])
    with pytest.raises(KernelError, match=r"tensors\[1\] is a int"):
        launcher.launch("pack_bucket", [f32, 3])
    with pytest.raises(KernelError, match="list or tuple"):
        launcher.launch("pack_bucket", f32)
    with pytest.raises(
        KernelError, match=r"out has 5 elements but the tensors need 6; .* at least 6"
    ):
        launcher.launch("pack_bucket", [f32, f32], out=torch.zeros(5))
    with pytest.raises(KernelError, match="out must be 1-D"):
        launcher.launch("pack_bucket", [f32, f32], out=torch.zeros(2, 3))
    with pytest.raises(KernelError, match=r"out has dtype torch\.float64"):
        launcher.launch("pack_bucket", [f32, f32], out=torch.zeros(6, dtype=torch.float64))


def test_pack_error_names_device_offender() -> None:
    meta = torch.empty(2, device="meta")
    with pytest.raises(KernelError, match=r"tensors\[1\] is on meta but tensors\[0\] is on cpu"):
        builtin_registry().spec("pack_bucket").reference(
            elementwise_geometry(4), [torch.zeros(2), meta]
        )


def test_unpack_errors() -> None:
    launcher = KernelLauncher(builtin_registry(), "cpu")
    with pytest.raises(KernelError, match="flat has 5 elements but the shapes need 6"):
        launcher.launch("unpack_bucket", torch.zeros(5), [(2, 3)])
    with pytest.raises(KernelError, match="flat must be 1-D"):
        launcher.launch("unpack_bucket", torch.zeros(2, 3), [(2, 3)])
    with pytest.raises(KernelError, match=r"shapes\[1\] = \(2, -1\) is not a shape"):
        launcher.launch("unpack_bucket", torch.zeros(6), [(1,), (2, -1)])
    with pytest.raises(KernelError, match="out has 1 tensors but shapes has 2"):
        launcher.launch("unpack_bucket", torch.zeros(6), [(1,), (2,)], out=[torch.zeros(1)])
    with pytest.raises(KernelError, match=r"out\[1\] has shape \(3,\) but shapes\[1\] is \(2,\)"):
        launcher.launch(
            "unpack_bucket", torch.zeros(6), [(1,), (2,)], out=[torch.zeros(1), torch.zeros(3)]
        )
    with pytest.raises(KernelError, match=r"out\[0\] is torch.float64"):
        launcher.launch("unpack_bucket", torch.zeros(6), [(1,)], out=[torch.zeros(1).double()])


@pytest.mark.parametrize("use_cpu", [False, True], ids=["reference", "cpu"])
def test_scale_accumulate_errors(use_cpu: bool) -> None:
    launcher = cpu_launcher() if use_cpu else KernelLauncher(builtin_registry(), "none")
    with pytest.raises(KernelError, match=r"dst has shape \(3,\) but src has \(4,\)"):
        launcher.launch("scale_accumulate", torch.zeros(3), torch.zeros(4), 1.0)
    with pytest.raises(
        KernelError, match=r"dst has dtype torch\.float32 but src has torch\.float16"
    ):
        launcher.launch("scale_accumulate", torch.zeros(3), torch.zeros(3).half(), 1.0)
    with pytest.raises(KernelError, match="dst is on cpu but src is on meta"):
        launcher.launch("scale_accumulate", torch.zeros(3), torch.zeros(3, device="meta"), 1.0)
    with pytest.raises(KernelError, match="not floating point"):
        launcher.launch("scale_accumulate", torch.zeros(3).long(), torch.zeros(3).long(), 1.0)


def test_register_for_undefined_kernel() -> None:
    registry = builtin_registry()
    with pytest.raises(KernelError) as info:
        registry.register("fused_adam", "cpu", pack_bucket_cat)
    message = str(info.value)
    assert "unknown kernel 'fused_adam'" in message
    assert "known kernels: fp8_dequantize, fp8_quantize, pack_bucket" in message
    with pytest.raises(KernelError, match="reserved"):
        registry.register("pack_bucket", REFERENCE, pack_bucket_cat)
    with pytest.raises(KernelError, match="must be callable"):
        registry.register("pack_bucket", "cpu", "not a function")  # type: ignore[arg-type]


def test_define_twice_rejected() -> None:
    registry = builtin_registry()
    spec = registry.spec("pack_bucket")
    with pytest.raises(KernelError, match="'pack_bucket' is already defined"):
        registry.define(spec)
    with pytest.raises(KernelError, match="non-empty string"):
        registry.define(KernelSpec("", "doc", pack_bucket_cat, elementwise_geometry))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"x": 0}, "x"), ({"y": -1}, "y"), ({"z": 0}, "z"), ({"x": 1.5}, "x"), ({"y": True}, "y")],
)
def test_dim3_rejects_bad_values(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"Dim3\.{field} must be an int >= 1"):
        Dim3(**kwargs)


def test_dim3_volume_and_defaults() -> None:
    assert Dim3() == Dim3(1, 1, 1)
    assert Dim3(4, 3, 2).volume == 24
    with pytest.raises(ValueError, match=r"Dim3\.x"):
        Dim3(0)


# --------------------------------------------------------------------------- registry


def test_builtin_registry_contents_and_independence() -> None:
    a = builtin_registry()
    b = builtin_registry()
    assert a.names() == [
        "fp8_dequantize",
        "fp8_quantize",
        "pack_bucket",
        "scale_accumulate",
        "unpack_bucket",
    ]
    for name in a.names():
        spec = a.spec(name)
        assert spec.name == name and spec.doc
        assert a.backends_for(name) == []
    register_cpu_kernels(a)
    assert a.backends_for("pack_bucket") == ["cpu"]
    assert a.backends_for("scale_accumulate") == ["cpu"]
    assert a.backends_for("unpack_bucket") == []
    assert b.backends_for("pack_bucket") == []
    assert a.implementation("pack_bucket", "cpu") == (pack_bucket_cat, "cpu")
    assert a.implementation("scale_accumulate", "cpu") == (scale_accumulate_add, "cpu")
    fn, impl = a.implementation("unpack_bucket", "cpu")
    assert impl == REFERENCE and fn is a.spec("unpack_bucket").reference


def test_the_kernel_modules_keep_their_public_names() -> None:
    """The split modules' names stay importable where users import them, as one object."""
    import lamina
    import lamina.device.kernels as kernels
    from lamina.device import bucket_kernels, fp8_kernels, kernel_registry

    assert sorted(kernels.__all__) == sorted(
        [
            "REFERENCE",
            "Dim3",
            "KernelFn",
            "KernelLauncher",
            "KernelRegistry",
            "KernelSpec",
            "LaunchConfig",
            "builtin_registry",
            "check_scale_accumulate_args",
            "elementwise_geometry",
            "prepare_pack_bucket",
        ]
    )
    for name in kernels.__all__:
        defined_in = bucket_kernels if hasattr(bucket_kernels, name) else kernel_registry
        if name != "builtin_registry":
            assert getattr(kernels, name) is getattr(defined_in, name), name
    assert lamina.Dim3 is kernel_registry.Dim3
    assert lamina.KernelLauncher is kernel_registry.KernelLauncher
    specs = {spec.name: spec for spec in (*bucket_kernels.BUCKET_KERNELS, *fp8_kernels.FP8_KERNELS)}
    registry = builtin_registry()
    assert {name: registry.spec(name) for name in registry.names()} == specs


def test_reregister_replaces() -> None:
    registry = builtin_registry()
    calls: list[str] = []

    def first(config: LaunchConfig, *args: Any) -> str:
        calls.append("first")
        return "first"

    def second(config: LaunchConfig, *args: Any) -> str:
        calls.append("second")
        return "second"

    registry.register("scale_accumulate", "test", first)
    launcher = KernelLauncher(registry, "test")
    assert launcher.launch("scale_accumulate", torch.zeros(1), torch.zeros(1), 1.0) == "first"
    registry.register("scale_accumulate", "test", second)
    assert launcher.launch("scale_accumulate", torch.zeros(1), torch.zeros(1), 1.0) == "second"
    assert registry.backends_for("scale_accumulate") == ["test"]
    assert calls == ["first", "second"]


def test_backend_without_impl_falls_back_to_reference() -> None:
    registry = builtin_registry()
    register_cpu_kernels(registry)
    launcher = KernelLauncher(registry, "tpu-like")
    assert launcher.backend == "tpu-like"
    for name in registry.names():
        assert launcher.implementation_name(name) == REFERENCE
    dst = torch.zeros(3)
    launcher.launch("scale_accumulate", dst, torch.ones(3), 2.0)
    assert torch.equal(dst, torch.full((3,), 2.0))
    cpu = KernelLauncher(registry, "cpu")
    assert cpu.implementation_name("unpack_bucket") == REFERENCE
    assert cpu.implementation_name("pack_bucket") == "cpu"


def test_launcher_reference_ignores_backend_impl() -> None:
    registry = builtin_registry()

    def broken(config: LaunchConfig, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("backend impl must not run")

    registry.register("pack_bucket", "test", broken)
    launcher = KernelLauncher(registry, "test")
    packed = launcher.reference("pack_bucket", [torch.ones(2), torch.zeros(1)])
    assert torch.equal(packed, torch.tensor([1.0, 1.0, 0.0]))
    with pytest.raises(AssertionError, match="must not run"):
        launcher.launch("pack_bucket", [torch.ones(2)])


# --------------------------------------------------------------------------- geometry


def recording_launcher() -> tuple[KernelLauncher, list[LaunchConfig]]:
    registry = builtin_registry()
    seen: list[LaunchConfig] = []

    def record(config: LaunchConfig, *args: Any, **kwargs: Any) -> Any:
        seen.append(config)
        return registry.spec("pack_bucket").reference(config, *args, **kwargs)

    registry.register("pack_bucket", "recorder", record)
    launcher = KernelLauncher(registry, "recorder")
    assert launcher.implementation_name("pack_bucket") == "recorder"
    return launcher, seen


def test_explicit_grid_and_block_are_passed_through() -> None:
    launcher, seen = recording_launcher()
    tensors = [torch.zeros(1000), torch.zeros(30)]
    launcher.launch("pack_bucket", tensors, grid=Dim3(3, 2), block=Dim3(32, 4, 2))
    assert seen[-1] == LaunchConfig(grid=Dim3(3, 2, 1), block=Dim3(32, 4, 2))
    launcher.launch("pack_bucket", tensors, grid=Dim3(7))
    assert seen[-1] == LaunchConfig(grid=Dim3(7), block=Dim3(256))
    launcher.launch("pack_bucket", tensors, block=Dim3(128))
    assert seen[-1] == LaunchConfig(grid=Dim3(5), block=Dim3(128))  # ceil(1030 / 256) = 5 grid
    with pytest.raises(KernelError, match="grid must be a Dim3"):
        launcher.launch("pack_bucket", tensors, grid=(3, 1, 1))  # type: ignore[arg-type]


def test_default_geometry_is_elementwise() -> None:
    launcher, seen = recording_launcher()
    for sizes in ([1000, 30], [0], [256], [257], [1, 1, 1]):
        tensors = [torch.zeros(n) for n in sizes]
        out = torch.zeros(sum(sizes) + 600)
        launcher.launch("pack_bucket", tensors, out=out)
        assert seen[-1] == elementwise_geometry(sum(sizes))
    registry = builtin_registry()
    assert registry.spec("unpack_bucket").geometry(
        torch.zeros(600), [(2, 300)]
    ) == elementwise_geometry(600)
    assert registry.spec("scale_accumulate").geometry(
        torch.zeros(513), torch.zeros(513), 1.0
    ) == elementwise_geometry(513)


def test_elementwise_geometry() -> None:
    assert elementwise_geometry(0) == LaunchConfig(Dim3(1), Dim3(256))
    assert elementwise_geometry(1) == LaunchConfig(Dim3(1), Dim3(256))
    assert elementwise_geometry(256) == LaunchConfig(Dim3(1), Dim3(256))
    assert elementwise_geometry(257) == LaunchConfig(Dim3(2), Dim3(256))
    assert elementwise_geometry(1030, block=128).grid == Dim3(9)
    with pytest.raises(ValueError, match="numel must be an int >= 0"):
        elementwise_geometry(-1)
    with pytest.raises(ValueError, match="block must be an int >= 1"):
        elementwise_geometry(10, block=0)


# --------------------------------------------------------------------------- fp8


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where the other is NaN (NaN payloads may differ)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a[~nan].view(torch.int32), b[~nan].view(torch.int32)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_fp8_kernels_are_bit_exact_to_the_references(dtype: torch.dtype) -> None:
    launcher = cpu_launcher()
    assert launcher.implementation_name("fp8_quantize") == "cpu"
    gen = torch.Generator().manual_seed(0)
    top = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}[dtype]
    for scale in (1e-38, 1e-10, 1e-3, 1.0, 1e3, top):
        x = torch.randn(128 * 64, generator=gen) * torch.logspace(-8, 0, 128 * 64)
        x = (x / x.abs().max() * scale).to(dtype)
        x[3], x[200], x[1000:1128] = float("inf"), float("nan"), 0.0
        payload, exponents = launcher.launch("fp8_quantize", x, 128)
        want = launcher.reference("fp8_quantize", x, 128)
        assert torch.equal(payload, want[0]) and torch.equal(exponents, want[1]), scale
        got = launcher.launch("fp8_dequantize", payload, exponents, 128)
        assert _same_bits(got, launcher.reference("fp8_dequantize", payload, exponents, 128))
    every_code = torch.arange(256, dtype=torch.uint8)
    for e in range(-127, 128, 9):
        exps = torch.tensor([e, -e], dtype=torch.int8)
        codes = every_code.repeat(2)
        got = launcher.launch("fp8_dequantize", codes, exps, 256)
        assert _same_bits(got, launcher.reference("fp8_dequantize", codes, exps, 256)), e
