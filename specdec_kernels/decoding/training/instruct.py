"""New training prompts written by the target itself, for the categories with few questions.

Spec-Bench's eight MT-bench categories (writing, roleplay, reasoning, math, coding,
extraction, stem, humanities) hold 10 questions each.  With 4 of each held out
(``data.HELD_OUT_PER_CATEGORY``), a trainer sees 6 prompts of writing or coding against 76
of translation or QA, and the heads agree least with the target on exactly those kinds of
text (docs/MEASUREMENTS.md, 2026-12-04).  Following Self-Instruct (Wang et al. 2023, "Self-
Instruct: Aligning Language Models with Self-Generated Instructions"), the target writes new
requests of each such category.  As in Self-Instruct, it is prompted as a plain language
model, not as a chat assistant: a numbered list of a few of the category's *training*
questions, "Request 4:" open at the end, which it continues, sampled at a positive
temperature (asked in the chat template for "one new request", the 135M model mostly
answered as an assistant instead).  A request is kept when it is new (``NoveltyFilter``): it
shares no run of ``NGRAM`` words with any Spec-Bench question, held-out ones included, nor
with a request kept before, and it has a sensible length.  So the benchmark's prompts are
never trained on, nor near-copies of them.

The drafters are then trained on the target's continuations of these requests, like on the
Spec-Bench training questions (``data.self_distilled_sets``); the requests are cached next to
that data (``cached_prompts``), keyed by everything they depend on.
"""

from __future__ import annotations

import json
import random
import re
import sys
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from specdec_kernels import files as _files
from specdec_kernels.checks import integer_at_least
from specdec_kernels.decoding.draft import SamplingParams
from specdec_kernels.decoding.engine.loop import SpeculativeDecoder
from specdec_kernels.decoding.model import NUMERICS, Transformer
from specdec_kernels.files import BadFileError
from specdec_kernels.optional import require

FEW_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
FEW_SHOT = 3  # examples per request prompt
NGRAM = 8  # a kept request shares no run of this many words with a Spec-Bench question
MIN_WORDS = 5
MAX_CHARS = 1500
ATTEMPTS_PER_PROMPT = 4  # requests drawn at most per prompt asked for, before giving up
TEMPERATURE, TOP_P, MAX_NEW_TOKENS = 0.8, 0.95, 160  # how a request is sampled


def words(text: str) -> List[str]:
    """Lower-cased word tokens of ``text`` (runs of letters, digits and underscores)."""
    return re.findall(r"\w+", text.lower())


def word_ngrams(text: str, n: int) -> Set[Tuple[str, ...]]:
    """The set of runs of ``n`` consecutive words of ``text`` (empty when it has fewer)."""
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


class NoveltyFilter:
    """Keeps a request that is new: at least ``min_words`` words and at most ``max_chars``
    characters, and no run of ``n`` words shared with a reference text or a request kept
    before (a request shorter than ``n`` words must not equal one, word for word).

    Args:
        references: texts a kept request must not copy from (all of Spec-Bench's questions).
        n, min_words, max_chars: as above, each >= 1.

    Raises:
        ValueError: n, min_words or max_chars < 1.
    """

    def __init__(
        self, references: Iterable[str], n: int = NGRAM, min_words: int = MIN_WORDS, max_chars: int = MAX_CHARS
    ):
        self.n, self.min_words, self.max_chars = (
            integer_at_least(name, v, 1) for name, v in (("n", n), ("min_words", min_words), ("max_chars", max_chars))
        )
        self.seen: Set[Tuple[str, ...]] = set()
        self.short: Set[Tuple[str, ...]] = set()
        for text in references:
            self._remember(text)

    def _remember(self, text: str) -> None:
        self.seen |= word_ngrams(text, self.n)
        w = tuple(words(text))
        if len(w) < self.n:
            self.short.add(w)

    def accept(self, text: str) -> bool:
        """Whether ``text`` is kept; a kept text is remembered (its repeats are refused)."""
        w = words(text)
        if len(w) < self.min_words or len(text) > self.max_chars:
            return False
        grams = word_ngrams(text, self.n)
        if grams & self.seen or (len(w) < self.n and tuple(w) in self.short):
            return False
        self._remember(text)
        return True


