"""The routed-expert part of K3's decode MoE block as CuTe DSL kernels (bf16 weights, fp32 math), so that
the tuned block's critical path is a handful of launches instead of dozens of torch ops:

``route``: one warp per token: sigmoid of the router scores, top-k of score + correction bias (k rounds of
a warp argmax, ties to the lower expert id), weights = the chosen sigmoid scores renormalised x scaling.
The same launch groups the slots by expert (``Groups``): lane j of token b appends slot b x k + j to its
expert's slot list (an atomic per expert) and, every ``per`` slots of an expert, one work item
(expert, first slot) to the item list. No sort, no host sync, static shapes: the block captures in a graph.
``w13`` (+ SiTU): CTA (i, j) takes work items i, i + grid, ...: item (e, t0) is up to ``per`` tokens of
expert e; the j-th tile of ``rows`` intermediate rows of e is read once for all of them;
act[slot, r] = situ(x_tok . gate_r, x_tok . up_r) (bf16).
``w2``: the same over latent rows: out[slot, r] = weight[slot] * act[slot] . w2_r (fp32, one row per slot).
``sum_norm``: a cluster of up to 8 CTAs per token (``sum_norm_layout``), each over its share of the columns: the
token's k slots summed in slot order (deterministic: the grouping order never reaches the numbers), RMSNorm with
the latent norm's weight (the CTAs' partial sums of squares exchanged through distributed shared memory and added
in rank order), bf16 out; CTA 0 also resets the group counters, so the next step (or graph replay) starts from zero.
``gather_rows``, ``reduce_add_rows``: the emulated collectives' stand-ins (``k3tune.runtime.moe.EmulatedComm``) as
one launch each, spin and output together, as a fused collective kernel writes its own output; ``sum_norm`` takes
the routed all-reduce's spin the same way.
Every kernel here takes ``pdl``: launched as a programmatic dependent, each CTA waits for the kernel before it
(``griddepcontrol.wait``) before reading anything and then lets the next one launch, so a chain of them overlaps
each launch with the previous kernel's tail (the block's ``pdl`` knob; pdl = 0 emits neither instruction).

Module switches (``bench/chain_ab.py`` measures each before it becomes the code every block is keyed on; the
module's source is part of each block's key, so flipping one re-keys them all): on, ``ROUTE_SELECT`` and
``FORCED_TOPK`` (session 46); off, refuted or superseded, ``ROUTE_REDUX``, ``GATHER_ROUTE`` and ``W2_EARLY_L2`` (NOTES
sessions 45, 46).

Grouping by expert matters once tokens share experts: at batch 64 with skewed routing ~280 experts serve
1024 slots, and a kernel per (token, choice) would read each of them ~3.6 times.

Inside a GEMV CTA the warps stride over K in 16-byte vectors (``ld.global.nc.v4`` for weights); a lane
loads ``unroll`` vectors of every row and of every token of the item before its FMAs (no branch between a
load and its use: the K tail and missing tokens are masked arithmetically / by clamped indices); lanes
reduce with shuffles, warps through shared memory.

Status: compiled on the CPU for sm_90a and sm_100a (tests/test_kernel_compile.py); numerics checked on a GPU
by tests/test_gpu_moe.py (with pdl = 1: written in session 24, not yet run on a GPU).
"""

import functools
import os
from dataclasses import dataclass

VEC = 8


ITEM_SHIFT = 16  # a work item is expert << 16 | first position in the expert's slot list


@dataclass(frozen=True)
class ExpertKernelConfig:
    rows: int = 4  # intermediate (w13) or latent (w2) rows per group of lanes
    warps: int = 4
    unroll: int = 4  # 16-byte vectors per row a lane loads before its FMAs
    lanes: int = 32  # lanes sharing a row's K: 32 = warps split K too; 8/16 = each group its own rows


def default_config(tokens: int) -> tuple:
    """The expert kernels' knobs where no tuned choice gives them: (w13 config, w2 config, tokens per item).
    Up to 4 tokens per step experts are rarely shared: one slot per item, the widest load batch; beyond,
    items of up to 4 tokens read an expert's tile once for all of them (w2's K is short: 192-384)."""
    if tokens <= 4:
        return ExpertKernelConfig(4, 4, 4), ExpertKernelConfig(4, 4, 1, 8), 1
    return ExpertKernelConfig(4, 4, 2), ExpertKernelConfig(4, 4, 1, 8), 2


@dataclass(frozen=True)
class Groups:
    """Slots grouped by expert, filled by ``route`` and reset by ``sum_norm``. counts[e]: slots of expert e
    (counts[E]: work items); slots[e, :counts[e]]: their slot ids; items[:counts[E]]: work items of at most
    ``per`` slots of one expert."""
    counts: object  # int32 [E + 1], zero between steps
    items: object  # int32 [tokens x k]
    slots: object  # int32 [E, tokens + per - 1]: only valid slot ids, ever
    per: int

    @classmethod
    def allocate(cls, experts: int, tokens: int, top_k: int, per: int, device) -> "Groups":
        import torch

        from k3tune.errors import ConfigError

        if experts >= 1 << (31 - ITEM_SHIFT) or tokens >= 1 << ITEM_SHIFT or per < 1:
            raise ConfigError(f"expert groups: {experts} experts, {tokens} tokens, {per} per item out of range")
        z = functools.partial(torch.zeros, dtype=torch.int32, device=device)
        return cls(z(experts + 1), z(tokens * top_k), z(experts, tokens + per - 1), per)  # spare: see w13


def current_arch() -> str:
    from k3tune.kernels.gemm_smallm import current_arch as arch

    return arch()


NEG = -3.0e38
KEY_NONE = -(1 << 31)  # below every float's orderable key (the redux route's removed or missing experts)


def _fake_args(kind: str, arch: str):
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    b, k, t = cute.sym_int(), cute.sym_int(), cute.sym_int()
    top = fake(Int32, (b, k), stride_order=(1, 0), assumed_align=4)
    wt = fake(Float32, (b, k), stride_order=(1, 0), assumed_align=4)
    e1, s = cute.sym_int(), cute.sym_int()
    groups = (fake(Int32, (e1,), assumed_align=4), fake(Int32, (s,), assumed_align=4),
              fake(Int32, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0), assumed_align=4))
    if kind == "route":
        y = fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2)
        return (y, fake(Float32, (cute.sym_int(),), assumed_align=4), top, wt, *groups)
    if kind == "situ":
        return (fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2),
                fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2))
    if kind == "sum_norm":
        n4 = cute.sym_int(divisibility=4)
        return (fake(Float32, (t, n4), stride_order=(1, 0), assumed_align=16),
                fake(BFloat16, (cute.sym_int(),), assumed_align=2),
                fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2), groups[0], Int64(0))
    if kind == "gather_route":
        return (fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2),
                fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2),
                fake(Float32, (cute.sym_int(),), assumed_align=4), top, wt, *groups, Int64(0))
    if kind in ("gather", "reduce_add"):
        rows = [fake(BFloat16, (b, cute.sym_int()), stride_order=(1, 0), assumed_align=2)
                for _ in range(2 if kind == "gather" else 3)]
        return (*rows, Int64(0))
    n, kk = cute.sym_int(), cute.sym_int(divisibility=VEC)
    x = fake(BFloat16, (cute.sym_int(), kk), stride_order=(1, 0), assumed_align=16)
    w = fake(BFloat16, (cute.sym_int(), n, kk), stride_order=(2, 1, 0), assumed_align=16)
    out = (fake(BFloat16, (t, cute.sym_int()), stride_order=(1, 0), assumed_align=2) if kind == "w13"
           else fake(Float32, (t, n), stride_order=(1, 0), assumed_align=4))
    return x, w, out, wt, *groups


