"""Statistics of a speculative decoding run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List


@dataclass
class DecodeStats:
    """Counters and timers of one ``generate`` call (all sequences of the batch together).

    Attributes:
        target_passes: target forward passes of the decode loop (prefill not counted).
        prefill_passes: target forward passes of the prefill (prompt chunks).
        sequence_steps: (sequence, target pass) pairs in which the sequence was unfinished.
        tokens: tokens emitted (stop tokens included, nothing past max_new_tokens).
        draft_tokens: draft tokens proposed (tree nodes other than the root).
        accepted_draft_tokens: draft tokens accepted (before truncation at a stop token or
            max_new_tokens).
        proposed_at[j]: sequence steps whose draft reached depth j + 1.
        accepted_at[j]: sequence steps whose accepted path reached depth j + 1.
        draft_lengths: the draft length K requested for every sequence step (step order,
            after the cut at max_new_tokens): fixed, or chosen by a draft-length policy.
        policy: the draft-length policy that chose K ("" for a fixed K or a schedule).
        drafters: per sub-drafter counters of a ``MultiDrafter`` (which sources proposed
            the accepted nodes: see ``multi.DRAFTER_COUNTERS``); empty otherwise.
        threads: the intra-op thread count the decode steps ran with, per step shape class
            ("tokens<=N": the verified block's size rounded up to a power of two), as the
            engine's ``threads="auto"`` chose it by the end of the call (1 while more
            threads were not measured clearly faster; the steps that timed other counts ran
            with those) or as it was given ("all" when given); empty when unchanged.
        prefill_tokens: positions the target computed in the prefill (prompt tokens, plus the
            padding of ragged chunks; a shared prefix counts once).
        shared_prefill_tokens: prompt tokens whose K/V a sequence took from another one's
            blocks instead of computing them (prefix sharing; 0 without).
        draft_model_tokens: positions fed through model drafters' forward passes (their
            prefill and their drafting, padding included; a shared prefix counts once); 0
            without a model drafter.
        kv_cache_bytes: bytes of the KV caches allocated for the batch (target and model
            drafters; allocated once at the start, so also their peak).
        prefill_time, draft_time, verify_time, bookkeeping_time, total_time: seconds.
            draft = the drafter's propose and observe; verify = the target forward pass and
            the verification op; bookkeeping = the rest of the loop (emitting tokens, stop
            checks, KV-cache compaction); total = the whole call (prefill included).
    """

    target_passes: int = 0
    prefill_passes: int = 0
    sequence_steps: int = 0
    tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    proposed_at: List[int] = field(default_factory=list)
    accepted_at: List[int] = field(default_factory=list)
    draft_lengths: List[int] = field(default_factory=list)
    policy: str = ""
    drafters: Dict[str, Dict[str, float]] = field(default_factory=dict)
    threads: Dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    shared_prefill_tokens: int = 0
    draft_model_tokens: int = 0
    kv_cache_bytes: int = 0
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    bookkeeping_time: float = 0.0
    total_time: float = 0.0

    def record(self, depth: int, num_accepted: int, emitted: int) -> None:
        """One sequence's step: its draft's depth, accepted drafts and emitted tokens."""
        while len(self.proposed_at) < depth:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for j in range(depth):
            self.proposed_at[j] += 1
            if num_accepted > j:
                self.accepted_at[j] += 1
        self.sequence_steps += 1
        self.tokens += emitted
        self.accepted_draft_tokens += num_accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass per sequence, the bonus token included (plain
        decoding scores 1.00; Spec-Bench's "mean accepted tokens")."""
        return self.tokens / self.sequence_steps if self.sequence_steps else 0.0

    @property
    def acceptance_rates(self) -> List[float]:
        """rates[j]: P(the accepted path reaches depth j + 1 | the draft reached depth j + 1)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def mean_draft_length(self) -> float:
        """Mean K requested per sequence step."""
        return sum(self.draft_lengths) / len(self.draft_lengths) if self.draft_lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.total_time if self.total_time > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_accepted_length=self.mean_accepted_length,
            acceptance_rates=self.acceptance_rates,
            mean_draft_length=self.mean_draft_length,
            tokens_per_second=self.tokens_per_second,
        )
        return d

    def summary(self) -> str:
        """A few human-readable lines."""
        rates = " ".join(f"{r:.2f}" for r in self.acceptance_rates) or "-"
        policy = f" ({self.policy})" if self.policy else ""
        extra = [f"draft length K: mean {self.mean_draft_length:.2f}{policy}"] if self.draft_lengths else []
        for name, c in self.drafters.items():
            extra.append(
                f"  {name}: proposed {c.get('proposed', 0)}, accepted {c.get('accepted', 0)} "
                f"({c.get('only_accepted', 0)} by it alone), {c.get('propose_time', 0.0) + c.get('observe_time', 0.0):.2f} s"
            )
        other = self.total_time - self.prefill_time - self.draft_time - self.verify_time - self.bookkeeping_time
        return "\n".join(
            [
                f"tokens {self.tokens} in {self.total_time:.2f} s: {self.tokens_per_second:.1f} tokens/s",
                f"target passes {self.target_passes} (+{self.prefill_passes} prefill), "
                f"mean accepted length {self.mean_accepted_length:.2f} tokens/pass",
                f"drafts accepted {self.accepted_draft_tokens}/{self.draft_tokens}; acceptance by depth: {rates}",
                f"time: prefill {self.prefill_time:.2f} s, draft {self.draft_time:.2f} s, verify "
                f"{self.verify_time:.2f} s, bookkeeping {self.bookkeeping_time:.2f} s, other {max(other, 0):.2f} s",
            ]
            + extra
        )
