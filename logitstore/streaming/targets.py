"""The teacher's side of a micro-batch as the stream hands it to the losses: `SparseTargets` for a teacher
that shares the student's tokenizer, `AlignedTargets` for a cross-tokenizer teacher. Both are flattened
over the batch's supervised positions, so the losses (logitstore.trainer.losses, aligned_losses) read
them without padding."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SparseTargets:
    """The teacher's side of one micro-batch, flattened over its P supervised positions (E entries)."""

    entry_ids: Tensor  # [E] long: teacher entry token ids
    entry_logprobs: Tensor  # [E] float: full-vocabulary log-softmax at temperature 1 (quantized)
    entry_pos: Tensor  # [E] long: position in [0, P) of each entry, non-decreasing
    tail: Tensor  # [P] float: teacher mass outside the stored entries
    target_ids: Tensor  # [P] long: the actual next token
    target_logprobs: Tensor  # [P] float: teacher log-prob of the actual next token
    entry_counts: Tensor | None = None  # [E] float: draws per entry (sampled stores only)
    n_draws: int | None = None  # draws per position (sampled stores only)
    weight: Tensor | None = None  # [P] float: per-position weight of the KD term (None = 1)

    @property
    def n_positions(self) -> int:
        return int(self.tail.shape[0])

    def cut(self, a: int, b: int, *, entries: tuple[int, int]) -> SparseTargets:
        """Positions [a, b) and their entries [e0, e1) (`entries`: `position_slicer` finds them), renumbered
        from 0: a chunk of the head's positions."""
        e0, e1 = entries
        return SparseTargets(
            entry_ids=self.entry_ids[e0:e1],
            entry_logprobs=self.entry_logprobs[e0:e1],
            entry_pos=self.entry_pos[e0:e1] - a,
            tail=self.tail[a:b],
            target_ids=self.target_ids[a:b],
            target_logprobs=self.target_logprobs[a:b],
            entry_counts=None if self.entry_counts is None else self.entry_counts[e0:e1],
            n_draws=self.n_draws,
            weight=None if self.weight is None else self.weight[a:b],
        )

    def restrict(self, keep: Tensor) -> SparseTargets:
        """These targets at the positions where `keep` [P] (bool) holds, renumbered (chat data's completion)."""
        entries = keep[self.entry_pos]
        new_index = torch.cumsum(keep.long(), 0) - 1
        pick = lambda x: None if x is None else x[keep]
        return dataclasses.replace(
            self,
            entry_ids=self.entry_ids[entries],
            entry_logprobs=self.entry_logprobs[entries],
            entry_pos=new_index[self.entry_pos[entries]],
            tail=self.tail[keep],
            target_ids=self.target_ids[keep],
            target_logprobs=self.target_logprobs[keep],
            weight=pick(self.weight),
            entry_counts=None if self.entry_counts is None else self.entry_counts[entries],
        )


@dataclass
class AlignedTargets:
    """A cross-tokenizer teacher's signal on P student positions."""

    target_ids: Tensor  # [P] long: the student's actual next token
    exact_pos: Tensor  # [P1] long in [0, P): positions at 1:1 groups (same bytes, same preceding text)
    entry_ids: Tensor  # [E] long: the student id of each teacher entry (exact vocabulary map), -1 if none
    entry_logprobs: Tensor  # [E] float: the teacher's full-vocabulary log-softmax at temperature 1 (quantized)
    entry_pos: Tensor  # [E] long in [0, P1), non-decreasing
    tail: Tensor  # [P1] float: teacher mass outside its stored entries
    chain_teacher_logprob: Tensor  # [G] float: teacher log-prob of a many-token group's exact bytes
    chain_pos: Tensor  # [C] long in [0, P): student positions whose target log-probs sum to the group's
    chain_group: Tensor  # [C] long in [0, G), non-decreasing
    weight: Tensor | None = None  # [P] float per-position weight (several teachers mixed), None = 1

    @property
    def n_positions(self) -> int:
        return int(self.target_ids.shape[0])

    def cut(self, a: int, b: int) -> AlignedTargets:
        """These targets at positions [a, b), renumbered from 0: a chunk of the head's positions, which
        holds whole many-token groups (`objective._whole_groups` chooses the cuts)."""
        keep = (self.exact_pos >= a) & (self.exact_pos < b)
        new_index = torch.cumsum(keep.long(), 0) - 1  # exact position i -> its index in the chunk
        entries = keep[self.entry_pos]
        chain = (self.chain_pos >= a) & (self.chain_pos < b)
        groups, chain_group = torch.unique(self.chain_group[chain], return_inverse=True)
        return dataclasses.replace(
            self,
            target_ids=self.target_ids[a:b],
            exact_pos=self.exact_pos[keep] - a,
            tail=self.tail[keep],
            entry_ids=self.entry_ids[entries],
            entry_logprobs=self.entry_logprobs[entries],
            entry_pos=new_index[self.entry_pos[entries]],
            chain_teacher_logprob=self.chain_teacher_logprob[groups],
            chain_pos=self.chain_pos[chain] - a,
            chain_group=chain_group.reshape(-1),
            weight=None if self.weight is None else self.weight[a:b],
        )

    def restrict(self, keep: Tensor) -> AlignedTargets:
        """These targets at the student positions where `keep` [P] (bool) holds, renumbered (chat data's
        completion). A many-token group stays only if all its positions stay: its log-probability is a sum
        over all of them."""
        new_index = torch.cumsum(keep.long(), 0) - 1
        exact = keep[self.exact_pos]
        exact_index = torch.cumsum(exact.long(), 0) - 1
        entries = exact[self.entry_pos]
        n_groups = self.chain_teacher_logprob.shape[0]
        dropped = torch.zeros(n_groups, dtype=torch.long).index_add_(
            0, self.chain_group, (~keep[self.chain_pos]).long()
        )
        groups = dropped == 0
        links = groups[self.chain_group]
        return dataclasses.replace(
            self,
            target_ids=self.target_ids[keep],
            exact_pos=new_index[self.exact_pos[exact]],
            entry_ids=self.entry_ids[entries],
            entry_logprobs=self.entry_logprobs[entries],
            entry_pos=exact_index[self.entry_pos[entries]],
            tail=self.tail[exact],
            chain_teacher_logprob=self.chain_teacher_logprob[groups],
            chain_pos=new_index[self.chain_pos[links]],
            chain_group=(torch.cumsum(groups.long(), 0) - 1)[self.chain_group[links]],
            weight=None if self.weight is None else self.weight[keep],
        )
