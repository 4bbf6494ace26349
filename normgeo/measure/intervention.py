"""The centering intervention: does LayerNorm's mean subtraction change what the model predicts?

The geometry (``angles.jsonl``, ``energy.jsonl``) says how far the norm inputs are from the uniform vector 1;
this module asks whether that component matters. It swaps one operation inside chosen norms, with each
module's own gain, bias and eps, and compares the model's predictions with and without the swap:

- at a LayerNorm site (kind ``layer``) it **removes** the centering: ``g * x / rms(x) + b`` instead of
  ``g * (x - mean x) / std(x) + b`` (a forward hook replaces the output);
- at an RMSNorm site (kind ``rms``) it **adds** it: the module runs on ``x - mean(x)`` (a forward pre-hook
  replaces the input), which is exactly ``g * (x - mean x) / std(x) (+ b)`` with the module's own code;
- a DyT site (kind ``tanh``) has no centering to remove or add and is never intervened on.

Scopes (:func:`intervention_scopes`): every norm at once (``all``), each block's norms one block at a time
(``layers``: blocks 0..L-1, then ``final``, and ``embed`` where a model has one), or each site class across
blocks (``site_classes``: ``ln1``, ``ln2``, ``final``). Each scope costs one extra no-grad forward over the
probe tokens: the intact forward is the angle probe's own (:func:`normgeo.measure.probe.run_probe` hands
its output to :meth:`InterventionProbe.observe`).

Measured per scope, on next-token prediction over the probe text: the mean change of the loss (nats,
intervened - intact), the mean KL(intact || intervened) and the top-1 agreement, each with a 95% block
bootstrap interval over probe sequences (the draw of ``null.jsonl``: :func:`normgeo.measure.stats.block_weights`),
and the same per bin of the token's energy fraction along 1 at the intervened norm inputs (the intact
forward's, averaged over the scope's sites), so that one can see whether the tokens with a component
along 1 are the ones that change. A model without a language-model head (an encoder such as MiniLM)
gets the cosine between its intact and intervened output vectors instead, and its rows say so
(``output: "embedding"``).

Nothing is stored per token beyond one batch: per scope, per-sequence sums (O(scopes x sequences)) and
per-bin sums. Hooks are removed whatever happens, so the model is left bitwise as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from normgeo.measure.norm_sites import NormSite
from normgeo.measure.stats import block_bootstrap_means, json_number

INTERVENTION_FILE = "intervention.jsonl"
SCOPE_KINDS = ("all", "layers", "site_classes")
DEFAULT_SCOPES = ("all", "layers")
INTERVENABLE_KINDS = ("layer", "rms")  # DyT ("tanh") has no centering to take out or put in
ACTIONS = {"layer": "remove", "rms": "add"}
# Edges of the bins of the per-token energy fraction along 1 (cos^2 of the angle with 1; an isotropic
# vector has 1/d): decades from 1e-4, the first bin holding everything below.
ENERGY_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
# Per-token quantities summed per sequence and per bin, by output kind.
NEXT_TOKEN_FIELDS = ("delta_loss", "kl", "top1_agreement", "loss_intact")
EMBEDDING_FIELDS = ("cosine",)


@dataclass(frozen=True)
class Scope:
    """A set of norms intervened on together, and how the records name it."""

    kind: str  # "all" | "layer" | "site_class"
    name: str  # "all", "layer 3", "layer final", "ln1"
    layer: int | str | None  # the block (or "final"/"embed") of a "layer" scope
    site_class: str | None  # the role of a "site_class" scope
    sites: tuple[NormSite, ...]

    @property
    def action(self) -> str:
        actions = {ACTIONS[site.kind] for site in self.sites}
        return actions.pop() if len(actions) == 1 else "mixed"


def intervenable(norms: Sequence[NormSite]) -> list[NormSite]:
    """The norms the intervention applies to: LayerNorm and RMSNorm sites (not DyT)."""
    return [norm for norm in norms if norm.kind in INTERVENABLE_KINDS]


def intervention_scopes(norms: Sequence[NormSite], kinds: Sequence[str] = DEFAULT_SCOPES) -> list[Scope]:
    """The scopes of ``kinds`` (:data:`SCOPE_KINDS`) over the intervenable norms, in a fixed order."""
    unknown = [kind for kind in kinds if kind not in SCOPE_KINDS]
    if unknown:
        raise ValueError(f"unknown intervention scope(s) {unknown}: choose from {', '.join(SCOPE_KINDS)}")
    sites = intervenable(norms)
    if not sites:
        return []
    scopes: list[Scope] = []
    if "all" in kinds:
        scopes.append(Scope("all", "all", None, None, tuple(sites)))
    if "layers" in kinds:
        layers: list[int | str] = []
        for site in sites:
            if site.layer not in layers:
                layers.append(site.layer)
        for layer in layers:
            members = tuple(site for site in sites if site.layer == layer)
            scopes.append(Scope("layer", f"layer {layer}", layer, None, members))
    if "site_classes" in kinds:
        roles: list[str] = []
        for site in sites:
            if site.role not in roles:
                roles.append(site.role)
        for role in roles:
            scopes.append(Scope("site_class", role, None, role, tuple(s for s in sites if s.role == role)))
    return scopes


def norm_affine(site: NormSite) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gain, bias) of a LayerNorm site's module, either possibly None; a module that keeps them under
    other names cannot be intervened on exactly, so it is refused with what to do."""
    module = site.module
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(
                f"norm {site.name!r} ({type(module).__name__}) has a {name} that is not a tensor: the "
                "intervention needs the module's gain as .weight and its bias as .bias"
            )
    return weight, bias


