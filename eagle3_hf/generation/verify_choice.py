"""Which verification a `generate()` call runs: row-exact where this hardware proves it exact, one call elsewhere.

Row-exact verification (exact_attention.py) gives every tree node the attention call of its own one-token step. The
verify forward then reproduces one-token steps bit for bit only where the target's other ops -- its matmuls above
all -- are row-invariant on this hardware: true on the AMX Xeons measured, false on an AMD EPYC with avx512_bf16 and
no AMX, where SmolLM2's `mlp.down_proj` rounds 16 rows differently from one. There row-exact verification costs
time (a verify forward measured 1.2-1.9x one call's on the Xeon; docs/research/bf16-exactness.md) and buys nothing:
its bf16 output equals plain output up to near-ties, exactly as one tree-masked call's does.

So `exact_verify="auto"` (the default) asks the row-invariance probe (probe.py, what `bench` reports) once per
target, dtype, device, thread count, attention implementation and set of module types (prepacking weights changes
the kernels) in a process, and once per machine across processes (probe_cache.py keeps its answers in the user's
cache folder, keyed by what decides them), and verifies row-exact only where the probe finds the verify forward equal to one-token steps bit for
bit. `exact_verify=True` runs row-exact regardless and warns once per setting where the probe fails; False always
verifies in one call. Batches of several prompts and non-CPU devices verify in one call: row-exact verification
covers torch's CPU attention for one prompt.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from eagle3_hf.generation.exact_attention import SUPPORTED
from eagle3_hf.generation.probe import ProbeResult, probe_row_exactness
from eagle3_hf.generation.probe_cache import load_probe, probe_key, refresh_requested, store_probe
from eagle3_hf.utils.precision import cpu_name

__all__ = [
    "PROVEN",
    "VerifyChoice",
    "check_exact_verify",
    "choose_verification",
    "probe_for_target",
]

PROVEN = "the row-invariance probe proves it"  # how a reason for row-exact verification that is exact starts

# target -> {setting: ProbeResult}: a fact about this process's hardware and the target's kernels, kept for the
# target's lifetime so that only the first call of a setting pays the probe (~3 s on SmolLM2-135M, 2 threads).
_probes: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, ProbeResult]] = weakref.WeakKeyDictionary()
_warned: weakref.WeakKeyDictionary[PreTrainedModel, set[tuple]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class VerifyChoice:
    """The verification one call runs and why.

    Attributes:
        exact: row-exact verification (per-node attention calls) runs; False: one tree-masked call.
        reason: why, in words (the probe's finding where one ran).
        probe: the row-invariance probe's result, when the choice asked it.
    """

    exact: bool
    reason: str
    probe: ProbeResult | None = None

    @property
    def mode(self) -> str:
        return "row-exact" if self.exact else "one-call"


def check_exact_verify(value: Any) -> str | bool:
    """`value` as an `exact_verify` setting ("auto", True or False; None means "auto"), or a ValueError naming it."""
    if value is None:
        return "auto"
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f"exact_verify must be 'auto', True or False; got {value!r}.")


def _setting(model: PreTrainedModel) -> tuple:
    kinds = frozenset(type(module).__name__ for module in model.modules())
    implementation = getattr(model.config, "_attn_implementation", None)
    return str(model.dtype), str(model.device), torch.get_num_threads(), implementation, kinds


def probe_for_target(model: PreTrainedModel, refresh: bool = False) -> ProbeResult:
    """The row-exact probe of `model` in its current setting: kept while `model` lives, and on disk for the next
    process (probe_cache.py); run only where neither has it, or where a fresh answer is asked for -- `refresh`
    here, or `$EAGLE3_HF_REFRESH_PROBE` for the disk's answers (once per process) -- which replaces the kept ones."""
    results = _probes.setdefault(model, {})
    setting = _setting(model)
    if setting in results and not refresh:
        return results[setting]
    key = probe_key(model)
    result = None if refresh or refresh_requested() else load_probe(key)
    if result is None:
        result = probe_row_exactness(model)
        store_probe(key, result)
    results[setting] = result
    return result


def choose_verification(model: PreTrainedModel, exact_verify: Any = "auto", rows: int = 1) -> VerifyChoice:
    """The verification a call of `rows` prompts on `model` runs for the `exact_verify` setting (module docstring)."""
    setting = check_exact_verify(exact_verify)
    if setting is False:
        return VerifyChoice(False, "exact_verify=False")
    if rows > 1:
        return VerifyChoice(False, f"a batch of {rows} verifies in one tree-masked call")
    implementation = getattr(model.config, "_attn_implementation", None)
    if model.device.type != "cpu" or implementation not in SUPPORTED:
        return VerifyChoice(
            False,
            f"row-exact verification covers torch's CPU attention ({', '.join(SUPPORTED)}); "
            f"this target runs {implementation} on {model.device.type}",
        )
    probe = probe_for_target(model)
    if probe.identical:
        return VerifyChoice(True, f"{PROVEN}: {probe.describe()}", probe)
    if setting == "auto":
        return VerifyChoice(False, f"row-exact verification is not exact here: {probe.describe()}", probe)
    warned, key = _warned.setdefault(model, set()), _setting(model)
    if key not in warned:
        warned.add(key)
        warnings.warn(
            f"exact_verify=True on hardware where row-exact verification is not exact: {probe.describe()} (CPU: "
            f"{cpu_name()}). Its verify forward costs more than one tree-masked call's (1.2-1.9x on an AMX Xeon; "
            "on an AMD EPYC without AMX the hybrid tree ran at 1.17x plain bf16 with it and 1.72x with one call) and "
            "its output equals plain decoding only up to near-ties, as one call's does; exact_verify='auto' (the "
            "default) verifies in one call where this probe fails.",
            stacklevel=4,
        )
    return VerifyChoice(True, f"exact_verify=True, though not exact here: {probe.describe()}", probe)
