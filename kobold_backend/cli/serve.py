"""`kobold-backend serve`: check the flags, bind the port, load a model (or the demo model), then serve the KoboldAI,
KoboldCpp and OpenAI APIs and the web page with waitress on that socket."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional, Tuple

log = logging.getLogger("kobold_backend.serve")


def _origins(value: str) -> Tuple[str, ...]:
    if value.strip().lower() in ("", "none", "off"):
        return ()
    return tuple(o.strip() for o in value.split(",") if o.strip())


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the CLI's subparsers and return its parser."""
    from kobold_backend.cli.model_args import add_model_arguments
    from kobold_backend.flag_types import existing_dir, existing_file, int_at_least

    p = subparsers.add_parser("serve", help="serve the KoboldAI/KoboldCpp HTTP API and a web page",
                              description="Load a model (or the built-in demo model) and serve KoboldAI's /api/v1 "
                                          "(also /api/latest), KoboldCpp's /api/extra, OpenAI's /v1 and a web page "
                                          "at /. Every flag is checked and the port is bound before the model "
                                          "loads.")
    add_model_arguments(p)
    p.add_argument("--models-dir", type=existing_dir, default=None, metavar="DIR",
                   help="folder of model folders the web page and PUT /api/v1/model may load from (default: none; "
                        "loading over the API is off)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int_at_least(1, 65535), default=5001,
                   help="TCP port, 1-65535 (default: 5001, like KoboldCpp)")
    p.add_argument("--api-key", default=os.environ.get("KOBOLD_BACKEND_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the API (default: $KOBOLD_BACKEND_API_KEY, else "
                        "no key)")
    p.add_argument("--queue", type=int_at_least(0), default=6, metavar="N",
                   help="requests that may wait behind the running one; more get 503 (default: 6)")
    p.add_argument("--cors-origins", type=_origins, default=("*",), metavar="ORIGINS",
                   help="comma-separated origins allowed to call the API from a browser, '*' or none (default: *)")
    p.add_argument("--max-length", type=int_at_least(1), default=180, metavar="N",
                   help="tokens generated when a request gives no max_length (default: 180)")
    p.add_argument("--chat-template", type=existing_file, default=None, metavar="FILE",
                   help="Jinja2 chat template for /v1/chat/completions, used instead of the model's own (default: "
                        "the model's chat_template.jinja or tokenizer_config.json)")
    p.add_argument("--enable-passthrough", action="store_true",
                   help="accept the per-request `passthrough` field: steering, activation capture, LoRA "
                        "(docs/passthrough.md); without it such requests get 403")
    p.add_argument("--vectors-dir", type=existing_dir, default=None, metavar="DIR",
                   help="control-vector files for passthrough `steer` (default: none)")
    p.add_argument("--lora-dir", type=existing_dir, default=None, metavar="DIR",
                   help="PEFT LoRA adapter folders for passthrough `lora` (default: none)")
    p.add_argument("--capture-dir", type=existing_dir, default=None, metavar="DIR",
                   help="folder passthrough `capture` may write safetensors files into (default: none)")
    return p


def _chat_template(path: Optional[Path]) -> Optional[str]:
    """The --chat-template file's source, compiled once to report its errors now (SystemExit 2 when bad)."""
    if path is None:
        return None
    from kobold_backend.engine.chat_template import TemplateCompileError, compile_template

    try:
        source = path.read_text(encoding="utf-8")
        compile_template(source)
    except (OSError, UnicodeDecodeError, TemplateCompileError) as e:
        sys.stderr.write(f"kobold-backend serve: error: argument --chat-template: {path}: {e}\n")
        raise SystemExit(2) from None
    return source


def run_serve(args: argparse.Namespace) -> int:
    """Bind the port, load the model, then serve until interrupted. The flags are checked before the server's
    modules (and torch) are imported."""
    from kobold_backend.cli.model_args import checked_speculation_kwargs

    chat_template = _chat_template(args.chat_template)
    speculation = checked_speculation_kwargs(args)
    from kobold_backend.cli.split import split_from_args
    from kobold_backend.progress import stderr_progress
    from kobold_backend.server.app import create_app
    from kobold_backend.server.auth import is_loopback
    from kobold_backend.server.config import ServerConfig
    from kobold_backend.server.engine_holder import EngineHolder
    from kobold_backend.server.wsgi import AddressUnavailable, WaitressServer, bind_listening_socket

    passthrough = None
    if args.enable_passthrough:
        from kobold_backend.engine.passthrough import PassthroughConfig

        passthrough = PassthroughConfig(vectors_dir=args.vectors_dir, lora_dir=args.lora_dir,
                                        capture_output_dir=args.capture_dir)
    try:
        sock = bind_listening_socket(args.host, args.port)
    except AddressUnavailable as e:
        log.error("%s", e)
        return 1
    try:
        load_kwargs = {"device": args.device, "dtype": args.dtype, "max_seq_len": args.max_context,
                       "embed_on_cpu": args.embed_on_cpu, "rope_alpha": args.rope_alpha,
                       "compress_pos_emb": args.compress_pos_emb, **speculation,
                       "cache_dtype": args.cache_dtype, "threads": args.threads}
        holder = EngineHolder(load_kwargs={k: v for k, v in load_kwargs.items() if v is not None})
        path = args.model
        if path is None:
            from kobold_backend.demo import demo_label, ensure_demo_model

            path = ensure_demo_model(progress=stderr_progress("building demo model"))
            holder.demo_path = Path(path).resolve()
            log.warning("no --model given: serving the built-in demo model from %s. %s", path, demo_label(path))
        layer_devices = split_from_args(args, path, args.max_context)
        active = holder.load(Path(path), progress=stderr_progress("loading"), layer_devices=layer_devices,
                             device=args.device)
    except BaseException:
        sock.close()
        raise
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None,
                          cors_origins=tuple(args.cors_origins), max_queue=args.queue,
                          models_dir=args.models_dir, default_max_length=args.max_length,
                          passthrough=passthrough, chat_template=chat_template)
    if not is_loopback(args.host) and not config.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                    args.host)
    app = create_app(config, holder)
    server = WaitressServer(app, host=args.host, port=args.port, threads=max(4, config.max_queue + 4), sock=sock)
    log.info("model %s ready: context %d tokens", active.name, active.max_context)
    log.info("serving on %s/ (KoboldAI API at %s/api, KoboldCpp extras at %s/api/extra)",
             server.url, server.url, server.url)
    previous = _stop_on_sigterm()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        log.info("stopping: running generations end with their final event")
    finally:
        server.shutdown()
        signal.signal(signal.SIGTERM, previous)
        log.info("stopped")
    return 0


def _stop_on_sigterm() -> Any:
    """SIGTERM (systemd, Docker) stops the server the way Ctrl-C does; returns the handler it replaced."""

    def handler(signum: int, frame: Any) -> None:
        log.info("SIGTERM received")
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)
