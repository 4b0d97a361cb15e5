"""The prebuilt kernel wheels: the committed index against its schema and the wheel files (hashes, tags, RECORD,
embedded fingerprints vs the modules themselves), the selection over a table of environments, install-ext into a
fresh venv (then the loader imports kobold_backend_ext and runs an op), and a reproducible CPU wheel build."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import platform
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jsonschema
import pytest
import torch
from packaging import tags as pkg_tags

import kobold_backend
from kobold_backend import cli, wheels
from kobold_backend.ops import native

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "wheels"
INDEX = wheels.load_index(WHEELS / "index.json")
ENTRIES: List[Dict[str, Any]] = INDEX["entries"]
HERE = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _entry_id(entry: Dict[str, Any]) -> str:
    return f"{entry['variant']}-cp{entry['python'].replace('.', '')}"


# ---------------------------------------------------------------------------------------------- the index


def test_index_validates_against_its_schema() -> None:
    schema = json.loads((WHEELS / "index.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(INDEX)


def test_index_covers_the_matrix_for_this_version() -> None:
    have = {(e["variant"], e["python"]) for e in ENTRIES}
    for py in ("3.8", "3.10", "3.11", "3.12"):
        assert ("cpu", py) in have
    assert {("cu130", "3.11"), ("cu130", "3.12")} <= have
    assert all(e["version"] == kobold_backend.__version__ for e in ENTRIES), "rebuild the wheels for this version"
    assert len({e["wheel"] for e in ENTRIES}) == len(ENTRIES)
    listed = {e["wheel"] for e in ENTRIES}
    assert sorted(p.name for p in WHEELS.glob("*.whl")) == sorted(listed), "wheel files not in the index"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.mark.parametrize("entry", ENTRIES, ids=_entry_id)
def test_wheel_file_matches_its_entry(entry: Dict[str, Any]) -> None:
    path = WHEELS / entry["wheel"]
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["size"]
    assert entry["size"] < 4_000_000, "keep committed wheels small (see docs/wheels.md for the arch list)"
    info = wheels.read_wheel(path)
    assert info["name"] == wheels.DIST_NAME and info["version"] == f"{entry['version']}+{entry['variant']}"
    assert info["tags"] == entry["tags"] == wheels.filename_tags(entry["wheel"])
    cp = "cp" + entry["python"].replace(".", "")
    assert all(t.startswith(f"{cp}-{cp}-") and t.endswith(entry["platform"]) for t in entry["tags"])
    assert info["fingerprints"] == entry["modules"]
    suffix = f".cpython-{cp[2:]}-x86_64-linux-gnu.so"
    sos = sorted(n for n in info["files"] if n.startswith(f"{wheels.PACKAGE}/_ext_"))
    assert sos == sorted(f"{wheels.PACKAGE}/{name}{suffix}" for name in entry["modules"])
    for name, fp in entry["modules"].items():
        assert fp["kind"] == name[len("_ext_"):] and fp["version"] == entry["version"]
    if entry["variant"] == "cpu":
        assert entry["cuda"] is None and entry["archs"] == [] and entry["torch_cuda_major"] is None
        assert set(entry["modules"]) == {"_ext_cpu"}
    else:
        cuda = entry["modules"]["_ext_cuda"]
        assert cuda["cuda_version"] == entry["cuda"] and cuda["archs"] == entry["archs"]
        assert entry["variant"] == "cu" + entry["cuda"].replace(".", "")
        assert entry["torch_cuda_major"] == int(entry["cuda"].split(".")[0])
    assert "consistent with the following platform tag" in entry["audit"] and entry["platform"] in entry["audit"]
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        assert len({i.date_time for i in infos}) == 1, "zip timestamps must be fixed"
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = [line.split(",") for line in zf.read(record_name).decode().splitlines()]
        recorded = {r[0]: r[1] for r in rows if r[1]}
        assert set(recorded) == set(zf.namelist()) - {record_name}
        for name, digest in recorded.items():
            assert _record_hash(zf.read(name)) == digest, name


def _sections(elf: bytes) -> List[str]:
    from elftools.elf.elffile import ELFFile  # pyelftools comes with auditwheel

    return [s.name for s in ELFFile(io.BytesIO(elf)).iter_sections()]


@pytest.mark.parametrize("entry", ENTRIES, ids=_entry_id)
def test_modules_are_stripped(entry: Dict[str, Any]) -> None:
    with zipfile.ZipFile(WHEELS / entry["wheel"]) as zf:
        for name in zf.namelist():
            if name.startswith(f"{wheels.PACKAGE}/_ext_"):
                sections = _sections(zf.read(name))
                assert not [s for s in sections if s.startswith(".debug")], name


HERE_ENTRIES = [e for e in ENTRIES if e["python"] == HERE]


@pytest.mark.skipif(not HERE_ENTRIES, reason=f"no wheel for Python {HERE}")
@pytest.mark.parametrize("entry", HERE_ENTRIES, ids=_entry_id)
def test_embedded_fingerprints_match_the_modules(entry: Dict[str, Any], tmp_path: Path) -> None:
    """Import the wheel's modules with this Python (the CUDA module imports without a GPU: cudart is static)."""
    with zipfile.ZipFile(WHEELS / entry["wheel"]) as zf:
        zf.extractall(tmp_path)
    for so in tmp_path.rglob("*.so*"):
        so.chmod(0o755)
    script = (
        "import importlib, json, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "out = {}\n"
        f"for name in {sorted(entry['modules'])!r}:\n"
        "    m = importlib.import_module('kobold_backend_ext.' + name)\n"
        "    out[name] = [m.__file__, m.fingerprint()]\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(tmp_path),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    for name, (file, fp) in found.items():
        assert file.startswith(str(tmp_path)) and fp == entry["modules"][name]


# ---------------------------------------------------------------------------------------------- selection


def linux_env(python: str, torch_version: Optional[str], torch_cuda: Optional[str] = None,
              driver: Optional[int] = None, gpus: Sequence[Tuple[str, Tuple[int, int]]] = (), glibc: int = 36,
              hip: Optional[str] = None) -> Dict[str, Any]:
    """A probe result for CPython `python` on x86_64 Linux with glibc 2.`glibc`, tags as packaging lists them."""
    major, minor = (int(x) for x in python.split("."))
    platforms = [f"manylinux_2_{g}_x86_64" for g in range(glibc, 16, -1)] + ["linux_x86_64"]
    tags = [str(t) for t in pkg_tags.cpython_tags((major, minor), platforms=platforms)]
    return {"python": f"{python}.0", "platform": "linux-x86_64", "tags": tags, "torch": torch_version,
            "torch_cuda": torch_cuda, "torch_hip": hip, "torch_error": None if torch_version else "ModuleNotFoundError",
            "driver_cuda": driver, "gpus": [[n, list(c)] for n, c in gpus]}


def fake_entry(variant: str, python: str, platform_tag: str = "manylinux_2_34_x86_64", torch_range: str = ">=2.1",
               version: str = kobold_backend.__version__) -> Dict[str, Any]:
    cp = "cp" + python.replace(".", "")
    cuda = None if variant == "cpu" else f"{variant[2:-1]}.{variant[-1]}"
    return {"wheel": f"kobold_backend_ext-{version}+{variant}-{cp}-{cp}-{platform_tag}.whl", "version": version,
            "variant": variant, "cuda": cuda, "torch": torch_range, "python": python,
            "torch_cuda_major": int(cuda.split(".")[0]) if cuda else None, "tags": [f"{cp}-{cp}-{platform_tag}"],
            "platform": platform_tag, "archs": ["80", "86", "89", "90+PTX"] if cuda else []}


TABLE_INDEX = [fake_entry(v, p) for p in ("3.8", "3.10", "3.11", "3.12") for v in ("cpu", "cu121")] + [
    fake_entry("cu118", "3.8"), fake_entry("cu130", "3.12"), fake_entry("cu128", "3.12"),
]
H200 = ("NVIDIA H200", (9, 0))
RTX3090 = ("NVIDIA GeForce RTX 3090", (8, 6))
T4 = ("Tesla T4", (7, 5))
RTX5090 = ("NVIDIA GeForce RTX 5090", (12, 0))

SELECTION_TABLE = [
    # (case, env, wheel variant-cp chosen or None, kind, a phrase in the message)
    ("United: Python 3.8, torch 2.1 cu118", linux_env("3.8", "2.1.2+cu118", "11.8", 12020, [RTX3090]),
     "cu118-cp38", "cuda", "CUDA 11.8 modules"),
    ("torch cu118 with an old 11.4 driver (minor-version compatible, SASS for sm_86)",
     linux_env("3.8", "2.1.2+cu118", "11.8", 11040, [RTX3090]), "cu118-cp38", "cuda", "11.4"),
    ("torch cu118 on Python 3.12: no CUDA 11 wheel there", linux_env("3.12", "2.1.2+cu118", "11.8", 11080, [RTX3090]),
     "cpu-cp312", "cpu", "no CUDA 11.x wheel"),
    ("torch cu130 but the driver only supports 12.8", linux_env("3.12", "2.9.0+cu130", "13.0", 12080, [H200]),
     "cpu-cp312", "cpu", "supports CUDA 12.8"),
    ("torch cu128 with a 13.0 driver: the CUDA 12 wheel of torch's major",
     linux_env("3.12", "2.8.0+cu128", "12.8", 13000, [H200]), "cu128-cp312", "cuda", "CUDA 12.8"),
    ("torch cu130 on an H200", linux_env("3.12", "2.9.0+cu130", "13.0", 13000, [H200]), "cu130-cp312", "cuda",
     "sm 80 86 89 90+PTX"),
    ("sm_120 runs the 9.0 PTX", linux_env("3.12", "2.9.0+cu130", "13.0", 13000, [RTX5090]), "cu130-cp312", "cuda",
     "CUDA 13.0"),
    ("a T4 (sm_75) is not in the arch list", linux_env("3.11", "2.5.1+cu121", "12.1", 12040, [T4]), "cpu-cp311",
     "cpu", "sm_75"),
    ("CUDA torch without a driver", linux_env("3.10", "2.5.1+cu121", "12.1", None), "cpu-cp310", "cpu",
     "no NVIDIA driver"),
    ("CPU-only torch", linux_env("3.11", "2.13.0+cpu"), "cpu-cp311", "cpu", "this torch has no CUDA"),
    ("ROCm torch", linux_env("3.10", "2.1.2+rocm5.6", hip="5.6.31061"), "cpu-cp310", "cpu", "no ROCm wheels"),
    ("Python 3.13: no wheel, JIT", linux_env("3.13", "2.6.0+cu124", "12.4", 12040, [RTX3090]), None, "none",
     "compiles its kernels on first use"),
    ("glibc 2.31 (Ubuntu 20.04) refuses manylinux_2_34", linux_env("3.8", "2.1.2+cu118", "11.8", 12020, [RTX3090],
                                                                   glibc=31), None, "none", "platform"),
    ("torch 2.0 is below the range", linux_env("3.10", "2.0.1+cu118", "11.8", 12020, [RTX3090]), None, "none",
     "outside >=2.1"),
    ("torch not installed", linux_env("3.10", None), None, "none", "torch is not importable"),
]


@pytest.mark.parametrize("case,env,chosen,kind,phrase", SELECTION_TABLE, ids=[row[0] for row in SELECTION_TABLE])
def test_selection_table(case: str, env: Dict[str, Any], chosen: Optional[str], kind: str, phrase: str) -> None:
    decision = wheels.select(env, TABLE_INDEX)
    assert (None if decision.entry is None else _entry_id(decision.entry)) == chosen
    assert decision.kind == kind
    message = decision.message()
    assert phrase in message and "\n" not in message
    if chosen is None:
        assert wheels.JIT_HINT in message


def test_selection_needs_the_same_package_version() -> None:
    env = linux_env("3.12", "2.9.0+cu130", "13.0", 13000, [H200])
    decision = wheels.select(env, [fake_entry("cu130", "3.12", version="0.0.9")])
    assert decision.entry is None and "no wheels for kobold_backend" in decision.message()


def test_selection_over_the_committed_index() -> None:
    """United's environment, and this test machine's own (CPU torch): the committed wheels that fit them."""
    united = wheels.select(linux_env("3.8", "2.1.2+cu118", "11.8", 12020, [RTX3090]), ENTRIES)
    cu118 = [e for e in ENTRIES if (e["variant"], e["python"]) == ("cu118", "3.8")]
    assert united.entry == (cu118[0] if cu118 else next(e for e in ENTRIES if _entry_id(e) == "cpu-cp38"))
    h200 = wheels.select(linux_env("3.12", "2.9.0+cu130", "13.0", 13000, [H200]), ENTRIES)
    assert _entry_id(h200.entry) == "cu130-cp312"
    here = wheels.select(wheels.probe_here(), ENTRIES)
    expected = [e for e in ENTRIES if e["python"] == HERE and e["variant"] == "cpu"]
    if torch.version.cuda is None and expected:
        assert here.entry == expected[0] and here.kind == "cpu"


def test_probe_reports_this_interpreter() -> None:
    found = wheels.probe(sys.executable)
    assert found["python"] == platform.python_version() and found["platform"] == sysconfig.get_platform()
    assert found["torch"] == str(torch.__version__) and found["torch_cuda"] == torch.version.cuda
    cp = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    libc, libc_version = platform.libc_ver()
    if sys.platform == "linux" and platform.machine() == "x86_64" and libc == "glibc":
        glibc_minor = int(libc_version.split(".")[1])
        expected = {f"{cp}-{cp}-manylinux_2_{g}_x86_64" for g in range(17, glibc_minor + 1)}
        assert expected | {f"{cp}-{cp}-linux_x86_64"} <= set(found["tags"])
    here = wheels.probe_here()
    assert {k: v for k, v in here.items() if k != "executable"} == {k: v for k, v in found.items() if k != "executable"}


def test_filename_tags_expand_compressed_tag_sets() -> None:
    assert wheels.filename_tags("x-1.0-cp38-cp38-manylinux_2_17_x86_64.manylinux2014_x86_64.whl") == [
        "cp38-cp38-manylinux_2_17_x86_64", "cp38-cp38-manylinux2014_x86_64"]
    with pytest.raises(wheels.WheelError):
        wheels.filename_tags("not-a-wheel.zip")


# ---------------------------------------------------------------------------------------------- install


@pytest.fixture(scope="module")
def target_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv of this Python that sees this environment's packages (torch) after its own site-packages."""
    root = tmp_path_factory.mktemp("target-venv")
    venv.EnvBuilder(with_pip=True).create(root)
    python = root / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(own) / "zz_parent_env.pth").write_text(ours + "\n")
    return python


