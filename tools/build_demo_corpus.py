"""Build the demo model's training corpus from redistributable text on this machine: the licence texts under
/usr/share/common-licenses and Python's own documentation (the standard library's docstrings, found by importing
each module and walking it with inspect, then in the library's source files with ast, and pydoc's help topics).

Usage: python tools/build_demo_corpus.py OUT_DIR [--heldout-permille 50]

Documents (a licence paragraph, a help topic, or one docstring headed by the qualified name and signature of what
it documents) are normalised (NFC, tabs expanded, trailing spaces and control characters removed, runs of blank
lines collapsed) and deduplicated on their body (case and whitespace folded; the first occurrence wins). A document
goes to the held-out split when the first eight bytes of the sha256 of its text, as a big-endian integer, modulo
1000 fall below --heldout-permille. The output depends only on this machine's files and Python version.
Writes OUT_DIR/train.jsonl, OUT_DIR/heldout.jsonl (one {"source", "text"} object a line) and manifest.json, and
prints the sha256 and size of each file.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import pkgutil
import platform
import re
import subprocess
import sys
import sysconfig
import unicodedata
import warnings
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

LICENSE_DIR = Path("/usr/share/common-licenses")
MIN_CHARS = 40
# Importing these runs programs (a browser, IDLE, turtle windows, the test suite) or prints on import.
SKIP_MODULES = {"antigravity", "this", "idlelib", "turtledemo", "turtle", "tkinter", "test", "lib2to3", "ensurepip",
                "pydoc_data", "xxsubtype", "xxlimited", "xxlimited_35"}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_BLANKS = re.compile(r"\n{3,}")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")  # default values' reprs carry memory addresses

Document = Tuple[str, str, str]  # (source, header, body): the text is the header, a blank line, the body


def doc_text(doc: Document) -> str:
    return f"{doc[1]}\n\n{doc[2]}" if doc[1] else doc[2]


def normalise(text: str) -> str:
    """NFC, tabs to spaces, no control characters or trailing spaces, at most one blank line in a row."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n").expandtabs(4)
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip()


def dedup_key(text: str) -> str:
    return " ".join(text.split()).lower()


def license_documents(folder: Path = LICENSE_DIR) -> Iterator[Document]:
    """One document per paragraph (blank-line separated) of each licence file, in file-name order."""
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        text = normalise(path.read_text(encoding="utf-8", errors="replace"))
        for paragraph in text.split("\n\n"):
            yield f"license:{path.name}", "", paragraph


def stdlib_module_names() -> List[str]:
    """Top-level standard-library module names (sys.stdlib_module_names from 3.10, else the stdlib folder)."""
    names = getattr(sys, "stdlib_module_names", None)
    if names is None:
        names = set(sys.builtin_module_names) | {m.name for m in pkgutil.iter_modules([stdlib_dir()])}
    return sorted(n for n in names if not n.startswith("_") and n not in SKIP_MODULES)


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _quiet_import(name: str) -> Optional[ModuleType]:
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except (Exception, SystemExit):  # import errors (missing C modules, other platforms) are skipped
        return None


def walk_stdlib() -> Iterator[ModuleType]:
    """Every importable public stdlib module and submodule, depth first in name order."""
    seen = set()
    stack = list(reversed(stdlib_module_names()))
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        module = _quiet_import(name)
        if module is None:
            continue
        yield module
        path = getattr(module, "__path__", None)
        if path:
            subs = sorted(f"{name}.{m.name}" for m in pkgutil.iter_modules(path)
                          if not m.name.startswith("_") and m.name not in SKIP_MODULES)
            stack.extend(reversed(subs))


class _Elided:
    def __repr__(self) -> str:
        return "..."


def _is_literal(value: object) -> bool:
    """None, numbers, short strings that are not paths (sys.executable is a default), and tuples of these."""
    if isinstance(value, tuple):
        return len(value) <= 8 and all(_is_literal(v) for v in value)
    if isinstance(value, (str, bytes)):
        return len(value) <= 40 and not any(sep in str(value) for sep in ("/", "\\"))
    return value is None or isinstance(value, (bool, int, float, complex))


def _signature(obj: object) -> str:
    """`(params)` with only literal defaults shown: a default's repr can hold a memory address, a path or the whole
    environment (cgi's `environ=os.environ`), which would make the corpus vary and leak this machine's state."""
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    params = [p if p.default is p.empty or _is_literal(p.default) else p.replace(default=_Elided())
              for p in sig.parameters.values()]
    return _ADDRESS.sub(">", str(sig.replace(parameters=params)))


