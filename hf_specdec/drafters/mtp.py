"""`MtpDrafter`: drafts with the multi-token-prediction (MTP) layers a checkpoint ships next to its decoder.

DeepSeek-V3, GLM-4 MoE, Mellum, Step and others are trained with MTP layers (`config.num_mtp_layers`, stored as
`num_nextn_predict_layers`), which transformers builds as an `MtpModel` (`transformers.modeling_layers`) and serves
with `generate(use_mtp=True)` (`MTPCandidateGenerator`). This drafter runs the same module, the same way:

- **Weights.** `MtpModel.from_pretrained(target)`, transformers' own loader: the checkpoint's MTP keys (the target's
  `_keys_to_ignore_on_load_unexpected` patterns, renamed by its conversion mapping), the layers built from
  `config.get_mtp_config()`. For a class that registers no such patterns (Llama, Qwen3, ... with layers trained by
  `hf_specdec.distill.train_mtp_layers`), `mtp_checkpoint.load_mtp_layers` reads the same layout itself. Qwen3.5
  and Qwen3-Next configs declare their layers as `mtp_num_hidden_layers`, which transformers' `MtpModel` does not
  read: the same loader runs on a view whose config copy declares them (full-attention blocks, as these checkpoints
  hold under `mtp.`). The token embeddings, the head and the rotary embedding *are* the target's modules
  (`MtpModel.tie_with_main_model`): nothing is copied.
- **What is fed.** MTP layer k at slot i (a position of the target whose hidden state is known) reads the previous
  stage's hidden state at i and the embedding of token x_{i+1+k}, at position i+1+k, and its output predicts
  x_{i+2+k}. Stage 0's hidden state is the target's `last_hidden_state` (after the final norm, as transformers feeds
  it: `output_hidden_states` with `tie_last_hidden_states`); stage k's is MTP layer k-1's output. The round already
  records the output of the target's last decoder layer during its verification forward (`target_hidden_layers`,
  `HiddenStateCapture`); the drafter applies the target's own final norm module to it, which is exactly
  `last_hidden_state`. No second target forward, no hidden states of the other layers.
- **Caches.** Each MTP layer attends over its own keys and values of every earlier slot (transformers' `MtpCache`,
  one layer per MTP layer), so every layer is fed every slot. A round feeds all layers the slots not yet exact, in
  one forward per layer (the last k slots of layer k read this round's drafts x_n, ..., x_{n-1+k}, n being the
  sequence length), as `MtpModel.forward` does. After verification a slot's keys stay only if every token it read
  was accepted; the others are cropped and fed again in the next round (transformers crops and refeeds them too, in
  `MTPCandidateGenerator.get_candidates`).
- **Drafts.** Stage k's output at the last slot gives draft k+1 through the shared head
  (`MtpModel._project_to_logits`: the head applied as the target applies it), standardized by the target's logits
  processors with the draft's own prefix, as transformers applies them. Greedy calls take the argmax; sampling calls
  sample it and return q = softmax of the standardized logits, so Algorithm 1 stays exact. With γ equal to the
  number of MTP layers, the drafts are transformers'. A longer chain goes on past the last layer reusing the layers in
  turn (layer j mod L for draft j+1, as vLLM's DeepSeek MTP cycles `spec_step_idx % num_mtp_layers`), each step fed
  the previous step's output and the token it drafted, one slot further on; those keys are cropped after the round. A
  shorter chain still runs every layer over the new slots, so that their caches stay complete.

**Trees.** With full-attention MTP layers (L of them), `speculative_tree_budget` grows EAGLE-2's dynamic tree, in
which every node is computed as the chain through it would be. In a chain, layer k's last k slots read this round's
drafts 1..k, so with a tree those slots depend on the path: each layer is first run over its slots that read the
context only (exact .. len - 2 - k; the step (k, 0) is its last one), and an expanded node at depth d then runs the
steps (k, d) a chain through it takes, for k = d .. L - 1 while d < L (the slot that reads the node's token in each
deeper layer), and k = d mod L past the last layer. Step (k, d) reads the node's token at position len - 1 + d and
the parent's step (k - 1 mod L, d - 1) (the root's: (k - 1, 0)), and attends to layer k's context slots and to its
steps of the node's ancestors and itself (an additive mask over the layer's cache); step (d mod L, d)'s output gives
the node's children. After the round each layer keeps its context slots only (the tree's steps are not in slot
order): the next round feeds the kept tokens again, as after a rejected draft. A context shorter than the layers
(a prompt of fewer than L tokens) drafts a chain until each layer has a context slot.

Like EAGLE, the first round is the prompt's prefill and drafts nothing: the target's hidden states are not known
before its first forward.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..sampling import sample_tokens
from ..trees import additive_bias
from .base import DraftContext, Drafter, DraftProposal, chain_proposal, register_drafter, require_hidden_states
from .mtp_checkpoint import load_mtp_layers, mtp_main_model
from .tree_builder import DynamicTree

__all__ = ["MtpDrafter"]


def _mtp_layer_count(target: PreTrainedModel) -> int:
    """The number of MTP layers the target's config declares; a clear error for a target without any."""
    text = target.config.get_text_config(decoder=True)
    count = getattr(text, "num_mtp_layers", None)
    if isinstance(count, int) and count > 0:
        return count
    qwen = getattr(text, "mtp_num_hidden_layers", None)  # Qwen3.5 / Qwen3-Next configs name them so
    if count is None and isinstance(qwen, int) and not isinstance(qwen, bool) and qwen > 0:
        return qwen
    declared = getattr(text, "num_nextn_predict_layers", None)
    if declared and count is None:
        detail = (
            f"its config declares `num_nextn_predict_layers={declared}`, but transformers builds no `MtpModel` for "
            f"{text.model_type} (its config has no `num_mtp_layers`)"
        )
    else:
        detail = f"its config declares none (`num_mtp_layers={count!r}`)"
    raise ValueError(
        f'`drafter="mtp"` (or `use_mtp=True`) drafts with the target\'s multi-token-prediction layers, but '
        f"{type(target).__name__} has none: {detail}. Use a checkpoint that ships MTP layers (DeepSeek-V3, GLM-4 MoE, "
        "Mellum, ...), train some (`hf_specdec.distill.train_mtp_layers(model, texts=...)`, then "
        '`drafter=MtpDrafter(layers)` or `save_mtp_layers`), or use another drafter: `drafter="prompt_lookup"`, '
        "`assistant_model=<a small model>`."
    )


