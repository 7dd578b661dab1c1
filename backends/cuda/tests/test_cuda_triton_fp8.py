"""Triton fp8 kernels: bit-exact to the references on a GPU and in Triton's CPU interpreter."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_testing import run_triton_snippet, triton_launcher

from lamina.device.kernels import Dim3, KernelLauncher

_INF, _NAN = float("inf"), float("nan")
#: Blocks of 8 the rounding and the block exponent can get wrong.
_ADVERSARIAL = [
    [0.0] * 8,
    [-0.0] * 8,
    [0.0, -0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0],
    [_NAN, 1.0, -2.0, 500.0, 0.0, -0.0, 3.0, 1e-3],
    [_INF, -1.0, 2.0, 0.5, 0.0, 1e-5, 600.0, -7.0],
    [-_INF, _INF, _NAN, 1.0, -1.0, 2.0, 3.0, 4.0],
    [448.0, -448.0, 0.453125, 1.0625, 1.1875, 2**-9 * 1.5, 2**-9 * 2.5, 2**-10],
    [448.00003, 1.0, -1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
    [447.99997, 1.75, 2**-7, 0.0, -0.0, 0.0, 0.0, 0.0],
    [1e-45, -1e-45, 0.0, 1e-40, 2e-40, -1e-38, 2**-126, 2**-127],
    [3.4e38, -3.4e38, 1.0, 1e30, 1e-30, 0.0, 0.0, 0.0],
]


@pytest.fixture
def launcher() -> KernelLauncher:
    """The cuda launcher with the Triton kernels (skips with the backend's reason if not)."""
    return triton_launcher("fp8_quantize", "fp8_dequantize")


def _inputs(dtype: torch.dtype, block: int) -> torch.Tensor:
    """Random blocks with amax from 2**-40 to 2**40, then the adversarial ones, on the GPU."""
    gen = torch.Generator().manual_seed(5)
    scales = torch.pow(2.0, torch.randint(-40, 41, (64, 1), generator=gen).float())
    x = (torch.randn(64, block, generator=gen) * scales).reshape(-1)
    adversarial = torch.tensor(_ADVERSARIAL).reshape(-1)
    tail = torch.zeros(-adversarial.numel() % block)
    return torch.cat([x, adversarial, tail]).to(dtype).cuda()


def _same_floats(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bits everywhere but at NaNs, which must be NaN in both."""
    nan = want.isnan()
    bits, want_bits = got.view(torch.int32), want.view(torch.int32)
    return torch.equal(got.isnan(), nan) and torch.equal(bits[~nan], want_bits[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block", "grid"), [(8, None), (32, Dim3(3)), (128, None), (1024, None)])
def test_fp8_quantize_matches_reference(
    launcher: KernelLauncher, dtype: torch.dtype, block: int, grid: Dim3 | None
) -> None:
    x = _inputs(dtype, block)
    payload = torch.full((x.numel(),), 0x55, dtype=torch.uint8, device="cuda")
    got = launcher.launch("fp8_quantize", x, block, payload=payload, grid=grid)
    want = launcher.reference("fp8_quantize", x, block)
    assert got[0] is payload
    assert torch.equal(got[0].cpu(), want[0].cpu())
    assert torch.equal(got[1].cpu(), want[1].cpu())


@pytest.mark.parametrize(("block", "grid"), [(32, None), (256, Dim3(2))])
def test_fp8_dequantize_matches_reference(
    launcher: KernelLauncher, block: int, grid: Dim3 | None
) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(8).cuda()
    exponents = torch.tensor([0, 1, -1, 8, 127, -127, -128, 100] * 8, dtype=torch.int8)
    exponents = exponents[: codes.numel() // block].cuda()
    out = torch.full((codes.numel(),), 7.0, device="cuda")
    got = launcher.launch("fp8_dequantize", codes, exponents, block, out=out, grid=grid)
    assert got is out
    assert _same_floats(
        got.cpu(), launcher.reference("fp8_dequantize", codes, exponents, block).cpu()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_matches_reference(launcher: KernelLauncher, dtype: torch.dtype) -> None:
    x = _inputs(dtype, 64)
    payload, exponents = launcher.launch("fp8_quantize", x, 64)
    got = launcher.launch("fp8_dequantize", payload, exponents, 64)
    want = launcher.reference("fp8_dequantize", *launcher.reference("fp8_quantize", x, 64), 64)
    assert _same_floats(got.cpu(), want.cpu())


def test_fp8_non_power_of_two_block_runs_the_reference(launcher: KernelLauncher) -> None:
    x = _inputs(torch.float32, 24)
    payload, exponents = launcher.launch("fp8_quantize", x, 24)
    want = launcher.reference("fp8_quantize", x, 24)
    assert torch.equal(payload, want[0]) and torch.equal(exponents, want[1])
    out = launcher.launch("fp8_dequantize", payload, exponents, 24)
    assert _same_floats(out.cpu(), launcher.reference("fp8_dequantize", *want, 24).cpu())


_INTERPRETED = textwrap.dedent(
    """
    import torch
    from lamina.device.fp8_kernels import fp8_dequantize_reference, fp8_quantize_reference
    from lamina.device.kernels import Dim3, LaunchConfig
    from lamina.errors import KernelError
    from lamina_cuda import triton_fp8 as tf

    nan, inf = float("nan"), float("inf")
    ADVERSARIAL = ADVERSARIAL_BLOCKS
    gen = torch.Generator().manual_seed(0)

    def quantize(x, block, grid):
        payload = torch.full((x.numel(),), 0x55, dtype=torch.uint8)
        exponents = torch.full((x.numel() // block,), 99, dtype=torch.int8)
        tf.launch_fp8_quantize(x, payload, exponents, block, grid)
        want = fp8_quantize_reference(None, x, block)
        bad = (payload != want[0]).nonzero().flatten()[:5].tolist()
        assert not bad, (x.dtype, block, [(x[i].item(), payload[i].item(), want[0][i].item())
                                          for i in bad])
        assert torch.equal(exponents, want[1]), (x.dtype, block, exponents, want[1])
        return payload, exponents

    def dequantize(payload, exponents, block, grid):
        out = torch.full((payload.numel(),), 7.0)
        tf.launch_fp8_dequantize(payload, exponents, out, block, grid)
        want = fp8_dequantize_reference(None, payload, exponents, block)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), block  # NaNs too

    # every rounding case: 448 heads each block (exponent 0), then a sweep of fp32
    # magnitudes up to 480 with the low bits that decide the rounding (ties, sticky bits)
    top = torch.arange(0, (0x43F00000 >> 19) + 2, dtype=torch.int32) << 19
    low = torch.tensor([0, 1, 0x3FFFF, 0x40000, 0x40001, 0x7FFFF, 0x80000, 0x80001])
    sweep = (top[:, None] + low.int()).flatten().view(torch.float32)
    sweep = torch.cat([sweep, -sweep])
    blocks = sweep[: sweep.numel() // 63 * 63].reshape(-1, 63)
    quantize(torch.cat([torch.full((len(blocks), 1), 448.0), blocks], 1).flatten(), 64, 64)
    quantize(torch.tensor(ADVERSARIAL).flatten(), 8, 3)
    # every exponent: blocks with amax from 2**-149 to 2**127
    scales = torch.pow(2.0, torch.arange(-149, 128, dtype=torch.float64)).float()
    mant = torch.randn(len(scales), 16, generator=gen)
    x32 = (mant / mant.abs().amax(dim=1, keepdim=True) * scales[:, None]).flatten()
    payload, exponents = quantize(x32, 16, 40)
    dequantize(payload, exponents, 16, 40)
    # every fp16 / bf16 bit pattern: finite ones by magnitude, both signs, then the rest
    for dtype, finite in ((torch.float16, 0x7C00), (torch.bfloat16, 0x7F80)):
        bits = torch.arange(finite, dtype=torch.int32)
        bits = torch.stack([bits, bits | 0x8000], 1).flatten()
        rest = torch.arange(finite, 0x8000, dtype=torch.int32)
        rest = torch.cat([rest, rest | 0x8000, bits[: 2 * (0x8000 - finite)]])
        bits = torch.cat([bits, rest[torch.randperm(len(rest), generator=gen)]])
        quantize(bits.to(torch.int16).view(dtype), 128, 16)
    # every code against ordinary and extreme exponents (-128 scales by inf)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(8)
    dequantize(codes, torch.tensor([0, 1, -1, 8, 127, -127, -128, 100] * 8).to(torch.int8), 32, 7)

    # the registered wrappers: CPU tensors and a block of 24 run the reference
    config = LaunchConfig(Dim3(4), Dim3(24))
    payload, exponents = tf.fp8_quantize_triton(config, x32[:96], 24)
    want = fp8_quantize_reference(config, x32[:96], 24)
    assert torch.equal(payload, want[0]) and torch.equal(exponents, want[1])
    out = tf.fp8_dequantize_triton(config, payload, exponents, 24)
    assert torch.equal(out, fp8_dequantize_reference(config, payload, exponents, 24))
    for call, match in (
        (lambda: tf.fp8_quantize_triton(config, torch.ones(10), 4), "not whole blocks of 4"),
        (lambda: tf.fp8_quantize_triton(LaunchConfig(Dim3(1, 2), Dim3(8)), x32, 8), "1-D"),
    ):
        try:
            call()
        except KernelError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(match)
    print("interpreted fp8 kernels ok")
    """
).replace("ADVERSARIAL_BLOCKS", repr(_ADVERSARIAL))


def test_fp8_kernels_in_the_triton_interpreter() -> None:
    run_triton_snippet(_INTERPRETED, "interpreted fp8 kernels ok", interpret=True)


_COMPILED = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from lamina_cuda import triton_fp8 as tf

    # sm_90 and sm_80 (no fp8 type there); ptxas ships inside the triton wheel.
    # No .ftz anywhere: fp32 subnormals must survive the scaling, as in torch.
    for cap in (90, 80):
        target = GPUTarget("cuda", cap, 32)
        for dt in ("fp32", "fp16", "bf16"):
            sig = {"x_ptr": "*" + dt, "payload_ptr": "*u8", "exponents_ptr": "*i8",
                   "nblocks": "i64", "BLOCK": "constexpr"}
            src = ASTSource(fn=tf._fp8_quantize_kernel, signature=sig, constexprs={"BLOCK": 128})
            ptx = triton.compile(src, target=target).asm["ptx"]
            assert "st.global" in ptx and "ftz" not in ptx, (cap, dt)
        sig = {"payload_ptr": "*u8", "exponents_ptr": "*i8", "out_ptr": "*fp32",
               "nblocks": "i64", "BLOCK": "constexpr"}
        src = ASTSource(fn=tf._fp8_dequantize_kernel, signature=sig, constexprs={"BLOCK": 128})
        ptx = triton.compile(src, target=target).asm["ptx"]
        assert "st.global" in ptx and "ftz" not in ptx, cap
    print("compiled for sm_90 and sm_80")
    """
)


def test_fp8_kernels_compile_for_a_gpu_without_one() -> None:
    run_triton_snippet(_COMPILED, "compiled for sm_90 and sm_80")
