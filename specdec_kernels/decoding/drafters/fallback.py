"""Fallback drafting (``FallbackDrafter``): each sequence takes the draft of the first
sub-drafter, in order, that drafts anything for it.

Later sub-drafters are not asked for that sequence: a cheap, confident source (prompt lookup
with a match of 2 tokens or more) goes first and a model drafter fills the steps where it
has nothing, and the target verifies only the draft chosen (a merged tree, ``MergeDrafter``,
verifies every drafter's nodes, which a CPU pays for per node).  A sub-drafter observes only
the steps it was asked to draft in (its node indices through ``merge.own_accepted_path``) and
catches up on the committed tokens when next asked.

Which sub-drafter will draft is known before K is chosen when the ones before the last say
so (``drafts_for``): ``draft_sources`` hands it to a draft-length policy, which keeps each
source's acceptance apart (``CostModelPolicy``).
"""

from __future__ import annotations

from typing import List, Optional

from specdec_kernels.decoding.draft import Draft, DraftRequest
from specdec_kernels.decoding.drafters.merge import MergeDrafter


class FallbackDrafter(MergeDrafter):
    """Each sequence's draft is the first sub-drafter's, in order, that drafts at least one
    token for it; a later sub-drafter is asked only for the sequences still without a draft
    (so it costs nothing where an earlier one drafted), e.g. prompt lookup with a long match
    first, else an EAGLE head.  One drafter's tree is verified, not the union.

    Args:
        drafters, max_nodes, max_depths, names: as ``MergeDrafter`` (``max_nodes`` cuts the
            draft chosen).

    Raises:
        As ``MergeDrafter``.

    Example::

        drafter = FallbackDrafter([NgramDrafter(min_ngram=2), EagleDrafter(model, tree=False)])
    """

    fallback = True

    def _still_waiting(self, waiting: List[bool], draft: Draft) -> List[bool]:
        """The sequences still without a draft after ``draft``: those waiting for which it
        holds the root alone."""
        return [w and int(c) <= 1 for w, c in zip(waiting, draft.num_nodes.tolist())]

    def draft_sources(self, request: DraftRequest) -> Optional[List[int]]:
        """Per sequence, the index of the sub-drafter that will draft for it at K >= 1: the
        first whose ``drafts_for(history)`` is true, else the last one (which is asked
        whatever the others do); the last one for an inactive sequence.  None where that
        cannot be known before drafting (a sub-drafter before the last without
        ``drafts_for``).

        Args:
            request: the batch's ``request.histories`` and ``request.active`` (its
                ``num_draft_tokens`` are not read: K is not chosen yet).

        Returns:
            One int in 0..len(drafters) - 1 per sequence, or None.
        """
        histories, active = request.histories, request.active
        last = len(self.drafters) - 1
        caps = self.max_depths or [None] * len(self.drafters)
        # the sub-drafters before the last; one capped at depth 0 never drafts
        predicates = [
            (lambda h: False) if c == 0 else getattr(d, "drafts_for", None) for d, c in zip(self.drafters[:last], caps)
        ]
        if None in predicates:
            return None
        return [
            next((i for i, p in enumerate(predicates) if p(h)), last) if a else last for h, a in zip(histories, active)
        ]
