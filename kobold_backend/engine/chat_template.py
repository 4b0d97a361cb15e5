"""Chat templates: the model's Jinja2 template rendered in a sandbox with the variables and helpers transformers'
apply_chat_template provides, and the rendered text turned into the ids `apply_chat_template(tokenize=True)` gives
(special tokens written by the template are single ids; no BOS is added, since a template that wants one writes
`bos_token` itself). The template is compiled by chat_jinja.py and rendered in a worker process (template_pool.py)
under the sandbox's bounds (template_sandbox.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from kobold_backend.engine.chat_jinja import (  # noqa: F401 (TemplateCompileError, compile_template: for callers)
    TemplateCompileError,
    TemplateRenderError,
    compile_template,
    render,
)
from kobold_backend.engine.template_pool import POOL, RenderFailed
from kobold_backend.engine.tokenizer import Tokenizer


class ChatFormatter:
    """Renders messages with one template and encodes the result for one tokenizer."""

    def __init__(self, source: str, tokenizer: Tokenizer, folder: Optional[Path] = None) -> None:
        self.source = source
        self.template = compile_template(source)
        self.tokenizer = tokenizer
        self.bos_token = tokenizer.bos_token or ""
        self.eos_token = tokenizer.eos_token or ""

    def render(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text: the template with bos_token, eos_token, no tools (what apply_chat_template renders;
        like it, keys whose value is None are dropped from the messages, so `content: null` reads as missing)."""
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                         eos_token=self.eos_token, tools=None, documents=None)
        input_chars = len(str(messages))
        try:
            text = POOL.render(self.source, variables, input_chars)
        except RenderFailed as e:
            raise TemplateRenderError(str(e)) from None
        return render(self.template, variables, input_chars) if text is None else text

    def encode(self, text: str) -> List[int]:
        """Token ids of rendered text: special tokens in it (BOS the template wrote, <|im_start|> ...) are single
        ids, and nothing is added around it."""
        return self.tokenizer.encode(text)