def uncentered_layer_norm(x: torch.Tensor, site: NormSite) -> torch.Tensor:
    """A LayerNorm site's output without its mean subtraction: ``g * x / sqrt(mean(x^2) + eps) + b``,
    computed in at least float32 and returned in ``x``'s dtype (as torch's LayerNorm does)."""
    weight, bias = norm_affine(site)
    compute = at_least_float32(x)
    scaled = F.rms_norm(compute, (compute.shape[-1],), eps=site.eps)
    if weight is not None:
        scaled = scaled * weight.to(compute.dtype)
    if bias is not None:
        scaled = scaled + bias.to(compute.dtype)
    return scaled.to(x.dtype)


def centered(x: torch.Tensor) -> torch.Tensor:
    """``x - mean(x)`` over the last dimension: an RMSNorm module fed this is a LayerNorm with its own
    gain, bias and eps (the mean square of a centered vector is the variance)."""
    return x - x.mean(dim=-1, keepdim=True)


@contextlib.contextmanager
def intervened(sites: Sequence[NormSite]) -> Iterator[None]:
    """Within the block, ``sites`` compute with the centering removed (LayerNorm) or added (RMSNorm).

    Only hooks are added, and they are removed on the way out whatever happens: no weight is touched.
    """
    handles = []
    try:
        for site in sites:
            if site.kind == "layer":
                def replace_output(module: nn.Module, inputs: tuple, output: torch.Tensor, site=site) -> torch.Tensor:
                    return uncentered_layer_norm(inputs[0], site)

                handles.append(site.module.register_forward_hook(replace_output))
            elif site.kind == "rms":
                def center_input(module: nn.Module, inputs: tuple) -> tuple:
                    return (centered(inputs[0]), *inputs[1:])

                handles.append(site.module.register_forward_pre_hook(center_input))
            else:
                raise ValueError(f"norm {site.name!r} is of kind {site.kind!r}: no centering to intervene on")
        yield
    finally:
        for handle in handles:
            handle.remove()


