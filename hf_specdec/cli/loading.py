"""Targets, drafters and tokenizers for the commands: from the embedded zoo, a local directory or a Hub id, in
safetensors (or GGUF) only; every failure is a `CLIError` that names the path."""

from __future__ import annotations

from pathlib import Path

from .common import CLIError, one_line


def load_target(name: str | None, dtype: str = "float32", gguf_file: str | None = None, **placement):
    """`(target, tokenizer)`: the embedded default when `name` is None, else a local directory or a Hub id (with
    `gguf_file`: that GGUF file in it). `placement`: `device_map`, `offload_folder` or `distributed_config`, passed
    to `from_pretrained`."""
    import torch

    import hf_specdec
    from hf_specdec import zoo

    if name is None:
        if placement:
            raise CLIError(
                "--device-map, --offload-folder and --tp-plan need --target PATH (the embedded zoo model "
                "is loaded whole)"
            )
        target, _, tokenizer = zoo.load_default(dtype=getattr(torch, dtype))
        return hf_specdec.enable(target), tokenizer
    from transformers import AutoTokenizer

    target = hf_specdec.enable(load_model(name, dtype, gguf_file, **placement))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **({"gguf_file": gguf_file} if gguf_file else {}))
    except Exception as err:
        raise CLIError(f"could not load a tokenizer from {name!r}: {one_line(err)}") from None
    return target, tokenizer


def load_model(name: str, dtype: str = "float32", gguf_file: str | None = None, **placement):
    import torch
    from transformers import AutoModelForCausalLM

    if not Path(name).exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise CLIError(f"no such model directory: {name!r}")
    if gguf_file is not None:
        if Path(name).is_dir() and not (Path(name) / gguf_file).is_file():
            raise CLIError(f"--gguf-file {gguf_file!r} is not a file in {name!r}")
        try:
            return AutoModelForCausalLM.from_pretrained(name, gguf_file=gguf_file, dtype=getattr(torch, dtype)).eval()
        except Exception as err:
            raise CLIError(
                f"could not load {gguf_file!r} from {name!r} (GGUF needs `pip install gguf`): {one_line(err)}"
            ) from None
    try:
        # safetensors only: a directory holding only a pickle checkpoint never reaches the unpickler
        return AutoModelForCausalLM.from_pretrained(
            name, dtype=getattr(torch, dtype), use_safetensors=True, **placement
        ).eval()
    except Exception as err:
        hint = ""
        if Path(name).is_dir() and not any(Path(name).glob("*.safetensors")):
            hint = (
                "; hf-specdec loads safetensors only and never unpickles: load the pickle checkpoint where you "
                "trust it and re-save it with `save_pretrained` (which writes safetensors)"
            )
        raise CLIError(f"could not load a model from {name!r}: {one_line(err)}{hint}") from None


def load_drafter(spec: list[str] | None, *, embedded_target: bool, dtype: str = "float32"):
    """`--drafter KIND [PATH]` -> what `generate` takes: `{"assistant_model": ...}` or `{"drafter": ...}`."""
    from hf_specdec import NGramDrafter, zoo

    kind, path = (spec or ["model"])[0], (spec[1] if spec and len(spec) > 1 else None)
    if len(spec or []) > 2:
        raise CLIError(f"--drafter takes a kind and at most one path, got {' '.join(spec)!r}")
    if kind == "prompt_lookup":
        if path is not None:
            raise CLIError("--drafter prompt_lookup takes no path")
        return {"drafter": "prompt_lookup"}
    if kind not in ("ngram", "model"):
        raise CLIError(f"--drafter must be 'prompt_lookup', 'ngram [PATH]' or 'model [PATH]', got {kind!r}")
    if path is None and not embedded_target:
        raise CLIError(f"--drafter {kind} needs a PATH (or Hub id) when --target is not the embedded default")
    if kind == "ngram":
        if path is None:
            return {"drafter": zoo.load_ngram()}
        if not Path(path).exists() and path.startswith((".", "/", "~")):
            raise CLIError(f"no such n-gram drafter directory: {path!r}")
        try:
            return {"drafter": NGramDrafter.from_pretrained(path)}
        except Exception as err:
            raise CLIError(f"could not load an n-gram drafter from {path!r}: {one_line(err)}") from None
    if path is None:
        import torch

        return {"assistant_model": zoo.load_default(dtype=getattr(torch, dtype))[1]}
    return {"assistant_model": load_model(path, dtype)}


def check_vocabulary(target, drafter_kwargs: dict) -> None:
    """Fails early (before any timing) when the drafter cannot draft for this target."""
    from hf_specdec.drafters.model import logits_width

    width = logits_width(target)
    model = drafter_kwargs.get("assistant_model")
    table = drafter_kwargs.get("drafter")
    if model is not None and logits_width(model) != width:
        raise CLIError(
            f"the drafter has a vocabulary of {logits_width(model)} tokens but the target has {width}; "
            "a drafter must share the target's tokenizer"
        )
    if hasattr(table, "vocab_size") and table.vocab_size != width:
        raise CLIError(
            f"the n-gram drafter was built for a vocabulary of {table.vocab_size} tokens but the target "
            f"has {width}; rebuild it with `hf-specdec build-ngram` and the target's tokenizer"
        )
