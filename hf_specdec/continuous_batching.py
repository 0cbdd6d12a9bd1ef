"""Speculation inside transformers' continuous batching: `model.generate_batch(..., drafter=...)` and
`model.init_continuous_batching(..., drafter=...)`.

Each step, every decoding request gets up to γ drafts from its own copy of the drafter (a draft model's copy keeps
the request's draft cache, a `DynamicCache` of its own, and drafts the request alone; a feature drafter's copy hears
the target's hidden states of the request's kept positions, `hf_specdec.continuous_features`), and its query in the
packed batch becomes `[last token, drafts...]`: the paged attention reads it like a chunk of prefill. The target's
logits at each of these positions are processed like plain continuous batching's (per-request temperature, top-k,
top-p) and verified per request (Algorithm 1; greedy: the agreeing prefix). The accepted drafts and the target's
token go through the request's own completion check one by one, so EOS and `max_new_tokens` stop inside a block. The
request's write position then moves back over the rejected drafts: their keys and values stay in its blocks until
overwritten, are never read (a request reads its cache up to its position only) and never hashed for prefix sharing
(only blocks completed by accepted tokens are marked). Drafts are trimmed to the step's token budget; a request's
blocks are freed when it finishes or is cancelled, as in plain continuous batching.

How many drafts each request verifies is chosen per step for the whole batch (`hf_specdec.policies.batch`: the
default `auto` policy prices drafts on the step's total query tokens and decodes plainly when they do not pay;
`speculative_gamma_policy="constant"` verifies every draft up to γ). The processor and scheduler are transformers'
own, upgraded in place (`hf_specdec.continuous_steps`): their construction (cache sizing, scheduler choice,
offloading) stays transformers'. The continuous-batching internals change between releases, so only the tested
transformers releases are served (`TESTED_TRANSFORMERS`).
"""

from __future__ import annotations

import contextvars
import copy

import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

from .configuration import SpeculativeOptions, resolve_speculative_options
from .continuous_features import feature_prototype
from .continuous_steps import SpeculativeBatchProcessor, draft_trimming
from .devices import cudnn_attention_off, execution_device
from .drafter_arguments import resolve_drafter
from .drafters.base import Drafter

__all__ = ["TESTED_TRANSFORMERS", "SpeculativeContinuousBatchingManager"]

TESTED_TRANSFORMERS = ((5, 24),)
"""The transformers releases (major, minor) whose continuous-batching internals this module was tested against."""

# the drafting request of the `generate_batch` call running in this thread (read by `init_continuous_batching`)
pending_drafting: contextvars.ContextVar[tuple[Drafter, SpeculativeOptions] | None] = contextvars.ContextVar(
    "hf_specdec_pending_drafting", default=None
)


def check_transformers_release() -> None:
    """Refuses a transformers release whose continuous-batching internals were not tested here."""
    release = Version(transformers.__version__).release[:2]
    if release not in TESTED_TRANSFORMERS:
        tested = ", ".join(f"{major}.{minor}.x" for major, minor in TESTED_TRANSFORMERS)
        raise RuntimeError(
            f"hf_specdec speculates inside continuous batching only with transformers {tested} (its continuous-"
            f"batching internals change between releases); this is transformers {transformers.__version__}. Install "
            f"`transformers=={tested[:-2]}.*`, or drop the drafter from `generate_batch` / `init_continuous_batching`."
        )


def check_drafter(drafter: Drafter, options: SpeculativeOptions) -> None:
    """Refuses what continuous batching cannot serve exactly yet, naming the argument."""
    name = type(drafter).__name__
    if drafter.reads_target_cache:
        raise ValueError(
            f"`drafter={name}` reads the target's key/value cache, which continuous batching keeps in pages of its "
            'own. Use a drafter that reads nothing or only hidden states from the target (`drafter="prompt_lookup"`, '
            '"suffix", a draft model, an EAGLE-3 head, MTP layers), or `generate` with a left-padded batch.'
        )
    if getattr(drafter, "cache_implementation", None) == "static":
        raise ValueError(
            f"`{name}(cache_implementation='static')`: in continuous batching each request drafts with a copy of "
            "the draft model's cache of its own, grown as the request goes. Leave the drafter's cache dynamic "
            "(`cache_implementation=None`)."
        )
    if options.speculative_tree_budget is not None:
        raise ValueError(
            f"`speculative_tree_budget={options.speculative_tree_budget}`: continuous batching verifies chains of "
            "drafts only. Drop `speculative_tree_budget`."
        )
    policy = options.speculative_gamma_policy
    if policy not in ("auto", "constant"):
        raise ValueError(
            f'`speculative_gamma_policy="{policy}"`: continuous batching chooses γ per step for the whole batch '
            '("auto", the default) or drafts a constant γ ("constant"). Pass one of these, or leave it unset.'
        )


