"""`DFlashDrafter`: a block drafter that fills a whole block of masked positions in one forward (DFlash).

transformers serves it as `generate(assistant_model=drafter, speculation_type="dflash")`
(`DFlashTokenCandidateGenerator`); the drafter is a `muse_glimmer_assistant` model (`MuseGlimmerAssistantModel`).
This drafter runs that model, loaded and fed exactly as transformers feeds it:

- **What it reads.** The target's hidden states at `config.target_layer_ids` (entry `i + 1` of the target's
  `output_hidden_states`: the output of decoder layer `i`; the last layer's after the target's final norm, as
  transformers' `output_hidden_states` ties it to `last_hidden_state`), concatenated in that order, at every position
  whose next token is known. The round records them during its own verification forward (`target_hidden_layers`,
  `HiddenStateCapture`): no second target forward, no hidden states of the other layers.
- **Its cache.** transformers' `DFlashCache`: each layer's keys and values of every such context position, computed
  from the projected hidden states alone (never from a draft), so nothing there is ever rejected. A round appends
  the new context positions and the block; the next round crops the block off again (`crop(-block_size)`, as
  transformers does).
- **The block.** One forward over `[x_n, mask, ..., mask]` (`block_size` tokens: the newest token, the *anchor*, then
  `block_size - 1` copies of `config.mask_token_id`) at positions `n - 1, ..., n + block_size - 2`, embedded by the
  target's own embeddings (without an `embed_norm` the embedding module may carry, as transformers does), attending
  to each other both ways and to every context position. Its outputs after the anchor, through the target's own
  head, give one distribution per drafted position: `block_size - 1` drafts for one drafter forward. Nothing of the
  target is copied: the embeddings and head *are* the target's modules.
- **Drafts.** Each position's logits are standardized by the target's logits processors with that draft's own
  prefix (the drafts before it included), as transformers applies them. Greedy calls take the argmax; sampling calls
  sample each position from its standardized q and return that q as `probs`, so Algorithm 1 stays exact. With
  `speculative_tree_budget`, the block becomes a token tree instead (deterministic nodes, `probs=None`): a
  position's distribution does not depend on the drafts before it, so the tree is grown best-first by cumulative
  log q from each position's top `tree_top_k` tokens (EAGLE-2's `DynamicTree`, without a forward per depth).

Like EAGLE, the first round is the prompt's prefill and drafts nothing: the target's hidden states are not known
before its first forward. In a left-padded batch each row has a copy of its own, fed its row's hidden states from
the batch's one verify forward.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..devices import execution_device
from ..sampling import sample_tokens
from .base import DraftContext, Drafter, DraftProposal, chain_proposal, register_drafter, require_hidden_states
from .tree_builder import DynamicTree

__all__ = ["DFlashDrafter"]

_FIX = (
    "Pass a DFlash block drafter (transformers' `muse_glimmer_assistant` model: "
    "`AutoModel.from_pretrained(<drafter checkpoint>)`)"
)


def _check_block_drafter(model) -> None:
    """Fails unless `model` is a DFlash block drafter: a model whose config names the target's layers it reads, its
    block size and its mask token, and whose forward takes the block's embeddings and the target's context."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"`model` must be a DFlash block drafter model, got {type(model).__name__}. {_FIX}.")
    config = model.config
    missing = [
        name for name in ("block_size", "mask_token_id", "target_layer_ids") if getattr(config, name, None) is None
    ]
    parameters = inspect.signature(model.forward).parameters
    missing += [
        f"forward({name}=...)" for name in ("noise_embeds", "context_hidden_states", "cache") if name not in parameters
    ]
    if missing:
        raise TypeError(
            f"`model` must be a DFlash block drafter, but {type(model).__name__} (model type "
            f"{getattr(config, 'model_type', None)!r}) has no {', '.join(f'`{name}`' for name in missing)}. {_FIX}; "
            'a drafter that is a causal language model goes in `assistant_model=`, without `speculation_type="dflash"`.'
        )
    block_size = config.block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"The DFlash drafter's `config.block_size` must be an int >= 2 (the anchor and at least one masked "
            f"position), got {block_size!r}. Use the drafter's published config."
        )
    layer_ids = config.target_layer_ids
    if not isinstance(layer_ids, (list, tuple)) or not layer_ids:
        raise ValueError(
            f"The DFlash drafter's `config.target_layer_ids` must be a non-empty list of the target's decoder layer "
            f"ids, got {layer_ids!r}. Use the drafter's published config."
        )


