"""The prebuilt kernel wheels: the committed index against its schema and the wheel files (hashes, tags, RECORD,
embedded fingerprints vs the modules themselves, the glibc/libstdc++ symbol versions they need), the selection over
a table of environments and over docs/wheels.md's selection table, install-ext into a fresh venv (then the loader
imports kobold_backend_ext and runs an op), and reproducible builds (CPU here; the committed cu130 wheel again with
`-m cuda_rebuild`; install-ext into a fresh venv per Python 3.8-3.13 with `-m wheel_venvs`)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import platform
import re
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
from kobold_backend import wheels
from kobold_backend.cli import main as cli
from kobold_backend.doctor import doctor_report
from kobold_backend.ops import build, native

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


PYTHONS = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13")
# The build matrix (docs/wheels.md, "Committed wheels"): variant -> (Pythons, GPU code).
MATRIX = {
    "cpu": (PYTHONS, []),
    "cu118": (PYTHONS, ["75", "80", "90+PTX"]),
    "cu130": (PYTHONS[2:], ["75", "80", "90", "100", "120+PTX"]),
}
# GPUs every CUDA variant must run compiled code on (sm_86/89 through the sm_80 code: same major, higher minor)
SERVED_BY_EVERY_CUDA_WHEEL = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0)]
WHEELS_FOLDER_LIMIT = 140_000_000  # bytes: the whole wheels/ folder (docs/wheels.md, "Size")


def test_index_covers_the_matrix_for_this_version() -> None:
    have = {(e["variant"], e["python"]): e for e in ENTRIES}
    expected = {(variant, py) for variant, (pythons, _) in MATRIX.items() for py in pythons}
    assert set(have) == expected
    for (variant, _), entry in have.items():
        assert entry["archs"] == MATRIX[variant][1]
        if variant != "cpu":
            assert all(native.arch_supported(cap, entry["archs"]) for cap in SERVED_BY_EVERY_CUDA_WHEEL), variant
    assert all(e["version"] == kobold_backend.__version__ for e in ENTRIES), "rebuild the wheels for this version"
    assert len({e["wheel"] for e in ENTRIES}) == len(ENTRIES)
    listed = {e["wheel"] for e in ENTRIES}
    assert sorted(p.name for p in WHEELS.glob("*.whl")) == sorted(listed), "wheel files not in the index"
    assert sum(p.stat().st_size for p in WHEELS.iterdir()) <= WHEELS_FOLDER_LIMIT


def test_every_wheel_was_built_from_the_landed_sources() -> None:
    """Issue 34: a kernel change lands with its rebuilt wheels. Each entry's `sources` is the digest of what a wheel
    of its kind is built from now (csrc/cpu + include for CPU wheels, all of csrc/ for CUDA wheels, with build.py),
    and each module's fingerprint carries its own kind's digest, which the loader compares at import."""
    digests = {kind: build.sources_digest(kind) for kind in ("cpu", "cuda")}
    stale = []
    for entry in ENTRIES:
        kind = "cuda" if entry["cuda"] else "cpu"
        modules = {name: fp.get("sources") for name, fp in entry["modules"].items()}
        want = {name: digests[fp["kind"]] for name, fp in entry["modules"].items()}
        if entry["sources"] != digests[kind] or modules != want:
            stale.append(entry["wheel"])
    assert not stale, (f"{len(stale)} committed wheels were built from other kernel sources than the landed ones "
                       f"({', '.join(stale[:3])} ...): rebuild them with tools/build_wheels.py (docs/wheels.md)")


def test_no_kernel_needs_hopper_only_instructions() -> None:
    """The matrix has no sm_90a code because no kernel uses wgmma, TMA or setmaxnreg (which only sm_90a has)."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "csrc").rglob("*")) if p.suffix in (".cu", ".cuh", ".h"))
    assert not re.search(r"wgmma|cp\.async\.bulk|setmaxnreg|cuTensorMap|__CUDA_ARCH_FEAT_SM90_ALL", text)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.mark.parametrize("entry", ENTRIES, ids=_entry_id)