class SpeculativeContinuousBatchingManager(ContinuousBatchingManager):
    """transformers' continuous batching manager (same `add_request` / `get_result` / streaming interface) whose
    steps draft and verify; each finished `GenerationOutput` carries the request's `speculative_stats`."""

    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None, *, drafter, options):
        check_transformers_release()
        check_drafter(drafter, options)
        _check_attention_layout(model.config.get_text_config())
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)
        try:
            _check_continuous_batching_config(self.continuous_batching_config)
            _check_processors(self.logit_processor.logits_processor)
            self.prototype = feature_prototype(model, drafter, self.generation_config)
        except ValueError:
            if self._original_attn_impl is not None:  # leave the model as it came
                self.model.set_attn_implementation(self._original_attn_impl)
            raise
        self.drafter, self.options = drafter, options
        self._processors: list[SpeculativeBatchProcessor] = []

    def _run_generation_loop(self, use_inference_mode: bool) -> None:
        try:  # on a GPU without cuDNN's attention while the manager runs, unless `speculative_cudnn_attention`
            with cudnn_attention_off(execution_device(self.model), not self.options.speculative_cudnn_attention):
                super()._run_generation_loop(use_inference_mode)
        finally:  # a feature drafter's capture belongs to this loop's thread
            for processor in self._processors:
                processor.close_capture()

    def _create_batch_processor(self) -> SpeculativeBatchProcessor:
        processor = super()._create_batch_processor()
        if not isinstance(processor, SpeculativeBatchProcessor):
            scheduler = processor.scheduler
            scheduler.__class__ = draft_trimming(type(scheduler))
            processor.__class__ = SpeculativeBatchProcessor
            processor.setup_drafting(self.model, self.drafter, self.options, self.generation_config, self.prototype)
            self._processors.append(processor)
        return processor

    def drafting_matches(self, drafter: Drafter, options: SpeculativeOptions) -> bool:
        """Whether a call asking for `drafter` and `options` may reuse this (cached) manager."""
        same_drafter = self.drafter is drafter or (
            type(self.drafter) is type(drafter) and _same_vars(self.drafter, drafter)
        )
        return same_drafter and self.options == options


def _same_vars(a, b) -> bool:
    try:
        return bool(vars(a) == vars(b))
    except Exception:  # attributes that do not compare (tensors): not the same
        return False


def _check_attention_layout(config) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) is not None or "sliding_attention" in layer_types:
        raise ValueError(
            f"{config.model_type} has sliding-window attention: continuous batching keeps those layers in ring "
            "buffers that a rejected draft would overwrite, so hf_specdec does not draft there yet. Drop the "
            "drafter, or use `generate` with a left-padded batch."
        )


def _check_continuous_batching_config(config) -> None:
    shapes = "verified positions change shape every step"
    refused = {  # name: (set, why it is not served)
        "use_async_batching": (bool(config.use_async_batching), shapes),
        "varlen_compile_config": (config.varlen_compile_config is not None, shapes),
        "decode_compile_config": (config.decode_compile_config is not None, shapes),
        "use_cuda_graph": (any(config.cuda_graph_booleans), shapes),
        "cpu_offload_space": (
            bool(config.cpu_offload_space),
            "a request offloaded to the CPU pool while decoding would re-process its queued drafts as its own tokens",
        ),
    }
    for name, (set_, why) in refused.items():
        if set_:
            raise ValueError(
                f"`ContinuousBatchingConfig({name}=...)` is set, which hf_specdec does not draft with yet ({why}). "
                f"Leave `{name}` unset, or drop the drafter."
            )


# processors that compute each scored position's scores from those scores alone
_POSITION_WISE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    TopHLogitsWarper,
    SuppressTokensLogitsProcessor,
    LogitNormalization,
    InfNanRemoveLogitsProcessor,
)


def _check_processors(processors) -> None:
    """Continuous batching calls the logits processors once per step with the step's tokens, one per scored position
    (not each request's sequence), which a verify step lays out otherwise (several positions per request): a processor
    that reads the tokens or their number (forced BOS / EOS, length penalties, n-gram and multi-token bans, custom ones)
    would compute something else than in a plain step. Only those that act on each position's scores alone are
    served with a drafter."""
    for processor in processors:
        if isinstance(processor, ContinuousBatchingLogitsProcessor) or type(processor) in _POSITION_WISE:
            continue
        if type(processor) in (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor) and all(
            len(sequence) == 1 for sequence in processor.sequence_bias
        ):
            continue  # single-token biases and bans: the same at every position
        raise ValueError(
            f"The generation config adds `{type(processor).__name__}`, which continuous batching calls with the "
            "step's tokens (one per scored position, not each request's sequence): a step that verifies drafts "
            "scores several positions per request, so it would compute something else than in a plain step. With a "
            "drafter, continuous batching serves the processors that act on each position's scores alone "
            "(temperature, top-k / top-p / min-p / typical / epsilon / eta sampling, `suppress_tokens`, single-token "
            "`sequence_bias` and `bad_words_ids`, `renormalize_logits`). Drop the setting or the drafter, or use "
            "`generate` with a left-padded batch."
        )