def _check_fits_target(model, target: PreTrainedModel, vocab_size: int) -> int:
    """Fails unless the block drafter `model` fits `target`; returns the target's number of decoder layers."""
    from ..capture import decoder_layers  # here: `capture` imports the drafters package

    config = model.config
    name = type(target).__name__
    if target.config.is_encoder_decoder:
        raise ValueError(
            f"DFlashDrafter drafts for decoder-only targets; {name} is an encoder-decoder model. Use "
            '`assistant_model=` or `drafter="prompt_lookup"` with it.'
        )
    blocks = decoder_layers(target)
    if blocks is None:
        raise ValueError(
            f"DFlashDrafter reads the target's hidden states, but {name} keeps no list of decoder layers where "
            "hf_specdec looks (`model.get_decoder().layers`). Use a drafter that does not read hidden states with it."
        )
    layers = len(blocks)
    layer_ids = list(config.target_layer_ids)
    wrong = [i for i in layer_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers]
    if wrong:
        raise ValueError(
            f"The DFlash drafter reads the target's hidden states at `config.target_layer_ids={layer_ids}`, but "
            f"{name} has {layers} decoder layers (ids 0 to {layers - 1}): {wrong} do not exist in it. Use a DFlash "
            f"drafter trained for this target (its `target_layer_ids` within [0, {layers - 1}])."
        )
    hidden_size = target.config.get_text_config(decoder=True).hidden_size
    if config.hidden_size != hidden_size:
        raise ValueError(
            f"The DFlash drafter has `hidden_size={config.hidden_size}` but {name} has hidden size {hidden_size}: "
            "the drafter reads the target's hidden states and embeddings, so both must match. Use a DFlash drafter "
            "trained for this target."
        )
    rows = target.get_input_embeddings().weight.shape[0]
    mask_token_id = config.mask_token_id
    drafter_vocab = getattr(config, "vocab_size", None)
    if drafter_vocab is not None and drafter_vocab != vocab_size:
        raise ValueError(
            f"The DFlash drafter was built for a vocabulary of `vocab_size={drafter_vocab}` tokens, but {name} has "
            f"{vocab_size} logits: they do not share a tokenizer. Use a DFlash drafter trained for this target."
        )
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < rows:
        raise ValueError(
            f"The DFlash drafter's `config.mask_token_id={mask_token_id!r}` is not a token of {name}, whose "
            f"embeddings hold {rows} tokens (ids 0 to {rows - 1}): the drafter embeds its masked positions with the "
            "target's embeddings, so it needs the target's vocabulary. Use a DFlash drafter trained for this target."
        )
    return layers