def test_wheel_file_matches_its_entry(entry: Dict[str, Any]) -> None:
    path = WHEELS / entry["wheel"]
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["size"]
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
        assert entry["cuda"] is None and entry["archs"] == [] and entry["torch_cuda_majors"] == []
        assert entry["driver_min"] is None and set(entry["modules"]) == {"_ext_cpu"}
    else:
        cuda = entry["modules"]["_ext_cuda"]
        assert cuda["cuda_version"] == entry["cuda"] and cuda["archs"] == entry["archs"]
        assert entry["variant"] == "cu" + entry["cuda"].replace(".", "")
        assert entry["torch_cuda_majors"] == [11, 12, 13] and entry["driver_min"] == wheels.driver_min(entry["cuda"])
    assert "consistent with the following platform tag" in entry["audit"] and entry["platform"] in entry["audit"]
    glibc = re.fullmatch(r"manylinux_2_(\d+)_x86_64", entry["platform"])
    assert glibc and int(glibc.group(1)) <= 31, "built against the glibc 2.31 sysroot (docs/wheels.md)"
    assert entry["toolchain"].startswith("Debian 11 sysroot: libc6=2.31")
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


# What manylinux_2_31 allows (auditwheel's policy; Ubuntu 20.04 has glibc 2.31 and gcc 10's libstdc++).
SYMBOL_LIMITS = {"GLIBC": (2, 31), "GLIBCXX": (3, 4, 28), "CXXABI": (1, 3, 12), "GCC": (7, 0, 0)}


def _version_needs(elf: bytes) -> List[str]:
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    needs = []
    for section in ELFFile(io.BytesIO(elf)).iter_sections():
        if isinstance(section, GNUVerNeedSection):
            for _, auxiliaries in section.iter_versions():
                needs += [aux.name for aux in auxiliaries]
    return needs


@pytest.mark.parametrize("entry", ENTRIES, ids=_entry_id)
def test_shared_objects_need_nothing_newer_than_ubuntu_20_04(entry: Dict[str, Any]) -> None:
    """Every shared object in the wheel (the modules and the grafted libgomp) asks for symbol versions that glibc
    2.31 and gcc 10's libstdc++ have: read from the ELF version-needs tables, independently of auditwheel."""
    with zipfile.ZipFile(WHEELS / entry["wheel"]) as zf:
        objects = [n for n in zf.namelist() if re.search(r"\.so(\.|$)", n)]
        assert any("libgomp" in n for n in objects), "libgomp is grafted"
        for name in objects:
            for need in _version_needs(zf.read(name)):
                match = re.fullmatch(r"(GLIBC|GLIBCXX|CXXABI|GCC)_([\d.]+)", need)
                if match:
                    version = tuple(int(x) for x in match.group(2).split("."))
                    assert version <= SYMBOL_LIMITS[match.group(1)], f"{name} needs {need}"


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


def fake_entry(variant: str, python: str, platform_tag: str = "manylinux_2_31_x86_64", torch_range: str = ">=2.1",
               version: str = kobold_backend.__version__) -> Dict[str, Any]:
    cp = "cp" + python.replace(".", "")
    cuda = None if variant == "cpu" else f"{variant[2:-1]}.{variant[-1]}"
    return {"wheel": f"kobold_backend_ext-{version}+{variant}-{cp}-{cp}-{platform_tag}.whl", "version": version,
            "variant": variant, "cuda": cuda, "torch": torch_range, "python": python,
            "torch_cuda_majors": list(wheels.TORCH_CUDA_MAJORS) if cuda else [],
            "driver_min": wheels.driver_min(cuda) if cuda else None, "tags": [f"{cp}-{cp}-{platform_tag}"],
            "platform": platform_tag, "archs": MATRIX.get(variant, MATRIX["cu130"])[1] if cuda else []}


TABLE_INDEX = [fake_entry(v, p) for p in PYTHONS for v in ("cpu", "cu118")] + [
    fake_entry("cu130", p) for p in PYTHONS[2:]]
H200 = ("NVIDIA H200", (9, 0))
RTX3090 = ("NVIDIA GeForce RTX 3090", (8, 6))
T4 = ("Tesla T4", (7, 5))
V100 = ("Tesla V100", (7, 0))
RTX5090 = ("NVIDIA GeForce RTX 5090", (12, 0))
B200 = ("NVIDIA B200", (10, 0))

