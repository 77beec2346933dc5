"""Prototype (branch s34-wgmma, NOTES session 33/34), not a shipped kernel: MXFP4 weights decoded in registers to
e4m3 and fed to Hopper's ``wgmma m64nTk32`` e4m3 with A from registers, on a dense problem y[T, N] = x[T, K] . W[N, K]^T
(T = 8 or 16 tokens), to learn whether this decode path reaches the HBM roofline where the shipped grouped expert
kernel (``moe_experts_tc``, bf16 ``mma.sync`` with an integer decode, issue-bound per s22/s26/s27) does not.

- An E2M1 nibble ``s e1 e0 m`` placed as the e4m3 byte ``s 0 0 e1 e0 m 0 0`` reads as its value x 2^-6 (exact,
  subnormals included); the 2^6 is applied once at the end.
- Layout (``pack``): the weights of a 64-row tile and a 64-K step are one 2560-byte blob (TMA, one box of 10 x 64
  words): thread ``tid``'s 4 code words at words 4 tid .. 4 tid + 3, its scale word at 512 + tid. Thread ``tid`` =
  32 w + 4 g + t holds wgmma A rows 16 w + g and 16 w + g + 8, K 4 t .. 4 t + 3 and 4 t + 16 .. 4 t + 19 of each
  32-K block (the m64k32 8-bit A fragment, checked on the CPU from the tiled MMA's TV layout). Code word 2 b + h
  (block b of the step, K half h): row g's 4 codes at bits 7, 4-2 of each byte (``word & 0x9C9C9C9C`` is one A
  register), row g + 8's at bits 5, 6, 1, 0 (a shift pair and a LOP3 make the other). Scale word: e8m0 bytes
  (row g, block 0), (row g + 8, block 0), (row g, block 1), (row g + 8, block 1).
- Per K block one wgmma into a fresh temporary accumulator (its own A registers: they must not change while the
  wgmma is in flight), then ``acc += 2^(e - 127) x tmp`` (the exponent byte shifted into an fp32's exponent field).
  2R steps an iteration in two sets: set 1's wgmmas run while set 0's temporaries are scaled in.
- x: e4m3 [T, K], all of it TMA'd into shared memory at the start (B operand, K-major).

Usage:
  python bench/wgmma_e4m3_proto.py sass [--tm 8] [--stages 8] [--rot 2]   (CPU: compile for sm_90a, SASS loop counts)
  python bench/wgmma_e4m3_proto.py bench --out $OUT/wgmma.json             (device: check, then time beside the
                                                                          shipped MXFP4 w13 kernel on the same bytes)
"""



import argparse
import json
import os
import statistics
import sys

from k3tune.kernels.moe_experts_wg import BLOB, HI_SHL, HI_SHR, LO_MASK  # the layout, shared with the grouped kernel


def pack(codes, scales):
    """K3's MXFP4 (codes uint8 [N, K/2], scales uint8 [N, K/32]) -> the blobs, int32 [N/64 x K/64 x 10, 64] (the
    layout ``k3tune.kernels.moe_experts_wg`` took from this prototype)."""
    from k3tune.kernels.moe_experts_wg import pack_blobs

    return pack_blobs(codes, scales)


