"""`NGramDrafter`: a static n-gram table built from a corpus, saved and loaded in Hub format (safetensors).

The table itself (counting, checking, reading its files) is built by `ngram_table.py`.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard, ModelCardData, ModelHubMixin, hf_hub_download
from huggingface_hub.errors import HFValidationError
from safetensors.torch import save_file

from ..file_writes import replace_file, write_text
from ..sampling import sample_tokens
from .base import DraftContext, Drafter, DraftProposal, register_drafter
from .ngram_table import (
    CONFIG_NAME,
    DRAFT_MODES,
    OVERRIDABLE,
    WEIGHTS_NAME,
    check_positive,
    count_table,
    describe,
    local_directory,
    read_table,
    shareable_name,
    tokenize_texts,
    validated_tables,
)
from .tree_builder import TokenTree

__all__ = ["NGramDrafter"]

_DOWNLOAD_OPTIONS = ("revision", "cache_dir", "force_download", "local_files_only", "token")

_TEMPLATE = (Path(__file__).resolve().parent.parent / "templates" / "ngram_drafter.md").read_text()


class NGramDrafter(
    Drafter,
    ModelHubMixin,
    library_name="hf_specdec",
    tags=["speculative-decoding", "ngram-drafter"],
    model_card_template=_TEMPLATE,
):
    r"""
    A static n-gram table (unigram ... n-gram, with backoff to the longest context seen) that drafts without any
    model forward, like llama.cpp's static n-gram caches and the paper's unigram / bigram drafters (Table 3).

    For every context of `k - 1` tokens (k = 1 ... n) the table keeps its `top_k` most frequent continuations
    with their empirical probabilities, stored sparsely in safetensors. Drafting looks up the longest known
    context, turns its continuations into q, standardizes q with the target's logits processors, and proposes
    its argmax (`draft_mode="greedy"`, deterministic) or a sample from it (`draft_mode="sample"`, q is passed to
    the sampler, which then accepts with min(1, p/q)).

    With `speculative_tree_budget` set, the proposal is a token tree grown best-first, as in EAGLE-2: each node's
    candidate children are its context's continuations ranked by standardized q (the target's processors applied
    with the node's own prefix), and the tree takes, one node at a time, the candidate with the highest product of
    q along its path, until it holds `tree_budget` nodes or no candidate is left within depth `num_tokens`. These
    are the `tree_budget` most probable paths' nodes under q. Tree nodes are chosen deterministically in both draft
    modes (`probs=None`): in `draft_mode="sample"` the sampler then tries the siblings one by one, accepting each
    with the target's residual probability, which keeps sampling exact. A tree without branches is proposed as a
    chain.

    Build one with [`~NGramDrafter.from_corpus`] (token ids) or [`~NGramDrafter.from_texts`] (texts and a
    tokenizer), save it with `save_pretrained` (safetensors, `config.json`, a `README.md` model card), load it
    with `from_pretrained` (a directory or a Hub repo id; nothing is unpickled), share it with `push_to_hub`.

    Example:

    ```python
    >>> import hf_specdec
    >>> table = hf_specdec.NGramDrafter.from_corpus([[1, 2, 3, 1, 2, 3, 1, 2]], n=3, vocab_size=8)
    >>> table.propose_for([[1, 2]], num_tokens=4).tokens
    tensor([[3, 1, 2, 3]])
    >>> table = hf_specdec.NGramDrafter.from_corpus([[1, 2, 3, 1, 2, 3, 1, 2, 4]], n=3, vocab_size=8)
    >>> tree = table.propose_for([[1, 2]], num_tokens=2, tree_budget=3)
    >>> tree.tokens, tree.parents  # after [1, 2]: 3 (q = 2/3), then its child 1 (2/3 * 1), then 4 (1/3)
    (tensor([[3, 1, 4]]), tensor([[-1,  0, -1]]))

    ```
    """

    tree_budget: int | None = None  # set per call by `reset`

    def __init__(
        self,
        tables: dict[str, torch.Tensor],
        *,
        n: int,
        vocab_size: int,
        top_k: int,
        draft_mode: str = "greedy",
        tokenizer_name: str | None = None,
        target_name: str | None = None,
        corpus_description: str | None = None,
        alpha: float | None = None,
    ):
        check_positive("n", n)
        check_positive("vocab_size", vocab_size)
        check_positive("top_k", top_k)
        if draft_mode not in DRAFT_MODES:
            raise ValueError(f"`draft_mode` must be one of {DRAFT_MODES}, got {draft_mode!r}.")
        self.n, self.vocab_size, self.top_k, self.draft_mode = n, vocab_size, top_k, draft_mode
        self.tokenizer_name, self.target_name = tokenizer_name, target_name
        self.corpus_description, self.alpha = corpus_description, alpha
        self.tables = validated_tables(tables, n=n, vocab_size=vocab_size, top_k=top_k)
        # context tuple -> row, per order; built once here (per-call copies share it read-only)
        self._rows = [
            {tuple(context): row for row, context in enumerate(self.tables[f"order_{k}.contexts"].tolist())}
            for k in range(1, n + 1)
        ]
        self._best: dict[tuple[int, int], int] = {}  # (order, row) -> its most probable token, filled on first use

    # ----- building -----------------------------------------------------------------------------------------

    @classmethod
    def from_corpus(
        cls,
        sequences: Iterable[Sequence[int] | torch.Tensor],
        *,
        n: int = 3,
        vocab_size: int,
        top_k: int = 8,
        draft_mode: str = "greedy",
        **metadata: Any,
    ) -> NGramDrafter:
        """Counts every k-gram (k = 1 ... `n`) of `sequences` (lists or 1-D tensors of token ids).

        `metadata` (`tokenizer_name`, `target_name`, `corpus_description`, `alpha`) goes into the config and card.
        """
        tables = count_table(sequences, n=n, vocab_size=vocab_size, top_k=top_k)
        return cls(tables, n=n, vocab_size=vocab_size, top_k=top_k, draft_mode=draft_mode, **metadata)

    @classmethod
    def from_texts(
        cls,
        texts: Iterable[str],
        *,
        tokenizer,
        n: int = 3,
        top_k: int = 8,
        vocab_size: int | None = None,
        draft_mode: str = "greedy",
        show_progress: bool | None = None,
        batch_size: int = 256,
        **metadata: Any,
    ) -> NGramDrafter:
        """Tokenizes `texts` with `tokenizer` (a progress bar on long corpora) and counts them like `from_corpus`.

        `vocab_size` defaults to `len(tokenizer)`; pass the target's logits width when its embeddings are padded.
        """
        sequences = tokenize_texts(texts, tokenizer, show_progress=show_progress, batch_size=batch_size)
        metadata.setdefault("tokenizer_name", shareable_name(getattr(tokenizer, "name_or_path", None)))
        return cls.from_corpus(
            sequences, n=n, vocab_size=vocab_size or len(tokenizer), top_k=top_k, draft_mode=draft_mode, **metadata
        )

    # ----- Hub format -----------------------------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        """The table's settings and provenance, as `save_pretrained` writes them to `config.json` (with the
        hf_specdec version)."""
        from .. import __version__

        return {
            "drafter_type": "ngram",
            "n": self.n,
            "vocab_size": self.vocab_size,
            "top_k": self.top_k,
            "draft_mode": self.draft_mode,
            "tokenizer_name": self.tokenizer_name,
            "target_name": self.target_name,
            "corpus_description": self.corpus_description,
            "alpha": self.alpha,
            "hf_specdec_version": __version__,
        }

    def _save_pretrained(self, save_directory: Path) -> None:
        # each file through a new file renamed into place: a link standing there is replaced, never written through
        tables = {k: v.contiguous() for k, v in self.tables.items()}
        replace_file(save_directory / WEIGHTS_NAME, lambda file: save_file(tables, str(file)))
        write_text(save_directory / CONFIG_NAME, json.dumps(self.config_dict(), indent=2, sort_keys=True) + "\n")
        card = save_directory / "README.md"
        if card.is_symlink():  # `ModelHubMixin` then writes a new card (it opens README.md by name: never a link)
            card.unlink()

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        *,
        force_download: bool = False,
        token: str | bool | None = None,
        cache_dir: str | Path | None = None,
        local_files_only: bool = False,
        revision: str | None = None,
        **overrides: Any,
    ) -> NGramDrafter:
        r"""
        Loads a table written by `save_pretrained`, from a local directory or a Hub repo id (nothing is unpickled).

        Args:
            pretrained_model_name_or_path (`str` or `Path`):
                A directory holding `config.json` and `model.safetensors`, or a Hub repo id (`"user/name"`).
            force_download, token, cache_dir, local_files_only, revision:
                As in `huggingface_hub.hf_hub_download`, for Hub repo ids.
            overrides:
                `n` (use orders 1 ... n only, at most the stored n), `top_k` (keep the top_k most frequent
                continuations per context, at most the stored top_k), `draft_mode`, `tokenizer_name`,
                `target_name`, `corpus_description`, `alpha`. Anything else is an error.

        Example:

        ```python
        >>> from hf_specdec.zoo import load_ngram
        >>> load_ngram(n=2, draft_mode="sample").n
        2

        ```
        """
        unknown = sorted(set(overrides) - set(OVERRIDABLE))
        if unknown:
            raise TypeError(
                f"Unknown option(s) {unknown} for `NGramDrafter.from_pretrained`, got "
                f"{ {key: overrides[key] for key in unknown} }. It accepts {list(OVERRIDABLE)} (and the download "
                "arguments `revision`, `cache_dir`, `force_download`, `local_files_only`, `token`)."
            )
        return cls._from_pretrained(
            model_id=str(pretrained_model_name_or_path),
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            token=token,
            **overrides,
        )

    @classmethod
    def _from_pretrained(
        cls, *, model_id: str, revision, cache_dir, force_download, local_files_only, token, **overrides
    ) -> NGramDrafter:
        directory = local_directory(model_id)

        def fetch(filename: str) -> Path:
            if directory is not None:
                local = directory / filename
                if local.is_symlink() and not local.exists():
                    raise OSError(
                        f"{local} is a broken link (to {os.readlink(local)!r}); restore the file or save "
                        "the drafter again with `save_pretrained`."
                    )
                if local.exists() and not local.is_file():
                    raise OSError(f"{describe(local)} is not a file; save the drafter again with `save_pretrained`.")
                if not local.is_file():
                    raise OSError(f"{model_id} has no {filename}; is it a directory written by save_pretrained?")
                return local
            try:
                return Path(
                    hf_hub_download(
                        model_id,
                        filename,
                        revision=revision,
                        cache_dir=cache_dir,
                        force_download=force_download,
                        local_files_only=local_files_only,
                        token=token,
                    )
                )
            except HFValidationError as err:
                raise OSError(f"{model_id!r} is neither a local directory nor a valid Hub repo id: {err}") from None

        tables, kwargs = read_table(model_id, fetch, overrides)
        return cls(tables, **kwargs)

    def push_to_hub(self, repo_id: str, *, model_card_kwargs: dict | None = None, **kwargs) -> str:
        """`ModelHubMixin.push_to_hub`, with the model card's usage snippet naming `repo_id`."""
        model_card_kwargs = {"repo_id": repo_id, **(model_card_kwargs or {})}
        return super().push_to_hub(repo_id, model_card_kwargs=model_card_kwargs, **kwargs)

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        """The model card (`README.md`) that `save_pretrained` and `push_to_hub` write beside the table."""
        card_data = ModelCardData(
            library_name="hf_specdec",
            tags=["hf_specdec", "speculative-decoding", "ngram-drafter"],
            base_model=self.target_name,
        )
        counts = ", ".join(str(len(rows)) for rows in self._rows)
        return ModelCard.from_template(
            card_data,
            template_str=_TEMPLATE,
            model_name=kwargs.pop("model_name", "N-gram drafter"),
            contexts_per_order=counts,
            repo_id=kwargs.pop("repo_id", None),
            **self.config_dict(),
            **kwargs,
        )

    # ----- drafting -------------------------------------------------------------------------------------------

    def reset(self, context: DraftContext) -> None:
        if context.vocab_size != self.vocab_size:
            raise ValueError(
                f"This NGramDrafter was built for a vocabulary of {self.vocab_size} tokens but the target has "
                f"{context.vocab_size}. Rebuild it with `vocab_size={context.vocab_size}` from the target's tokenizer."
            )
        self.logits_processor = context.logits_processor
        self.sample = self.draft_mode == "sample"  # sampled drafts carry q (ignored when the target is greedy)
        self.tree_budget = context.tree_budget

    def distribution(self, context_tokens: Sequence[int]) -> tuple[torch.LongTensor, torch.FloatTensor]:
        """The continuations and their probabilities (renormalized) after the longest known suffix of the context."""
        return self._continuations(*self._row_of(context_tokens))

    def _row_of(self, context_tokens: Sequence[int]) -> tuple[int, int]:
        """(order, row) of the longest suffix of the context that the table knows."""
        for k in range(min(self.n, len(context_tokens) + 1), 0, -1):
            key = tuple(context_tokens[len(context_tokens) - k + 1 :]) if k > 1 else ()
            row = self._rows[k - 1].get(key)
            if row is not None:
                return k, row
        raise AssertionError("the unigram row always exists")

    def _continuations(self, k: int, row: int) -> tuple[torch.LongTensor, torch.FloatTensor]:
        tokens = self.tables[f"order_{k}.tokens"][row]
        probs = self.tables[f"order_{k}.probs"][row].float()
        keep = tokens >= 0
        return tokens[keep], probs[keep] / probs[keep].sum()

    def _most_probable(self, context_tokens: Sequence[int]) -> int:
        """The token a greedy draft takes after the context without logits processors: the argmax of its row's
        log q (ties: the lowest id, as `argmax` over the vocabulary picks), computed once per row."""
        found = self._row_of(context_tokens)
        best = self._best.get(found)
        if best is None:
            tokens, probs = self._continuations(*found)
            scores = probs.log()
            best = self._best[found] = int(tokens[scores == scores.max()].min())
        return best

    def propose(self, input_ids: torch.LongTensor, num_tokens: int, attention_mask=None) -> DraftProposal:
        batch = input_ids.shape[0]
        if num_tokens == 0:
            return DraftProposal.empty(batch, input_ids.device)
        if self.tree_budget is not None and batch == 1:  # trees are verified at batch size 1 only: chains otherwise
            return self._propose_tree(input_ids, num_tokens, self.tree_budget)
        ids = input_ids
        contexts = input_ids[:, max(0, input_ids.shape[1] - self.n + 1) :].tolist() if self.n > 1 else [[]] * batch
        if not self.sample and not self.logits_processor:  # nothing to standardize q with: the rows' best tokens
            return DraftProposal(tokens=self._greedy_drafts(contexts, num_tokens, input_ids.device), probs=None)
        drafted, probs = [], []
        for _ in range(num_tokens):
            q_logits = torch.full((batch, self.vocab_size), float("-inf"), device=input_ids.device)
            for row, context in enumerate(contexts):
                tokens, token_probs = self.distribution(context)
                q_logits[row, tokens.to(input_ids.device)] = token_probs.log().to(input_ids.device)
            scores = self.logits_processor(ids, q_logits)  # [batch, vocab]: q standardized like p
            if not torch.isfinite(scores).any(dim=-1).all():
                break  # the processors ruled out every continuation the table knows: stop drafting here
            if self.sample:
                q = scores.softmax(dim=-1)
                token = sample_tokens(q)[:, None]  # [batch, 1]
                probs.append(q)
            else:
                token = scores.argmax(dim=-1, keepdim=True)
            drafted.append(token)
            ids = torch.cat([ids, token], dim=-1)
            contexts = [
                (context + [t])[-(self.n - 1) :] if self.n > 1 else []
                for context, t in zip(contexts, token[:, 0].tolist())
            ]
        if not drafted:
            return DraftProposal.empty(batch, input_ids.device)
        return DraftProposal(tokens=torch.cat(drafted, dim=-1), probs=torch.stack(probs, 1) if probs else None)

    def _greedy_drafts(self, contexts: list[list[int]], num_tokens: int, device) -> torch.LongTensor:
        """Each row's greedy chain from its last n - 1 tokens, table lookups only (no vocabulary-sized tensor): what
        the general path drafts when there are no logits processors."""
        drafted = []
        for context in contexts:
            row = []
            for _ in range(num_tokens):
                row.append(self._most_probable(context))
                context = (context + row[-1:])[-(self.n - 1) :] if self.n > 1 else []
            drafted.append(row)
        return torch.tensor(drafted, dtype=torch.long, device=device)

    def _propose_tree(self, input_ids: torch.LongTensor, num_tokens: int, budget: int) -> DraftProposal:
        """Best-first by the sum of log q along the path (ties: the earlier candidate). A node's children are
        looked up only once nothing left is more probable than the node itself (its children are at most as
        probable), so the nodes that end up as leaves cost no lookup and no processor call."""
        tree = TokenTree(budget, num_tokens)
        recent = input_ids[0, -(self.n - 1) :].tolist() if self.n > 1 else []  # the n-gram context of the root
        # heap of (-path log q, order, node, token): a candidate `token` under parent `node`, or with token None,
        # `node` (already in the tree) waiting for its children to be looked up
        heap: list[tuple[float, int, int, int | None]] = []
        order = itertools.count()

        def push_children(node: int, path_log_q: float) -> None:
            path = tree.path(node)
            context = (recent + path)[-(self.n - 1) :] if self.n > 1 else []
            tokens, token_probs = self.distribution(context)
            q_logits = torch.full((1, self.vocab_size), float("-inf"), device=input_ids.device)
            q_logits[0, tokens.to(input_ids.device)] = token_probs.log().to(input_ids.device)
            ids = torch.cat([input_ids, torch.tensor([path], dtype=torch.long, device=input_ids.device)], dim=-1)
            scores = self.logits_processor(ids, q_logits)[0]  # [vocab]: q standardized like p, given this path
            log_q = scores.log_softmax(dim=-1)
            # tokens the processors ruled out are no candidates; the others are argmax-ranked (a stable sort of
            # ascending ids: ties go to the lower id, like argmax), and more than the budget left could never join
            finite = (scores > float("-inf")).nonzero()[:, 0]  # [candidates], ascending token ids
            ranked = finite[torch.sort(scores[finite], descending=True, stable=True).indices][: budget - len(tree)]
            for token, token_log_q in zip(ranked.tolist(), log_q[ranked].tolist()):
                heapq.heappush(heap, (-(path_log_q + token_log_q), next(order), node, token))

        push_children(-1, 0.0)
        while heap and not tree.full:
            negative_log_q, _, node, token = heapq.heappop(heap)
            if token is None:
                push_children(node, -negative_log_q)
                continue
            child = tree.add(node, token)
            if tree.depths[child] < num_tokens:
                heapq.heappush(heap, (negative_log_q, next(order), child, None))
        return tree.proposal(input_ids.device)

    def propose_for(self, input_ids, num_tokens: int, tree_budget: int | None = None) -> DraftProposal:
        """One stand-alone proposal (no target processors), handy for inspecting or comparing tables; a token tree
        of at most `tree_budget` nodes when it is given."""
        from transformers import LogitsProcessorList

        drafter = copy.copy(self)
        drafter.logits_processor, drafter.sample, drafter.tree_budget = LogitsProcessorList(), False, tree_budget
        return drafter.propose(torch.as_tensor(input_ids, dtype=torch.long), num_tokens)

    @classmethod
    def from_options(cls, pretrained_model_name_or_path: str | None = None, **options) -> NGramDrafter:
        """`generate(drafter="ngram", drafter_kwargs={"pretrained_model_name_or_path": ...})` lands here."""
        accepted = ["pretrained_model_name_or_path", *OVERRIDABLE, *_DOWNLOAD_OPTIONS]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            given = {"pretrained_model_name_or_path": pretrained_model_name_or_path, **options}
            raise TypeError(
                f"Unknown `drafter_kwargs` key(s) {unknown} for NGramDrafter, got drafter_kwargs={given!r}. "
                f"NGramDrafter accepts {accepted}."
            )
        if pretrained_model_name_or_path is None:
            raise ValueError(
                "`drafter='ngram'` needs a table: pass `drafter_kwargs={'pretrained_model_name_or_path': PATH}`, "
                "or pass the `NGramDrafter` itself as `drafter=`."
            )
        return cls.from_pretrained(pretrained_model_name_or_path, **options)


register_drafter("ngram", NGramDrafter)
