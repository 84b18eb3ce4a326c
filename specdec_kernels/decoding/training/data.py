"""The self-distillation data pipeline shared by the drafter trainers (Medusa heads,
``training.medusa``; the EAGLE-style head, ``training.eagle``).

1. Prompts: Spec-Bench questions (``specdec_kernels/data/spec_bench/question.jsonl``)
   through the chat template, split per category (``split_questions``): the first 2 of
   each category are what ``bench.e2e`` evaluates and the 3rd and 4th the tuning set;
   neither is ever trained on.
2. Text and features: the target continues every prompt with its own greedy text
   (``generate_data``: batched plain decoding with the engine, in the numerics
   ``--gen-numerics`` names) while ``HiddenRecorder`` keeps the target's final hidden state
   (after its final norm) of every position, and on request the outputs of some of its
   layers (EAGLE-3's features) beside it.  The result (``SelfDistilled``: token ids, fp16
   hidden states) is cached on disk
   (``cached_data``, ``cache_path``), finished batches too, so an interrupted run resumes
   and a second trainer on the same prompts reuses the first one's data.

Self-distillation on the target's own outputs follows Medusa-2 (Cai et al. 2024) and
EAGLE (Li et al. 2024): the drafter learns what the target says, not what a dataset says.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from specdec_kernels import files as _files
from specdec_kernels.checks import layer_indices
from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest, StepResult
from specdec_kernels.decoding.engine.loop import SpeculativeDecoder
from specdec_kernels.decoding.model import NUMERICS, Transformer
from specdec_kernels.decoding.training.instruct import FEW_CATEGORIES, written_prompts
from specdec_kernels.decoding.training.softmax import TrainingOptions
from specdec_kernels.files import BadFileError
from specdec_kernels.optional import require

if TYPE_CHECKING:
    from transformers import LlamaConfig

HELD_OUT_PER_CATEGORY = 4  # never trained on: 2 evaluated by bench.e2e, 2 for tuning the tree
BENCH_PER_CATEGORY = 2


# ---------------------------------------------------------------------- prompts
def split_questions(
    questions: Sequence[dict],
    per_category: int,
    long_per_category: Optional[int] = None,
    long_categories: Sequence[str] = (),
) -> Tuple[List[dict], List[dict], List[dict]]:
    """(train, tune, bench) Spec-Bench questions, each list in file order.

    bench: the first 2 questions of each category (those ``bench.e2e`` evaluates); tune: the
    3rd and 4th; train: up to ``per_category`` of the rest of each category
    (``long_per_category`` for the ``long_categories``, whose long prompts cost the most).
    """
    seen: Dict[str, int] = defaultdict(int)
    train, tune, bench = [], [], []
    for q in questions:
        c = q["category"]
        i = seen[c]
        seen[c] += 1
        cap = long_per_category if long_per_category is not None and c in long_categories else per_category
        if i < BENCH_PER_CATEGORY:
            bench.append(q)
        elif i < HELD_OUT_PER_CATEGORY:
            tune.append(q)
        elif i < HELD_OUT_PER_CATEGORY + cap:
            train.append(q)
    return train, tune, bench


def chat_ids(tokenizer, text: str) -> List[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


# ---------------------------------------------------------------------- data
class HiddenRecorder(Drafter):
    """Plain decoding (no drafts) that keeps the target's final hidden states.

    ``hidden[b]`` collects the final hidden state of consecutive positions from 0: those of
    the prompt tokens the prefill feeds (all but the last), read by a forward hook on the
    target's last decoder layer while the engine prefills (the final norm applied here, as
    ``Transformer.forward`` does), then the root of every step, handed over by the engine
    in ``observe`` (``StepResult.features.last``: the last accepted node, the root in plain
    decoding; the prefill's last fed token is the hook's).  With
    ``feature_layers`` (distinct layer indices of the target) each position's row also holds
    the outputs of those layers after the final hidden state, in that order (the layout of
    ``Transformer.forward``'s ``hidden_layers``): hooks on those layers in the prefill, the
    engine's ``hidden_layers`` in the steps.  Call ``prepare(model, prompts)`` before each
    ``generate`` and ``release()`` after it (``observe`` of the run's start does, once the
    prefill is done).

    Raises (from the engine's ``generate``):
        ValueError: a recorded row beyond float16's range (the layer outputs are the
            unnormalised residual streams).
    """

    name = "record-hidden"
    wants_hidden = True

    def __init__(self, feature_layers: Sequence[int] = ()) -> None:
        self.feature_layers = tuple(int(i) for i in feature_layers)

    def prepare(self, model: Transformer, prompts: Sequence[Sequence[int]]) -> None:
        self.model = model
        self.fed = [len(p) - 1 for p in prompts]
        self.hidden: List[List[torch.Tensor]] = [[] for _ in prompts]
        self._prefilling = True
        self._taps: Dict[int, torch.Tensor] = {}
        self._hooks = [
            model.layers[i].register_forward_hook(lambda m, a, out, i=i: self._taps.__setitem__(i, out))
            for i in self.feature_layers
        ]  # registered first: a tap on the last layer runs before the hook that reads it
        self._hooks.append(model.layers[-1].register_forward_hook(self._prefill_hook))

    def _prefill_hook(self, module, args, output) -> None:
        # Block.forward(x, cos, sin, layer_cache, write, cache_seqlens, ...): a prefill chunk
        # starts at cache_seqlens (the same for every sequence) and holds output.shape[1] rows
        if not self._prefilling:
            return
        start = int(args[5][0])
        rows = torch.cat([self.model.norm(output)] + [self._taps[i] for i in self.feature_layers], dim=-1)
        rows = float16_rows(rows, self.feature_layers)
        for b, f in enumerate(self.fed):
            n = min(rows.shape[1], f - start)
            if n > 0:
                self.hidden[b].extend(rows[b, :n])

    def release(self) -> None:
        """Remove the prefill's hooks from the model (again: a no-op)."""
        self._prefilling = False
        for hook in getattr(self, "_hooks", []):
            hook.remove()
        self._hooks, self._taps = [], {}

    def propose(self, request: DraftRequest) -> Draft:
        """No drafts: each sequence's root alone."""
        return Draft.from_lists([([h[-1]], [-1]) for h in request.histories])

    def observe(self, result: StepResult) -> None:
        """At the run's start remove the prefill's hooks (the engine prefills before it
        starts the drafter; the prefill's last fed token was recorded by the hook, so its
        ``features`` are skipped); after a step append ``result.features.last[b]`` (B, H')
        of every sequence whose row is valid (still running) to ``hidden[b]``, as float16."""
        super().observe(result)
        if result.started:
            self.release()
            return
        features = result.features
        for b, a in enumerate(features.valid):
            if a:
                self.hidden[b].append(float16_rows(features.last[b], self.feature_layers))


def float16_rows(rows: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """``rows`` (hidden states, and the outputs of ``layers``, which are the unnormalised residual
    streams) as float16 on the CPU, the form the data is kept in.

    Raises:
        ValueError: naming ``layers``, where a value is beyond float16's range or NaN.
    """
    if rows.numel() and not bool(rows.abs().max() < torch.finfo(torch.float16).max):  # NaN too
        raise ValueError(
            f"the hidden states or the outputs of layers {list(layers)} reach {float(rows.abs().max()):.3g}, "
            "beyond float16's range"
        )
    return rows.detach().to("cpu", torch.float16, copy=True)


@dataclass
class SelfDistilled:
    """Greedy continuations and the target's hidden states.

    tokens[s]: prompt + generated ids; prompt_lengths[s]; first[s]: the position of
    hidden[s][0]; hidden[s]: (T_s, hidden_size) fp16, consecutive positions; generated with
    feature layers (``generate_data``) (T_s, hidden_size * (1 + len(layers))): the final
    hidden state, then those layers' outputs.
    """

    tokens: List[List[int]]
    prompt_lengths: List[int]
    first: List[int]
    hidden: List[torch.Tensor]

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "prompt_lengths": self.prompt_lengths,
            "first": self.first,
            "hidden": self.hidden,
        }

    @classmethod
    def from_dict(cls, d, path, expected: Optional[int] = None) -> "SelfDistilled":
        """The data of a cache file's dict (``to_dict``'s), checked: the four lists, of one
        length (``expected`` when given), token lists of ints, 2-D hidden-state tensors.

        Raises:
            BadFileError: naming ``path``, when anything is missing or of another shape.
        """
        keys = ("tokens", "prompt_lengths", "first", "hidden")
        if not isinstance(d, dict) or any(not isinstance(d.get(k), list) for k in keys):
            raise BadFileError(path, f"not a self-distilled data cache (a dict of the lists {keys} was expected)")
        n = {len(d[k]) for k in keys}
        if len(n) != 1 or (expected is not None and n != {expected}):
            raise BadFileError(path, f"a self-distilled data cache of other prompts (list lengths {sorted(n)})")
        for i, (t, h) in enumerate(zip(d["tokens"], d["hidden"])):
            if not isinstance(t, list) or not all(isinstance(x, int) for x in t):
                raise BadFileError(path, f"sequence {i}'s tokens are not a list of ints")
            if not isinstance(h, torch.Tensor) or h.dim() != 2:
                raise BadFileError(path, f"sequence {i}'s hidden states are not a 2-D tensor")
        return cls(d["tokens"], d["prompt_lengths"], d["first"], d["hidden"])


def length_batches(lengths: Sequence[int], max_batch: int, max_tokens: int) -> List[List[int]]:
    """Indices grouped into batches of similar lengths (shortest first): at most ``max_batch``
    prompts and, beyond the first prompt, at most ``max_tokens`` padded prompt tokens each
    (the prefill pads every prompt to the batch's longest)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: List[List[int]] = []
    for i in order:
        b = batches[-1] if batches else None
        if b is None or len(b) >= max_batch or (len(b) + 1) * lengths[i] > max_tokens:
            batches.append([i])
        else:
            b.append(i)
    return batches


def generate_data(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    batch: int,
    stop_ids: Sequence[int],
    desc: str = "generate",
    partial: Optional[Path] = None,
    max_tokens: int = 4096,
    numerics: str = "float32",
    feature_layers: Sequence[int] = (),
) -> SelfDistilled:
    """Greedy continuations of every prompt and the hidden states, in batches of similar
    lengths (``length_batches(lengths, batch, max_tokens)``).

    ``partial``: a file where finished batches are kept, so that an interrupted run resumes
    where it stopped (same batches, so the same numbers); it is replaced atomically after each
    batch, and one that cannot be read (truncated, corrupt, other prompts) is reported with a
    warning and started over, never used.  ``numerics``: the model's ``Transformer.numerics``
    while it generates ("int8": 8-bit activations against the packed weights, the engine's
    fastest greedy on a CPU; the model's own numerics come back afterwards).
    ``feature_layers``: also record these layers' outputs beside each final hidden state
    (``HiddenRecorder``), so that no second pass over the data computes them.

    Raises:
        ValueError: an unknown ``numerics``; ``feature_layers`` not distinct layers of the model;
            a recorded value beyond float16's range.
    """
    tqdm = require("tqdm", purpose="training the heads (progress bars)", extra="engine").tqdm

    feature_layers = tuple(layer_indices("feature_layers", feature_layers, model.args.num_layers))
    recorder = HiddenRecorder(feature_layers)
    decoder = SpeculativeDecoder(model, recorder, stop_token_ids=stop_ids)
    width = model.args.hidden_size * (1 + len(feature_layers))
    out: Dict[int, tuple] = {}
    if partial is not None and partial.exists():
        out = _read_partial(partial, len(prompts), width)
    # numerics_as: ValueError for an unknown one, before any work
    with (
        model.numerics_as(numerics),
        tqdm(total=len(prompts), desc=desc, unit="prompt", file=sys.stderr, initial=len(out)) as bar,
    ):
        for idx in length_batches([len(p) for p in prompts], batch, max_tokens):
            if all(i in out for i in idx):
                continue
            out.update(_generate_batch(decoder, recorder, [prompts[i] for i in idx], idx, new_tokens, width))
            bar.update(len(idx))
            if partial is not None:
                _files.atomic_torch_save({i: list(v) for i, v in out.items()}, partial)
    return SelfDistilled(
        tokens=[out[i][0] for i in range(len(prompts))],
        prompt_lengths=[len(p) for p in prompts],
        first=[out[i][1] for i in range(len(prompts))],
        hidden=[out[i][2] for i in range(len(prompts))],
    )


def _generate_batch(
    decoder: SpeculativeDecoder,
    recorder: HiddenRecorder,
    prompts: Sequence[Sequence[int]],
    idx: Sequence[int],
    new_tokens: int,
    width: int,
) -> Dict[int, tuple]:
    """One batch of ``generate_data``: {idx[j]: (prompts[j] + its greedy continuation, 0,
    its hidden states (n, width) fp16)}, the recorder's hooks on the decoder's model meanwhile."""
    recorder.prepare(decoder.model, prompts)
    try:
        result = decoder.generate(prompts, new_tokens, num_draft_tokens=0)
    finally:
        recorder.release()  # never leave the hooks on the model
    out = {}
    for j, i in enumerate(idx):
        h = torch.stack(recorder.hidden[j]) if recorder.hidden[j] else torch.zeros(0, width, dtype=torch.float16)
        out[i] = (list(prompts[j]) + result.tokens[j], 0, h)
    return out


def _read_partial(partial: Path, num_prompts: int, width: int) -> Dict[int, tuple]:
    """The finished batches kept in ``partial`` ({prompt index: (tokens, first, hidden)}, the
    hidden states ``width`` wide), or {} (with a warning naming the file) when it cannot be
    read or holds other prompts."""
    try:
        d = _files.load_torch(partial, "self-distilled partial data")
        if not isinstance(d, dict) or not all(
            isinstance(i, int)
            and 0 <= i < num_prompts
            and isinstance(v, (list, tuple))
            and len(v) == 3
            and isinstance(v[2], torch.Tensor)
            and v[2].dim() == 2
            and v[2].shape[1] == width
            for i, v in d.items()
        ):
            raise BadFileError(partial, f"not the partial data of these {num_prompts} prompts")
        return {int(i): tuple(v) for i, v in d.items()}
    except BadFileError as e:
        warnings.warn(f"specdec_kernels: {e}; starting the data over", RuntimeWarning, stacklevel=3)
        return {}


def cached_data(
    path: Optional[Path], make, expected: Optional[int] = None, width: Optional[int] = None
) -> SelfDistilled:
    """The self-distilled data cached at ``path``, or ``make(partial path)``'s, then cached
    there (written atomically: a temporary file, then ``os.replace``).  A cache file that
    cannot be read (empty, truncated, corrupt, not a data cache, not ``expected`` sequences,
    hidden states not ``width`` wide) is reported with a warning naming it and regenerated,
    never used."""
    if path is not None and path.exists():
        try:
            data = SelfDistilled.from_dict(_files.load_torch(path, "self-distilled data cache"), path, expected)
            if width is not None and any(h.shape[1] != width for h in data.hidden):
                raise BadFileError(path, f"hidden states of another width than {width}")
        except BadFileError as e:
            warnings.warn(f"specdec_kernels: {e}; regenerating it", RuntimeWarning, stacklevel=2)
        else:
            print(f"(self-distilled data from the cache {path})", file=sys.stderr)
            return data
    data = make(None if path is None else path.with_suffix(".partial"))
    if path is not None:
        _files.atomic_torch_save(data.to_dict(), path)
        path.with_suffix(".partial").unlink(missing_ok=True)
    return data


# the sizes every tiny random test model shares: vocab 111, hidden 64, 4 query heads of dim 16
# over 2 KV heads, and large initial weights (peaked logits, so that drafts get accepted and rejected)
TINY_MODEL_SIZES = dict(
    vocab_size=111, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5
)


def tiny_llama_config(num_hidden_layers: int = 2, **overrides: Any) -> LlamaConfig:
    """The transformers ``LlamaConfig`` of a tiny random Llama: ``TINY_MODEL_SIZES``, an MLP of
    width 128, 512 positions, tied embeddings, ``num_hidden_layers`` layers; ``overrides`` (config
    fields) replace any of those."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **{
            **TINY_MODEL_SIZES,
            "intermediate_size": 128,
            "num_hidden_layers": num_hidden_layers,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
            **overrides,
        }
    )


