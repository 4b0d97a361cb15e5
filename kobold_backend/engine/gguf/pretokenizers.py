"""llama.cpp's BPE pre-tokenizers by `tokenizer.ggml.pre`: the split regexes it applies one after the other (each
splits every piece the previous ones left, keeping matches and the text between them), whether it byte-encodes
the pieces (GPT-2's byte-to-character table) or keeps raw UTF-8 with "▁" for spaces, whether a piece that is
itself a vocabulary token skips the merges (`ignore_merges`), and whether it adds BOS when the GGUF file does not
say (`tokenizer.ggml.add_bos_token` absent).

Source of every entry: llama.cpp's src/llama-vocab.cpp (ggml-org/llama.cpp, 2026): `llm_tokenizer_bpe`'s
`regex_exprs` per LLAMA_VOCAB_PRE_TYPE, and `llama_vocab::impl::load`, which maps each `tokenizer.ggml.pre` name to
a type and sets `ignore_merges`, `add_bos`, `escape_whitespaces`. Where llama.cpp rewrites a tokenizer.json regex
for std::regex (`(?i:'s|...)` spelled as `'[sS]|...`), the rewritten form is used: it is what llama.cpp runs.
The `tokenizers` package runs these with Oniguruma; llama.cpp runs its own splitters for the GPT-2 and Llama 3
patterns and std::regex on code points folded to one stand-in per Unicode category for the others, so the two can
part on characters whose category the fold loses (the case-sensitive `[^a-z]` classes of tekken and gpt-4o on
non-ASCII letters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class PreTokenizer:
    regexes: Tuple[str, ...]
    byte_encode: bool = True  # False: raw UTF-8 pieces, spaces written "▁", <0xXX> byte tokens (SPM-style BPE)
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the GGUF file has no tokenizer.ggml.add_bos_token


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
           r"|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
          r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
# deepseek-llm's letter class, as its tokenizer.json (and llama.cpp) spell it.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_LLM = (r"[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + r"]+", "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f"
                 "\u3000-\u3002]+", r"\s+$", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}+")
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              r"[!" + '"' + r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPARK = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
          r"[!" + '"' + r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
          r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")
_CASED_WORDS = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+{c}"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*{c}")
_TEKKEN = _CASED_WORDS.replace("{c}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (_CASED_WORDS.replace("{c}", _CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_GRANITE_EMB = (_CASED_WORDS.replace(r"[\p{L}]", r"[\p{L}\p{M}]").replace("{c}", _CONTRACTIONS + "?")
                + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_YOUTU = ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
          "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TINY_AYA = (r"\d{1,3}(?=(?:\d{3})*\b)",
             r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS
             + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_BAILING = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)"
               r"|\s+")
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
_MINICPM5 = (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CHAMELEON = (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
              r"[\p{P}!-/:-@\[-`{-~]", _GPT2)
_NEWLINES = r"[^\n]+|[\n]+"

_KINDS: Dict[Tuple[str, ...], PreTokenizer] = {
    ("default",): PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"):
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ("dbrx", "smaug-bpe"): PreTokenizer((_LLAMA3,)),
    ("jais-2",): PreTokenizer((_JAIS2,)),
    ("deepseek-llm",): PreTokenizer(_DEEPSEEK_LLM),
    ("deepseek-coder",): PreTokenizer(_DEEPSEEK_CODER),
    ("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"): PreTokenizer(_DEEPSEEK3),
    ("spark2_5",): PreTokenizer(_SPARK),
    ("youtu",): PreTokenizer(_YOUTU, ignore_merges=True),
    ("falcon",): PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"):
        PreTokenizer((r"\p{N}", _GPT2)),
    ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
     "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
     "granite-docling"): PreTokenizer((_GPT2,)),
    ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"):
        PreTokenizer((_QWEN2,)),
    ("qwen35",): PreTokenizer((_QWEN35,)),
    ("poro-chat", "bloom", "gpt3-finnish"): PreTokenizer((_BLOOM,)),
    ("glm4", "chatglm-bpe"): PreTokenizer((_LLAMA3,)),
    ("viking",): PreTokenizer((_BLOOM, r"\p{N}")),
    ("tekken",): PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    ("chameleon",): PreTokenizer(_CHAMELEON, add_bos=True),
    ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"): PreTokenizer((_GPT4O,)),
    ("granite-embed-multi-97m",): PreTokenizer((_GRANITE_EMB,), ignore_merges=True),
    ("tiny_aya", "cohere2moe"): PreTokenizer(_TINY_AYA),
    ("bailingmoe", "bailingmoe2", "llada-moe"): PreTokenizer((_BAILING,)),
    ("seed-coder",): PreTokenizer((_SEED_CODER,)),
    ("ufakzeka",): PreTokenizer((_UFAKZEKA,)),
    ("grok-2",): PreTokenizer((_QWEN2,)),
    ("laguna",): PreTokenizer((_NEWLINES, _QWEN2)),
    ("exaone-moe",): PreTokenizer((_EXAONE_MOE,)),
    ("minicpm5",): PreTokenizer(_MINICPM5, ignore_merges=True),
    # SPM-style BPE: spaces become "▁" before the split; Gemma 4 always adds BOS (llama.cpp overrides the file).
    ("gemma4", "granite-embed-multi-311m"): PreTokenizer((_NEWLINES,), byte_encode=False, add_bos=True),
    ("sarvam-moe",): PreTokenizer((_NEWLINES,), byte_encode=False),
}

PRE_TOKENIZERS: Dict[str, PreTokenizer] = {name: kind for names, kind in _KINDS.items() for name in names}

# llama.cpp splits these with hand-written code (unicode.cpp), not with the regexes it lists, or runs a tokenizer
# session of its own; no regex pipeline reproduces them.
UNSUPPORTED_PRE = {
    "kimi-k2": "llama.cpp splits its Han and non-Han runs with hand-written code",
    "afmoe": "llama.cpp groups its digits with hand-written code",
    "superbpe": "its zero-width digit-group split has no Hugging Face pre-tokenizer equivalent",
    "whitespace": "llama.cpp runs its own whitespace session for it",
}
