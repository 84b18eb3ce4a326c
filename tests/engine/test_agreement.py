"""decoding.training.agreement: the held-out agreement report runs end to end on the tiny random
model, its numbers are what the trainers' own measures give, and its flags are checked first."""

import json

import pytest
import torch

from specdec_kernels.decoding.training import agreement
from specdec_kernels.files import BadFileError


def test_heldout_prompts_are_not_spec_bench_questions():
    from specdec_kernels.decoding.prompts import spec_bench_questions

    held = agreement.read_prompts(agreement.HELDOUT)
    bench = {q["turns"][0].strip() for q in spec_bench_questions()}
    assert len(held) == 26 and len({r["category"] for r in held}) == 13
    assert not any(r["prompt"].strip() in bench for r in held)


def test_runs_end_to_end_on_the_random_model(tmp_path, capsys):
    out = tmp_path / "agr.json"
    assert agreement.main(["--random-model", "--new-tokens", "6", "--depth", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["depth"] == 2 and res["target"] == "tiny-random-llama"
    groups = res["results"]
    assert set(groups) == {"overall"} | {r["category"] for r in agreement.read_prompts(agreement.HELDOUT)}
    for r in groups.values():
        assert len(r["eagle"]["top1"]) == 2 and len(r["medusa"]["top1"]) == 3
        for kind in ("eagle", "medusa"):
            assert all(0.0 <= a <= 1.0 for a in r[kind]["top1"])
            assert 1.0 <= r[kind]["chain_expected_accepted_length"] <= 1.0 + len(r[kind]["top1"])
    # the categories' scored positions add up to the overall count
    cats = [g for g in groups if g != "overall"]
    assert sum(groups[c]["eagle"]["positions"][0] for c in cats) == groups["overall"]["eagle"]["positions"][0]
    assert "overall" in capsys.readouterr().out


def test_medusa_agreement_counts_by_hand(monkeypatch):
    """A head whose ranking puts the label first everywhere agrees at 1.0; the chain's
    expected accepted length is then 1 + the number of heads."""
    from specdec_kernels.decoding.drafters.medusa import MedusaHeads
    from specdec_kernels.decoding.training.data import generate_data, tiny_random_model

    model = tiny_random_model(0)
    heads = MedusaHeads(model.args.hidden_size, 2, token_conditioned=False, context_window=0).eval()
    with torch.inference_mode():
        data = generate_data(model, [[5, 17, 33, 2], [64, 3, 9]], 5, 2, [])
    import specdec_kernels.decoding.training.medusa as tm

    # every label ranked first where it exists
    monkeypatch.setattr(tm, "true_ranks", lambda heads, W, X, Y, **k: torch.where(Y >= 0, 0, -1))
    r = agreement.medusa_agreement(model, heads, data)
    assert r["top1"] == [1.0, 1.0] and r["chain_expected_accepted_length"] == 3.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--new-tokens", "0"], "--new-tokens"),
        (["--depth", "0"], "--depth"),
        (["--eagle", "none", "--medusa", "none"], "nothing to measure"),
        (["--prompts", "/no/such/file.jsonl"], "file.jsonl"),
        (["--eagle", "/no/such/head.pt"], "head.pt"),
        (["--json", "/no/such/dir/out.json", "--random-model"], "--json"),
    ],
)
def test_flags_are_checked_before_any_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        agreement.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_prompt_file_without_categories_is_refused(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    with pytest.raises(BadFileError, match="category"):
        agreement.read_prompts(bad)
