"""Where a programmatic dependent launch lets the next launch start: the trigger points the staged
gemm.wgmma_cktrig searches (its docstring says why), and what a family extending a dense family with them declares."""

LATE = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 1024)
FIRST = LATE[-1]  # at the loop's first stage (right after the wait): what every late >= a slice's stages does


def late_seeds(ktiles: int) -> list[int]:
    """Trigger points worth a seed for a slice of ``ktiles`` stages, as LATE values: its second stage, its middle,
    its first (s55-r2/r3, H100: the best of the 16-token layouts on TP8's 1536 x 7168 and 7168 x 1536 ops)."""
    def at(stage: int) -> int:  # the LATE value that fires at the latest point no later than ``stage``
        x = min((x for x in LATE if x >= ktiles - stage), default=FIRST)
        return FIRST if x >= ktiles else x

    return list(dict.fromkeys(at(s) for s in (1, ktiles // 2, 0)))


class LateTrigger:
    """What a family that extends a dense kernel family (``parent``, its next base class) with the ``late`` knob
    declares: the knob in the space, ignored without PDL, seeded and adopted from the parent at ``late_seeds``, and
    a build that launches its own ``compile(cfg, arch)`` on x, W and out. Subclasses set ``parent`` and
    ``config_cls`` (the parent's config with ``late``) and define ``compile`` and ``ktiles`` (stages a slice)."""

    parent: str

    def space(self, problem) -> dict[str, tuple]:
        return {**super().space(problem), "late": LATE}

    def valid(self, cfg, problem) -> bool:
        """One name for each kernel a search measures: late 0 with PDL is the parent's kernel (measured under the
        parent's name), and every late value at or past a slice's stages fires at its first stage, so only FIRST
        stands for them (s56-r3 picked late 10 for 7-stage slices). Without PDL the knob is 0 (the bench's twin)."""
        if not hasattr(cfg, "late"):  # the parent's seeds are checked here before they are converted
            return super().valid(cfg, problem)
        late = cfg.late
        return (late in LATE and (late > 0 if cfg.pdl else late == 0) and super().valid(cfg, problem)
                and (late < self.ktiles(problem, cfg.params()) or late == FIRST))

    def canonical(self, params: dict) -> dict:
        """Without PDL nothing is triggered: the knob is ignored."""
        return {**params, "late": 0} if not params.get("pdl") else params

    def default(self, problem):
        """The first seed; without one, the parent's default triggering at its first stage (or, without PDL, as the
        parent)."""
        seeds = self.seeds(problem)
        if seeds:
            return seeds[0]
        params = super().default(problem).params()
        return self.config_cls(**params, late=FIRST if params.get("pdl") else 0)

    def seeds(self, problem) -> list:
        """The parent's first three PDL seeds triggering at their slice's second stage, middle and first
        (``late_seeds``); at late 0 they are the parent's own kernels, which the sweep measures under the parent's
        name, and the parent's winners nearby come in through ``adopt``."""
        out = []
        for c in [c for c in super().seeds(problem) if c.pdl][:3]:
            out += self.adopt(self.parent, c.params(), problem)
        return list(dict.fromkeys(c for c in (self.config_cls(**p) for p in out) if self.valid(c, problem)))

    def adopt(self, family: str, params: dict, problem) -> list[dict]:
        """A parent config (a winner nearby, or a seed) with PDL, triggering at each of ``late_seeds``."""
        if family != self.parent or not params.get("pdl") or not {"bk", "split_k"} <= params.keys():
            return []  # (or a winner stored before the parent had those knobs)
        return [{**params, "late": t} for t in late_seeds(self.ktiles(problem, params))]

    def build(self, problem, cfg):
        import torch
        from cuda.bindings import driver as cuda
        from cutlass.cute.runtime import from_dlpack

        from k3tune.kernels.gemm_smallm import current_arch

        fn = self.compile(cfg, current_arch())

        def run(inputs: dict):
            x = (from_dlpack(inputs["x"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=cfg.bk))
            w = (from_dlpack(inputs["w"], assumed_align=16).mark_compact_shape_dynamic(mode=0)
                 .mark_compact_shape_dynamic(mode=1, divisibility=cfg.bk))
            y = from_dlpack(inputs["out"], assumed_align=16).mark_layout_dynamic()
            fn(x, w, y, cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            return inputs["out"]

        return run


def compile_dense(kernel, bk: int, arch: str):
    """``kernel(x, w, y, stream)`` compiled for ``arch`` with M, N and K dynamic (K a multiple of ``bk``): what
    ``LateTrigger.build`` launches. Never call inside a capture."""
    import os

    import cutlass.cute as cute
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ["CUTE_DSL_ARCH"] = arch  # some checks read the environment, not the option
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=bk)
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(BFloat16, (n, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, n), stride_order=(1, 0), assumed_align=16)
    return cute.compile(kernel, x, w, y, make_fake_stream(), options=f"--gpu-arch {arch}")
