"""The KoboldAI United backend: the `model_backend` class United instantiates once from
modeling/inference_models/kobold_backend/class.py, built over United's InferenceModel when it is importable.

Generation runs through the engine's Generator; this module only translates United's protocol
(parameters, settings files, GenerationSettings, hooks, stoppers, batches, GenerationResult).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kobold_backend.errors import RequestError
from kobold_backend.host.settings import PLUGIN_FOLDER, read_settings, write_settings

PASSTHROUGH_ENV = "KOBOLD_BACKEND_PASSTHROUGH"

model_backend_name = "kobold_backend"
model_backend_type = "GPTQ"

log = logging.getLogger(__name__)

def engine_problem() -> Optional[str]:
    """Why the engine cannot run in this interpreter (None when it can)."""
    try:
        import torch

        from kobold_backend.engine import generator, loader  # noqa: F401
    except Exception as exc:  # any import failure disables the backend, as United expects
        return f"the engine cannot be imported here ({type(exc).__name__}: {exc})"
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 1):
        return f"kobold_backend needs torch 2.1 or newer, found {torch.__version__}"
    return None


def resolve_model_path(model_name: Optional[str], model_path: Optional[str]) -> Optional[Path]:
    """United's rule: the given path if it exists, else models/<name with / -> _>, else the name itself."""
    candidates = []
    if model_path:
        candidates.append(Path(model_path))
    if model_name:
        candidates.append(Path("models") / model_name.replace("/", "_"))
        candidates.append(Path(model_name))
    for path in candidates:
        if path.is_dir() or path.suffix == ".gguf" and path.is_file():
            return path
    return None


def _safetensors_names(path: Path) -> List[str]:
    """Tensor names from a safetensors header, without reading any tensor data."""
    from kobold_backend.engine.weights import safetensors_header

    return list(safetensors_header(path))


def check_model_folder(path: Path) -> Optional[str]:
    """Why this folder (or .gguf file) is not a model this engine can run (None when it is): config.json, tokenizer
    and safetensors headers only, or a GGUF file's metadata, so United's folder browser stays fast."""
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.weights import safetensors_files
    from kobold_backend.errors import ModelFormatError

    if path.suffix == ".gguf":
        return _check_gguf(path)
    try:
        config = ModelConfig.from_dir(path)
        files = safetensors_files(path)
        names = set()
        for file in files:
            names.update(_safetensors_names(file))
    except (ModelFormatError, OSError, ValueError) as exc:
        return str(exc)
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        return f"{path} has no tokenizer.json or tokenizer.model"
    names.update(config.description.stored_names(sorted(names)))
    if "model.embed_tokens.weight" not in names:
        return f"{path} has no model.embed_tokens.weight tensor"
    layout = config.description.layout(config, 0)
    # q_proj, Phi-3's qkv_proj, or (a layer whose mixer and experts the description loads) their first
    first = next(iter({**layout.linears, **layout.mlp_linears}.values()))
    q = f"model.layers.0.{first.prefix}"
    if f"{q}.qweight" in names and config.quant is None:
        return f"{path} holds GPTQ tensors but no quantization config"
    if not any(f"{q}.{t}" in names for t in ("weight", "qweight", "q_weight")):  # dense, GPTQ/AWQ, EXL2
        return f"{path} has no {q} weights"
    return None


def _check_gguf(path: Path) -> Optional[str]:
    from kobold_backend.engine.gguf.checkpoint import gguf_config, is_gguf
    from kobold_backend.engine.gguf.file import GGUFFile
    from kobold_backend.engine.gguf.tokenizer_files import tokenizer_files
    from kobold_backend.errors import ModelFormatError

    if not is_gguf(path):
        return f"{path} is not a GGUF file"
    try:
        gguf_config(path)
        gguf = GGUFFile(path)
        try:
            tokenizer_files(gguf.metadata, path.name)
        finally:
            gguf.close()
    except (ModelFormatError, OSError, ValueError) as exc:
        return str(exc)
    return None


