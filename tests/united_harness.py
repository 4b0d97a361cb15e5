"""A small, faithful re-implementation of the KoboldAI United side of the backend protocol, for tests.

It reproduces (from United's modeling/inference_model.py, stoppers.py, post_token_hooks.py, utils.py and
the aiserver.py flows described in /work/shared/spec/host-protocol.md section 1) the InferenceModel base
class, GenerationResult, GenerationSettings, ModelCapabilities, GenerationMode, the stoppers and the
streaming hook, koboldai_vars, backend discovery, and the select/resubmit/load/CLI/PUT-model sequences.
`UnitedHost(root)` installs these as the modules `utils`, `modeling`, `modeling.inference_model`,
`modeling.stoppers`, `modeling.post_token_hooks` and `modeling.logits_processors` for the duration of a
`with` block, with `modeling` pointing at root/modeling so plugins in root/modeling/inference_models/ import.
Lua, soft prompts, world info and the TPU path are out of scope and kept at their "off" values.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch

log = logging.getLogger("united_harness")

# ---------------------------------------------------------------------------------------------- utils


class InferenceConfig:
    def __init__(self) -> None:
        self.do_core = False
        self.do_dynamic_wi = False
        self.stop_at_genamt = False


class LuaBridge:
    """The parts of bridge.lua's koboldbridge the stoppers touch."""

    def __init__(self) -> None:
        self.generated_cols = 0
        self.generated: Dict[int, Dict[int, int]] = defaultdict(dict)
        self.regeneration_required = False
        self.generating = True


class StoryActions:
    """koboldai_vars.actions: records what the streaming hook sends to the browser."""

    def __init__(self) -> None:
        self.streamed: List[List[str]] = []

    def stream_tokens(self, data: List[str]) -> None:
        self.streamed.append(list(data))


class KoboldVars:
    """koboldai_vars with United's defaults (koboldai_settings.py) for every field the protocol reads."""

    def __init__(self) -> None:
        self.temp = 0.5
        self.top_p = 0.9
        self.top_k = 0
        self.tfs = 1.0
        self.typical = 1.0
        self.top_a = 0.0
        self.rep_pen = 1.1
        self.rep_pen_slope = 1.0
        self.rep_pen_range = 2048
        self.eps_cutoff = 0.0
        self.eta_cutoff = 0.0
        self.sampler_order = [6, 0, 1, 2, 3, 4, 5]
        self.use_default_badwordsids = True
        self.abort = False
        self.generated_tkns = 0
        self.genamt = 80
        self.numseqs = 1
        self.alt_multi_gen = False
        self.max_length = 2048
        self.output_streaming = True
        self.inference_config = InferenceConfig()
        self.standalone = False
        self.lua_koboldbridge = LuaBridge()
        self.singleline = False
        self.chatmode = False
        self.chatname = "You"
        self.adventure = False
        self.stop_sequence: List[str] = []
        self.dynamicscan = False
        self.newlinemode = "n"
        self.actions = StoryActions()
        self.quiet = True
        self.full_determinism = False
        self.seed: Optional[int] = None
        self.model = ""
        self.total_layers = 0
        self.loaded_layers = 0
        self.status_message = ""
        self.revision = None


utils = ModuleType("utils")
utils.koboldai_vars = KoboldVars()


def decodenewlines(txt: str) -> str:
    if utils.koboldai_vars.newlinemode == "s":
        return txt.replace("</s>", "\n")
    if utils.koboldai_vars.newlinemode == "ns":
        return txt.replace("</s>", "")
    return txt


def encodenewlines(txt: str) -> str:
    if utils.koboldai_vars.newlinemode == "s":
        return txt.replace("\n", "</s>")
    return txt


def applyoutputformatting(txt: str, no_sentence_trimming: bool = False, no_single_line: bool = False) -> str:
    """United trims and reformats here according to UI options; all of them are off in the harness."""
    return txt


utils.decodenewlines = decodenewlines
utils.encodenewlines = encodenewlines
utils.applyoutputformatting = applyoutputformatting

# -------------------------------------------------------------------------------- modeling.inference_model


