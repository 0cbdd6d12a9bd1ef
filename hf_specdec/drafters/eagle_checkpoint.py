"""Reading and writing an EAGLE-3 head in the published layout, from a local directory or the Hub.

The weights use the layout that SGLang (`LlamaForCausalLMEagle3`), vLLM and SpecForge read and write: `fc.weight`,
`midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q, k, v taking 2h inputs; vLLM's `norm_before_residual: true` variant
is read too), `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`,
and a `config.json` with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, `target_hidden_size` and,
when the layers read are not the default, `eagle_config.eagle_aux_hidden_state_layer_ids` (decoder layer ids k,
whose output is entry k + 1 of `output_hidden_states`). The token embeddings are the target's unless the checkpoint
carries its own `embed_tokens.weight`.

Weights are read from safetensors, or from `pytorch_model.bin` with `weights_only=True`: no code is ever unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.activations import ACT2FN

from ..devices import execution_device
from ..file_writes import replace_file, write_text
from ..modeling import logits_width
from .eagle_head import ARCHITECTURE, Eagle3DraftModel, default_eagle_layers, text_config

__all__ = ["HUB_OPTIONS", "check_hub_options", "load_head", "model_card", "save_head"]

WEIGHTS_NAME = "model.safetensors"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
INDEX_NAME = "model.safetensors.index.json"
HUB_OPTIONS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")


def save_head(model: Eagle3DraftModel, save_directory: str | Path, card: str) -> None:
    """Writes `config.json` (recording the layers read, even when the head was loaded from a config that left them
    to the default), `model.safetensors` and the model card `card` (`README.md`) to `save_directory`. Each file is
    written through a new file renamed into place: a link standing there is replaced, never written through."""
    from safetensors.torch import save_file

    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("eagle_layers", None)
    config["architectures"] = [ARCHITECTURE]
    config["eagle_config"] = {
        **(config.get("eagle_config") or {}),
        "eagle_aux_hidden_state_layer_ids": [i - 1 for i in model.config.eagle_layers],
    }
    write_text(directory / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    if model.embed_tokens is not None:
        tensors["embed_tokens.weight"] = model.embed_tokens.weight.detach().contiguous().cpu()
    replace_file(directory / WEIGHTS_NAME, lambda file: save_file(tensors, str(file), metadata={"format": "pt"}))
    write_text(directory / "README.md", card)


def model_card(config: LlamaConfig, target_name: str | None, training_info: dict) -> str:
    """The `README.md` of a saved head: how to load it, its draft vocabulary and features (`config.eagle_layers`,
    set on every head's config, whether its `config.json` named them or left them to the default), what training
    recorded."""
    lines = ["---", "library_name: hf-specdec", "tags:", "- speculative-decoding", "- eagle3"]
    if target_name:
        lines.append(f"base_model: {target_name}")
    lines += [
        "---",
        "",
        "# EAGLE-3 draft head",
        "",
        f"A draft head for `{target_name or 'its target'}` in the EAGLE-3 layout that SGLang and vLLM "
        "read (`LlamaForCausalLMEagle3`), for exact speculative decoding with `hf_specdec`:",
        "",
        "```python",
        "import hf_specdec",
        "drafter = hf_specdec.EagleDrafter.from_pretrained(path, target=model)",
        "out = hf_specdec.enable(model).generate(ids, drafter=drafter)",
        "```",
        "",
        f"- draft vocabulary: {config.draft_vocab_size} of {config.vocab_size} tokens",
        f"- target features: `output_hidden_states` entries {list(config.eagle_layers)}",
    ]
    for key, value in training_info.items():
        lines.append(f"- {key.replace('_', ' ')}: {value}")
    return "\n".join(lines) + "\n"


def load_head(pretrained: str | Path, target: PreTrainedModel, hub_kwargs: dict) -> tuple[Eagle3DraftModel, str]:
    """The head saved at `pretrained` (a local directory or a Hub repo id), checked against `target` and moved to its
    device and dtype, with the name of the target it was trained for (as its config records it)."""
    directory = _resolve(pretrained, hub_kwargs)
    config_path = directory / "config.json"
    try:
        values = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OSError(f"{directory} has no config.json, so it is not an EAGLE-3 head directory.") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise OSError(
            f"{config_path} is not valid JSON ({type(error).__name__}: {error}); download or save the head again."
        ) from None
    if not isinstance(values, dict):
        raise OSError(f"{config_path} holds a JSON {type(values).__name__}, not an object: it is not a head config.")
    tensors = _read_weights(directory)
    tensors = {name.removeprefix("model."): tensor for name, tensor in tensors.items()}
    text = text_config(target)
    vocab = logits_width(target)
    values.pop("architectures", None)
    if "speculators_config" in values or "transformer_layer_config" in values or values.get("norm_before_fc"):
        raise ValueError(
            f"The EAGLE-3 head at {pretrained} uses a layout hf_specdec does not read yet (a `speculators` config, "
            "or `norm_before_fc`); serving it anyway could draft from wrong features. Use a head saved in the "
            "SGLang / EAGLE-3 layout (`LlamaForCausalLMEagle3`)."
        )
    values.setdefault("target_hidden_size", values.get("hidden_size"))
    values.setdefault("norm_before_residual", False)
    fc = tensors.get("fc.weight")
    head = tensors.get("lm_head.weight")
    if fc is None or head is None or "midlayer.self_attn.q_proj.weight" not in tensors:
        raise OSError(
            f"{directory} does not hold EAGLE-3 weights (`fc.weight`, `midlayer.*`, `lm_head.weight`); found "
            f"{sorted(tensors)[:8]}."
        )
    if values.get("draft_vocab_size") is None:
        values["draft_vocab_size"] = head.shape[0]
    config = _config_of(values, config_path, text.num_hidden_layers)
    problems = []
    if config.target_hidden_size != text.hidden_size:
        problems.append(
            f"it reads target hidden states of size {config.target_hidden_size}, the target's are {text.hidden_size}"
        )
    if fc.dim() != 2 or fc.shape[1] != len(config.eagle_layers) * text.hidden_size:
        problems.append(
            f"its `fc` takes {fc.shape[-1]} features, {len(config.eagle_layers)} layers of the target "
            f"give {len(config.eagle_layers) * text.hidden_size}"
        )
    if config.vocab_size != vocab:
        problems.append(f"it maps into a vocabulary of {config.vocab_size} tokens, the target has {vocab}")
    if not all(0 <= i <= text.num_hidden_layers for i in config.eagle_layers):
        problems.append(f"it reads layer outputs {config.eagle_layers}, the target has {text.num_hidden_layers} layers")
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is None and config.hidden_size != text.hidden_size:
        problems.append(
            f"it has no `embed_tokens.weight` of its own, and the target's embeddings ({text.hidden_size} wide) do "
            f"not fit its hidden size {config.hidden_size}"
        )
    if problems:
        raise ValueError(
            f"The EAGLE-3 head at {pretrained} does not fit the target {type(target).__name__}: "
            + "; ".join(problems)
            + ". Use a head trained for this target (or train one with "
            "`hf_specdec.distill.train_eagle_drafter`)."
        )
    model = Eagle3DraftModel(config)
    if "d2t" not in tensors:  # a head over the full vocabulary
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    _check_tensors(tensors, embed, model, pretrained, config_path)
    tensors["d2t"] = tensors["d2t"].long()
    tensors["t2d"] = tensors["t2d"].bool()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [name for name in missing if not name.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(
            f"The EAGLE-3 head at {pretrained} does not match the EAGLE-3 layout: missing {missing}, unexpected "
            f"{unexpected}."
        )
    if embed is not None:
        model.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
    model.to(device=execution_device(target), dtype=target.dtype)
    return model, values.get("_name_or_path") or str(pretrained)


# the sizes a head's config gives its tensors, each a positive int
_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
)


def _config_of(values: dict, config_path: Path, target_layers: int) -> LlamaConfig:
    """The head's config from its `config.json` values, with `eagle_layers` set; a value of the wrong type or an
    impossible combination fails naming the field, its value and the file."""
    fix = f"Fix it in {config_path}, or download or save the head again."
    for name in (*_SIZES, "head_dim"):
        value = values.get(name)
        if (name != "head_dim" or value is not None) and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"The EAGLE-3 head config's `{name}` must be a positive int, got {value!r}. {fix}")
    eps = values.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"The EAGLE-3 head config's `rms_norm_eps` must be a positive number, got {eps!r}. {fix}")
    activation = values.get("hidden_act", "silu")
    if not isinstance(activation, str) or activation not in ACT2FN:
        raise ValueError(
            f"The EAGLE-3 head config's `hidden_act` must be the name of an activation transformers knows (for "
            f"example 'silu'), got {activation!r}. {fix}"
        )
    heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
    if values.get("head_dim") is None and values["hidden_size"] % heads:
        raise ValueError(
            f"The EAGLE-3 head config's `hidden_size` {values['hidden_size']} is not a multiple of "
            f"`num_attention_heads` {heads} (and it gives no `head_dim`). {fix}"
        )
    if heads % kv_heads:
        raise ValueError(
            f"The EAGLE-3 head config's `num_attention_heads` {heads} is not a multiple of `num_key_value_heads` "
            f"{kv_heads}. {fix}"
        )
    eagle_config = values.get("eagle_config")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    if eagle_config is not None and (
        not isinstance(eagle_config, dict)
        or (ids is not None and not (isinstance(ids, list) and all(type(i) is int for i in ids)))
    ):
        raise ValueError(
            f"The EAGLE-3 head config's `eagle_config` must be an object whose `eagle_aux_hidden_state_layer_ids` is "
            f"a list of decoder layer ids (ints), got {eagle_config!r}. {fix}"
        )
    try:
        config = LlamaConfig(**{**values, "architectures": [ARCHITECTURE]})
    except Exception as error:  # transformers' (or huggingface_hub's) validation of the config's fields
        raise ValueError(f"The EAGLE-3 head config is invalid ({type(error).__name__}: {error}). {fix}") from None
    config.eagle_layers = _layers_of(config, target_layers)
    return config


def _check_tensors(tensors: dict, embed, model: Eagle3DraftModel, pretrained, config_path: Path) -> None:
    """Fails, naming each tensor, its size and the size the config gives it, when the weights do not fit the
    config; and when `d2t` maps a draft id outside the target's vocabulary."""
    config = model.config
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    if embed is not None:
        expected["embed_tokens.weight"] = (config.vocab_size, config.hidden_size)
        tensors = {**tensors, "embed_tokens.weight": embed}
    wrong = [
        f"`{name}` is {tuple(tensors[name].shape)}, the config gives {shape}"
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    if wrong:
        sizes = ", ".join(f"{name}={getattr(config, name)}" for name in (*_SIZES, "head_dim"))
        raise ValueError(
            f"The EAGLE-3 head at {pretrained} has weights whose sizes do not match its config ({sizes}): "
            + "; ".join(wrong)
            + f". The weights and {config_path} do not belong together: download or save the head again."
        )
    hot = tensors["d2t"].long() + torch.arange(config.draft_vocab_size)  # the target id of each draft id
    outside = ((hot < 0) | (hot >= config.vocab_size)).nonzero()[:, 0]
    if len(outside):
        first = int(outside[0])
        raise ValueError(
            f"The EAGLE-3 head at {pretrained} has a `d2t` that maps {len(outside)} draft id(s) outside the "
            f"target's vocabulary [0, {config.vocab_size}) (draft id {first} -> target id {int(hot[first])}; "
            "`target = draft + d2t[draft]`): its `d2t` is corrupt, or belongs to another vocabulary. Download or "
            "save the head again."
        )


def _layers_of(config: LlamaConfig, target_layers: int) -> list[int]:
    """Entries of `output_hidden_states` a config reads (its `eagle_aux_hidden_state_layer_ids`, plus one); EAGLE-3's
    default three when it names none (as several published heads do)."""
    ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    return [int(i) + 1 for i in ids] if ids else default_eagle_layers(target_layers)


def check_hub_options(hub_kwargs: dict) -> None:
    """Fails on an option `EagleDrafter` does not take, naming the Hub download options it does."""
    unknown = sorted(set(hub_kwargs) - set(HUB_OPTIONS))
    if unknown:
        raise TypeError(
            f"Unknown option(s) {unknown} for EagleDrafter. Besides `model` / `pretrained`, `target_name`, "
            f"`tree_top_k` and `training_info`, it takes the Hub download options {list(HUB_OPTIONS)}."
        )


def _resolve(pretrained: str | Path, hub_kwargs: dict) -> Path:
    path = Path(pretrained)
    if path.is_dir():
        return path
    if path.exists() or str(pretrained).startswith((".", "/", "~")) or str(pretrained).count("/") > 1:
        raise OSError(f"`pretrained` {str(pretrained)!r} is not a directory holding an EAGLE-3 head.")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(pretrained), allow_patterns=["*.json", "*.safetensors", "*.bin", "*.md"], **hub_kwargs
            )
        )
    except Exception as error:  # offline, unknown repo, gated...
        raise OSError(
            f"Could not load the EAGLE-3 head {str(pretrained)!r}: it is not a local directory, and the Hub download "
            f"failed ({type(error).__name__}: {error}). Pass a local directory, or check the repo id and network."
        ) from error


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The head's tensors, from the files a saved head publishes (as transformers reads them): `model.safetensors`,
    else the shards `model.safetensors.index.json` lists, else `pytorch_model.bin` read with `weights_only=True`
    (plain tensors only: no code is ever unpickled). Other files in the folder are never read."""
    from safetensors.torch import load_file

    index = directory / INDEX_NAME
    if (directory / WEIGHTS_NAME).is_file():
        files = [directory / WEIGHTS_NAME]
    elif index.is_file():
        files = _shards(directory, index)
    else:
        files = []
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                tensors.update(load_file(str(file)))
            except Exception as error:
                raise OSError(f"Could not read the safetensors file {file} ({error}).") from error
        return tensors
    file = directory / PICKLE_WEIGHTS_NAME
    if not file.exists():
        raise OSError(
            f"{directory} holds no `{WEIGHTS_NAME}`, `{INDEX_NAME}` or `{PICKLE_WEIGHTS_NAME}` with EAGLE-3 weights "
            "(other weight files are not read). Save the head with `EagleDrafter.save_pretrained`, or name its "
            f"weights `{WEIGHTS_NAME}`."
        )
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        # torch's first sentence only: the rest of its message suggests `weights_only=False`, which would run the code
        reason = " ".join(str(error).split()).split(". ")[0][:200]
        raise OSError(
            f"Could not read {file} as plain tensors ({type(error).__name__}: {reason}). hf_specdec loads `.bin` heads "
            "with `weights_only=True` and never unpickles code; convert the head to safetensors."
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise OSError(f"{file} does not hold a flat dict of tensors.")
    return state


def _shards(directory: Path, index: Path) -> list[Path]:
    """The shard files `index` (a `model.safetensors.index.json`) lists, each a file name inside `directory`."""
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise OSError(f"{index} is not a safetensors index ({type(error).__name__}: {error}).") from None
    for name in shards:
        if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
            raise OSError(f"{index} lists the shard {name!r}, which is not a file in {directory}.")
    return [directory / name for name in shards]
