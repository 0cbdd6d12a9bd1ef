"""`hf-specdec serve`: transformers' OpenAI-compatible server (`transformers serve --continuous-batching`: the same
FastAPI app, endpoints, handlers and request format), whose continuous batching drafts and verifies with an
hf_specdec drafter (`hf_specdec.continuous_batching`).

transformers' `Serve` builds its model manager and generation state inside its constructor, so `build_server`
assembles the same parts from transformers' serving modules, with two subclasses:

- `SpeculativeModelManager` loads each model as a causal LM from safetensors (or a GGUF file) and enables it
  (`hf_specdec.enable`);
- `SpeculativeGenerationState` serves requests with continuous batching, through a manager made by
  `model.init_continuous_batching(..., drafter=...)`, or, with `continuous_batching=False` and for the requests
  transformers serves with sequential `generate` (another modality), through transformers' sequential manager, whose
  `model.generate(...)` calls get the drafting arguments too.

No request is decoded without the drafter the server was started with. Needs transformers' serving packages
(`pip install "hf-specdec[serve]"`).
"""

from __future__ import annotations

from pathlib import Path

from transformers.cli.serving.model_manager import ModelManager  # transformers' serving modules import no FastAPI
from transformers.cli.serving.utils import CBGenerateManager, GenerateManager, GenerationState, split_revision
from transformers.utils.import_utils import is_serve_available

from .continuous_batching import check_transformers_release

__all__ = ["SpeculativeGenerateManager", "SpeculativeGenerationState", "SpeculativeModelManager", "build_server"]

SERVE_INSTALL_HINT = 'Install them with `pip install "hf-specdec[serve]"` (FastAPI, uvicorn, openai).'


def check_serve_available() -> None:
    """Refuses to build a server without transformers' serving packages, naming how to install them."""
    if not is_serve_available():
        raise ImportError(f"`hf-specdec serve` needs transformers' serving packages. {SERVE_INSTALL_HINT}")


class SpeculativeModelManager(ModelManager):
    """transformers serve's model manager, loading each model as an enabled causal LM, from safetensors only
    (a GGUF file holds no pickle either)."""

    def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
        from transformers import AutoModelForCausalLM

        from .mixin import enable

        model_id, revision = split_revision(model_id_and_revision)
        if gguf_file is None and Path(model_id).is_dir() and not any(Path(model_id).glob("*.safetensors")):
            raise ValueError(
                f"{model_id!r} holds no safetensors weights; hf-specdec serve loads safetensors only and never "
                "unpickles. Load the checkpoint where you trust it and re-save it with `save_pretrained`."
            )
        kwargs = {
            "revision": revision,
            "attn_implementation": self.attn_implementation,
            "dtype": self.dtype,
            "device_map": self.device,
            "trust_remote_code": self.trust_remote_code,
            "tqdm_class": tqdm_class,
        }
        quantization_config = self.get_quantization_config()
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        else:
            kwargs["use_safetensors"] = True
        if progress_callback is not None:
            progress_callback({"status": "loading", "model": model_id_and_revision, "stage": "model"})
        return enable(AutoModelForCausalLM.from_pretrained(model_id, **kwargs))


class SpeculativeCBGenerateManager(CBGenerateManager):
    """transformers serve's continuous-batching manager, made with the server's drafting arguments."""

    drafting: dict

    def init_cb(self, model, gen_config) -> None:
        if self._cb is not None:
            return
        self._cb = model.init_continuous_batching(
            generation_config=gen_config, continuous_batching_config=self._cb_config, **self.drafting
        )
        self._cb.start()


class _DraftingModel:
    """`model` whose `generate` also gets the server's drafting arguments (every other attribute is the model's)."""

    def __init__(self, model, drafting: dict):
        self._model, self._drafting = model, drafting

    def generate(self, *args, **kwargs):
        return self._model.generate(*args, **kwargs, **self._drafting)

    def __getattr__(self, name):
        return getattr(self._model, name)


