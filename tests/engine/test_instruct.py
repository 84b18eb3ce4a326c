"""Training prompts the target writes (``training.instruct``): the novelty filter by hand,
the reply cleaning, reproducible writing on the tiny model, the cache, the trainers' flags."""

from __future__ import annotations

import json
import re

import pytest

from specdec_kernels.decoding.training import data as train_data
from specdec_kernels.decoding.training import eagle as train_eagle
from specdec_kernels.decoding.training import instruct

REFERENCE = "Write a persuasive essay about the benefits of public libraries in small towns today."


def test_novelty_filter_by_hand():
    f = instruct.NoveltyFilter([REFERENCE], n=4, min_words=3, max_chars=200)
    # shares "benefits of public libraries" (4 words) with the reference
    assert not f.accept("List the benefits of public libraries for kids.")
    # shares only 3-word runs ("the benefits of"): new
    assert f.accept("Explain the benefits of parks and public libraries.")
    # its own repeat (case and punctuation aside) is refused once kept
    assert not f.accept("explain THE benefits of parks, and public libraries!")
    assert not f.accept("Too short")  # 2 words < min_words
    assert not f.accept("word " * 60)  # 300 characters > max_chars
    assert f.accept("A different request entirely about cooking pasta.")


def test_novelty_filter_refuses_a_short_copy():
    """A text shorter than n words has no n-gram: it is compared word for word."""
    f = instruct.NoveltyFilter(["Name three rivers."], n=8, min_words=1)
    assert not f.accept("name three RIVERS")
    assert f.accept("Name three mountains.")
    assert not f.accept("Name three mountains")


