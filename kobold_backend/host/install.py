"""`kobold-backend install-plugin KOBOLDAI_DIR [--python PATH] [--uninstall]`: puts this package into
KoboldAI United's Python environment without changing any package United pins, and writes the plugin's
class.py. A manifest in the plugin folder records what was added, so --uninstall removes exactly that.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.util
import json
import re
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import kobold_backend
from kobold_backend.errors import KoboldBackendError
from kobold_backend.host.settings import PLUGIN_FOLDER
from kobold_backend.host.shim import SHIM_FILENAME, write_shim

DIST_NAME = "kobold-backend"
MANIFEST = "kobold_backend.manifest.json"
HOST_PYTHONS = (
    Path("runtime/envs/koboldai/bin/python"),
    Path("runtime/envs/koboldai/bin/python3"),
    Path("runtime/envs/koboldai/python.exe"),
)
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dll", ".dylib")
SCRIPTS = Path(__file__).resolve().parent / "scripts"  # programs run by path in the host's Python

Say = Callable[[str], None]


class InstallError(KoboldBackendError):
    """install-plugin refused or failed; the message says why and what was left in place."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_koboldai_dir(folder: Path) -> None:
    if not (folder / "aiserver.py").is_file() or not (folder / "modeling" / "inference_models").is_dir():
        raise InstallError(
            f"{folder} is not a KoboldAI United checkout (it needs aiserver.py and modeling/inference_models/)."
        )


def find_host_python(folder: Path, python: Optional[str] = None) -> Path:
    """--python if given, else United's bundled environment (runtime/envs/koboldai)."""
    if python:
        path = Path(python)
        if not path.is_file():
            raise InstallError(f"--python {python} is not a file.")
        return path
    for rel in HOST_PYTHONS:
        if (folder / rel).is_file():
            return folder / rel
    raise InstallError(
        f"No Python found in {folder / 'runtime/envs/koboldai'}; run United's install_requirements first "
        "or pass --python /path/to/python."
    )