def _installed_ext(python: Path) -> Optional[str]:
    return wheels.probe(str(python))["installed_ext"]


@pytest.mark.skipif(not any(e["python"] == HERE and e["variant"] == "cpu" for e in ENTRIES),
                    reason=f"no CPU wheel for Python {HERE}")
def test_install_refuses_a_wheel_whose_hash_differs(target_python: Path, tmp_path: Path) -> None:
    index = json.loads((WHEELS / "index.json").read_text())
    entry = next(e for e in index["entries"] if e["python"] == HERE and e["variant"] == "cpu")
    data = bytearray((WHEELS / entry["wheel"]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / entry["wheel"]).write_bytes(bytes(data))
    index["entries"] = [entry]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(wheels.WheelError, match="sha256"):
        wheels.install_ext(str(target_python), say=lambda _: None, index_path=tmp_path / "index.json")
    assert _installed_ext(target_python) is None


@pytest.mark.skipif(not any(e["python"] == HERE and e["variant"] == "cpu" for e in ENTRIES),
                    reason=f"no CPU wheel for Python {HERE}")
def test_install_ext_into_a_venv_then_the_loader_uses_it(target_python: Path) -> None:
    said: List[str] = []
    decision = wheels.install_ext(str(target_python), say=said.append)
    assert decision.installed and decision.kind == "cpu" and decision.entry is not None
    assert _installed_ext(target_python) == f"{decision.entry['version']}+cpu"
    assert any("sha256 verified" in line for line in said)
    # In the venv, with the module built into the package hidden, the loader imports kobold_backend_ext's and runs
    # an op through it (checked against the torch reference).
    script = (
        "import sys, torch\n"
        "sys.modules['kobold_backend._ext_cpu'] = None\n"
        "from kobold_backend.ops import native, reference\n"
        "r = native.load('cpu', mode='prebuilt')\n"
        "x = torch.randn(3, 40, dtype=torch.float64).float(); w = torch.rand(40) + 0.5\n"
        "y = native.CpuKernels(r.module).rms_norm(x, w, 1e-5)\n"
        "torch.testing.assert_close(y, reference.rms_norm(x.double(), w.double(), 1e-5).float())\n"
        "print(r.path, r.module.__name__, r.file)\n"
    )
    proc = subprocess.run([str(target_python), "-c", script], capture_output=True, text=True, cwd=str(ROOT),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    path, name, file = proc.stdout.split()
    assert path == "prebuilt" and name == "kobold_backend_ext._ext_cpu"
    assert str(target_python.parents[1]) in file


def test_install_ext_dry_run_from_the_cli(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["install-ext", "--dry-run", "--python", sys.executable]) == 0
    out = capsys.readouterr().out
    fits = [e for e in ENTRIES if e["python"] == HERE and e["variant"] == "cpu"]
    if fits and torch.version.cuda is None:
        assert fits[0]["wheel"] in out and "Installing" not in out


def test_install_ext_without_an_index_explains_the_jit_path(tmp_path: Path) -> None:
    said: List[str] = []
    decision = wheels.install_ext(sys.executable, say=said.append, index_path=tmp_path / "index.json")
    assert decision.entry is None and not decision.installed
    assert len(said) == 1 and "no wheel index" in said[0] and wheels.JIT_HINT in said[0]


def test_doctor_shows_the_wheel_decision() -> None:
    report = native.doctor_report()
    assert "Prebuilt wheel installed:" in report and "Wheel for this environment:" in report
    fits = [e for e in ENTRIES if e["python"] == HERE and e["variant"] == "cpu"]
    if fits and torch.version.cuda is None:
        assert f"Wheel for this environment: {fits[0]['wheel']}" in report


# ---------------------------------------------------------------------------------------------- reproducibility


@pytest.mark.slow
def test_cpu_wheel_build_is_reproducible(tmp_path: Path) -> None:
    """Two builds of the CPU wheel for this Python (compile, strip, auditwheel repair, zip) are byte-identical.
    They use this environment's pybind11 (the pinned one would be downloaded: nothing is, at test time)."""
    digests = []
    for run in ("a", "b"):
        out = tmp_path / run
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "build_wheels.py"), "--python", sys.executable,
                               "--cpu", "--no-index", "--pybind11", "installed", "--out", str(out)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        (wheel,) = out.glob("*.whl")
        digests.append((wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest()))
    assert digests[0] == digests[1]
    assert "consistent with the following platform tag" in proc.stderr