def tiny_random_model(seed: int = 0) -> Transformer:
    """A 2-layer random Llama (``tiny_llama_config()``: vocab 111, hidden 64, head dim 16) as our
    Transformer, its weights drawn after ``torch.manual_seed(seed)``, for smoke tests."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return Transformer.from_hf_model(LlamaForCausalLM(tiny_llama_config()).eval())


def comma_list(text: str) -> List[str]:
    """The non-empty, stripped items of a comma-separated flag ("writing, coding,")."""
    return [c.strip() for c in text.split(",") if c.strip()]


class TinyTokenizer:
    """A character tokenizer for the tiny random model's smoke tests (``--random-model``):
    printable ASCII as ids 3..97 of its 111, a chat template of id 1, the text, id 98."""

    def encode(self, text: str) -> List[int]:
        return [ord(ch) - 29 for ch in text if 32 <= ord(ch) <= 126]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, return_dict: bool = False):
        return [1] + [t for m in messages for t in self.encode(m["content"])] + [98]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(int(t) + 29) for t in ids if 3 <= int(t) <= 97)


class Target(NamedTuple):
    """What ``load_target`` loads: the target, its tokenizer, the prompt sets (token ids), its
    stop ids and name, and the Spec-Bench questions (train split, all)."""

    model: Transformer
    tokenizer: Any
    train: List[List[int]]
    tune: List[List[int]]
    bench: List[List[int]]
    stop_ids: List[int]
    base_model: str
    train_questions: List[dict]
    all_questions: List[dict]


def load_target(args) -> Target:
    """The target and its prompts: SmolLM2-135M-Instruct on the Spec-Bench split
    (``split_questions``), or with ``--random-model`` a tiny random Llama, random prompts and
    a few made-up questions of the ``FEW_CATEGORIES`` (for the written prompts' smoke test)."""
    if args.random_model:
        model = tiny_random_model(args.seed)
        g = torch.Generator().manual_seed(args.seed)

        def rand(n):
            return [
                torch.randint(
                    0, TINY_MODEL_SIZES["vocab_size"], (int(torch.randint(2, 12, (1,), generator=g)),), generator=g
                ).tolist()
                for _ in range(n)
            ]

        vocab = ("tell", "me", "a", "story", "about", "the", "sea", "write", "code", "that", "sorts", "list", "of")
        questions = [
            {"category": c, "turns": [" ".join(vocab[int(i)] for i in torch.randint(0, len(vocab), (9,), generator=g))]}
            for c in FEW_CATEGORIES
            for _ in range(HELD_OUT_PER_CATEGORY + 3)
        ]
        train_q = split_questions(questions, 3)[0]
        return Target(model, TinyTokenizer(), rand(6), rand(3), rand(2), [], "tiny-random-llama", train_q, questions)
    from specdec_kernels.decoding.loading import MODEL_NAME, load_smollm2
    from specdec_kernels.decoding.prompts import spec_bench_questions

    model, tok = load_smollm2()
    longs = comma_list(args.long_categories)
    questions = spec_bench_questions()
    train, tune, bench = split_questions(questions, args.per_category, args.long_per_category, longs)
    ids = lambda qs: [chat_ids(tok, q["turns"][0]) for q in qs]  # noqa: E731
    return Target(model, tok, ids(train), ids(tune), ids(bench), [tok.eos_token_id], MODEL_NAME, train, questions)


def default_cache_dir(cache_dir: Optional[str] = None) -> Path:
    """Where generated data is cached: ``cache_dir``, else $SPECDEC_CACHE_DIR, else
    ~/.cache/specdec_kernels, with ``self-distilled`` appended."""
    return (
        Path(cache_dir or os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec_kernels")
        / "self-distilled"
    )


def cache_path(
    cache: Optional[Path],
    tag: str,
    fingerprint: str,
    new_tokens: int,
    gen_batch: int,
    gen_max_tokens: int,
    prompts: Sequence[Sequence[int]],
    numerics: str = "float32",
    feature_layers: Sequence[int] = (),
) -> Optional[Path]:
    """The cache file of one prompt set (None when ``cache`` is None): named by ``tag`` and a
    hash of everything the data depends on (the target's fingerprint, the generation
    settings, the prompts' token ids, and the numerics and recorded layers where they are
    not the defaults, so that a default run keeps the name it always had)."""
    if cache is None:
        return None
    parts: List[Any] = [fingerprint, new_tokens, gen_batch, gen_max_tokens, [list(p) for p in prompts]]
    if numerics != "float32" or feature_layers:
        parts += [numerics, [int(i) for i in feature_layers]]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return cache / f"{tag}-{key}.pt"


def self_distilled_sets(
    model: Transformer,
    fingerprint: str,
    sets: Dict[str, Sequence[Sequence[int]]],
    args,
    stop_ids: Sequence[int],
    cache: Optional[Path],
    feature_layers: Sequence[int] = (),
) -> List[SelfDistilled]:
    """``SelfDistilled`` data of each named prompt set, from the cache or generated (and
    then cached): the target's greedy continuations of ``args.new_tokens`` tokens, in
    batches of ``args.gen_batch`` prompts and ``args.gen_max_tokens`` padded tokens, in the
    numerics ``args.gen_numerics``; with ``feature_layers``, those layers' outputs recorded
    beside the final hidden states."""
    out = []
    numerics = args.gen_numerics
    width = model.args.hidden_size * (1 + len(feature_layers))
    with torch.inference_mode():
        for tag, prompts in sets.items():
            path = cache_path(
                cache,
                tag,
                fingerprint,
                args.new_tokens,
                args.gen_batch,
                args.gen_max_tokens,
                prompts,
                numerics,
                feature_layers,
            )
            out.append(
                cached_data(
                    path,
                    lambda part, prompts=prompts, tag=tag: generate_data(
                        model,
                        prompts,
                        args.new_tokens,
                        args.gen_batch,
                        stop_ids,
                        f"generate ({tag})",
                        part,
                        args.gen_max_tokens,
                        numerics,
                        feature_layers,
                    ),
                    expected=len(prompts),
                    width=width,
                )
            )
    return out


# ---------------------------------------------------------------------- the trainers' shared CLI
def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The flags both trainers take: which prompts, how the data is generated and cached,
    threads, the bench evaluation, the tiny random smoke test."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-category", type=int, default=76, help="training questions per Spec-Bench category at most")
    p.add_argument(
        "--long-per-category", type=int, default=76, help="training questions at most in the long-prompt categories"
    )
    p.add_argument(
        "--long-categories", default="summarization,rag", help="comma-separated categories with long prompts"
    )
    p.add_argument(
        "--written-per-category",
        type=int,
        default=0,
        help="training prompts the target writes per category of --written-categories (Self-Instruct; 0: none)",
    )
    p.add_argument(
        "--written-categories",
        default=",".join(FEW_CATEGORIES),
        help="comma-separated categories to write prompts for (default: the 8 with 10 Spec-Bench questions)",
    )
    p.add_argument("--new-tokens", type=int, default=384, help="greedy tokens generated per training prompt")
    p.add_argument("--gen-batch", type=int, default=24, help="prompts decoded together while generating, at most")
    p.add_argument(
        "--gen-numerics",
        choices=NUMERICS,
        default="float32",
        help="the target's numerics while it generates the data (int8: 8-bit activations, its fastest greedy on a CPU)",
    )
    p.add_argument(
        "--gen-max-tokens", type=int, default=4096, help="padded prompt tokens per generation batch, at most"
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="cache of generated data (default $SPECDEC_CACHE_DIR or ~/.cache/specdec_kernels)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--evaluate", action="store_true", help="then decode the bench prompts and report mean accepted length"
    )
    p.add_argument("--eval-tokens", type=int, default=128, help="new tokens per prompt in --evaluate")
    p.add_argument("--random-model", action="store_true", help="smoke test: a tiny random Llama and random prompts")


def flags_at_least(p: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str], low: int) -> None:
    """``p.error`` (exit 2, one line naming the flag) for a flag of ``names`` (attribute
    names; None, an unset optional flag, passes) below ``low``, or not a finite number."""
    for name in names:
        v = getattr(args, name)
        if v is not None and not low <= v < math.inf:
            p.error(f"--{name.replace('_', '-')} must be a finite number >= {low}, got {v}")