class GenerationResult:
    def __init__(
        self,
        model: InferenceModel,
        out_batches: Any,
        prompt: Any,
        is_whole_generation: bool,
        output_includes_prompt: bool = False,
        single_line: bool = False,
    ) -> None:
        if output_includes_prompt:
            self.encoded = out_batches[:, len(prompt):]
        else:
            self.encoded = out_batches
        self.prompt = prompt
        self.is_whole_generation = is_whole_generation
        self.decoded = [utils.decodenewlines(model.tokenizer.decode(enc)) for enc in self.encoded]
        if single_line:
            self.decoded = [x.split("\n", 1)[0] for x in self.decoded]
            self.encoded = np.array(model.tokenizer(self.decoded).input_ids)


class GenerationSettings:
    def __init__(self, **overrides: Any) -> None:
        for setting in ["temp", "top_p", "top_k", "tfs", "typical", "top_a", "rep_pen", "rep_pen_slope",
                        "rep_pen_range", "eps_cutoff", "eta_cutoff", "sampler_order"]:
            setattr(self, setting, overrides.get(setting, getattr(utils.koboldai_vars, setting)))


@dataclass
class ModelCapabilities:
    embedding_manipulation: bool = False
    post_token_hooks: bool = False
    stopper_hooks: bool = False
    post_token_probs: bool = False
    api_host: bool = True
    uses_tpu: bool = False


class GenerationMode(Enum):
    STANDARD = "standard"
    FOREVER = "forever"
    UNTIL_EOS = "until_eos"
    UNTIL_NEWLINE = "until_newline"
    UNTIL_SENTENCE_END = "until_sentence_end"


class LuaIntegration:
    """Placeholder for United's logits processor (Lua generation modifiers are not emulated)."""


class PhraseBiasLogitsProcessor:
    """Placeholder for United's phrase-bias logits processor."""


class ProbabilityVisualization:
    """Placeholder for United's probability-visualization logits processor."""


