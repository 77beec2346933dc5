"""The MoE block in a real TP group on the CPU: one spawned process a rank (torch.distributed, gloo), every rank
holding its own shards, real collectives (``k3tune.runtime.tp_group.GroupComm``). Every rank's output must match
the TP-free fp32 reference of the model its shards make up, and be the same on every rank. The one-GPU emulation
cannot check this: its ranks all hold the same shards. The GPU case runs the CuTe expert kernels (bf16 and MXFP4) in
two ranks on one GPU over gloo (a correctness run: NCCL takes one GPU a rank, issue 5's multi-GPU work)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from k3tune.errors import ConfigError
from k3tune.runtime.moe import BlockShape, MoEBlock, assemble_full, random_weights, reference, routing_agrees, virtual_full

SMALL = BlockShape(hidden=256, experts=32, top_k=4, latent=128, inter=128, shared_inter=256)
MID = BlockShape(hidden=1024, experts=64, top_k=8, latent=512, inter=512, shared_inter=1024)  # CuTe expert kernels


def _rank(rank: int, world: int, port: int, path: str, fmt: str, device: str = "cpu") -> None:
    import torch.distributed as dist

    from k3tune.runtime import Selector
    from k3tune.runtime.tp_group import GroupComm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shape = SMALL if device == "cpu" else MID
        ranks = [random_weights(shape, world, r, fmt=fmt, device=device, seed=5) for r in range(world)]  # the shards
        comm = GroupComm()
        blk = MoEBlock.build(ranks[rank], path, batch=3, draft=1, comm=comm,
                             selector=Selector.load(None) if path == "tuned" else None)
        if device != "cpu":
            assert blk.ran["experts"].startswith("k3tune "), blk.ran["experts"]  # the CuTe kernels ran, not torch
        x = torch.randn(6, shape.hidden, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16).to(device)
        out = blk(x)
        assert blk.ran["collectives"] == f"torch.distributed gloo (tp={world}, rank {rank}): real collectives"
        full = assemble_full(ranks)
        _, _, biased = reference(x, full, shape)
        assert routing_agrees(blk.last_top, biased, shape)
        ref, _, _ = reference(x, full, shape, top=blk.last_top)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (rank, err)
        # the shards differ, so the emulation's model (every rank holding this one's) is another model
        alone, _, _ = reference(x, virtual_full(ranks[rank]), shape, top=blk.last_top)
        assert ((alone - ref).norm() / ref.norm()).item() > 0.1
        every = comm.gather(out)
        assert all(torch.equal(every[0], o) for o in every), "the ranks' outputs differ"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,path,fmt", [(2, "stock", "bf16"), (2, "tuned", "bf16"), (2, "tuned", "mxfp4"),
                                            (4, "tuned", "bf16")])
def test_block_in_a_real_group_matches_the_model_its_shards_make(world, path, fmt, free_port):
    mp.spawn(_rank, args=(world, free_port, path, fmt), nprocs=world, join=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_cute_block_in_a_real_group_on_one_gpu_matches(fmt, free_port):
    mp.spawn(_rank, args=(2, free_port, "tuned", fmt, "cuda"), nprocs=2, join=True)


def test_assembled_weights_put_each_ranks_shards_in_rank_order():
    ranks = [random_weights(SMALL, 2, r, seed=3) for r in range(2)]
    full = assemble_full(ranks)
    assert torch.equal(full["w_rl"], torch.cat([ranks[0].w_rl, ranks[1].w_rl]).float())
    assert torch.equal(full["w_up"][:, SMALL.latent // 2:], ranks[1].w_up.float())
    w13, w2 = full["expert"](5)
    inter = SMALL.inter // 2
    assert torch.equal(w13[inter:2 * inter], ranks[1].w13[5][:inter].float())  # rank 1's gate rows, after rank 0's
    assert torch.equal(w13[2 * inter + inter:], ranks[1].w13[5][inter:].float())  # its up rows, last
    assert torch.equal(w2[:, :inter], ranks[0].w2[5].float())
    assert torch.equal(ranks[0].bias, ranks[1].bias) and torch.equal(ranks[0].norm, ranks[1].norm)  # replicated
    with pytest.raises(ConfigError, match="1 ranks' weights for tp=2"):
        assemble_full(ranks[:1])


def test_group_collectives_refuse_without_a_process_group_and_a_mismatched_tp():
    from k3tune.runtime.moe import EmulatedComm
    from k3tune.runtime.tp_group import GroupComm

    with pytest.raises(ConfigError, match="init_process_group"):
        GroupComm()
    with pytest.raises(ConfigError, match="collectives are for tp=4, the weights are one rank's of tp=2"):
        MoEBlock.build(random_weights(SMALL, 2), "stock", batch=1, comm=EmulatedComm(4))
    with pytest.raises(ConfigError, match="rank 2 of tp=2"):
        random_weights(SMALL, 2, rank=2)


def test_group_bench_runs_end_to_end_on_cpu_ranks(tmp_path):
    """bench/moe_group.py (the real-group block against its emulation, for a multi-GPU device) in its CPU mode: real
    spawned gloo ranks serving the block at reduced widths, every rank's output the same, the labels saying so."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"hidden_size": 256, "num_experts": 32, "num_experts_per_token": 4,
                               "routed_expert_hidden_size": 128, "moe_intermediate_size": 128,
                               "num_shared_experts": 2}))
    out = tmp_path / "group.json"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "moe_group.py"), "--device", "cpu", "--gpus", "2",
                        "--config", str(cfg), "--batches", "1,3", "--layers", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 3] and all(row["ranks_agree"] for row in rows)
    assert rows[0]["ran"]["collectives"] == "torch.distributed gloo (tp=2, rank 0): real collectives"
    bad = subprocess.run([sys.executable, str(root / "bench" / "moe_group.py"), "--device", "cpu", "--gpus", "1"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode != 0 and "a TP group needs 2 or more ranks" in bad.stderr
