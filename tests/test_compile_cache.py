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