class StandaloneCapabilities:
    """United's ModelCapabilities fields, for use outside United."""

    def __init__(self, **values: bool) -> None:
        self.embedding_manipulation = False
        self.post_token_hooks = False
        self.stopper_hooks = False
        self.post_token_probs = False
        self.api_host = True
        self.uses_tpu = False
        self.__dict__.update(values)


class StandaloneInferenceModel:
    """The parts of United's InferenceModel this backend relies on, used when United is not importable."""

    def __init__(self) -> None:
        self.abort = False
        self.gen_state: Dict[str, Any] = {}
        self.post_token_hooks: List[Callable[..., Any]] = []
        self.stopper_hooks: List[Callable[..., Any]] = []
        self.logits_processors: List[Any] = []
        self.tokenizer: Any = None
        self.capabilties = StandaloneCapabilities()
        self.model_name = "Not Defined"

    def load(self, save_model: bool = False, initial_load: bool = False) -> None:
        self._pre_load()
        self._load(save_model=save_model, initial_load=initial_load)
        self._post_load()
        self._save_settings()

    def _pre_load(self) -> None:
        """Called before _load()."""

    def _post_load(self) -> None:
        """Called after _load()."""

    def _save_settings(self) -> None:
        """Called after _post_load()."""

    def _load(self, save_model: bool, initial_load: bool) -> None:
        raise NotImplementedError

    def _post_token_gen(self, input_ids: Any) -> None:
        for hook in self.post_token_hooks:
            hook(self, input_ids)

    def abort_generation(self, abort: bool = True) -> None:
        self.abort = abort


class StandaloneResult:
    """United's GenerationResult for is_whole_generation backends, used when United is not importable."""

    def __init__(self, model: Any, out_batches: Any, prompt: Any, is_whole_generation: bool,
                 output_includes_prompt: bool = False, single_line: bool = False) -> None:
        import numpy as np

        self.encoded = out_batches[:, len(prompt):] if output_includes_prompt else out_batches
        self.prompt = prompt
        self.is_whole_generation = is_whole_generation
        self.decoded = [model.tokenizer.decode(row) for row in self.encoded]
        if single_line:
            self.decoded = [text.split("\n", 1)[0] for text in self.decoded]
            rows = model.tokenizer(self.decoded).input_ids
            width = max((len(r) for r in rows), default=0)
            pad = model.tokenizer.pad_token_id or 0
            self.encoded = np.array([r + [pad] * (width - len(r)) for r in rows], dtype=np.int64)


