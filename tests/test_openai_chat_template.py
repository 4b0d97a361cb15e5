"""Chat templates rendered by the server (sandboxed Jinja2) against transformers' apply_chat_template on the fixture
tokenizers: the same text and the same token ids for a Llama-2 [INST] template (sentencepiece), a Llama-3 header
template (byte-level BPE) and a template using HF's helpers; and what the sandbox refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from kobold_backend.engine.chat_template import (
    ChatFormatter,
    TemplateCompileError,
    TemplateRenderError,
    compile_template,
)
from kobold_backend.engine.tokenizer import load_tokenizer
from kobold_backend.errors import ModelFormatError
from tests.fixtures.tokenizer_families import LLAMA2, LLAMA3

# HF's extras: strftime_now, tools=None, namespace, loop controls, tojson without HTML escapes, {% generation %},
# trim_blocks/lstrip_blocks whitespace handling.
HELPERS = """{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
  {%- if m['role'] != 'system' -%}{%- continue -%}{%- endif -%}
  {%- set ns.system = m['content'] -%}{%- break -%}
{%- endfor %}
{{ bos_token }}Year {{ strftime_now('%Y') }}.
{% if tools is not none %}TOOLS {{ tools | length }}{% endif %}
{% if ns.system %}System: {{ ns.system | tojson }}
{% endif %}
{% for m in messages if m['role'] != 'system' %}
    {% if m['role'] == 'assistant' %}
Assistant: {% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}
    {% else %}
User ({{ m.name | default('anon') }}): {{ m['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}Assistant:{% endif %}"""

CONVERSATIONS: List[List[Dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there, who are you?"}],
    [{"role": "system", "content": "You are terse <b>&</b> \"kind\"."},
     {"role": "user", "content": "  Tell me\nabout the licence.  "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"},
     {"role": "assistant", "content": "A small model. "}, {"role": "user", "content": "naïve café 漢字 😀 [INST]"}],
    [{"role": "user", "content": "Hi", "name": None}],
]


def _template(folder: Path) -> Optional[str]:
    """The model's own template, as the engine reads it with the tokenizer."""
    return load_tokenizer(folder).chat_template


def with_template(src: Path, dest: Path, template: str) -> Path:
    """A copy of a fixture tokenizer (or model) folder whose tokenizer_config.json carries `template`."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.fixture(scope="module")
def folders(spm_dir: Path, bpe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_templates")
    return {
        "llama2-spm": with_template(spm_dir, root / "llama2-spm", LLAMA2),
        "llama3-bpe": with_template(bpe_dir, root / "llama3-bpe", LLAMA3),
        "llama3-spm": with_template(spm_dir, root / "llama3-spm", LLAMA3),
        "helpers-spm": with_template(spm_dir, root / "helpers-spm", HELPERS),
        "helpers-bpe": with_template(bpe_dir, root / "helpers-bpe", HELPERS),
    }


def hf_render(folder: Path, messages: List[Dict[str, Any]], tokenize: bool) -> Any:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize, return_dict=False)


@pytest.mark.parametrize("name", ["llama2-spm", "llama3-bpe", "llama3-spm", "helpers-spm", "helpers-bpe"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_text_and_ids_match_transformers(folders: Dict[str, Path], name: str, conversation: int) -> None:
    folder = folders[name]
    messages = CONVERSATIONS[conversation]
    source = _template(folder)
    assert source is not None
    formatter = ChatFormatter(source, load_tokenizer(folder), folder)
    text = formatter.render(messages)
    assert text == hf_render(folder, messages, tokenize=False)
    assert formatter.encode(text) == list(hf_render(folder, messages, tokenize=True))


def test_special_tokens_become_single_ids(folders: Dict[str, Path]) -> None:
    folder = folders["llama2-spm"]
    formatter = ChatFormatter(LLAMA2, load_tokenizer(folder), folder)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    ids = formatter.encode(formatter.render(messages))
    # sentencepiece would read "<s>" as the characters <, s, >; the ids are BOS (1) and EOS (2) instead.
    assert ids.count(1) == 2 and ids.count(2) == 1 and ids[0] == 1


def test_raise_exception_reaches_the_caller(folders: Dict[str, Path]) -> None:
    folder = folders["llama2-spm"]
    formatter = ChatFormatter(LLAMA2, load_tokenizer(folder), folder)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateRenderError, match="Conversation roles must alternate"):
        formatter.render(bad)
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="Conversation roles must alternate"):
        hf_render(folder, bad, tokenize=False)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}{{ cycler.__init__.__globals__ }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ messages|attr('__class__') }}",
])
def test_sandbox_refuses_escapes_and_mutation(spm_dir: Path, template: str) -> None:
    formatter = ChatFormatter(template, load_tokenizer(spm_dir), spm_dir)
    messages = [{"role": "user", "content": "hi"}]
    try:
        out = formatter.render(messages)
    except TemplateRenderError:
        return
    # Jinja's sandbox may also answer an unsafe attribute with an empty undefined instead of raising.
    assert "class" not in out and "function" not in out and messages[0]["role"] == "user"


def test_compile_errors_and_missing_template(spm_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TemplateCompileError, match="line 1"):
        compile_template("{% for m in messages %}")
    assert _template(spm_dir) is None
    # a model's own template that does not compile is a model error at load (422 load_error), not a 500 per chat
    broken = with_template(spm_dir, tmp_path / "broken", "{% for m in messages %}")
    with pytest.raises(ModelFormatError, match="chat template does not compile .*line 1"):
        load_tokenizer(broken)


def test_chat_template_jinja_file_wins(folders: Dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(folders["llama2-spm"], folder)
    (folder / "chat_template.jinja").write_text(LLAMA3)
    assert _template(folder) == LLAMA3
