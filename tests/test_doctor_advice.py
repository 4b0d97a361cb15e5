"""`kobold-backend doctor` says which kernels are in use and why, and never advises a step that changes nothing
(issue 35: it advised `install-ext` while the module compiled into the package, which the loader takes first,
made the wheel irrelevant)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import kobold_backend
from kobold_backend import doctor
from kobold_backend.ops import native

PACKAGE = Path(kobold_backend.__file__).resolve().parent
ENTRY = {"wheel": "kobold_backend_ext-0.1.0+cpu-cp311-cp311-manylinux_2_27_x86_64.whl", "version": "0.1.0",
         "variant": "cpu", "modules": {"_ext_cpu": {}}}
CUDA_ENTRY = dict(ENTRY, variant="cu121", modules={"_ext_cpu": {}, "_ext_cuda": {}})


def status(cpu: Dict[str, Any], cuda: Dict[str, Any]) -> Dict[str, Any]:
    return {"cpu": cpu, "cuda": cuda}


IN_PACKAGE = {"path": "prebuilt", "file": str(PACKAGE / "_ext_cpu.so"), "reason": "built into the package"}
FROM_WHEEL = {"path": "prebuilt", "file": "/site-packages/kobold_backend_ext/_ext_cpu.so", "reason": "wheel"}
TORCH = {"path": "torch", "file": None, "reason": "no module"}


def test_a_wheel_the_package_shadows_is_not_advised() -> None:
    advice = doctor._wheel_advice(ENTRY, None, status(IN_PACKAGE, TORCH))
    assert "install-ext" not in advice and "would change nothing" in advice and "CPU kernels" in advice
    # a CUDA wheel still brings the CUDA module the package lacks: then installing it does something
    assert "`kobold-backend install-ext` installs it" in doctor._wheel_advice(CUDA_ENTRY, None,
                                                                             status(IN_PACKAGE, TORCH))


def test_the_wheel_is_advised_only_where_it_replaces_something() -> None:
    assert doctor._wheel_advice(ENTRY, None, status(TORCH, TORCH)) == \
        "`kobold-backend install-ext` installs it in place of torch's own operations"
    assert doctor._wheel_advice(ENTRY, "0.1.0+cpu", status(FROM_WHEEL, TORCH)) == "installed"


def test_in_use_says_where_the_kernels_come_from() -> None:
    assert "compiled into this package" in doctor.in_use_line(IN_PACKAGE)
    assert "prebuilt kernel wheel" in doctor.in_use_line(FROM_WHEEL)
    assert "torch's own operations" in doctor.in_use_line(TORCH)


def test_this_environments_report_advises_no_step_that_changes_nothing() -> None:
    report = doctor.doctor_report()
    info = native.status()
    lines = report.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("CPU kernels: ")))
    assert lines[at + 1] == doctor.in_use_line(info["cpu"])
    if doctor.in_package(info["cpu"]):
        assert "install-ext" not in report
