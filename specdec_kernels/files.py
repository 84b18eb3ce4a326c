"""The files the package reads, read with one contract, and the manifest of its shipped data.

Every reader here fails the same way on a bad file: ``FileNotFoundError`` when it is missing,
else ``BadFileError`` (a ``ValueError``) whose message starts with the path and says what is
wrong: empty, truncated, corrupt (a checksum that does not match), not the kind of file
expected, or a format version this package does not read.  Nothing is returned from a file
that failed, so nothing half-read is ever used.

Shipped data (everything under ``specdec_kernels/data``) is listed with its SHA-256 in
``data/MANIFEST.sha256`` (``sha256sum`` format: ``cd specdec_kernels/data && sha256sum -c
MANIFEST.sha256`` checks it by hand).  A reader given a path under ``data/`` checks the file
against it first (once per path, modification time and size in a process); after changing a
shipped file, refresh the manifest with ``python -m specdec_kernels.files update``
(``python -m specdec_kernels.files check`` compares without writing).

Files this package writes (head files, caches) are ``torch.save`` archives, zip files with a
CRC-32 per member: ``check_archive`` checks every member's CRC, before ``load_torch``
unpickles and before ``peek_module`` memory-maps (the checks before a model loads), so a
flipped byte anywhere is an error too, and writers replace a file atomically (``atomic_write``: a
temporary file in the same folder, then ``os.replace``), so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

PathLike = Union[str, os.PathLike]

DATA_DIR = Path(__file__).resolve().parent / "data"
MANIFEST_NAME = "MANIFEST.sha256"
REFRESH_COMMAND = "python -m specdec_kernels.files update"

# (resolved path, mtime_ns, size) of files already found intact in this process
_verified: Dict[Tuple[str, int, int], bool] = {}


class BadFileError(ValueError):
    """A file that cannot be read as what it should be; ``path`` names it, ``reason`` says why
    (the message is ``"<path>: <reason>"``)."""

    def __init__(self, path: PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def _a(kind: str) -> str:
    """``kind`` with its indefinite article ("an EAGLE head", "a Medusa heads")."""
    return ("an " if kind[:1].upper() in "AEIOU" else "a ") + kind


def sha256_file(path: PathLike) -> str:
    """The SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------ the manifest
def compute_manifest(data_dir: Optional[PathLike] = None) -> Dict[str, str]:
    """{path relative to ``data_dir`` (posix): SHA-256} of every file under it except the
    manifest itself and Python caches, sorted by path."""
    root = Path(data_dir) if data_dir is not None else DATA_DIR
    out = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if f.is_file() and rel != MANIFEST_NAME and "__pycache__" not in f.parts:
            out[rel] = sha256_file(f)
    return out


def format_manifest(entries: Dict[str, str]) -> str:
    """The manifest's text: one ``<sha256>  <relative path>`` line per file (sha256sum's format)."""
    return "".join(f"{digest}  {rel}\n" for rel, digest in sorted(entries.items()))


def read_manifest(data_dir: Optional[PathLike] = None) -> Dict[str, str]:
    """The manifest of ``data_dir`` (default the package's data folder): {relative path: SHA-256}.

    Raises:
        FileNotFoundError: no manifest.
        BadFileError: a line that is not ``<64 hex digits>  <path>``.
    """
    path = (Path(data_dir) if data_dir is not None else DATA_DIR) / MANIFEST_NAME
    out = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not rel:
            raise BadFileError(path, f"line {n} is not '<sha256>  <path>' (the manifest is corrupt)")
        out[rel] = digest
    return out


