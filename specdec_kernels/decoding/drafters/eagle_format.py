"""The EAGLE head's file format: what ``EagleHead.save`` writes and ``EagleHead.load`` reads.

A head file is the shared head-file archive (``head_file``: ``config`` and an fp16
``state_dict``) of kind ``"eagle-head"``.  ``config`` holds the layer's sizes
(``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``intermediate_size``), its
``window``, ``rope_theta`` and ``eps``, and free-form metadata; the file may also hold
``token_ranking`` (int32, the training labels' tokens, most frequent first: the FR-Spec draft
vocabulary).  Format 1 is an EAGLE head; format 2 (``FEATURE_LAYERS_FORMAT``) adds
``feature_layers``, the target layers an EAGLE-3 head fuses (Li et al. 2025), and is written
only for such heads, so that format 1 readers refuse them rather than drop the layers.
Files from before the ``kind`` field are told from Medusa heads by their weights.
``SHIPPED`` is the SmolLM2-135M-Instruct head in the package.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec_kernels.decoding.drafters.head_file import HeadFile

if TYPE_CHECKING:
    from specdec_kernels.decoding.drafters.eagle_head import EagleHead

FORMAT = 1
FEATURE_LAYERS_FORMAT = 2  # the format of files of heads with feature_layers (format 1 readers would drop them)
KIND = "eagle-head"  # config["kind"] of the files ``EagleHead.save`` writes
SHIPPED = Path(__file__).resolve().parents[2] / "data" / "eagle" / "smollm2-135m-instruct.pt"


class EagleHeadFile(HeadFile):
    """The file format of ``EagleHead`` (its base): the class constants ``HeadFile`` reads and
    the config entries and payload an EAGLE head file holds (see the module docstring).
    ``_from_config`` builds the subclass (``EagleHead``) a checked config describes."""

    KIND = KIND
    DESCRIPTION, ARTICLE = "EAGLE head", "an"
    NON_FINITE_NOTE = ", with quantize_head=True or False"
    READABLE_FORMATS = (FORMAT, FEATURE_LAYERS_FORMAT)
    SHIPPED = SHIPPED

    def _file_fields(self) -> dict:
        return {
            "format": FEATURE_LAYERS_FORMAT if self.feature_layers else FORMAT,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "window": self.window,
            "rope_theta": self.rope_theta,
            "eps": self.eps,
            **({"feature_layers": list(self.feature_layers)} if self.feature_layers else {}),
        }

    def _extra_payload(self) -> dict:
        return {} if self.token_ranking is None else {"token_ranking": self.token_ranking.to(torch.int32)}

    def _read_extra_payload(self, payload: dict) -> None:
        self.set_token_ranking(payload.get("token_ranking"))

    @classmethod
    def _kind_before_kind_field(cls, state: dict) -> str:
        return "medusa-heads" if "weight" in state and "fc" not in state else KIND

    @classmethod
    def _from_config(cls, c: dict) -> "EagleHead":
        return cls(
            int(c["hidden_size"]),
            int(c["num_heads"]),
            int(c["num_kv_heads"]),
            int(c["head_dim"]),
            int(c["intermediate_size"]),
            window=int(c["window"]),
            rope_theta=float(c["rope_theta"]),
            eps=float(c["eps"]),
            config=c,
            feature_layers=c["feature_layers"] if c["format"] == FEATURE_LAYERS_FORMAT else (),
        )