def request_prompt(examples: Sequence[str]) -> str:
    """The text the target continues to write one new request like the ``examples``: the
    examples as a numbered list of requests, then the next number's label, open."""
    shown = "".join(f"Request {i + 1}:\n{e.strip()}\n\n" for i, e in enumerate(examples))
    return f"{shown}Request {len(examples) + 1}:\n"


_NEXT = re.compile(r"\n\s*Request\s*\d*\s*:|\n\s*\n\s*\n")


def clean_request(text: str) -> str:
    """The request in the target's continuation: up to the next "Request N:" label (or two
    empty lines), stripped."""
    return _NEXT.split(text, maxsplit=1)[0].strip()


def _category_seed(seed: int, category: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(category.encode())) & 0x7FFFFFFF


def write_prompts(
    model: Transformer,
    encode: Callable[[str], List[int]],
    decode: Callable[[List[int]], str],
    examples: Dict[str, Sequence[str]],
    per_category: int,
    references: Iterable[str],
    *,
    seed: int,
    stop_ids: Sequence[int],
    batch: int = 16,
    max_new_tokens: int = MAX_NEW_TOKENS,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    few_shot: int = FEW_SHOT,
    done: Optional[Dict[str, List[str]]] = None,
    on_category: Optional[Callable[[str, List[str]], None]] = None,
) -> Dict[str, List[str]]:
    """Up to ``per_category`` new requests per category of ``examples``, written by ``model``: category -> its
    kept requests, in the order written.

    Each attempt shows the target ``few_shot`` of the category's examples (drawn with a generator seeded by ``seed``
    and the category) in ``request_prompt``, samples its continuation at ``temperature`` / ``top_p`` (seeded per
    attempt, so a run is reproducible), and keeps ``clean_request(continuation)`` when a ``NoveltyFilter`` over
    ``references`` (and the examples) accepts it.  At most ``ATTEMPTS_PER_PROMPT * per_category`` attempts per
    category, in batches of ``batch``; a category can come back short.

    Args:
        model: the target.
        encode: text -> the target's token ids (plain text, no chat template).
        decode: generated token ids -> text (special tokens dropped).
        examples: category -> its training questions' texts (never held-out ones), each category non-empty.
        per_category: requests wanted per category, >= 0.
        references: texts no request may copy from (every Spec-Bench question, the held-out prompts).
        done: categories finished by an interrupted run (their requests, taken as they are and counted by the
            novelty filter); the others are written as in a fresh run.
        on_category: called with each category and its requests once it is finished (to keep them, so that an
            interrupted run resumes).

    Raises:
        ValueError: per_category < 0, batch, max_new_tokens or few_shot < 1, a category without examples.
    """
    _check_request_arguments(examples, per_category, batch, max_new_tokens, few_shot)
    tqdm = require("tqdm", purpose="writing training prompts (progress bars)", extra="engine").tqdm
    novelty = NoveltyFilter([*references, *(e for ex in examples.values() for e in ex)])
    decoder = SpeculativeDecoder(model, None, stop_token_ids=list(stop_ids))
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    writer = _RequestWriter(
        decoder, encode, decode, novelty, sampling, seed, stop_ids, per_category, batch, max_new_tokens, few_shot
    )
    out = writer.resume(done, examples)
    total = per_category * len(examples)
    with tqdm(
        total=total, desc="write prompts", unit="prompt", file=sys.stderr, initial=per_category * len(out)
    ) as bar:
        for category in [c for c in examples if c not in out]:  # those that ``done`` does not hold
            out[category] = writer.category(category, examples[category], bar)
            if on_category is not None:
                on_category(category, out[category])
    return {c: out[c] for c in examples}