@functools.cache
def compiled(kind: str, knobs: tuple, arch: str, pdl: int = 0):
    """One compile per kernel kind, knob tuple, arch and ``pdl``; batch, widths and expert counts are dynamic.
    knobs: w13 (rows, warps, unroll, lanes, per, beta, linear_beta); w2 (rows, warps, unroll, lanes, per); route
    (experts, top_k, scaling, forced, per); sum_norm (top_k, eps, vectors per thread, slices, threads, cluster); situ
    (beta, linear_beta); gather, reduce_add (tp). ``pdl`` = 1: launched as a programmatic dependent (see ``Pdl`` in
    ``_kernel_classes``). Pass it positionally (``compile_cache.install`` keys on positional arguments). Never call
    inside a capture."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    classes = _kernel_classes()
    kern = classes[kind](*knobs)
    kern.pdl = bool(pdl)
    return cute.compile(kern, *_fake_args(kind, arch), make_fake_stream(), options=f"--gpu-arch {arch}")


ROUTE_REDUX = False  # superseded by select (its rounds remain select's fallback, Route.top_k_redux)
ROUTE_SELECT = True  # on (s46): the top-k by a bound and one bitonic sort (Route.top_k_select)
FORCED_TOPK = True  # on (s46): an imposed routing still runs the top-k (its cost measured), then imposes its experts


def topk(forced: bool) -> tuple[str, bool]:
    """(the route kernel's top-k method, whether an imposed routing runs it too) under the module's switches."""
    method = "select" if ROUTE_SELECT else "redux" if ROUTE_REDUX else "shuffle"
    return method, bool(forced and FORCED_TOPK)
GATHER_ROUTE = False  # off (s45-r1: 1.2 µs slower at MXFP4 b1): the all-gather stand-in and the route in one launch


def route(scores_and_latent, bias, top, weights, top_k: int, scaling: float, groups: Groups,
          forced: bool = False, stream=None, pdl: bool = False):
    """top [B, k] int32, weights [B, k] fp32 from the router scores (the first len(bias) columns), and the
    slots grouped by expert into ``groups`` (which must be reset: fresh, or after ``sum_norm``).
    ``forced``: ``top`` already holds the experts (an imposed routing, for measurement); only the weights
    and the groups are computed, in the same single launch."""
    from k3tune.errors import ConfigError

    if not 0 < top_k <= 32:
        raise ConfigError(f"the route kernel keeps one choice per lane of a warp: top_k {top_k} is not in 1..32")
    method, forced_topk = topk(forced)
    knobs = (bias.shape[0], top_k, float(scaling), forced, groups.per) + \
        ((method, forced_topk) if method != "shuffle" or forced_topk else ())
    fn = compiled("route", knobs, current_arch(), int(pdl))
    fn(_t(scores_and_latent, 2), _t(bias, 4), _t(top, 4), _t(weights, 4), *_groups(groups), _stream(stream))


def run_w13(cfg: ExpertKernelConfig, latent, w13, act, weights, groups: Groups, beta: float, linear_beta: float,
            stream=None, pdl: bool = False):
    """act[slot, :I] = situ(latent[token] . gate rows, latent[token] . up rows) for slot = token x k + choice,
    over the work items of ``groups``."""
    _check(cfg, groups)
    fn = compiled("w13", (cfg.rows, cfg.warps, cfg.unroll, cfg.lanes, groups.per, float(beta), float(linear_beta)),
                  current_arch(), int(pdl))
    fn(_t(latent, 16), _t(w13, 16), _t(act, 2), _t(weights, 4), *_groups(groups), _stream(stream))


W2_EARLY_L2 = False  # off (s45-r1: refuted): w2's CTAs pull their weight tile into L2 before the PDL wait


def run_w2(cfg: ExpertKernelConfig, act, w2, out, weights, groups: Groups, stream=None, pdl: bool = False):
    """out[slot, :L] = weight[slot] * act[slot] . w2 rows (fp32), over the work items of ``groups``.
    With ``pdl`` and ``W2_EARLY_L2``, each CTA first asks L2 for its first item's weight tile
    (``cp.async.bulk.prefetch.L2``), then waits for w13: a w2 CTA resident during w13's tail streams its weights
    meanwhile. The items it reads for that were written by the route kernel before w13 (complete before any w13
    CTA let w2 launch); the expert id is clamped, so a stale item can only prefetch the wrong tile."""
    _check(cfg, groups)
    early = bool(pdl and W2_EARLY_L2)
    knobs = (cfg.rows, cfg.warps, cfg.unroll, cfg.lanes, groups.per) + ((True,) if early else ())
    fn = compiled("w2", knobs, current_arch(), int(pdl))
    fn(_t(act, 16), _t(w2, 16), _t(out, 4), _t(weights, 4), *_groups(groups), _stream(stream))


def _check(cfg: ExpertKernelConfig, groups: Groups):
    from k3tune.errors import ConfigError

    def pow2(v):
        return v > 0 and v & (v - 1) == 0

    if not (pow2(cfg.rows) and pow2(groups.per) and cfg.lanes in (4, 8, 16, 32) and cfg.warps in (1, 2, 4, 8)):
        raise ConfigError(f"expert kernel {cfg} with {groups.per} tokens per item: rows and tokens per item must "
                          "be powers of two, lanes 4/8/16/32, warps 1/2/4/8")


SUM_NORM_THREADS = 512
SUM_NORM_CLUSTERS = (8, 4, 2)  # portable cluster sizes, largest first
SPIN_CTAS = 128  # the CTAs of a fused stand-in that spin (fewer than any target GPU's SMs: all in the first wave)


def sum_norm_layout(n: int, slices: int) -> tuple[int, int, int]:
    """(CTAs a token's row is spread over, threads a CTA, 16-byte vectors a thread) for a row ``n`` wide summed over
    ``slices`` slices: the largest cluster of SUM_NORM_CLUSTERS whose CTAs own whole vectors of every slice. One
    CTA per token read a token's k x n fp32 slots alone (229 KB at K3's top-16: ~4 us on one SM in s39-r4's
    profile); over 8 SMs the block is 1.3-3 us faster (s39-r5/r6, bench/sum_norm_ab.py)."""
    w = n // slices
    cluster = next((c for c in SUM_NORM_CLUSTERS if w % (4 * c) == 0), 1)
    nv = n // cluster // 4
    threads = min(SUM_NORM_THREADS, -(-nv // 32) * 32)
    return cluster, threads, -(-nv // threads)


def sum_norm(per_slot, norm_weight, out, top_k: int, eps: float, groups: Groups, slices: int = 1, cycles: int = 0,
             stream=None, pdl: bool = False):
    """n[b] = RMSNorm(sum_j per_slot[b k + j]) x norm_weight; out[b] = the sum of n[b]'s ``slices`` equal
    slices (bf16, width / slices: what a row-parallel projection over ``slices`` emulated ranks multiplies;
    1: n itself); resets ``groups`` for the next step. RMSNorm(c x) = x / sqrt(mean(x^2) + eps / c^2): a
    caller whose sum is all-reduced by c identical ranks passes eps / c^2. ``cycles``: SM cycles of spin first,
    an emulated all-reduce's link time (the all-reduce fused with the norm, one launch). The row width must be a
    multiple of 4 (16-byte vectors) and of ``slices``; ``sum_norm_layout`` spreads each row over a cluster of CTAs."""
    from k3tune.errors import ConfigError

    n = per_slot.shape[1]
    if n % 4 or n % slices or out.shape[1] != n // slices:
        raise ConfigError(f"sum_norm: width {n} must be a multiple of 4 and of {slices} slices, out {out.shape[1]}"
                          f" wide")
    cluster, threads, per = sum_norm_layout(n, slices)
    fn = compiled("sum_norm", (top_k, float(eps), per, slices, threads, cluster), current_arch(), int(pdl))
    fn(_t(per_slot, 16), _t(norm_weight, 2), _t(out, 2), _t(groups.counts, 4), int(cycles), _stream(stream))


def gather_rows(x, out, tp: int, cycles: int = 0, stream=None, pdl: bool = False):
    """out[b] = x[b] repeated ``tp`` times (bf16 [B, tp w] from [B, w]) after ``cycles`` SM cycles of spin: an
    emulated all-gather's stand-in and its output in one launch."""
    from k3tune.errors import ConfigError

    if out.shape != (x.shape[0], tp * x.shape[1]):
        raise ConfigError(f"gather_rows: out {list(out.shape)} is not [{x.shape[0]}, {tp} x {x.shape[1]}]")
    fn = compiled("gather", (tp,), current_arch(), int(pdl))
    fn(_t(x, 2), _t(out, 2), int(cycles), _stream(stream))


def gather_route(x, out, tp: int, bias, top, weights, top_k: int, scaling: float, groups: Groups,
                 forced: bool = False, cycles: int = 0, stream=None, pdl: bool = False):
    """``gather_rows(x, out, tp, cycles)`` and ``route(out, ...)`` in one launch (GATHER_ROUTE, off since s45-r1): the
    routing CTAs spin the stand-in's cycles beside the gather's, then route from x's copy of the scores, as a
    fused all-gather kernel would route once its peers' parts are in. Same outputs as the two launches."""
    from k3tune.errors import ConfigError

    if out.shape != (x.shape[0], tp * x.shape[1]) or top.shape[0] != x.shape[0]:
        raise ConfigError(f"gather_route: out {list(out.shape)} is not [{x.shape[0]}, {tp} x {x.shape[1]}] or top "
                          f"{list(top.shape)} has another batch")
    if not 0 < top_k <= 32 or bias.shape[0] > out.shape[1]:
        raise ConfigError(f"gather_route: top_k {top_k} not in 1..32 or {bias.shape[0]} experts past the row")
    knobs = (tp, x.shape[1], bias.shape[0], top_k, float(scaling), forced, groups.per, *topk(forced))
    fn = compiled("gather_route", knobs, current_arch(), int(pdl))
    fn(_t(x, 2), _t(out, 2), _t(bias, 4), _t(top, 4), _t(weights, 4), *_groups(groups), int(cycles),
       _stream(stream))


def reduce_add_rows(x, base, out, tp: int, cycles: int = 0, stream=None, pdl: bool = False):
    """out = base + tp x (bf16, fp32 math) after ``cycles`` SM cycles of spin: an emulated all-reduce (every rank
    holding x) fused with the residual add, in one launch."""
    from k3tune.errors import ConfigError

    if not x.shape == base.shape == out.shape:
        raise ConfigError(f"reduce_add_rows: x {list(x.shape)}, base {list(base.shape)}, out {list(out.shape)} differ")
    fn = compiled("reduce_add", (tp,), current_arch(), int(pdl))
    fn(_t(x, 2), _t(base, 2), _t(out, 2), int(cycles), _stream(stream))


def situ_rows(h, out, beta: float, linear_beta: float, stream=None, pdl: bool = False):
    """out[b, i] = situ(h[b, i], h[b, n + i]) for h [B, 2n] (gate columns, then up columns), bf16."""
    fn = compiled("situ", (float(beta), float(linear_beta)), current_arch(), int(pdl))
    fn(_t(h, 2), _t(out, 2), _stream(stream))


def _t(x, align: int):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(x, assumed_align=align).mark_layout_dynamic(leading_dim=x.dim() - 1)


def _groups(g: Groups):
    return _t(g.counts, 4), _t(g.items, 4), _t(g.slots, 4)


def _stream(stream):
    import torch
    from cuda.bindings import driver as cuda

    return cuda.CUstream((stream or torch.cuda.current_stream()).cuda_stream)


@functools.cache
def _kernel_classes():
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.experimental.primitives import cp_async_bulk_prefetch

    @cute.jit
    def spin_once(cycles: Int64, bidx: Int32, tidx: Int32):
        """Busy-wait ``cycles`` SM clock cycles (torch.cuda._sleep's unit), reading no memory, in one thread of each
        of the first SPIN_CTAS CTAs while the CTA's other warps wait at a barrier (they issue nothing): the kernel
        lasts the spin once, not once a wave of CTAs, and its spinning warps leave the SMs to the kernels running
        beside it (the shared experts), as a collective on a few SMs would. The first SPIN_CTAS CTAs are in the
        first wave on any GPU with at least that many SMs."""
        if cycles > 0:
            if bidx < SPIN_CTAS and tidx == 0:
                t0 = cute.arch.clock64()
                now = t0
                while now - t0 < cycles:
                    now = cute.arch.clock64()
            cute.arch.sync_threads()

    class Pdl:
        """``pdl`` (set by ``compiled``): the kernel is launched as a programmatic dependent of the kernel before it on
        its stream. Each CTA first waits for that grid to complete (its outputs visible), reads nothing before, then
        lets the next kernel launch: the next kernel's launch and start overlap this one, and its CTAs wait the same
        way, so every kernel of the chain still sees the whole of its predecessor's output."""
        pdl = False

        @cute.jit
        def pdl_start(self):
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()

    class ExpertGemv(Pdl):
        def __init__(self, which, rows, warps, unroll, lanes, per, beta=0.0, linear_beta=0.0, early=False):
            self.w13 = which == "w13"
            self.early = early  # w2 only (see run_w2): its first item's weight tile into L2 before the PDL wait
            self.rows, self.warps, self.unroll, self.lanes, self.per = rows, warps, unroll, lanes, per
            self.beta, self.lin = beta, linear_beta
            self.nrows = 2 * rows if self.w13 else rows  # weight rows a group reads: gate + up for w13
            # lanes == 32: the CTA's warps split K and reduce through shared memory; fewer: each group of
            # ``lanes`` lanes owns ``rows`` rows of its own (short K: w2's 192-384)
            self.groups = 1 if lanes == 32 else warps * (32 // lanes)
            self.ksplit = warps if lanes == 32 else 1
            self.cta_rows = rows * self.groups

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, mWt: cute.Tensor,
                     mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor, stream: cuda.CUstream):
            out_rows = mW.shape[1] // 2 if cutlass.const_expr(self.w13) else mW.shape[1]
            tiles = (out_rows + self.cta_rows - 1) // self.cta_rows
            # at most one item per slot; past ~32k CTAs, CTAs loop over items instead of idling
            ctas = cutlass.min(mItems.shape[0], cutlass.max(8, 32768 // tiles))
            self.kernel(mX, mW, mOut, mWt, mCnt, mItems, mSlots).launch(
                grid=(ctas, tiles, 1), block=(self.warps * 32, 1, 1), stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, mWt: cute.Tensor,
                   mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor):
            if cutlass.const_expr(self.early and self.pdl and not self.w13):
                self.early_l2(mW, mCnt, mItems)
            self.pdl_start()
            R, NR, W, U, P, L = self.rows, self.nrows, self.warps, self.unroll, self.per, self.lanes
            G, KW, CR = self.groups, self.ksplit, self.cta_rows
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, _ = cute.arch.block_idx()
            gdx, _, _ = cute.arch.grid_dim()
            warp = tidx // 32
            lane = tidx % 32
            sub = lane % L
            grp = 0 if cutlass.const_expr(L == 32) else tidx // L  # this group's rows: grp * R ...
            kbase = warp * 32 * U + lane if cutlass.const_expr(L == 32) else sub
            kw = warp if cutlass.const_expr(L == 32) else 0
            k = mWt.shape[1]
            n_experts = mCnt.shape[0] - 1
            half = mW.shape[1] // 2
            out_rows = half if cutlass.const_expr(self.w13) else mW.shape[1]
            nvec = mW.shape[2] // VEC
            gX = cute.zipped_divide(mX, (1, VEC))
            w_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
            x_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((KW, G, NR * P)), 16)
            wrow = []
            for r in cutlass.range_constexpr(NR):  # gate rows, then (w13) the matching up rows
                base = cutlass.min(bidy * CR + grp * R + (r % R), out_rows - 1)
                wrow.append(base + half if cutlass.const_expr(self.w13 and r >= R) else base)
            n = NR * P  # values a lane accumulates, reduced over the group's lanes below
            chunk = min(n, L)
            halvings = tuple(chunk >> i for i in range(1, chunk.bit_length()))  # chunk/2, ..., 1
            folds = tuple(chunk << i for i in range(32) if chunk << i < L)  # chunk, 2 chunk, ... < lanes
            for it in cutlass.range(bidx, mCnt[n_experts], gdx):
                code = mItems[it]
                e = code >> ITEM_SHIFT
                t0 = code & ((1 << ITEM_SHIFT) - 1)
                gW = cute.zipped_divide(mW[e, None, None], (1, VEC))
                xrow = []
                for t in cutlass.range_constexpr(P):  # past the item's tokens: a stale but valid slot id
                    sl = mSlots[e, t0 + t]  # (the list has P - 1 spare columns), its result dropped below
                    xrow.append(sl // k if cutlass.const_expr(self.w13) else sl)
                ntok = mCnt[e] - t0  # this item's tokens: min(ntok, P); needed only when storing
                acc = cute.make_rmem_tensor(cute.make_layout(n), Float32)  # index r * P + t
                acc.fill(0.0)
                rw = cute.make_rmem_tensor(cute.make_layout((VEC, NR, U)), BFloat16)
                rx = cute.make_rmem_tensor(cute.make_layout((VEC, P, U)), BFloat16)
                for v0 in cutlass.range(kbase, nvec, KW * L * U):
                    for u in cutlass.range_constexpr(U):  # every load of the batch first, weights (which
                        v = cutlass.min(v0 + u * L, nvec - 1)  # need only the expert) before activations
                        for r in cutlass.range_constexpr(NR):
                            cute.copy(w_atom, gW[(None, (wrow[r], v))], rw[None, r, u])
                    for u in cutlass.range_constexpr(U):
                        v = cutlass.min(v0 + u * L, nvec - 1)
                        for t in cutlass.range_constexpr(P):
                            cute.copy(x_atom, gX[(None, (xrow[t], v))], rx[None, t, u])
                    for u in cutlass.range_constexpr(U):
                        keep = cutlass.max(cutlass.min(nvec - (v0 + u * L), 1), 0).to(Float32)
                        xs = []
                        for t in cutlass.range_constexpr(P):
                            xs.append(rx[None, t, u].load().to(Float32))
                        for r in cutlass.range_constexpr(NR):
                            wv = rw[None, r, u].load().to(Float32)  # converted once for all tokens
                            for t in cutlass.range_constexpr(P):
                                a = Float32(0.0)
                                for j in cutlass.range_constexpr(VEC):
                                    a = a + wv[j] * xs[t][j]
                                acc[r * P + t] = acc[r * P + t] + a * keep
                # reduce over the group's lanes, ``chunk`` values at a time: halving exchanges leave lane
                # ``sub`` with value sub % chunk of the chunk (n - 1 shuffles instead of 5 per value)
                for c0 in cutlass.range_constexpr(0, n, chunk):
                    for hs in cutlass.range_constexpr(len(halvings)):
                        h = halvings[hs]
                        upper = (sub & h) != 0
                        for i in cutlass.range_constexpr(h):
                            lo, hi = acc[c0 + i], acc[c0 + i + h]
                            send = Float32(cutlass.select_(upper, lo, hi))
                            keep_v = Float32(cutlass.select_(upper, hi, lo))
                            acc[c0 + i] = keep_v + cute.arch.shuffle_sync_bfly(send, offset=h)
                    for os_ in cutlass.range_constexpr(len(folds)):
                        acc[c0] = acc[c0] + cute.arch.shuffle_sync_bfly(acc[c0], offset=folds[os_])
                    if sub < chunk:
                        red[kw, grp, c0 + sub] = acc[c0]
                cute.arch.sync_threads()
                for q0 in cutlass.range_constexpr(0, CR * P, W * 32):
                    q = q0 + tidx  # q = (g * R + r) * P + t
                    t = q % P
                    rr = (q // P) % R
                    g = q // (P * R)
                    row = bidy * CR + g * R + rr
                    if q < CR * P and t < ntok and row < out_rows:
                        slot = mSlots[e, t0 + t]
                        s = Float32(0.0)
                        for wi in cutlass.range_constexpr(KW):
                            s = s + red[wi, g, rr * P + t]
                        if cutlass.const_expr(self.w13):
                            up = Float32(0.0)
                            for wi in cutlass.range_constexpr(KW):
                                up = up + red[wi, g, (R + rr) * P + t]
                            up = cutlass.max(cutlass.min(up, Float32(self.lin)), Float32(-self.lin))
                            gate_sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-Float32(self.beta) * s))
                            mOut[slot, row] = (s * gate_sig * up).to(BFloat16)
                        else:
                            mOut[slot, row] = s * mWt[slot // k, slot % k]
                cute.arch.sync_threads()  # red is reused by the next item

        @cute.jit
        def early_l2(self, mW: cute.Tensor, mCnt: cute.Tensor, mItems: cute.Tensor):
            """One thread: this CTA's rows of its first item's expert (contiguous: rows x K bf16) into L2."""
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, _ = cute.arch.block_idx()
            if tidx == 0 and bidx < mCnt[mCnt.shape[0] - 1]:
                e = cutlass.max(cutlass.min(mItems[bidx] >> ITEM_SHIFT, mW.shape[0] - 1), 0)
                row0 = bidy * self.cta_rows
                nrows = cutlass.min(self.cta_rows, mW.shape[1] - row0)
                kk = mW.shape[2]
                first = (Int64(e) * mW.shape[1] + row0) * kk  # 64-bit: past 2^31 elements at tp <= 2
                cp_async_bulk_prefetch(mW.iterator + first, nrows * kk * 2)

    class Route(Pdl):
        """``method``: how the k choices are found (``topk`` in ``route``): "shuffle" (k rounds of a warp argmax by
        shuffles), "redux" (the rounds by ``redux.sync``), "select" (a bound, one bitonic sort of the candidates: see
        ``top_k_select``). ``forced_topk``: with ``forced``, the top-k still runs, as a served step runs it, and
        the imposed experts replace its choices (an imposed routing then costs what the router's own does)."""

        def __init__(self, experts, top_k, scaling, forced=False, per=1, method="shuffle", forced_topk=False):
            self.E, self.K, self.scaling, self.forced, self.per_item = experts, top_k, scaling, forced, per
            self.per = (experts + 31) // 32
            self.method, self.forced_topk = method, forced_topk

        @cute.jit
        def __call__(self, mY: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor, mWt: cute.Tensor,
                     mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor, stream: cuda.CUstream):
            self.kernel(mY, mBias, mTop, mWt, mCnt, mItems, mSlots).launch(
                grid=(mTop.shape[0], 1, 1), block=(32, 1, 1), stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mY: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor, mWt: cute.Tensor,
                   mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor):
            self.pdl_start()
            lane, _, _ = cute.arch.thread_idx()
            b, _, _ = cute.arch.block_idx()
            sI, sF = self.scratch()
            self.route_token(mY, mBias, mTop, mWt, mCnt, mItems, mSlots, b, lane, sI, sF)

        def score(self, mY, b, e):
            """Token b's router score of expert e (a plain function: inlined where it is traced)."""
            return mY[b, e]

        def scratch(self):
            """The select top-k's shared memory (a warp's candidates: keys and ids, sigmoids and chosen weights; slots
            32-63: each lane's spare, where its non-candidates' stores land)."""
            smem = cutlass.memory.SmemAllocator()
            return (smem.allocate_tensor(Int32, cute.make_layout((2, 64), stride=(64, 1)), 16),
                    smem.allocate_tensor(Float32, cute.make_layout((2, 64), stride=(64, 1)), 16))

        @cute.jit
        def route_token(self, mY: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor, mWt: cute.Tensor,
                        mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor, b: Int32, lane: Int32,
                        sI: cute.Tensor, sF: cute.Tensor):
            """Token b's top-k, weights and slot grouping, by the one warp whose lanes are ``lane``."""
            my_w = Float32(0.0)  # lane r keeps the r-th choice: no lane reads another lane's stores
            my_id = Int32(0)
            total = Float32(0.0)
            if cutlass.const_expr(not self.forced or self.forced_topk):
                sig, key = self.keys(mY, mBias, b, lane)
                if cutlass.const_expr(self.method == "select"):
                    my_w, my_id, total = self.top_k_select(sig, key, lane, sI, sF)
                elif cutlass.const_expr(self.method == "redux"):
                    my_w, my_id, total = self.top_k_redux(sig, key, lane)
                else:
                    my_w, my_id, total = self.top_k_shuffle(sig, key, lane)
            if cutlass.const_expr(self.forced):
                nat = my_id + Int32(cutlass.select_(my_w * total == Float32(-7.0), 1, 0))  # the router's choice
                my_w = Float32(0.0)
                my_id = Int32(0)
                if lane < self.K:
                    my_id = mTop[b, lane]
                    if cutlass.const_expr(self.forced_topk):  # never true: keeps the top-k from being optimised away
                        my_id = Int32(cutlass.select_(nat == Int32(-7), nat, my_id))
                    my_w = Float32(1.0) / (Float32(1.0) + cute.math.exp(-self.score(mY, b, my_id).to(Float32)))
                total = cute.arch.warp_reduction_sum(my_w)
            if lane < self.K:
                if cutlass.const_expr(not self.forced):
                    mTop[b, lane] = my_id
                mWt[b, lane] = my_w * (Float32(self.scaling) / total)
                # group the slot under its expert; every per_item-th slot of an expert opens a work item
                pos = cute.arch.atomic_add(mCnt.iterator + my_id, Int32(1))
                mSlots[my_id, pos] = b * self.K + lane
                if pos % self.per_item == 0:
                    at = cute.arch.atomic_add(mCnt.iterator + self.E, Int32(1))
                    mItems[at] = (my_id << ITEM_SHIFT) | pos

        @cute.jit
        def keys(self, mY: cute.Tensor, mBias: cute.Tensor, b: Int32, lane: Int32):
            """(sigmoid of the score, score + bias as an Int32 whose signed order is the float order) of experts
            lane + 32 i: a negative float's low 31 bits flipped (no -0.0 arises: sigmoid > 0); KEY_NONE past E."""
            P = self.per
            vals = cute.make_rmem_tensor(cute.make_layout(P), Float32)
            sig = cute.make_rmem_tensor(cute.make_layout(P), Float32)
            raw = cute.make_rmem_tensor(cute.make_layout(P), Float32)
            for i in cutlass.range_constexpr(P):  # every load first: the sigmoids' reciprocals branch (their slow
                e = cutlass.min(lane + 32 * i, self.E - 1)  # path), and a load after a branch waits for it
                raw[i] = self.score(mY, b, e).to(Float32)
                vals[i] = mBias[e]
            for i in cutlass.range_constexpr(P):
                sig[i] = Float32(1.0) / (Float32(1.0) + cute.math.exp(-raw[i]))
                vals[i] = sig[i] + vals[i]
            bits = cute.recast_tensor(vals, Int32)
            key = cute.make_rmem_tensor(cute.make_layout(P), Int32)
            for i in cutlass.range_constexpr(P):
                v = bits[i]
                k = v ^ ((v >> 31) & Int32(0x7FFFFFFF))
                key[i] = k if cutlass.const_expr(32 * (i + 1) <= self.E) else \
                    Int32(cutlass.select_(lane + 32 * i < self.E, k, Int32(KEY_NONE)))
            return sig, key

        @cute.jit
        def top_k_shuffle(self, sig: cute.Tensor, key: cute.Tensor, lane: Int32):
            """k rounds of a warp argmax by shuffles (the highest key, ties to the lowest expert id)."""
            my_w = Float32(0.0)
            my_id = Int32(0)
            total = Float32(0.0)
            for r in cutlass.range_constexpr(self.K):
                best = Int32(KEY_NONE)
                for i in cutlass.range_constexpr(self.per):
                    best = cutlass.max(best, key[i])
                best = cute.arch.warp_reduction(best, lambda x, y: cutlass.max(x, y))
                idx = Int32(1 << 30)
                for i in cutlass.range_constexpr(self.per):  # the lowest expert id holding the best key
                    idx = cutlass.min(idx, Int32(cutlass.select_(key[i] == best, lane + 32 * i, Int32(1 << 30))))
                idx = cute.arch.warp_reduction(idx, lambda x, y: cutlass.min(x, y))
                chosen = Float32(0.0)
                for i in cutlass.range_constexpr(self.per):
                    hit = lane + 32 * i == idx
                    chosen = chosen + Float32(cutlass.select_(hit, sig[i], Float32(0.0)))
                    key[i] = Int32(cutlass.select_(hit, Int32(KEY_NONE), key[i]))
                chosen = cute.arch.warp_reduction_sum(chosen)
                total = total + chosen
                my_w = Float32(cutlass.select_(lane == r, chosen, my_w))
                my_id = Int32(cutlass.select_(lane == r, idx, my_id))
            return my_w, my_id, total

        @cute.jit
        def top_k_redux(self, sig: cute.Tensor, key: cute.Tensor, lane: Int32):
            """The shuffle rounds' choices and weights, each round's argmax as two ``redux.sync`` (sm_80+) instead of
            ten shuffle steps: the warp's max key, then the lowest expert id holding it; the chosen sigmoid comes
            from its lane by one shuffle. Each lane's max is a pairwise tree, not a chain."""
            P = self.per
            my_w = Float32(0.0)
            my_id = Int32(0)
            total = Float32(0.0)
            for r in cutlass.range_constexpr(self.K):
                best = cute.arch.warp_redux_sync(pairwise([key[i] for i in range(P)], cutlass.max), "max")
                idx = cute.arch.warp_redux_sync(pairwise([Int32(cutlass.select_(key[i] == best, lane + 32 * i,
                                                                                Int32(1 << 30))) for i in range(P)],
                                                         cutlass.min), "min")
                mine = Float32(0.0)
                for i in cutlass.range_constexpr(P):
                    hit = lane + 32 * i == idx
                    mine = Float32(cutlass.select_(hit, sig[i], mine))
                    key[i] = Int32(cutlass.select_(hit, Int32(KEY_NONE), key[i]))
                chosen = cute.arch.shuffle_sync(mine, idx % 32)
                total = total + chosen
                my_w = Float32(cutlass.select_(lane == r, chosen, my_w))
                my_id = Int32(cutlass.select_(lane == r, idx, my_id))
            return my_w, my_id, total

        @cute.jit
        def top_k_select(self, sig: cute.Tensor, key: cute.Tensor, lane: Int32, sI: cute.Tensor, sF: cute.Tensor):
            """The rounds' choices, order and weights without k dependent rounds. The k-th largest of the 32 lanes'
            maxima, L, bounds the k-th largest key from below (k lanes hold a key >= L each), so every choice, ties
            at the k-th place included, is among the candidates key >= L: typically ~k + 6 of the 896. They are
            compacted into shared memory by ballots and sorted once, one a lane, by a bitonic network of shuffles
            (key descending, expert id ascending: the rounds' order); lane r < k then holds the r-th choice, and the
            weights' total is summed in that order (bit for bit the rounds' sum). More than 32 candidates (ties in
            bulk): the redux rounds."""
            P, K = self.per, self.K
            L = cute.arch.shuffle_sync(bitonic_desc(pairwise([key[i] for i in range(P)], cutlass.max), lane), K - 1)
            pos = cute.make_rmem_tensor(cute.make_layout(P), Int32)
            cum = Int32(0)
            for i in cutlass.range_constexpr(P):
                mask = cute.arch.vote_ballot_sync(key[i] >= L)
                pos[i] = Int32(cutlass.select_(key[i] >= L, cum + cute.arch.popc(mask & cute.arch.lanemask_lt()),
                                               Int32(-1)))
                cum = cum + cute.arch.popc(mask)
            my_w = Float32(0.0)
            my_id = Int32(0)
            total = Float32(0.0)
            if cum <= 32:
                sI[0, lane] = Int32(KEY_NONE)
                sI[1, lane] = Int32(1 << 30)
                sF[0, lane] = Float32(0.0)
                cute.arch.sync_warp()
                for i in cutlass.range_constexpr(P):  # branch-free: a non-candidate writes its lane's spare slot
                    at = Int32(cutlass.select_(pos[i] >= 0, pos[i], 32 + lane))
                    sI[0, at] = key[i]
                    sI[1, at] = lane + 32 * i
                    sF[0, at] = sig[i]
                cute.arch.sync_warp()
                k, e, w = bitonic_desc_pairs(sI[0, lane], sI[1, lane], sF[0, lane], lane)
                sF[1, lane] = w
                cute.arch.sync_warp()
                for r in cutlass.range_constexpr(K):
                    total = total + sF[1, r]
                my_w, my_id = w, e
            else:
                my_w, my_id, total = self.top_k_redux(sig, key, lane)
            return my_w, my_id, total

    class SumNorm(Pdl):
        """A token's row over ``cluster`` CTAs (one thread-block cluster): CTA c of the token's cluster owns output
        columns [c wc, (c + 1) wc) of every slice (wc = width / slices / cluster), i.e. latent columns r w + c wc ...
        for each slice r; it sums its columns' k slots, squares them, and the CTAs' partial sums of squares are
        exchanged through distributed shared memory (each pushes its own to every peer), so each CTA adds the same
        ``cluster`` partials in rank order (deterministic) before it normalises its columns."""

        def __init__(self, top_k, eps, per, slices=1, threads=SUM_NORM_THREADS, cluster=1):
            self.K, self.eps, self.per, self.slices = top_k, eps, per, slices
            self.THREADS, self.C = threads, cluster

        @cute.jit
        def __call__(self, mP: cute.Tensor, mG: cute.Tensor, mOut: cute.Tensor, mCnt: cute.Tensor, cycles: Int64,
                     stream: cuda.CUstream):
            if cutlass.const_expr(self.C > 1):
                self.kernel(mP, mG, mOut, mCnt, cycles).launch(grid=(mOut.shape[0] * self.C, 1, 1),
                                                               block=(self.THREADS, 1, 1), cluster=[self.C, 1, 1],
                                                               stream=stream, use_pdl=self.pdl)
            else:
                self.kernel(mP, mG, mOut, mCnt, cycles).launch(grid=(mOut.shape[0], 1, 1), block=(self.THREADS, 1, 1),
                                                               stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mP: cute.Tensor, mG: cute.Tensor, mOut: cute.Tensor, mCnt: cute.Tensor, cycles: Int64):
            T, K, PER, C, S = self.THREADS, self.K, self.per, self.C, self.slices
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            b = bidx // C  # the token
            rank = bidx % C  # the cluster is C consecutive CTAs along x
            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(T // 32), 16)
            if cutlass.const_expr(C > 1):  # each rank's partial sum of squares lands in every peer's xs[rank]
                xs = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
                bar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)
                if tidx == 0:
                    cute.arch.mbarrier_init(bar.iterator, 1)
                    cute.arch.mbarrier_init_fence()
                    cute.arch.mbarrier_arrive_and_expect_tx(bar.iterator, C * 4)
                cute.arch.cluster_arrive_relaxed()
            self.pdl_start()  # the spin (link time) starts when the collective's input exists
            spin_once(cycles, bidx, tidx)  # a fused all-reduce's link time (0: none)
            n = mP.shape[1]  # the latent's width (the output is w = n / slices wide)
            w = n // S
            wc = w // C  # output columns (of every slice) this CTA owns: a multiple of 4
            q4 = wc // 4
            nv = S * q4  # this CTA's 16-byte vectors of the row
            gP = cute.zipped_divide(mP, (1, 4))
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            sums = cute.make_rmem_tensor(cute.make_layout((4, PER)), Float32)
            sums.fill(0.0)
            sq = Float32(0.0)
            for i in cutlass.range_constexpr(PER):
                v = cutlass.min(tidx + i * T, nv - 1)
                col4 = (v // q4) * (w // 4) + rank * q4 + v % q4  # slice v // q4's vector v % q4 of this CTA
                rp = cute.make_rmem_tensor(cute.make_layout((4, K)), Float32)
                for j in cutlass.range_constexpr(K):  # the token's k slots, all loads first
                    cute.copy(atom, gP[(None, (b * K + j, col4))], rp[None, j])
                keep = cutlass.max(cutlass.min(nv - (tidx + i * T), 1), 0).to(Float32)
                for j in cutlass.range_constexpr(K):  # in slot order: deterministic
                    for c in cutlass.range_constexpr(4):
                        sums[c, i] = sums[c, i] + rp[c, j]
                for c in cutlass.range_constexpr(4):
                    sq = sq + sums[c, i] * sums[c, i] * keep
            sq = cute.arch.warp_reduction_sum(sq)
            if tidx % 32 == 0:
                red[tidx // 32] = sq
            if bidx == 0:  # every expert kernel of this step is done: reset the groups for the next one
                for q in cutlass.range(tidx, mCnt.shape[0], T):
                    mCnt[q] = Int32(0)
            cute.arch.sync_threads()
            tot = Float32(0.0)
            for wi in cutlass.range_constexpr(T // 32):
                tot = tot + red[wi]
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_wait()  # every peer's mbarrier is initialised and armed
                if tidx < C:  # thread p pushes this rank's partial to peer p
                    bits = cute.make_rmem_tensor(cute.make_layout(1), Float32)
                    bits[0] = tot
                    cute.arch.store_async_dsmem((xs.iterator + rank).align(4), cute.recast_tensor(bits, Int32)[0],
                                                bar.iterator, tidx)
                cute.arch.mbarrier_wait(bar.iterator, 0)
                tot = Float32(0.0)
                for z in cutlass.range_constexpr(C):  # rank order: the same sum in every CTA
                    tot = tot + xs[z]
            inv = cute.math.rsqrt(tot / n.to(Float32) + Float32(self.eps))
            if cutlass.const_expr(S == 1):
                for i in cutlass.range_constexpr(PER):
                    v = tidx + i * T
                    if v < nv:
                        col = 4 * (rank * q4 + v)
                        for c in cutlass.range_constexpr(4):
                            mOut[b, col + c] = (sums[c, i] * inv * mG[col + c].to(Float32)).to(BFloat16)
            else:  # this CTA's normed columns through shared memory, then each output column sums its slices in order
                row = smem.allocate_tensor(Float32, cute.make_layout(4 * PER * T), 16)
                for i in cutlass.range_constexpr(PER):
                    v = tidx + i * T
                    if v < nv:
                        col = 4 * ((v // q4) * (w // 4) + rank * q4 + v % q4)
                        for c in cutlass.range_constexpr(4):
                            row[4 * v + c] = sums[c, i] * inv * mG[col + c].to(Float32)
                cute.arch.sync_threads()
                for q in cutlass.range(tidx, wc, T):
                    acc = Float32(0.0)
                    for r in cutlass.range_constexpr(S):
                        acc = acc + row[r * wc + q]
                    mOut[b, rank * wc + q] = acc.to(BFloat16)

    def pairwise(vals, op):
        """op over ``vals`` as a pairwise tree, unrolled at trace time (a plain function: the DSL leaves its loop
        alone): depth log2(len), not len."""
        while len(vals) > 1:
            vals = [op(vals[j], vals[j + 1]) if j + 1 < len(vals) else vals[j] for j in range(0, len(vals), 2)]
        return vals[0]

    def keep_first(lane, j, k):
        """In a bitonic sorting network's stage (k, j): whether this lane keeps the element that sorts first
        (descending overall: in the final stage, k = 32, the lower lane of each pair)."""
        return ((lane // j) ^ (lane // k)) % 2 == 0

    def bitonic_desc(v, lane):
        """32 Int32 values, one a lane, sorted descending (lane 0 the largest) by shuffles."""
        k = 2
        while k <= 32:
            j = k // 2
            while j >= 1:
                p = cute.arch.shuffle_sync_bfly(v, j)
                v = Int32(cutlass.select_(keep_first(lane, j, k), cutlass.max(v, p), cutlass.min(v, p)))
                j //= 2
            k *= 2
        return v

    def bitonic_desc_pairs(key, ident, val, lane):
        """32 (key, id, value) triples, one a lane, sorted by key descending, then id ascending (distinct ids)."""
        k = 2
        while k <= 32:
            j = k // 2
            while j >= 1:
                pk = cute.arch.shuffle_sync_bfly(key, j)
                pi = cute.arch.shuffle_sync_bfly(ident, j)
                pv = cute.arch.shuffle_sync_bfly(val, j)
                p_first = Int32(cutlass.select_(pk > key, 1, Int32(cutlass.select_(pk == key, Int32(
                    cutlass.select_(pi < ident, 1, 0)), 0))))
                me_first = Int32(cutlass.select_(key > pk, 1, Int32(cutlass.select_(pk == key, Int32(
                    cutlass.select_(ident < pi, 1, 0)), 0))))
                take = Int32(cutlass.select_(keep_first(lane, j, k), p_first, me_first))
                key = Int32(cutlass.select_(take == 1, pk, key))
                ident = Int32(cutlass.select_(take == 1, pi, ident))
                val = Float32(cutlass.select_(take == 1, pv, val))
                j //= 2
            k *= 2
        return key, ident, val

    def rows_grid(mOut, threads):
        """One CTA per ``threads`` elements of each row of ``mOut`` (a flat grid: any CTA past the first
        SPIN_CTAS skips the spin)."""
        return (mOut.shape[0] * ((mOut.shape[1] + threads - 1) // threads), 1, 1)

    def spun_element(mOut, cycles, threads, first=0):
        """In a ``rows_grid`` kernel (its CTAs from ``first`` on): the spin (``spin_once``), then this thread's
        (row, column) of ``mOut``."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bidx = bidx - first
        spin_once(cycles, bidx, tidx)
        blocks = (mOut.shape[1] + threads - 1) // threads
        return bidx // blocks, (bidx % blocks) * threads + tidx

    class Gather(Pdl):
        """out[b, r w + j] = x[b, j] for r < tp after ``cycles`` of spin: an all-gather's stand-in that writes
        its output, as the collective kernel would (one launch, not a spin and a concatenation)."""
        THREADS = 256

        def __init__(self, tp):
            self.tp = tp

        @cute.jit
        def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, cycles: Int64, stream: cuda.CUstream):
            self.kernel(mX, mOut, cycles).launch(grid=rows_grid(mOut, self.THREADS), block=(self.THREADS, 1, 1),
                                                 stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, cycles: Int64):
            self.pdl_start()
            b, i = spun_element(mOut, cycles, self.THREADS)
            if i < mOut.shape[1]:
                mOut[b, i] = mX[b, i % mX.shape[1]]

    class GatherRoute(Route):
        """``Gather`` and ``Route`` in one launch (GATHER_ROUTE, see ``gather_route``): CTA b < B spins the
        stand-in's cycles, as a fused collective's CTA waits for its peers' parts, then its first warp routes token
        b; the CTAs after them are ``Gather``'s. The route reads the scores the gather writes, out[b, e] =
        x[b, e % width], from x (``width``: x's row width, static), so it needs no grid-wide wait for them."""
        THREADS = Gather.THREADS

        def __init__(self, tp, width, experts, top_k, scaling, forced=False, per=1, method="shuffle",
                     forced_topk=False):
            super().__init__(experts, top_k, scaling, forced, per, method, forced_topk)
            self.tp, self.width = tp, width

        def score(self, mY, b, e):
            return mY[b, e % self.width]

        @cute.jit
        def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor,
                     mWt: cute.Tensor, mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor, cycles: Int64,
                     stream: cuda.CUstream):
            grid = rows_grid(mOut, self.THREADS)
            self.kernel(mX, mOut, mBias, mTop, mWt, mCnt, mItems, mSlots, cycles).launch(
                grid=(mTop.shape[0] + grid[0], 1, 1), block=(self.THREADS, 1, 1), stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor,
                   mWt: cute.Tensor, mCnt: cute.Tensor, mItems: cute.Tensor, mSlots: cute.Tensor, cycles: Int64):
            self.pdl_start()
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            sI, sF = self.scratch()
            if bidx < mTop.shape[0]:
                spin_once(cycles, Int32(0), tidx)  # every routing CTA waits out the link time
                if tidx < 32:
                    self.route_token(mX, mBias, mTop, mWt, mCnt, mItems, mSlots, bidx, tidx, sI, sF)
            else:
                b, i = spun_element(mOut, cycles, self.THREADS, mTop.shape[0])
                if i < mOut.shape[1]:
                    mOut[b, i] = mX[b, i % mX.shape[1]]

    class ReduceAdd(Pdl):
        """out = base + tp x (fp32 math, bf16 out) after ``cycles`` of spin: an all-reduce's stand-in fused with
        the residual add, as a fused all-reduce kernel does it."""
        THREADS = 256

        def __init__(self, tp):
            self.tp = tp

        @cute.jit
        def __call__(self, mX: cute.Tensor, mBase: cute.Tensor, mOut: cute.Tensor, cycles: Int64,
                     stream: cuda.CUstream):
            self.kernel(mX, mBase, mOut, cycles).launch(grid=rows_grid(mOut, self.THREADS),
                                                        block=(self.THREADS, 1, 1), stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mBase: cute.Tensor, mOut: cute.Tensor, cycles: Int64):
            self.pdl_start()
            b, i = spun_element(mOut, cycles, self.THREADS)
            if i < mOut.shape[1]:
                mOut[b, i] = (mBase[b, i].to(Float32) + Float32(self.tp) * mX[b, i].to(Float32)).to(BFloat16)

    class Situ(Pdl):
        THREADS = 256

        def __init__(self, beta, linear_beta):
            self.beta, self.lin = beta, linear_beta

        @cute.jit
        def __call__(self, mH: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
            n = mOut.shape[1]
            self.kernel(mH, mOut).launch(grid=(mOut.shape[0], (n + self.THREADS - 1) // self.THREADS, 1),
                                         block=(self.THREADS, 1, 1), stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mH: cute.Tensor, mOut: cute.Tensor):
            self.pdl_start()
            tidx, _, _ = cute.arch.thread_idx()
            b, j, _ = cute.arch.block_idx()
            n = mOut.shape[1]
            i = j * self.THREADS + tidx
            if i < n:
                g = mH[b, i].to(Float32)
                u = cutlass.max(cutlass.min(mH[b, n + i].to(Float32), Float32(self.lin)), Float32(-self.lin))
                mOut[b, i] = (g / (Float32(1.0) + cute.math.exp(-Float32(self.beta) * g)) * u).to(BFloat16)

    return {"w13": lambda *k: ExpertGemv("w13", *k), "w2": lambda *k: ExpertGemv("w2", *k[:5], 0.0, 0.0, *k[5:]),
            "route": Route, "sum_norm": SumNorm, "situ": Situ, "gather": Gather, "reduce_add": ReduceAdd,
            "gather_route": GatherRoute}