def run_python(python: Path, args: Sequence[str], cwd: Optional[Path] = None) -> str:
    """Run the host's Python; raise InstallError with its output when it fails."""
    proc = subprocess.run([str(python), *args], cwd=str(cwd) if cwd else None, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise InstallError(f"{python} {' '.join(args[:3])} ... failed (exit {proc.returncode}):\n{proc.stdout}")
    return proc.stdout


def pip(python: Path, args: Sequence[str], cwd: Path) -> str:
    return run_python(python, ["-m", "pip", "--disable-pip-version-check", "--no-input", *args], cwd)


def freeze(python: Path, cwd: Path) -> Dict[str, str]:
    """The host's installed packages as seen from its folder `cwd`: normalized name -> version."""
    found = json.loads(run_python(python, [str(SCRIPTS / "installed_versions.py")], cwd))
    return {normalize(name): version for name, version in found.items()}


def project_requirements() -> List[str]:
    """This package's runtime requirements: from its installed metadata, else from the source tree's
    pyproject.toml."""
    from importlib import metadata

    try:
        requires = metadata.requires(DIST_NAME)
    except metadata.PackageNotFoundError:
        requires = None
    if requires is not None:
        return [r for r in requires if "extra ==" not in r]
    pyproject = Path(kobold_backend.__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        raise InstallError("kobold-backend is neither installed with metadata nor run from its source tree.")
    try:
        import tomllib as toml  # novermin (guarded: tomli below on 3.8-3.10)
    except ImportError:
        try:
            import tomli as toml  # type: ignore[no-redef]
        except ImportError:
            raise InstallError(
                "Reading pyproject.toml needs Python 3.11+ or the tomli package (pip install tomli)."
            ) from None
    data = toml.loads(pyproject.read_text(encoding="utf-8"))
    return list(data["project"]["dependencies"])


def plan_dependencies(python: Path, requirements: Sequence[str], cwd: Path) -> Dict[str, Any]:
    proc = subprocess.run([str(python), str(SCRIPTS / "requirement_plan.py")], input=json.dumps(list(requirements)),
                          cwd=str(cwd), capture_output=True, text=True)
    if proc.returncode != 0:
        raise InstallError(f"Could not inspect the host's packages with {python}:\n{proc.stderr}")
    return json.loads(proc.stdout)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(dest: Path, requirements: Sequence[str]) -> Path:
    """A pure-Python wheel of the running kobold_backend package (compiled extensions are left out; they
    come from the prebuilt-wheel index or the JIT build). No build backend or network is needed."""
    package = Path(kobold_backend.__file__).resolve().parent
    version = kobold_backend.__version__
    dist_info = f"kobold_backend-{version}.dist-info"
    files: Dict[str, bytes] = {}
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and not path.name.endswith(SKIPPED_SUFFIXES):
            files["kobold_backend/" + path.relative_to(package).as_posix()] = path.read_bytes()
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {DIST_NAME}",
        f"Version: {version}",
        "Summary: LLM inference engine for KoboldAI frontends (installed by install-plugin)",
        "Requires-Python: >=3.8",
        *(f"Requires-Dist: {r}" for r in requirements),
    ]
    files[f"{dist_info}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: kobold-backend install-plugin\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{dist_info}/entry_points.txt"] = b"[console_scripts]\nkobold-backend = kobold_backend.cli.main:main\n"
    record = [f"{name},{_record_hash(data)},{len(data)}" for name, data in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = dest / f"kobold_backend-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # same files, same wheel
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)
    return wheel


def read_manifest(plugin_dir: Path) -> Optional[Dict[str, Any]]:
    path = plugin_dir / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def write_manifest(plugin_dir: Path, manifest: Dict[str, Any]) -> None:
    plugin_dir.mkdir(parents=True, exist_ok=True)
    (plugin_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")


def changed_pins(pins: Dict[str, str], now: Dict[str, str]) -> List[str]:
    return [f"{name} {version} -> {now.get(name, 'removed')}" for name, version in sorted(pins.items())
            if now.get(name) != version]


def verify_shim(python: Path, koboldai_dir: Path, model: Optional[Path]) -> Dict[str, Any]:
    """Import class.py with the host's Python the way United does and call is_valid on `model`."""
    args = [str(SCRIPTS / "import_shim.py"), PLUGIN_FOLDER]
    if model is not None:
        args.append(str(Path(model).resolve()))
    output = run_python(python, args, cwd=koboldai_dir)
    lines = [line for line in output.splitlines() if line.startswith("KOBOLD_BACKEND_VERIFY ")]
    if not lines:
        raise InstallError(f"The plugin check printed no result:\n{output}")
    return json.loads(lines[-1].split(" ", 1)[1])


def install_extension(python: Path, koboldai_dir: Path, say: Say) -> List[str]:
    """Prebuilt kernels through kobold_backend.wheels when that module exists; returns the packages it added."""
    if importlib.util.find_spec("kobold_backend.wheels") is None:
        say("No prebuilt-kernel installer in this build: the engine compiles its CUDA kernels on first use "
            "(JIT, needs a CUDA toolkit) and otherwise runs its torch reference ops.")
        return []
    before = freeze(python, koboldai_dir)
    importlib.import_module("kobold_backend.wheels").install_ext(str(python))
    return sorted(set(freeze(python, koboldai_dir)) - set(before))


def install(
    koboldai_dir: Path,
    python: Optional[str] = None,
    verify_model: Optional[Path] = None,
    pip_args: Sequence[str] = (),
    requirements: Optional[Sequence[str]] = None,
    say: Say = print,
) -> Dict[str, Any]:
    """Install (or reinstall) the plugin; returns the manifest. Never changes a package the host had."""
    koboldai_dir = Path(koboldai_dir).resolve()
    check_koboldai_dir(koboldai_dir)
    host = find_host_python(koboldai_dir, python)
    plugin_dir = koboldai_dir / "modeling" / "inference_models" / PLUGIN_FOLDER
    previous = read_manifest(plugin_dir) or {}
    ours = {normalize(DIST_NAME)} | set(previous.get("packages", []))
    before = freeze(host, koboldai_dir)
    pins = previous.get("host_pins") or {name: v for name, v in before.items() if name not in ours}
    say(f"Host Python: {host} ({len(pins)} pinned packages recorded)")
    reqs = list(project_requirements() if requirements is None else requirements)
    plan = plan_dependencies(host, reqs, koboldai_dir)
    if plan["conflicts"]:
        raise InstallError("Refusing to change the host's pinned packages:\n  " + "\n  ".join(plan["conflicts"]))
    manifest: Dict[str, Any] = {
        "plugin": PLUGIN_FOLDER, "version": kobold_backend.__version__, "python": str(host),
        "host_pins": pins, "packages": sorted(set(previous.get("packages", [])) | {normalize(DIST_NAME)}),
        "files": [SHIM_FILENAME, MANIFEST], "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_manifest(plugin_dir, manifest)
    if plan["missing"]:
        say("Installing missing dependencies: " + ", ".join(plan["missing"]))
        with tempfile.TemporaryDirectory() as tmp:
            constraints = Path(tmp) / "host-pins.txt"
            constraints.write_text("".join(f"{name}=={version}\n" for name, version in before.items()))
            pip(host, ["install", "-c", str(constraints), *pip_args, *plan["missing"]], koboldai_dir)
        after_deps = freeze(host, koboldai_dir)
        manifest["packages"] = sorted(set(manifest["packages"]) | (set(after_deps) - set(before)))
        write_manifest(plugin_dir, manifest)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp), reqs)
        say(f"Installing {wheel.name} into the host (--no-deps)")
        pip(host, ["install", "--no-deps", "--force-reinstall", *pip_args, str(wheel)], koboldai_dir)
    manifest["packages"] = sorted(set(manifest["packages"]) | set(install_extension(host, koboldai_dir, say)))
    write_manifest(plugin_dir, manifest)
    shim = write_shim(plugin_dir, kobold_backend.__version__)
    say(f"Wrote {shim}")
    result = verify_shim(host, koboldai_dir, verify_model)
    if result["disable"]:
        raise InstallError(f"The plugin imports but is disabled in the host: {result['reason']}")
    if verify_model is not None and not result.get("is_valid"):
        raise InstallError(f"The plugin loaded but is_valid() refused the check model {verify_model}.")
    changed = changed_pins(pins, freeze(host, koboldai_dir))
    if changed:
        raise InstallError("The host's pinned packages changed: " + "; ".join(changed))
    manifest["verified"] = result
    write_manifest(plugin_dir, manifest)
    say(f"Installed: United will list the backend {result['name']!r} after a restart.")
    return manifest


def uninstall(koboldai_dir: Path, python: Optional[str] = None, say: Say = print) -> bool:
    """Remove what the manifest says install added; returns False when nothing was installed."""
    koboldai_dir = Path(koboldai_dir).resolve()
    check_koboldai_dir(koboldai_dir)
    plugin_dir = koboldai_dir / "modeling" / "inference_models" / PLUGIN_FOLDER
    manifest = read_manifest(plugin_dir)
    if manifest is None:
        say(f"kobold_backend is not installed in {koboldai_dir} (no {MANIFEST}); nothing to do.")
        return False
    host = Path(python) if python else Path(manifest["python"])
    if not host.is_file():
        host = find_host_python(koboldai_dir, python)
    present = freeze(host, koboldai_dir)
    packages = [name for name in manifest["packages"] if name in present]
    if packages:
        say("Uninstalling " + ", ".join(packages))
        pip(host, ["uninstall", "-y", *packages], koboldai_dir)
    for name in manifest["files"]:
        (plugin_dir / name).unlink(missing_ok=True)
    cache = plugin_dir / "__pycache__"
    if cache.is_dir():
        for item in cache.iterdir():
            if item.name.startswith(Path(SHIM_FILENAME).stem + "."):
                item.unlink()
        if not any(cache.iterdir()):
            cache.rmdir()
    if plugin_dir.is_dir() and not any(plugin_dir.iterdir()):
        plugin_dir.rmdir()
    changed = changed_pins(manifest["host_pins"], freeze(host, koboldai_dir))
    if changed:
        raise InstallError("The host's pinned packages differ from before the install: " + "; ".join(changed))
    say(f"Uninstalled kobold_backend from {koboldai_dir}.")
    return True


def add_install_plugin_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "install-plugin", help="install the KoboldAI United backend plugin into a KoboldAI checkout",
        description="Install this package into KoboldAI United's Python without changing its pinned packages "
                    "and write modeling/inference_models/kobold_backend/class.py (or remove both).",
    )
    p.add_argument("koboldai_dir", metavar="KOBOLDAI_DIR", help="the KoboldAI United folder (holds aiserver.py)")
    p.add_argument("--python", help="the host's Python (default: KOBOLDAI_DIR/runtime/envs/koboldai/bin/python)")
    p.add_argument("--uninstall", action="store_true", help="remove exactly what install-plugin added")
    p.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the host's pip install, e.g. --pip-arg=--no-index (repeatable)")
    p.add_argument("--no-check-model", action="store_true",
                   help="skip building the demo model for the post-install is_valid check")
    return p


def run_install_plugin(args: argparse.Namespace) -> int:
    folder = Path(args.koboldai_dir)
    if args.uninstall:
        uninstall(folder, args.python)
        return 0
    check_koboldai_dir(folder.resolve())
    model = None
    if not args.no_check_model:
        from kobold_backend.demo import ensure_demo_model

        model = Path(ensure_demo_model())
    install(folder, args.python, verify_model=model, pip_args=args.pip_arg)
    return 0
