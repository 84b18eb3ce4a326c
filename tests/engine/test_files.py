"""The files the product reads: every reader fails with its documented error on a bad file,
naming the path and what is wrong (class 1 of issue #39), and the shipped data files are
checked against their SHA-256 manifest (class 2).

Readers: EAGLE and Medusa head files (``EagleHead.load`` / ``MedusaHeads.load`` and the
drafters built from a path), Spec-Bench prompt files (``prompts.read_questions``), the GGUF
(``loading.load_checkpoint``), and the caches: the converted model (``loading._read_cache``)
and the self-distilled training data (``training.data.cached_data`` and its partial file).
The heads and prompt readers raise ``BadFileError`` (a ValueError); a cache is never used when
bad: a warning names the file and it is rebuilt."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

from specdec_kernels import files as _files
from specdec_kernels.decoding import loading, prompts
from specdec_kernels.decoding.drafters import eagle, medusa
from specdec_kernels.decoding.training import data as train_data
from specdec_kernels.files import BadFileError
from tests.engine.heads import HIDDEN, tiny  # noqa: F401  (fixture)
from tests.engine.model_cache import write_model_cache

TEXT = b"this is a text file, not a model\n"


def _truncate(path):
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _flip_middle(path):
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    # a new modification time even within one tick of the file system's clock
    os.utime(path, ns=(st.st_atime_ns, max(st.st_mtime_ns, path.stat().st_mtime_ns) + 1_000_000))


def flip_weight_byte(path):
    """Flip one bit in the middle of the largest weight member's data of a ``torch.save``
    archive (a zip of stored members), not in the zip's headers nor the pickle: the archive
    still opens and memory-maps; only that member's CRC-32 tells."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        member = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = (
        int.from_bytes(raw[member.header_offset + o : member.header_offset + o + 2], "little") for o in (26, 28)
    )
    start = member.header_offset + 30 + name_len + extra_len  # the member's data (stored, not compressed)
    assert member.compress_type == zipfile.ZIP_STORED and start + member.file_size <= len(raw)
    raw[start + member.file_size // 2] ^= 0x10
    st = path.stat()
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, max(st.st_mtime_ns, path.stat().st_mtime_ns) + 1_000_000))


def _with_nan_weight(make):
    """A fault: a head file from ``make()`` whose first weight holds one NaN."""

    def fault(tmp, path):
        head = make()
        with torch.no_grad():
            next(head.parameters()).view(-1)[5] = float("nan")
        head.save(path)

    return fault


def _eagle_head(hidden=HIDDEN):
    torch.manual_seed(0)
    return eagle.EagleHead(hidden, 4, 2, 16, 96)


def _medusa_heads(hidden=HIDDEN):
    torch.manual_seed(0)
    return medusa.MedusaHeads(hidden, 2)


# ------------------------------------------------------------------ the raising readers
# Each: (write a good file at path, read it, the faults it can have).  A fault is a function
# (tmp folder, path) that damages or replaces the file, and the words the message must hold.
def _write_eagle(path):
    _eagle_head().save(path)


def _write_medusa(path):
    _medusa_heads().save(path)


