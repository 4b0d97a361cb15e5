"""Coverage-guided fuzzing of one model-file parser with atheris (libFuzzer), by hand: the same seeds and targets as
tests/test_fuzz_parsers.py, the engine's modules instrumented, any exception other than the engine's error type a
crash, a parse over 2 s a timeout, and resident memory capped.

    pip install atheris            # manylinux wheels for CPython 3.8-3.11 (not in the test extra)
    python tools/fuzz_parsers.py gguf -max_total_time=300
    python tools/fuzz_parsers.py all -max_total_time=120   # each parser in turn, in its own process

Parsers: gguf, safetensors, exl2, config, tokenizer_json, tokenizer_model, template. libFuzzer's options follow the
parser's name (-max_total_time, -runs, -jobs ...); -timeout=2, -rss_limit_mb=2048 and an -artifact_prefix in the
temporary folder (printed) are set unless given.
libFuzzer's last line gives the executions ("Done N runs in T second(s)").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PARSERS = ("gguf", "safetensors", "exl2", "config", "tokenizer_json", "tokenizer_model", "template")


def seeds(ff: Any, parser: str) -> List[bytes]:
    if parser == "gguf":
        return [ff.gguf_seed("llama"), ff.gguf_seed("gpt2")]
    if parser == "safetensors":
        return [ff.safetensors_seed()]
    if parser == "exl2":
        return [bytes(64)]
    if parser == "config":
        return [json.dumps(ff.config_seed()).encode()]
    if parser == "tokenizer_json":
        return [json.dumps(ff.tokenizer_json_seed()).encode()]
    if parser == "tokenizer_model":
        return [ff.sentencepiece_seed()]
    return [t.encode() for t in ff.TEMPLATE_SEEDS]


def target(ff: Any, parser: str) -> Callable[[bytes, Path], None]:
    """The bytes libFuzzer makes, as the parser's input."""
    if parser == "gguf":
        return ff.read_gguf
    if parser == "safetensors":
        return ff.read_safetensors
    if parser == "config":
        return lambda data, tmp: ff.read_config({"config.json": data}, tmp)
    if parser == "tokenizer_json":
        return lambda data, tmp: ff.read_tokenizer({"tokenizer.json": data}, tmp)
    if parser == "tokenizer_model":
        return lambda data, tmp: ff.read_tokenizer({"tokenizer.model": data}, tmp)
    if parser == "template":
        return lambda data, tmp: ff.render_template(data.decode("utf-8", "replace"), tmp)

    import atheris
    import torch

    seed = ff.exl2_seed()
    names = sorted(seed)

    def exl2(data: bytes, tmp: Path) -> None:
        """Bytes as edits of the valid linear's tables: (tensor, element, value) triples."""
        fdp = atheris.FuzzedDataProvider(data)
        tensors: Dict[str, Any] = {k: v.clone() for k, v in seed.items()}
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            name = names[fdp.ConsumeIntInRange(0, len(names) - 1)]
            flat = tensors[name].reshape(-1)
            index = fdp.ConsumeIntInRange(0, flat.numel() - 1)
            info = torch.iinfo(flat.dtype) if not flat.dtype.is_floating_point else torch.finfo(flat.dtype)
            flat[index] = max(info.min, min(info.max, fdp.ConsumeIntInRange(-(2**31), 2**31 - 1)))
        ff.read_exl2(tensors, tmp)

    return exl2


def fuzz(parser: str, args: List[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["kobold_backend"]):
        import kobold_backend.engine.chat_template  # noqa: F401
        import kobold_backend.engine.config  # noqa: F401
        import kobold_backend.engine.exl2  # noqa: F401
        import kobold_backend.engine.gguf.checkpoint  # noqa: F401
        import kobold_backend.engine.tokenizer  # noqa: F401
        import kobold_backend.engine.weights  # noqa: F401
        import kobold_backend.ops.exl2_weight  # noqa: F401
    from kobold_backend.errors import KoboldBackendError
    from tests.fixtures import fuzz_files as ff

    run = target(ff, parser)

    def one(data: bytes) -> None:
        with tempfile.TemporaryDirectory(prefix="kobold-fuzz-") as tmp:
            try:
                run(data, Path(tmp))
            except KoboldBackendError:
                pass

    corpus = Path(tempfile.mkdtemp(prefix=f"kobold-fuzz-{parser}-"))
    for i, data in enumerate(seeds(ff, parser)):
        (corpus / f"seed{i}").write_bytes(data)
        one(data)  # the first run imports what the target reads with: not a parse libFuzzer should time
    found = corpus.parent / f"{corpus.name}-found"
    found.mkdir()
    print(f"crash, timeout and out-of-memory inputs go to {found}", flush=True)
    options = ("-timeout=2", "-rss_limit_mb=2048", f"-artifact_prefix={found}/")
    defaults = [a for a in options if not any(x.startswith(a.split("=")[0]) for x in args)]
    atheris.Setup([sys.argv[0]] + defaults + args + [str(corpus)], one)
    atheris.Fuzz()


def main(argv: List[str]) -> int:
    if not argv or argv[0] not in PARSERS + ("all",):
        print(__doc__)
        return 2
    if argv[0] == "all":
        codes = [subprocess.call([sys.executable, __file__, parser] + argv[1:], env=dict(os.environ))
                 for parser in PARSERS]
        return max(codes)
    fuzz(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
