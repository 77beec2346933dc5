"""Where a launch's fixed part goes: per-CTA clock stamps of gemm.splitk_cluster inside a CUDA graph of launches.

    python bench/timeline.py --n 1536 --k 7168 --configs '[[8, {"warps_n": 1, "warps_k": 4, "tile_m": 8,
        "split_k": 8, "bk": 128, "stages": 4, "pdl": 1}]]'

bench/kline.py splits a launch's time into a fixed part and a streaming rate; this splits the fixed part. The
kernel is splitk_cluster's: its main loop inherited, its ``kernel`` (launch prologue and cluster sum) copied here
with thread 0 of every CTA reading ``%globaltimer`` at entry, when its K loop is done, and at exit (rank 0 after its
store), and its SM. (A hook in gemm_splitk_cluster would change its source and so make its shipped winners stale.)
A CUDA graph of launches cycling through the sweep's weight copies past L2 (``measure_gpu.rotation_sets``), each
launch writing its own stamp buffer, is replayed after a numerics check against the family's reference (poisoned
output); for the launches after the first few it prints, relative to the end of the launch before (the last CTA
exit): when this launch's first and median CTA started (negative: started early under PDL), the spread of the K
loops' ends, the cluster sums after them, and the launch's own span. A diagnostic, not a measurement of record: the
stamps cost a few instructions a CTA, and ``%globaltimer`` moved in steps of ~0.26 us on the H100 (s54-r8).
"""

import argparse
import functools
import json
import statistics

import torch

from k3tune.errors import CannotImplement
from k3tune.kernels import family, gemm_splitk_cluster
from k3tune.plan.problems import Problem
from k3tune.search.measure_gpu import rotation_sets
from k3tune.search.outcome import relative_error

STAMPS = 4  # entry, K loop done, exit, SM id


