"""``speculative_generate`` takes what ``model.generate`` takes (issue #38) and is safe to call
from several threads on one model (issue #39).

For each of generate's arguments that changes the output, on tiny random models of three
families (Llama, Qwen2, Mistral), batch 2 with left padding, greedy: our output equals
generate's with that argument, and generate's own output with it differs from its output
without it (so the comparison can fail).  Drafts come from prompt lookup trees, an assistant
model (chains and trees) or the target's early exit, so that logits processors meet draft
nodes with contexts of their own.  Also: a streamer receives exactly the returned tokens;
``model.generate(custom_generate=speculative_generate)`` equals generate; scores and logits
equal generate's; sampled first tokens follow the processed target distribution (chi-square);
what cannot be honoured is refused with a ValueError naming it; two threads on one model
interleaved by events both finish with generate's tokens.
"""

from __future__ import annotations

import string
import threading
import warnings

import pytest
import torch

from specdec_kernels.decoding import NgramDrafter
from tests.engine.families import tiny_family
from tests.engine.tiny import V, real_only
from tests.utils import P_THRESHOLD, chi_square_pvalue

transformers = pytest.importorskip("transformers")
from specdec_kernels.integrations.transformers import ATTENTION_NAME, speculative_generate  # noqa: E402

FAMILIES = ["llama", "qwen2", "mistral"]
BATCH = [[5, 17, 33, 2, 90, 41, 7, 5, 17, 33], [64, 3, 64, 3, 9]]  # the second row left-padded by 5
N = 12  # new tokens


