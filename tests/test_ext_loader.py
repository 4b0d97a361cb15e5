"""The extension loader: each forced path, fingerprint and driver/arch checks, atomic JIT builds, and the
CUDA compile check (skipped without nvcc)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import kobold_backend
from kobold_backend import ops
from kobold_backend.doctor import doctor_report
from kobold_backend.errors import ExtensionError
from kobold_backend.ops import build, native

CPU_NAME = "kobold_backend._ext_cpu"


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ext-cache")


@pytest.fixture(scope="module")
def jit_file(jit_cache: Path) -> Path:
    """A JIT build of _ext_cpu made in a private cache (the same build every JIT test reuses)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(native.ENV_CACHE, str(jit_cache))
    try:
        result = native.load("cpu", mode="jit")
    finally:
        mp.undo()
    assert result.path == "jit" and result.file
    return Path(result.file)


@pytest.fixture(autouse=True)
def fresh_slots() -> Any:
    native.reset()
    yield
    native.reset()


def _fake_module(fp: Dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(CPU_NAME)
    module.__file__ = "/nowhere/_ext_cpu.so"
    module.fingerprint = lambda: dict(fp)  # type: ignore[attr-defined]
    return module


def test_jit_path_builds_into_the_cache_and_runs(jit_file: Path, jit_cache: Path) -> None:
    assert jit_file.is_file() and jit_cache in jit_file.parents
    assert not [p for p in jit_cache.iterdir() if p.name.startswith(".")], "temporary build folders left behind"
    module = native._import_file("cpu", jit_file)
    fp = module.fingerprint()
    assert fp["version"] == kobold_backend.__version__ and fp["kind"] == "cpu"
    assert fp["sources"] == build.sources_digest("cpu")
    x = torch.randn(2, 33)
    y = native.CpuKernels(module).rms_norm(x, torch.ones(33), 1e-5)
    torch.testing.assert_close(y, ops.reference.rms_norm(x, torch.ones(33), 1e-5))


def test_jit_reuses_a_finished_build(jit_file: Path, jit_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_CACHE, str(jit_cache))

    def no_compiling(*_: Any, **__: Any) -> None:
        raise AssertionError("a cached build must not be rebuilt")

    monkeypatch.setattr(build, "build_cpu", no_compiling)
    assert native.load("cpu", mode="jit").file == str(jit_file)


def test_prebuilt_path_imports_the_installed_module(jit_file: Path, tmp_path: Path) -> None:
    """In a fresh interpreter (this one already holds an _ext_cpu), a module placed in the package loads."""
    shutil.copy(jit_file, tmp_path / jit_file.name)
    script = (
        "import sys, kobold_backend\n"
        f"kobold_backend.__path__.insert(0, {str(tmp_path)!r})\n"
        "from kobold_backend.ops import native\n"
        "r = native.load('cpu', mode='prebuilt')\n"
        "print(r.path, r.file)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=str(Path(kobold_backend.__file__).parents[1]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["prebuilt", str(tmp_path / jit_file.name)]


def test_a_stale_module_in_the_package_gives_way_to_the_jit_build(jit_file: Path, jit_cache: Path,
                                                                   tmp_path: Path) -> None:
    """Issue 34: a module built from other sources is refused before it is imported (a process keeps the first
    extension module of a name, so an imported stale one would shadow the JIT build), and auto mode then loads the
    JIT build in the same process."""
    digest = build.sources_digest("cpu").encode()
    data = jit_file.read_bytes()
    assert data.count(digest) == 1
    (tmp_path / jit_file.name).write_bytes(data.replace(digest, b"0" * len(digest)))
    script = (
        "import sys, kobold_backend\n"
        f"kobold_backend.__path__.insert(0, {str(tmp_path)!r})\n"
        "from kobold_backend.ops import native\n"
        "r = native.load('cpu', mode='auto')\n"
        "print(r.path, r.file)\n"
        "print(r.problems[0])\n"
    )
    env = dict(os.environ, **{native.ENV_CACHE: str(jit_cache)})
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(Path(kobold_backend.__file__).parents[1]))
    assert proc.returncode == 0, proc.stderr
    first, problem = proc.stdout.splitlines()
    assert first == f"jit {jit_file}"
    assert problem.startswith(f"The prebuilt CPU kernel module {tmp_path / jit_file.name} was built from other "
                              "kernel sources (unknown)") and "kobold-backend install-ext" in problem


def test_torch_path_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_MODE, "torch")
    assert native.cpu_kernels() is None
    x = torch.randn(3, 8)
    assert torch.equal(ops.rms_norm(x, torch.ones(8), 1e-5), ops.reference.rms_norm(x, torch.ones(8), 1e-5))
    info = native.status()
    assert info["mode"] == "torch" and info["cpu"]["path"] == "torch"
    assert "KOBOLD_BACKEND_EXT=torch" in info["cpu"]["reason"]
    assert "CPU kernels: torch" in doctor_report()


