"""Backend choice explains itself, and gpukv's kernel cache stays its own."""

import os
import subprocess
import sys

import pytest

from gpukv.core import backend


def test_importing_gpukv_leaves_numba_cache_dir_alone():
    code = "import os, gpukv; print(os.environ.get('NUMBA_CACHE_DIR', '<unset>'))"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "<unset>"


def test_kernel_cache_locator_takes_only_gpukv_sources(tmp_path):
    from numba.core import caching

    backend._install_cache_locator()
    backend._install_cache_locator()  # idempotent
    ours = [c for c in caching.CacheImpl._locator_classes if getattr(c, "gpukv_locator", False)]
    assert len(ours) == 1 and caching.CacheImpl._locator_classes[0] is ours[0]

    def f():
        return 1

    inside = os.path.join(backend._PACKAGE_DIR, "kernels", "tree.py")
    loc = ours[0].from_function(f, inside)
    assert loc is not None and loc.get_cache_path().startswith(backend.CACHE_DIR)
    engine_file = tmp_path / "engine_kernels.py"
    engine_file.write_text("x = 1\n")
    assert ours[0].from_function(f, str(engine_file)) is None


def test_unusable_cuda_names_its_reason():
    if backend.cuda_usable():
        pytest.skip("a usable GPU is present")
    reason = backend.cuda_unusable_reason()
    assert isinstance(reason, str) and reason
    with pytest.raises(backend.BackendError, match="needs a GPU") as e:
        backend.resolve("cuda")
    assert reason in str(e.value)


def test_info_says_why_auto_chose_cpu():
    if backend.cuda_usable():
        pytest.skip("a usable GPU is present")
    env = {k: v for k, v in os.environ.items() if k not in ("GPUKV_BACKEND", "NUMBA_ENABLE_CUDASIM")}
    out = subprocess.run([sys.executable, "-m", "gpukv.cli", "info"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "backend: cpu" in out.stdout
    assert "auto chose cpu:" in out.stdout
    assert "pip install 'gpukv[cuda]'" in out.stdout  # what the cuda backend needs
