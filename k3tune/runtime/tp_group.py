"""The MoE block's collectives in a real TP group: one process a rank, torch.distributed (NCCL on GPUs; gloo runs the
same code on CPUs, for tests), every rank holding its own shards.

``GroupComm`` is what ``MoEBlock.build(..., comm=GroupComm())`` takes in place of the one-GPU ``EmulatedComm``; the
block's ``ran['collectives']`` then names the backend and the group instead of a stand-in. Sums are taken in fp32
(the routed latent's slot sums are fp32 already; the final all-reduce adds bf16 partials). Gloo takes only host
tensors here: a GPU tensor goes through the host on a gloo group (a correctness path, not a timed one).

Not yet in the MoE block family's key: no block winner has been measured in a real group. The multi-GPU block
measurement that first uses it adds this module to ``MoeOverlap.depends_on``.
"""

from __future__ import annotations

from k3tune.errors import ConfigError


class GroupComm:
    real = True  # every rank holds its own shards: the block's steps differ (k3tune.runtime.moe's module doc)

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("a real TP group needs torch.distributed initialised first (init_process_group)")
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.pdl = False  # no fused stand-ins to launch as dependents
        self.label = f"torch.distributed {self.backend} (tp={self.tp}, rank {self.rank}): real collectives"

    def cycles(self, nbytes: int, ring_factor: float = 2.0) -> int:
        return 0  # no stand-in: the collective takes its own time

    def stand_in_us(self, nbytes: int, ring_factor: float) -> float:
        return 0.0

    def _run(self, fn, t):
        """``fn`` on ``t`` (in place), through the host where gloo cannot take a GPU tensor."""
        if self.backend == "gloo" and t.is_cuda:
            h = t.cpu()
            fn(h)
            t.copy_(h)
        else:
            fn(t)
        return t

    def _sum_(self, t):
        """The group's sum of the fp32 tensor ``t``, in place (``t`` is a temporary of the caller's)."""
        import torch.distributed as dist

        return self._run(lambda h: dist.all_reduce(h, group=self.group), t)

    def all_reduce(self, x):
        """The group's sum of ``x`` (fp32 math), in ``x``'s dtype."""
        import torch

        return self._sum_(x.to(torch.float32, copy=True)).to(x.dtype)

    def all_reduce_add(self, x, base, partial: bool = False):
        """The block's last step: all_reduce(base + x) where ``base`` is this rank's partial (the tuned path's
        row-parallel up-projection), else base + all_reduce(x) (``base`` replicated: the stock path's)."""
        import torch

        if partial:
            return self._sum_(base.float() + x.float()).to(base.dtype)
        return (base.float() + self._sum_(x.to(torch.float32, copy=True))).to(base.dtype)

    def gather(self, t):
        """[tp, *t.shape]: every rank's ``t``, in rank order."""
        import torch
        import torch.distributed as dist

        t = t.contiguous()
        out = torch.empty((self.tp, *t.shape), dtype=t.dtype, device=t.device)

        def into(o):
            src = t.to(o.device)
            if self.backend == "nccl":
                dist.all_gather_into_tensor(o, src, group=self.group)
            else:
                dist.all_gather(list(o.unbind(0)), src, group=self.group)

        return self._run(into, out)

    def all_gather(self, x):
        """[B, n] on each rank -> [B, tp n]: the ranks' columns side by side, in rank order."""
        g = self.gather(x)  # [tp, B, n]
        return g.permute(1, 0, 2).reshape(x.shape[0], -1)

    def replicate(self, t, dim: int):
        """The unsharded weight of which this rank holds shard ``t`` along ``dim`` (ranks in order)."""
        import torch

        return torch.cat(list(self.gather(t).unbind(0)), dim=dim)

    def latent_slice(self, normed):
        """This rank's slice of the normed latent: what its row-parallel up-projection multiplies."""
        n = normed.shape[-1] // self.tp
        return normed[:, self.rank * n:(self.rank + 1) * n].contiguous()