def test_bad_mode_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_MODE, "fast")
    with pytest.raises(ExtensionError, match="KOBOLD_BACKEND_EXT='fast' is not one of"):
        native.cpu_kernels()


def test_forced_prebuilt_without_a_module_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    # Neither prebuilt location may import, whichever one setup installed here ("not installed" for both).
    monkeypatch.setitem(sys.modules, CPU_NAME, None)
    monkeypatch.setitem(sys.modules, "kobold_backend_ext._ext_cpu", None)
    with pytest.raises(ExtensionError) as info:
        native.load("cpu", mode="prebuilt")
    message = str(info.value)
    assert "\n" not in message and "pip install ." in message and "no prebuilt" in message


def test_mismatched_fingerprint_forced_raises_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_module({"kind": "cpu", "version": "0.0.0-test", "cuda_version": None, "archs": []})
    monkeypatch.setitem(sys.modules, CPU_NAME, fake)
    with pytest.raises(ExtensionError) as info:
        native.load("cpu", mode="prebuilt")
    message = str(info.value)
    assert "\n" not in message
    assert "0.0.0-test" in message and kobold_backend.__version__ in message and "pip install ." in message
    # the dispatch surfaces the same error in forced mode, on every call
    monkeypatch.setenv(native.ENV_MODE, "prebuilt")
    for _ in range(2):
        with pytest.raises(ExtensionError, match="0.0.0-test"):
            ops.rms_norm(torch.randn(1, 4), torch.ones(4), 1e-5)


def test_mismatched_fingerprint_auto_logs_and_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    fake = _fake_module({"kind": "cpu", "version": "0.0.0-test", "cuda_version": None, "archs": []})
    monkeypatch.setitem(sys.modules, CPU_NAME, fake)
    monkeypatch.setattr(native, "jit_unavailable_reason", lambda kind: "JIT disabled by the test")
    with caplog.at_level(logging.WARNING, logger="kobold_backend.ops.native"):
        result = native.load("cpu", mode="auto")
    assert result.path == "torch" and result.module is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.0.0-test" in warnings[0] and "\n" not in warnings[0]
    assert "JIT disabled by the test" in result.reason


@pytest.mark.parametrize("origin, fix", [("prebuilt", "kobold-backend install-ext"), ("JIT-built", "to rebuild it")])
def test_a_module_built_from_other_sources_is_refused(origin: str, fix: str) -> None:
    """The fingerprint's `sources` digest must be this package's (issue 34): a stale wheel or an old JIT build is
    refused in one sentence naming the fix, not probed for what it can do."""
    fp = {"kind": "cpu", "version": kobold_backend.__version__, "sources": "0123456789abcdef" * 4,
          "cuda_version": None, "archs": []}
    with pytest.raises(ExtensionError) as info:
        native.check_fingerprint(fp, "cpu", origin, "/x.so")
    message = str(info.value)
    assert "built from other kernel sources (0123456789ab)" in message and fix in message and "\n" not in message
    assert build.sources_digest("cpu")[:12] in message
    with pytest.raises(ExtensionError, match="other kernel sources"):
        native.check_fingerprint(dict(CUDA_FP, sources="unknown"), "cuda", origin, "/x.so", 13000, [])
    native.check_fingerprint(dict(fp, sources=build.sources_digest("cpu")), "cpu", origin, "/x.so")


