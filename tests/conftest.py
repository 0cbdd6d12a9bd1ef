"""Shared fixtures: tiny real transformers models built from configs (no Hub), seeded."""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
from transformers.generation import GenerationMixin

import hf_specdec
from hf_specdec.drafters.base import _REGISTRY as _DRAFTERS
from hf_specdec.mixin import _install_into_transformers
from hf_specdec.policies import _POLICIES

# tiny models gain nothing from intra-op threads, and on a loaded 2-core machine threads oversubscribe badly
torch.set_num_threads(1)


def _config_module_state(name: str):
    """Every entry of a torch config module: its value and whether it is hidden (a `delattr` hides an entry)."""
    module = sys.modules.get(name)
    if module is None:  # not imported yet (inductor loads with the first compile): nothing a test could have changed
        return None
    return {key: entry.hide for key, entry in module._config.items()}, module.get_config_copy()


# set by pytest itself, by `tokenizers` when a process that used its thread pool forks (pipelines' data loaders), and
# by torch's inductor for the compile workers it starts and, on a GPU, for triton's cache and assembler
_ENVIRONMENT_SET_BY_LIBRARIES = (
    "PYTEST_CURRENT_TEST",
    "TOKENIZERS_PARALLELISM",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    "TRITON_CACHE_DIR",
    "TRITON_PTXAS_PATH",
)


def _global_state() -> dict:
    """The process-wide state a test could leave changed behind it, by name."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    )

    registry = transformers.pipelines.PIPELINE_REGISTRY
    return {
        "torch._dynamo.config": _config_module_state("torch._dynamo.config"),
        "torch._inductor.config": _config_module_state("torch._inductor.config"),
        "torch default dtype": torch.get_default_dtype(),
        "torch threads": torch.get_num_threads(),
        "torch grad mode": torch.is_grad_enabled(),
        "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch.Tensor methods": {
            name: torch.Tensor.__dict__.get(name) for name in ("item", "tolist", "__bool__", "cpu")
        },
        "environment variables": {k: v for k, v in os.environ.items() if k not in _ENVIRONMENT_SET_BY_LIBRARIES},
        "hf_specdec drafter registry": dict(_DRAFTERS._classes),
        "hf_specdec policy registry": dict(_POLICIES._classes),
        "transformers pipeline registry": {task: dict(spec) for task, spec in registry.supported_tasks.items()},
        "transformers pipeline aliases": dict(registry.task_aliases),
        # hf_specdec's registration wraps `check_task` on the registry instance (4.x's "translation_XX_to_YY" names)
        "transformers pipeline registry check_task": registry.__dict__.get("check_task"),
        "transformers AutoConfig registry": dict(CONFIG_MAPPING._extra_content),
        "transformers causal LM registry": dict(MODEL_FOR_CAUSAL_LM_MAPPING._extra_content),
        "transformers seq2seq registry": dict(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING._extra_content),
        "GenerationMixin._validate_model_kwargs": GenerationMixin.__dict__["_validate_model_kwargs"],
    }


@pytest.fixture(scope="session", autouse=True)
def installed_into_transformers():
    """What the first `hf_specdec.enable` of a process installs into transformers, once (hf_specdec's pipelines in
    its registry, the hint in its unused-arguments error), installed before the first test.

    Every test then starts from that state, whichever test enables a model first, and `leaves_global_state_as_found`
    fails a test that changes it in any other way. tests/test_enable.py checks, in fresh processes, that importing
    hf_specdec installs nothing and that `enable` and `register_pipelines` install this."""
    _install_into_transformers()


@pytest.fixture(autouse=True)
def leaves_global_state_as_found(request, installed_into_transformers):
    """Fails a test that leaves torch's or transformers' global state (or our registries) changed: a later test, in
    this process or on a fresh machine with another test order, would otherwise run under it."""
    before = _global_state()
    yield
    after = _global_state()
    # a config module first imported during the test (None before) was not changed by it
    changed = sorted(name for name in before if before[name] is not None and before[name] != after[name])
    if changed:
        details = []
        for name in changed:
            if isinstance(before[name], dict) and isinstance(after[name], dict):
                keys = {
                    k for k in before[name].keys() | after[name].keys() if before[name].get(k) != after[name].get(k)
                }
                details.append(f"{name} (keys: {sorted(map(str, keys))[:10]})")
            else:
                details.append(f"{name} ({before[name]!r} -> {after[name]!r})"[:300])
        pytest.fail(
            f"{request.node.nodeid} left global state changed: {'; '.join(details)}. Restore it in the test "
            f"(a context manager, or a `finally`).",
            pytrace=False,
        )


VOCAB = 96

# kwargs that make each architecture tiny; names follow each config class
TINY = {
    "llama": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "mistral": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
    ),
    "qwen2": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32),
    "phi": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gemma": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    ),
}
ARCHITECTURES = sorted(TINY)


def tiny_config(arch: str, **overrides):
    # no special tokens: EOS would end generations at random points and hide the comparison
    kwargs = dict(TINY[arch], vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


# encoder-decoder targets; ids 0-2 are pad (= decoder start), eos and bos, so prompts use ids >= 3
SEQ2SEQ_TINY = {
    # larger initializations than the defaults: outputs that depend on the source and have sharp argmaxes
    "t5": dict(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8, initializer_factor=3.0),
    "bart": dict(
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        init_std=0.3,
    ),
    "marian": dict(
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        init_std=0.3,
    ),
}
SEQ2SEQ_ARCHITECTURES = sorted(SEQ2SEQ_TINY)


def tiny_seq2seq_config(arch: str, **overrides):
    kwargs = dict(
        SEQ2SEQ_TINY[arch],
        vocab_size=VOCAB,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        decoder_start_token_id=0,
        forced_eos_token_id=None,
    )
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def tiny_seq2seq(arch: str, seed: int = 0, **overrides):
    """A tiny encoder-decoder that never emits EOS on its own (generation_config.eos_token_id is None)."""
    torch.manual_seed(seed)
    model = AutoModelForSeq2SeqLM.from_config(tiny_seq2seq_config(arch, **overrides)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    return model


def source(length: int = 10, seed: int = 0) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator)


def tiny_model(arch: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).eval()
    # random-init logits are nearly flat; a larger head makes argmax ties (float noise) irrelevant
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model


def noisy_copy(model, scale: float, seed: int = 1):
    """A partly-right drafter: the target's weights plus Gaussian noise."""
    torch.manual_seed(seed)
    noisy = copy.deepcopy(model)
    # a copy of a model transformers compiled keeps its compiled forward, which runs the original's weights
    noisy.__dict__.pop("_compiled_call", None)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn_like(param) * scale * param.std().clamp(min=1e-3))
    return noisy


