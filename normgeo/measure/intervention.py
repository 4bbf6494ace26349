"""The centering intervention: does LayerNorm's mean subtraction change what the model predicts?

The geometry says how far the norm inputs are from the uniform vector 1; this module asks whether that
component matters, by swapping one operation inside chosen norms (each module's own gain, bias and eps):

- a LayerNorm site (kind ``layer``) **removes** the centering: ``g * x / rms(x) + b`` (a forward hook
  replaces the output);
- an RMSNorm site (kind ``rms``) **adds** it: the module runs on ``x - mean(x)`` (a forward pre-hook);
- a DyT site (kind ``tanh``) has no centering and is never intervened on.

Scopes (:func:`intervention_scopes`): every norm at once (``all``), each block's norms (``layers``), or each
site class across blocks (``site_classes``). Each scope costs one extra no-grad forward over the first
``probe.intervention_tokens`` probe tokens; a scope in one block resumes at that block from the intact
forward's residual stream (:class:`BlockReplay`), so the per-block scopes cost about (L + 1) / 2 forwards.

Per scope, on next-token prediction: the mean loss change (nats, intervened - intact), KL(intact ||
intervened) and top-1 agreement, with 95% block-bootstrap intervals over probe sequences (the draw of
``null.jsonl``), and the same per bin of the tokens' energy fraction along 1 at the intervened inputs. A model
without a language-model head gets the cosine of its intact and intervened outputs (``output: "embedding"``).
The same by the predicting token's position bucket (and at document starts, ``doc_start``, which overlap the
buckets) go to ``intervention_positions.jsonl``.

Only per-sequence and per-bin sums are kept; hooks are removed whatever happens, so the model is left as it
was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from normgeo.measure.mean_sources import BUCKET_STARTS, DOC_START, bucket_names
from normgeo.measure.measurement import Measurement, ProbeBatch, RecordKeys
from normgeo.measure.norm_sites import NormSite
from normgeo.measure.stats import block_bootstrap_means, distributed, json_number
from normgeo.run_folder import INTERVENTION_FILE, INTERVENTION_POSITIONS_FILE

log = logging.getLogger(__name__)

# Probe tokens the intervention runs on (probe.intervention_tokens): its 95% interval of the loss change on
# SmolLM2-135M is already +-0.017 nats at 4,096 tokens (docs/intervention_numbers.md).
DEFAULT_INTERVENTION_TOKENS = 8192
SCOPE_KINDS = ("all", "layers", "site_classes")
# Every norm at once by default: one extra forward on the budget's tokens answers "does the mean subtraction
# change the predictions"; the per-block breakdown (``layers``, about (L + 1) / 2 more forwards resumed
# mid-stack) and ``site_classes`` are asked for (docs/probe.md, bench/probe_cost.py).
DEFAULT_SCOPES = ("all",)
INTERVENABLE_KINDS = ("layer", "rms")  # DyT ("tanh") has no centering to take out or put in
ACTIONS = {"layer": "remove", "rms": "add"}
# Edges of the bins of the per-token energy fraction along 1 (cos^2 of the angle with 1; an isotropic
# vector has 1/d): decades from 1e-4, the first bin holding everything below.
ENERGY_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
# Per-token quantities summed per sequence and per bin, by output kind.
NEXT_TOKEN_FIELDS = ("delta_loss", "kl", "top1_agreement", "loss_intact")
EMBEDDING_FIELDS = ("cosine",)
CHANGES = ("delta_loss", "kl", "top1_agreement", "cosine")  # the quantities with intervals in the rows


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
        for layer in dict.fromkeys(site.layer for site in sites):
            members = tuple(site for site in sites if site.layer == layer)
            scopes.append(Scope("layer", f"layer {layer}", layer, None, members))
    if "site_classes" in kinds:
        for role in dict.fromkeys(site.role for site in sites):
            scopes.append(Scope("site_class", role, None, role, tuple(s for s in sites if s.role == role)))
    return scopes


def norm_affine(site: NormSite) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gain, bias) of a LayerNorm site's module, either possibly None; a module that keeps them under
    other names cannot be intervened on exactly, so it is refused with what to do."""
    module = site.module
    # TransformerLens' LayerNorm keeps them as .w and .b
    weight = getattr(module, "weight", getattr(module, "w", None))
    bias = getattr(module, "bias", getattr(module, "b", None))
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

                def replace_output(
                    module: nn.Module, inputs: tuple, output: torch.Tensor, site=site
                ) -> torch.Tensor:
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
    raise TypeError(
        f"cannot read logits or hidden states from a model output of type {type(output).__name__}"
    )


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 up to float32; float32 and float64 as they are (a float64 model is measured in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def energy_fraction(x: torch.Tensor) -> torch.Tensor:
    """Per token, the fraction of ||x||^2 along 1: (sum x)^2 / (d ||x||^2) (0 for a zero vector)."""
    x = at_least_float32(x.detach())
    square = x.square().sum(dim=-1)
    return (x.sum(dim=-1).square() / (x.shape[-1] * square)).nan_to_num(0.0)


# Tokens per chunk of the vocabulary-sized work. On CPU 32 x 49,152 float32 logits (6 MB) and the chunk's
# temporaries stay in the L3 cache across the passes (measured on 2 cores: 2-3x faster than whole-batch
# reductions); on a GPU larger chunks keep the kernels big while bounding the temporaries (1,024 x 50,304 x
# 4 B = 206 MB each).
VOCAB_CHUNK_TOKENS = {"cpu": 32, "cuda": 1024}
ARGMAX_BLOCK = 64  # entries per block of row_argmax's first pass


def vocab_chunks(rows: int, length: int, device: torch.device) -> list[tuple[int, slice]]:
    """(row, token slice) chunks of a (rows, length, V) tensor for the vocabulary-sized work on ``device``:
    each a contiguous view of the logits (flattening ``logits[:, :-1]`` would copy them)."""
    size = VOCAB_CHUNK_TOKENS.get(device.type, 1024)
    return [
        (row, slice(start, min(start + size, length)))
        for row in range(rows)
        for start in range(0, length, size)
    ]


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-d ``x``, the first maximal index as torch gives it (NaN counted as the
    maximum), through the block maxima: a CPU's amax is vectorized and its argmax is not (25x slower over a
    vocabulary), so only the first block that holds the maximum is searched by index."""
    width = x.shape[-1]
    whole = width // ARGMAX_BLOCK * ARGMAX_BLOCK
    if x.device.type != "cpu" or whole == 0:
        return x.argmax(dim=-1)
    maxima = x[:, :whole].unflatten(-1, (-1, ARGMAX_BLOCK)).amax(dim=-1)
    if whole < width:
        maxima = torch.cat([maxima, x[:, whole:].amax(dim=-1, keepdim=True)], dim=-1)
    first = maxima.argmax(dim=-1, keepdim=True) * ARGMAX_BLOCK  # the first block holding the maximum
    # A short last block repeats the last index: a repeat comes after its first occurrence, never chosen.
    index = (first + torch.arange(ARGMAX_BLOCK, device=x.device)).clamp_(max=width - 1)
    return index.gather(-1, x.gather(-1, index).argmax(dim=-1, keepdim=True)).squeeze(-1)


def next_token_changes(
    intact_logits: torch.Tensor, intervened_logits: torch.Tensor, batch: torch.Tensor
) -> torch.Tensor:
    """(rows, T - 1, 4) per predicted token: loss change, KL(intact || intervened), top-1 agreement, intact
    loss, from the two forwards' logits (rows, T, V) and the tokens (rows, T).

    With p the intact next-token probabilities and d = z' - z, the intervened logits less the intact ones,
    up to any constant per token: KL(p || q) = log E_p e^d - E_p d, and the loss change is
    log E_p e^d - d[target]. Both are computed from d, of the size of the change (z' - z is exact in float32
    where the logits are close), centred by its mean: as differences of O(10) float32 sums over the
    vocabulary they were off by ~1e-5 nats, 2% of a random-weight GPT's KL, set by the CPU's summation
    order. The intact loss is log-sum-exp minus the target's logit, the log-sum-exp read from the largest
    probability (at least 1/V, so exact to float32 rounding). Chunk by chunk (:func:`vocab_chunks`), every
    pass in the cache and no (rows, T, V) tensor made."""
    rows, length = intervened_logits.shape[0], intervened_logits.shape[1] - 1
    changes = torch.empty((rows, length, 4), dtype=at_least_float32(intact_logits[:0]).dtype,
                          device=intervened_logits.device)
    for row, chunk in vocab_chunks(rows, length, intervened_logits.device):
        intact = at_least_float32(intact_logits[row, chunk])
        logits = at_least_float32(intervened_logits[row, chunk])
        targets = batch[row, 1:][chunk].unsqueeze(-1)
        probs = torch.softmax(intact, dim=-1)
        total = probs.sum(dim=-1)  # 1 within float32 rounding: every expectation is divided by it
        loss = intact.amax(dim=-1) - probs.amax(dim=-1).log() - intact.gather(-1, targets).squeeze(-1)
        agree = row_argmax(logits) == row_argmax(intact)
        d = logits - intact
        d -= (torch.linalg.vecdot(probs, d) / total).unsqueeze(-1)  # for precision only: constants cancel
        mean_d = torch.linalg.vecdot(probs, d) / total
        delta_target = d.gather(-1, targets).squeeze(-1)
        # log E_p e^d = log1p(E_p (e^d - 1)): a sum of terms of the change's size. e^80 keeps it finite; a
        # logit moved by more than 80 nats against the others would be taken as 80.
        log_mean_exp = (torch.linalg.vecdot(probs, d.clamp_(max=80.0).expm1_()) / total).log1p()
        kl = (log_mean_exp - mean_d).clamp(min=0.0)
        changes[row, chunk] = torch.stack([log_mean_exp - delta_target, kl, agree.to(kl.dtype), loss], dim=-1)
    return changes


def embedding_changes(intact: torch.Tensor, intervened_hidden: torch.Tensor) -> torch.Tensor:
    """(rows, T, 1): cosine of each token's intact and intervened output vector."""
    return F.cosine_similarity(
        at_least_float32(intact), at_least_float32(intervened_hidden), dim=-1
    ).unsqueeze(-1)