def _write_questions(path):
    rows = [{"question_id": 81 + i, "category": "writing", "turns": [f"question {i}"]} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _with_format(write, fmt):
    def fault(tmp, path):
        write(path)
        payload = torch.load(path, weights_only=True)
        payload["config"]["format"] = fmt
        torch.save(payload, path)

    return fault


def _replace(data: bytes):
    def fault(tmp, path):
        path.write_bytes(data)

    return fault


def _other_kind(write_other):
    def fault(tmp, path):
        write_other(path)

    return fault


def _drafter_of_other_model(make_drafter, write_small):
    """A head file for a model of hidden size 32, given (as a path) to a drafter of the
    64-wide tiny model."""

    def read(path, model):
        return make_drafter(model, path)

    def fault(tmp, path):
        write_small(path)

    return read, fault


def _damaged(write, damage):
    """A fault: a good file from ``write``, then ``damage(path)``."""

    def fault(tmp, path):
        write(path)
        damage(path)

    return fault


COMMON = {
    "empty": (_replace(b""), "empty"),
    "text": (_replace(TEXT), "not a"),
}


def _head_file_reader(write, read, faults):
    """A reader of head files: the ``COMMON`` faults and a truncated file, then ``faults``."""
    return dict(
        write=write,
        read=read,
        faults={**COMMON, "truncated": (_damaged(write, _truncate), "truncated"), **faults},
    )


def _saved_heads_reader(write, load, other_kind, write_other, words, make):
    """A reader of a saved heads file (``load(path)``): also a flipped byte (anywhere, and in a
    weight), a file of the ``other_kind`` (whose message must hold ``words``), an unknown
    format and a NaN weight in a head from ``make()``."""
    return _head_file_reader(
        write,
        lambda path, model: load(path),
        {
            "one byte flipped": (_damaged(write, _flip_middle), "corrupt"),
            "one weight bit flipped": (_damaged(write, flip_weight_byte), "fails its CRC-32 check"),
            f"{other_kind} file": (_other_kind(write_other), words),
            "format 99": (_with_format(write, 99), "format 99"),
            "a NaN weight": (_with_nan_weight(make), "non-finite weights"),
        },
    )


READERS = {
    "eagle-head": _saved_heads_reader(
        _write_eagle, eagle.EagleHead.load, "medusa", _write_medusa, "not an EAGLE head file", _eagle_head
    ),
    "medusa-heads": _saved_heads_reader(
        _write_medusa, medusa.MedusaHeads.load, "eagle", _write_eagle, "not a Medusa heads file", _medusa_heads
    ),
    # the checks before a model loads (the CLI's): the file's config, every fault load finds
    "eagle-file-config": _saved_heads_reader(
        _write_eagle, eagle.EagleHead.file_config, "medusa", _write_medusa, "not an EAGLE head file", _eagle_head
    ),
    "medusa-file-config": _saved_heads_reader(
        _write_medusa, medusa.MedusaHeads.file_config, "eagle", _write_eagle, "not a Medusa heads file", _medusa_heads
    ),
    "eagle-drafter": _head_file_reader(
        _write_eagle,
        lambda path, model: eagle.EagleDrafter(model, path),
        {
            "other model": (lambda tmp, path: _eagle_head(32).save(path), "another model"),
            "a NaN weight": (_with_nan_weight(_eagle_head), "non-finite weights"),
        },
    ),
    "medusa-drafter": _head_file_reader(
        _write_medusa,
        lambda path, model: medusa.MedusaDrafter(model, path),
        {
            "other model": (lambda tmp, path: _medusa_heads(32).save(path), "another model"),
            "a NaN weight": (_with_nan_weight(_medusa_heads), "non-finite weights"),
        },
    ),
    "spec-bench-prompts": dict(
        write=_write_questions,
        read=lambda path, model: prompts.read_questions(path),
        faults={
            "empty": (_replace(b""), "empty"),
            "truncated": (_damaged(_write_questions, _truncate), "truncated"),
            "binary": (_other_kind(_write_eagle), "not UTF-8"),
            "other json": (_replace(b'{"model": "llama"}\n'), "no 'question_id'"),
            "not json lines": (_replace(TEXT), "not JSON"),
        },
    ),
}

CASES = [(r, f) for r, spec in READERS.items() for f in spec["faults"]]


@pytest.mark.parametrize("reader,fault", CASES, ids=[f"{r}-{f}" for r, f in CASES])
def test_every_reader_names_the_file_and_what_is_wrong(tmp_path, tiny, reader, fault):  # noqa: F811
    spec = READERS[reader]
    good = tmp_path / "good.file"
    spec["write"](good)
    spec["read"](good, tiny)  # the good file reads
    path = tmp_path / "bad.file"
    damage, words = spec["faults"][fault]
    damage(tmp_path, path)
    with pytest.raises(ValueError) as e:
        spec["read"](path, tiny)
    assert str(path) in str(e.value) and words in str(e.value), str(e.value)
    with pytest.raises(FileNotFoundError, match="missing.file"):
        spec["read"](tmp_path / "missing.file", tiny)


# ------------------------------------------------------------------ the GGUF
def _write_gguf(path, *, layers=30, hidden=576, arch="llama", tensor_rows=64):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("test model")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_tensor("token_embd.weight", np.arange(tensor_rows * 16, dtype=np.float32).reshape(tensor_rows, 16))
    w.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_version(path, version):
    _write_gguf(path)
    raw = bytearray(path.read_bytes())
    raw[4:8] = version.to_bytes(4, "little")
    path.write_bytes(bytes(raw))


GGUF_FAULTS = {
    "empty": (lambda p: p.write_bytes(b""), "empty"),
    "text": (lambda p: p.write_bytes(TEXT), "not a GGUF file"),
    "truncated": (lambda p: (_write_gguf(p, tensor_rows=4096), _truncate(p)), "truncated"),
    "version 9": (lambda p: _gguf_version(p, 9), "GGUF version 9"),
    "other model": (lambda p: _write_gguf(p, layers=2, hidden=64), "another model"),
}


@pytest.mark.parametrize("fault", list(GGUF_FAULTS))
def test_gguf_loader_names_the_file_and_what_is_wrong(tmp_path, monkeypatch, fault):
    pytest.importorskip("transformers")
    good = tmp_path / "good" / "model.gguf"
    good.parent.mkdir()
    _write_gguf(good)
    loading.check_gguf(str(good))  # the synthetic file has SmolLM2's shape and passes
    path = tmp_path / "bad" / "model.gguf"
    path.parent.mkdir()
    damage, words = GGUF_FAULTS[fault]
    damage(path)
    monkeypatch.setattr(loading, "smollm2_gguf", lambda: (str(path.parent), path.name))
    with pytest.raises(ValueError) as e:
        loading.load_checkpoint(str(tmp_path / "cache"))
    assert str(path) in str(e.value) and words in str(e.value), str(e.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("state_dict.pt"))


# ------------------------------------------------------------------ the caches
CACHE_FAULTS = {
    "empty": (lambda p: p.write_bytes(b""), "empty"),
    "text": (lambda p: p.write_bytes(TEXT), "not a"),
    "truncated": (_truncate, "truncated"),
    "one byte flipped": (_flip_middle, "corrupt"),
    "other data": (lambda p: torch.save({"tokens": [[1]], "hidden": "x"}, p), "not a self-distilled"),
}


def _distilled(n):
    return train_data.SelfDistilled(
        tokens=[[1, 2, 3 + i] for i in range(n)],
        prompt_lengths=[1] * n,
        first=[0] * n,
        hidden=[torch.full((2, 4), float(i), dtype=torch.float16) for i in range(n)],
    )


@pytest.mark.parametrize("fault", list(CACHE_FAULTS))
def test_a_bad_cache_is_named_and_rebuilt_never_used(tmp_path, fault):
    """The self-distilled data cache, its partial file and the converted-model cache: a bad
    file gives a warning naming it and what is wrong, then the data is made again and the
    cache rewritten whole (atomically)."""
    damage, words = CACHE_FAULTS[fault]
    # the data cache
    path = tmp_path / "train-0.pt"
    train_data.cached_data(path, lambda part: _distilled(3), expected=3)
    assert train_data.cached_data(path, lambda part: pytest.fail("a good cache is read"), expected=3).tokens[2] == [
        1,
        2,
        5,
    ]
    damage(path)
    made = []
    with pytest.warns(RuntimeWarning) as w:
        got = train_data.cached_data(path, lambda part: made.append(part) or _distilled(3), expected=3)
    msg = " ".join(str(x.message) for x in w)
    assert str(path) in msg and words in msg, msg
    assert made and got.tokens == _distilled(3).tokens
    assert train_data.SelfDistilled.from_dict(torch.load(path, weights_only=True), path, 3).tokens == got.tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-0.pt"]  # no temporary file left
    # a cache of other prompts (another count) is not used either
    with pytest.warns(RuntimeWarning, match="other prompts"):
        assert len(train_data.cached_data(path, lambda part: _distilled(5), expected=5).tokens) == 5

    # the partial file of an interrupted generation
    partial = tmp_path / "train-1.partial"
    _files.atomic_torch_save({0: [[1, 2], 0, torch.zeros(1, 4, dtype=torch.float16)]}, partial)
    assert list(train_data._read_partial(partial, 3, 4)) == [0]
    with pytest.warns(RuntimeWarning, match="partial data"):  # hidden states of another width
        assert train_data._read_partial(partial, 3, 8) == {}
    damage(partial)
    with pytest.warns(RuntimeWarning) as w:
        assert train_data._read_partial(partial, 3, 4) == {}
    msg = " ".join(str(x.message) for x in w)
    assert str(partial) in msg and (words in msg or "partial data" in msg), msg

    # the converted-model cache (state_dict.pt; a bad one is rebuilt by load_checkpoint)
    where, stamp = write_model_cache(tmp_path, {"w": torch.arange(4096.0)})
    damage(where / "state_dict.pt")
    with pytest.warns(RuntimeWarning) as w:
        assert loading._read_cache(where, stamp) is None
    msg = " ".join(str(x.message) for x in w)
    assert str(where / "state_dict.pt") in msg, msg


def test_writers_replace_files_atomically(tmp_path):
    """A writer that fails leaves the old file whole and no temporary file behind."""
    path = tmp_path / "h.pt"
    _write_eagle(path)
    before = path.read_bytes()

    def boom(tmp):
        open(tmp, "wb").write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        _files.atomic_write(path, boom)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["h.pt"]


# ------------------------------------------------------------------ the manifest (class 2)
def test_manifest_lists_every_shipped_file_with_its_digest():
    """Regenerates the manifest of specdec_kernels/data and compares: it cannot go stale.
    After changing a shipped file, refresh it with `python -m specdec_kernels.files update`."""
    assert _files.read_manifest() == _files.compute_manifest(), (
        f"specdec_kernels/data/{_files.MANIFEST_NAME} is stale: run `{_files.REFRESH_COMMAND}`"
    )
    listed = set(_files.read_manifest())
    assert {"eagle/smollm2-135m-instruct.pt", "medusa/smollm2-135m-instruct.pt", "spec_bench/question.jsonl"} <= listed
    assert _files.main(["check"]) == 0


def test_a_shipped_file_with_one_byte_flipped_is_refused(tmp_path, monkeypatch):
    """A copy of the data folder stands in for the package's: each shipped file loads through
    its real loader when intact (verified once per path, mtime and size), and with one byte
    flipped in the middle fails naming the path and the SHA-256 mismatch."""
    data = tmp_path / "data"
    shutil.copytree(_files.DATA_DIR, data)
    monkeypatch.setattr(_files, "DATA_DIR", data)
    monkeypatch.setattr(_files, "_verified", {})
    loaders = {
        "eagle/smollm2-135m-instruct.pt": eagle.EagleHead.load,
        "medusa/smollm2-135m-instruct.pt": medusa.MedusaHeads.load,
        "spec_bench/question.jsonl": prompts.read_questions,
    }
    hashed = []
    real_sha = _files.sha256_file
    monkeypatch.setattr(_files, "sha256_file", lambda p: hashed.append(str(p)) or real_sha(p))
    for rel, load in loaders.items():
        load(data / rel)
        load(data / rel)
        assert hashed.count(str(data / rel)) == 1, "verified once per path, mtime and size"
    assert len(prompts.read_questions(data / "spec_bench/question.jsonl")) == 480
    for rel, load in loaders.items():
        _flip_middle(data / rel)
        with pytest.raises(ValueError) as e:
            load(data / rel)
        assert str(data / rel) in str(e.value) and "SHA-256" in str(e.value), str(e.value)
    # a file the manifest does not list is refused too
    (data / "eagle" / "extra.pt").write_bytes((data / "eagle/smollm2-135m-instruct.pt").read_bytes())
    with pytest.raises(BadFileError, match="does not list"):
        eagle.EagleHead.load(data / "eagle" / "extra.pt")


def test_the_package_reads_its_shipped_files_intact():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert eagle.load_eagle_head().hidden_size == 576
        assert medusa.load_medusa_heads().hidden_size == 576
    assert len(prompts.spec_bench_questions()) == 480
