"""A dense decode projection as serving runs it: the selector's kernel for one op of one deployment, built for the
step's exact token count and bound to this rank's weight, ready to call on the current stream and to capture in a
CUDA graph.

    from k3tune.runtime import Selector
    from k3tune.runtime.dense import DenseProjection

    proj = DenseProjection.serve(Selector.load(), "kda.o_proj", w, tp=16, batch=8, draft=0)   # w [N, K] bf16
    y = proj(x)      # x [tokens, K] bf16 -> y [tokens, N] bf16; tokens = batch * (1 + draft)
    proj.ran         # e.g. 'gemm.splitk_cluster {...} (measured)'

The weight must be the op's per-rank shape at that tp (a wrong tp's weight is a ConfigError, not a wrong answer). A
CuTe kernel writes into an output buffer the projection owns: each call returns that buffer, rewritten, so copy it
before the next call if it must live longer (a CUDA graph replays into the same buffer).

Serving never stops on a tuning result. A tuned config that does not fit this exact token count (it was tuned for
its bucket) gives its family's default config; a family that cannot run here (no code for this GPU's arch, a CPU
tensor, or a kernel that fails to build) gives the safe baseline, cuBLAS (``torch.matmul``). ``ran`` says which
kernel runs and why, and a fallback to cuBLAS is logged as a warning. Building allocates the kernel's buffers (its
output, and a split-K workspace where it has one) once; a call allocates nothing for a CuTe kernel.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from k3tune.errors import CannotImplement, ConfigError
from k3tune.kernels import family, gemm_smallm
from k3tune.plan import problems as plans

log = logging.getLogger(__name__)

SAFE = "gemm.cublas"


@dataclass
class DenseProjection:
    op: str
    ran: str  # the family, its knobs, and where they came from (measured, nearest bucket, default, fallback)
    family: str
    _inputs: dict
    _run: object
    x_shape: tuple[int, int]  # [tokens, K]: what each call takes

    @classmethod
    def serve(cls, selector, op: str, weight, tp: int, batch: int, draft: int = 0) -> DenseProjection:
        """``op``'s kernel from ``selector`` (k3tune.runtime.Selector) for a deployment of ``tp`` ranks, ``batch``
        sequences and ``draft`` speculative tokens, bound to ``weight`` (this rank's [N, K] bf16 shard)."""
        import torch

        o = plans.op(op)
        if o.kind != "gemm":
            raise ConfigError(f"{op} is not a dense projection (kind {o.kind})")
        choice = selector.lookup(op, tp, batch, draft)
        dep = plans.Deployment(tp, batch, 1, draft, 0)
        want = plans.problem_for(o, selector.model, dep, selector.spec)
        if weight.dim() != 2 or tuple(weight.shape) != (want["N"], want["K"]) or weight.dtype != torch.bfloat16:
            raise ConfigError(f"{op} at tp {tp} takes a [{want['N']}, {want['K']}] bf16 weight, got "
                              f"{list(weight.shape)} {weight.dtype}")
        return cls.bind(choice, op, weight, dep.tokens)

    @classmethod
    def bind(cls, choice, op: str, weight, tokens: int) -> DenseProjection:
        """``choice`` (a selector's ``Choice`` for ``op``) built for ``tokens`` rows of x and bound to ``weight``
        ([N, K] bf16), whatever its shape: for a caller that checked the weight against its own model (the MoE
        block's ``RankWeights``). ``serve`` is this after the lookup and the check against the selector's model."""
        import torch

        if weight.dim() != 2 or weight.dtype != torch.bfloat16:
            raise ConfigError(f"{op} takes a 2-D bf16 weight, got {list(weight.shape)} {weight.dtype}")
        if not weight.is_contiguous():
            raise ConfigError(f"{op}: the weight must be contiguous (row-major [N, K]), as the kernels read it")
        n, k = weight.shape
        problem = plans.Problem(op, "gemm", (("M", tokens), ("N", n), ("K", k)))
        fam, how = family(choice.family), choice.source
        try:
            cfg = fam.config_from_params(problem, dict(choice.params))
        except CannotImplement as e:
            cfg, how = fam.default_config(problem), f"{how}; its family's default config: {e}"
        run, why = None, _cannot_run(fam, problem, weight.device)
        if why is None:
            try:
                run = fam.build(problem, cfg)
            except CannotImplement as e:
                why = str(e)
            except Exception as e:  # DSL/MLIR compile errors have no common base class
                why = f"build failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if run is None:
            log.warning("%s: %s cannot run here (%s): serving %s", op, fam.name, why, SAFE)
            fam, how = family(SAFE), f"{SAFE} instead of {fam.name} ({why})"
            cfg = fam.default_config(problem)
            run = fam.build(problem, cfg)
        inputs = fam.make_inputs(problem, weight.device, torch.Generator(device=weight.device).manual_seed(0))
        inputs["w"] = weight
        label = f"{fam.name} {json.dumps(cfg.params(), sort_keys=True)} ({how})"
        return cls(op, label, fam.name, inputs, run, (tokens, k))

    @property
    def out(self):
        """The output buffer the CuTe kernel writes (each call returns it, rewritten); None for cuBLAS."""
        return self._inputs.get("out")

    def __call__(self, x):
        if x.shape != self.x_shape:  # a kernel built for these tokens would read past a smaller x
            raise ConfigError(f"{self.op}: built for x of shape {list(self.x_shape)}, got {list(x.shape)}")
        return self._run({**self._inputs, "x": x.contiguous()})


def _cannot_run(fam, problem, device) -> str | None:
    """Why ``fam`` cannot run ``problem`` on ``device`` (None: it can)."""
    if device.type != "cuda":
        return None if "cpu" in fam.backends else f"a {device.type} tensor: {fam.name} needs a CUDA GPU"
    arch = gemm_smallm.current_arch()
    if not fam.supports(arch) or not fam.runs_on(problem, "gpu"):
        return f"no code for {arch}"
    return None