def block_stack(model: nn.Module, norms: Sequence[NormSite]) -> tuple[nn.ModuleList | None, str]:
    """The ModuleList that holds the blocks of the norms' integer layers, or (None, why it cannot be found).

    Every norm of block l must sit in entry l of one and the same list (:attr:`NormSite.block`): a model with
    two stacks (an encoder and a decoder) cannot be resumed mid-stack.
    """
    stacks = set()
    for norm in norms:
        if not isinstance(norm.layer, int):
            continue
        if norm.block is None or not norm.block.endswith(f".{norm.layer}"):
            return (
                None,
                f"norm {norm.name!r} of block {norm.layer} is not found in entry {norm.layer} of a "
                "block list",
            )
        stacks.add(norm.block.removesuffix(f".{norm.layer}"))
    if len(stacks) != 1:
        return (
            None,
            "its norms are in more than one block list" if stacks else "it has no norm inside a block",
        )
    prefix = stacks.pop()
    stack = model.get_submodule(prefix)
    if not isinstance(stack, nn.ModuleList):
        return None, f"{prefix!r} is a {type(stack).__name__}, not a list of blocks"
    return stack, ""


class _Replay(nn.Module):
    """Stands in for a block whose output on the current batch is known: returns it without computing."""

    def __init__(self, output: object) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.output


