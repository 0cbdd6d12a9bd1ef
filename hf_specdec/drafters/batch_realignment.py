"""Where a draft model's cache moves in a padded batch: after each round the loop re-pads the rows so that they end
together again, and the draft cache follows them (as the target's cache does), keeping per row the cached tokens
that are still its prefix."""

from __future__ import annotations

import torch

__all__ = ["batch_realignment"]


def batch_realignment(
    fed_ids: torch.LongTensor,
    fed_mask: torch.LongTensor,
    input_ids: torch.LongTensor,
    attention_mask: torch.LongTensor,
    old_padding: list[int] | None,
    padding: list[int] | None,
) -> tuple[int, int, bool, torch.LongTensor]:
    """`(kept, shift, alike, columns)`: how many of the new columns the draft cache keeps, how far the first row
    moved right, whether every row moved alike, and `columns` (`[batch, width]`: for each new column of each row,
    the column it was in; `width` = `input_ids`' width less the newest token, never cached).

    `fed_ids` / `fed_mask` (`[batch, cached]`): what the cache holds, in the old columns; `input_ids` /
    `attention_mask`: the re-padded rows. With `padding` (each row's left padding in `input_ids`, on the host, and
    `old_padding` the same for what the cache holds, or None to read it once), nothing is read from the device: a
    row moved right by as much as it emitted fewer tokens than the longest row, which puts its first rejected draft
    at the newest column or past it, so everything it fed before that column is its prefix. Without `padding`, the
    cached ids are compared with the new ones on the device (one read)."""
    width = input_ids.shape[1] - 1
    positions = torch.arange(width, device=input_ids.device)[None, :]  # [1, width]
    if padding is not None:
        if old_padding is None:
            old_padding = (fed_mask == 0).sum(-1).tolist()
        moved_rows = [new - old for new, old in zip(padding, old_padding)]
        kept = max(0, min(width, *(moved + fed_ids.shape[1] for moved in moved_rows)))
        shift, alike = moved_rows[0], all(moved == moved_rows[0] for moved in moved_rows)
        moved = torch.tensor(moved_rows, device=input_ids.device)
        return kept, shift, alike, positions - moved[:, None]
    old_pad = (fed_mask == 0).sum(-1)  # [batch]: left padding of what the cache holds
    new_pad = (attention_mask == 0).sum(-1)  # [batch]
    moved = new_pad - old_pad  # [batch]: how far each row moved right
    columns = positions - moved[:, None]  # [batch, width]: where each new column was
    fed_here = fed_ids.gather(1, columns.clamp(0, fed_ids.shape[1] - 1))
    in_cache = (columns >= 0) & (columns < fed_ids.shape[1])
    # a row's cached prefix stays valid up to its first column that is not what it now holds (padding is masked)
    same = (in_cache & (fed_here == input_ids[:, :width])) | (positions < new_pad[:, None])
    kept, shift, alike = torch.stack(
        [same.long().cumprod(-1).sum(-1).min(), moved[0], (moved == moved[0]).all().long()]
    ).tolist()  # one device sync
    return kept, shift, bool(alike), columns
