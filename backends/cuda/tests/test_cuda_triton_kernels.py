"""Triton kernels: against the references on a GPU, and in Triton's CPU interpreter."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_testing import run_triton_snippet, triton_launcher

from lamina.device.kernels import Dim3, KernelLauncher
from lamina.errors import KernelError


@pytest.fixture
def launcher() -> KernelLauncher:
    """The cuda launcher with the Triton kernels (skips with the backend's reason if not)."""
    return triton_launcher("pack_bucket", "scale_accumulate")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("grid", [None, Dim3(1), Dim3(3)])
def test_pack_bucket_matches_reference(
    launcher: KernelLauncher, dtype: torch.dtype, grid: Dim3 | None
) -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(7, 3), (5,), (), (0,), (1000,), (2, 2, 2)]
    tensors = [(torch.randn(s, generator=gen) * 50).to(dtype).cuda() for s in shapes]
    tensors.append(torch.randn(6, 4, generator=gen).to(dtype).cuda().t())  # non-contiguous
    total = sum(t.numel() for t in tensors)
    out = torch.full((total + 9,), 3, dtype=dtype, device="cuda")
    got = launcher.launch("pack_bucket", tensors, out=out, grid=grid, block=Dim3(128))
    want = launcher.reference("pack_bucket", tensors, out=torch.empty_like(out))
    assert got is out
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("grid", [None, Dim3(2)])
def test_scale_accumulate_matches_reference(
    launcher: KernelLauncher, dtype: torch.dtype, grid: Dim3 | None
) -> None:
    gen = torch.Generator().manual_seed(4)
    dst = torch.randn(5003, generator=gen).to(dtype).cuda()
    src = torch.randn(5003, generator=gen).to(dtype).cuda()
    want = launcher.reference("scale_accumulate", dst.clone(), src, -0.375)
    got = launcher.launch("scale_accumulate", dst, src, -0.375, grid=grid, block=Dim3(256))
    assert got is dst
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_block_must_be_a_power_of_two(launcher: KernelLauncher) -> None:
    x = torch.ones(10, device="cuda")
    with pytest.raises(KernelError, match="power of two; use 128"):
        launcher.launch("scale_accumulate", x, x.clone(), 1.0, block=Dim3(100))


_INTERPRETED = textwrap.dedent(
    """
    import torch
    from lamina.device.kernels import Dim3, LaunchConfig
    from lamina.errors import KernelError
    from lamina_cuda import triton_kernels as tk

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in [(7, 3), (5,), (), (0,), (300,)]]
    total = sum(t.numel() for t in tensors)
    out = torch.empty(total)
    for grid, block in [(1, 16), (3, 64), (40, 8)]:
        out.fill_(7.0)
        tk.launch_pack(out, [t.reshape(-1) for t in tensors], grid, block)
        assert torch.equal(out, torch.cat([t.reshape(-1) for t in tensors])), (grid, block)
    # The interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest even):
    # allow one bf16 ulp there.
    for dtype, rtol in [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 2**-7)]:
        dst, src = (torch.randn(1000, generator=gen).to(dtype) for _ in range(2))
        want = torch.add(dst.float(), src.float(), alpha=0.25).to(dtype)
        tk.launch_scale_accumulate(dst, src, 0.25, 3, 64)
        torch.testing.assert_close(dst, want, rtol=rtol, atol=1e-6)
    bad = LaunchConfig(Dim3(1), Dim3(96))
    try:
        tk._geometry(bad, "pack_bucket")
    except KernelError as exc:
        assert "use 128" in str(exc)
    else:
        raise AssertionError("a block of 96 was accepted")
    print("interpreted kernels ok")
    """
)


def test_kernels_in_the_triton_interpreter() -> None:
    run_triton_snippet(_INTERPRETED, "interpreted kernels ok", interpret=True)


_COMPILED = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from lamina_cuda import triton_kernels as tk

    target = GPUTarget("cuda", 90, 32)  # sm_90; ptxas ships inside the triton wheel
    for dt in ("fp32", "fp16", "bf16", "i64"):
        sig = {"out_ptr": "*" + dt, "src_ptrs": "*i64", "starts": "*i64",
               "num_tensors": "i32", "total": "i64", "BLOCK_SIZE": "constexpr"}
        src = ASTSource(fn=tk._pack_kernel, signature=sig, constexprs={"BLOCK_SIZE": 256})
        assert "st.global" in triton.compile(src, target=target).asm["ptx"]
    for dt in ("fp32", "fp16", "bf16"):
        sig = {"dst_ptr": "*" + dt, "src_ptr": "*" + dt, "scale": "fp32", "n": "i32",
               "BLOCK_SIZE": "constexpr"}
        src = ASTSource(fn=tk._scale_accumulate_kernel, signature=sig,
                        constexprs={"BLOCK_SIZE": 256})
        assert "st.global" in triton.compile(src, target=target).asm["ptx"]
    print("compiled for sm_90")
    """
)


def test_kernels_compile_for_a_gpu_without_one() -> None:
    run_triton_snippet(_COMPILED, "compiled for sm_90")