class BlockReplay:
    """Resume a forward at block l: blocks 0..l-1 are swapped for stand-ins that return their outputs of the
    intact forward (recorded on the current batch only), so only blocks l.. and the head compute.

    Exact whenever nothing before block l changes: a scope that intervenes in block l (or the final norm)
    sees the same residual stream at block l's input as a full re-run, and the blocks that run see the same
    inputs. Every rank swaps the same blocks, so a sharded model's collectives stay matched.
    """

    def __init__(self, stack: nn.ModuleList) -> None:
        self.stack = stack
        self.outputs: list[object] = [None] * len(stack)
        self.recording = False
        self._handles: list = []

    def __enter__(self) -> BlockReplay:
        def make_recorder(index: int) -> Callable:
            def record(module: nn.Module, inputs: tuple, output: object) -> None:
                if self.recording:
                    self.outputs[index] = output

            return record

        self._handles = [block.register_forward_hook(make_recorder(i)) for i, block in enumerate(self.stack)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.outputs = [None] * len(self.stack)

    @contextlib.contextmanager
    def resumed_at(self, layer: int) -> Iterator[None]:
        """Within the block, a forward computes only blocks ``layer``.. (``len(stack)``: the final norm and
        head)."""
        originals = [self.stack[i] for i in range(layer)]
        try:
            if layer:
                # Every stand-in returns block layer-1's output: the
                # ones before it are ignored by their successor.
                stand_in = _Replay(self.outputs[layer - 1])
                for i in range(layer):
                    self.stack[i] = stand_in
            yield
        finally:
            for i, block in enumerate(originals):
                self.stack[i] = block


def eager() -> contextlib.AbstractContextManager:
    """The intervened forwards run eagerly: hooks and swapped blocks would make a compiled model recompile."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def same_output(a: object, b: object) -> bool:
    """Whether two forwards' outputs agree to rounding: within 1e-3 of the largest |value| in float32 or 64,
    5e-2 in a 16-bit dtype (a compiled intact forward against an eager resumed one differs by a few ulps; a
    resumed forward that does not reproduce the model differs by the size of the values)."""
    x, y = model_output(a)[1], model_output(b)[1]
    tolerance = 5e-2 if torch.finfo(x.dtype).bits <= 16 else 1e-3
    x, y = x.float(), y.float()
    return x.shape == y.shape and bool((x - y).abs().max() <= tolerance * x.abs().max().clamp(min=1.0))


class CenteringIntervention(Measurement):
    """The centering intervention as a probe measurement: after each intact forward, every scope's intervened
    forward, the changes added up per probe sequence and per energy bin (``intervention.jsonl``).

    Only probe sequences number < ``num_sequences`` are intervened on (the windows of the first
    ``probe.intervention_tokens`` tokens, ``token_budget`` of them): the angles need many tokens, the loss
    change's interval is narrow after a few thousand. Scopes in one block (``layer l``, ``layer final``)
    resume the forward at that block (:class:`BlockReplay`) where ``model``'s blocks can be found and a
    resumed forward reproduces the intact one on the first batch; otherwise every scope runs the full
    forward, and a warning says so once. ``device``: where :meth:`all_reduce` sends the sums (NCCL reduces
    CUDA tensors only). ``with_rows=False``: :meth:`records` gives nothing (the bootstrap costs; only the
    writing rank needs them).
    """

    def __init__(
        self,
        model: nn.Module,
        norms: Sequence[NormSite],
        scopes: Sequence[Scope],
        num_sequences: int,
        *,
        token_budget: int,
        device: torch.device | str = "cpu",
        with_rows: bool = True,
        bootstrap_replicates: int = 1000,
        bootstrap_block: int = 1,
        seed: int = 1234,
        resume: bool = True,
    ) -> None:
        self.norms = intervenable(norms)
        self.scopes = list(scopes)
        self.num_sequences = num_sequences
        self.token_budget = token_budget
        self.device = torch.device(device)
        self.with_rows = with_rows
        self.bootstrap = {"replicates": bootstrap_replicates, "block": bootstrap_block, "seed": seed}
        self.output: str | None = None  # "next_token" or "embedding", from the first forward
        self.seq_count = np.zeros((len(self.scopes), num_sequences))
        self.seq_sum: np.ndarray | None = None  # (scopes, sequences, fields)
        self.bin_count = np.zeros((len(self.scopes), len(ENERGY_EDGES) - 1))
        self.bin_sum: np.ndarray | None = None  # (scopes, bins, fields)
        self.bin_energy = np.zeros((len(self.scopes), len(ENERGY_EDGES) - 1))  # sum of the tokens' fractions
        # Per scope, sequence and position bucket, then the document starts (the last slot, overlapping the
        # buckets): token counts and sums (the per-position rows' bootstrap).
        self.position_count = np.zeros((len(self.scopes), num_sequences, len(BUCKET_STARTS) + 1))
        self.position_sum: np.ndarray | None = None  # (scopes, sequences, buckets + 1, fields)
        self._fractions: dict[str, torch.Tensor] = {}
        self._intervenable = {norm.name for norm in self.norms}
        resumable = [
            s for s in self.scopes if s.kind == "layer" and (isinstance(s.layer, int) or s.layer == "final")
        ]
        stack, why = block_stack(model, self.norms) if resume and resumable else (None, "")
        self.replay = BlockReplay(stack) if stack is not None else None
        self._checked = False  # the replay's first-batch check against the intact forward
        if why:
            self._fall_back(why)

    @property
    def fields(self) -> tuple[str, ...]:
        return NEXT_TOKEN_FIELDS if self.output == "next_token" else EMBEDDING_FIELDS

    def _fall_back(self, why: str) -> None:
        if self.replay is not None:
            self.replay.__exit__(None, None, None)  # its recording hooks go now, not at the probe's end
        log.warning(
            "centering intervention: the model cannot be resumed mid-stack (%s); each of its per-block "
            "scopes runs the full forward",
            why,
        )
        self.replay = None

    def resume_layer(self, scope: Scope) -> int | None:
        """The block a scope's forward resumes at, or None for a full forward."""
        if self.replay is None or scope.kind != "layer":
            return None
        if scope.layer == "final":
            return len(self.replay.stack)
        return scope.layer if isinstance(scope.layer, int) else None

    def __enter__(self) -> CenteringIntervention:
        if self.replay is not None:
            self.replay.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.replay is not None:
            self.replay.__exit__(*exc_info)

    def intervenes(self, lead_id: int) -> bool:
        """Whether the batch whose smallest global sequence id is ``lead_id`` holds intervened sequences."""
        return bool(self.scopes) and lead_id < self.num_sequences

    def scope_cost(self, scope: Scope) -> float:
        """A scope's forward in full forwards: one resumed at block l of L runs (L - l + 1) / (L + 1) of the
        model (the head and embeddings counted as one more block): the estimate the probe announces."""
        layer = self.resume_layer(scope)
        if layer is None:
            return 1.0
        blocks = len(self.replay.stack)
        return (blocks - layer + 1) / (blocks + 1)

    def reads_output(self, lead_id: int) -> bool:
        return self.intervenes(lead_id)

    def forwards_per_batch(self, lead_id: int) -> float:
        return sum(self.scope_cost(scope) for scope in self.scopes) if self.intervenes(lead_id) else 0.0

    def before_batch(self, batch: ProbeBatch) -> None:
        if self.replay is not None:  # the blocks' outputs are kept only for batches that are intervened on
            self.replay.recording = self.intervenes(batch.lead_id)

    def observe_norm(self, index: int, norm: NormSite, inputs: torch.Tensor, output: torch.Tensor,
                     batch: ProbeBatch) -> None:
        if norm.name in self._intervenable and self.intervenes(batch.lead_id):
            self._fractions[norm.name] = energy_fraction(inputs)

    def _allocate(self, output: str) -> None:
        self.output = output
        fields = len(self.fields)
        self.seq_sum = np.zeros((len(self.scopes), self.num_sequences, fields))
        self.bin_sum = np.zeros((len(self.scopes), len(ENERGY_EDGES) - 1, fields))
        self.position_sum = np.zeros((len(self.scopes), self.num_sequences, len(BUCKET_STARTS) + 1, fields))

    @torch.no_grad()
    def observe_batch(self, batch: ProbeBatch) -> None:
        """Each scope's intervened forward of the batch, compared with the intact one.

        Runs for every batch with intervened sequences on any rank (``lead_id``), also where this rank's rows
        are all past the budget or padding, so that every rank of a sharded model makes the same calls.
        """
        fractions, self._fractions = self._fractions, {}
        if not self.intervenes(batch.lead_id):
            return
        if self.replay is not None:
            self.replay.recording = False
        kind, intact = model_output(batch.output)
        if self.output is None:
            self._allocate(kind)
        # The real rows within the budget: sequence ids ascend within a batch.
        rows = int((batch.sequence_ids[: batch.rows] < self.num_sequences).sum())
        ids = batch.sequence_ids[:rows]
        intact = intact[:rows].detach()
        fractions = {name: value[:rows] for name, value in fractions.items()}
        tokens = slice(0, -1) if kind == "next_token" else slice(None)  # the last token has no next token
        # The predicting tokens that begin a document; read back with the changes below (a few batches only).
        starts = (batch.document_starts[:rows, tokens].cpu().numpy()
                  if batch.document_starts is not None else None)
        if self.replay is not None and not self._checked:
            self._check_replay(batch)
        for index, scope in enumerate(self.scopes):
            layer = self.resume_layer(scope)
            resumed = self.replay.resumed_at(layer) if layer is not None else contextlib.nullcontext()
            with eager(), resumed, intervened(scope.sites):
                changed = model_output(batch.forward(batch.tokens))[1][:rows]
            batch.progress(self.scope_cost(scope))
            if rows == 0:
                continue
            if kind == "next_token":
                per_token = next_token_changes(intact, changed, batch.tokens[:rows])
            else:
                per_token = embedding_changes(intact, changed)
            # A norm the forward did not call (none in our models) adds nothing to the scope's energy.
            seen = [fractions[site.name][:, tokens] for site in scope.sites if site.name in fractions]
            energy = torch.stack(seen).mean(dim=0) if seen else torch.zeros(per_token.shape[:2])
            self._add(index, per_token.double().cpu().numpy(), energy.double().cpu().numpy(),
                      ids.cpu().numpy(), starts)
        if self.replay is not None:
            self.replay.outputs = [None] * len(self.replay.stack)  # this batch's activations go now

    def _check_replay(self, batch: ProbeBatch) -> None:
        """Once: a forward resumed at the middle block, with nothing intervened, must give the intact output;
        a model whose blocks share state outside their outputs (or raise when resumed) falls back."""
        self._checked = True
        assert self.replay is not None
        middle = len(self.replay.stack) // 2
        try:
            with eager(), self.replay.resumed_at(middle):
                resumed = batch.forward(batch.tokens)
            why = "" if same_output(batch.output, resumed) else "does not reproduce the intact forward"
        except Exception as exc:  # any failure of a resumed forward means: do not resume
            why = f"raised {type(exc).__name__}: {exc}"
        if distributed():  # one decision for every rank: a sharded model's ranks must run the same forwards
            failed = torch.tensor([float(bool(why))], device=self.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            why = why or ("does not reproduce the intact forward on another rank" if failed.item() else "")
        if why:
            self._fall_back(f"a forward resumed at block {middle} {why}")

    def _add(self, scope: int, per_token: np.ndarray, energy: np.ndarray, sequence_ids: np.ndarray,
             starts: np.ndarray | None = None) -> None:
        assert self.seq_sum is not None and self.bin_sum is not None and self.position_sum is not None
        np.add.at(self.seq_count[scope], sequence_ids, per_token.shape[1])
        np.add.at(self.seq_sum[scope], sequence_ids, per_token.sum(axis=1))
        flat, values = energy.reshape(-1), per_token.reshape(-1, per_token.shape[-1])
        bins = np.clip(np.searchsorted(ENERGY_EDGES, flat, side="right") - 1, 0, len(ENERGY_EDGES) - 2)
        np.add.at(self.bin_count[scope], bins, 1)
        np.add.at(self.bin_sum[scope], bins, values)
        np.add.at(self.bin_energy[scope], bins, flat)
        # The position of the token whose prediction (or output vector) changed, in its probe window.
        positions = np.arange(per_token.shape[1])
        buckets = np.searchsorted(BUCKET_STARTS, positions, side="right") - 1
        where = (sequence_ids[:, None], buckets[None, :])
        np.add.at(self.position_count[scope], where, 1)
        np.add.at(self.position_sum[scope], where, per_token)
        if starts is not None:  # the predicting tokens that begin a document: the last slot
            doc = len(BUCKET_STARTS)
            np.add.at(self.position_count[scope][:, doc], sequence_ids, starts.sum(axis=1))
            np.add.at(self.position_sum[scope][:, doc], sequence_ids,
                      np.where(starts[..., None], per_token, 0.0).sum(axis=1))

    def all_reduce(self) -> None:
        if not distributed() or not self.scopes:
            return
        # Every rank ran the same intervened batches (lead_id), so every rank's sums exist and have one shape.
        assert self.seq_sum is not None and self.bin_sum is not None
        for name in ("seq_count", "seq_sum", "bin_count", "bin_sum", "bin_energy", "position_count",
                     "position_sum"):
            tensor = torch.from_numpy(getattr(self, name)).to(self.device)
            dist.all_reduce(tensor)
            setattr(self, name, tensor.cpu().numpy())

    def records(self, where: RecordKeys) -> dict[str, list[dict]]:
        if not self.with_rows:
            return {}
        return {INTERVENTION_FILE: intervention_rows(self, **where, **self.bootstrap),
                INTERVENTION_POSITIONS_FILE: position_rows(self, **where, **self.bootstrap)}


INTERVENTION_FIELDS = (
    "model", "norm", "step", "tokens_seen", "scope", "scope_name", "layer", "site_class", "sites", "action",
    "output", "intervention_tokens", "tokens", "sequences",
    "delta_loss", "delta_loss_ci_low", "delta_loss_ci_high",
    "kl", "kl_ci_low", "kl_ci_high",
    "top1_agreement", "top1_agreement_ci_low", "top1_agreement_ci_high",
    "loss_intact",
    "cosine", "cosine_ci_low", "cosine_ci_high",
    "energy_bins",
    "ci_level", "bootstrap_replicates", "bootstrap_block", "bootstrap_seed",
)


def intervention_rows(
    probe: CenteringIntervention,
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
        interval = block_bootstrap_means(probe.seq_count[index], probe.seq_sum[index], replicates=replicates,
                                         block=block, seed=seed, level=level)
        row: dict = {
            "model": model,
            "norm": norm,
            "step": step,
            "tokens_seen": tokens_seen,
            "scope": scope.kind,
            "scope_name": scope.name,
            "layer": scope.layer,
            "site_class": scope.site_class,
            "sites": [
                site.role if site.layer == site.role else f"{site.layer}.{site.role}" for site in scope.sites
            ],
            "action": scope.action,
            "output": probe.output,
            "intervention_tokens": probe.token_budget,
            "tokens": int(probe.seq_count[index].sum()),
            "sequences": int(measured.sum()),
            **estimates(fields, interval),
        }
        bins = []
        for b in range(len(ENERGY_EDGES) - 1):
            count = probe.bin_count[index, b]
            entry = {
                "fraction_low": ENERGY_EDGES[b],
                "fraction_high": ENERGY_EDGES[b + 1],
                "tokens": int(count),
                "mean_fraction": json_number(probe.bin_energy[index, b] / count) if count else None,
            }
            for f, name in enumerate(fields):
                if name != "loss_intact":
                    entry[name] = json_number(probe.bin_sum[index, b, f] / count) if count else None
            bins.append(entry)
        row["energy_bins"] = bins
        row.update(ci_level=level, bootstrap_replicates=replicates, bootstrap_block=block,
                   bootstrap_seed=seed)
        rows.append({name: row[name] for name in INTERVENTION_FIELDS})
    return rows


def estimates(fields: Sequence[str], interval: dict | None, bounds: bool = True) -> dict:
    """Each change's mean and interval (``*_ci_low``/``*_ci_high``) and the intact loss's mean, null where
    the output kind has no such field or nothing was measured; ``bounds=False``: null intervals."""
    row: dict = {}
    for quantity in (*CHANGES, "loss_intact"):
        f = fields.index(quantity) if quantity in fields and interval is not None else None
        row[quantity] = json_number(interval["mean"][f]) if f is not None else None
        if quantity != "loss_intact":
            bounded = f is not None and bounds
            row[f"{quantity}_ci_low"] = json_number(interval["low"][f]) if bounded else None
            row[f"{quantity}_ci_high"] = json_number(interval["high"][f]) if bounded else None
    return row


POSITION_FIELDS = (
    "model", "norm", "step", "tokens_seen", "scope", "scope_name", "action", "output", "bucket",
    "first_position", "last_position", "tokens", "sequences",
    "delta_loss", "delta_loss_ci_low", "delta_loss_ci_high",
    "kl", "kl_ci_low", "kl_ci_high",
    "top1_agreement", "top1_agreement_ci_low", "top1_agreement_ci_high",
    "loss_intact",
    "cosine", "cosine_ci_low", "cosine_ci_high",
    "delta_loss_share", "kl_share",
    "ci_level", "bootstrap_replicates", "bootstrap_block", "bootstrap_seed",
)


def position_rows(
    probe: CenteringIntervention,
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
    """``intervention_positions.jsonl``'s rows: one per scope and position bucket (:data:`POSITION_FIELDS`),
    then the scope's document starts (``bucket: "doc_start"``, positions null), which overlap the buckets.

    Each bucket's means have the same block bootstrap over probe sequences as the scope's row; ``*_share``
    is the bucket's part of the scope's summed loss change (or KL) over all its tokens: the part of the
    mean change that the bucket's predictions make, null where the scope's sum is 0."""
    if not probe.scopes or probe.position_sum is None:
        return []
    fields = probe.fields
    names = [*bucket_names(), DOC_START]
    firsts = [*BUCKET_STARTS, None]
    lasts = [*(start - 1 for start in BUCKET_STARTS[1:]), None, None]
    rows = []
    for index, scope in enumerate(probe.scopes):
        # Over the position buckets alone (each token once): the document starts are counted in them too.
        totals = probe.position_sum[index, :, : len(BUCKET_STARTS)].sum(axis=(0, 1))  # (fields,)
        for b, name in enumerate(names):
            count, sums = probe.position_count[index, :, b], probe.position_sum[index, :, b]
            row: dict = {
                "model": model, "norm": norm, "step": step, "tokens_seen": tokens_seen,
                "scope": scope.kind, "scope_name": scope.name, "action": scope.action, "output": probe.output,
                "bucket": name, "first_position": firsts[b], "last_position": lasts[b],
                "tokens": int(count.sum()), "sequences": int((count > 0).sum()),
            }
            interval = (block_bootstrap_means(count, sums, replicates=replicates, block=block, seed=seed,
                                              level=level, drop_empty=True) if count.sum() else None)
            # Tokens in one resampled block only (a few document starts): every replicate that draws them
            # draws the same tokens, so the interval would have width 0; it is null instead.
            varies = len(np.unique(np.flatnonzero(count) // block)) >= 2
            row.update(estimates(fields, interval, bounds=varies))
            # A position bucket past the windows has share 0; no document start (no separator): unknown.
            known = name != DOC_START or row["tokens"] > 0
            for quantity in ("delta_loss", "kl"):
                f = fields.index(quantity) if quantity in fields else None
                total = totals[f] if f is not None and known else 0.0
                row[f"{quantity}_share"] = json_number(sums[:, f].sum() / total) if total else None
            row.update(ci_level=level, bootstrap_replicates=replicates, bootstrap_block=block,
                       bootstrap_seed=seed)
            rows.append({key: row[key] for key in POSITION_FIELDS})
    return rows