def _check_request_arguments(
    examples: Dict[str, Sequence[str]], per_category: int, batch: int, max_new_tokens: int, few_shot: int
) -> None:
    """``write_prompts``'s checks of its arguments (its ValueErrors)."""
    integer_at_least("per_category", per_category, 0)
    for name, v in (("batch", batch), ("max_new_tokens", max_new_tokens), ("few_shot", few_shot)):
        integer_at_least(name, v, 1)
    for c, ex in examples.items():
        if not ex:
            raise ValueError(f"examples of category {c!r} are empty")


@dataclass
class _RequestWriter:
    """How ``write_prompts`` writes requests: the target's decoder, the tokenizer's ``encode`` and
    ``decode``, the novelty filter, the sampling and the settings (as ``write_prompts``'s)."""

    decoder: SpeculativeDecoder
    encode: Callable[[str], List[int]]
    decode: Callable[[List[int]], str]
    novelty: NoveltyFilter
    sampling: SamplingParams
    seed: int
    stop_ids: Sequence[int]
    per_category: int
    batch: int
    max_new_tokens: int
    few_shot: int

    def resume(self, done: Optional[Dict[str, List[str]]], examples: Dict[str, Sequence[str]]) -> Dict[str, List[str]]:
        """The categories of ``examples`` that ``done`` holds, their requests counted by the novelty filter."""
        out: Dict[str, List[str]] = {c: list(v) for c, v in (done or {}).items() if c in examples}
        for kept in out.values():
            for text in kept:
                self.novelty.accept(text)
        return out

    def category(self, category: str, ex: Sequence[str], bar) -> List[str]:
        """The requests kept for ``category`` from its examples ``ex``, each one counted on the progress
        ``bar`` as it is kept, the ones missing (a short category) at the end."""
        rng = random.Random(_category_seed(self.seed, category))
        kept: List[str] = []
        attempts, most = 0, ATTEMPTS_PER_PROMPT * self.per_category
        while len(kept) < self.per_category and attempts < most:
            n = min(self.batch, most - attempts)
            shots = [rng.sample(list(ex), min(self.few_shot, len(ex))) for _ in range(n)]
            prompts = [self.encode(request_prompt(s)) for s in shots]
            seeds = [_category_seed(self.seed, category) + attempts + i for i in range(n)]
            result = self.decoder.generate(
                prompts, self.max_new_tokens, num_draft_tokens=0, sampling=self.sampling, seeds=seeds
            )
            attempts += n
            for tokens in result.tokens:
                text = clean_request(self.decode([t for t in tokens if t not in self.stop_ids]))
                if len(kept) < self.per_category and self.novelty.accept(text):
                    kept.append(text)
                    bar.update(1)
        bar.update(self.per_category - len(kept))  # a short category's missing prompts
        return kept


def prompts_cache_path(cache: Optional[Path], fingerprint: str, settings: dict) -> Optional[Path]:
    """The cache file of one set of written requests (None when ``cache`` is None), named by
    a hash of the target's fingerprint and every setting they depend on."""
    if cache is None:
        return None
    key = zlib.crc32(json.dumps([fingerprint, settings], sort_keys=True).encode())
    return cache / f"written-prompts-{key:08x}.json"


def _read_requests(path: Path) -> Optional[Dict[str, List[str]]]:
    """The dict of lists of strings in the JSON file at ``path``, or None (with a
    RuntimeWarning naming the file) when it cannot be read or holds something else."""
    try:
        d = json.loads(path.read_text())
        why = "not a cache of written prompts (a dict of lists of strings)"
    except (OSError, ValueError) as e:
        d, why = None, f"not readable as JSON ({type(e).__name__}: {e})"
    if isinstance(d, dict) and all(isinstance(v, list) and all(isinstance(t, str) for t in v) for v in d.values()):
        return d
    warnings.warn(f"specdec_kernels: {BadFileError(path, why)}; regenerating it", RuntimeWarning, stacklevel=3)
    return None