def check_data_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` (exit 2, one line naming the flag) for a bad flag of ``add_data_arguments``."""
    names = ("per_category", "long_per_category", "new_tokens", "gen_batch", "gen_max_tokens", "eval_tokens", "threads")
    flags_at_least(p, args, names, 1)
    flags_at_least(p, args, ["written_per_category"], 0)
    categories = comma_list(args.written_categories)
    if not categories:
        p.error("--written-categories names no category")
    from specdec_kernels.decoding.prompts import spec_bench_questions

    known = {q["category"] for q in spec_bench_questions()}
    if set(categories) - known:
        p.error(f"--written-categories: unknown {sorted(set(categories) - known)} (Spec-Bench has {sorted(known)})")
    if args.random_model and set(categories) - set(FEW_CATEGORIES):
        p.error(f"--written-categories: --random-model has questions of {list(FEW_CATEGORIES)} only")


TRAINING_OPTIONS = ("steps", "lr", "seed", "distill", "frequent", "negatives")


def add_training_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The optimiser and loss flags both trainers take: --steps (default ``steps``), --lr,
    --distill, and the sampled softmax's --frequent and --negatives."""
    p.add_argument("--steps", type=int, default=steps, help="optimiser steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--distill",
        type=float,
        default=1.0,
        help="weight of the soft labels (the target's own distribution) against its argmax, in [0, 1]",
    )
    p.add_argument("--frequent", type=int, default=4096, help="most frequent labels always in the sampled softmax")
    p.add_argument("--negatives", type=int, default=2048, help="tokens drawn from the rest of the vocabulary per step")


def check_training_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, **fields: Any) -> None:
    """``p.error`` (exit 2, one line naming the flag) for a bad flag of ``add_training_arguments``
    or a bad one of the other ``TrainingOptions`` ``fields`` (as ``training_options``): the
    check is ``TrainingOptions``' own, whose message starts with the field's name."""
    try:
        training_options(args, **fields)
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        p.error(f"--{name.replace('_', '-')} {rest}")


def training_options(args: argparse.Namespace, **fields: Any) -> TrainingOptions:
    """The trainers' ``TrainingOptions`` from the flags that ``add_training_arguments`` and
    ``add_data_arguments`` set (``TRAINING_OPTIONS``: steps, lr, seed, distill, frequent,
    negatives) and the other ``fields`` a trainer has flags for (medusa: weight_decay)."""
    return TrainingOptions(**{name: getattr(args, name) for name in TRAINING_OPTIONS}, **fields)


def training_record(prog_module: str, argv: Optional[Sequence[str]], args: argparse.Namespace) -> dict:
    """What a trained file records of how it was made: the command and every option."""
    return {
        "command": f"python -m {prog_module} " + " ".join(argv if argv is not None else sys.argv[1:]),
        **{k: v for k, v in vars(args).items() if k not in ("out", "cache_dir", "threads", "evaluate")},
    }


def evaluate_drafters(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    stop_ids: Sequence[int],
    drafters: Dict[str, Tuple[Drafter, int]],
    batch: int = 8,
) -> Dict[str, dict]:
    """Decode the prompts at temperature 0 with each named (drafter, K) and with plain
    decoding: per drafter the mean accepted length, tokens, target passes, seconds, and
    whether every output equals plain greedy decoding."""
    plain = SpeculativeDecoder(model, None, stop_token_ids=stop_ids)
    ref: List[List[int]] = []
    for s in range(0, len(prompts), batch):
        ref += plain.generate(prompts[s : s + batch], new_tokens, num_draft_tokens=0).tokens
    results = {}
    for name, (drafter, k) in drafters.items():
        decoder = SpeculativeDecoder(model, drafter, stop_token_ids=stop_ids)
        tokens: List[List[int]] = []
        steps, passes, t = 0, 0, time.perf_counter()
        for s in range(0, len(prompts), batch):
            r = decoder.generate(prompts[s : s + batch], new_tokens, num_draft_tokens=k)
            tokens += r.tokens
            steps += r.stats.sequence_steps
            passes += r.stats.target_passes
        emitted = sum(len(x) for x in tokens)
        results[name] = {
            "mean_accepted_length": emitted / max(steps, 1),
            "tokens": emitted,
            "target_passes": passes,
            "seconds": time.perf_counter() - t,
            "equals_plain_greedy": tokens == ref,
        }
    return results


def print_evaluation(results: Dict[str, dict]) -> None:
    """One line per drafter of ``evaluate_drafters``' results, then the JSON."""
    for name, r in results.items():
        print(
            f"{name}: mean accepted length {r['mean_accepted_length']:.3f} ({r['tokens']} tokens, "
            f"{r['target_passes']} target passes, {r['seconds']:.0f} s), equals plain greedy: {r['equals_plain_greedy']}"
        )
    print(json.dumps(results))


class TrainingSetup(NamedTuple):
    """What a trainer starts from (``prepare``)."""

    model: Transformer
    fingerprint: str
    base_model: str
    train: SelfDistilled
    tune: SelfDistilled
    bench_prompts: List[List[int]]
    stop_ids: List[int]

    def trained_config(self, record: dict, train_positions: int, losses: Sequence[float], figures: dict) -> dict:
        """What a trained file's config records: the base model and its fingerprint, and under
        ``"training"`` how the file was made (``record``, a ``training_record``), the training
        positions, the final loss (the mean of the last 20 steps') and the trainer's
        ``figures`` (e.g. its tuning-set figures)."""
        return {
            "base_model": self.base_model,
            "base_fingerprint": self.fingerprint,
            "training": {
                **record,
                "train_positions": int(train_positions),
                "final_loss": sum(losses[-20:]) / len(losses[-20:]),
                **figures,
            },
        }

    def save_and_evaluate(
        self,
        heads: Any,
        load: Callable[[str], Any],
        evaluate: Callable[..., Dict[str, dict]],
        args: argparse.Namespace,
        seconds: Tuple[float, float],
    ) -> int:
        """A trainer's end: save the trained ``heads`` at ``args.out`` and say so with the
        ``seconds`` (data, training) taken; with ``--evaluate``, read them back
        (``load(path)``) and print ``evaluate(model, heads, bench prompts, --eval-tokens, stop
        ids)`` (``print_evaluation``).  Returns 0, the exit status."""
        heads.save(args.out)
        print(f"saved {args.out} (data {seconds[0]:.0f} s, training {seconds[1]:.0f} s)", file=sys.stderr)
        if args.evaluate:
            heads = load(args.out)
            with torch.inference_mode():
                res = evaluate(self.model, heads, self.bench_prompts, args.eval_tokens, self.stop_ids)
            print_evaluation(res)
        return 0


def prepare(
    args: argparse.Namespace,
    check_target: Optional[Callable[[Transformer], Optional[str]]] = None,
    feature_layers: Sequence[int] = (),
) -> TrainingSetup:
    """Threads and seed from ``args``, the target (``load_target``) and the train and tune
    sets' self-distilled data (cached, ``self_distilled_sets``; with ``feature_layers``
    those layers' outputs recorded beside the final hidden states).  ``check_target(model)``:
    a message for a flag the loaded target does not fit (printed, exit 2, before any data
    is generated), or None."""
    from specdec_kernels.decoding.drafters.head_file import model_fingerprint

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target = load_target(args)
    model, train_p, stops, base = target.model, list(target.train), target.stop_ids, target.base_model
    problem = check_target(model) if check_target is not None else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    fingerprint = model_fingerprint(model)
    print(
        f"target {base} ({fingerprint}); prompts: {len(train_p)} train, {len(target.tune)} tune, "
        f"{len(target.bench)} bench (held out)",
        file=sys.stderr,
    )
    cache = None if args.random_model else default_cache_dir(args.cache_dir)
    if args.written_per_category:
        from specdec_kernels.decoding.training.agreement import HELDOUT, read_prompts

        categories = comma_list(args.written_categories)
        references = [t for q in target.all_questions for t in q["turns"]] + [
            r["prompt"] for r in read_prompts(HELDOUT)
        ]
        written = written_prompts(
            model,
            target.tokenizer,
            fingerprint,
            target.train_questions,
            references,
            args.written_per_category,
            categories,
            seed=args.seed,
            stop_ids=stops,
            cache=cache,
            numerics=args.gen_numerics,
        )
        train_p += [chat_ids(target.tokenizer, t) for t in written]
        print(f"{len(written)} written prompts added to the training prompts", file=sys.stderr)
    tune_d, train_d = self_distilled_sets(
        model, fingerprint, {"tune": target.tune, "train": train_p}, args, stops, cache, feature_layers
    )
    return TrainingSetup(model, fingerprint, base, train_d, tune_d, list(target.bench), list(stops))
