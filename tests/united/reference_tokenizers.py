"""Writes the tokenizer folders of tests/fixtures/tokenizer_families.py with this Python's `tokenizers` and
transformers (the newest: the project's own .venv), and what transformers' AutoTokenizer gives on them, to
OUT/<family>/ and OUT/reference.json. tests/test_tokenizer_versions.py runs it in that Python and compares the
engine under another release (United's tokenizers 0.15) with the record. Usage: python reference_tokenizers.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict

from transformers import AutoTokenizer

from tests.fixtures.tokenizer_families import FAMILIES
from tests.test_tokenizer_fidelity import texts_for


def main(out: Path) -> None:
    record: Dict[str, Any] = {}
    for name, write in FAMILIES.items():
        hf = AutoTokenizer.from_pretrained(str(write(out / name)))
        rows = []
        for text in texts_for(name):
            full = hf(text).input_ids
            rows.append({"text": text, "full": full, "plain": hf(text, add_special_tokens=False).input_ids,
                         "decoded": hf.decode(full, skip_special_tokens=True)})
        record[name] = {"vocab_size": len(hf), "rows": rows}
    (out / "reference.json").write_text(json.dumps(record), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