@pytest.fixture
def llama_pair():
    target = hf_specdec.enable(tiny_model("llama", seed=0))
    drafter = tiny_model("llama", seed=1)
    return target, drafter


def prompt(length: int = 8, seed: int = 0, vocab: int = VOCAB) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=generator)


class ScriptedDrafter(hf_specdec.Drafter):
    """Proposes a known continuation, corrupting every `period`-th absolute position: acceptance under control.

    `period=1` is never right, `period=None` always right. Deterministic (q is a point mass).
    """

    def __init__(self, reference: torch.LongTensor, period: int | None = None, vocab: int = VOCAB):
        self.reference = reference  # [1, total_len]: the target's own greedy output
        self.period = period
        self.vocab = vocab

    def propose(self, input_ids, num_tokens):
        start = input_ids.shape[1]
        tokens = self.reference[:, start : start + num_tokens].clone()
        if self.period is not None:
            positions = torch.arange(start, start + tokens.shape[1])
            wrong = positions % self.period == self.period - 1
            tokens[:, wrong] = (tokens[:, wrong] + 1) % self.vocab
        return hf_specdec.DraftProposal(tokens=tokens)


@pytest.fixture(scope="session")
def local_tokenizer():
    """A real BPE tokenizer trained here with `tokenizers`, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "the cat sat on the mat and the dog sat on the log",
        "speculative decoding drafts tokens with a small model and verifies them with a large one",
        "def add(a, b):\n    return a + b\n",
        "a quick brown fox jumps over the lazy dog while the cat watches",
    ] * 20
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def benchmark_script(name: str):
    """The benchmark script `benchmarks/<name>.py` as a module, with benchmarks/ on `sys.path` while it is used (the
    scripts import `harness` and `pairs` from there); the path and the modules imported from there are put back."""
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path[:] = saved_path
        for module in set(sys.modules) - saved_modules:
            if (
                getattr(sys.modules[module], "__file__", None)
                and Path(sys.modules[module].__file__).parent == BENCHMARKS
            ):
                del sys.modules[module]


def saved_target(tmp_path, tokenizer):
    """A tiny 4-layer Llama for `tokenizer`, saved with it under `tmp_path / "target"` (for the CLI's path flags)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    return tmp_path / "target"