def write_manifest(data_dir: Optional[PathLike] = None) -> Dict[str, str]:
    """Recompute the manifest of ``data_dir`` (default the package's) and write it atomically."""
    root = Path(data_dir) if data_dir is not None else DATA_DIR
    entries = compute_manifest(root)
    text = format_manifest(entries)
    atomic_write(root / MANIFEST_NAME, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return entries


def _shipped_relative(path: Path) -> Optional[str]:
    """``path`` relative to the package's data folder (posix), or None outside it."""
    try:
        return path.resolve().relative_to(DATA_DIR.resolve()).as_posix()
    except ValueError:
        return None


def verify_shipped(path: PathLike) -> None:
    """Check a file under the package's data folder against the manifest (nothing to do for
    other paths); a file once found intact is not hashed again while its modification time
    and size stay the same.

    Raises:
        FileNotFoundError: the file or the manifest is missing.
        BadFileError: the SHA-256 differs from the manifest's (corrupt or modified), or the
            manifest does not list the file.
    """
    path = Path(path)
    rel = _shipped_relative(path)
    if rel is None:
        return
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key in _verified:
        return
    expected = read_manifest(DATA_DIR).get(rel)
    if expected is None:
        raise BadFileError(
            path, f"a shipped data file that {MANIFEST_NAME} does not list (refresh it with `{REFRESH_COMMAND}`)"
        )
    got = sha256_file(path)
    if got != expected:
        raise BadFileError(
            path,
            f"corrupt or modified: its SHA-256 {got[:16]}... differs from the manifest's {expected[:16]}... "
            "(reinstall specdec-kernels)",
        )
    _verified[key] = True


# ------------------------------------------------------------------ readers
def existing_file(path: PathLike, kind: str) -> Path:
    """``path`` as a Path after the checks every reader makes: it exists, is a file, is not
    empty, and matches the manifest when shipped.

    Args:
        path: the file.
        kind: what it should be, for the messages ("GGUF model", "EAGLE head").

    Raises:
        FileNotFoundError: no such file.
        BadFileError: not a regular file, empty, or a shipped file whose SHA-256 differs from
            the manifest's.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, f"no {kind} file", str(path))
    if not path.is_file():
        raise BadFileError(path, f"not a file (a {kind} file was expected)")
    if path.stat().st_size == 0:
        raise BadFileError(path, f"empty (0 bytes), not {_a(kind)} file")
    verify_shipped(path)
    return path


def check_archive(path: PathLike, kind: str) -> Path:
    """``path`` as a Path after checking that it is a whole, uncorrupted ``torch.save``
    archive: ``existing_file``'s checks, then a zip whose central directory is present (a
    truncated copy loses it) and whose every member matches its CRC-32, so a flipped bit
    anywhere, weights included, is found.  Reads the whole file once (about 10 ms for the
    shipped 10 MB heads); a file found intact is not read again while its modification time
    and size stay the same.  ``load_torch`` and ``peek_module`` both start with it.

    Args:
        path: the file.
        kind: what the file should be, for the messages ("EAGLE head").

    Raises:
        FileNotFoundError: no such file.
        BadFileError: empty, not a torch.save archive, truncated, a member failing its CRC,
            or a shipped file not matching the manifest.
    """
    path = existing_file(path, kind)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] != b"PK":
        raise BadFileError(path, f"not {_a(kind)} file (not a torch.save archive: it starts with {magic!r})")
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _verified:
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise BadFileError(
                path, f"truncated or corrupt ({st.st_size} bytes; the zip archive is incomplete: {e})"
            ) from None
        if bad is not None:
            raise BadFileError(path, f"corrupt: member {bad} fails its CRC-32 check")
        _verified[key] = True
    return path


def load_torch(path: PathLike, kind: str) -> Any:
    """A ``torch.save`` archive's object (``weights_only`` unpickling, CPU tensors), after
    ``check_archive``: a whole archive whose every member matches its CRC-32.

    Args:
        path: the file.
        kind: what the file should be, for the messages ("EAGLE head").

    Raises:
        FileNotFoundError: no such file.
        BadFileError: empty, not a torch.save archive, truncated, a member failing its CRC,
            a shipped file not matching the manifest, or contents torch cannot unpickle.
    """
    import torch

    path = check_archive(path, kind)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (torch raises many types for a bad archive)
        raise BadFileError(path, f"not a readable {kind} file ({type(e).__name__}: {e})") from None


def check_state_dict_shapes(path: PathLike, module: Any, state_dict: Any) -> None:
    """Check that ``state_dict`` holds exactly ``module``'s weights, name for name and shape
    for shape (``module`` may live on the meta device).

    Raises:
        BadFileError: not a dict of tensors, or names or shapes that differ (the first four
            differing names are given).
    """
    import torch

    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise BadFileError(path, "its state_dict is not a dict of tensors")
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    if want != got:
        wrong = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise BadFileError(path, f"the weights do not fit the config ({', '.join(wrong[:4])})")


def peek_module(path: PathLike, kind: str, build: Callable[[Any], Any]) -> Any:
    """The module a weights file describes, built on the meta device and checked against the
    file's weight names and shapes without loading the weights, after ``check_archive`` (every
    member's CRC-32, as ``load_torch`` checks it): the payload is memory-mapped, so this takes
    milliseconds for a head file (for checks before a model loads) and finds every fault
    ``load_torch`` would.

    Args:
        path: a ``torch.save`` archive holding a dict with a ``state_dict``.
        kind: what the file should be, for the messages ("EAGLE head").
        build: makes the module from the file's payload (called under ``torch.device("meta")``;
            the payload's tensors are memory-mapped CPU tensors, so it may read them).

    Raises:
        FileNotFoundError: no such file.
        BadFileError: a truncated or corrupt archive (a member failing its CRC), anything
            torch cannot read, a payload ``build`` refuses, or weights that do not fit (see
            ``check_state_dict_shapes``).
    """
    import torch

    path = check_archive(path, kind)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001  (anything torch cannot read is not such a file)
        raise BadFileError(path, f"not {_a(kind)} file ({type(e).__name__})") from None
    if not isinstance(payload, dict):
        raise BadFileError(path, f"not {_a(kind)} file (it holds a {type(payload).__name__})")
    with torch.device("meta"):
        module = build(payload)
    check_state_dict_shapes(path, module, payload.get("state_dict"))
    return module


def read_text(path: PathLike, kind: str) -> str:
    """A UTF-8 text file's contents.

    Raises:
        FileNotFoundError: no such file.
        BadFileError: empty, not UTF-8 text, or a shipped file not matching the manifest.
    """
    path = existing_file(path, kind)
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFileError(path, f"not {_a(kind)} file (not UTF-8 text at byte {e.start})") from None


def read_jsonl(path: PathLike, kind: str, fields: Dict[str, type]) -> List[dict]:
    """The records of a JSON-lines file (blank lines skipped), each an object holding at least
    ``fields`` (name: type).

    Raises:
        FileNotFoundError: no such file.
        BadFileError: empty, not UTF-8, a line that is not JSON (a truncated last line too), a
            record without a field or with one of another type, no record at all, or a
            shipped file not matching the manifest.  The message names the line.
    """
    text = read_text(path, kind)
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            cut = n == len(text.splitlines()) and not text.endswith("\n")
            why = "truncated: its last line is incomplete JSON" if cut else f"line {n} is not JSON ({e.msg})"
            raise BadFileError(path, f"{why}; not {_a(kind)} file") from None
        if not isinstance(rec, dict):
            raise BadFileError(path, f"line {n} is a JSON {type(rec).__name__}, not {_a(kind)} record")
        for name, typ in fields.items():
            if name not in rec:
                raise BadFileError(path, f"line {n} has no {name!r}: not {_a(kind)} record")
            if not isinstance(rec[name], typ) or (typ is int and isinstance(rec[name], bool)):
                raise BadFileError(
                    path, f"line {n}: {name!r} is a {type(rec[name]).__name__}, not a {typ.__name__} ({kind})"
                )
        records.append(rec)
    if not records:
        raise BadFileError(path, f"holds no record: not {_a(kind)} file")
    return records


# ------------------------------------------------------------------ writers
def atomic_write(path: PathLike, write: Callable[[str], Any]) -> None:
    """Write ``path`` atomically: ``write(tmp)`` fills a new temporary file in the same folder
    (a unique name, so concurrent writers never share one), which then replaces ``path`` in one
    ``os.replace``; on failure the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: PathLike) -> None:
    """``torch.save(obj, path)`` through ``atomic_write``."""
    import torch

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


# ------------------------------------------------------------------ command line
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``update``: rewrite data/MANIFEST.sha256 from the files; ``check``: compare, exit 1 on a
    difference (each differing path printed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args not in (["update"], ["check"]):
        print("usage: python -m specdec_kernels.files update|check", file=sys.stderr)
        return 2
    if args == ["update"]:
        entries = write_manifest()
        print(f"wrote {DATA_DIR / MANIFEST_NAME} ({len(entries)} files)")
        return 0
    want, have = compute_manifest(), read_manifest()
    diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
    for k in diff:
        print(f"{k}: manifest {have.get(k, 'missing')}, file {want.get(k, 'missing')}")
    return 1 if diff else 0


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