class SpeculativeGenerateManager(GenerateManager):
    """transformers serve's sequential manager (`model.generate()` on its inference thread, one request at a time),
    each call drafting with the server's drafting arguments."""

    def __init__(self, drafting: dict):
        super().__init__()
        self.drafting = drafting

    def generate_streaming(self, model, *args, **kwargs):
        return super().generate_streaming(_DraftingModel(model, self.drafting), *args, **kwargs)

    async def generate_non_streaming(self, model, *args, **kwargs):
        return await super().generate_non_streaming(_DraftingModel(model, self.drafting), *args, **kwargs)


class SpeculativeGenerationState(GenerationState):
    """transformers serve's generation state, whose managers draft: continuous batching's (by default) and the
    sequential one (`continuous_batching=False`, or a request continuous batching does not serve)."""

    def __init__(self, drafting: dict, cb_config=None, continuous_batching: bool = True):
        super().__init__(continuous_batching=continuous_batching, compile=False, cb_config=cb_config)
        self.drafting = drafting

    def get_manager(self, model_id: str, use_cb: bool = False):
        if not use_cb:
            if model_id not in self._generate_managers:
                self._generate_managers[model_id] = SpeculativeGenerateManager(self.drafting)
            return self._generate_managers[model_id]
        manager = super().get_manager(model_id, use_cb=True)
        if type(manager) is CBGenerateManager:  # made by transformers, not started yet: upgraded in place
            manager.__class__ = SpeculativeCBGenerateManager
            manager.drafting = self.drafting
        return manager


def build_server(
    model: str | None,
    drafting: dict,
    *,
    device: str = "auto",
    dtype: str = "auto",
    attn_implementation: str | None = None,
    model_timeout: int = 300,
    continuous_batching: bool = True,
    continuous_batching_config=None,
    enable_cors: bool = False,
):
    """transformers serve's FastAPI app (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`,
    `/health`, ...), whose continuous batching drafts with `drafting` (the keyword arguments of
    `init_continuous_batching`: `drafter`, `drafter_kwargs`, `speculative_*`). `model`: preloaded and served for
    every request (a local directory, a Hub id, or `<repo>:<file>.gguf`); None: each request names its model.
    `continuous_batching=False` decodes each request alone with `model.generate(..., **drafting)`, as `transformers
    serve` does without `--continuous-batching` (for models continuous batching does not run: hybrids, sliding
    windows).

    Returns `(app, model_manager, generation_state)`; the app runs under any ASGI server (`hf-specdec serve` uses
    uvicorn). The drafting arguments are checked here, before any model is loaded.
    """
    check_transformers_release()
    _check_drafting(drafting)
    check_serve_available()
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server as build_app
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler

    model_manager = SpeculativeModelManager(
        device=device,
        dtype=dtype,
        attn_implementation=attn_implementation,
        continuous_batching=continuous_batching,
        model_timeout=model_timeout,
        force_model=model,
    )
    state = SpeculativeGenerationState(drafting, continuous_batching_config, continuous_batching)
    app = build_app(
        model_manager,
        ChatCompletionHandler(model_manager=model_manager, generation_state=state, chat_template_kwargs={}),
        completion_handler=CompletionHandler(model_manager=model_manager, generation_state=state),
        response_handler=ResponseHandler(model_manager=model_manager, generation_state=state, chat_template_kwargs={}),
        transcription_handler=TranscriptionHandler(model_manager, state),
        systemone_handler=SystemOneHandler(
            model_manager=model_manager, generation_state=state, chat_template_kwargs={}
        ),
        generation_state=state,
        enable_cors=enable_cors,
    )
    return app, model_manager, state


def _check_drafting(drafting: dict) -> None:
    """The server's drafting arguments, checked as continuous batching checks them, before any model is loaded."""
    from .continuous_batching import check_drafter, take_drafting_request

    if drafting.get("drafter") is None and drafting.get("assistant_model") is None:
        raise ValueError(
            f"`build_server(drafting={drafting!r})` needs a drafter: pass `drafting={{'drafter': 'prompt_lookup'}}` "
            "(`hf-specdec serve --drafter prompt_lookup`); without one, use `transformers serve --continuous-batching`."
        )
    kwargs = dict(drafting)
    request = take_drafting_request(None, None, kwargs, "build_server")
    if kwargs:
        raise TypeError(f"`build_server` got unexpected drafting arguments {sorted(kwargs)}.")
    check_drafter(*request)
