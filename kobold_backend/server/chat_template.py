"""The chat-template renderer lives in the engine (rendering a model's template is model knowledge); the server's
routes and `--chat-template` use it through these names."""

from kobold_backend.engine.chat_template import (
    SAFE_JINJA,
    ChatFormatter,
    TemplateCompileError,
    TemplateRenderError,
    compile_template,
    model_template,
)

__all__ = ["SAFE_JINJA", "ChatFormatter", "TemplateCompileError", "TemplateRenderError", "compile_template",
           "model_template"]