@pytest.mark.parametrize("bad", [dict(n=0), dict(min_words=0), dict(max_chars=0), dict(n=True), dict(n=2.5)])
def test_novelty_filter_bad_sizes(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        instruct.NoveltyFilter([], **bad)


@pytest.mark.parametrize(
    "reply, want",
    [
        ("  Plan a trip to Rome.  \n\nRequest 5:\nSomething else", "Plan a trip to Rome."),
        ("Describe a sunset.\nRequest:\nmore", "Describe a sunset."),
        ("Sort a list in C.\n\n\nTrailing text", "Sort a list in C."),
        ("Two lines\nof one request.", "Two lines\nof one request."),
        ("One paragraph.\n\nAnother of the same request.", "One paragraph.\n\nAnother of the same request."),
    ],
)
def test_clean_request_by_hand(reply, want):
    assert instruct.clean_request(reply) == want


def test_request_prompt_lists_the_examples_and_leaves_the_next_open():
    text = instruct.request_prompt(["First one.", "  Second one. "])
    assert text == "Request 1:\nFirst one.\n\nRequest 2:\nSecond one.\n\nRequest 3:\n"


def _write(model, per_category, seed, references=(), **options):
    tok = train_data.TinyTokenizer()
    examples = {"writing": ["tell me a story about the sea", "write a poem on the moon"], "coding": ["sort a list"]}
    return instruct.write_prompts(
        model,
        tok.encode,
        tok.decode,
        examples,
        per_category,
        references,
        seed=seed,
        stop_ids=[],
        batch=3,
        max_new_tokens=24,
        **options,
    )


def test_write_prompts_is_reproducible_and_new():
    model = train_data.tiny_random_model(0)
    a = _write(model, 2, seed=5)
    assert a == _write(model, 2, seed=5)
    assert a != _write(model, 2, seed=6)
    assert set(a) == {"writing", "coding"} and all(len(v) <= 2 for v in a.values())
    kept = [t for v in a.values() for t in v]
    assert kept, "the tiny model wrote no request that passes the filter"
    # every kept request passes a fresh filter over the examples and the other kept ones
    f = instruct.NoveltyFilter(["tell me a story about the sea", "write a poem on the moon", "sort a list"])
    assert all(f.accept(t) for t in kept)
    # a reference that is one of them makes the next run refuse it
    again = _write(model, 2, seed=5, references=[kept[0]])
    assert kept[0] not in [t for v in again.values() for t in v]


@pytest.mark.parametrize(
    "kw, name",
    [(dict(per_category=-1), "per_category"), (dict(batch=0), "batch"), (dict(max_new_tokens=0), "max_new_tokens")],
)
def test_write_prompts_bad_arguments(kw, name):
    args = dict(per_category=1, batch=1, max_new_tokens=4)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        instruct.write_prompts(
            None, list, str, {"writing": ["x"]}, args.pop("per_category"), [], seed=0, stop_ids=[], **args
        )
    with pytest.raises(ValueError, match="'coding'"):
        instruct.write_prompts(None, list, str, {"coding": []}, 1, [], seed=0, stop_ids=[])


def test_cached_prompts_reuses_and_regenerates(tmp_path):
    path = instruct.prompts_cache_path(tmp_path, "fp", {"a": 1})
    assert path != instruct.prompts_cache_path(tmp_path, "fp", {"a": 2})
    assert instruct.prompts_cache_path(None, "fp", {}) is None
    calls = []

    def make(done, on_category):
        calls.append(1)
        return {"writing": ["one", "two"]}

    assert instruct.cached_prompts(path, make) == {"writing": ["one", "two"]}
    assert instruct.cached_prompts(path, make) == {"writing": ["one", "two"]} and len(calls) == 1
    for damaged in ("{not json", json.dumps({"writing": [1, 2]}), json.dumps(["a"])):
        path.write_text(damaged)
        with pytest.warns(RuntimeWarning, match=path.name):
            assert instruct.cached_prompts(path, make) == {"writing": ["one", "two"]}
    assert len(calls) == 4 and json.loads(path.read_text()) == {"writing": ["one", "two"]}
    assert instruct.cached_prompts(None, make) == {"writing": ["one", "two"]}


def test_an_interrupted_run_resumes_with_the_same_requests(tmp_path):
    """The categories finished before an interruption are kept in the partial file; the run
    that resumes writes only the others and ends with what an uninterrupted run writes."""
    model = train_data.tiny_random_model(0)
    fresh = _write(model, 2, seed=5)
    path = tmp_path / "written.json"

    def interrupted(done, on_category):
        def stop_after_one(category, kept):
            on_category(category, kept)
            raise KeyboardInterrupt

        return _write(model, 2, seed=5, done=done, on_category=stop_after_one)

    with pytest.raises(KeyboardInterrupt):
        instruct.cached_prompts(path, interrupted)
    partial = json.loads(path.with_suffix(".partial.json").read_text())
    assert list(partial) == ["writing"] and partial["writing"] == fresh["writing"]
    seen = []

    def resumed(done, on_category):
        seen.append(dict(done))
        return _write(model, 2, seed=5, done=done, on_category=on_category)

    assert instruct.cached_prompts(path, resumed) == fresh
    assert seen == [partial] and not path.with_suffix(".partial.json").exists()


def test_trainer_writes_prompts_end_to_end(tmp_path, capsys):
    out = tmp_path / "eagle.pt"
    argv = ["--random-model", "--steps", "1", "--segments", "1", "--segment", "8", "--new-tokens", "4"]
    argv += ["--written-per-category", "1", "--written-categories", "writing,coding", "--out", str(out)]
    assert train_eagle.main(argv) == 0
    err = capsys.readouterr().err
    assert "writing: " in err and "coding: " in err
    assert 0 <= int(re.search(r"(\d+) written prompts added", err).group(1)) <= 2
    assert "prompts: 6 train" in err


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--written-per-category", "-1"], "--written-per-category"),
        (["--written-categories", " , "], "--written-categories"),
        (["--written-categories", "writing,poetry"], "--written-categories"),
        (["--written-categories", "translation"], "--written-categories"),  # not among the random model's
    ],
)
def test_trainer_written_flags_are_checked_before_loading(extra, flag, capsys):
    with pytest.raises(SystemExit) as e:
        train_eagle.main(["--random-model", "--out", "/tmp/unused.pt"] + extra)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_written_prompts_are_sampled_in_the_numerics_asked_for(tmp_path, monkeypatch):
    """``numerics`` is the model's while it writes (its own numerics come back after, also
    when writing raises), and it is a part of the cache key only when it is not float32, so
    float32 runs keep their files (the key of the settings without it)."""
    model = train_data.tiny_random_model(0)
    model.numerics = "int8"  # the model's own numerics, which a float32 run must not keep
    seen = []
    fail = []

    def fake_write(m, *args, **kw):
        seen.append(m.numerics)
        if fail:
            raise KeyboardInterrupt
        return {"writing": [f"request {len(seen)}"]}

    monkeypatch.setattr(instruct, "write_prompts", fake_write)
    questions = [{"category": "writing", "turns": ["tell me a story"]}]
    tok = train_data.TinyTokenizer()

    def run(seed=0, **kw):
        return instruct.written_prompts(
            model, tok, "fp", questions, [], 1, ["writing"], seed=seed, stop_ids=[], cache=tmp_path, **kw
        )

    assert run() == ["request 1"] and seen == ["float32"] and model.numerics == "int8"
    assert run(numerics="float32") == ["request 1"] and len(seen) == 1  # the same cache file
    assert run(numerics="int8") == ["request 2"] and seen == ["float32", "int8"]  # a new one
    assert model.numerics == "int8"
    files = sorted(p.name for p in tmp_path.glob("written-prompts-*.json"))
    assert len(files) == 2
    # the float32 file is named by the settings as they were before numerics joined them
    settings = dict(
        examples={"writing": ["tell me a story"]},
        per_category=1,
        seed=0,
        batch=16,
        few_shot=instruct.FEW_SHOT,
        ngram=instruct.NGRAM,
        attempts=instruct.ATTEMPTS_PER_PROMPT,
        prompt=instruct.request_prompt(["{example}"]),
        sampling=[instruct.TEMPERATURE, instruct.TOP_P, instruct.MAX_NEW_TOKENS],
        references=instruct.zlib.crc32(b"[]"),
    )
    assert instruct.prompts_cache_path(tmp_path, "fp", settings).name in files
    fail.append(1)
    model.numerics = "float32"
    with pytest.raises(KeyboardInterrupt):
        run(numerics="int8", seed=1)
    assert seen[-1] == "int8" and model.numerics == "float32"
    with pytest.raises(ValueError, match="numerics"):
        run(numerics="int4")
    assert len(seen) == 3  # refused before any writing
