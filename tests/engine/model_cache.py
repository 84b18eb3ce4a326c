"""A converted-model cache folder (``loading.cache_dir``) written by hand, for the tests of how
``loading._read_cache`` treats a damaged one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Tuple

import torch

from specdec_kernels.decoding import loading


def write_model_cache(root: Path, state_dict: Dict[str, torch.Tensor]) -> Tuple[Path, dict]:
    """A cache under ``root`` of a fake source file (size 1) holding ``state_dict``, an empty
    config and the source's stamp; returns (the cache folder, the stamp)."""
    stamp = {"size": 1, "sha256_head_tail": "0" * 64, "format": 1}
    where = loading.cache_dir(str(root), stamp)
    where.mkdir(parents=True)
    (where / "source.json").write_text(json.dumps(stamp))
    (where / "config.json").write_text("{}")
    torch.save(state_dict, where / "state_dict.pt")
    return where, stamp