class KoboldBackendMixin:
    """United's backend contract over the engine; mixed in front of United's InferenceModel."""

    _host: Optional[ModuleType] = None
    _result_class: Any = StandaloneResult

    def __init__(self) -> None:
        self._abort_event = threading.Event()
        super().__init__()  # type: ignore[call-arg]
        self.disable_reason = engine_problem()
        self.disable = self.disable_reason is not None
        if self.disable:
            log.warning("kobold_backend is disabled: %s", self.disable_reason)
        self.settings_dir: Optional[Path] = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.loaded: Any = None
        self.generator: Any = None
        self.model_config: Any = None
        self.model_name = ""
        self.path: Optional[str] = None
        self.input_values: Optional[Dict[str, Any]] = None
        self.load_values: Dict[str, Any] = {}
        self.bracket_tokens: List[int] = []
        self._passthrough_config: Any = None
        self.last_passthrough_results: List[Any] = []
        self._setup_united_hooks()

    @property
    def abort(self) -> bool:  # type: ignore[override]
        return self._abort_event.is_set()

    @abort.setter
    def abort(self, value: bool) -> None:
        if value:
            self._abort_event.set()
        else:
            self._abort_event.clear()

    def _setup_united_hooks(self) -> None:
        """United's streaming hook and stoppers, and the capabilities that enable them (as ExLlama does)."""
        host = self._host
        if host is None:
            self.capabilties = StandaloneCapabilities(post_token_hooks=True, stopper_hooks=True)
            return
        self.capabilties = host.ModelCapabilities(
            embedding_manipulation=False, post_token_hooks=True, stopper_hooks=True, post_token_probs=False
        )
        try:
            from modeling.post_token_hooks import PostTokenHooks
            from modeling.stoppers import Stoppers
        except ImportError as exc:
            log.warning("United's hooks are not importable (%s); streaming and stop sequences are off", exc)
            return
        self.post_token_hooks = [PostTokenHooks.stream_tokens]
        self.stopper_hooks = [
            Stoppers.core_stopper,
            Stoppers.dynamic_wi_scanner,
            Stoppers.singleline_stopper,
            Stoppers.chat_mode_stopper,
            Stoppers.stop_sequence_stopper,
        ]

    @staticmethod
    def _vars() -> Any:
        """United's koboldai_vars (None outside United)."""
        return getattr(sys.modules.get("utils"), "koboldai_vars", None)

    # ------------------------------------------------------------------ discovery and parameters

    def is_valid(self, model_name: str, model_path: Optional[str], menu_path: str) -> bool:
        if self.disable:
            return False
        path = resolve_model_path(model_name, model_path)
        if path is None:
            return False
        problem = check_model_folder(path)
        if problem is not None:
            log.debug("kobold_backend cannot run %s: %s", path, problem)
            return False
        return True

    def _saved_values(self, model_name: Optional[str], model_path: Optional[str]) -> Dict[str, Any]:
        for key in (model_name, model_path):
            if key:
                saved = read_settings(key, self.settings_dir)
                if saved:
                    return saved
        return {}

    def get_requested_parameters(
        self, model_name: str, model_path: Optional[str], menu_path: str, parameters: Optional[Dict[str, Any]] = None
    ) -> List[Dict[str, Any]]:
        from kobold_backend.engine.load_options import requested_parameters

        path = resolve_model_path(model_name, model_path)
        values = self._saved_values(model_name, model_path)
        values.update(parameters or {})
        return requested_parameters(path, values)

    def set_input_parameters(self, parameters: Dict[str, Any]) -> None:
        """Keep the submitted values for _load (United's base would setattr every key, including "model")."""
        self.input_values = dict(parameters)
        self.model_name = str(
            parameters.get("custom_model_name") or parameters.get("id") or parameters.get("name")
            or parameters.get("model") or ""
        )
        self.path = parameters.get("path") or None

    # ------------------------------------------------------------------ loading

    def _load(self, save_model: bool, initial_load: bool) -> None:
        from kobold_backend.engine.config import ModelConfig
        from kobold_backend.engine.generator import Generator
        from kobold_backend.engine.load_options import planned_load_options
        from kobold_backend.engine.loader import load_model
        from kobold_backend.errors import ModelFormatError
        from kobold_backend.host.tokenizer_adapter import UnitedTokenizer

        if self.disable:
            raise RuntimeError(f"kobold_backend is disabled: {self.disable_reason}")
        self._release()
        values = self.input_values
        if values is None:
            # PUT /api/v1/model loads without set_input_parameters: United has put the name in koboldai_vars.
            kv = self._vars()
            self.model_name = str(getattr(kv, "model", "") or self.model_name)
            self.path = None
            values = self._saved_values(self.model_name, None)
        path = resolve_model_path(self.model_name, self.path)
        if path is None:
            raise ModelFormatError(f"No model folder found for {self.model_name or self.path!r}.")
        self.model_config = ModelConfig.from_dir(path)
        options = planned_load_options(values, path)
        self.load_values = options.values
        self.loaded = load_model(path, progress=self._progress, **options.load_kwargs())
        self.model = self.loaded.model
        self.generator = Generator(self.loaded.model, self.loaded.tokenizer)
        self.generator.use_speculation(self.loaded.speculation)
        self.tokenizer = UnitedTokenizer(self.loaded.tokenizer)
        self.path = str(path)
        if not self.model_name or self.model_name == "Not Defined":
            self.model_name = self.loaded.name

    def _progress(self, done: int, total: int, message: str) -> None:
        """United's load progress bar reads koboldai_vars.total_layers / loaded_layers."""
        kv = self._vars()
        if kv is None:
            return
        if hasattr(kv, "total_layers"):
            kv.total_layers = total
        if hasattr(kv, "loaded_layers"):
            kv.loaded_layers = done
        if hasattr(kv, "status_message"):
            kv.status_message = "" if done >= total else f"Loading {message}"

    def _post_load(self) -> None:
        self.tokenizer._koboldai_header = []
        self.bracket_tokens = self.tokenizer.token_ids_containing("[]")

    def _save_settings(self) -> None:
        if self.model_name and self.load_values:
            write_settings(self.model_name, self.load_values, self.settings_dir)

    def _release(self) -> None:
        """Free the model, its caches and the GPU memory they held."""
        loaded = self.loaded
        self.loaded = self.generator = self.model = self.tokenizer = None
        if loaded is not None:
            loaded.unload()
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def unload(self) -> None:
        self._release()
        self.input_values = None
        self.path = None

    # ------------------------------------------------------------------ generation

    def _sampler_settings(self, gen_settings: Any, banned: Sequence[int]) -> Any:
        """The sampler settings United sends (its names and defaults: engine/sampler_fields.py), United's
        repetition-penalty rule, and the banned ids."""
        from kobold_backend.engine.sampler_fields import united_values
        from kobold_backend.engine.sampling import SamplerSettings

        values = united_values(lambda name: getattr(gen_settings, name, None) if gen_settings is not None else None)
        return SamplerSettings(**values, rep_pen_mode="kobold_united", banned_token_ids=tuple(sorted(set(banned))))

    def _banned_ids(self) -> Tuple[List[int], bool]:
        """(ids never sampled, whether EOS is banned): BOS always; EOS and every token with "[" or "]"
        when United's use_default_badwordsids is on (EOS stays allowed in "until EOS" mode)."""
        tok = self.tokenizer
        banned = [tok.bos_token_id] if tok.bos_token_id is not None else []
        kv = self._vars()
        if kv is not None and getattr(kv, "use_default_badwordsids", False):
            banned += self.bracket_tokens
            if not self.gen_state.get("allow_eos"):
                return banned, True
        return banned, False

    def _united_request(self, prompt: List[int], max_new: int, gen_settings: Any, batch_count: int,
                        seed: int) -> Any:
        """United's generation call as the engine's request: BOS prepended, an unbounded length (United sends 1e7
        for its "forever" modes) filling the rest of the cache, the oldest prompt tokens dropped to fit, United's
        sampler settings and bans, batch_count completions."""
        from kobold_backend.engine.request import GenerationRequest, fit_ids, new_tokens_to_fill

        size = self.generator.max_context
        bos = self.tokenizer.bos_token_id
        head = [bos] if bos is not None and (not prompt or prompt[0] != bos) else []
        prompt = head + prompt
        if max_new >= size:
            max_new = new_tokens_to_fill(size, min(len(prompt), size - 1))
        if len(prompt) > size - max_new:
            log.warning("prompt of %d tokens + %d new exceeds the %d-token context; dropping the oldest",
                        len(prompt), max_new, size)
            prompt = fit_ids(prompt, size - max_new, bos)
        banned, ban_eos = self._banned_ids()
        return GenerationRequest(
            prompt_ids=prompt, max_new_tokens=max_new, settings=self._sampler_settings(gen_settings, banned),
            ban_eos=ban_eos, seed=seed, abort=self._abort_event, n=max(1, int(batch_count)),
        )

    def _raw_generate(
        self,
        prompt_tokens: Any,
        max_new: int,
        gen_settings: Any = None,
        single_line: bool = False,
        batch_count: int = 1,
        seed: Optional[int] = None,
        **kwargs: Any,
    ) -> Any:
        import numpy as np
        import torch

        if self.generator is None:
            raise RuntimeError("kobold_backend has no model loaded")
        if int(max_new) < 1:
            return self._result_class(model=self, out_batches=np.zeros((max(1, int(batch_count)), 0), np.int64),
                                      prompt=prompt_tokens, is_whole_generation=True)
        original = [int(t) for t in np.asarray(prompt_tokens).reshape(-1)]
        # No seed: draw one from torch's global RNG, which United seeds for API calls with sampler_seed.
        base_seed = int(seed) if seed is not None else int(torch.randint(0, 2 ** 62, (1,)).item())
        req = self._united_request(original, int(max_new), gen_settings, batch_count, base_seed)
        eos = set(self.tokenizer.eos_token_ids)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.abort = False
        spec = kwargs.get("passthrough")
        self.last_passthrough_results = []

        def hooks(row: int) -> Any:
            passthrough = self._passthrough(spec, len(req.prompt_ids), req.max_new_tokens)
            if passthrough is not None and hasattr(passthrough, "results"):
                self.last_passthrough_results.append(passthrough)
            return passthrough

        streams = self.generator.stream_rows(req, hooks)
        tokens: List[List[int]] = [[] for _ in streams]
        done = [False] * len(streams)

        def finish(i: int) -> None:
            if not done[i]:
                done[i] = True
                streams[i].close()

        try:
            steps = 0
            while True:
                for i, stream in enumerate(streams):
                    if done[i]:
                        continue
                    event = next(stream)
                    if event.token_id is None or (event.token_id in eos and event.finish_reason is None):
                        finish(i)
                        continue
                    tokens[i].append(event.token_id)
                    if single_line and "\n" in self.tokenizer.decode(event.token_id):
                        finish(i)
                if all(len(row) <= steps for row in tokens):
                    break
                steps += 1
                seq = torch.tensor(
                    [original + row + [pad] * (steps - len(row)) for row in tokens], dtype=torch.long
                )
                self._post_token_gen(seq)
                if self.abort or any(stopper(self, seq) for stopper in self.stopper_hooks):
                    break
                if all(done):
                    break
        finally:
            for i in range(len(streams)):
                finish(i)
            self.abort = False
        width = max(len(row) for row in tokens)
        out = np.array([row + [pad] * (width - len(row)) for row in tokens], dtype=np.int64)
        out = out.reshape(len(tokens), width)
        return self._result_class(
            model=self, out_batches=out, prompt=prompt_tokens, is_whole_generation=True, single_line=single_line
        )

    def _passthrough(self, spec: Any, prompt_tokens: int, budget: int) -> Any:
        """The forward actions of a `passthrough` keyword: a dict spec is validated and built (only when
        KOBOLD_BACKEND_PASSTHROUGH names a folder with vectors/, loras/ and captures/ inside); an object
        with after_layer/linear_delta from Python code is used as it is."""
        if spec is None or not isinstance(spec, dict):
            return spec
        root = os.environ.get(PASSTHROUGH_ENV)
        if not root:
            raise RequestError(f"passthrough is disabled in this backend; set {PASSTHROUGH_ENV} to a folder "
                               "holding vectors/, loras/ and captures/ (docs/passthrough.md)", "passthrough")
        from kobold_backend.engine.passthrough import PassthroughConfig, build_passthrough

        if self._passthrough_config is None:
            base = Path(root)
            self._passthrough_config = PassthroughConfig(vectors_dir=base / "vectors", lora_dir=base / "loras",
                                                         capture_output_dir=base / "captures")
        return build_passthrough(spec, self.generator.model, self._passthrough_config,
                                 prompt_tokens=prompt_tokens, max_new_tokens=budget)


def make_model_backend(host: Optional[ModuleType] = None) -> type:
    """The model_backend class: over United's InferenceModel when `host` is United's
    modeling.inference_model module, else over StandaloneInferenceModel."""
    base = host.InferenceModel if host is not None else StandaloneInferenceModel
    result = host.GenerationResult if host is not None else StandaloneResult
    return type("model_backend", (KoboldBackendMixin, base), {
        "__module__": __name__,
        "__doc__": f"KoboldAI United backend running Hugging Face LLM checkpoints on kobold_backend ({PLUGIN_FOLDER}).",
        "_host": host,
        "_result_class": result,
    })