def _doc(obj: object) -> Optional[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def docstring_documents(module: ModuleType) -> Iterator[Document]:
    """The module's docstring, then each public class, function and method defined in it, headed by
    `name(signature)`."""
    mod_name = module.__name__
    doc = _doc(module)
    if doc:
        yield f"pydoc:{mod_name}", f"Module {mod_name}", doc
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod_name:
            continue
        if inspect.isclass(obj):
            class_doc = _doc(obj)
            if class_doc:
                yield f"pydoc:{mod_name}.{attr}", f"class {mod_name}.{attr}{_signature(obj)}", class_doc
            for member, fn in sorted(vars(obj).items()):
                if member.startswith("_") and member != "__init__":
                    continue
                if isinstance(fn, (staticmethod, classmethod)):
                    fn = fn.__func__
                doc = _doc(fn) if callable(fn) or isinstance(fn, property) else None
                if doc and doc != class_doc:
                    yield f"pydoc:{mod_name}.{attr}.{member}", f"{mod_name}.{attr}.{member}{_signature(fn)}", doc
        elif inspect.isroutine(obj):
            doc = _doc(obj)
            if doc:
                yield f"pydoc:{mod_name}.{attr}", f"{mod_name}.{attr}{_signature(obj)}", doc


def source_docstring_documents(root: Optional[str] = None) -> Iterator[Document]:
    """Docstrings of every module, class and function in the standard library's .py files (private helpers and
    the test suite included), read with ast without running anything; headed like docstring_documents."""
    base = Path(root or stdlib_dir())
    unparse = getattr(ast, "unparse", None)
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        yield from _ast_docs(tree, module, module, unparse)


def _ast_docs(node: ast.AST, module: str, qualname: str, unparse: object) -> Iterator[Document]:
    doc = ast.get_docstring(node)  # type: ignore[arg-type]
    if doc:
        if isinstance(node, ast.Module):
            header = f"Module {module}"
        elif isinstance(node, ast.ClassDef):
            header = f"class {qualname}"
        else:
            args = unparse(node.args) if callable(unparse) else ""  # type: ignore[attr-defined]
            header = f"{qualname}({args})"
        yield f"source:{qualname}", header, doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _ast_docs(child, module, f"{qualname}.{child.name}", unparse)


def help_topic_documents() -> Iterator[Document]:
    """pydoc's help topics (the language reference sections `help("FOR")` shows), one document each."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for name in sorted(topics):
        yield f"topic:{name}", "", topics[name]


def all_sources() -> Iterator[Document]:
    """Licence paragraphs, help topics, imported docstrings, then source docstrings."""
    yield from license_documents()
    yield from help_topic_documents()
    for module in walk_stdlib():
        yield from docstring_documents(module)
    yield from source_docstring_documents()


def collect(documents: Iterable[Document], min_chars: int = MIN_CHARS) -> List[Document]:
    """Normalised, short bodies dropped, deduplicated on the body (first occurrence kept)."""
    docs: List[Document] = []
    seen = set()
    for source, header, body in documents:
        body = normalise(body)
        key = dedup_key(body)
        if len(body) >= min_chars and key not in seen:
            seen.add(key)
            docs.append((source, normalise(header), body))
    return docs


def is_heldout(text: str, permille: int) -> bool:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < permille


def _write_jsonl(path: Path, docs: List[Document]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for doc in docs:
            fh.write(json.dumps({"source": doc[0], "text": doc_text(doc)}, ensure_ascii=False) + "\n")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(out_dir: Path, heldout_permille: int = 50, min_chars: int = MIN_CHARS,
          documents: Optional[Iterable[Document]] = None) -> Dict[str, object]:
    """Write the corpus files and manifest.json into out_dir; return the manifest. `documents` defaults to
    all_sources()."""
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = collect(all_sources() if documents is None else documents, min_chars)
    splits = {"train": [d for d in docs if not is_heldout(doc_text(d), heldout_permille)],
              "heldout": [d for d in docs if is_heldout(doc_text(d), heldout_permille)]}
    files: Dict[str, Dict[str, object]] = {}
    for split, items in splits.items():
        path = out_dir / f"{split}.jsonl"
        _write_jsonl(path, items)
        files[path.name] = {
            "sha256": file_sha256(path), "bytes": path.stat().st_size, "documents": len(items),
            "characters": sum(len(doc_text(d)) for d in items),
            "documents_by_source": {kind: sum(1 for d in items if d[0].startswith(kind + ":"))
                                    for kind in ("license", "topic", "pydoc", "source")},
        }
    manifest: Dict[str, object] = {
        "sources": {"license": f"paragraphs of the licence texts in {LICENSE_DIR}",
                    "topic": "pydoc's help topics (pydoc_data.topics)",
                    "pydoc": "docstrings of the imported standard library, walked with inspect",
                    "source": f"docstrings in the standard library's source files under {stdlib_dir()}, via ast"},
        "python": platform.python_version(),
        "heldout_permille": heldout_permille,
        "min_chars": min_chars,
        "files": files,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: Optional[List[str]] = None) -> int:
    if not (sys.flags.no_site and sys.flags.isolated):
        # Only the standard library: no site-packages (a virtualenv's setuptools swaps in its own distutils)
        # and no PYTHON* variables, so the corpus is the same inside and outside a virtual environment.
        args = sys.argv[1:] if argv is None else argv
        return subprocess.call([sys.executable, "-I", "-S", str(Path(__file__).resolve())] + list(args))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder to write train.jsonl, heldout.jsonl, manifest.json into")
    parser.add_argument("--heldout-permille", type=int, default=50, help="share of documents held out, in 1/1000")
    parser.add_argument("--min-chars", type=int, default=MIN_CHARS, help="drop documents shorter than this")
    args = parser.parse_args(argv)
    manifest = build(args.out_dir, args.heldout_permille, args.min_chars)
    for name, info in manifest["files"].items():  # type: ignore[union-attr]
        print(f"{info['sha256']}  {name}  {info['bytes']} bytes, {info['documents']} documents, "
              f"{info['characters']} characters")
    print(f"python {manifest['python']}; manifest: {args.out_dir / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