SELECTION_TABLE = [
    # (case, env, wheel variant-cp chosen or None, kind, a phrase in the message)
    ("United: Python 3.8, torch 2.1 cu118, driver 535", linux_env("3.8", "2.1.2+cu118", "11.8", 12020, [RTX3090]),
     "cu118-cp38", "cuda", "CUDA 11.8 modules"),
    ("driver 535 + torch cu124 -> the cu118 wheel", linux_env("3.11", "2.4.1+cu124", "12.4", 12020, [RTX3090]),
     "cu118-cp311", "cuda", "needs a driver for CUDA 13.0 (Linux driver >= 580.65.06)"),
    ("driver 580 + torch cu124 -> cu130 is preferred", linux_env("3.11", "2.4.1+cu124", "12.4", 13000, [RTX3090]),
     "cu130-cp311", "cuda", "CUDA 13.0 modules"),
    ("torch cu118 with a 13.0 driver: the module's CUDA need not be torch's",
     linux_env("3.12", "2.3.1+cu118", "11.8", 13000, [H200]), "cu130-cp312", "cuda", "CUDA 13.0"),
    ("Python 3.8 with a 13.0 driver: no cu130 wheel for 3.8", linux_env("3.8", "2.4.1+cu121", "12.1", 13000, [H200]),
     "cu118-cp38", "cuda", "CUDA 11.8"),
    ("sm_75 (T4) -> a wheel that has sm_75", linux_env("3.10", "2.5.1+cu121", "12.1", 12020, [T4]), "cu118-cp310",
     "cuda", "sm 75 80"),
    ("sm_75 with a 13.0 driver", linux_env("3.10", "2.9.0+cu130", "13.0", 13000, [T4]), "cu130-cp310", "cuda",
     "sm 75 80"),
    ("an 11.0 driver (450.80.02) runs the cu118 wheel (minor version compatibility)",
     linux_env("3.9", "2.1.2+cu118", "11.8", 11000, [RTX3090]), "cu118-cp39", "cuda", "CUDA 11.8"),
    ("a 10.2 driver is too old for either", linux_env("3.9", "2.1.2+cu118", "11.8", 10020, [RTX3090]), "cpu-cp39",
     "cpu", "supports CUDA 10.2"),
    ("RTX 5090 (sm_120) with driver 570: cu118's 9.0 PTX", linux_env("3.12", "2.7.0+cu128", "12.8", 12080, [RTX5090]),
     "cu118-cp312", "cuda", "90+PTX"),
    ("B200 (sm_100) with driver 580: cu130's sm_100 SASS", linux_env("3.13", "2.9.0+cu130", "13.0", 13000, [B200]),
     "cu130-cp313", "cuda", "100 120+PTX"),
    ("V100 (sm_70): neither wheel has code for it", linux_env("3.12", "2.5.1+cu124", "12.4", 13000, [V100]),
     "cpu-cp312", "cpu", "sm_70"),
    ("CUDA torch without a driver", linux_env("3.10", "2.5.1+cu121", "12.1", None), "cpu-cp310", "cpu",
     "no NVIDIA driver"),
    ("CPU-only torch", linux_env("3.11", "2.13.0+cpu"), "cpu-cp311", "cpu", "this torch has no CUDA"),
    ("ROCm torch", linux_env("3.10", "2.1.2+rocm5.6", hip="5.6.31061"), "cpu-cp310", "cpu", "no ROCm wheels"),
    ("Python 3.14: no wheel, JIT", linux_env("3.14", "2.9.0+cu130", "13.0", 13000, [H200]), None, "none",
     "compiles its kernels on first use"),
    ("glibc 2.28 (Debian 10) refuses manylinux_2_31", linux_env("3.8", "2.1.2+cu118", "11.8", 12020, [RTX3090],
                                                                glibc=28), None, "none", "platform"),
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


# The CUDA version each Linux driver branch reports (NVIDIA's "CUDA Toolkit and Corresponding Driver Versions",
# written down here from the release notes; docs/wheels.md cites them): (driver, cuDriverGetVersion).
DRIVER_BRANCHES = [(440.33, 10020), (450.80, 11000), (455.23, 11010), (460.27, 11020), (465.19, 11030),
                   (470.42, 11040), (495.29, 11050), (510.39, 11060), (515.43, 11070), (520.61, 11080),
                   (525.60, 12000), (530.30, 12010), (535.54, 12020), (545.23, 12030), (550.54, 12040),
                   (555.42, 12050), (560.28, 12060), (570.26, 12080), (575.51, 12090), (580.65, 13000),
                   (590.44, 13010)]
GPU_NAMES = {"sm_70": V100, "sm_75": T4, "sm_80": ("NVIDIA A100", (8, 0)), "sm_86": RTX3090,
             "sm_89": ("NVIDIA L4", (8, 9)), "sm_90": H200, "sm_100": B200, "sm_120": RTX5090}


def _driver_cuda(driver: float) -> Optional[int]:
    reported = [cuda for number, cuda in DRIVER_BRANCHES if number <= driver]
    return reported[-1] if reported else None


def _drivers(cell: str) -> List[Optional[int]]:
    """'450.80 – 579' -> both ends' reported CUDA versions; '≥ 580' -> 580.65 and a newer branch; 'none'."""
    if cell in ("none", "–"):
        return [None]
    if cell.startswith("≥"):
        low = float(cell[1:].strip())
        return [_driver_cuda(max(low, 580.65)), _driver_cuda(low + 10)]
    if cell.startswith("<"):
        return [_driver_cuda(float(cell[1:].strip()) - 10)]
    low, high = (float(x) for x in cell.split("–"))
    return [_driver_cuda(low), _driver_cuda(high)]


def _pythons(cell: str) -> List[str]:
    low, _, high = cell.partition("–")
    versions = [f"3.{n}" for n in range(8, 15)]
    return versions[versions.index(low.strip()): versions.index((high or low).strip()) + 1]


def docs_selection_rows() -> List[List[str]]:
    """The rows of docs/wheels.md's selection table (between its marker comments)."""
    text = (ROOT / "docs" / "wheels.md").read_text(encoding="utf-8")
    table = text.split("<!-- selection table: start -->")[1].split("<!-- selection table: end -->")[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|")]
    assert rows[0] == ["torch", "torch CUDA", "driver (Linux)", "Python", "glibc", "GPUs", "wheel"]
    return rows[2:]


def _row_id(row: List[str]) -> str:
    return "_".join(row[:5]).replace("–", "-").replace("≥", ">=").replace(" ", "")


@pytest.mark.parametrize("row", docs_selection_rows(), ids=_row_id)
def test_docs_selection_table_is_what_install_ext_does(row: List[str]) -> None:
    """Every row of docs/wheels.md's table, over the committed index: each Python of its range, both ends of its
    driver range and each GPU it names get the wheel the row says."""
    torch_cell, cuda_cell, driver_cell, python_cell, glibc_cell, gpu_cell, wheel_cell = row
    torch_version = torch_cell.split("–")[0].split()[-1] if torch_cell[0].isdigit() else "2.5.1"
    cuda = {"cpu": None, "rocm": None}.get(cuda_cell, f"{cuda_cell[2:-1]}.{cuda_cell[-1]}")
    hip = "6.2.41133" if cuda_cell == "rocm" else None
    local = f"+{cuda_cell}" if cuda_cell != "rocm" else "+rocm6.2"
    gpus = [GPU_NAMES[g] for g in gpu_cell.split()] if gpu_cell != "–" else []
    glibc = int(glibc_cell.split(".")[1])
    for python in _pythons(python_cell):
        for driver in _drivers(driver_cell):
            for gpu in gpus or [None]:
                env = linux_env(python, torch_version + local, cuda, driver, [gpu] if gpu else [], glibc, hip)
                decision = wheels.select(env, ENTRIES)
                got = "none" if decision.entry is None else decision.entry["variant"]
                assert got == wheel_cell.split()[0], (python, driver, gpu, decision.message())
                if decision.entry is not None:
                    assert decision.entry["python"] == python


def test_selection_needs_the_same_package_version() -> None:
    env = linux_env("3.12", "2.9.0+cu130", "13.0", 13000, [H200])
    decision = wheels.select(env, [fake_entry("cu130", "3.12", version="0.0.9")])
    assert decision.entry is None and "no wheels for kobold_backend" in decision.message()


def test_selection_over_the_committed_index() -> None:
    """United's environment, the device's, and this test machine's own (CPU torch): the committed wheels."""
    united = wheels.select(linux_env("3.8", "2.1.2+cu118", "11.8", 12020, [RTX3090]), ENTRIES)
    assert _entry_id(united.entry) == "cu118-cp38"
    h200 = wheels.select(linux_env("3.12", "2.11.0+cu130", "13.0", 13000, [H200]), ENTRIES)
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
    # nothing reached the venv's own site-packages (the parent environment, seen through the .pth file, may have
    # its own kobold_backend_ext from setup)
    own = subprocess.run([str(target_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert not list(Path(own).glob("kobold_backend_ext*"))


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
    report = doctor_report()
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


@pytest.mark.slow
def test_kernel_objects_compile_once_for_every_python(tmp_path: Path) -> None:
    """build_cpu with an objects folder: the second build reuses the kernel objects (only the binding compiles) and
    links the same bytes; tools/build_wheels.py relies on this to compile a toolkit's kernels once."""
    from kobold_backend.ops import build

    objects = tmp_path / "objects"
    objects.mkdir()
    built, logs = [], []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        log: List[str] = []
        built.append(build.build_cpu(tmp_path / run / f"_ext_cpu{build.ext_suffix()}", log=log.append,
                                     objects=objects))
        logs.append(log)
    for kernel in ("ops_cpu.cpp", "ggml_cpu.cpp", "kv_quant_cpu.cpp"):
        assert any(f"compile {kernel}" in line for line in logs[0])
        assert not any(kernel in line for line in logs[1])
    assert any("module_cpu.cpp" in line for line in logs[1])
    assert sorted(p.name.split("-")[0] for p in objects.iterdir()) == ["ggml_cpu", "kv_quant_cpu", "ops_cpu"]
    assert built[0].read_bytes() == built[1].read_bytes()


def _selected(request: pytest.FixtureRequest, marker: str) -> None:
    """Tests behind an explicit marker run only when `-m` names it (they need toolchains or downloads CI lacks)."""
    if marker not in (request.config.option.markexpr or ""):
        pytest.skip(f"run with -m {marker}")


def _cuda13_home() -> Optional[Path]:
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda-13.0", "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            out = subprocess.run([str(Path(home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
            if "release 13.0" in out.stdout:
                return Path(home)
    return None


@pytest.mark.wheel_rebuild
@pytest.mark.parametrize("variant", ["cpu", "cu130"])
def test_committed_wheel_rebuilds_byte_for_byte(variant: str, tmp_path: Path, request: pytest.FixtureRequest
                                                ) -> None:
    """Rebuild this Python's committed wheel with the toolchain it was made with ($KOBOLD_BACKEND_SYSROOT from
    tools/glibc231_sysroot.sh; nvcc 13.0 for cu130): the same sha256. The CUDA build takes 10+ minutes on 2 cores,
    hence the explicit marker: `pytest -m wheel_rebuild tests/test_wheels.py`."""
    _selected(request, "wheel_rebuild")
    sysroot = os.environ.get("KOBOLD_BACKEND_SYSROOT", "")
    if not (Path(sysroot) / "TOOLCHAIN").is_file():
        pytest.skip("set KOBOLD_BACKEND_SYSROOT to a folder made by tools/glibc231_sysroot.sh")
    entry = next(e for e in ENTRIES if (e["variant"], e["python"]) == (variant, HERE))
    cmd = [sys.executable, str(ROOT / "tools" / "build_wheels.py"), "--python", HERE, "--sysroot", sysroot,
           "--no-index", "--out", str(tmp_path)]
    if variant == "cpu":
        cmd.append("--cpu")
    else:
        home = _cuda13_home()
        if home is None:
            pytest.skip("no CUDA 13.0 nvcc")
        cmd += ["--cuda-home", str(home)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert (wheel.name, wheels.sha256_file(wheel)) == (entry["wheel"], entry["sha256"])


@pytest.mark.wheel_venvs
@pytest.mark.parametrize("python", PYTHONS)
def test_install_ext_in_a_fresh_venv_per_python(python: str, request: pytest.FixtureRequest) -> None:
    """tools/wheel_venv_check.py: a fresh venv of that Python with torch from the package index (about 4 GB each,
    hence the explicit marker: `pytest -m wheel_venvs tests/test_wheels.py`), install-ext picks its CPU wheel and
    the loader runs an op from it."""
    _selected(request, "wheel_venvs")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "wheel_venv_check.py"), "--python", python],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0 and f"Python {python}: ok" in proc.stdout, proc.stdout + proc.stderr