class DFlashDrafter(Drafter):
    r"""
    Drafts a whole block with one forward of a DFlash block drafter (transformers' `muse_glimmer_assistant` model),
    reading the target's hidden states at the layers the drafter names (see the module docstring).
    `generate(drafter="dflash", drafter_kwargs={"model": drafter_model})` builds one.

    Greedy and sampled decoding are both exact. It drafts chains of up to `config.block_size - 1` tokens, and token
    trees with `speculative_tree_budget` (from each position's `tree_top_k` most likely tokens).

    Args:
        model (`PreTrainedModel`, `str` or `Path`):
            The block drafter (`MuseGlimmerAssistantModel`), or a local directory or Hub repo id to load it from with
            `AutoModel.from_pretrained` (once, here).
        tree_top_k (`int`, *optional*, defaults to 4):
            With `speculative_tree_budget`: children per expanded tree node, and nodes expanded per depth.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    >>> target = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> block = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4,
    ...     mask_token_id=63, target_layer_ids=[0, 3]))  # random weights here; load a trained one
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> plain = target.generate(ids, max_new_tokens=8, do_sample=False)
    >>> fast = target.generate(ids, drafter="dflash", drafter_kwargs={"model": block}, max_new_tokens=8,
    ...     do_sample=False)
    >>> bool((plain == fast).all())
    True

    ```
    """

    reads_target_hidden_states = True

    def __init__(self, model, tree_top_k: int = 4):
        if isinstance(model, (str, Path)):
            from transformers import AutoModel

            model = AutoModel.from_pretrained(model)
        _check_block_drafter(model)
        if isinstance(tree_top_k, bool) or not isinstance(tree_top_k, int) or tree_top_k < 1:
            raise ValueError(
                f"`tree_top_k` must be a positive int (children per expanded tree node), got {tree_top_k!r}. "
                "Use `tree_top_k=4` (the default), or any int >= 1."
            )
        self.model = model
        self.tree_top_k = tree_top_k
        # one block per round: a forward drafts `block_size - 1` tokens, and no more whatever γ asks
        self.default_gamma = model.config.block_size - 1

    def reset(self, context: DraftContext) -> None:
        from transformers.cache_utils import DFlashCache

        target, model = context.target, self.model
        layers = _check_fits_target(model, target, context.vocab_size)
        config = model.config
        self.block_size = config.block_size
        self.target_hidden_layers = [i + 1 for i in config.target_layer_ids]
        # transformers' `output_hidden_states` replaces the last layer's output by `last_hidden_state` (after the
        # final norm): the slots that read it get the target's own final norm
        self.normed_slots = []
        if getattr(target.config, "tie_last_hidden_states", True) is not False:
            self.normed_slots = [slot for slot, layer in enumerate(self.target_hidden_layers) if layer == layers]
        self.final_norm = getattr(target.get_decoder(), "norm", None) if self.normed_slots else None
        if self.normed_slots and not isinstance(self.final_norm, torch.nn.Module):
            raise ValueError(
                f"The DFlash drafter reads the target's last layer ({layers - 1}), which transformers hands over "
                f"after the final norm, but {type(target).__name__} keeps no final norm where hf_specdec looks "
                "(`get_decoder().norm`). Use a DFlash drafter that does not read the last layer."
            )
        self.hidden_size = config.hidden_size
        self.embeddings = target.get_input_embeddings()
        self.embeddings_device = execution_device(self.embeddings)
        self.head = target.get_output_embeddings()
        self.head_device = self.head.weight.device
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.target_device = context.input_ids.device
        self.vocab_size = context.vocab_size
        self.logits_processor = context.logits_processor
        self.do_sample = context.do_sample
        self.tree_budget = context.tree_budget if context.input_ids.shape[0] == 1 else None
        self.noise_ids = torch.full((1, self.block_size), config.mask_token_id, dtype=torch.long)  # [1, block]
        self.cache = DFlashCache(config=config)
        self.cache.activate_past_recording()  # a sliding-window layer keeps what the block's crop needs back
        self.block_cached = False  # the cache ends with the last block's keys (cropped before the next forward)
        self.seen = 0  # context positions (next token known) whose keys the cache holds
        self.pending: torch.Tensor | None = None  # [1, n, layers * hidden]: context positions seen, ... not yet fed

    def _embed_block(self, anchor: torch.LongTensor) -> torch.Tensor:
        """The target's embeddings of `[anchor, mask, ..., mask]` (`anchor`: `[1, 1]`), `[1, block, hidden]`: without
        an `embed_norm` the embedding module applies on top (transformers embeds DFlash's block without it)."""
        ids = torch.cat([anchor.to(self.embeddings_device), self.noise_ids.to(self.embeddings_device)[:, 1:]], dim=-1)
        if getattr(self.embeddings, "embed_norm", None) is not None:
            if not isinstance(self.embeddings, torch.nn.Embedding):
                raise ValueError(
                    f"The target's embeddings ({type(self.embeddings).__name__}) apply an `embed_norm` that DFlash "
                    "embeds without, and are not an `nn.Embedding` hf_specdec can bypass it on."
                )
            embeds = torch.nn.Embedding.forward(self.embeddings, ids)  # the table alone, the module left untouched
        else:
            embeds = self.embeddings(ids)
        return embeds.to(device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def _block_logits(self, input_ids: torch.LongTensor) -> torch.FloatTensor:
        """Feeds the pending context and runs the block after `input_ids` (`[1, n]`) in one forward: the logits of
        its `block_size - 1` drafted positions, `[1, block - 1, vocab]` float32 on the target's device."""
        length = input_ids.shape[1]
        fed = 0 if self.pending is None else self.pending.shape[1]
        if self.seen + fed != length - 1:
            raise RuntimeError(
                f"DFlashDrafter holds the target's hidden states up to position {self.seen + fed - 1}, but the "
                f"sequence has {length} tokens: the loop did not hand it the hidden states of every kept position."
            )
        if self.block_cached:  # the last block's keys: the context's stay, exact whatever was accepted
            self.cache.crop(-self.block_size)
        context = (
            self.pending.to(device=self.device, dtype=self.dtype)
            if fed
            else torch.zeros(
                1, 0, self.hidden_size * len(self.target_hidden_layers), device=self.device, dtype=self.dtype
            )
        )
        self.cache.set_previous_accepted_tokens(fed)
        positions = torch.arange(self.seen, length - 1 + self.block_size, device=self.device)[None]
        mask = torch.ones(1, length - 1 + self.block_size, dtype=torch.long, device=self.device)
        hidden = self.model(
            noise_embeds=self._embed_block(input_ids[:, -1:]),
            context_hidden_states=context,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
        ).last_hidden_state  # [1, block, hidden]
        self.seen, self.pending, self.block_cached = length - 1, None, True
        logits = self.head(hidden[:, 1:].to(self.head_device)).to(device=self.target_device, dtype=torch.float32)
        width = logits.shape[-1]
        if width < self.vocab_size:  # a head narrower than the target's logits (never seen): the rest get -inf
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits[..., : self.vocab_size]

    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        batch = input_ids.shape[0]
        if batch != 1:
            raise ValueError(
                "DFlashDrafter drafts for one sequence at a time (hf_specdec gives each row of a batch a copy)."
            )
        if num_tokens == 0 or (self.pending is None and self.seen == 0):  # a plain step, or the prompt's prefill
            return DraftProposal.empty(batch, input_ids.device)
        logits = self._block_logits(input_ids)[:, : min(num_tokens, self.block_size - 1)]  # [1, k, vocab]
        if self.tree_budget is not None:
            return self._propose_tree(input_ids, logits)
        ids = input_ids
        probs, usable = [], []  # per draft: its q (sampling) and whether the processors left any token
        for position in range(logits.shape[1]):
            scores = self.logits_processor(ids, logits[:, position])  # [1, vocab]: standardized
            usable.append(torch.isfinite(scores).any())
            if self.do_sample:
                q = scores.softmax(dim=-1)
                q = torch.where(usable[-1], q, torch.full_like(q, 1.0 / q.shape[-1]))  # cut below when unusable
                token = sample_tokens(q)[:, None]
                probs.append(q)
            else:
                token = scores.argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, token], dim=-1)
        return chain_proposal(ids, input_ids.shape[1], usable, probs)

    def _propose_tree(self, input_ids: torch.LongTensor, logits: torch.FloatTensor) -> DraftProposal:
        """A token tree from the block's logits (`[1, depth, vocab]`): node scores by cumulative log q, each
        position standardized with each expanded node's own prefix; no further drafter forward."""
        tree = DynamicTree(
            self.logits_processor(input_ids, logits[:, 0]).log_softmax(dim=-1),
            self.tree_budget,
            self.tree_top_k,
            self.target_device,
        )
        for depth in range(1, logits.shape[1]):
            expansion = tree.expand()
            if expansion is None:
                break
            size = expansion.tokens.shape[0]
            prefixes = torch.cat([input_ids.expand(size, -1), expansion.paths], dim=-1)  # [f, seq_len + depth]
            tree.grow(self.logits_processor(prefixes, logits[:, depth].expand(size, -1).clone()).log_softmax(dim=-1))
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
        states = target_hidden_states  # [1, n, layers * hidden], in `target_hidden_layers` order
        if self.normed_slots:
            slots = list(states.split(self.hidden_size, dim=-1))
            with torch.no_grad():
                for slot in self.normed_slots:
                    slots[slot] = self.final_norm(slots[slot])
            states = torch.cat(slots, dim=-1)
        self.pending = states if self.pending is None else torch.cat([self.pending, states], dim=1)


register_drafter("dflash", DFlashDrafter)