def _load_mtp_model(target: PreTrainedModel):
    """The target's MTP layers, loaded from its checkpoint by transformers' own loader, on the device of the target's
    last decoder layer (transformers' choice)."""
    from transformers.modeling_layers import MtpModel

    main = mtp_main_model(target, _mtp_layer_count(target))
    where = target.config.name_or_path
    fix = (
        '`drafter="mtp"` reads them from the checkpoint the target was loaded from (`from_pretrained`); for a model '
        "built otherwise, pass `MtpDrafter(mtp_model=MtpModel(target, num_mtp_layers))` with weights of your own."
    )
    if not where:
        raise ValueError(
            f"Could not load the MTP layers of {type(target).__name__}: it was not loaded from a checkpoint "
            f"(`config.name_or_path={where!r}`). {fix}"
        )
    last_layer = target.get_decoder().layers[-1]
    device = next((p.device for p in last_layer.parameters() if p.device.type != "meta"), torch.device("cpu"))
    try:
        MtpModel.get_mtp_weights_regex(main)
    except (TypeError, ValueError):  # the class registers no MTP key patterns: read the published layout here
        load = load_mtp_layers
    else:
        load = lambda target: MtpModel.from_pretrained(main, device_map={"": device})
    try:
        return load(target)
    except (OSError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"Could not load the MTP layers of {type(target).__name__} from its checkpoint "
            f"(`config.name_or_path={where!r}`): {type(error).__name__}: {error}. {fix}"
        ) from error