class InferenceModel:
    """United's root class for all models."""

    def __init__(self) -> None:
        self.abort = False
        self.gen_state: Dict[str, Any] = {}
        self.post_token_hooks: List[Any] = []
        self.stopper_hooks: List[Any] = []
        self.logits_processors = [LuaIntegration(), PhraseBiasLogitsProcessor(), ProbabilityVisualization()]
        self.tokenizer: Any = None
        self.capabilties = ModelCapabilities()
        self.model_name = "Not Defined"

    def is_valid(self, model_name: str, model_path: Optional[str], menu_path: str) -> bool:
        return True

    def requested_parameters(self, model_name: str, model_path: Optional[str], menu_path: str) -> Dict[str, Any]:
        return {}

    def set_input_parameters(self, parameters: Dict[str, Any]) -> None:
        for parameter in parameters:
            setattr(self, parameter, parameters[parameter])

    def get_auxilary_device(self) -> str:
        return "cpu"

    def load(self, save_model: bool = False, initial_load: bool = False) -> None:
        self._pre_load()
        self._load(save_model=save_model, initial_load=initial_load)
        self._post_load()
        self._save_settings()

    def unload(self) -> None:
        return

    def _pre_load(self) -> None:
        """Pre load hook."""

    def _post_load(self) -> None:
        """Post load hook."""

    def _save_settings(self) -> None:
        """Save settings hook."""

    def _load(self, save_model: bool, initial_load: bool) -> None:
        raise NotImplementedError

    def core_generate(self, text: list, found_entries: Any, gen_mode: GenerationMode = GenerationMode.STANDARD):
        kv = utils.koboldai_vars
        gen_in = torch.tensor(text, dtype=torch.long)[None]
        assert gen_in.shape[-1] + kv.genamt <= kv.max_length
        gen_in = gen_in.to(self.get_auxilary_device())
        found_entries = found_entries or set()
        self.gen_state["wi_scanner_excluded_keys"] = found_entries
        with torch.no_grad():
            already_generated = 0
            numseqs = kv.numseqs
            total_gens = None
            for _ in range(kv.numseqs if kv.alt_multi_gen else 1):
                while True:
                    result = self.raw_generate(
                        gen_in[0],
                        max_new=kv.genamt,
                        do_streaming=kv.output_streaming,
                        do_dynamic_wi=kv.dynamicscan,
                        batch_count=numseqs if not kv.alt_multi_gen else 1,
                        bypass_hf_maxlength=kv.dynamicscan,
                        is_core=True,
                        tpu_dynamic_inference=kv.dynamicscan,
                        seed=kv.seed if kv.full_determinism else None,
                        gen_mode=gen_mode,
                    )
                    genout = result.encoded
                    already_generated += len(genout[0])
                    if result.is_whole_generation:
                        break
                    if self.gen_state.get("halt") or not self.gen_state.get("regeneration_required"):
                        break
                    raise NotImplementedError("Dynamic WI regeneration is not emulated by the harness")
                total_gens = genout if total_gens is None else torch.cat((total_gens, genout))
        return total_gens, already_generated

    def _raw_generate(self, prompt_tokens: Any, max_new: int, gen_settings: GenerationSettings,
                      single_line: bool = False, batch_count: int = 1, **kwargs: Any) -> GenerationResult:
        raise NotImplementedError

    def raw_generate(
        self,
        prompt: Union[str, list, np.ndarray],
        max_new: int,
        do_streaming: bool = False,
        do_dynamic_wi: bool = False,
        batch_count: int = 1,
        bypass_hf_maxlength: bool = False,
        generation_settings: Optional[dict] = None,
        is_core: bool = False,
        single_line: bool = False,
        found_entries: Any = (),
        tpu_dynamic_inference: bool = False,
        seed: Optional[int] = None,
        gen_mode: GenerationMode = GenerationMode.STANDARD,
        **kwargs: Any,
    ) -> GenerationResult:
        self.gen_state["do_streaming"] = do_streaming
        self.gen_state["do_dynamic_wi"] = do_dynamic_wi
        self.gen_state["stop_at_genamt"] = do_dynamic_wi
        self.gen_state["wi_scanner_excluded_keys"] = self.gen_state.get("wi_scanner_excluded_keys", set())
        self.gen_state["allow_eos"] = False
        temp_stoppers = []
        if gen_mode not in self.get_supported_gen_modes():
            gen_mode = GenerationMode.STANDARD
        if gen_mode == GenerationMode.FOREVER:
            self.gen_state["stop_at_genamt"] = False
            max_new = 1e7
        elif gen_mode == GenerationMode.UNTIL_EOS:
            self.gen_state["allow_eos"] = True
            self.gen_state["stop_at_genamt"] = False
            max_new = 1e7
        elif gen_mode == GenerationMode.UNTIL_NEWLINE:
            temp_stoppers.append(Stoppers.newline_stopper)
        elif gen_mode == GenerationMode.UNTIL_SENTENCE_END:
            temp_stoppers.append(Stoppers.sentence_end_stopper)
        self.stopper_hooks += temp_stoppers
        utils.koboldai_vars.inference_config.do_core = is_core
        gen_settings = GenerationSettings(*(generation_settings or {}))
        if isinstance(prompt, torch.Tensor):
            prompt_tokens = prompt.cpu().numpy()
        elif isinstance(prompt, list):
            prompt_tokens = np.array(prompt)
        elif isinstance(prompt, str):
            prompt_tokens = np.array(self.tokenizer.encode(prompt))
        else:
            raise ValueError(f"Prompt is {type(prompt)}. Not a fan!")
        assert isinstance(prompt_tokens, np.ndarray)
        assert len(prompt_tokens.shape) == 1
        result = self._raw_generate(
            prompt_tokens=prompt_tokens,
            max_new=max_new,
            batch_count=batch_count,
            gen_settings=gen_settings,
            single_line=single_line,
            tpu_dynamic_inference=tpu_dynamic_inference,
            seed=seed,
        )
        for stopper in temp_stoppers:
            self.stopper_hooks.remove(stopper)
        return result

    def _post_token_gen(self, input_ids: torch.LongTensor) -> None:
        for hook in self.post_token_hooks:
            hook(self, input_ids)

    def abort_generation(self, abort: bool = True) -> None:
        self.abort = abort

    def get_supported_gen_modes(self) -> List[GenerationMode]:
        ret = [GenerationMode.STANDARD]
        if self.capabilties.stopper_hooks:
            ret += [GenerationMode.FOREVER, GenerationMode.UNTIL_NEWLINE, GenerationMode.UNTIL_SENTENCE_END]
        return ret


