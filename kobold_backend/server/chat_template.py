"""Chat templates for /v1/chat/completions: the model's Jinja2 template rendered in a sandbox with the variables and
helpers transformers' apply_chat_template provides, and the rendered text turned into token ids."""

from __future__ import annotations

import functools
import json
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

# Jinja2 releases before 3.1.6 have known sandbox escapes (transformers refuses them for the same reason).
SAFE_JINJA = (3, 1, 6)


class TemplateCompileError(Exception):
    """The template is not valid Jinja2 (a fault of the model folder or the configured file)."""


class TemplateRenderError(Exception):
    """The template refused these messages (raise_exception, a sandbox violation or a failing expression)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson, which escapes HTML characters, by plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant text for training masks);
    rendering keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _jinja_version() -> tuple:
    parts = re.findall(r"\d+", jinja2.__version__)[:3]
    return tuple(int(p) for p in parts)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in an immutable sandbox like transformers' (trim_blocks, lstrip_blocks, loop
    controls, raise_exception, strftime_now, a tojson that does not escape HTML)."""
    if _jinja_version() < SAFE_JINJA:
        log.warning("Jinja2 %s has known sandbox escapes; install Jinja2 >= 3.1.6 before serving untrusted "
                    "chat templates", jinja2.__version__)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateCompileError(f"line {e.lineno}: {e.message}") from None


def model_template(folder: Path) -> Optional[str]:
    """The model's own template: `chat_template.jinja` (how recent transformers saves it), else the
    `chat_template` string of tokenizer_config.json; None when it has neither."""
    from kobold_backend.engine.tokenizer import chat_template

    jinja_file = Path(folder) / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return chat_template(folder)


def _config_token(folder: Path, key: str) -> Optional[str]:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get(key)
        except (ValueError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def _token_text(tokenizer: Any, token_id: Optional[int]) -> Optional[str]:
    """The vocabulary string of a (control) token, read from the underlying tokenizer."""
    if token_id is None:
        return None
    sp = getattr(tokenizer, "sp", None)
    if sp is not None:
        return str(sp.IdToPiece(int(token_id)))
    rust = getattr(tokenizer, "tok", None)
    if rust is not None:
        return rust.id_to_token(int(token_id))
    return None


class ChatFormatter:
    """Renders messages with one template and encodes the result for one tokenizer."""

    def __init__(self, source: str, tokenizer: Any, folder: Path) -> None:
        self.template = compile_template(source)
        self.tokenizer = tokenizer
        eos_ids = tuple(getattr(tokenizer, "eos_ids", ()) or ())
        self.bos_token = _config_token(folder, "bos_token") or _token_text(tokenizer, tokenizer.bos_id) or ""
        self.eos_token = (_config_token(folder, "eos_token")
                          or _token_text(tokenizer, eos_ids[0] if eos_ids else None) or "")
        self.specials = self._special_ids(eos_ids)
        self._split = (re.compile("(" + "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
                                  + ")") if self.specials else None)

    def _special_ids(self, eos_ids: tuple) -> Dict[str, int]:
        """bos_token/eos_token text -> id. A sentencepiece tokenizer reads "<s>" as plain text, so these are
        cut out of the rendered prompt and inserted as ids, as transformers does with special tokens."""
        out: Dict[str, int] = {}
        for text, fallback in ((self.bos_token, self.tokenizer.bos_id),
                               (self.eos_token, eos_ids[0] if len(eos_ids) == 1 else None)):
            if not text:
                continue
            ids = self.tokenizer.encode(text, add_bos=False)
            if len(ids) == 1:
                out[text] = int(ids[0])
            elif fallback is not None:
                out[text] = int(fallback)
        return out

    def render(self, messages: List[Dict[str, Any]]) -> str:
        """The prompt text: the template with add_generation_prompt=True, bos_token, eos_token, no tools."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token, tools=None, documents=None)
        except jinja2.TemplateError as e:
            raise TemplateRenderError(str(e.message or e)) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
            raise TemplateRenderError(f"the chat template failed on these messages ({type(e).__name__}: {e})") \
                from None

    def encode(self, text: str) -> List[int]:
        """Token ids of rendered text; BOS/EOS text becomes their ids, no BOS is added (the template writes it)."""
        pieces = self._split.split(text) if self._split is not None else [text]
        ids: List[int] = []
        for piece in pieces:
            if not piece:
                continue
            if piece in self.specials:
                ids.append(self.specials[piece])
            else:
                ids.extend(int(i) for i in self.tokenizer.encode(piece, add_bos=False))
        return ids