class MtpDrafter(Drafter):
    r"""
    Drafts with the target's own multi-token-prediction layers, loaded and run as transformers' `use_mtp=True`
    does (see the module docstring): `generate(drafter="mtp")` after `hf_specdec.enable(model)`.

    Greedy and sampled decoding are both exact. It drafts chains, and with `speculative_tree_budget` dynamic token
    trees (EAGLE-2: each depth expands the `tree_top_k` best nodes by cumulative log q, each with its `tree_top_k` most
    likely tokens) when the target's MTP layers use full attention (DeepSeek-V3's, GLM-4 MoE's, one or several; a
    sliding-window MTP layer drafts chains). One sequence per copy: in a left-padded batch each row has a copy of
    its own, fed its row's hidden states from the batch's one verify forward (trees need one sequence).

    Args:
        mtp_model (`transformers.modeling_layers.MtpModel`, *optional*):
            The MTP layers, sharing the target's embeddings and head (`MtpModel.from_pretrained(target)` or
            `MtpModel(target, num_mtp_layers)`). Without it, each `generate` call loads them from the target's
            checkpoint, as transformers does; to load them once for many calls, use `MtpDrafter.from_target(model)`.
        tree_top_k (`int`, *optional*, defaults to 4):
            With `speculative_tree_budget`: the nodes expanded per depth and the children kept per expanded node.

    Example:

    ```python
    >>> import torch, hf_specdec
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> from transformers.modeling_layers import MtpModel
    >>> config = AutoConfig.for_model("deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, n_routed_experts=4,
    ...     num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
    ...     qk_nope_head_dim=8, v_head_dim=8, num_mtp_layers=1)
    >>> target = hf_specdec.enable(AutoModelForCausalLM.from_config(config))
    >>> mtp = MtpModel(target, 1)  # random weights here; with a checkpoint, `drafter="mtp"` loads its own
    >>> for weight in mtp.layers.parameters():
    ...     _ = torch.nn.init.normal_(weight, std=0.1)
    >>> drafter = hf_specdec.drafters.mtp.MtpDrafter(mtp)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> plain = target.generate(ids, max_new_tokens=8, do_sample=False)
    >>> fast = target.generate(ids, drafter=drafter, max_new_tokens=8, do_sample=False)
    >>> bool((plain == fast).all())
    True

    ```
    """

    reads_target_hidden_states = True
    default_gamma = 3
    """SGLang's recipe for DeepSeek-V3's one MTP layer (`--speculative-num-steps 3`): reused past its trained depth,
    an MTP layer's acceptance falls off quickly. The γ policy adapts it."""

    def __init__(self, mtp_model=None, *, tree_top_k: int = 4):
        if isinstance(tree_top_k, bool) or not isinstance(tree_top_k, int) or tree_top_k < 1:
            raise ValueError(
                f"`tree_top_k` must be a positive int (children per expanded tree node), got {tree_top_k!r}. "
                "Use `tree_top_k=4` (the default), or any int >= 1."
            )
        self.tree_top_k = tree_top_k
        if mtp_model is not None:
            from transformers.modeling_layers import MtpModel

            if not isinstance(mtp_model, MtpModel):
                raise TypeError(
                    f"`mtp_model` must be a `transformers.modeling_layers.MtpModel`, got {type(mtp_model).__name__}. "
                    "Load one with `MtpModel.from_pretrained(target)`, or leave it out to load the target's."
                )
        self.mtp_model = mtp_model

    @classmethod
    def from_target(cls, target: PreTrainedModel, *, tree_top_k: int = 4) -> MtpDrafter:
        """A drafter holding `target`'s MTP layers, loaded once from its checkpoint (reuse it across calls)."""
        return cls(_load_mtp_model(target), tree_top_k=tree_top_k)

    def reset(self, context: DraftContext) -> None:
        from transformers.cache_utils import MtpCache

        target = context.target
        if target.config.is_encoder_decoder:
            raise ValueError(
                f"MtpDrafter drafts for decoder-only targets; {type(target).__name__} is an encoder-decoder model. "
                'Use `assistant_model=` or `drafter="prompt_lookup"` with it.'
            )
        declared = getattr(target.config.get_text_config(decoder=True), "num_mtp_layers", None)
        model = self.mtp_model if self.mtp_model is not None else _load_mtp_model(target)
        # layers given for a config that declares none (`train_mtp_layers`) are as many as they are
        num_layers = _mtp_layer_count(target) if isinstance(declared, int) and declared > 0 else len(model.layers)
        head = target.get_output_embeddings()
        if model.shared_head is not head:
            raise ValueError(
                f"`mtp_model` was not built for this {type(target).__name__}: its head is not the target's own (an "
                "MtpModel shares the target's embeddings and head, nothing copied). Build it from this target: "
                "`MtpModel.from_pretrained(target)` or `MtpModel(target, num_mtp_layers)`."
            )
        if len(model.layers) != num_layers:
            raise ValueError(
                f"`mtp_model` has {len(model.layers)} MTP layers, but {type(target).__name__}'s config declares "
                f"`num_mtp_layers={num_layers}`. Build it with `MtpModel(target, {num_layers})`."
            )
        decoder = target.get_decoder()
        self.final_norm = getattr(decoder, "norm", None)
        if not isinstance(self.final_norm, torch.nn.Module):
            raise ValueError(
                f"MtpDrafter feeds the MTP layers the target's last hidden state (after its final norm), but "
                f"{type(decoder).__name__} keeps no final norm where hf_specdec looks (`get_decoder().norm`). Use "
                'another drafter with this model (`drafter="prompt_lookup"`, `assistant_model=...`).'
            )
        self.model = model
        self.num_layers = num_layers
        self.target_hidden_layers = [target.config.get_text_config(decoder=True).num_hidden_layers]
        self.cache = MtpCache(config=model.config)  # `get_mtp_config()` of the config the layers were built from
        self.cache.activate_past_recording()  # a sliding-window layer keeps what a crop may need back
        if not all(getattr(layer, "is_croppable", False) for layer in self.cache.layers):
            raise ValueError(
                f"The MTP layers of {type(target).__name__} keep state that cannot be rolled back after a rejected "
                "draft (a recurrent or linear-attention MTP layer); MtpDrafter cannot draft for it."
            )
        self.device = model.layers[0].eh_proj.weight.device
        self.dtype = model.layers[0].eh_proj.weight.dtype
        self.embed_device = model.embed_tokens.weight.device
        self.target_device = context.input_ids.device
        self.vocab_size = context.vocab_size
        self.logits_processor = context.logits_processor
        self.do_sample = context.do_sample
        layer_types = getattr(model.config, "layer_types", None) or ["full_attention"] * num_layers
        # trees with full-attention MTP layers: each node's steps attend to the context and their own ancestors'
        full = all(kind == "full_attention" for kind in layer_types[:num_layers])
        self.tree_budget = context.tree_budget if full and context.input_ids.shape[0] == 1 else None
        self.tree_round = False  # whether the last proposal was a tree (its steps' keys are all cropped)
        self.exact = 0  # leading slots whose keys are exact in every MTP layer's cache
        self.pending: torch.Tensor | None = None  # [1, n, hidden]: the target's last hidden state at slots exact, ...
        self.proposed_at: int | None = None  # the sequence length at which the layers last ran
        self.drafted = 0  # the drafts of that proposal

    def _scores(self, hidden: torch.Tensor, prefixes: torch.LongTensor) -> torch.FloatTensor:
        """The standardized scores `[n, vocab]` of the drafts after MTP outputs `hidden` (`[n, hidden]`), each with
        its own prefix (`[n, len]`): the shared head as `MtpModel` applies it, then the target's processors."""
        logits = self.model._project_to_logits(hidden).to(device=self.target_device, dtype=torch.float32)
        width = logits.shape[-1]
        if width < self.vocab_size:  # a head narrower than the target's logits (never seen): the rest get -inf
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return self.logits_processor(prefixes, logits[..., : self.vocab_size])

    def _drafted(self, hidden: torch.Tensor, prefix: torch.LongTensor):
        """Draft from an MTP output `[1, hidden]` after `prefix` (`[1, len]`): the token `[1, 1]`, its q `[1, vocab]`
        (sampling) or None, and whether the processors left any token (a 0-dim bool)."""
        scores = self._scores(hidden, prefix)  # [1, vocab]: standardized
        usable = torch.isfinite(scores).any()
        if not self.do_sample:
            return scores.argmax(dim=-1, keepdim=True), None, usable
        q = scores.softmax(dim=-1)
        q = torch.where(usable, q, torch.full_like(q, 1.0 / q.shape[-1]))  # cut below when unusable
        return sample_tokens(q)[:, None], q, usable

    def _draft_into(self, hidden: torch.Tensor, ids: torch.LongTensor, probs: list, usable: list) -> torch.LongTensor:
        """Drafts the token after `ids` from the last slot of an MTP output `hidden` (`[1, T, hidden]`), records its
        q and usability, and returns `ids` with it appended."""
        token, q, ok = self._drafted(hidden[:, -1], ids)
        probs.append(q)
        usable.append(ok)
        return torch.cat([ids, token], dim=-1)

    def _run_layer(self, index: int, hidden: torch.Tensor, tokens: torch.LongTensor, first_position: int):
        """MTP layer `index` over `tokens` (`[1, T]`, at positions first_position, ...) and the previous stage's
        `hidden` (`[1, T, hidden]`); appends their keys to the layer's cache. Returns its output `[1, T, hidden]`."""
        positions = torch.arange(first_position, first_position + tokens.shape[1], device=self.device)[None]
        return self.model.forward_layer(index, hidden, positions, self.cache, input_ids=tokens.to(self.embed_device))

    @torch.no_grad()
    def propose(
        self, input_ids: torch.LongTensor, num_tokens: int, attention_mask: torch.LongTensor | None = None
    ) -> DraftProposal:
        batch, length = input_ids.shape
        if batch != 1:
            raise ValueError(
                "MtpDrafter drafts for one sequence at a time (hf_specdec gives each row of a batch a copy)."
            )
        if num_tokens == 0 or self.pending is None:  # a plain step, or the prompt's prefill: the layers wait
            return DraftProposal.empty(batch, input_ids.device)
        if self.exact + self.pending.shape[1] != length - 1:
            raise RuntimeError(
                f"MtpDrafter holds the target's hidden states up to position {self.exact + self.pending.shape[1] - 1}"
                f", but the sequence has {length} tokens: the loop did not hand it the hidden states of every kept "
                "position."
            )
        for layer in self.cache.layers:  # drop the keys of slots that read a rejected draft, or a reused layer's
            excess = layer.get_seq_length() - self.exact
            if excess > 0:  # a sliding-window layer (Mellum's) cannot crop before its first keys, nor by zero once full
                layer.crop(-excess)
        ids = input_ids
        probs, usable = [], []  # per draft: its q (sampling) and whether the processors left any token
        hidden = self.pending.to(device=self.device, dtype=self.dtype)  # stage 0: slots exact .. length - 2
        # a tree needs every layer to have a slot that reads only the context (a prompt of num_layers tokens or more)
        self.tree_round = self.tree_budget is not None and length - self.num_layers - self.exact >= 1
        if self.tree_round:
            self.proposed_at, self.drafted = length, num_tokens  # a path is at most `num_tokens` deep
            return self._propose_tree(input_ids, num_tokens, self._context_stages(input_ids, hidden))
        for index in range(self.num_layers):
            # layer `index` reads token x_{i+1+index} at slot i: the last `index` of them are this round's drafts
            tokens = ids[:, self.exact + 1 + index : length + index]
            hidden = self._run_layer(index, hidden, tokens, self.exact + 1 + index)
            if len(usable) < max(num_tokens, self.num_layers - 1):  # the next layer reads this draft
                ids = self._draft_into(hidden, ids, probs, usable)
        while len(usable) < num_tokens:  # past the last layer: the layers again, one slot further each step
            step = len(usable)
            hidden = self._run_layer(step % self.num_layers, hidden[:, -1:], ids[:, -1:], length - 1 + step)
            ids = self._draft_into(hidden, ids, probs, usable)
        proposal = chain_proposal(ids, length, usable[:num_tokens], probs[:num_tokens] if self.do_sample else [])
        self.proposed_at, self.drafted = length, proposal.tokens.shape[1]
        return proposal

    def _context_stages(self, input_ids: torch.LongTensor, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Runs each MTP layer k over its slots that read context tokens only (exact .. length - 2 - k; the slots
        after them read drafts, which a tree's nodes feed), from stage 0's `hidden` (`[1, slots, hidden]`), and
        returns each layer's output at its last such slot (`[1, hidden]` each): the step (k, 0) of the module
        docstring's tree, which reads the last token of the context."""
        length, stages = input_ids.shape[1], []
        for index in range(self.num_layers):
            count = length - 1 - index - self.exact  # slots exact .. length - 2 - index
            tokens = input_ids[:, self.exact + 1 + index : length]
            hidden = self._run_layer(index, hidden[:, :count], tokens, self.exact + 1 + index)
            stages.append(hidden[:, -1])
        return stages

    def _propose_tree(self, input_ids: torch.LongTensor, num_tokens: int, stages: list[torch.Tensor]) -> DraftProposal:
        """EAGLE-2's dynamic tree ([`DynamicTree`]) over the MTP layers' outputs; `stages[k]` (`[1, hidden]`) is layer
        k's output at its last context slot (`_context_stages`). An expanded node at depth d runs, for each layer k it
        has a step in (k = d .. L - 1 while d < L, else k = d mod L), the step a chain through it takes: the layer
        reads the node's token at position len - 1 + d and the parent's output of layer k - 1 (mod L; the root's:
        `stages[k - 1]`), attending to the layer's context slots and to its steps of the node's ancestors (an
        additive 4D mask over the layer's cache). Layer d mod L's output gives the node's children. The steps' keys
        are cropped next round, as a chain's reused steps are."""
        length, device, model, num_layers = input_ids.shape[1], self.device, self.model, self.num_layers
        tree = DynamicTree(
            self._scores(stages[0], input_ids).log_softmax(dim=-1), self.tree_budget, self.tree_top_k, device
        )
        if not len(tree):
            return tree.proposal()
        contexts = [layer.get_seq_length() for layer in self.cache.layers]
        columns: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # each layer's steps: expanded rows
        outputs: list[torch.Tensor | None] = [None] * num_layers  # layer k's output per tree node, [nodes, hidden]
        expanded = 0
        for depth in range(1, num_tokens):
            expansion = tree.expand()
            if expansion is None:
                break
            size = expansion.tokens.shape[0]
            nodes, parents = expansion.nodes.to(device), tree.parents[expansion.nodes].to(device)
            positions = torch.full((1, size), length - 1 + depth, device=device)
            embeds = model.embed_tokens(expansion.tokens[None].to(self.embed_device)).to(device)
            rows = torch.arange(expanded, expanded + size, device=device)  # no host-to-device copy
            expanded += size
            for index in range(depth, num_layers) if depth < num_layers else [depth % num_layers]:
                previous = (index - 1) % num_layers
                if depth == 1:  # the root's step in the previous layer
                    node_hidden = stages[previous].expand(size, -1)
                else:
                    node_hidden = outputs[previous][parents]
                columns[index].append(rows)
                visible = expansion.mask[:, torch.cat(columns[index])]  # ancestors and itself
                allowed = torch.cat([torch.ones(size, contexts[index], dtype=torch.bool, device=device), visible], 1)
                out = self._tree_step(index, embeds, node_hidden, positions, allowed)
                if outputs[index] is None or outputs[index].shape[0] < len(tree):
                    grown = out.new_zeros(len(tree), out.shape[-1])
                    if outputs[index] is not None:
                        grown[: outputs[index].shape[0]] = outputs[index]
                    outputs[index] = grown
                outputs[index][nodes] = out[0]
            prefixes = torch.cat([input_ids.expand(size, -1), expansion.paths], dim=-1)  # [f, len + depth]
            tree.grow(self._scores(outputs[depth % num_layers][nodes], prefixes).log_softmax(dim=-1))
        return tree.proposal()

    def _tree_step(self, index: int, embeds, hidden, positions, allowed) -> torch.Tensor:
        """MTP layer `index` over tree nodes (`embeds` `[1, f, hidden]` of their tokens, the previous step's `hidden`
        `[f, hidden]`, at `positions` `[1, f]`), attending where `allowed` (`[f, cached + f]`) says; appends their keys
        to the layer's cache and returns its output `[1, f, hidden]`, as `MtpModel.forward_layer` computes it."""
        model = self.model
        rotary = None
        if model.rotary_emb is not None:
            rope = (
                {"layer_type": model.config.layer_types[index]} if getattr(model, "has_per_layer_rope", False) else {}
            )
            rotary = model.rotary_emb(embeds, position_ids=positions, **rope)
        out = model.layers[index](
            embeds,
            hidden[None],
            position_embeddings=rotary,
            attention_mask=additive_bias(allowed[None, None], self.dtype),
            position_ids=positions,
            cache=self.cache,
        )
        return model.shared_post_norm(out) if model.use_shared_post_norm else out

    def on_verified(
        self,
        input_ids: torch.LongTensor,
        num_accepted: torch.LongTensor,
        attention_mask: torch.LongTensor | None = None,
        accepted_nodes: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | None = None,
    ) -> None:
        require_hidden_states(self, target_hidden_states)
        with torch.no_grad():
            last_hidden = self.final_norm(target_hidden_states)  # [1, n, hidden]: the target's last_hidden_state
        self.pending = last_hidden if self.pending is None else torch.cat([self.pending, last_hidden], dim=1)
        if self.proposed_at is None:
            return
        # layer k's slot i read x_{i+1+k}, a draft when i+1+k >= proposed_at: its keys stay if that draft is now in
        # the sequence. The drafts kept are read off its length (no host read of `num_accepted`; never more than
        # were accepted); slots exact before this round stay so
        length = self.proposed_at
        # never more than were drafted: in a padded batch a row that drafted fewer may also keep filler tokens
        accepted = min(max(0, input_ids.shape[1] - length - 1), self.drafted)
        if self.tree_round:  # a tree's steps are not in slot order: each layer keeps its context slots only
            accepted = 0
        exact = max(self.exact, length - 1 - max(0, self.num_layers - 1 - accepted))
        self.pending = self.pending[:, exact - self.exact :]
        self.exact, self.proposed_at = exact, None


register_drafter("mtp", MtpDrafter)