def test_stale_prebuilt_module_falls_back_in_auto_mode(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    fake = _fake_module({"kind": "cpu", "version": kobold_backend.__version__, "sources": "stale",
                         "cuda_version": None, "archs": []})
    monkeypatch.setitem(sys.modules, CPU_NAME, fake)
    monkeypatch.setattr(native, "jit_unavailable_reason", lambda kind: "JIT disabled by the test")
    with caplog.at_level(logging.WARNING, logger="kobold_backend.ops.native"):
        result = native.load("cpu", mode="auto")
    assert result.path == "torch" and "other kernel sources" in result.reason


def test_digest_per_module_kind(tmp_path: Path) -> None:
    """A CUDA-only change leaves the CPU digest (and so the CPU wheels) current; a shared header or a CPU source
    changes both; the digest does not depend on where the sources are."""
    src = tmp_path / "csrc"
    shutil.copytree(build.source_dir(), src)
    cpu, cuda = build.sources_digest("cpu", src), build.sources_digest("cuda", src)
    assert (cpu, cuda) == (build.sources_digest("cpu"), build.sources_digest("cuda")) and cpu != cuda
    (src / "cuda" / "norm.cu").write_text((src / "cuda" / "norm.cu").read_text() + "\n// edited\n")
    assert build.sources_digest("cpu", src) == cpu and build.sources_digest("cuda", src) != cuda
    cuda2 = build.sources_digest("cuda", src)
    (src / "include" / "kb_common.h").write_text((src / "include" / "kb_common.h").read_text() + "\n")
    assert build.sources_digest("cpu", src) != cpu and build.sources_digest("cuda", src) != cuda2
    with pytest.raises(ValueError):
        build.sources_digest("rocm", src)


def test_module_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"_ext_cpu{build.ext_suffix()}").write_bytes(b"not an ELF file")
    monkeypatch.setattr(kobold_backend, "__path__", [str(tmp_path)] + list(kobold_backend.__path__))
    monkeypatch.delitem(sys.modules, CPU_NAME, raising=False)
    with pytest.raises(ExtensionError) as info:
        native.load("cpu", mode="prebuilt")
    message = str(info.value)
    assert "failed to import" in message and "\n" not in message


def test_failed_jit_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "csrc"
    shutil.copytree(build.source_dir(), src)
    (src / "cpu" / "ops_cpu.cpp").write_text("#error deliberately broken\n", encoding="utf-8")
    cache = tmp_path / "cache"
    monkeypatch.setenv(native.ENV_CACHE, str(cache))
    monkeypatch.setattr(build, "source_dir", lambda: src)
    with pytest.raises(ExtensionError) as info:
        native.load("cpu", mode="jit")
    message = str(info.value)
    assert "Compiling the CPU kernels failed" in message and "python -m kobold_backend.ops.build --cpu" in message
    assert "\n" not in message
    assert list(cache.iterdir()) == [], "a failed build left files in the cache"


def test_forced_jit_without_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "find_cxx", lambda: None)
    with pytest.raises(ExtensionError, match="KOBOLD_BACKEND_EXT=jit but no C\\+\\+ compiler"):
        native.load("cpu", mode="jit")


def test_cuda_slot_without_a_gpu_uses_torch() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert native.load("cuda", mode="prebuilt").path == "torch"
    assert native.status()["cuda"]["path"] == "torch"


# ---------------------------------------------------------------------------------------------- CUDA checks


CUDA_FP = {"kind": "cuda", "version": kobold_backend.__version__, "sources": build.sources_digest("cuda"),
           "cuda_version": "13.0", "archs": ["80", "86", "89", "90+PTX"]}