def drafting_kwargs_error(name: str, value) -> ValueError:
    shown = repr(value) if isinstance(value, (bool, int, float, str, type(None))) else f"<{type(value).__name__}>"
    return ValueError(
        f"`{name}={shown}` is not served inside continuous batching yet. There, hf_specdec drafts with `drafter=...` "
        '(e.g. `drafter="prompt_lookup"`), `drafter_kwargs`, `speculative_gamma`, `speculative_lenience`, '
        "`speculative_verification` and `speculative_cudnn_attention`. Drop it, or use `generate` with a left-padded batch."
    )


# transformers' own drafting settings, which its continuous batching would drop without a word
_TRANSFORMERS_DRAFTING = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "speculation_type")
_NOT_SERVED = ("assistant_tokenizer", *_TRANSFORMERS_DRAFTING)


def take_drafting_request(
    model, generation_config, kwargs: dict, entry: str = "generate_batch"
) -> tuple[Drafter, SpeculativeOptions] | None:
    """Pops the drafting arguments of one `generate_batch` / `init_continuous_batching` call from `kwargs`: the
    drafter and its options, or None when the call does not draft. What is not served here is refused by name.
    `model` None: checked before any model is loaded (a server's arguments). `entry`: the call, as errors name it."""
    for name in _NOT_SERVED:
        value = kwargs.get(name, getattr(generation_config, name, None) if name in _TRANSFORMERS_DRAFTING else None)
        if value not in (None, False):
            raise drafting_kwargs_error(name, value)
    drafter, assistant_model = kwargs.pop("drafter", None), kwargs.pop("assistant_model", None)
    drafter_kwargs = kwargs.pop("drafter_kwargs", None)
    called_with = sorted(
        name for name, value in kwargs.items() if name.startswith("speculative_") and value is not None
    )
    model_config = model.generation_config if model is not None else GenerationConfig()
    options = resolve_speculative_options(kwargs, generation_config, model_config, entry=entry)
    if drafter is None and assistant_model is None:
        if drafter_kwargs is not None or called_with:
            name = "drafter_kwargs" if drafter_kwargs is not None else called_with[0]
            raise ValueError(
                f"`{name}` was given without a drafter, so continuous batching would decode plainly. Pass "
                '`drafter=...` (e.g. `drafter="prompt_lookup"`), or drop it.'
            )
        return None
    drafter = resolve_drafter(drafter, assistant_model, drafter_kwargs, target=model)
    options = options.with_default_gamma(
        getattr(drafter, "default_gamma", None), f"{type(drafter).__name__}.default_gamma"
    )
    return drafter, options


def init_manager(model, parent_init, generation_config, continuous_batching_config, workload_hints, drafting: dict):
    """`model.init_continuous_batching(...)`: transformers' manager, or ours when the call (or the `generate_batch`
    call it serves) drafts. A cached persistent manager is reused only for the same drafting."""
    request = (
        take_drafting_request(model, generation_config, drafting, "init_continuous_batching")
        if drafting
        else pending_drafting.get()
    )
    if drafting:
        raise TypeError(f"`init_continuous_batching` got unexpected keyword arguments {sorted(drafting)}.")
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None:
        same = (
            request is None
            if not isinstance(cached, SpeculativeContinuousBatchingManager)
            else (request is not None and cached.drafting_matches(*request))
        )
        if not same:
            raise ValueError(
                "A persistent continuous batching manager is cached on this model with other drafting settings than "
                "this call's. Call `model.destroy_cached_continuous_batching_manager()` first."
            )
    if request is None or cached is not None:
        return parent_init(generation_config, continuous_batching_config, workload_hints)
    config = generation_config if generation_config is not None else model.generation_config
    if config.eos_token_id is None:  # as transformers does, on a copy: the user's config is never modified
        config = copy.deepcopy(config)
        config.eos_token_id = -1
    if continuous_batching_config is None:
        continuous_batching_config = ContinuousBatchingConfig()
    drafter, options = request
    return SpeculativeContinuousBatchingManager(
        model, config, continuous_batching_config, workload_hints, drafter=drafter, options=options
    )


def paged_generate(model, parent_generate, call, drafter, assistant_model, drafter_kwargs):
    """`generate(..., cache_implementation="paged", drafter=...)`: transformers switches such a call to
    `generate_batch`, which then drafts."""
    drafting = {"drafter": drafter, "assistant_model": assistant_model, "drafter_kwargs": drafter_kwargs}
    for name in [name for name in call.extra if name.startswith("speculative_") or name in _NOT_SERVED]:
        drafting[name] = call.extra.pop(name)
    request = take_drafting_request(model, call.get("generation_config"), drafting, "generate")
    token = pending_drafting.set(request)
    try:
        return parent_generate(*call.args, **call.kwargs)
    finally:
        pending_drafting.reset(token)
