"""The sampler settings' other surfaces come from engine/sampler_fields.py alone: the web page's sampler inputs
(rendered into the page at /), the `generate` command's sampler flags and their defaults, and /v1's defaults. A
setting added to the table reaches each of them with no other edit, and the page's own files name none of them."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict

import pytest

from kobold_backend.cli.main import build_parser, generate_request
from kobold_backend.engine import sampler_fields
from kobold_backend.engine.sampler_fields import SAMPLER_FIELDS, SamplerField
from kobold_backend.server import ServerConfig, create_app, openai_schemas, schemas
from kobold_backend.server.engine_holder import EngineHolder

STATIC = Path(__file__).resolve().parent.parent / "kobold_backend" / "server" / "static"
PAGE_OWN = {"max_length", "max_context_length", "sampler_seed"}  # request fields, not sampler settings
ZETA = SamplerField("zeta", "number", 0.0, "A made-up setting.", minimum=0, maximum=2, kobold="zeta",
                    openai_default=0.5, cli=True, page_label="Zeta <z>", page_step=0.1, page_default=1.5)


def page_inputs() -> Dict[str, Dict[str, str]]:
    """The sampler section's inputs of the served page: id -> attributes (and the label before it)."""
    html = create_app(ServerConfig(), EngineHolder()).test_client().get("/").get_data(as_text=True)
    section = html[html.index('id="sampler"'):]
    section = section[:section.index("</div>")]
    out = {}
    for label, attrs in re.findall(r"<label>([^<]*)<input ([^>]*)></label>", section):
        fields = dict(re.findall(r'([\w-]+)="([^"]*)"', attrs))
        fields["label"] = label.strip()
        out[fields["id"]] = fields
    return out


def test_the_page_shows_the_tables_settings_with_their_ranges_and_values() -> None:
    inputs = page_inputs()
    shown = [f for f in SAMPLER_FIELDS if f.page_label]
    assert set(inputs) == PAGE_OWN | {f.kobold for f in shown}
    assert len(shown) >= 10
    for f in shown:
        got = inputs[f.kobold]
        low, high = f.wire_range()
        value = f.wire_default() if f.page_default is sampler_fields.SAME else f.page_default
        assert got["label"] == f.page_label and float(got["value"]) == value
        assert float(got["min"]) == low and (float(got["max"]) if "max" in got else None) == high
        assert (got.get("data-integer") == "1") == (f.kind == "integer")
    # the page KoboldCpp users know: Lite's repetition penalty, KoboldCpp's top-k and temperature
    assert inputs["rep_pen"]["value"] == "1.07" and inputs["top_k"]["value"] == "100"
    assert inputs["temperature"]["value"] == "0.7" and inputs["temperature"]["step"] == "0.05"


def test_the_pages_files_name_no_sampler_setting() -> None:
    script = (STATIC / "app.js").read_text(encoding="utf-8")
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    for f in SAMPLER_FIELDS:
        if f.kobold is not None:
            assert f'"{f.kobold}"' not in script and f'id="{f.kobold}"' not in page, f.kobold


def test_the_cli_flags_and_openai_defaults_are_the_tables() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {a.dest: a.default for a in sub.choices["generate"]._actions if a.dest in sampler_fields.BY_NAME}
    assert flags == {f.name: f.wire_default() for f in SAMPLER_FIELDS if f.cli}
    # one default per setting: the command line's is the KoboldAI API's (top-k was 0 here and 100 there)
    assert flags == {"temperature": 0.7, "top_k": 100, "top_p": 0.92, "rep_pen": 1.0}
    api = schemas.parse_generate({"prompt": "x"})
    assert flags == {name: getattr(api, name) for name in flags}
    params = openai_schemas.parse_completion({"prompt": "x"}).params
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 0, 1.0)
    assert params.rep_pen_range == 320  # KoboldCpp's default where the table gives no OpenAI one


def test_a_new_setting_reaches_the_page_the_cli_and_openai(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_fields, "SAMPLER_FIELDS", SAMPLER_FIELDS + (ZETA,))
    monkeypatch.setitem(sampler_fields.BY_NAME, "zeta", ZETA)
    zeta = page_inputs()["zeta"]
    assert zeta["label"] == "Zeta &lt;z&gt;"
    assert (zeta["min"], zeta["max"], zeta["step"], zeta["value"]) == ("0", "2", "0.1", "1.5")
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.zeta == 0.0  # the KoboldAI API's default (the engine's, which the table gives no other)
    with pytest.raises(TypeError, match="zeta"):  # the flag goes into the engine's settings: a real field
        generate_request(args, SimpleNamespace(encode=lambda text, add_bos: [1]))
    assert build_parser().parse_args(["generate", "--prompt", "x", "--zeta", "1.25"]).zeta == 1.25
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--zeta", "3"])
    assert sampler_fields.openai_defaults()["zeta"] == 0.5
    seen: Dict[str, Any] = {}
    monkeypatch.setattr(openai_schemas, "parse_generate", lambda body: seen.update(body))
    openai_schemas._sampler_params({}, 16)
    assert seen["zeta"] == 0.5 and seen["temperature"] == 1.0
