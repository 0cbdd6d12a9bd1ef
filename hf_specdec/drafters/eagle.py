"""`EagleDrafter`: a drafter that reads the target's own hidden states (EAGLE-3, Li et al. 2025).

The draft model is one decoder layer on top of the target's features. At a position t whose next token x_{t+1} is
known, it reads the target's hidden states at three layers (low, middle, high: by default entries 2, L // 2 and
L - 3 of `output_hidden_states`, as SGLang and vLLM capture them), concatenated and projected by `fc`, together with
the embedding of x_{t+1}; its one layer attends over the concatenation `[input_layernorm(embedding),
hidden_norm(features)]` (2h wide), and a final norm and a head over a reduced **draft vocabulary** predict x_{t+2}.
Drafting further, the layer's own output (before the final norm) stands in for the target's features, with the
embedding of the token it drafted, one position further on. Draft ids map to target ids through `d2t`
(`target = draft + d2t[draft]`); `t2d` marks the target ids the draft vocabulary holds.

The network and a new head's initial weights are in `eagle_head.py`; the published checkpoint layout (SGLang's
`LlamaForCausalLMEagle3`, which vLLM and SpecForge read and write too) is read and written by `eagle_checkpoint.py`.

The round hands the drafter the target's hidden states of the positions it keeps, from the verification forward it
runs anyway (`Drafter.target_hidden_layers`, `HiddenStateCapture` in `hf_specdec.capture`): no second target
forward, and only the three layers read are recorded. The first round has no features yet, so it drafts nothing
(that round is the prompt's prefill). Sampling stays exact: a proposal carries the q it sampled from, the draft
logits scattered over the full target vocabulary (`-inf` outside the draft vocabulary) and standardized by the
target's logits processors, so q(x) > 0 for every drafted token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..devices import execution_device
from ..sampling import sample_tokens
from .base import DraftContext, Drafter, DraftProposal, chain_proposal, register_drafter, require_hidden_states
from .eagle_checkpoint import HUB_OPTIONS, check_hub_options, load_head, model_card, save_head
from .eagle_head import Eagle3DraftModel, default_eagle_layers, initial_head, text_config
from .tree_builder import DynamicTree

__all__ = ["Eagle3DraftModel", "EagleDrafter", "default_eagle_layers"]


class EagleDrafter(Drafter):
    r"""
    Drafts with an EAGLE-3 head: one decoder layer that reads the target's own hidden states (see the module
    docstring for the architecture). `generate(drafter="eagle", drafter_kwargs={"pretrained": path})` loads one;
    `hf_specdec.distill.train_eagle_drafter` trains one for any decoder-only target.

    It drafts chains, and dynamic token trees with `speculative_tree_budget` (EAGLE-2: each depth expands the
    `tree_top_k` best nodes, by cumulative log q along their path, with their `tree_top_k` most likely tokens, in one
    draft forward; the proposal keeps the budget's best nodes). Greedy and sampled decoding are both exact.

    Args:
        model (`Eagle3DraftModel`, *optional*):
            The draft network (from `from_pretrained`, `from_target` or training). Give it or `pretrained`.
        pretrained (`str` or `Path`, *optional*):
            A local directory or Hub repo id of an EAGLE-3 head, loaded with `from_pretrained` at the start of each
            call, for the call's target. Give it or `model`.
        target_name (`str`, *optional*):
            The target it was trained for, recorded in the saved model card.
        tree_top_k (`int`, *optional*, defaults to 4):
            Children per expanded tree node, and nodes expanded per depth.
        training_info (`dict`, *optional*):
            What training recorded (data, time, acceptance), for the model card.
        hub_kwargs:
            Hub download options for `pretrained`: `revision`, `token`, `cache_dir`, `local_files_only`,
            `force_download`, `proxies`.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    >>> target = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> drafter = hf_specdec.EagleDrafter.from_target(target)
    >>> plain = target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False)
    >>> fast = target.generate(torch.tensor([[1, 2, 3]]), drafter=drafter, max_new_tokens=8, do_sample=False)
    >>> bool((plain == fast).all())
    True

    ```
    """

    reads_target_hidden_states = True

    def __init__(
        self,
        model: Eagle3DraftModel | None = None,
        *,
        pretrained: str | Path | None = None,
        target_name: str | None = None,
        tree_top_k: int = 4,
        training_info: dict | None = None,
        **hub_kwargs,
    ):
        check_hub_options(hub_kwargs)
        if (model is None) == (pretrained is None):
            raise ValueError(
                "EagleDrafter needs exactly one of `model` (an `Eagle3DraftModel`) or `pretrained` (a local "
                "directory or Hub repo id of an EAGLE-3 head), got "
                f"{'neither' if model is None else 'both'}. For example `drafter_kwargs={{'pretrained': path}}`, or "
                "`EagleDrafter.from_pretrained(path, target=model)`."
            )
        if model is not None and not isinstance(model, Eagle3DraftModel):
            raise TypeError(f"`model` must be an `Eagle3DraftModel`, got {type(model).__name__}.")
        if isinstance(tree_top_k, bool) or not isinstance(tree_top_k, int) or tree_top_k < 1:
            raise ValueError(
                f"`tree_top_k` must be a positive int (children per expanded tree node), got {tree_top_k!r}. "
                "Use `tree_top_k=4` (the default), or any int >= 1."
            )
        self.model = model
        self.pretrained = pretrained
        self.hub_kwargs = hub_kwargs
        self.target_name = target_name
        self.tree_top_k = tree_top_k
        self.training_info = dict(training_info or {})

    # ------------------------------------------------------------------ building, saving and loading
    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        draft_token_ids: Sequence[int] | torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        seed: int = 0,
        **config_overrides,
    ) -> EagleDrafter:
        """A new (untrained) head for `target`: sized like its layers, the draft vocabulary `draft_token_ids` (all
        target ids by default, most useful first), `fc` starting as the high features alone, the head's rows and
        the final norm copied from the target's, so that it starts close to an early exit of the target."""
        model = initial_head(target, draft_token_ids, layers, seed, **config_overrides)
        name = getattr(target.config, "_name_or_path", None) or type(target).__name__
        return cls(model, target_name=name)

    def save_pretrained(self, save_directory: str | Path) -> None:
        """Writes `config.json`, `model.safetensors` (the published EAGLE-3 layout) and a model card."""
        model = self._loaded_model("save_pretrained")
        save_head(model, save_directory, model_card(model.config, self.target_name, self.training_info))

    @classmethod
    def from_pretrained(
        cls, pretrained: str | Path, target: PreTrainedModel, *, tree_top_k: int = 4, **hub_kwargs
    ) -> EagleDrafter:
        """Loads an EAGLE-3 head saved in the published layout (`model.safetensors`, or `pytorch_model.bin` read with
        `weights_only=True`) from a local directory or the Hub, and checks that it fits `target`."""
        check_hub_options(hub_kwargs)
        model, target_name = load_head(pretrained, target, hub_kwargs)
        return cls(model, target_name=target_name, tree_top_k=tree_top_k)

    @classmethod
    def from_options(cls, **options) -> EagleDrafter:
        """`generate(drafter="eagle", drafter_kwargs=options)` lands here: an unknown key fails naming
        `drafter_kwargs` and what it accepts."""
        accepted = ["model", "pretrained", "target_name", "tree_top_k", "training_info", *HUB_OPTIONS]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise TypeError(
                f"Unknown `drafter_kwargs` key(s) {unknown} for EagleDrafter, got drafter_kwargs={options!r}. "
                f"EagleDrafter accepts {accepted}."
            )
        return cls(**options)

    def _loaded_model(self, what: str) -> Eagle3DraftModel:
        if self.model is None:
            raise ValueError(
                f"EagleDrafter.{what} needs a loaded head; load it with `EagleDrafter.from_pretrained("
                f"{self.pretrained!r}, target=model)` first."
            )
        return self.model

    # ------------------------------------------------------------------ drafting
    def reset(self, context: DraftContext) -> None:
        target = context.target
        if target.config.is_encoder_decoder:
            raise ValueError(
                f"EagleDrafter drafts for decoder-only targets; {type(target).__name__} is an encoder-decoder model. "
                "Use `assistant_model=` or prompt lookup with it."
            )
        if self.model is None:  # `drafter="eagle"` with `drafter_kwargs={"pretrained": ...}`: loaded per call
            self.model = EagleDrafter.from_pretrained(self.pretrained, target, **self.hub_kwargs).model
        model = self.model
        text = text_config(target)
        if model.config.target_hidden_size != text.hidden_size or model.config.vocab_size != context.vocab_size:
            raise ValueError(
                f"This EAGLE-3 head was built for a target with hidden size {model.config.target_hidden_size} and "
                f"{model.config.vocab_size} logits, but {type(target).__name__} has hidden size {text.hidden_size} "
                f"and {context.vocab_size} logits. Use a head trained for this target."
            )
        self.target_hidden_layers = list(model.config.eagle_layers)
        self.embeddings = model.embed_tokens if model.embed_tokens is not None else target.get_input_embeddings()
        self.embeddings_device = execution_device(self.embeddings)  # the target's may be offloaded by accelerate
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.target_device = context.input_ids.device
        self.vocab_size = context.vocab_size
        self.hot_ids = model.hot_ids.to(self.target_device)
        self.logits_processor = context.logits_processor
        self.do_sample = context.do_sample
        self.tree_budget = context.tree_budget if context.input_ids.shape[0] == 1 else None
        self.keys = self.values = None  # [1, kv_heads, seen, head_dim]: the layer's cache of real positions
        self.seen = 0  # positions t (with x_{t+1} known) the cache holds
        self.pending = None  # [1, n, features]: target features of positions seen, seen + 1, ... not yet fed

    def _embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        embeds = self.embeddings(token_ids.to(self.embeddings_device))
        return embeds.to(device=self.device, dtype=self.dtype)

    def _scores(self, draft_logits: torch.Tensor, prefixes: torch.LongTensor) -> torch.FloatTensor:
        """Draft logits `[n, draft_vocab]` over the full target vocabulary (`-inf` outside the draft vocabulary),
        standardized by the target's processors with each row's prefix: `[n, vocab]`."""
        full = torch.full((draft_logits.shape[0], self.vocab_size), float("-inf"), device=self.target_device)
        full[:, self.hot_ids] = draft_logits.to(device=self.target_device, dtype=torch.float32)
        return self.logits_processor(prefixes, full)

    def _feed_context(self, input_ids: torch.LongTensor) -> torch.Tensor | None:
        """Feeds the pending target features (positions `seen`..len-2, each with the embedding of the token after
        it) into the layer's cache; returns the layer's output at the last one `[1, 1, h]`, or None without
        features."""
        length = input_ids.shape[1]
        if self.pending is None:
            return None
        if self.seen + self.pending.shape[1] != length - 1:
            raise RuntimeError(
                f"EagleDrafter holds target features up to position {self.seen + self.pending.shape[1] - 1}, but the "
                f"sequence has {length} tokens: the loop did not hand it the hidden states of every kept position."
            )
        features = self.pending.to(device=self.device, dtype=self.dtype)
        start = self.seen
        positions = torch.arange(start, length - 1, device=self.device)[None]
        hidden, keys, values = self.model(
            self._embed(input_ids[:, start + 1 :]),
            features,
            positions,
            project=True,
            past_keys=self.keys,
            past_values=self.values,
        )
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        self.seen, self.pending = length - 1, None
        return hidden[:, -1:]

    @torch.no_grad()
    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        batch = input_ids.shape[0]
        if batch != 1:
            raise ValueError(
                "EagleDrafter drafts for one sequence at a time (hf_specdec gives each row of a batch a copy)."
            )
        if num_tokens == 0:  # a plain step: the features wait, and are fed in one forward when drafts are asked
            return DraftProposal.empty(batch, input_ids.device)
        hidden = self._feed_context(input_ids)
        if hidden is None:
            return DraftProposal.empty(batch, input_ids.device)
        if self.tree_budget is not None:
            return self._propose_tree(input_ids, num_tokens, hidden)
        model = self.model
        ids = input_ids
        probs = []
        keys, values = self.keys, self.values
        position = self.seen - 1  # the last real position
        usable = []  # per step: whether the processors left any draft token (no host sync inside the loop)
        for step in range(num_tokens):
            scores = self._scores(model.logits(hidden[:, -1]).float(), ids)  # [1, vocab]: standardized q
            usable.append(torch.isfinite(scores).any())
            if self.do_sample:
                q = scores.softmax(dim=-1)
                q = torch.where(usable[-1], q, torch.full_like(q, 1.0 / q.shape[-1]))  # cut below if unusable
                token = sample_tokens(q)[:, None]
                probs.append(q)
            else:
                token = scores.argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, token], dim=-1)
            if step + 1 == num_tokens:
                break
            position += 1
            hidden, new_keys, new_values = model(
                self._embed(token),
                hidden,
                torch.full((1, 1), position, device=self.device),
                project=False,
                past_keys=keys,
                past_values=values,
            )
            keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
        return chain_proposal(ids, input_ids.shape[1], usable, probs)

    def _propose_tree(self, input_ids: torch.LongTensor, num_tokens: int, hidden: torch.Tensor) -> DraftProposal:
        """EAGLE-2's dynamic tree ([`DynamicTree`]) over the layer's outputs: `hidden` `[1, 1, h]` is the output at
        the last real position. Each expanded node is fed with the output that predicted it."""
        model, device = self.model, self.device
        tree = DynamicTree(
            self._scores(model.logits(hidden[:, -1]).float(), input_ids).log_softmax(dim=-1),
            self.tree_budget,
            self.tree_top_k,
            device,
        )
        if not len(tree):
            return tree.proposal()
        node_hidden = hidden[0].expand(len(tree), -1)  # [n, h]: the output that predicted each node
        fed_keys = fed_values = None  # [1, kv, expanded, d]
        real = self.keys.shape[2]
        for depth in range(1, num_tokens):
            expansion = tree.expand()
            if expansion is None:
                break
            size = expansion.tokens.shape[0]
            allowed = torch.cat(
                [torch.ones(size, real, dtype=torch.bool, device=device), expansion.mask], dim=1
            )  # [f, real + expanded]
            keys = self.keys if fed_keys is None else torch.cat([self.keys, fed_keys], dim=2)
            values = self.values if fed_values is None else torch.cat([self.values, fed_values], dim=2)
            positions = torch.full((1, size), self.seen - 1 + depth, device=device)
            out, new_keys, new_values = model(
                self._embed(expansion.tokens[None]),
                node_hidden[expansion.nodes.to(device)][None],
                positions,
                project=False,
                past_keys=keys,
                past_values=values,
                mask=allowed[None, None],
            )
            fed_keys = new_keys if fed_keys is None else torch.cat([fed_keys, new_keys], dim=2)
            fed_values = new_values if fed_values is None else torch.cat([fed_values, new_values], dim=2)
            prefixes = torch.cat([input_ids.expand(size, -1), expansion.paths], dim=-1)  # [f, seq_len + depth]
            tree.grow(self._scores(model.logits(out[0]).float(), prefixes).log_softmax(dim=-1))
            node_hidden = torch.cat([node_hidden, out[0].repeat_interleave(tree.top_k, dim=0)])
        return tree.proposal()

    def on_verified(
        self,
        input_ids: torch.LongTensor,
        num_accepted: torch.LongTensor,
        attention_mask: torch.LongTensor | None = None,
        accepted_nodes: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | None = None,
    ) -> None:
        require_hidden_states(self, target_hidden_states)
        if not target_hidden_states.shape[1]:  # no position kept (drafts that were never verified)
            return
        pending = (
            target_hidden_states if self.pending is None else torch.cat([self.pending, target_hidden_states], dim=1)
        )
        self.pending = pending


register_drafter("eagle", EagleDrafter)
