"""Property-based fuzzing of the API from its own OpenAPI document (schemathesis), /api and /v1 alike: no input gives
a 500, and every answer has a documented status and matches its documented schema."""

from __future__ import annotations

import shutil
from typing import Any, Dict, List

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from kobold_backend.server import ServerConfig, create_app
from kobold_backend.server.openapi import openapi_document
from tests.server_helpers import make_holder

EXAMPLES = 40
# The fixture model has no chat template of its own; this one lets /v1/chat/completions generate.
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def api_app(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    ckpt = checkpoints.get("dense_fp32")
    models = tmp_path_factory.mktemp("models")
    shutil.copytree(ckpt.path, models / "tiny")
    app = create_app(ServerConfig(models_dir=models, max_content_length=64 * 1024, chat_template=CHAT_TEMPLATE),
                     make_holder(ckpt.path))
    yield app
    app.extensions["kobold_backend"].close()


def cases() -> List[Any]:
    """(operation, mode): every operation with valid inputs; those with a body also with invalid ones."""
    out = []
    for path, ops in openapi_document()["paths"].items():
        for method, op in ops.items():
            name = f"{method.upper()} {path}"
            out.append(pytest.param(name, GenerationMode.POSITIVE, id=f"{name} positive"))
            if "requestBody" in op:
                out.append(pytest.param(name, GenerationMode.NEGATIVE, id=f"{name} negative"))
    return out


@pytest.fixture(scope="module")
def api_schema(api_app: Any) -> Any:
    schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", api_app)
    return {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}


# schemathesis' own pytest plugin does not run under pytest 9, so each operation is driven with hypothesis here.
@pytest.mark.parametrize("operation,mode", cases())
def test_no_server_errors_and_documented_answers(api_schema: Dict[str, Any], operation: str,
                                                 mode: GenerationMode) -> None:
    op = api_schema[operation]

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        if operation == "PUT /api/v1/model" and isinstance(case.body, dict) and case.body.get("model") == "ReadOnly":
            case.body["model"] = "tiny"  # keep a model loaded for the cases that follow
        checks = [not_a_server_error]
        if mode is GenerationMode.POSITIVE:
            checks += [status_code_conformance, response_schema_conformance]
        case.call_and_validate(checks=checks)

    check()
