"""Speculative beam search (the paper's Appendix A.4)."""

from __future__ import annotations

__all__ = ["speculative_beam_search"]


def speculative_beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config, *, drafter,
                            options, streamer=None, inputs_tensor=None, stats=None, attach_stats=True,
                            **model_kwargs):
    raise ValueError(
        f"`num_beams` > 1 cannot be combined with a drafter, got num_beams={generation_config.num_beams}. "
        "Speculative beam search is not supported yet: use `num_beams=1`, or drop `assistant_model`/`drafter` "
        "for plain beam search."
    )
