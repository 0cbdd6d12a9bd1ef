"""LayerSkip self-speculation: the target's own first k layers, its final norm and its head draft.

transformers serves this as `generate(..., assistant_early_exit=k)` (`EarlyExitCandidateGenerator`, for checkpoints
trained to exit early such as `facebook/layerskip-llama3.2-1B`). `EarlyExitDrafter` drafts the same way inside
hf_specdec's round, so it gets what every draft model gets here (trees, padded batches, a static draft cache, the γ
policies), and `generate(..., assistant_early_exit=k)` on an enabled model is the same request as
`drafter="early_exit", drafter_kwargs={"exit_layer": k}`.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from .base import DraftContext, register_drafter
from .model import ModelDrafter
from .model_setup import StaticCachePool

__all__ = ["EarlyExitDrafter", "early_exit_view"]


def early_exit_view(model: PreTrainedModel, exit_layer: int) -> PreTrainedModel:
    """A view of `model` that runs only its first `exit_layer` decoder layers, then its own final norm and head.

    Nothing is copied or changed: the view is a new object of the model's class whose submodules are the model's own
    (embeddings, the first `exit_layer` layers, norm, head, rotary tables), with a copy of the config that says
    `num_hidden_layers=exit_layer`. The model itself keeps every layer and its config; a call that verifies with it
    while the view drafts is unaffected (transformers' own early exit instead lowers the shared config's
    `num_hidden_layers` for the length of each draft)."""
    name = type(model).__name__
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    layers = getattr(base, "layers", None)
    config = getattr(base, "config", None)
    if not isinstance(layers, torch.nn.ModuleList) or getattr(config, "num_hidden_layers", None) != len(layers):
        raise ValueError(
            f"`assistant_early_exit` / `drafter='early_exit'` drafts with the target's first layers, but {name} keeps "
            f"no list of decoder layers where transformers' early exit looks (`model.{prefix}.layers`, as many as "
            "`config.num_hidden_layers`). Use an assistant model or prompt lookup with this model."
        )
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < len(layers):
        raise ValueError(
            f"`exit_layer` (`assistant_early_exit`) must be an int in [1, {len(layers) - 1}]: the number of {name}'s "
            f"{len(layers)} decoder layers that draft, got {exit_layer!r}. LayerSkip checkpoints name the layer "
            "they were trained to exit at (e.g. `assistant_early_exit=4`)."
        )
    view_config = copy.deepcopy(config)
    view_config.num_hidden_layers = exit_layer
    layer_types = getattr(view_config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) != exit_layer:
        try:
            view_config.layer_types = layer_types[:exit_layer]
        except AttributeError:  # a property derived from other fields (Mamba2, Falcon-H1): it may follow the count
            if len(view_config.layer_types) != exit_layer:
                raise ValueError(
                    f"`assistant_early_exit` / `drafter='early_exit'` drafts with {name}'s first {exit_layer} layers, "
                    f"but its config derives `layer_types` from other fields, which hf_specdec cannot cut to "
                    f"{exit_layer} layers. Use an assistant model or prompt lookup with this model."
                ) from None
    _check_keeps_attention(name, config, view_config, exit_layer)
    base_view = _shallow_view(base)
    base_view._modules["layers"] = torch.nn.ModuleList(layers[:exit_layer])
    base_view.config = view_config
    view = _shallow_view(model)
    view._modules[prefix] = base_view
    view.config = view_config if model.config is config else _with_text_config(model.config, view_config)
    return view


def _check_keeps_attention(name: str, config, view_config, exit_layer: int) -> None:
    """A hybrid's first layers may all be linear-attention / SSM layers, while its forward builds an attention mask
    from a key/value layer of its cache (Qwen3.5's `create_causal_mask` reads `get_seq_length`), which the view's
    cache would not have: refused, naming the first exit that keeps one."""
    try:
        full, cut = DynamicCache(config=config).layers, DynamicCache(config=view_config).layers
    except Exception:  # a config transformers builds no cache from: the view's first forward tells
        return
    attention = [index for index, layer in enumerate(full) if isinstance(layer, CacheLayerMixin)]
    if attention and len(cut) == exit_layer and not any(isinstance(layer, CacheLayerMixin) for layer in cut):
        layers = "first layer" if exit_layer == 1 else f"first {exit_layer} layers"
        raise ValueError(
            f"`assistant_early_exit={exit_layer}` / `drafter='early_exit'` would draft with {name}'s {layers}, "
            "linear-attention / state-space layers only, while its forward needs an attention layer in its cache. "
            f"Exit at layer {attention[0] + 1} or later (its first attention layer is layer {attention[0]})."
        )


def _shallow_view(module: torch.nn.Module) -> torch.nn.Module:
    """A new module of the same class sharing `module`'s parameters, buffers and submodules, whose own table of
    submodules may be changed without touching `module`'s. What belongs to `module` as a whole is not carried over:
    its hooks (a counter or a capture on the model is not told of the view's forwards), a `forward` replaced on the
    instance (accelerate's wrapper calls the original module, all of its layers), a compiled forward."""
    view = object.__new__(type(module))
    state = {}
    for key, value in module.__dict__.items():
        if key == "forward" or key.startswith("_compiled"):
            continue
        if "hooks" in key and isinstance(value, dict):
            value = type(value)()
        state[key] = value
    state["_modules"] = dict(module._modules)
    view.__dict__ = state
    return view


def _with_text_config(config, text_config):
    """A copy of a composite model's config whose text config is `text_config`."""
    config = copy.copy(config)
    for key, value in vars(config).items():
        if value is getattr(config, "text_config", None):
            setattr(config, key, text_config)
    return config


class EarlyExitDrafter(ModelDrafter):
    """Drafts with the target's own first `exit_layer` decoder layers, final norm and head (LayerSkip
    self-speculation). The draft cache holds keys and values of those layers only; the verify forward recomputes
    every layer for the drafted positions (transformers' `EarlyExitCandidateGenerator` does too).

    Args:
        exit_layer (`int`):
            How many of the target's decoder layers draft, in [1, num_hidden_layers - 1]. A LayerSkip checkpoint
            drafts well at the layer it was trained to exit at.
        tree_top_k, cache_implementation:
            As for `ModelDrafter`.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    >>> target = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> out = target.generate(ids, assistant_early_exit=2, max_new_tokens=5)
    >>> torch.equal(out, target.generate(ids, max_new_tokens=5, do_sample=False))
    True

    ```
    """

    def __init__(self, exit_layer: int, tree_top_k: int = 4, cache_implementation: str | None = None):
        if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or exit_layer < 1:
            raise ValueError(
                f"`exit_layer` (`assistant_early_exit`) must be a positive int: how many of the target's decoder "
                f"layers draft, got {exit_layer!r}."
            )
        self.exit_layer = exit_layer
        self.init_options = dict(tree_top_k=tree_top_k, cache_implementation=cache_implementation)
        # what the loops read before `reset`; the options themselves are checked by `ModelDrafter` in `reset`
        self.model, self.tree_top_k, self.cache_implementation = None, tree_top_k, cache_implementation
        self.supports_padded_batches = cache_implementation != "static"
        self.static_caches = StaticCachePool()  # kept across calls, as `ModelDrafter`'s (shared by the copies)

    def reset(self, context: DraftContext) -> None:
        # the target's own modules, viewed at the exit layer: built per call (the view is a few small objects)
        static_caches = self.static_caches
        ModelDrafter.__init__(self, early_exit_view(context.target, self.exit_layer), **self.init_options)
        self.static_caches = static_caches
        super().reset(context)


register_drafter("early_exit", EarlyExitDrafter)