def left_padded(prompts, pad=0):
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (P - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


IDS, MASK = left_padded(BATCH)
P = IDS.shape[1]


def generate(hf, **kw):
    """transformers' own generate of the batch (greedy unless told), quietly."""
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        return hf.generate(IDS, attention_mask=MASK, pad_token_id=0, **kw)


def ours(hf, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return speculative_generate(hf, IDS, attention_mask=MASK, pad_token_id=0, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, model, generate's greedy output of N tokens, two token ids its rows emit early)."""
    hf = tiny_family(request.param)
    free = generate(hf, max_new_tokens=N)
    early = [int(free[0, P + 2]), int(free[1, P + 3])]
    return request.param, hf, free, early


def char_tokenizer():
    """A character-level fast tokenizer over the tiny models' vocabulary of V tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = string.ascii_letters + string.digits
    tokens = list(chars) + [c + c for c in chars][: V - len(chars)]
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk)


class StopAfter(transformers.StoppingCriteria):
    """A caller's stopping criterion: stop a row once it holds ``token`` after the prompt."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, P:] == self.token).any(dim=1)


# ------------------------------------------------------------------ generate's arguments
# name -> (generate's arguments given to both; ours only (draft source); the baseline whose
# output the arguments must change, or None when the output's length is what they set)
CASES = {
    "max_length": (lambda e: dict(max_length=P + 7), dict(prompt_lookup_num_tokens=3), None),
    "default-length": (lambda e: dict(), dict(prompt_lookup_num_tokens=3), None),
    "eos-list": (lambda e: dict(eos_token_id=e, max_new_tokens=N), dict(assistant_early_exit=1), {}),
    "min_new_tokens": (
        lambda e: dict(eos_token_id=e, min_new_tokens=8, max_new_tokens=N),
        dict(prompt_lookup_num_tokens=3, tree=True),
        "eos",
    ),
    "repetition_penalty": (
        lambda e: dict(repetition_penalty=1.8, max_new_tokens=N),
        dict(prompt_lookup_num_tokens=3, tree=True),
        {},
    ),
    "repetition_penalty-assistant-tree": (
        lambda e: dict(repetition_penalty=1.8, max_new_tokens=N),
        dict(assistant="self", tree=(2, 2), num_draft_tokens=3),
        {},
    ),
    "no_repeat_ngram_size": (
        lambda e: dict(no_repeat_ngram_size=1, max_new_tokens=N),
        dict(assistant="other", num_draft_tokens=3),
        {},
    ),
    "bad_words-suppress": (
        lambda e: dict(bad_words_ids=[[e[0]]], suppress_tokens=[e[1]], max_new_tokens=N),
        dict(assistant_early_exit=1, tree=(2,)),
        {},
    ),
    "generation_config": (
        lambda e: dict(
            generation_config=transformers.GenerationConfig(
                max_new_tokens=N, repetition_penalty=1.5, eos_token_id=e[1], pad_token_id=0
            )
        ),
        dict(prompt_lookup_num_tokens=2),
        {},
    ),
    "prefix_allowed_tokens_fn": (
        lambda e: dict(prefix_allowed_tokens_fn=lambda b, row: [t for t in range(V) if t % 3 != b], max_new_tokens=N),
        dict(assistant="self", tree=(2,), num_draft_tokens=3),
        {},
    ),
    "stopping_criteria": (
        lambda e: dict(stopping_criteria=transformers.StoppingCriteriaList([StopAfter(e[1])]), eos_token_id=V - 1),
        dict(prompt_lookup_num_tokens=3),
        {"eos_token_id": V - 1},
    ),
    "num_assistant_tokens-heuristic": (
        lambda e: dict(max_new_tokens=N),
        dict(assistant="other", num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic"),
        None,
    ),
    "use_cache": (lambda e: dict(use_cache=False, max_new_tokens=N), dict(assistant_early_exit=1), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_arguments_equal_generate(family, case):
    name, hf, free, early = family
    shared, mine, baseline = CASES[case]
    kw = shared(early)
    mine = dict(mine)
    who = mine.pop("assistant", None)
    if who is not None:
        mine["assistant_model"] = hf if who == "self" else tiny_family(name, seed=1)
    ref = generate(hf, **kw)
    assert torch.equal(ours(hf, **kw, **mine), ref)
    if baseline == "eos":  # min_new_tokens: against EOS alone
        assert not torch.equal(ref, generate(hf, eos_token_id=early, max_new_tokens=N))
    elif baseline is not None:
        base = generate(hf, max_new_tokens=N, **baseline) if baseline else free
        assert not torch.equal(ref, base), f"{case} does not change generate's output here: the test cannot fail"
    if case == "max_length":
        assert ref.shape[1] == P + 7
    if case == "default-length":  # generate's default: 20 new tokens
        assert ref.shape[1] == P + 20


def test_stop_strings_with_a_tokenizer(family):
    name, hf, free, early = family
    tok = char_tokenizer()
    stop = tok.decode(free[1, P + 3 : P + 5])
    kw = dict(stop_strings=[stop], tokenizer=tok, eos_token_id=V - 1, max_new_tokens=N)
    ref = generate(hf, **kw)
    assert (ref[1, P + 5 :] == 0).all() and not (ref[0, P:] == 0).all()  # the second row stopped there
    assert torch.equal(ours(hf, prompt_lookup_num_tokens=3, tree=True, **kw), ref)


def test_a_streamer_receives_exactly_the_returned_tokens():
    """put(prompt (B, P)), then (B, n) blocks of whole columns, finished rows padded; end() once."""
    hf = tiny_family("llama")
    early = int(generate(hf, max_new_tokens=N)[1, P + 3])

    class Recorder(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.clone())

        def end(self):
            self.ends += 1

    for kw in (dict(prompt_lookup_num_tokens=3, tree=True), dict(assistant_model=hf, num_draft_tokens=4)):
        rec = Recorder()
        out = ours(hf, max_new_tokens=N, eos_token_id=early, streamer=rec, **kw)
        assert torch.equal(out, generate(hf, max_new_tokens=N, eos_token_id=early))
        assert (out[1, -1] == 0).item()  # a row finished early: its column entries are padding
        assert torch.equal(rec.puts[0], IDS) and rec.ends == 1
        assert all(p.dim() == 2 and p.shape[0] == 2 and p.shape[1] >= 1 for p in rec.puts[1:])
        assert torch.equal(torch.cat(rec.puts, dim=1), out)
    # transformers' own TextIteratorStreamer (batch 1) gets the text of the returned tokens
    tok = char_tokenizer()
    streamer = transformers.TextIteratorStreamer(tok)
    out = speculative_generate(hf, IDS[1:, 5:], max_new_tokens=N, streamer=streamer, prompt_lookup_num_tokens=3)
    assert "".join(streamer) == tok.decode(out[0])


def test_scores_and_logits_equal_generate(family):
    """return_dict_in_generate with output_scores / output_logits: generate's tuples of (B, V)
    per new position (processed scores, raw logits), NaN once a row has stopped."""
    name, hf, free, early = family
    for extra in (dict(), dict(repetition_penalty=1.5)):
        kw = dict(max_new_tokens=8, eos_token_id=early[1], return_dict_in_generate=True, output_scores=True, **extra)
        ref = generate(hf, output_logits=True, **kw)
        out = ours(hf, output_logits=True, prompt_lookup_num_tokens=3, tree=True, **kw)
        assert isinstance(out, transformers.generation.utils.GenerateDecoderOnlyOutput)
        assert torch.equal(out.sequences, ref.sequences)
        assert len(out.scores) == len(ref.scores) == len(out.logits) == out.sequences.shape[1] - P
        stopped = (out.sequences[1, P:] == early[1]).nonzero()[0, 0].item()  # the second row's EOS
        for t, (s, r, lo, lr) in enumerate(zip(out.scores, ref.scores, out.logits, ref.logits)):
            rows = [0, 1] if t <= stopped else [0]
            torch.testing.assert_close(s[rows], r[rows], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(lo[rows], lr[rows], rtol=1e-4, atol=1e-4)
            if t > stopped:
                assert s[1].isnan().all() and lo[1].isnan().all()
        if extra:  # the penalty is in the scores
            assert not torch.allclose(out.scores[3][0], out.logits[3][0])
    assert ours(hf, max_new_tokens=4, return_dict_in_generate=True).scores is None


def test_heuristic_schedule_per_row():
    """generate's "heuristic": +2 after a fully accepted draft, else -1 (at least 1), per row."""
    from types import SimpleNamespace

    from specdec_kernels.integrations._hf_generate import heuristic_schedule

    schedule = heuristic_schedule(3)
    state = SimpleNamespace(batch_size=3, last_step=None)
    assert schedule(0, state) == [3, 3, 3]
    state.last_step = SimpleNamespace(active=[True, True, False], num_accepted=[3, 1, 0], depths=[3, 3, 0])
    assert schedule(1, state) == [5, 2, 3]
    state.last_step = SimpleNamespace(active=[True, True, False], num_accepted=[0, 0, 0], depths=[5, 2, 0])
    assert schedule(2, state) == [4, 1, 3]
    assert schedule(3, state) == [3, 1, 3]  # never below 1


# ------------------------------------------------------------------ custom_generate
@pytest.mark.parametrize("extra", [dict(), dict(prompt_lookup_num_tokens=3, tree=True, repetition_penalty=1.5)])
def test_custom_generate_reaches_it(family, extra):
    """model.generate(**batch, custom_generate=speculative_generate): transformers prepares the
    config, processors and criteria, our loop decodes; equal to generate's output."""
    name, hf, free, early = family
    gen_only = {k: v for k, v in extra.items() if k not in ("prompt_lookup_num_tokens", "tree")}
    with torch.inference_mode():
        out = hf.generate(
            IDS, attention_mask=MASK, pad_token_id=0, max_new_tokens=N, custom_generate=speculative_generate, **extra
        )
    assert torch.equal(out, generate(hf, max_new_tokens=N, **gen_only))
    with torch.inference_mode():  # no padding: generate hands the loop no mask
        one = hf.generate(IDS[:1], max_new_tokens=N, custom_generate=speculative_generate, drafter=NgramDrafter(2))
    assert torch.equal(one, free[:1])


# ------------------------------------------------------------------ sampling
def test_sampled_first_tokens_follow_the_processed_target():
    """Repetition penalty, temperature, generate's default top-k of 50 and min-p, drafts sampled
    by an assistant model from its own processed logits: the first sampled token of many
    independent rows follows transformers' processed target distribution (p > 1e-3, fixed
    seeds: deterministic); the control (another temperature) is rejected."""
    hf = tiny_family("llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    n = 1200
    kw = dict(do_sample=True, temperature=1.3, min_p=0.02, repetition_penalty=1.6)
    out = speculative_generate(
        hf,
        torch.tensor([prompt] * n),
        max_new_tokens=2,
        seed=99,
        assistant_model=tiny_family("llama", seed=1),
        num_draft_tokens=2,
        **kw,
    )
    samples = out[:, len(prompt)]
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[:, -1].float()

    def target(temperature):
        lp = transformers.generation.logits_process
        procs = transformers.LogitsProcessorList(
            [
                lp.RepetitionPenaltyLogitsProcessor(1.6),
                lp.TemperatureLogitsWarper(temperature),
                lp.TopKLogitsWarper(50),
                lp.MinPLogitsWarper(0.02),
            ]
        )
        return torch.softmax(procs(torch.tensor([prompt]), logits.clone())[0].double(), -1)

    assert chi_square_pvalue(samples, target(1.3)) > P_THRESHOLD
    assert chi_square_pvalue(samples, target(1.3 * 1.5)) < P_THRESHOLD  # the test has power


def test_num_return_sequences_and_temperature_zero():
    hf = tiny_family("mistral")
    kw = dict(max_new_tokens=6, do_sample=True, num_return_sequences=3, prompt_lookup_num_tokens=2)
    a = ours(hf, seed=5, **kw)
    assert a.shape == (6, P + 6) and torch.equal(a[:, :P], IDS.repeat_interleave(3, dim=0))
    assert torch.equal(a, ours(hf, seed=5, **kw))  # reproducible
    assert len({tuple(r) for r in a[:3, P:].tolist()}) > 1  # the copies of a prompt sample on their own
    with pytest.raises(ValueError, match="temperature"):  # as generate
        ours(hf, max_new_tokens=4, do_sample=True, temperature=0.0)


# ------------------------------------------------------------------ refusals
REFUSED = [
    (dict(num_beams=2), "num_beams"),
    (dict(num_return_sequences=2), "num_return_sequences"),  # greedy: generate refuses it too
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
    (dict(guidance_scale=1.5), "guidance_scale"),
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(dola_layers="high"), "dola_layers"),
    (dict(use_mtp=True), "use_mtp"),
    (dict(assistant_ensemble_weight=0.5), "assistant_ensemble_weight"),
    (dict(token_healing=True), "token_healing"),
    (dict(cache_implementation="quantized"), "cache_implementation"),
    (dict(synced_gpus=True), "synced_gpus"),
    (dict(negative_prompt_ids=IDS), "negative_prompt_ids"),
    (dict(assistant_tokenizer=object()), "assistant_tokenizer"),
    (dict(inputs_embeds=torch.zeros(2, P, 64)), "inputs_embeds"),
    (dict(max_new_token=3), "max_new_token"),  # a typo
    (dict(position_ids=torch.zeros(2, P, dtype=torch.int64)), "position_ids"),
    (dict(stopping_criteria=[StopAfter(3)]), "eos_token_id"),  # batch without EOS: rows would keep going
    (dict(prompt_lookup_num_tokens=2, assistant_early_exit=1), "at most one draft source"),
    (dict(assistant_early_exit=2), "assistant_early_exit"),
    (dict(input_ids=IDS[0]), r"input_ids\[None\]"),
    (
        dict(logits_processor=[transformers.generation.logits_process.ClassifierFreeGuidanceLogitsProcessor(2.0)]),
        "ClassifierFreeGuidance",
    ),
]


@pytest.mark.parametrize("bad,word", REFUSED, ids=[w for _, w in REFUSED])
def test_what_cannot_be_honoured_is_refused(bad, word):
    hf = tiny_family("llama")
    kw = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=4, pad_token_id=0)
    kw.update(bad)
    if kw["input_ids"].dim() == 1:
        kw.pop("attention_mask")
    with pytest.raises(ValueError, match=word):
        speculative_generate(hf, kw.pop("input_ids"), **kw)
    assert hf.config._attn_implementation == "sdpa"


def test_missing_attention_mask_is_inferred_as_generate_does():
    """No mask: padding is where input_ids == pad_token_id unless pad is an EOS token."""
    hf = tiny_family("qwen2")
    with torch.inference_mode():
        ref = hf.generate(IDS, max_new_tokens=N, pad_token_id=0)
        same_as_eos = hf.generate(IDS, max_new_tokens=N, pad_token_id=0, eos_token_id=0)
    assert not torch.equal(ref[:, P:], same_as_eos[:, P:])  # padding attended when pad == eos
    assert torch.equal(speculative_generate(hf, IDS, max_new_tokens=N, pad_token_id=0), ref)
    assert torch.equal(speculative_generate(hf, IDS, max_new_tokens=N, pad_token_id=0, eos_token_id=0), same_as_eos)


# ------------------------------------------------------------------ threads
class Gate(NgramDrafter):
    """Prompt lookup that runs ``hook`` before its first proposal (the target's prefill is done)."""

    def __init__(self, hook):
        super().__init__(2)
        self.hook = hook
        self.passed = False

    def propose(self, request):
        if not self.passed:
            self.passed = True
            self.hook()
        return super().propose(request)


def test_two_threads_on_one_model():
    """A is decoding when B starts on the same model; A finishes (and releases the attention
    implementation) while B is mid-way; B must finish with generate's tokens, and the model is
    back on sdpa after both.  Forced by events: deterministic."""
    hf = tiny_family("llama")
    ref = generate(hf, max_new_tokens=N)
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    results, errors = {}, {}

    def gate_a():
        a_in.set()
        assert b_in.wait(120)

    def gate_b():
        assert a_in.is_set()
        b_in.set()
        assert a_done.wait(120)
        assert hf.config._attn_implementation == ATTENTION_NAME  # B still holds it

    def run(name, hook):
        try:
            results[name] = ours(hf, max_new_tokens=N, drafter=Gate(hook))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors[name] = e
        finally:
            if name == "a":
                a_done.set()

    ta = threading.Thread(target=run, args=("a", gate_a))
    ta.start()
    assert a_in.wait(120)
    tb = threading.Thread(target=run, args=("b", gate_b))
    tb.start()
    ta.join(180)
    tb.join(180)
    assert not errors, errors
    assert torch.equal(results["a"], ref) and torch.equal(results["b"], ref)
    assert hf.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------ the real model
@real_only
def test_real_smollm2_stop_strings_and_penalty():
    """SmolLM2, batch 2 left-padded chat prompts, repetition penalty and a stop string found in
    the first row's output without it: generate's tokens, and the streamer gets them."""
    from specdec_kernels.decoding.loading import load_hf_smollm2

    hf, tok = load_hf_smollm2()
    tok.padding_side = "left"
    texts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in ("Rename add to plus: def add(a, b): return a + b", "Say hello.")
    ]
    batch = tok(texts, return_tensors="pt", padding=True)
    L = batch.input_ids.shape[1]
    kw = dict(max_new_tokens=10, repetition_penalty=1.3)
    free = speculative_generate(hf, **batch, **kw)  # transformers' generate is slow here: one call only
    stop = tok.decode(free[0, L + 3 : L + 5])
    with torch.inference_mode():
        ref = hf.generate(**batch, stop_strings=[stop], tokenizer=tok, **kw)
    assert ref.shape[1] < free.shape[1] or (ref[0, L + 5 :] == tok.pad_token_id).all()  # the stop string acted
    puts = []

    class Recorder(transformers.generation.streamers.BaseStreamer):
        def put(self, value):
            puts.append(value)

        def end(self):
            puts.append(None)

    out = speculative_generate(
        hf, **batch, stop_strings=[stop], tokenizer=tok, prompt_lookup_num_tokens=4, streamer=Recorder(), **kw
    )
    assert torch.equal(out, ref)
    assert puts[-1] is None and torch.equal(torch.cat(puts[:-1], dim=1), out)
