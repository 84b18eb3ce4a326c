"""The benchmark CLIs refuse bad values and combinations before any work (issue #39 item 7):
exit status 2 and one line naming the flag, before a model loads, a process starts or a
timing runs (each CLI's expensive first step is replaced by a failure here).  The vLLM
plugin's environment variables: tests/integrations/test_vllm_plugin.py."""

from __future__ import annotations

import sys

import pytest
import torch

from specdec_kernels.bench import defaults, e2e, flashinfer_side, kernels, policies, static, step_cost, threads
from specdec_kernels.bench import vllm as bench_vllm
from specdec_kernels.decoding import have_smollm2, loading

NO_FOLDER = "/nonexistent-folder/out.jsonl"


@pytest.fixture
def no_work(monkeypatch):
    """Every expensive first step of the benchmarks fails the test."""

    def fail(*a, **k):
        pytest.fail("the work started before the flags were checked")

    monkeypatch.setattr(loading, "load_checkpoint", fail)
    monkeypatch.setattr(loading, "load_smollm2", fail)
    monkeypatch.setattr(e2e, "build_context", fail)
    monkeypatch.setattr(step_cost, "measure", fail)
    monkeypatch.setattr(step_cost, "measure_model", fail)
    monkeypatch.setattr(static, "collect", fail)
    monkeypatch.setattr(kernels, "copy_bandwidth_gbps", fail)
    monkeypatch.setattr(bench_vllm, "export_smollm2", fail)
    monkeypatch.setattr(bench_vllm, "run_driver", fail)


def _exit_status(fn, argv) -> int:
    try:
        rc = fn(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return rc


VLLM = ["--vllm-python", sys.executable]
CASES = [
    # bench.e2e: flags, combinations, prompt lengths (the last two after reading the prompts)
    (e2e.main, ["--num-draft-tokens", "1000"], "--num-draft-tokens"),
    (e2e.main, ["--threads", "0"], "--threads"),
    (e2e.main, ["--per-category", "0"], "--per-category"),
    (e2e.main, ["--batch", "4"], "--batch"),
    (e2e.main, ["--categories", "coding,no-such-category", "--out", "{tmp}"], "--categories"),
    # bench.vllm
    (bench_vllm.main, VLLM + ["--num-speculative-tokens", "1000"], "--num-speculative-tokens"),
    (bench_vllm.main, VLLM + ["--categories", "no-such-category", "--out", "{tmp}"], "--categories"),
    # bench.defaults
    (defaults.main, ["--numerics", "int4"], "--numerics"),
    (defaults.main, ["--methods", "ngram,no-such-drafter"], "--methods"),
    (defaults.main, ["--rounds", "0"], "--rounds"),
    (defaults.main, ["--max-new-tokens", "0"], "--max-new-tokens"),
    # bench.policies
    (policies.main, ["--ids", "1"], "--ids"),
    (policies.main, ["--ids", "125,x"], "--ids"),
    (policies.main, ["--threads", "0"], "--threads"),
    (policies.main, ["--methods", "no-such-method"], "--methods"),
    (policies.main, ["--methods", "ngram-k8", "--typical", "0.09"], "--methods"),
    (policies.main, ["--temperature", "0.5"], "--temperature"),
    (policies.main, ["--typical", "nan"], "--typical"),
    (policies.main, ["--typical", "0.09", "--temperature", "0"], "--temperature"),
    (policies.main, ["--typical", "0.09", "--temperature", "inf"], "--temperature"),
    (policies.main, ["--jsonl", NO_FOLDER], "--jsonl"),
    # bench.threads
    (threads.main, ["--ids", "x"], "--ids"),
    (threads.main, ["--cap", "nan"], "--cap"),
    (threads.main, ["--load", "0"], "--load"),
    (threads.main, ["--numerics", "int4"], "--numerics"),
    (threads.main, ["--jsonl", NO_FOLDER], "--jsonl"),
    # bench.step_cost
    (step_cost.main, ["--sizes", "2,x"], "--sizes"),
    (step_cost.main, ["--sizes", "0"], "--sizes"),
    (step_cost.main, ["--prefix", "-1"], "--prefix"),
    (step_cost.main, ["--min-time", "nan"], "--min-time"),
    (step_cost.main, ["--models", "no-such-model"], "--models"),
    (step_cost.main, ["--no-llamacpp"], "--no-llamacpp"),
    (step_cost.main, ["--models", "tiny", "--prefix", "9000"], "--prefix"),
    (step_cost.main, ["--threads", "0"], "--threads"),
    # bench.static / bench.kernels / bench.flashinfer_side
    (static.cli, ["--archs", "9x"], "--archs"),
    (static.cli, ["--archs", "70"], "--archs"),
    (static.cli, ["--jobs", "0"], "--jobs"),
    (kernels.main, ["--op", "no-such-op"], "--op"),
    (kernels.main, ["--static", "--op", "sampling_probs"], "--static"),
    (flashinfer_side.main, ["--pairs", "sampling,nope"], "--pairs"),
    (flashinfer_side.main, ["--pairs", ","], "--pairs"),
]
if not torch.cuda.is_available():
    CASES += [
        (e2e.main, ["--device", "cuda"], "--device"),
        (step_cost.main, ["--device", "cuda"], "--device"),
        (kernels.main, ["--device", "cuda"], "--device"),
    ]
if have_smollm2():  # prompts longer than the model's positions, found with the tokenizer alone
    CASES += [
        (e2e.main, ["--max-new-tokens", "8190", "--methods", "greedy", "--out", "{tmp}"], "--max-new-tokens"),
        (bench_vllm.main, VLLM + ["--max-new-tokens", "8190", "--out", "{tmp}"], "--max-new-tokens"),
        (policies.main, ["--max-new-tokens", "8190"], "--max-new-tokens"),
        (threads.main, ["--max-new-tokens", "8190"], "--max-new-tokens"),
    ]


@pytest.mark.parametrize(
    "fn,argv,flag", CASES, ids=[f"{fn.__module__}.{fn.__name__} {' '.join(a)}" for fn, a, _ in CASES]
)
def test_bad_flags_fail_before_any_work_with_one_line(fn, argv, flag, no_work, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert _exit_status(fn, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