def model_output(output: object) -> tuple[str, torch.Tensor]:
    """("next_token", logits) or ("embedding", last hidden states) of a forward's output: our GPT returns
    logits; a Hugging Face causal LM has ``.logits``; a base model or encoder ``.last_hidden_state``."""
    if isinstance(output, torch.Tensor):
        return "next_token", output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return "next_token", logits
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return "embedding", hidden
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return "embedding", output[0]
    raise TypeError(f"cannot read logits or hidden states from a model output of type {type(output).__name__}")


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 up to float32; float32 and float64 as they are (a float64 model is measured in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def energy_fraction(x: torch.Tensor) -> torch.Tensor:
    """Per token, the fraction of ||x||^2 along 1: (sum x)^2 / (d ||x||^2) (0 for a zero vector)."""
    x = at_least_float32(x.detach())
    square = x.square().sum(dim=-1)
    return (x.sum(dim=-1).square() / (x.shape[-1] * square)).nan_to_num(0.0)


@dataclass
class IntactPrediction:
    """What every scope's intervened forward is compared with, computed once per batch: the intact forward's
    next-token probabilities (rows, T - 1, V), their negative entropy sum(p log p), the loss on the true next
    tokens and the top-1 tokens."""

    probs: torch.Tensor
    neg_entropy: torch.Tensor
    loss: torch.Tensor
    top1: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, batch: torch.Tensor) -> IntactPrediction:
        log_probs = F.log_softmax(at_least_float32(logits[:, :-1]), dim=-1)
        loss = -log_probs.gather(-1, batch[:, 1:].unsqueeze(-1)).squeeze(-1)
        probs = log_probs.exp()
        neg_entropy = torch.linalg.vecdot(probs, log_probs)
        return cls(probs, neg_entropy, loss, log_probs.argmax(dim=-1))


