"""The `tokenizers` features newer than 0.15 (KoboldAI United's transformers 4.36.1 allows tokenizers <0.19), for
every release from 0.15 on: where the installed release has a feature it is used, and where it lacks one, a
tokenizer.json written by a newer release is rewritten in the older layout and the missing behaviour runs in Python.

- Metaspace `split` (0.19): `split=False` is done by `MetaspaceStep` (tokenizers' Metaspace rules, unsplit);
  a `prepend_scheme`-only node gets the `add_prefix_space` key 0.15 requires.
- BPE `ignore_merges` (0.19): a word that is whole in the vocabulary is its own token (`IgnoreMergesStep`).
- BPE merges stored as pairs (0.20): written back as "left right" strings, or passed as pairs to the BPE
  constructor where a piece contains a space.
- A normalizer or pre-tokenizer of None (0.19 accepts None): an empty Sequence, which changes nothing.
- `encode_special_tokens` (0.15.1): only split_special_tokens=True needs it; without it that is refused.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from kobold_backend.errors import ModelFormatError

SPACE_MARK = "\u2581"


class Features(NamedTuple):
    """What the installed `tokenizers` can do itself."""

    metaspace_split: bool
    ignore_merges: bool
    pair_merges: bool
    none_components: bool
    encode_special_tokens: bool


@functools.lru_cache(maxsize=None)
def installed_features() -> Features:
    """Found by behaviour: releases before 0.19 accept and ignore unknown keyword arguments such as split=."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    def works(check: Callable[[], bool]) -> bool:
        try:
            return check()
        except Exception:  # TypeError for an unknown argument or None; the bindings' own Exception for bad JSON
            return False

    def unsplit() -> bool:
        step = pre_tokenizers.Metaspace(replacement=SPACE_MARK, prepend_scheme="always", split=False)
        return len(step.pre_tokenize_str("a b")) == 1

    def ignores_merges() -> bool:
        return [t.id for t in models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[], ignore_merges=True)
                .tokenize("ab")] == [2]

    def pairs() -> bool:
        spec = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}
        return Tokenizer.from_str(json.dumps(_complete(spec))).encode("ab").ids == [2]

    def set_none() -> bool:
        Tokenizer(models.BPE()).normalizer = None
        return True

    return Features(metaspace_split=works(unsplit), ignore_merges=works(ignores_merges), pair_merges=works(pairs),
                    none_components=works(set_none),
                    encode_special_tokens=hasattr(Tokenizer(models.BPE()), "encode_special_tokens"))


def _complete(spec: Dict[str, Any]) -> Dict[str, Any]:
    """A minimal tokenizer.json with the fields every release requires."""
    full = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None}
    full.update(spec)
    return full


# --- steps run in Python where the installed release lacks them -------------------------------------------------


class MetaspaceStep:
    """tokenizers' Metaspace with split=False: spaces become "▁", and "▁" is put in front of a piece of text that
    does not start with one: every piece ("always"), the one at the start of the input ("first") or none."""

    def __init__(self, replacement: str, prepend_scheme: str) -> None:
        self.replacement = replacement
        self.prepend_scheme = prepend_scheme

    def _one(self, index: int, normalized: Any) -> List[Any]:
        normalized.replace(" ", self.replacement)
        prepend = self.prepend_scheme == "always" or (self.prepend_scheme == "first" and index == 0)
        if prepend and not normalized.normalized.startswith(self.replacement):
            normalized.prepend(self.replacement)
        return [normalized]

    def pre_tokenize(self, pretok: Any) -> None:
        pretok.split(self._one)


class IgnoreMergesStep:
    """BPE's ignore_merges: a pre-tokenized word that is whole in the vocabulary becomes that one token; the
    others are left to the model."""

    def __init__(self, vocab: Dict[str, int], model: Any) -> None:
        self.vocab = vocab
        self.model = model

    def _tokens(self, word: str) -> List[Any]:
        from tokenizers import Token

        found = self.vocab.get(word)
        if found is None:
            return self.model.tokenize(word)
        return [Token(found, word, (0, len(word.encode("utf-8"))))]

    def pre_tokenize(self, pretok: Any) -> None:
        pretok.tokenize(self._tokens)


def _python_step(step: Any) -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.PreTokenizer.custom(step)


# --- building -----------------------------------------------------------------------------------------------------


def empty_normalizer() -> Any:
    """None where the installed release accepts it, else a Sequence of nothing."""
    from tokenizers import normalizers

    return None if installed_features().none_components else normalizers.Sequence([])


