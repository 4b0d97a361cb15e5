"""Builds kobold-backend with its native modules: _ext_cpu (C++ compiler) always, _ext_cuda where nvcc is found.

Metadata is in pyproject.toml; compiler flags are in kobold_backend/ops/build.py (shared with the JIT loader).
Environment: KOBOLD_BACKEND_NO_NATIVE=1 builds the Python package alone (scripts/setup.sh then installs a prebuilt
kernel wheel or compiles the modules itself); KOBOLD_BACKEND_NO_CUDA=1 skips the CUDA module;
KOBOLD_BACKEND_CUDA_ARCH picks its GPU archs (default "8.0 8.6 8.9 9.0+PTX"); MAX_JOBS caps parallel compiles.

The licence is set here, not in pyproject.toml: setuptools >= 77 wants an SPDX expression (`license_expression`,
and warns about the old `license` table), but setuptools 77 needs Python >= 3.9 and Python 3.8 is supported, so
older setuptools get the same text in the old `license` field.
"""

import importlib.util
import os
import shutil
from pathlib import Path

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kb_build", ROOT / "kobold_backend" / "ops" / "build.py")
kb_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb_build)


class BuildNative(build_ext):
    """Builds each module with kobold_backend/ops/build.py instead of distutils' compiler."""

    def build_extension(self, ext: Extension) -> None:
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        if ext.name.endswith(kb_build.CUDA_MODULE):
            try:
                kb_build.build_cuda(out)
            except kb_build.BuildError as exc:
                hint = "Set KOBOLD_BACKEND_NO_CUDA=1 to install without the CUDA module."
                raise kb_build.BuildError(f"{exc}\n{hint}") from exc
        else:
            kb_build.build_cpu(out)


class BuildPyWithSources(build_py):
    """Ships csrc/ as kobold_backend/_csrc so an installed package can still JIT-build its kernels."""

    def run(self) -> None:
        super().run()
        shutil.copytree(ROOT / "csrc", Path(self.build_lib) / "kobold_backend" / "_csrc", dirs_exist_ok=True)


LICENSE = "AGPL-3.0-or-later"
SPDX_METADATA = int(setuptools.__version__.split(".")[0]) >= 77
licence = {"license_expression": LICENSE} if SPDX_METADATA else {"license": LICENSE}

extensions = []
if os.environ.get("KOBOLD_BACKEND_NO_NATIVE", "") != "1":
    extensions.append(Extension(f"kobold_backend.{kb_build.CPU_MODULE}", sources=[]))
    if os.environ.get("KOBOLD_BACKEND_NO_CUDA", "") != "1" and kb_build.find_nvcc():
        extensions.append(Extension(f"kobold_backend.{kb_build.CUDA_MODULE}", sources=[]))

setup(ext_modules=extensions, cmdclass={"build_ext": BuildNative, "build_py": BuildPyWithSources}, **licence)
