"""The fused one-shot all-reduce + residual (+ RMSNorm) kernel on a real TP group: one spawned process per
GPU, symmetric-memory buffers, NVLS off; every rank's result checked against an fp32 reference of the
all-gathered partial sums, outputs poisoned first, odd row counts, and results identical on every rank.
Needs two or more GPUs (skipped otherwise). Run on the device: pytest -m gpu tests/test_gpu_allreduce.py"""

import os

import pytest

pytestmark = pytest.mark.gpu


def _rank(rank: int, world: int, port: int, failures):
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from k3tune.kernels import allreduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    try:
        for m, n, norm in [(1, 7168, False), (3, 7168, True), (17, 136, True), (64, 7168, False)]:
            buf = symm_mem.empty((m, n), dtype=torch.bfloat16, device=dev)
            hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
            g = torch.Generator(device=dev).manual_seed(100 * rank + m)
            buf.copy_(torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16))
            res = torch.randn(m, n, device=dev, generator=torch.Generator(device=dev).manual_seed(m)).to(torch.bfloat16)
            w = (1 + 0.1 * torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(7)))
            w = w.to(torch.bfloat16)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
            normed = torch.full_like(out, float("nan"))
            peers = [hdl.get_buffer(r, (m, n), torch.bfloat16) for r in range(world)]
            hdl.barrier(channel=0)
            allreduce.one_shot(peers, res, out, w if norm else None, normed if norm else None)
            hdl.barrier(channel=0)  # nobody frees or rewrites its buffer while a peer still reads it
            parts = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(world)]
            dist.all_gather(parts, buf)
            ref = res.float() + sum(p.float() for p in parts)
            assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2, (m, n)
            if norm:
                ref_n = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
                assert ((normed.float() - ref_n).norm() / ref_n.norm()).item() < 1e-2, (m, n)
            outs = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(outs, out)
            assert all(torch.equal(o, outs[0]) for o in outs), "every rank must hold the same result"
    except Exception as e:  # reported to the parent: an assertion in a child would only show as an exit code
        failures[rank] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def test_one_shot_allreduce_on_a_tp_group():
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs 2 or more GPUs (a multi-GPU device kind)")
    with mp.Manager() as mgr:
        failures = mgr.dict()
        mp.spawn(_rank, args=(world, 29531, failures), nprocs=world, join=True)
        assert not dict(failures), dict(failures)


def test_sweep_tunes_the_allreduce_on_the_group_and_records_group_keyed_winners(tmp_path):
    """`k3tune sweep --gpus 2` on the 2-GPU all-reduce spec: every variant of every batch measured on the group
    (correctness first), one winner per problem, each problem keyed by its group size."""
    import torch

    from k3tune.plan import model, spec
    from k3tune.search.driver import SweepOptions, run_sweep
    from k3tune.shipped import configs_dir
    from k3tune.store.db import Database
    from k3tune.store.models import ProblemRow, Trial, Winner

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 or more GPUs (a multi-GPU device kind)")
    sp = spec.load(configs_dir() / "sweep_h200x2_allreduce.toml")
    db = Database(tmp_path / "coll.sqlite")
    st = run_sweep(SweepOptions(sp, model.load(), db, "gpu", 2))
    assert st.problems_done == 7 and not st.no_winner, st
    with db.session() as s:
        keys = {p.id: p.key for p in s.query(ProblemRow)}
        trials = s.query(Trial).all()
        winners = s.query(Winner).all()
    assert len(trials) == 7 * 4 and all(t.status.value == "ok" for t in trials), [
        (keys[t.problem_id], t.params, t.error) for t in trials if t.status.value != "ok"]
    assert len(winners) == 7 and all("group=2" in keys[w.problem_id] for w in winners)
    assert {w.family for w in winners} == {"tp.allreduce"}
    assert all(w.ties == [] for w in winners)  # a list like every winner's (until s70 the integer 0)
