"""The chat-template renderer's process (`python -m kobold_backend.engine.template_worker MEMORY_BYTES`): it caps its
own address space at what it uses after start-up plus MEMORY_BYTES, lowers its priority, says it is ready, then
answers one JSON line per JSON line on stdin: {"source", "variables", "input_chars"} -> {"text"} or {"error"}
(template_pool.py runs it).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

from kobold_backend.engine.chat_jinja import TemplateCompileError, TemplateRenderError, compile_template, render


def limit_memory(extra_bytes: int) -> None:
    """RLIMIT_AS = the address space in use now + `extra_bytes` (on Linux: elsewhere the render is bounded by the
    sandbox's checks and the pool's time limit only)."""
    try:
        import resource

        with open("/proc/self/statm", encoding="ascii") as fh:
            in_use = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (in_use + extra_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ImportError, OSError, ValueError):
        pass


def answer(request: Dict[str, Any], memory_bytes: int) -> Dict[str, Any]:
    try:
        template = compile_template(request["source"])
        return {"text": render(template, request["variables"], int(request["input_chars"]))}
    except (TemplateCompileError, TemplateRenderError) as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": f"the chat template needed more than {memory_bytes >> 20} MiB of memory"}


def main() -> None:
    memory_bytes = int(sys.argv[1])
    limit_memory(memory_bytes)
    try:
        os.nice(5)
    except (AttributeError, OSError):
        pass
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line), memory_bytes)
        except MemoryError:
            reply = {"error": f"the chat template needed more than {memory_bytes >> 20} MiB of memory"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
