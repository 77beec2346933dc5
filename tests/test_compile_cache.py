"""The on-disk compiled-kernel cache: a second process (here: a cleared in-process cache) loads the kernel
the first compiled instead of compiling it; entries are whole files; a corrupt entry is recompiled and
replaced; 'off' disables it; the key changes with the knobs."""

import warnings

import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3TUNE_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def _compile_allreduce():
    from k3tune.kernels import allreduce

    allreduce.compiled.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return allreduce.compiled(2, False, 1e-6, 1, "sm_90a")


def test_a_compiled_kernel_is_loaded_not_recompiled(cache, monkeypatch):
    import cutlass.cute as cute

    first = _compile_allreduce()
    entries = list(cache.glob("allreduce-*.o"))
    assert len(entries) == 1 and entries[0].stat().st_size > 0
    assert not list(cache.glob(".*.tmp")), "no partial entry left behind"

    def no_compile(*a, **k):
        raise AssertionError("compiled again instead of loaded from the cache")

    monkeypatch.setattr(cute, "compile", no_compile)
    loaded = _compile_allreduce()
    assert loaded is not first and callable(loaded)
    assert type(loaded).__name__ == type(first).__name__


def test_a_corrupt_entry_is_recompiled_and_replaced(cache):
    _compile_allreduce()
    (entry,) = cache.glob("allreduce-*.o")
    entry.write_bytes(b"not an object file")
    assert callable(_compile_allreduce())
    assert entry.stat().st_size > 100


def test_off_disables_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3TUNE_KERNEL_CACHE", "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert callable(_compile_allreduce())
    assert not list(tmp_path.rglob("*.o"))


def test_the_key_covers_knobs_and_sources():
    from k3tune.kernels.compile_cache import entry_name

    a = entry_name("allreduce", (2, False), ("k3tune.kernels.allreduce",))
    assert a != entry_name("allreduce", (4, False), ("k3tune.kernels.allreduce",))
    assert a != entry_name("allreduce", (2, False), ("k3tune.kernels.allreduce", "k3tune.kernels.moe_experts"))


