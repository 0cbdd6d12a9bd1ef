"""MTP layers in a checkpoint, in DeepSeek-V3's published layout: building them for any decoder, writing them beside
the model's own weights, and reading them back for a model class that registers no MTP keys.

The layout: MTP layer k of a model with L decoder layers sits under `model.layers.{L+k}.`: its decoder block's keys as
the model's own layers name them, plus `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` (transformers' `post_norm`).
The config declares the layers (`num_mtp_layers`, which DeepSeek-V3, GLM-4 MoE and others write as
`num_nextn_predict_layers`). transformers' `MtpModel.from_pretrained(model)` finds these keys through the model
class's `_keys_to_ignore_on_load_unexpected` patterns (DeepSeek-V3's `model.layers.61.*`, Step 3.7's dynamic ones);
for a class without such patterns (Llama, Qwen3, Mistral, ...) `load_mtp_layers` reads them the same way.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..file_writes import replace_file, save_into, write_text

__all__ = ["build_mtp_layers", "load_mtp_layers", "mtp_main_model", "save_mtp_layers"]

_LIFTED = ("enorm.", "hnorm.", "eh_proj.")  # an MTP layer's own modules, stored beside its block's keys
_INDEX = "model.safetensors.index.json"


class _MainModelView:
    """What `MtpModel(main_model, n)` (and transformers' `MtpModel.from_pretrained`) reads of its main model, with a
    copy of its config that declares `n` MTP layers: a model whose config declares none (or declares them as Qwen3.5
    and Qwen3-Next do, `mtp_num_hidden_layers`) gets MTP layers without its own config being changed. Everything else
    is the target's."""

    def __init__(self, target: PreTrainedModel, num_mtp_layers: int, layer_type: str | None = None):
        self._target = target
        self.config = copy.deepcopy(target.config)
        text = self.config.get_text_config(decoder=True)
        text.num_mtp_layers = num_mtp_layers
        if layer_type is not None and getattr(text, "layer_types", None) is not None:
            text.mtp_layer_types = [layer_type] * num_mtp_layers
        for field in ("layer_types", "mlp_layer_types"):  # otherwise the type of the last decoder layer
            types = getattr(text, field, None)
            if types is not None and getattr(text, f"mtp_{field}", None) is None:
                setattr(text, f"mtp_{field}", [types[-1]] * num_mtp_layers)

    def __getattr__(self, name):  # the class's MTP key patterns, dtype, name_or_path, weight conversions, ...
        return getattr(self._target, name)

    def get_decoder(self):
        return self._target.get_decoder()

    def get_input_embeddings(self):
        return self._target.get_input_embeddings()

    @property
    def lm_head(self):
        return self._target.get_output_embeddings()


def mtp_main_model(target: PreTrainedModel, num_mtp_layers: int):
    """What transformers' `MtpModel` and its loader take as the main model: `target` itself when its config declares
    `num_mtp_layers`; for Qwen3.5 / Qwen3-Next configs, which declare `mtp_num_hidden_layers` instead (their
    checkpoints keep the layers under `mtp.`: `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm` and
    `layers.{k}`, full-attention decoder blocks), a view whose config copy declares them."""
    text = target.config.get_text_config(decoder=True)
    if getattr(text, "num_mtp_layers", None) == num_mtp_layers:
        return target
    qwen = getattr(text, "mtp_num_hidden_layers", None) == num_mtp_layers
    return _MainModelView(target, num_mtp_layers, layer_type="full_attention" if qwen else None)


def build_mtp_layers(target: PreTrainedModel, num_mtp_layers: int | None = None):
    """`MtpModel(target, num_mtp_layers)` (embeddings, head and rotary embedding the target's own), in the dtype and
    on the device of the target's last layer; `num_mtp_layers` defaults to what the target's config declares. A
    config that declares none (or another count) is not changed: the layers are built from a copy that declares them.
    The layers' weights are whatever the model class initializes them to."""
    from transformers.modeling_layers import MtpModel

    if target.config.is_encoder_decoder or target.config.get_text_config(decoder=True) is not target.config:
        raise ValueError(
            f"MTP layers are built here for decoder-only language models whose config is the text config; "
            f"{type(target).__name__} is not one."
        )
    declared = getattr(target.config, "num_mtp_layers", None)
    count = declared if num_mtp_layers is None else num_mtp_layers
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(
            f"`num_mtp_layers` must be a positive integer, got {count!r} (the target's config declares "
            f"`num_mtp_layers={declared!r}`). Pass `num_mtp_layers=1` (DeepSeek-V3's count)."
        )
    main = mtp_main_model(target, count)
    last = target.get_decoder().layers[-1]
    weight = next(p for p in last.parameters())
    with torch.device(weight.device):
        model = MtpModel(main, count)
    model.layers.to(dtype=weight.dtype)
    if getattr(model, "shared_post_norm", None) is not None:
        model.shared_post_norm.to(dtype=weight.dtype)
    return model.eval()


def _decoder_layer_count(target: PreTrainedModel) -> int:
    return target.config.get_text_config(decoder=True).num_hidden_layers


def _to_checkpoint_key(name: str, layers: int) -> str:
    """`layers.{k}.<module>` of an `MtpModel` → its key in the published layout."""
    match = re.match(r"layers\.(\d+)\.(.*)", name)
    k, rest = int(match.group(1)), match.group(2)
    if rest.startswith("mtp_block."):
        rest = rest[len("mtp_block.") :]
    elif rest.startswith("post_norm."):
        rest = "shared_head.norm." + rest[len("post_norm.") :]
    return f"model.layers.{layers + k}.{rest}"


def _from_checkpoint_key(key: str, layers: int) -> str:
    """A published-layout key → the `MtpModel` parameter it holds."""
    match = re.match(r"model\.layers\.(\d+)\.(.*)", key)
    k, rest = int(match.group(1)) - layers, match.group(2)
    if rest.startswith("shared_head.norm."):
        return f"layers.{k}.post_norm." + rest[len("shared_head.norm.") :]
    if rest.startswith(_LIFTED):
        return f"layers.{k}.{rest}"
    return f"layers.{k}.mtp_block.{rest}"


def save_mtp_layers(target: PreTrainedModel, mtp_model, save_directory: str | Path) -> None:
    """Saves `target` (`save_pretrained`) with `mtp_model`'s layers beside its weights, in the published layout (see
    the module docstring): a model loaded back from `save_directory` drafts with them through `drafter="mtp"` (and,
    for model types that transformers serves with MTP, through transformers' own `generate(use_mtp=True)`).

    The MTP weights go to a shard of their own, listed with the model's in `model.safetensors.index.json`; the config
    declares the layers (`num_mtp_layers`, and `mtp_layer_types` / `mtp_mlp_layer_types` where the model's config
    has per-layer types). The embeddings and head are the target's, so no copy of them is written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if mtp_model.shared_head is not target.get_output_embeddings():
        raise ValueError(
            "`mtp_model` was not built for this target: its head is not the target's own. Build it with "
            "`hf_specdec.distill.train_mtp_layers(target, ...)` or `MtpModel(target, num_mtp_layers)`."
        )
    if getattr(mtp_model, "shared_post_norm", None) is not None:
        raise ValueError("MTP layers with a shared post norm (Inkling's layout) are not written here.")
    directory = Path(save_directory)
    written = save_into(directory, target.save_pretrained)
    layers = _decoder_layer_count(target)
    tensors = {
        _to_checkpoint_key(name, layers): tensor.detach().to("cpu").contiguous()
        for name, tensor in mtp_model.state_dict().items()
        if name.startswith("layers.")
    }
    index_file = directory / _INDEX
    single = directory / "model.safetensors"
    if _INDEX in written:  # sharded: one more shard
        if single.exists():
            raise ValueError(
                f"{directory} holds a `model.safetensors` from an earlier save, which transformers would load instead "
                f"of the shards just written. Save into an empty folder, or remove that file first."
            )
        index = json.loads(index_file.read_text(encoding="utf-8"))
        mtp_file = "model-mtp.safetensors"
    else:  # one file: made the first of two shards (transformers reads `model.safetensors` alone when it exists)
        with safe_open(str(single), framework="pt") as weights:
            names = list(weights.keys())
        first, mtp_file = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        os.replace(single, directory / first)
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, first)}
    replace_file(directory / mtp_file, lambda file: save_file(tensors, str(file), metadata={"format": "pt"}))
    index["weight_map"].update(dict.fromkeys(tensors, mtp_file))
    index["metadata"]["total_size"] = sum(p.numel() * p.element_size() for p in target.state_dict().values()) + sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    write_text(index_file, json.dumps(index, indent=2, sort_keys=True) + "\n")
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    mtp_config = mtp_model.config
    count_key = target.config.attribute_map.get("num_mtp_layers", "num_mtp_layers")
    config[count_key] = len(mtp_model.layers)
    config.pop("num_mtp_layers" if count_key != "num_mtp_layers" else "num_nextn_predict_layers", None)
    for field in ("layer_types", "mlp_layer_types"):
        if getattr(target.config, field, None) is not None:
            config[f"mtp_{field}"] = list(getattr(mtp_config, field))
    write_text(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _weight_files(directory: Path) -> list[Path]:
    index_file = directory / _INDEX
    if index_file.is_file():
        index = json.loads(index_file.read_text(encoding="utf-8"))
        return [directory / name for name in sorted(set(index["weight_map"].values()))]
    return [directory / "model.safetensors"]


def load_mtp_layers(target: PreTrainedModel):
    """The target's MTP layers read from its local checkpoint (`config.name_or_path`) in the published layout, for a
    model class that registers no MTP key patterns (transformers' `MtpModel.from_pretrained` needs them). Every
    weight of every layer must be there; nothing is unpickled (safetensors only)."""
    from safetensors import safe_open

    directory = Path(target.config.name_or_path)
    if not directory.is_dir():
        raise ValueError(
            f"{type(target).__name__} registers no MTP key patterns, so hf_specdec reads its MTP layers from a local "
            f"checkpoint folder; `config.name_or_path={str(directory)!r}` is not one."
        )
    layers = _decoder_layer_count(target)
    count = target.config.get_text_config(decoder=True).num_mtp_layers
    wanted = re.compile(rf"model\.layers\.({'|'.join(str(layers + k) for k in range(count))})\.")
    model = build_mtp_layers(target, count)
    state = {}
    for file in _weight_files(directory):
        with safe_open(str(file), framework="pt", device="cpu") as weights:
            for key in weights.keys():
                if wanted.match(key):
                    state[_from_checkpoint_key(key, layers)] = weights.get_tensor(key)
    expected = {name for name in model.state_dict() if name.startswith("layers.")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise RuntimeError(
            f"The MTP weights in {directory} do not fit {type(target).__name__}'s MTP layers: missing {missing[:6]}"
            f"{' ...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
        )
    dtype = next(model.layers.parameters()).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)  # copied onto its device
    return model