@functools.cache
def _timed_class():
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32, Int64

    class Timed(gemm_splitk_cluster._kernel_class()):
        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mT: cute.Tensor,
                     stream: cuda.CUstream):
            m = mX.shape[0]
            n = mW.shape[0]
            grid = ((n + self.rows - 1) // self.rows, (m + self.tm - 1) // self.tm, self.split)
            self.kernel(mX, mW, mY, mT).launch(grid=grid, block=(self.threads, 1, 1), cluster=[1, 1, self.split],
                                               stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mT: cute.Tensor):
            MT, NT, WN, S = self.mt, self.nt, self.wn, self.split
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, bidz = cute.arch.block_idx()
            cta = (bidz * cute.arch.grid_dim()[1] + bidy) * cute.arch.grid_dim()[0] + bidx
            if tidx == 0:
                mT[cta, 0] = cute.arch.globaltimer()
            rank = cute.arch.block_idx_in_cluster()
            m = mX.shape[0]
            n = mW.shape[0]
            warp = tidx // 32
            lane = tidx % 32
            g = lane // 4
            c = lane % 4
            wrow = warp % WN
            wkk = warp // WN
            row0 = bidx * self.rows
            tok0 = bidy * self.tm
            ktiles = mW.shape[1] // (self.bk * S)
            kt0 = bidz * ktiles
            nacc = 4 * MT * NT

            smem = cutlass.memory.SmemAllocator()
            sW, sX = self._ring(smem)
            recv = smem.allocate_tensor(Float32, cute.make_layout((S - 1) * 32 * WN * nacc), 16)
            bar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)
            if rank == 0 and tidx == 0:
                cute.arch.mbarrier_init(bar.iterator, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(bar.iterator, (S - 1) * 32 * WN * nacc * 4)
            cute.arch.cluster_arrive_relaxed()
            acc = self._mainloop(mX, mW, sW, sX, smem, tidx, row0, tok0, kt0, ktiles, m, n)
            if tidx == 0:
                mT[cta, 1] = cute.arch.globaltimer()
            cute.arch.cluster_wait()
            slot = (wrow * 32 + lane) * nacc
            if wkk == 0 and rank > 0:
                flat = cute.make_rmem_tensor(cute.make_layout(nacc), Float32)
                for e in cutlass.range_constexpr(nacc):
                    flat[e] = acc[e]
                bits = cute.recast_tensor(flat, Int32)
                base = (rank - 1) * 32 * WN * nacc + slot
                for q in cutlass.range_constexpr(nacc // 4):
                    cute.arch.store_async_dsmem((recv.iterator + (base + 4 * q)).align(16),
                                                (bits[4 * q], bits[4 * q + 1], bits[4 * q + 2], bits[4 * q + 3]),
                                                bar.iterator, 0)
            if rank == 0:
                cute.arch.mbarrier_wait(bar.iterator, 0)
                if wkk == 0:
                    for z in cutlass.range_constexpr(S - 1):
                        for e in cutlass.range_constexpr(nacc):
                            acc[e] = acc[e] + recv[z * 32 * WN * nacc + slot + e]
                    self._store(acc, mY, row0 + wrow * 16 * MT, tok0, g, c, m, n)
                cute.arch.sync_threads()
            if tidx == 0:
                mT[cta, 2] = cute.arch.globaltimer()
                mT[cta, 3] = Int64(cute.arch.smid())

    return Timed


@functools.cache
def _compiled(cfg_key: tuple):
    import cutlass.cute as cute
    from cutlass import BFloat16, Int64
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from k3tune.kernels.gemm_smallm import current_arch

    mt, wn, wk, tm, split, bk, stages, pdl = cfg_key
    arch = current_arch()
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    t = make_fake_compact_tensor(Int64, (cute.sym_int(), STAMPS), stride_order=(1, 0), assumed_align=8)
    kernel = _timed_class()(mt, wn, wk, tm, split, bk, stages, 0, pdl)
    return cute.compile(kernel, x, w, y, t, make_fake_stream(), options=f"--gpu-arch {arch}")


def timeline(m: int, n: int, k: int, params: dict, launches: int) -> dict:
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import from_dlpack

    fam = family("gemm.splitk_cluster")
    p = Problem("timeline", "gemm", (("M", m), ("N", n), ("K", k)))
    cfg = fam.config_from_params(p, {**fam.default_config(p).params(), **params})
    fn = _compiled((cfg.m_tiles, cfg.warps_n, cfg.warps_k, cfg.tile_m, cfg.split_k, cfg.bk, cfg.stages, cfg.pdl))
    ctas = -(-n // (16 * cfg.m_tiles * cfg.warps_n)) * -(-m // cfg.tile_m) * cfg.split_k
    inputs = fam.make_inputs(p, torch.device("cuda"), torch.Generator(device="cuda").manual_seed(5))
    inputs["out"].fill_(float("nan"))
    sets = rotation_sets(fam, p, inputs)  # weight copies past L2, as the sweep times
    stamps = [torch.zeros(ctas, STAMPS, dtype=torch.int64, device="cuda") for _ in range(launches)]

    def dyn(t):
        return from_dlpack(t, assumed_align=16).mark_compact_shape_dynamic(mode=0).mark_compact_shape_dynamic(
            mode=1, divisibility=cfg.bk)

    args = []
    for i in range(launches):
        s = sets[i % len(sets)]
        args.append((dyn(s["x"]), dyn(s["w"]), from_dlpack(s["out"], assumed_align=16).mark_layout_dynamic(),
                     from_dlpack(stamps[i], assumed_align=8).mark_layout_dynamic()))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn(*args[0], cuda.CUstream(stream.cuda_stream))  # warm-up, and the numerics check
    stream.synchronize()
    err = relative_error(inputs["out"], fam.reference(p, inputs))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for a in args:
            fn(*a, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t = torch.stack(stamps).cpu()  # [launch, cta, stamp]
    rows_out = []
    for i in range(launches // 4, launches):  # steady state
        prev_end = int(t[i - 1, :, 2].max())
        start, done, end = (t[i, :, j].double() - prev_end for j in range(3))
        rows_out.append({"first_start": float(start.min()), "median_start": float(start.median()),
                         "last_start": float(start.max()), "first_done": float(done.min()),
                         "median_done": float(done.median()), "last_done": float(done.max()),
                         "last_exit": float(end.max()), "sum_after_done": float((end - done).median())})
    summary = {key: statistics.median(r[key] for r in rows_out) / 1e3 for key in rows_out[0]}
    return {"M": m, "N": n, "K": k, "params": cfg.params(), "ctas": ctas, "err": err,
            "ok": err < fam.tolerance(p), "weight_copies": len(sets), "us": summary,
            "sms_used": int(t[-1, :, 3].unique().numel())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help="JSON list of [M, knob dict]")
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        configs = [(int(m), dict(params)) for m, params in json.loads(args.configs)]
    except (ValueError, TypeError) as e:
        ap.error(f"--configs takes a JSON list of [M, knob dict] pairs ({e})")
    out = []
    print(f"# {torch.cuda.get_device_name()}, N {args.n}, K {args.k}; µs relative to the previous launch's last exit")
    for m, params in configs:
        try:
            r = timeline(m, args.n, args.k, params, args.launches)
        except CannotImplement as e:
            print(f"M={m:<3} {json.dumps(params)} skip: {e}", flush=True)
            continue
        if not r["ok"]:  # the reference disagrees: its stamps say nothing
            print(f"M={m:<3} {json.dumps(params)} WRONG err {r['err']:.3g}", flush=True)
            continue
        out.append(r)
        u = r["us"]
        print(f"M={m:<3} {json.dumps(params)} ctas {r['ctas']} on {r['sms_used']} SMs, err {r['err']:.2g}: "
              f"start first {u['first_start']:.2f} median {u['median_start']:.2f} last {u['last_start']:.2f} | "
              f"K loop done first {u['first_done']:.2f} median {u['median_done']:.2f} last {u['last_done']:.2f} | "
              f"sum+store {u['sum_after_done']:.2f} | launch ends {u['last_exit']:.2f}", flush=True)
    if args.out:
        from gemm import write_json

        write_json(args.out, out)


if __name__ == "__main__":
    main()
