"""The file format the EAGLE head and the Medusa heads share, and its checks.

A head file is a ``torch.save`` archive of a dict: ``config`` (the sizes the class needs,
``kind``, ``format`` and free-form metadata) and ``state_dict`` (fp16 weights), plus extra
entries a class adds (the EAGLE head's ``token_ranking``).  Every reader fails the same way
(see ``specdec_kernels.files``): ``FileNotFoundError`` for a missing file, else a
``BadFileError`` (a ``ValueError``) whose message starts with the path.

A head whose weights are not all finite is refused wherever one enters: reading its file
(``load`` and ``file_config``, a ``BadFileError``) and handing a module to a drafter
(``for_target``, a ``ValueError`` naming the head, its file and the weight): a NaN or an
infinity turns the scores it reaches into NaN, which draft arbitrary tokens the target rejects.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Iterable, Optional, Tuple, Union

import torch
from torch import nn

from specdec_kernels import files as _files
from specdec_kernels.files import BadFileError

if TYPE_CHECKING:
    from specdec_kernels.decoding.model import Transformer


def non_finite_weights(named: Iterable[Tuple[str, object]]) -> Optional[str]:
    """None when every floating-point tensor of ``named`` ((name, value) pairs; other values are
    skipped) is finite, else which are not: ``"'fc': 3 of 36864 values NaN or infinite"``, then
    ``", and 2 more weights"`` when others are too."""
    bad = []
    for name, value in named:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            count = int(value.numel() - torch.isfinite(value).sum())
            if count:
                bad.append(f"{name!r}: {count} of {value.numel()} values NaN or infinite")
    if not bad:
        return None
    more = len(bad) - 1
    return bad[0] + (f", and {more} more weight{'s' if more > 1 else ''}" if more else "")


def model_fingerprint(model: "Transformer") -> str:
    """A short content hash of a target model: its shape (``ModelArgs``) and a sample of its
    final-norm and output-head weights (float32 bytes); 16 hex digits.  Heads trained on one
    model are meant for that model (they work with another, only with fewer accepted drafts)."""
    args = asdict(model.args)
    if not args.get("qkv_bias"):  # a field added later: hashed only when set (old fingerprints stay valid)
        args.pop("qkv_bias", None)
    h = hashlib.sha256(repr(sorted(args.items())).encode())
    h.update(model.norm.weight.detach().float().cpu().contiguous().numpy().tobytes())
    rows = model.output.weight.detach()[:: max(1, model.args.vocab_size // 64)]
    h.update(rows.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class HeadFile(nn.Module):
    """A draft head module that is saved to and loaded from one head file.

    A subclass sets the class attributes and implements ``_file_fields`` (the config entries
    ``save`` writes) and ``_from_config`` (the module a checked config describes); it may
    extend ``_extra_payload`` / ``_read_extra_payload`` for entries beside the weights.
    Instances carry ``config`` (free-form metadata, dict) and ``source`` (the file they were
    loaded from, or None).
    """

    KIND: ClassVar[str]  # config["kind"] of the files this class writes
    DESCRIPTION: ClassVar[str]  # "EAGLE head": what the file is, for messages
    ARTICLE: ClassVar[str]  # "an" / "a", before DESCRIPTION
    READABLE_FORMATS: ClassVar[Tuple[int, ...]]
    SHIPPED: ClassVar[Path]  # the head file shipped in the package

    #: a clause the messages about non-finite weights add on the subclass's own options
    #: (the EAGLE head: that quantising it does not help)
    NON_FINITE_NOTE: ClassVar[str] = ""

    config: dict
    source: Optional[str]
    hidden_size: int

    @classmethod
    def _non_finite_reason(cls, which: str, where: str = "") -> str:
        return (
            f"non-finite weights{where} ({which}): the scores they reach come out NaN and draft arbitrary "
            f"tokens the target rejects{cls.NON_FINITE_NOTE}; use a head with finite weights (retrain it, "
            "or use the shipped one)"
        )

    def check_finite(self) -> None:
        """Check that every weight of the head is finite.

        Raises:
            ValueError: a NaN or an infinity in some weight; the message names the head (and
                the file it was loaded from), the weight and what to do.
        """
        which = non_finite_weights(self.state_dict().items())
        if which is not None:
            source = f" ({self.source})" if self.source else ""
            raise ValueError(self._non_finite_reason(which, f" in the {self.DESCRIPTION}{source}"))

    # ------------------------------------------------------------------ subclass hooks
    def _file_fields(self) -> dict:
        """The config entries ``save`` writes beside ``kind`` (``format`` included)."""
        raise NotImplementedError

    @classmethod
    def _kind_before_kind_field(cls, state: dict) -> str:
        """The kind of a file written before config["kind"] existed, from its weight names."""
        raise NotImplementedError

    @classmethod
    def _from_config(cls, config: dict) -> "HeadFile":
        """The (uninitialised) module ``config`` describes; KeyError/TypeError/ValueError on a
        config it cannot use."""
        raise NotImplementedError

    def _extra_payload(self) -> dict:
        """Entries written beside ``config`` and ``state_dict``."""
        return {}

    def _read_extra_payload(self, payload: dict) -> None:
        """Read what ``_extra_payload`` wrote (after the weights are loaded)."""

    # ------------------------------------------------------------------ the file
    def save(self, path: Union[str, Path]) -> None:
        """Write the weights (fp16) and the config to ``path`` atomically (a reader never sees
        half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {**self.config, "kind": self.KIND, **self._file_fields()}
        state = {k: v.detach().to(torch.float16).cpu().contiguous() for k, v in self.state_dict().items()}
        _files.atomic_torch_save({"config": config, "state_dict": state, **self._extra_payload()}, path)

    @classmethod
    def _from_payload(cls, path, payload) -> "HeadFile":
        """The (uninitialised) module ``payload``'s config describes, on the current default
        device, after checking that the payload is a file of this class's kind and format."""
        not_ours = f"not {cls.ARTICLE} {cls.DESCRIPTION} file"
        if not isinstance(payload, dict) or "config" not in payload or "state_dict" not in payload:
            raise BadFileError(path, f"{not_ours} (no config / state_dict)")
        if not isinstance(payload["config"], dict) or not isinstance(payload["state_dict"], dict):
            raise BadFileError(path, f"{not_ours} (config and state_dict must be dicts)")
        config = dict(payload["config"])
        kind = config.get("kind", cls._kind_before_kind_field(payload["state_dict"]))
        if kind != cls.KIND:
            raise BadFileError(path, f"{not_ours} (a {kind!r} file)")
        if config.get("format") not in cls.READABLE_FORMATS:
            readable = ", ".join(map(str, cls.READABLE_FORMATS))
            raise BadFileError(path, f"{cls.DESCRIPTION} format {config.get('format')}, this version reads {readable}")
        try:
            return cls._from_config(config)
        except (KeyError, TypeError, ValueError) as e:
            raise BadFileError(path, f"a config this version cannot read ({type(e).__name__}: {e})") from None

    @classmethod
    def load(
        cls, path: Union[str, Path, None] = None, *, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> "HeadFile":
        """Read a file written by ``save``, or the shipped one when ``path`` is None (first
        checked against the package's SHA-256 manifest); every file's zip members are checked
        against their CRC-32.  The module comes back in eval mode, in ``dtype`` on ``device``.

        Raises:
            FileNotFoundError: no such file.
            ValueError (``BadFileError``, the message starting with the path): an empty,
                truncated or corrupt file (a shipped file not matching the manifest), a file
                of another kind (an EAGLE head given to the Medusa heads, and the reverse),
                a format this version cannot read, a config or weights that do not fit, or
                weights that are not all finite.
        """
        path = cls.SHIPPED if path is None else path
        payload = _files.load_torch(path, cls.DESCRIPTION)
        module = cls._from_payload(path, payload)
        cls._check_file_weights(path, payload)
        try:
            module.load_state_dict({k: v.to(torch.float32) for k, v in payload["state_dict"].items()})
            module._read_extra_payload(payload)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
            raise BadFileError(path, f"weights that do not fit the config ({type(e).__name__}: {e})") from None
        module.source = str(path)
        return module.to(device=device, dtype=dtype).eval()

    @classmethod
    def _check_file_weights(cls, path, payload: dict) -> None:
        """A ``BadFileError`` naming the first non-finite weight of a file's ``state_dict``."""
        which = non_finite_weights(payload["state_dict"].items())
        if which is not None:
            raise BadFileError(path, cls._non_finite_reason(which))

    @classmethod
    def file_config(cls, path: Union[str, Path]) -> dict:
        """The config of the file at ``path``, checked as ``load`` checks it (every zip member's
        CRC-32, kind, format, weight names and shapes, finite weights) without loading it: the
        file is read once for its CRCs, memory-mapped, and the module is built on the meta
        device (milliseconds for a head file: the checks before a model loads).

        Raises:
            FileNotFoundError: no such file.
            ValueError (``BadFileError``, the message starting with the path): an empty,
                truncated or corrupt file (a member failing its CRC-32), not a file of this
                class's kind (not a torch file, another kind of head file, another format),
                weights whose names or shapes do not fit, or weights that are not all finite.
        """

        def build(payload):
            module = cls._from_payload(path, payload)
            cls._check_file_weights(path, payload)
            return module

        return _files.peek_module(path, cls.DESCRIPTION, build).config

    @classmethod
    def for_target(
        cls, head: Union["HeadFile", str, Path, None], model: "Transformer", *, check_fingerprint: bool = True
    ) -> "HeadFile":
        """``head`` (a module of this class, a path to its file, or None for the shipped one)
        checked against the target ``model``, in eval mode, in the model's dtype on its device.

        Raises:
            ValueError: a head of another hidden size than the model's, one that reads a layer
                the model does not have (``feature_layers``), one whose weights are not all
                finite in the model's dtype (``check_finite``), and as ``load``.

        Warns:
            UserWarning: with ``check_fingerprint``, a head whose stored ``base_fingerprint``
                is not ``model_fingerprint(model)``: decoding stays exact, but fewer drafts
                will be accepted.
        """
        if head is None or isinstance(head, (str, Path)):
            head = cls.load(head, dtype=model.dtype, device=model.device)
        source = f" ({head.source})" if head.source else ""
        if head.hidden_size != model.args.hidden_size:
            raise ValueError(
                f"the hidden size of the {cls.DESCRIPTION} ({head.hidden_size}) differs from the model's"
                f" ({model.args.hidden_size}){source}: made for another model"
            )
        layers = tuple(getattr(head, "feature_layers", ()))
        if layers and max(layers) >= model.args.num_layers:
            raise ValueError(
                f"the {cls.DESCRIPTION}{source} reads layer {max(layers)}'s output, the model has"
                f" {model.args.num_layers} layers: made for another model"
            )
        if check_fingerprint and head.config.get("base_fingerprint") not in (None, model_fingerprint(model)):
            warnings.warn(
                f"{cls.DESCRIPTION}{source} trained on {head.config.get('base_model', 'another model')} "
                f"(fingerprint {head.config.get('base_fingerprint')}) used with a different model: "
                "decoding stays exact, but fewer drafts will be accepted",
                stacklevel=3,
            )
        head = head.to(device=model.device, dtype=model.dtype).eval()
        head.check_finite()  # in the model's dtype: a float32 weight past float16's range is infinite there
        return head
