"""The chat-template shapes of the 2026 families (written for these tests, in the style of the released
tokenizer_config.json templates) rendered by the server's sandboxed Jinja2 against transformers'
apply_chat_template, then through the OpenAI chat route of a server holding a Cohere 2 fixture.

- Command-R / R7B: `<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>...<|END_OF_TURN_TOKEN|>` turns, a default preamble
  when no system message is given, `<|CHATBOT_TOKEN|>` as the generation prompt;
- GLM-4 / 4.5: `[gMASK]<sop>` then `<|system|>` / `<|user|>` / `<|assistant|>` blocks, a `/nothink` suffix and an
  empty `<think></think>` when `enable_thinking` is false, assistant turns with their reasoning stripped;
- Mistral Small 3.x: `[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]`, `[INST]...[/INST]`, roles checked to alternate with
  `raise_exception`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from kobold_backend.engine.chat_template import ChatFormatter, TemplateRenderError
from kobold_backend.engine.tokenizer import load_tokenizer
from tests.test_openai_chat_template import hf_render, with_template

COHERE = """{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}
{%- set preamble = messages[0]['content'] -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set preamble = 'You are a helpful assistant.' -%}{%- set rest = messages -%}{%- endif -%}
<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{{ preamble }}<|END_OF_TURN_TOKEN|>
{%- for m in rest -%}
{%- if m['role'] == 'user' -%}<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{ m['content'] | trim }}<|END_OF_TURN_TOKEN|>
{%- elif m['role'] == 'assistant' -%}
<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{{ m['content'] | trim }}<|END_OF_TURN_TOKEN|>
{%- endif -%}{%- endfor -%}
{%- if add_generation_prompt -%}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{%- endif -%}"""

GLM = """[gMASK]<sop>
{%- macro visible_text(content) -%}{%- if content is string -%}{{- content -}}{%- else -%}
{%- for item in content if item.type == 'text' -%}{{- item.text -}}{%- endfor -%}{%- endif -%}{%- endmacro -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}<|system|>
{{ visible_text(m.content) }}
{%- elif m.role == 'user' %}<|user|>
{% set content = visible_text(m.content) %}{{ content }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not content.endswith('/nothink')) else '' -}}
{%- elif m.role == 'assistant' %}<|assistant|>
{%- set content = visible_text(m.content) -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif %}
<think></think>
{{ content.strip() }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>
{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' }}
{%- endif -%}"""

MISTRAL3 = """{{- bos_token }}{%- if messages[0]['role'] == 'system' -%}
{%- set system_message = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set system_message = 'You are Mistral Small 3, a Large Language Model.' -%}
{%- set loop_messages = messages -%}{%- endif -%}
[SYSTEM_PROMPT]{{ system_message }}[/SYSTEM_PROMPT]
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant.') -}}
{%- endif -%}
{%- if message['role'] == 'user' -%}[INST]{{ message['content'] }}[/INST]
{%- elif message['role'] == 'assistant' -%}{{ message['content'] }}{{ eos_token }}{%- endif -%}
{%- endfor -%}"""

TEMPLATES = {"cohere": COHERE, "glm": GLM, "mistral3": MISTRAL3}
CONVERSATIONS: List[List[Dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there, who are you?"}],
    [{"role": "system", "content": "Be terse & \"kind\"."}, {"role": "user", "content": "  Tell me\nabout it.  "},
     {"role": "assistant", "content": "<think>hm</think>\nIt is small. "},
     {"role": "user", "content": [{"type": "text", "text": "naïve café 漢字 😀"}]}],
]


@pytest.fixture(scope="module")
def folders(spm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_templates_2026")
    return {name: with_template(spm_dir, root / name, t) for name, t in TEMPLATES.items()}


def _messages(name: str, conversation: int) -> List[Dict[str, Any]]:
    messages = CONVERSATIONS[conversation]
    if name != "glm":  # only GLM's template reads content parts
        messages = [dict(m, content=m["content"] if isinstance(m["content"], str) else m["content"][0]["text"])
                    for m in messages]
    return messages


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_family_templates_match_transformers(folders: Dict[str, Path], name: str, conversation: int) -> None:
    folder = folders[name]
    messages = _messages(name, conversation)
    formatter = ChatFormatter(TEMPLATES[name], load_tokenizer(folder), folder)
    text = formatter.render(messages)
    assert text == hf_render(folder, messages, tokenize=False)
    assert formatter.encode(text) == list(hf_render(folder, messages, tokenize=True))


def test_mistral3_alternation_error_reaches_the_caller(folders: Dict[str, Path]) -> None:
    folder = folders["mistral3"]
    formatter = ChatFormatter(MISTRAL3, load_tokenizer(folder), folder)
    with pytest.raises(TemplateRenderError, match="roles must alternate"):
        formatter.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_chat_route_renders_the_model_template(folders: Dict[str, Path], tmp_path: Path) -> None:
    """A Cohere 2 model folder carrying Command-R's template: /v1/chat/completions counts the rendered prompt's
    tokens as transformers tokenizes its own rendering, and /api/v1/model names the architecture."""
    import shutil

    from kobold_backend.server import ServerConfig, create_app
    from tests.fixtures.arch2026_checkpoints import SPEC_BY_NAME, build
    from tests.server_helpers import make_holder

    built = build(SPEC_BY_NAME["cohere2"], tmp_path / "hf")
    config = json.loads((built.path / "tokenizer_config.json").read_text())
    config["chat_template"] = COHERE
    (built.path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    messages = _messages("cohere", 1)
    expected = len(hf_render(built.path, messages, tokenize=True))
    app = create_app(ServerConfig(), make_holder(built.path, context=512))
    try:
        c = app.test_client()
        assert c.get("/api/v1/model").get_json()["architecture"] == "Cohere2ForCausalLM"
        out = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
        assert out.status_code == 200, out.get_data(as_text=True)
        assert out.get_json()["usage"]["prompt_tokens"] == expected
    finally:
        app.extensions["kobold_backend"].close()
        shutil.rmtree(built.path, ignore_errors=True)


def test_image_parts_are_refused_naming_the_vision_tower(tmp_path: Path) -> None:
    """A multimodal checkpoint (Mistral 3) loads its text model; a chat asking for an image is refused in one
    sentence that says why."""
    from kobold_backend.server import ServerConfig, create_app
    from tests.fixtures.arch2026_checkpoints import SPEC_BY_NAME, build
    from tests.server_helpers import make_holder

    built = build(SPEC_BY_NAME["mistral3"], tmp_path / "hf")
    app = create_app(ServerConfig(), make_holder(built.path, context=128))
    try:
        c = app.test_client()
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        out = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, image]}], "max_tokens": 2})
        assert out.status_code == 400
        assert "does not load a vision tower" in out.get_json()["error"]["message"]
        ok = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.get_json()["usage"]["completion_tokens"] == 2
    finally:
        app.extensions["kobold_backend"].close()
