"""L2 weight prefetch in CuTe DSL: pull the first ``nbytes`` of a weight tensor into L2 with
``cp.async.bulk.prefetch.L2`` (sm_90+), one elected thread per CTA, ``CHUNK`` bytes per CTA.

Launched on a side stream while a phase leaves HBM idle (routing and top-k, or a collective), so that the
next op finds part of its weights in L2. Best-effort by design: nothing waits on it and nothing it does
changes a result. ``nbytes`` is a runtime value (one compile serves every size); 0 launches nothing.

Status: compiled on the CPU (tests/test_kernel_compile.py); its effect is measured by bench/moe.py.
"""

import functools
import os

CHUNK = 64 << 10  # bytes per CTA (one bulk prefetch instruction)


@functools.cache
def compiled(arch: str):
    import cutlass.cute as cute
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch
    w = make_fake_compact_tensor(BFloat16, (cute.sym_int(divisibility=8),), assumed_align=16)
    return cute.compile(_kernel_class()(), w, 0, make_fake_stream(), options=f"--gpu-arch {arch}")


def prefetch(weight, nbytes: int, stream=None) -> None:
    """Prefetch min(nbytes, weight's bytes) (rounded down to 16) from the start of ``weight`` into L2."""
    import torch
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import from_dlpack

    from k3tune.kernels.gemm_smallm import current_arch

    n = min(int(nbytes), weight.numel() * weight.element_size()) // 16 * 16
    if n <= 0:
        return
    flat = weight.reshape(-1).view(torch.bfloat16)
    compiled(current_arch())(from_dlpack(flat, assumed_align=16).mark_layout_dynamic(), n,
                             cuda.CUstream((stream or torch.cuda.current_stream()).cuda_stream))


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import Int32
    from cutlass.experimental.primitives import cp_async_bulk_prefetch

    class L2Prefetch:
        @cute.jit
        def __call__(self, mW: cute.Tensor, nbytes: Int32, stream: cuda.CUstream):
            self.kernel(mW, nbytes).launch(grid=((nbytes + CHUNK - 1) // CHUNK, 1, 1), block=(32, 1, 1),
                                           stream=stream)

        @cute.kernel
        def kernel(self, mW: cute.Tensor, nbytes: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            start = bidx * CHUNK
            size = cutlass.min(nbytes - start, CHUNK)
            if tidx == 0:
                cp_async_bulk_prefetch(mW.iterator + start // 2, size)  # bf16 elements: 2 bytes each

    return L2Prefetch