def _write_requests(path: Path, d: Dict[str, List[str]]) -> None:
    _files.atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(d, indent=1)))


def cached_prompts(
    path: Optional[Path],
    make: Callable[[Dict[str, List[str]], Optional[Callable[[str, List[str]], None]]], Dict[str, List[str]]],
) -> Dict[str, List[str]]:
    """The requests cached at ``path``, or ``make(done, on_category)``'s, then cached there
    atomically.  Meanwhile every finished category is kept in a partial file beside it
    (``.partial.json``), whose categories ``make`` gets back as ``done`` when an interrupted
    run starts again.  A file that cannot be read, or is not a dict of lists of strings, is
    reported with a RuntimeWarning naming it and regenerated, never used."""
    if path is not None and path.exists():
        d = _read_requests(path)
        if d is not None:
            print(f"(written prompts from the cache {path})", file=sys.stderr)
            return d
    if path is None:
        return make({}, None)
    partial = path.with_suffix(".partial.json")
    done = (_read_requests(partial) if partial.exists() else None) or {}

    def keep(category: str, requests: List[str]) -> None:
        done[category] = requests
        _write_requests(partial, done)

    d = make(dict(done), keep)
    _write_requests(path, d)
    partial.unlink(missing_ok=True)
    return d


def _written_settings(
    examples: Dict[str, List[str]],
    per_category: int,
    references: Sequence[str],
    *,
    seed: int,
    batch: int,
    numerics: str,
) -> dict:
    """Every setting ``written_prompts``'s requests depend on (their cache key); ``numerics`` only when it is
    not "float32" (so float32 runs keep their cache files)."""
    settings = dict(
        examples=examples,
        per_category=per_category,
        seed=seed,
        batch=batch,
        few_shot=FEW_SHOT,
        ngram=NGRAM,
        attempts=ATTEMPTS_PER_PROMPT,
        prompt=request_prompt(["{example}"]),
        sampling=[TEMPERATURE, TOP_P, MAX_NEW_TOKENS],
        references=zlib.crc32(json.dumps(list(references)).encode()),
    )
    if numerics != "float32":
        settings["numerics"] = numerics
    return settings


@torch.inference_mode()
def written_prompts(
    model: Transformer,
    tokenizer,
    fingerprint: str,
    train_questions: Sequence[dict],
    references: Sequence[str],
    per_category: int,
    categories: Sequence[str],
    *,
    seed: int,
    stop_ids: Sequence[int],
    cache: Optional[Path],
    batch: int = 16,
    numerics: str = "float32",
) -> List[str]:
    """``write_prompts`` for ``categories`` from their ``train_questions`` (first turns),
    never copying any of the ``references`` (every Spec-Bench turn and the held-out prompts of
    ``training.agreement``), through ``cached_prompts``; the kept requests of every category
    in one list (categories in the order given).  The target samples them in ``numerics``
    (``Transformer.numerics``; "int8" is its fastest decoding on a CPU), a part of the cache
    key when it is not "float32" (so float32 runs keep their cache files).

    Raises:
        ValueError: a category with no training question, an unknown ``numerics``, and as
            ``write_prompts``.
    """
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    examples: Dict[str, List[str]] = {c: [] for c in categories}
    for q in train_questions:
        if q["category"] in examples:
            examples[q["category"]].append(q["turns"][0])
    settings = _written_settings(examples, per_category, references, seed=seed, batch=batch, numerics=numerics)

    def make(done, on_category) -> Dict[str, List[str]]:
        with model.numerics_as(numerics):
            return write_prompts(
                model,
                tokenizer.encode,
                lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                examples,
                per_category,
                references,
                seed=seed,
                stop_ids=stop_ids,
                batch=batch,
                done=done,
                on_category=on_category,
            )

    written = cached_prompts(prompts_cache_path(cache, fingerprint, settings), make)
    for c in categories:
        print(f"  {c}: {len(written.get(c, []))} written prompts", file=sys.stderr)
    return [t for c in categories for t in written.get(c, [])]