# ----------------------------------------------------------------------- modeling.stoppers / post_token_hooks


class Stoppers:
    @staticmethod
    def core_stopper(model: InferenceModel, input_ids: torch.LongTensor) -> bool:
        kv = utils.koboldai_vars
        if not kv.inference_config.do_core:
            return False
        kv.generated_tkns += 1
        bridge = kv.lua_koboldbridge
        if not kv.standalone and bridge.generated_cols and kv.generated_tkns != bridge.generated_cols:
            raise RuntimeError(f"Inconsistency detected between KoboldAI Python and Lua backends "
                               f"({kv.generated_tkns} != {bridge.generated_cols})")
        if kv.abort or (kv.inference_config.stop_at_genamt and kv.generated_tkns >= kv.genamt):
            kv.abort = False
            model.gen_state["regeneration_required"] = False
            model.gen_state["halt"] = False
            return True
        if kv.standalone:
            return False
        assert input_ids.ndim == 2
        model.gen_state["regeneration_required"] = bridge.regeneration_required
        model.gen_state["halt"] = not bridge.generating
        bridge.regeneration_required = False
        for i in range(kv.numseqs) if not kv.alt_multi_gen else range(1):
            bridge.generated[i + 1][kv.generated_tkns] = int(input_ids[i, -1].item())
        return model.gen_state["regeneration_required"] or model.gen_state["halt"]

    @staticmethod
    def dynamic_wi_scanner(model: InferenceModel, input_ids: torch.LongTensor) -> bool:
        kv = utils.koboldai_vars
        if not kv.inference_config.do_dynamic_wi:
            return False
        if not kv.dynamicscan:
            return False
        assert len(model.gen_state["wi_scanner_excluded_keys"]) == input_ids.shape[0]
        return False

    @staticmethod
    def chat_mode_stopper(model: InferenceModel, input_ids: torch.LongTensor) -> bool:
        kv = utils.koboldai_vars
        if not kv.chatmode:
            return False
        data = [model.tokenizer.decode(x) for x in input_ids]
        if "completed" not in model.gen_state:
            model.gen_state["completed"] = [False] * len(input_ids)
        for i in range(len(input_ids)):
            if data[i][-1 * (len(kv.chatname) + 1):] == kv.chatname + ":":
                model.gen_state["completed"][i] = True
        if all(model.gen_state["completed"]):
            kv.generated_tkns = kv.genamt
            del model.gen_state["completed"]
            return True
        return False

    @staticmethod
    def stop_sequence_stopper(model: InferenceModel, input_ids: torch.LongTensor) -> bool:
        kv = utils.koboldai_vars
        data = [model.tokenizer.decode(x) for x in input_ids]
        if "completed" not in model.gen_state:
            model.gen_state["completed"] = [False] * len(input_ids)
        extra_options = ["> You", "You:", "\n\n You", "\n\nYou", ". You"]
        if kv.adventure:
            for option in extra_options:
                if option not in kv.stop_sequence:
                    kv.stop_sequence.append(option)
        for stopper in kv.stop_sequence:
            for i in range(len(input_ids)):
                if data[i][-1 * (len(stopper)):] == stopper:
                    model.gen_state["completed"][i] = True
        if all(model.gen_state["completed"]):
            kv.generated_tkns = kv.genamt
            del model.gen_state["completed"]
            if kv.adventure:
                for option in extra_options:
                    if option in kv.stop_sequence:
                        kv.stop_sequence.remove(option)
            return True
        return False

    @staticmethod
    def singleline_stopper(model: InferenceModel, input_ids: torch.LongTensor) -> bool:
        if not utils.koboldai_vars.singleline:
            return False
        return Stoppers.newline_stopper(model, input_ids)

    @staticmethod
    def newline_stopper(model: InferenceModel, input_ids: torch.LongTensor) -> bool:
        """Stop once every row's last token is a newline (a batch cannot stop one row alone)."""
        if "newline_in_sequence" not in model.gen_state:
            model.gen_state["newline_in_sequence"] = [False] * len(input_ids)
        for sequence_idx, batch_sequence in enumerate(input_ids):
            if model.tokenizer.decode(batch_sequence[-1]) == "\n":
                model.gen_state["newline_in_sequence"][sequence_idx] = True
        if all(model.gen_state["newline_in_sequence"]):
            del model.gen_state["newline_in_sequence"]
            return True
        return False

    @staticmethod
    def sentence_end_stopper(model: InferenceModel, input_ids: torch.LongTensor) -> bool:
        """Stop once every row's last token ends a sentence."""
        if "sentence_end_in_sequence" not in model.gen_state:
            model.gen_state["sentence_end_in_sequence"] = [False] * len(input_ids)
        for sequence_idx, batch_sequence in enumerate(input_ids):
            if model.tokenizer.decode(batch_sequence[-1]).rstrip().endswith((".", "!", "?")):
                model.gen_state["sentence_end_in_sequence"][sequence_idx] = True
        if all(model.gen_state["sentence_end_in_sequence"]):
            del model.gen_state["sentence_end_in_sequence"]
            return True
        return False