def test_cuda_fingerprint_accepts_a_matching_driver_and_gpu() -> None:
    native.check_fingerprint(CUDA_FP, "cuda", "prebuilt", "/x.so", 13000, [("NVIDIA H200", (9, 0))])
    native.check_fingerprint(CUDA_FP, "cuda", "prebuilt", "/x.so", 13020, [("RTX 5090", (12, 0))])


def test_cuda_fingerprint_rejects_an_old_driver() -> None:
    with pytest.raises(ExtensionError) as info:
        native.check_fingerprint(CUDA_FP, "cuda", "prebuilt", "/x.so", 12040, [("NVIDIA A100", (8, 0))])
    message = str(info.value)
    assert "CUDA 13.0" in message and "CUDA 12.4" in message and "update the driver" in message
    assert "\n" not in message


def test_cuda_fingerprint_rejects_a_gpu_without_code() -> None:
    with pytest.raises(ExtensionError, match=r"sm_75; rebuild it with KOBOLD_BACKEND_CUDA_ARCH=\"7.5\""):
        native.check_fingerprint(CUDA_FP, "cuda", "prebuilt", "/x.so", 13000, [("Tesla T4", (7, 5))])


def test_cuda_fingerprint_rejects_another_version() -> None:
    with pytest.raises(ExtensionError, match="built for kobold_backend 9.9.9"):
        native.check_fingerprint(dict(CUDA_FP, version="9.9.9"), "cuda", "JIT-built", "/x.so", 13000, [])


@pytest.mark.parametrize("cap,archs,ok", [
    ((8, 6), ["80"], True),
    ((8, 9), ["86"], True),
    ((8, 0), ["86"], False),
    ((9, 0), ["80", "86"], False),
    ((12, 0), ["90+PTX"], True),
    ((7, 5), ["80", "90+PTX"], False),
    ((9, 0), ["90a"], True),
    ((10, 0), ["90a"], False),
])
def test_arch_supported(cap: Any, archs: Any, ok: bool) -> None:
    assert native.arch_supported(cap, archs) is ok


def test_parse_archs_and_gencode() -> None:
    archs = build.parse_archs("8.0 8.6 8.9 9.0+PTX")
    assert archs == [("80", False), ("86", False), ("89", False), ("90", True)]
    flags = build.gencode_flags(build.parse_archs("9.0+PTX"))
    assert flags == ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]
    with pytest.raises(build.BuildError):
        build.parse_archs("ampere")


@pytest.mark.slow
@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed")
def test_cuda_sources_compile() -> None:
    """Every .cu file and the binding compile (one arch here; the CI script checks the full default list)."""
    build.check_cuda("9.0", log=lambda message: None)


@pytest.mark.parametrize("package, origin", [("kobold_backend", "built into the kobold_backend package"),
                                             ("kobold_backend_ext", "from the prebuilt wheel kobold_backend_ext")])
def test_doctor_says_where_a_prebuilt_module_comes_from(package: str, origin: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16: "CPU kernels: prebuilt" beside "Prebuilt wheel installed: none" read as a contradiction; the
    kernel line now says whether the module is part of the package or came from the wheel."""
    fake = _fake_module({"kind": "cpu", "version": kobold_backend.__version__, "sources": build.sources_digest("cpu"),
                         "cuda_version": None, "archs": []})
    fake.__name__ = f"{package}._ext_cpu"
    if package == "kobold_backend":
        monkeypatch.setitem(sys.modules, CPU_NAME, fake)
    else:
        monkeypatch.setitem(sys.modules, CPU_NAME, None)  # nothing built into the package
        monkeypatch.setitem(sys.modules, "kobold_backend_ext", types.ModuleType("kobold_backend_ext"))
        monkeypatch.setitem(sys.modules, "kobold_backend_ext._ext_cpu", fake)
    monkeypatch.setenv(native.ENV_MODE, "prebuilt")
    assert native.load("cpu").reason.startswith(origin)
    line = next(x for x in doctor_report().splitlines() if x.startswith("CPU kernels: "))
    assert line.startswith("CPU kernels: prebuilt /nowhere/_ext_cpu.so (") and origin in line