def empty_pre_tokenizer() -> Any:
    from tokenizers import pre_tokenizers

    return None if installed_features().none_components else pre_tokenizers.Sequence([])


def metaspace(prepend_scheme: str, features: Optional[Features] = None) -> Any:
    """A pre-tokenizer: spaces become "▁", the dummy prefix per `prepend_scheme`, no split at "▁"."""
    from tokenizers import pre_tokenizers

    if (features or installed_features()).metaspace_split:
        return pre_tokenizers.Metaspace(replacement=SPACE_MARK, prepend_scheme=prepend_scheme, split=False)
    return _python_step(MetaspaceStep(SPACE_MARK, prepend_scheme))


def set_encode_special_tokens(backend: Any, value: bool, features: Optional[Features] = None) -> None:
    """transformers' split_special_tokens: special tokens written in the text are read as plain text."""
    if (features or installed_features()).encode_special_tokens:
        backend.encode_special_tokens = value
    elif value:
        import tokenizers

        raise ModelFormatError(
            f"This tokenizer sets split_special_tokens, which needs tokenizers>=0.15.1 (installed: "
            f"{tokenizers.__version__})."
        )


def _nodes(node: Any) -> List[Dict[str, Any]]:
    """A component and, for a Sequence, its parts, depth first."""
    if not isinstance(node, dict):
        return []
    found = [node]
    for part in node.get("pretokenizers") or node.get("decoders") or node.get("normalizers") or []:
        found += _nodes(part)
    return found


def _needs_rewrite(spec: Dict[str, Any], have: Features) -> bool:
    model = spec.get("model") or {}
    merges = model.get("merges") or []
    nodes = _nodes(spec.get("pre_tokenizer")) + _nodes(spec.get("decoder"))
    metaspace = any(n.get("type") == "Metaspace" for n in nodes)
    return ((metaspace and not have.metaspace_split) or ("ignore_merges" in model and not have.ignore_merges)
            or (bool(merges) and not isinstance(merges[0], str) and not have.pair_merges))


def from_spec(spec: Dict[str, Any], features: Optional[Features] = None) -> Any:
    """A `tokenizers.Tokenizer` from a parsed tokenizer.json of any release, with the installed release's
    features, or the Python steps above where it lacks them."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    have = features or installed_features()
    if not _needs_rewrite(spec, have):
        return Tokenizer.from_str(json.dumps(spec))
    spec = copy.deepcopy(spec)
    model = spec.get("model") or {}
    steps: List[Any] = []
    if not have.metaspace_split:
        pre = spec.get("pre_tokenizer")
        for node in _nodes(pre) + _nodes(spec.get("decoder")):
            if node.get("type") != "Metaspace":
                continue
            scheme = node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never")
            unsplit = node.pop("split", True) is False and any(node is n for n in _nodes(pre))
            if unsplit and node is not pre:
                raise ModelFormatError("A Metaspace pre-tokenizer with split=false inside a Sequence needs "
                                       "tokenizers>=0.19.")
            if unsplit:
                steps.append(MetaspaceStep(node.get("replacement", SPACE_MARK), scheme))
                spec["pre_tokenizer"] = None
            node.setdefault("add_prefix_space", scheme != "never")
    ignore = bool(model.get("ignore_merges")) and not have.ignore_merges
    if not have.ignore_merges:
        model.pop("ignore_merges", None)
    pairs: Optional[List[Any]] = None
    merges = model.get("merges")
    if model.get("type") == "BPE" and merges and not have.pair_merges and not isinstance(merges[0], str):
        if any(" " in part for merge in merges for part in merge):
            pairs, model["merges"] = [tuple(m) for m in merges], []
        else:
            model["merges"] = [" ".join(m) for m in merges]
    backend = Tokenizer.from_str(json.dumps(spec))
    if pairs is not None:
        options = {key: model[key] for key in ("dropout", "unk_token", "continuing_subword_prefix",
                                               "end_of_word_suffix", "fuse_unk", "byte_fallback")
                   if model.get(key) is not None}
        backend.model = BPE(vocab=model["vocab"], merges=pairs, **options)
    if ignore:
        steps.append(IgnoreMergesStep(dict(model["vocab"]), backend.model))
    if steps:
        from tokenizers import pre_tokenizers

        native = [backend.pre_tokenizer] if backend.pre_tokenizer is not None else []
        backend.pre_tokenizer = pre_tokenizers.Sequence(native + [_python_step(step) for step in steps])
    return backend