def test_install_puts_an_unedited_kernel_module_behind_the_cache(cache, monkeypatch):
    """What a sweep worker does with K3TUNE_WORKER_KERNEL_CACHE=1: the module's own compiled() now writes
    and reads the disk cache, without an edit to the module (whose source keys its shipped winners)."""
    import cutlass.cute as cute

    from k3tune.kernels import l2_prefetch
    from k3tune.kernels.compile_cache import install

    monkeypatch.setattr(l2_prefetch, "compiled", l2_prefetch.compiled)  # restored after the test
    mods = {"k3tune.kernels.l2_prefetch": ("k3tune.kernels.l2_prefetch",)}
    assert install(mods) == ["k3tune.kernels.l2_prefetch"] and install(mods) == ["k3tune.kernels.l2_prefetch"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert callable(l2_prefetch.compiled("sm_90a"))
    assert list(cache.glob("l2_prefetch-*.o"))
    l2_prefetch.compiled.cache_clear()

    def no_compile(*a, **k):
        raise AssertionError("compiled again instead of loaded from the cache")

    monkeypatch.setattr(cute, "compile", no_compile)
    assert callable(l2_prefetch.compiled("sm_90a"))


_RACE = """
import sys, warnings
from k3tune.kernels import allreduce, compile_cache
warnings.simplefilter("ignore", DeprecationWarning)
assert callable(allreduce.compiled(2, False, 1e-6, 1, "sm_90a"))
print(len(compile_cache.COMPILED))
"""


def test_two_processes_asking_for_one_kernel_compile_it_once(cache):
    """Real processes started together: one takes the entry's lock and compiles, the other waits for the
    entry and loads it (the duplicated compiles that held back the 2-GPU sweep)."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _RACE], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(int(o.split()[-1]) for o in outs) == [0, 1], outs
    assert len(list(cache.glob("allreduce-*.o"))) == 1 and not list(cache.glob(".*.tmp"))


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def _lock_holder(cache):
    """A process holding the allreduce test kernel's compile lock (started, and holding it, when this returns)."""
    import subprocess
    import sys

    from k3tune.kernels.compile_cache import entry_name

    name = entry_name("allreduce", (2, False, 1e-6, 1, "sm_90a"), ("k3tune.kernels.allreduce",))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(cache / f".{name}.lock")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_lock_held_by_a_killed_process_is_free_at_once(cache, monkeypatch):
    """A sweep worker killed -9 while compiling (s10-r2: its lock file kept every worker that wanted the
    kernel waiting 2 minutes) holds nothing: the next process takes the lock and compiles without waiting."""
    from k3tune.kernels import compile_cache

    holder = _lock_holder(cache)
    holder.kill()
    holder.wait(timeout=30)
    monkeypatch.setattr(compile_cache, "LOCK_WAIT_S", 1e9)  # were the lock still held, this test would hang
    before = len(compile_cache.COMPILED)
    assert callable(_compile_allreduce())
    assert len(compile_cache.COMPILED) == before + 1


def test_a_lock_held_by_a_live_process_is_waited_for_then_ignored(cache, monkeypatch):
    """A live holder (still compiling) is waited for at most LOCK_WAIT_S, then the kernel is compiled anyway."""
    from k3tune.kernels import compile_cache

    holder = _lock_holder(cache)
    try:
        monkeypatch.setattr(compile_cache, "LOCK_WAIT_S", 0.5)
        before = len(compile_cache.COMPILED)
        assert callable(_compile_allreduce())
        assert len(compile_cache.COMPILED) == before + 1
    finally:
        holder.kill()
        holder.wait(timeout=30)


_LOAD_FARMED = """
import json, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from k3tune.kernels import compile_cache, family
from k3tune.plan.problems import Problem
compile_cache.install()
p = Problem("kda.o_proj", "gemm", (("M", 4), ("N", 7168), ("K", 768)))
for params in json.loads(sys.argv[1]):
    fam = family("gemm.smallm")
    fam.build(p, fam.config_from_params(p, params))
print(len(compile_cache.COMPILED))
"""


def test_the_compile_farm_fills_the_cache_that_workers_load_from(cache, monkeypatch):
    """CPU processes compile a search's queued candidates; a separate process building the same candidates
    (as a GPU worker does) loads every kernel and compiles none."""
    import json
    import subprocess
    import sys

    from k3tune.kernels import family
    from k3tune.plan.problems import Problem
    from k3tune.search.compile_farm import CompileFarm

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    p = Problem("kda.o_proj", "gemm", (("M", 4), ("N", 7168), ("K", 768)))
    fam = family("gemm.smallm")
    params = [c.params() for c in list(fam.configs(p))[:2]]
    with CompileFarm(2, "sm_90a") as farm:
        assert all(farm.submit(p, "gemm.smallm", prm) for prm in params)
        assert not farm.submit(p, "gemm.smallm", params[0]), "a candidate is compiled once"
        assert not farm.submit(p, "gemm.cublas", {}), "nothing to compile for cuBLAS"
        assert farm.wait() == (2, 0)
    assert len(list(cache.glob("gemm_smallm-*.o"))) == 2
    out = subprocess.run([sys.executable, "-c", _LOAD_FARMED, json.dumps(params)], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0", "the worker-side build loaded the farm's kernels"


_LOAD_BLOCK = """
import json, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from k3tune.kernels import compile_cache, family
from k3tune.plan.problems import Problem
compile_cache.install()
op, kind, dims = json.loads(sys.argv[1])
p = Problem(op, kind, tuple(tuple(d) for d in dims))
fam = family("moe.overlap")
fam.prebuild(p, fam.config_from_params(p, json.loads(sys.argv[2])))
print(len(compile_cache.COMPILED))
"""


def test_the_compile_farm_builds_a_blocks_expert_kernels(cache, monkeypatch):
    """A block family is farmed through its prebuild: the farm compiles the two tensor-core expert kernels an
    MXFP4 candidate runs, and a separate process asking for them again (as the worker's executor does) compiles
    none."""
    import json
    import subprocess
    import sys

    from k3tune.kernels import family
    from k3tune.plan.problems import Problem
    from k3tune.search.compile_farm import CompileFarm, farmed

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    dims = (("tp", 16), ("M", 8), ("experts", 896), ("top_k", 16), ("latent", 3584), ("inter", 192),
            ("shared_inter", 384), ("hidden", 7168), ("format", "mxfp4"), ("routing", "uniform"))
    p = Problem("moe.block", "moe_block", dims)
    fam = family("moe.overlap")
    params = {**fam.default(p).params(), "tc13_dq": 1}
    assert farmed("moe.overlap") and not farmed("moe.stock")
    with CompileFarm(1, "sm_90a") as farm:
        assert farm.submit(p, "moe.overlap", params)
        assert farm.wait() == (1, 0)
    assert sorted(f.name.split("-")[0] for f in cache.glob("*.o")) == ["moe_tc_w13", "moe_tc_w2"]
    out = subprocess.run([sys.executable, "-c", _LOAD_BLOCK, json.dumps([p.op, p.kind, dims]), json.dumps(params)],
                         capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0", "the executor-side build loaded the farm's kernels"


def test_the_farm_is_given_every_problems_known_candidates_at_the_start(cache, monkeypatch):
    """A sweep hands the farm each problem's queued candidates (defaults, seeds) before any is opened: the farmed
    families' ones only, each once, and they land in the cache."""
    from k3tune.kernels import families_for
    from k3tune.plan.problems import Problem
    from k3tune.plan.spec import SearchSettings
    from k3tune.search.compile_farm import CompileFarm, farmed
    from k3tune.search.strategy import ProblemSearch

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert farmed("gemm.smallm") and not farmed("gemm.cublas") and not farmed("no.such_family")
    probs = [Problem("kda.o_proj", "gemm", (("M", m), ("N", 7168), ("K", 768))) for m in (1, 2)]
    settings = SearchSettings(budget=6, patience=3)
    queued = [c for p in probs for c in ProblemSearch(p, families_for(p, "gpu"), settings, seed=0).queue]
    built = [c for c in queued if farmed(c.family)]
    assert built and len(built) < len(queued), "the queue holds cuBLAS (not farmed) and CuTe candidates"
    with CompileFarm(0, "sm_90a") as off:
        assert off.submit_known(probs, "gpu", settings, lambda p: []) == 0
    with CompileFarm(2, "sm_90a") as farm:
        assert farm.submit_known(probs, "gpu", settings, lambda p: []) == len(built)
        assert farm.submit_known(probs, "gpu", settings, lambda p: []) == 0, "each candidate once"
        assert farm.wait() == (len(built), 0)
    assert {f.name.split("-")[0] for f in cache.glob("*.o")} == {c.family.replace(".", "_") for c in built}


def test_candidates_wanted_now_overtake_the_known_backlog(cache, monkeypatch):
    """The known candidates of every problem wait in a backlog that feeds the farm only while fewer than
    ``depth`` builds are queued; a candidate wanted now (an open problem's next one) is built at once, ahead of
    them (on 2 H200s, TPE samples queued behind ~1600 known builds held the workers up)."""
    from k3tune.kernels import params_key
    from k3tune.plan.problems import Problem
    from k3tune.plan.spec import SearchSettings
    from k3tune.search.compile_farm import CompileFarm

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    probs = [Problem("kda.o_proj", "gemm", (("M", m), ("N", 7168), ("K", 768))) for m in (1, 2)]
    settings = SearchSettings(budget=6, patience=3)
    with CompileFarm(1, "sm_90a", depth=1) as farm:
        n = farm.submit_known(probs, "gpu", settings, lambda p: [])
        assert n >= 3 and len(farm.futures) == 1 and len(farm.backlog) == n - 1
        last_key = list(farm.backlog)[-1]
        p, fam, params = farm.backlog[last_key]
        assert farm.submit(p, fam, params) and last_key in farm.futures and last_key not in farm.backlog
        assert not farm.submit(p, fam, params), "once"
        assert farm.wait() == (n, 0) and not farm.backlog
    assert last_key == (p.key, fam, params_key(params))


def test_tma_kernels_round_trip_through_the_cache(cache, monkeypatch):
    """The TMA GEMMs (gemm.stream, gemm.wgmma) dump and load like the others (on the CPU: that the loaded kernel
    runs correctly is tests/test_gpu_kernels.py::test_tma_kernels_loaded_from_the_disk_cache, the check before
    the compile farm may build them for the workers)."""
    import cutlass.cute as cute

    from k3tune.kernels import gemm_stream, gemm_wgmma
    from k3tune.kernels.compile_cache import KERNEL_MODULES, install

    monkeypatch.setattr(gemm_stream, "compiled", gemm_stream.compiled)  # restored after the test
    monkeypatch.setattr(gemm_wgmma, "compiled", gemm_wgmma.compiled)
    install({m: KERNEL_MODULES[m] for m in ("k3tune.kernels.gemm_stream", "k3tune.kernels.gemm_wgmma")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        first = (gemm_stream.compiled(3, 6, 8, 7168, 1, "sm_90a", 1), gemm_wgmma.compiled(1, 16, 2, 64, 4, 1, "sm_90a"))
    assert len(list(cache.glob("gemm_stream-*.o"))) == 1 and len(list(cache.glob("gemm_wgmma-*.o"))) == 1
    gemm_stream.compiled.cache_clear()
    gemm_wgmma.compiled.cache_clear()

    def no_compile(*a, **k):
        raise AssertionError("compiled again instead of loaded from the cache")

    monkeypatch.setattr(cute, "compile", no_compile)
    loaded = (gemm_stream.compiled(3, 6, 8, 7168, 1, "sm_90a", 1), gemm_wgmma.compiled(1, 16, 2, 64, 4, 1, "sm_90a"))
    assert all(callable(f) for f in loaded) and all(a is not b for a, b in zip(first, loaded))
