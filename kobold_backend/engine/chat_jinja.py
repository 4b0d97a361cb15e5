"""The chat-template Jinja2 environment: a template compiled in the bounded sandbox with the helpers transformers'
apply_chat_template provides (trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now, an HTML-safe
tojson, {% generation %}), and rendered with its failures as TemplateRenderError. It imports no tokenizer, so the
tokenizer loader and the template worker process can use it."""

from __future__ import annotations

import functools
import json
import logging
import re
from datetime import datetime
from typing import Any, Dict, Optional

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols

from kobold_backend.engine.template_sandbox import BoundedSandbox, render_bounded
from kobold_backend.errors import ModelFormatError

log = logging.getLogger(__name__)

# Jinja2 releases before 3.1.6 have known sandbox escapes (transformers refuses them for the same reason).
SAFE_JINJA = (3, 1, 6)


# The longest template compiled (real ones are a few tens of kilobytes).
MAX_TEMPLATE_CHARS = 1 << 20


class TemplateCompileError(ModelFormatError):
    """The template is not valid Jinja2 (a fault of the model folder or the configured file): a model error, so a
    load that reads it is refused like any bad model file."""


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
    controls, raise_exception, strftime_now, a tojson that does not escape HTML), with each render's work and
    sizes bounded (template_sandbox.py)."""
    if _jinja_version() < SAFE_JINJA:
        log.warning("Jinja2 %s has known sandbox escapes; install Jinja2 >= 3.1.6 before serving untrusted "
                    "chat templates", jinja2.__version__)
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateCompileError(f"the template has {len(source)} characters (at most {MAX_TEMPLATE_CHARS})")
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateCompileError(f"line {e.lineno}: {e.message}") from None
    except (SyntaxError, RecursionError, MemoryError) as e:  # Python's compiler and Jinja's parser have depth limits
        raise TemplateCompileError(f"the template nests too deeply ({type(e).__name__}: {e})") from None


def render(template: jinja2.Template, variables: Dict[str, Any], input_chars: int) -> str:
    """`template` rendered with `variables` under the sandbox's bounds; TemplateRenderError says why not."""
    try:
        return render_bounded(template, input_chars, variables)
    except jinja2.TemplateError as e:
        raise TemplateRenderError(str(e.message or e)) from None
    except RecursionError:
        raise TemplateRenderError("the chat template recursed too deeply") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, MemoryError) as e:
        raise TemplateRenderError(f"the chat template failed on these messages ({type(e).__name__}: {e})") \
            from None