def kernel_class():
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Float8E4M3FN, Int32, Uint32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    class WgE4m3:
        def __init__(self, tm: int, k: int, stages: int, rot: int):
            assert k % 128 == 0 and (k // 64) % (2 * rot) == 0 and stages >= 2, (k, rot, stages)
            self.tm, self.k, self.stages, self.rot = tm, k, stages, rot
            self.ksteps, self.xst = k // 64, k // 128

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                Float8E4M3FN, Float8E4M3FN, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
                (1, 1, 1), tiler_mn=(64, self.tm), a_source=warpgroup.OperandSource.RMEM)
            x_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, self.tm, 128), Float8E4M3FN,
                                                     self.xst)
            tma_x, tX = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX,
                                                    cute.slice_(x_staged, (None, None, 0)), (self.tm, 128))
            w_one = cute.make_layout((10 * self.rot, 64), stride=(64, 1))
            tma_w, tW = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW, w_one, (10 * self.rot, 64))

            @cute.struct
            class Storage:
                xbars: cute.struct.MemRange[cutlass.Int64, self.xst * 2]
                wbars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sX: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(x_staged)], 1024]
                sW: cute.struct.Align[cute.struct.MemRange[Int32, BLOB * self.rot * self.stages], 128]

            self.storage = Storage
            self.kernel(tma_x, tX, tma_w, tW, mY, tiled_mma, x_staged).launch(
                grid=(mY.shape[1] // 64, 1, 1), block=[128, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, tma_x: cute.CopyAtom, mX: cute.Tensor, tma_w: cute.CopyAtom, mW: cute.Tensor,
                   mY: cute.Tensor, tiled_mma: cute.TiledMma, x_staged: cute.ComposedLayout):
            S, R, KS, XS = self.stages, self.rot, self.ksteps, self.xst
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp == 0:
                cpasync.prefetch_descriptor(tma_x)
                cpasync.prefetch_descriptor(tma_w)
            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(self.storage)
            one = cute.make_layout((1, 1, 1, 1))
            x_bytes = cute.size_in_bytes(Float8E4M3FN, cute.slice_(x_staged, (None, None, 0)))
            xpipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.xbars.data_ptr(), num_stages=XS,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
                tx_count=x_bytes, cta_layout_vmnk=one)
            wpipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.wbars.data_ptr(), num_stages=S,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
                tx_count=BLOB * 4 * R, cta_layout_vmnk=one)
            sX = st.sX.get_tensor(x_staged.outer, swizzle=x_staged.inner)
            gX = cute.local_tile(mX, (self.tm, 128), (0, None))
            tXs, tXg = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                             cute.group_modes(gX, 0, 2))
            sWt = st.sW.get_tensor(cute.make_layout((10 * R, 64, S), stride=(64, 1, BLOB * R)))
            sQ = st.sW.get_tensor(cute.make_layout((4, R * BLOB // 4, S), stride=(1, 4, BLOB * R)))
            gW = cute.local_tile(mW, (10 * R, 64), (None, 0))
            tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sWt, 0, 2),
                                             cute.group_modes(gW, 0, 2))
            first = bidx * (KS // R)

            if warp == 0:
                for j in cutlass.range_constexpr(XS):  # all of x, one stage a 128-K slice
                    ps = pipeline.PipelineState(XS, j, j, 1)
                    xpipe.producer_acquire(ps)
                    cute.copy(tma_x, tXg[(None, j)], tXs[(None, j)], tma_bar_ptr=xpipe.producer_get_barrier(ps))
                for j in cutlass.range_constexpr(min(S - 1, self.ksteps // R)):  # the ring's first S - 1 stages
                    ps = pipeline.PipelineState(S, j, j, 1)
                    wpipe.producer_acquire(ps)
                    cute.copy(tma_w, tWg[(None, first + j)], tWs[(None, j)], tma_bar_ptr=wpipe.producer_get_barrier(ps))

            thr_mma = tiled_mma.get_slice(tidx)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))  # (mma, n, k blocks of 32, x stage)
            tCcA = thr_mma.partition_A(cute.make_identity_tensor((64, 32)))
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((64, self.tm)))
            nacc = cute.size(tCcC.shape)
            acc = cute.make_rmem_tensor(tCcC.shape, Float32)
            acc.fill(0.0)
            # per set, step r and block b: the A registers and the temporary accumulator of one wgmma
            a_regs = [[[cute.make_rmem_tensor(tCcA.shape, Float8E4M3FN) for b in range(2)] for r in range(R)]
                      for _ in range(2)]
            tmps = [[[cute.make_rmem_tensor(tCcC.shape, Float32) for b in range(2)] for r in range(R)]
                    for _ in range(2)]
            scw = cute.make_rmem_tensor((2, R), Uint32)
            bits = cute.make_rmem_tensor((2,), Uint32)
            fbits = cute.recast_tensor(bits, Float32)
            cw = cute.make_rmem_tensor(cute.make_layout((4, R)), Int32)  # a stage's code words
            cwu = cute.recast_tensor(cw, Uint32)

            for it in cutlass.range(0, KS // R, 2, unroll=1):  # two ring stages (sets) an iteration
                for half in cutlass.range_constexpr(2):
                    stg = it + half  # ring stage number: steps R stg .. R stg + R - 1
                    if warp == 0:  # refill the slot stage stg - 1 freed with stage stg + S - 1
                        nxt = stg + S - 1
                        if nxt < KS // R:
                            ps = pipeline.PipelineState(S, nxt, nxt % S, (nxt // S + 1) % 2)
                            wpipe.producer_acquire(ps)
                            cute.copy(tma_w, tWg[(None, first + nxt)], tWs[(None, nxt % S)],
                                      tma_bar_ptr=wpipe.producer_get_barrier(ps))
                    cs = pipeline.PipelineState(S, stg, stg % S, (stg // S) % 2)
                    wpipe.consumer_wait(cs)
                    for r in cutlass.range_constexpr(R):
                        step = stg * R + r
                        if cutlass.const_expr((half * R + r) % 2 == 0):  # 2 R it is even: step's parity is static
                            xs = step // 2
                            xpipe.consumer_wait(pipeline.PipelineState(XS, xs, xs, 0))
                        cute.autovec_copy(sQ[None, r * (BLOB // 4) + tidx, stg % S], cw[None, r])
                        scw[half, r] = Uint32(sQ[tidx % 4, r * (BLOB // 4) + 128 + tidx // 4, stg % S])
                    wpipe.consumer_release(cs)
                    for r in cutlass.range_constexpr(R):
                        for b in cutlass.range_constexpr(2):
                            aw = cute.recast_tensor(a_regs[half][r][b], Uint32)
                            for h in cutlass.range_constexpr(2):
                                w = cwu[2 * b + h, r]
                                aw[2 * h] = w & Uint32(LO_MASK)
                                aw[2 * h + 1] = ((w << Uint32(2)) & Uint32(HI_SHL)) | ((w >> Uint32(2)) & Uint32(HI_SHR))
                    warpgroup.fence()
                    for r in cutlass.range_constexpr(R):
                        step = stg * R + r
                        for b in cutlass.range_constexpr(2):
                            kb = ((half * R + r) % 2) * 2 + b  # the 32-K block within the 128-K x stage
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                            cute.gemm(tiled_mma, tmps[half][r][b], a_regs[half][r][b][None, None, 0],
                                      tCrB[None, None, kb, step // 2], tmps[half][r][b])
                    warpgroup.commit_group()
                for half in cutlass.range_constexpr(2):
                    warpgroup.wait_group(1 - half)  # set 0 done while set 1 runs; then set 1
                    for r in cutlass.range_constexpr(R):
                        sc = scw[half, r]
                        for b in cutlass.range_constexpr(2):
                            for row in cutlass.range_constexpr(2):
                                j = 2 * b + row  # e8m0 byte j as an fp32 exponent field: 2^(e - 127)
                                if cutlass.const_expr(j == 3):
                                    bits[row] = (sc >> Uint32(1)) & Uint32(0x7F800000)
                                else:
                                    bits[row] = (sc << Uint32(23 - 8 * j)) & Uint32(0x7F800000)
                            t = tmps[half][r][b]
                            for i in cutlass.range_constexpr(nacc):
                                acc[i] = acc[i] + fbits[(i // 2) % 2] * t[i]

            for i in cutlass.range_constexpr(nacc):
                rc = tCcC[i]
                mY[rc[1], bidx * 64 + rc[0]] = acc[i] * 64.0  # the decode's 2^-6

    return WgE4m3


def compile_fake(tm: int, k: int, stages: int, rot: int, arch: str = "sm_90a"):
    import cutlass.cute as cute
    from cutlass import Float8E4M3FN, Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch
    n = cute.sym_int(divisibility=64)
    w = make_fake_compact_tensor(Int32, (cute.sym_int(divisibility=10), 64), stride_order=(1, 0), assumed_align=16)
    x = make_fake_compact_tensor(Float8E4M3FN, (tm, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(Float32, (tm, n), stride_order=(1, 0), assumed_align=16)
    return cute.compile(kernel_class()(tm, k, stages, rot), w, x, y, make_fake_stream(), options=f"--gpu-arch {arch}")


def sass(args) -> None:
    from k3tune.kernels.compile_cache import _runtime_for_cpu

    _runtime_for_cpu()
    fn = compile_fake(args.tm, args.k, args.stages, args.rot)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import expert_sass

    cubins = expert_sass.device_cubins(fn, "wge4m3")
    out = os.path.join(os.environ.get("OUTDIR", "/tmp"), f"wge4m3_tm{args.tm}_s{args.stages}_r{args.rot}")
    open(out + ".cubin", "wb").write(cubins[0])
    open(out + ".sass", "w").write(expert_sass.disassemble(out + ".cubin"))
    print(out + ".sass", expert_sass.resources(out + ".cubin"))


class Dense:
    """The prototype compiled for the GPU, launched on given tensors."""

    def __init__(self, tm, k, stages, rot):
        self.fn = compile_fake(tm, k, stages, rot)

    def __call__(self, blob, x8, y):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass import Float8E4M3FN
        from cutlass.cute.runtime import from_dlpack

        w = from_dlpack(blob, assumed_align=16).mark_compact_shape_dynamic(mode=0, divisibility=10)
        x = from_dlpack(x8.view(torch.uint8), assumed_align=16)
        x.element_type = Float8E4M3FN
        out = from_dlpack(y, assumed_align=16).mark_compact_shape_dynamic(mode=1, divisibility=64)
        self.fn(w, x, out, cuda.CUstream(torch.cuda.current_stream().cuda_stream))


def bench(args) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemm import copy_bandwidth

    from k3tune.kernels import moe_experts, moe_experts_tc, mxfp4
    from k3tune.kernels.moe_experts import Groups
    from k3tune.kernels.moe_experts_tc import TcExpertConfig
    from k3tune.search.measure_gpu import time_graph

    torch.manual_seed(0)
    bw = copy_bandwidth()
    K, inter = args.k, args.rows // 2  # w13 at TP8 by default: K3's latent, 2 x 384 rows an expert
    rows, built = [], {}
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    for tm, experts in [(int(a), int(b)) for a, b in (p.split(":") for p in args.points.split(","))]:
        n = experts * 2 * inter
        sets = []
        for _ in range(2):  # > 60 MiB of L2 each at these sizes: two sets rotate past it
            w = (torch.randn(n, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
            codes, scales = mxfp4.quantize(w)
            del w
            sets.append((codes, scales))
        nbytes = mxfp4.nbytes(n, K)
        floor = nbytes / bw * 1e6
        x = torch.randn(tm, K, device="cuda")
        xs = x.abs().amax(-1, keepdim=True) / 448.0
        x8 = (x / xs).to(torch.float8_e4m3fn)
        ref = x8.float() @ mxfp4.dequantize(*sets[0], dtype=torch.float32).T  # [T, N]
        row = dict(tm=tm, experts=experts, n=n, k=K, mbytes=nbytes / 1e6, floor_us=floor)
        blobs = [pack(c, s) for c, s in sets]
        for stages, rot in [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",") if c]:
            name = f"wg_s{stages}_r{rot}"
            try:
                k = built.get((tm, stages, rot)) or built.setdefault((tm, stages, rot), Dense(tm, K, stages, rot))
            except Exception as e:  # a config that does not compile is recorded, not fatal
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            y = torch.full((tm, n), float("nan"), device="cuda")
            k(blobs[0], x8, y)
            torch.cuda.synchronize()
            err = ((y - ref).norm() / ref.norm()).item()
            ok = err < 2e-3  # fp8 wgmma adds in reduced precision within a 32-K block
            entry = dict(rel_err=err, ok=ok)
            if ok:
                ts = time_graph(lambda s: k(s[0], x8, y), [(b,) for b in blobs], args.samples)
                med = statistics.median(ts)
                q = statistics.quantiles(ts, n=4)
                entry.update(us=med, iqr=q[2] - q[0], roof=floor / med)
            row[name] = entry
            print(f"T={tm} experts={experts} {name}: err {err:.2e}" +
                  (f" {entry['us']:.1f} us, roof {entry['roof']:.3f}" if ok else " WRONG"), flush=True)
        # the shipped kernel on the same bytes: T tokens per group of 16 experts, each expert exactly T tokens
        tokens = experts // 16 * tm
        grp_experts = experts
        y_route = torch.full((tokens, grp_experts + K), -30.0, device="cuda")
        tok = torch.arange(tokens, device="cuda")
        for i in range(16):
            y_route[tok, (tok // tm) * 16 + i] = 30.0
        y_route = y_route.to(torch.bfloat16)
        bias = torch.zeros(grp_experts, device="cuda")
        xt = torch.randn(tokens, K, device="cuda").to(torch.bfloat16)
        y_route[:, grp_experts:] = xt
        for cfg_s in [c for c in args.tc.split(";") if c]:
            cfg = TcExpertConfig(**json.loads(cfg_s))
            grp = Groups.allocate(grp_experts, tokens, 16, cfg.tokens, "cuda")
            top = torch.full((tokens, 16), -1, dtype=torch.int32, device="cuda")
            wts = torch.full((tokens, 16), float("nan"), device="cuda")
            moe_experts.route(y_route, bias, top, wts, 16, 1.0, grp)
            torch.cuda.synchronize()
            counts = grp.counts[:grp_experts]
            assert int(counts.min()) == int(counts.max()) == tm, "every expert gets exactly T tokens"
            ops = [(moe_experts_tc.pack_codes(c.reshape(experts, 2 * inter, K // 2)) if cfg.dq else
                    c.reshape(experts, 2 * inter, K // 2), s.reshape(experts, 2 * inter, K // 32)) for c, s in sets]
            act = torch.full((tokens * 16, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
            ts = time_graph(lambda s: moe_experts_tc.run_w13(cfg, xt, s[0], act, wts, grp, 4.0, 25.0, scales=s[1]),
                            ops, args.samples)
            assert not torch.isnan(act.float()).any(), "the shipped kernel wrote every slot"
            med = statistics.median(ts)
            q = statistics.quantiles(ts, n=4)
            name = "tc_" + "_".join(f"{k}{v}" for k, v in json.loads(cfg_s).items())
            row[name] = dict(us=med, iqr=q[2] - q[0], roof=floor / med)
            print(f"T={tm} experts={experts} {name}: {med:.1f} us, roof {floor / med:.3f}", flush=True)
            del ops
        rows.append(row)
        del sets, blobs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, rows=rows), f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sass")
    s.add_argument("--tm", type=int, default=8)
    s.add_argument("--k", type=int, default=3584)
    s.add_argument("--stages", type=int, default=8)
    s.add_argument("--rot", type=int, default=2)
    b = sub.add_parser("bench")
    b.add_argument("--points", default="8:16,8:128,16:128", help="T:experts (w13 at TP8: 768 rows an expert)")
    b.add_argument("--configs", default="8/2,6/4,8/4,4/4,12/1", help="ring stages/64-K steps a stage")
    b.add_argument("--tc", default='{"m_tiles":1,"warps_n":2,"warps_k":2,"unroll":2,"dq":1,"ring":2};'
                           '{"m_tiles":1,"warps_n":2,"warps_k":2,"unroll":2,"dq":1}',
                   help="shipped TcExpertConfig kwargs, ';'-separated (default: the DB's TP8 b8 w13 winner)")
    b.add_argument("--k", type=int, default=3584, help="K (w2 at TP8: 384)")
    b.add_argument("--rows", type=int, default=768, help="rows an expert (w2: 3584; the shipped comparator is w13 only)")
    b.add_argument("--samples", type=int, default=15)
    b.add_argument("--out", default="")
    args = ap.parse_args()
    sass(args) if args.cmd == "sass" else bench(args)


if __name__ == "__main__":
    main()