class PostTokenHooks:
    @staticmethod
    def stream_tokens(model: InferenceModel, input_ids: torch.LongTensor) -> None:
        if not model.gen_state.get("do_streaming"):
            return
        if not utils.koboldai_vars.output_streaming:
            return
        data = [
            utils.applyoutputformatting(utils.decodenewlines(model.tokenizer.decode(x[-1])),
                                        no_sentence_trimming=True, no_single_line=True)
            for x in input_ids
        ]
        utils.koboldai_vars.actions.stream_tokens(data)


# ------------------------------------------------------------------------------------ aiserver.py flows


def _module(name: str, **attrs: Any) -> ModuleType:
    mod = ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@dataclass
class Registry:
    model_backends: Dict[str, Any] = field(default_factory=dict)
    module_names: Dict[str, str] = field(default_factory=dict)
    crosswalk: Dict[str, List[str]] = field(default_factory=dict)
    import_errors: Dict[str, str] = field(default_factory=dict)


class UnitedHost:
    """A United root folder plus the emulated modules; use as a context manager."""

    MODULES = ("utils", "modeling", "modeling.inference_model", "modeling.stoppers", "modeling.post_token_hooks",
               "modeling.logits_processors")

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.plugins = self.root / "modeling" / "inference_models"
        self.plugins.mkdir(parents=True, exist_ok=True)
        (self.root / "aiserver.py").touch()
        (self.root / "settings").mkdir(exist_ok=True)
        self.vars = KoboldVars()
        self.registry = Registry()
        self.model: Any = None
        self.tokenizer: Any = None
        self._saved: Dict[str, Any] = {}
        self._cwd = ""

    def __enter__(self) -> UnitedHost:
        utils.koboldai_vars = self.vars
        modeling = _module("modeling")
        modeling.__path__ = [str(self.root / "modeling")]
        modules = {
            "utils": utils,
            "modeling": modeling,
            "modeling.inference_model": _module(
                "modeling.inference_model", InferenceModel=InferenceModel, GenerationResult=GenerationResult,
                GenerationSettings=GenerationSettings, ModelCapabilities=ModelCapabilities,
                GenerationMode=GenerationMode),
            "modeling.stoppers": _module("modeling.stoppers", Stoppers=Stoppers),
            "modeling.post_token_hooks": _module("modeling.post_token_hooks", PostTokenHooks=PostTokenHooks),
            "modeling.logits_processors": _module(
                "modeling.logits_processors", LuaIntegration=LuaIntegration,
                PhraseBiasLogitsProcessor=PhraseBiasLogitsProcessor, ProbabilityVisualization=ProbabilityVisualization),
        }
        for name, mod in modules.items():
            self._saved[name] = sys.modules.get(name)
            sys.modules[name] = mod
        self._cwd = os.getcwd()
        os.chdir(self.root)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.model is not None:
            self.model.unload()
        os.chdir(self._cwd)
        for name in [n for n in sys.modules if n.startswith("modeling.inference_models")]:
            del sys.modules[name]
        for name, mod in self._saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod

    def discover(self) -> Registry:
        """aiserver.py's import-time scan of modeling/inference_models/<folder>/class.py."""
        reg = self.registry = Registry()
        for folder in sorted(os.listdir(self.plugins)):
            full = self.plugins / folder
            if not full.is_dir():
                continue
            if os.listdir(full) == ["__pycache__"]:
                shutil.rmtree(full)
                continue
            try:
                module = importlib.import_module(f"modeling.inference_models.{folder}.class")
                name = module.model_backend_name
                if name in reg.model_backends:
                    raise RuntimeError(f"Duplicate model backend name {name!r}")
                backend = module.model_backend()
                if "disable" in vars(backend) and backend.disable:
                    continue
                reg.model_backends[name] = backend
                reg.module_names[name] = folder
                reg.crosswalk.setdefault(module.model_backend_type, []).append(name)
            except RuntimeError:
                raise
            except Exception as exc:  # United only logs a broken backend
                reg.import_errors[folder] = f"{type(exc).__name__}: {exc}"
        return reg

    def select_folder(self, name: str, path: str, menu: str = "Custom") -> Dict[str, List[Dict[str, Any]]]:
        """select_model for a custom folder: every backend's is_valid, then get_requested_parameters."""
        valid = {}
        for backend_name, backend in self.registry.model_backends.items():
            if backend.is_valid(name, path, menu):
                valid[backend_name] = backend.get_requested_parameters(name, path, menu)
        return {"model_backends": valid}

    def resubmit(self, data: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
        """resubmit_model_info: ask the valid backends again with the form's current values."""
        return {"model_backends": {
            name: self.registry.model_backends[name].get_requested_parameters(
                data["name"], data.get("path"), data["menu"], parameters=data)
            for name in data["valid_backends"]
        }}

    def _after_load(self, backend: Any) -> None:
        self.model = backend
        self.vars.model = backend.model_name if backend.model_name != "Not Defined" else getattr(backend, "id", "")
        self.tokenizer = backend.tokenizer
        # final_startup(): warm the tokenizer up on ids from GPT-2's vocabulary
        utils.decodenewlines(self.tokenizer.decode([25678, 559]))
        self.tokenizer.encode(utils.encodenewlines("eunoia"))

    def load(self, plugin: str, data: Dict[str, Any], initial_load: bool = False) -> Any:
        """load_model socket event: unload the old model, set_input_parameters, load."""
        if self.model is not None:
            self.model.unload()
        backend = self.registry.model_backends[plugin]
        backend.set_input_parameters(dict(data, plugin=plugin))
        backend.load(initial_load=initial_load, save_model=False)
        self._after_load(backend)
        return backend

    def cli_load(self, model: str, plugin: str, path: Optional[str], parameters: Dict[str, Any]) -> Any:
        """--model X --model_backend NAME --path P --model_parameters {...}: defaults fill the gaps."""
        backend = self.registry.model_backends[plugin]
        values: Dict[str, Any] = {}
        for param in backend.get_requested_parameters(model, path, ""):
            if param["uitype"] == "Valid Display":
                continue
            if param["id"] in parameters:
                values[param["id"]] = parameters[param["id"]]
            elif param["default"] == "":
                raise SystemExit(f"{param['id']} needs a value")
            else:
                values[param["id"]] = param["default"]
        values.update(id=model, model=model, path=path, menu_path="")
        backend.set_input_parameters(values)
        backend.load(initial_load=True, save_model=False)
        self._after_load(backend)
        return backend

    def put_model(self, model: str, plugin: str) -> Any:
        """PUT /api/v1/model: unload, set koboldai_vars.model, load with no set_input_parameters."""
        if self.model is not None:
            self.model.unload()
        self.vars.model = model
        backend = self.registry.model_backends[plugin]
        backend.load(initial_load=False, save_model=False)
        self._after_load(backend)
        return backend

    def generate(self, text: str) -> List[str]:
        """What aiserver's generate() does with core_generate's output for one story action."""
        kv = self.vars
        tokens = self.tokenizer._koboldai_header + self.tokenizer.encode(utils.encodenewlines(text))
        kv.generated_tkns = 0
        start = time.time()
        genout, already_generated = self.model.core_generate(tokens, set())
        log.debug("core_generate took %.2fs", time.time() - start)
        return [utils.decodenewlines(self.tokenizer.decode(row[-already_generated:])) if already_generated else ""
                for row in genout]
