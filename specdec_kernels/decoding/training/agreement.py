"""How often the draft heads agree with the target, by depth, on held-out prompts that are not
Spec-Bench's.

    python -m specdec_kernels.decoding.training.agreement [--prompts FILE] [--new-tokens N]
        [--depth D] [--eagle PATH] [--medusa PATH] [--json PATH] [--random-model]

1. Prompts: ``specdec_kernels/data/heldout/prompts.jsonl`` by default, 26 prompts written for
   this check (two for each kind of task in Spec-Bench's 13 categories; none is a Spec-Bench
   question, and none is in the heads' training data).  Each record holds ``category`` and
   ``prompt``; a file of your own works the same way.
2. Data: the target's greedy continuations of ``--new-tokens`` tokens and its final hidden
   states (``training.data.generate_data``, the trainers' own pipeline, not cached).
3. EAGLE head: top-1 agreement at depths 1..D with teacher-forced tokens and the head's own
   features from depth 2 on (``training.eagle.agreement``, the drafter's draft vocabulary
   included), and the expected accepted length of a chain of D drafts.
4. Medusa heads: head i's top-1 agreement with the token i + 1 places ahead
   (``training.medusa.true_ranks`` on the true path), and the expected accepted length of
   their chain.

Reports overall and per category; ``--json`` writes the same as one JSON object.
``--random-model`` runs everything on a tiny random Llama with random heads (a smoke test).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from specdec_kernels import files as _files
from specdec_kernels.decoding.drafters.eagle import SHIPPED as EAGLE_SHIPPED
from specdec_kernels.decoding.drafters.eagle import EagleHead
from specdec_kernels.decoding.drafters.medusa import SHIPPED as MEDUSA_SHIPPED
from specdec_kernels.decoding.drafters.medusa import MedusaHeads
from specdec_kernels.decoding.model import Transformer
from specdec_kernels.decoding.training.data import SelfDistilled, chat_ids, generate_data, tiny_random_model

HELDOUT = Path(__file__).resolve().parents[2] / "data" / "heldout" / "prompts.jsonl"
SEGMENT = 128  # the EAGLE trainer's default segment (its drafter's window)


def read_prompts(path) -> List[dict]:
    """The records of a held-out prompt file: ``category`` (str) and ``prompt`` (str) each.

    Raises:
        FileNotFoundError: no such file.
        BadFileError: not such a JSON-lines file (see ``files.read_jsonl``).
    """
    return _files.read_jsonl(path, "held-out prompt", {"category": str, "prompt": str})


def subset(data: SelfDistilled, idx: Sequence[int]) -> SelfDistilled:
    """The sequences ``idx`` of ``data``."""
    return SelfDistilled(
        [data.tokens[i] for i in idx],
        [data.prompt_lengths[i] for i in idx],
        [data.first[i] for i in idx],
        [data.hidden[i] for i in idx],
    )


def eagle_agreement(
    model: Transformer,
    head: EagleHead,
    data: SelfDistilled,
    depth: int,
    outputs: Optional[List[torch.Tensor]] = None,
) -> Dict[str, object]:
    """``training.eagle.agreement`` on ``data``: top-1 by depth 1..``depth`` (the head's draft
    vocabulary applied), the chain's expected accepted length and the positions scored.  An
    EAGLE-3 head (``feature_layers``) reads its layers' outputs: ``outputs`` (one per sequence
    of ``data``, as ``training.eagle.layer_outputs`` returns them), or computed here."""
    from specdec_kernels.decoding.training.eagle import agreement, feature_rows, layer_outputs

    if outputs is None and head.feature_layers:
        outputs = layer_outputs(model, data, head.feature_layers)
    rows = feature_rows(data, model.output.weight, layer_outputs=outputs)
    return agreement(head, model, rows, depth, SEGMENT, head.recommended_draft_vocab)


def medusa_agreement(model: Transformer, heads: MedusaHeads, data: SelfDistilled) -> Dict[str, object]:
    """Head i's top-1 agreement with the target's token i + 1 places ahead (generated positions;
    the true path for token-conditioned heads), the chain's expected accepted length over the
    positions where every head's label exists (the Medusa trainer's own figure also counts the
    last positions of a sequence, where deeper labels are missing, as rejections), and the
    positions scored per head."""
    from specdec_kernels.decoding.training.medusa import context_states, examples, true_ranks

    ex = examples(data, heads.num_heads, prompt=False)
    E = model.tok_embeddings.weight
    ranks = true_ranks(heads, model.output.weight, context_states(heads, E, ex), ex.labels, tokens=ex.path, embedding=E)
    k = heads.num_heads
    scored = [ranks[:, i] >= 0 for i in range(k)]
    top1 = [float((ranks[:, i] == 0)[scored[i]].float().mean()) if scored[i].any() else 0.0 for i in range(k)]
    # the chain over the positions where every head's label exists (as EAGLE's is counted)
    full = (ranks >= 0).all(dim=1)
    chain = 1.0 + sum(float((ranks[full, : i + 1] == 0).all(dim=1).float().mean()) for i in range(k) if full.any())
    return {"top1": top1, "chain_expected_accepted_length": chain, "positions": [int(s.sum()) for s in scored]}


def measure(
    model: Transformer,
    prompts: List[List[int]],
    categories: List[str],
    eagle: Optional[EagleHead],
    medusa: Optional[MedusaHeads],
    new_tokens: int,
    depth: int,
    stop_ids: Sequence[int],
) -> Dict[str, Dict[str, dict]]:
    """{"overall" and each category: {"eagle": ..., "medusa": ...}} for the given heads."""
    with torch.inference_mode():
        data = generate_data(model, prompts, new_tokens, 8, stop_ids, "generate (held-out)")
        outputs = None  # an EAGLE-3 head's layer outputs, computed once for every group
        if eagle is not None and eagle.feature_layers:
            from specdec_kernels.decoding.training.eagle import layer_outputs

            outputs = layer_outputs(model, data, eagle.feature_layers)
    groups = {"overall": list(range(len(prompts)))}
    for i, c in enumerate(categories):
        groups.setdefault(c, []).append(i)
    out = {}
    for name, idx in groups.items():
        part = subset(data, idx)
        res = {}
        with torch.inference_mode():
            if eagle is not None:
                part_outputs = None if outputs is None else [outputs[i] for i in idx]
                res["eagle"] = eagle_agreement(model, eagle, part, depth, part_outputs)
            if medusa is not None:
                res["medusa"] = medusa_agreement(model, medusa, part)
        out[name] = res
    return out


def format_report(results: Dict[str, Dict[str, dict]]) -> str:
    """A text table: one row per group and head kind, top-1 by depth and the chain's expected
    accepted length."""
    lines = [f"{'group':<16} {'heads':<7} {'top-1 by depth':<32} {'chain E[accepted]':>17} {'positions':>10}"]
    for group, res in results.items():
        for kind, r in res.items():
            top1 = " ".join(f"{a:.3f}" for a in r["top1"])
            lines.append(
                f"{group:<16} {kind:<7} {top1:<32} {r['chain_expected_accepted_length']:>17.2f} {r['positions'][0]:>10}"
            )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kernels.decoding.training.agreement",
        description=" ".join(__doc__.split("\n\n")[0].split()),
    )
    p.add_argument("--prompts", default=str(HELDOUT), help="a JSON-lines file of {category, prompt} records")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    p.add_argument("--depth", type=int, default=3, help="EAGLE depths scored (1: teacher forcing only)")
    p.add_argument("--eagle", default=str(EAGLE_SHIPPED), help="EAGLE head file ('none': skip)")
    p.add_argument("--medusa", default=str(MEDUSA_SHIPPED), help="Medusa heads file ('none': skip)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--random-model", action="store_true", help="a tiny random Llama and random heads (smoke test)")
    args = p.parse_args(argv)
    if args.new_tokens < 1:
        p.error("--new-tokens must be >= 1")
    if args.depth < 1:
        p.error("--depth must be >= 1")
    if args.eagle == "none" and args.medusa == "none":
        p.error("--eagle none and --medusa none leave nothing to measure")
    try:  # every file read and checked before a model loads
        args.records = read_prompts(args.prompts)
        if not args.random_model:
            for flag, cls in (("eagle", EagleHead), ("medusa", MedusaHeads)):
                if getattr(args, flag) != "none":
                    cls.file_config(getattr(args, flag))
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    if args.json is not None and not Path(args.json).parent.is_dir():
        p.error(f"--json: no folder {Path(args.json).parent}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    categories = [r["category"] for r in args.records]
    if args.random_model:
        torch.manual_seed(0)
        model = tiny_random_model(0)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 111, (len(r["prompt"]) % 9 + 2,), generator=g).tolist() for r in args.records]
        H = model.args.hidden_size
        eagle = None if args.eagle == "none" else EagleHead.for_model(model).eval()
        medusa = None if args.medusa == "none" else MedusaHeads(H, 3).eval()
        stops: List[int] = []
        target = "tiny-random-llama"
    else:
        from specdec_kernels.decoding.loading import MODEL_NAME, load_smollm2

        model, tok = load_smollm2()
        prompts = [chat_ids(tok, r["prompt"]) for r in args.records]
        # checked against the target now (its hidden size, the layers an EAGLE-3 head reads), before any data
        eagle = None if args.eagle == "none" else EagleHead.for_target(args.eagle, model)
        medusa = None if args.medusa == "none" else MedusaHeads.load(args.medusa)
        stops = [tok.eos_token_id]
        target = MODEL_NAME
    results = measure(model, prompts, categories, eagle, medusa, args.new_tokens, args.depth, stops)
    print(
        f"# draft heads' agreement with {target} on {len(prompts)} held-out prompts ({args.prompts}), "
        f"{args.new_tokens} greedy tokens each",
    )
    print(format_report(results))
    if args.json:
        meta = {"target": target, "prompts": str(args.prompts), "new_tokens": args.new_tokens, "depth": args.depth}
        _files.atomic_write(args.json, lambda tmp: Path(tmp).write_text(json.dumps({**meta, "results": results})))
    return 0


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