def next_token_changes(intact: IntactPrediction, intervened_logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """(rows, T - 1, 4) per predicted token: loss change, KL(intact || intervened), top-1 agreement, intact loss.

    With q = log_softmax(z) of the intervened logits z, KL = sum p log p - sum p z + logsumexp(z) (sum p = 1):
    one reduction and one dot product over the vocabulary per scope, no (T, V) temporaries beyond z itself.
    """
    logits = at_least_float32(intervened_logits[:, :-1])
    normalizer = torch.logsumexp(logits, dim=-1)
    loss = normalizer - logits.gather(-1, batch[:, 1:].unsqueeze(-1)).squeeze(-1)
    kl = (intact.neg_entropy - torch.linalg.vecdot(intact.probs, logits) + normalizer).clamp(min=0.0)
    agree = (intact.top1 == logits.argmax(dim=-1)).float()
    return torch.stack([loss - intact.loss, kl, agree, intact.loss], dim=-1)


def embedding_changes(intact: torch.Tensor, intervened_hidden: torch.Tensor) -> torch.Tensor:
    """(rows, T, 1): cosine of each token's intact and intervened output vector."""
    return F.cosine_similarity(at_least_float32(intact), at_least_float32(intervened_hidden), dim=-1).unsqueeze(-1)


class InterventionProbe:
    """Runs every scope's intervened forward after each intact probe forward and keeps the sums.

    Use as a context manager around the probe (it registers, on every intervenable norm, a pre-hook that
    records the energy fraction along 1 of each token during the intact forward), and pass
    :meth:`observe` as ``run_probe``'s ``on_batch``. ``num_sequences`` probe sequences are tracked by
    their global index; :meth:`all_reduce` merges ranks (each sequence is measured on one rank) through
    ``device``, the probe's (a CUDA device under NCCL).
    """

    def __init__(self, norms: Sequence[NormSite], scopes: Sequence[Scope], num_sequences: int,
                 device: torch.device | str = "cpu") -> None:
        self.norms = intervenable(norms)
        self.device = torch.device(device)  # where all_reduce sends the sums (NCCL reduces CUDA tensors only)
        self.scopes = list(scopes)
        self.num_sequences = num_sequences
        self.output: str | None = None  # "next_token" or "embedding", from the first forward
        self.seq_count = np.zeros((len(self.scopes), num_sequences))
        self.seq_sum: np.ndarray | None = None  # (scopes, sequences, fields)
        self.bin_count = np.zeros((len(self.scopes), len(ENERGY_EDGES) - 1))
        self.bin_sum: np.ndarray | None = None  # (scopes, bins, fields)
        self.bin_energy = np.zeros((len(self.scopes), len(ENERGY_EDGES) - 1))  # sum of the tokens' fractions
        self._recording = False
        self._fractions: dict[str, torch.Tensor] = {}
        self._handles: list = []

    @property
    def fields(self) -> tuple[str, ...]:
        return NEXT_TOKEN_FIELDS if self.output == "next_token" else EMBEDDING_FIELDS

    def __enter__(self) -> InterventionProbe:
        def make_recorder(site: NormSite) -> Callable:
            def record(module: nn.Module, inputs: tuple) -> None:
                if self._recording:
                    self._fractions[site.name] = energy_fraction(inputs[0])

            return record

        self._handles = [norm.module.register_forward_pre_hook(make_recorder(norm)) for norm in self.norms]
        self._recording = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._recording = False

    def _allocate(self, output: str) -> None:
        self.output = output
        fields = len(self.fields)
        self.seq_sum = np.zeros((len(self.scopes), self.num_sequences, fields))
        self.bin_sum = np.zeros((len(self.scopes), len(ENERGY_EDGES) - 1, fields))

    @torch.no_grad()
    def observe(
        self, call: Callable[[torch.Tensor], object], batch: torch.Tensor, output: object, rows: int,
        sequence_ids: torch.Tensor,
    ) -> None:
        """After the intact forward of ``batch`` (whose first ``rows`` rows are probe sequences number
        ``sequence_ids``; the rest padding): run each scope's intervened forward and add up the changes.

        The forwards run even when ``rows`` is 0 (a padded batch), so that every rank of a sharded model
        makes the same collective calls.
        """
        kind, intact = model_output(output)
        if self.output is None:
            self._allocate(kind)
        intact = intact[:rows].detach()
        reference = IntactPrediction.of(intact, batch[:rows]) if kind == "next_token" and rows else None
        fractions = {name: value[:rows] for name, value in self._fractions.items()}
        self._fractions = {}
        self._recording = False
        try:
            for index, scope in enumerate(self.scopes):
                with intervened(scope.sites):
                    changed = model_output(call(batch))[1][:rows]
                if rows == 0:
                    continue
                if kind == "next_token":
                    per_token = next_token_changes(reference, changed, batch[:rows])
                    tokens = slice(0, -1)  # the last token has no next token
                else:
                    per_token = embedding_changes(intact, changed)
                    tokens = slice(None)
                # A norm the forward did not call (none in our models) adds nothing to the scope's energy.
                seen = [fractions[site.name][:, tokens] for site in scope.sites if site.name in fractions]
                energy = torch.stack(seen).mean(dim=0) if seen else torch.zeros(per_token.shape[:2])
                self._add(index, per_token.double().cpu().numpy(), energy.double().cpu().numpy(),
                          sequence_ids.cpu().numpy())
        finally:
            self._recording = True

    def _add(self, scope: int, per_token: np.ndarray, energy: np.ndarray, sequence_ids: np.ndarray) -> None:
        assert self.seq_sum is not None and self.bin_sum is not None
        np.add.at(self.seq_count[scope], sequence_ids, per_token.shape[1])
        np.add.at(self.seq_sum[scope], sequence_ids, per_token.sum(axis=1))
        flat, values = energy.reshape(-1), per_token.reshape(-1, per_token.shape[-1])
        bins = np.clip(np.searchsorted(ENERGY_EDGES, flat, side="right") - 1, 0, len(ENERGY_EDGES) - 2)
        np.add.at(self.bin_count[scope], bins, 1)
        np.add.at(self.bin_sum[scope], bins, values)
        np.add.at(self.bin_energy[scope], bins, flat)

    def all_reduce(self) -> None:
        """Sum every rank's sums into every rank's (no-op outside torch.distributed)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not self.scopes:
            return
        assert self.seq_sum is not None and self.bin_sum is not None
        for name in ("seq_count", "seq_sum", "bin_count", "bin_sum", "bin_energy"):
            tensor = torch.from_numpy(getattr(self, name)).to(self.device)
            dist.all_reduce(tensor)
            setattr(self, name, tensor.cpu().numpy())


INTERVENTION_FIELDS = (
    "model", "norm", "step", "tokens_seen", "scope", "scope_name", "layer", "site_class", "sites", "action",
    "output", "tokens", "sequences",
    "delta_loss", "delta_loss_ci_low", "delta_loss_ci_high",
    "kl", "kl_ci_low", "kl_ci_high",
    "top1_agreement", "top1_agreement_ci_low", "top1_agreement_ci_high",
    "loss_intact",
    "cosine", "cosine_ci_low", "cosine_ci_high",
    "energy_bins",
    "ci_level", "bootstrap_replicates", "bootstrap_block", "bootstrap_seed",
)


def intervention_rows(
    probe: InterventionProbe,
    *,
    model: str,
    norm: str,
    step: int | None,
    tokens_seen: int | None,
    replicates: int = 1000,
    block: int = 1,
    seed: int = 0,
    level: float = 0.95,
) -> list[dict]:
    """``intervention.jsonl``'s rows: one per scope (the contract, :data:`INTERVENTION_FIELDS`)."""
    if not probe.scopes or probe.seq_sum is None or probe.bin_sum is None:
        return []
    rows = []
    fields = probe.fields
    for index, scope in enumerate(probe.scopes):
        measured = probe.seq_count[index] > 0
        interval = block_bootstrap_means(
            probe.seq_count[index], probe.seq_sum[index], replicates=replicates, block=block, seed=seed, level=level
        )
        estimate = {name: (interval["mean"][f], interval["low"][f], interval["high"][f]) for f, name in enumerate(fields)}
        row: dict = {
            "model": model, "norm": norm, "step": step, "tokens_seen": tokens_seen,
            "scope": scope.kind, "scope_name": scope.name, "layer": scope.layer, "site_class": scope.site_class,
            "sites": [site.role if site.layer == site.role else f"{site.layer}.{site.role}" for site in scope.sites],
            "action": scope.action,
            "output": probe.output, "tokens": int(probe.seq_count[index].sum()), "sequences": int(measured.sum()),
        }
        for name in ("delta_loss", "kl", "top1_agreement", "cosine"):
            mean, low, high = estimate.get(name, (None, None, None))
            row[name] = json_number(mean) if mean is not None else None
            row[f"{name}_ci_low"] = json_number(low) if low is not None else None
            row[f"{name}_ci_high"] = json_number(high) if high is not None else None
        row["loss_intact"] = json_number(estimate["loss_intact"][0]) if "loss_intact" in estimate else None
        bins = []
        for b in range(len(ENERGY_EDGES) - 1):
            count = probe.bin_count[index, b]
            entry = {"fraction_low": ENERGY_EDGES[b], "fraction_high": ENERGY_EDGES[b + 1], "tokens": int(count),
                     "mean_fraction": json_number(probe.bin_energy[index, b] / count) if count else None}
            for f, name in enumerate(fields):
                if name != "loss_intact":
                    entry[name] = json_number(probe.bin_sum[index, b, f] / count) if count else None
            bins.append(entry)
        row["energy_bins"] = bins
        row.update(ci_level=level, bootstrap_replicates=replicates, bootstrap_block=block, bootstrap_seed=seed)
        rows.append({name: row[name] for name in INTERVENTION_FIELDS})
    return rows
