"""Every environment setting is read in k3tune/settings.py; these pin how each one is parsed."""

from pathlib import Path

from k3tune import settings


def test_kernel_cache_directory_off_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("K3TUNE_KERNEL_CACHE", str(tmp_path))
    assert settings.load().kernel_cache == tmp_path
    monkeypatch.setenv("K3TUNE_KERNEL_CACHE", "OFF")
    assert settings.load().kernel_cache is None
    monkeypatch.delenv("K3TUNE_KERNEL_CACHE")
    assert settings.load().kernel_cache == Path.home() / ".cache" / "k3tune" / "kernels"


def test_flags_and_lists(monkeypatch):
    monkeypatch.setenv("K3TUNE_DEBUG", "yes")
    monkeypatch.setenv("K3TUNE_EXTRA_FAMILIES", " gemm.a, ,gemm.b ")
    s = settings.load()
    assert s.debug and s.extra_families == ("gemm.a", "gemm.b")
    monkeypatch.setenv("K3TUNE_DEBUG", "0")
    s = settings.load()
    assert not s.debug


def test_database_default_is_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("K3TUNE_DB", raising=False)
    monkeypatch.chdir(tmp_path)
    assert settings.load().default_db == str(tmp_path / "k3tune.sqlite")
    monkeypatch.setenv("K3TUNE_DB", "postgresql://u@h/k")
    assert settings.load().default_db == "postgresql://u@h/k"


def test_names_paths_and_urls_lose_the_spaces_and_newline_around_them(monkeypatch, tmp_path):
    """A value read from a file or a config map keeps its newline: K3TUNE_HARDWARE='h200\\n' was an unknown hardware,
    K3TUNE_DB='/x/k.sqlite\\n' a database not found; a blank one is unset."""
    for var, value in (("K3TUNE_DB", "/x/k.sqlite"), ("K3TUNE_HARDWARE", "h200"), ("K3TUNE_ROUTING", "zipf:1.2"),
                       ("K3TUNE_SERVE_DB", "postgresql://u@h/k")):
        monkeypatch.setenv(var, f" {value}\n")
    monkeypatch.setenv("K3TUNE_KERNEL_CACHE", f"{tmp_path}\n")
    s = settings.load()
    assert (s.db, s.hardware, s.routing, s.serve_db) == ("/x/k.sqlite", "h200", "zipf:1.2", "postgresql://u@h/k")
    assert s.kernel_cache == tmp_path
    monkeypatch.setenv("K3TUNE_HARDWARE", "  \n")
    assert settings.load().hardware is None
