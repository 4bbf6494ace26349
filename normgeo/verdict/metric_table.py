"""What a verdict metric is: one :class:`Metric` record per metric (name, words, unit, number format, margin
key, which way is "better"), in one table. Everything that names, formats or reads a metric asks here."""

from __future__ import annotations

from dataclasses import dataclass

from normgeo.readers.downstream import DOWNSTREAM_PREFIX, is_downstream

SITE_CLASSES = ("ln1.in", "ln2.in", "final.in", "ln1.out", "ln2.out", "final.out")
INTERVENTION = "intervention_dloss"  # the centering intervention's loss change, all norms at once
# Where the mean lives (mean_sources.jsonl) at the last probe, mean over the norm inputs: described only.
MEAN_FIRST, MEAN_TOP8 = "mean_first/last", "mean_top8/last"
INTACT = "intact"  # the "other" of a per-arm intervention row: the arm's own model without the swap


@dataclass(frozen=True)
class Metric:
    """One verdict metric. ``direction`` names where the difference points, with ``{arm}`` the arm whose value
    is higher (``higher=True``) or lower (``higher=False``)."""

    name: str           # verdict.csv's ``metric``, a run measure's column
    text: str           # in sentences and tables
    margin_key: str     # conf/compare/margins.yaml's key
    unit: str           # after a margin: " nats", "°", ...
    spec: str           # format of a value: "+.4f"
    direction: str      # "{arm} reaches the lower validation loss"
    higher: bool        # {arm} in ``direction`` is the arm with the higher value

    def number(self, value: float) -> str:
        return f"{format(value, self.spec)}{'°' if self.unit == '°' else ''}"

    def margin_text(self, margin: float) -> str:
        return f"±{margin:g}{self.unit}"

    def which(self, mean: float, arm: str, other: str) -> str:
        """Where a difference arm − other of ``mean`` points, in words."""
        return self.direction.format(arm=arm if (mean > 0) == self.higher else other)


def _windowed(kind: str, text: str, unit: str, spec: str, direction: str, higher: bool) -> list[Metric]:
    return [Metric(f"{kind}/window", f"{text} (last 30% of probes)", kind, unit, spec, direction, higher),
            Metric(f"{kind}/last", f"{text} (last probe)", kind, unit, spec, direction, higher)]


_LOSS = "{arm} reaches the lower validation loss"
_ORTHOGONAL = "1 is closer to orthogonal under {arm}"
TABLE: tuple[Metric, ...] = (
    Metric("val_loss/tail", "validation loss, mean of the last 20% of the curve", "val_loss", " nats", "+.4f",
           _LOSS, False),
    Metric("val_loss", "final validation loss", "val_loss", " nats", "+.4f", _LOSS, False),
    Metric("ones_dev/all", "|angle with 1 - 90°|, mean over the 6 site classes", "ones_dev", "°", "+.2f",
           _ORTHOGONAL, False),
    *(Metric(f"ones_dev/{site}", f"|angle with 1 - 90°| at {site}", "ones_dev", "°", "+.2f", _ORTHOGONAL,
             False) for site in SITE_CLASSES),
    *_windowed("rank_pct", "1's rank among random directions", " percentile points", "+.1f",
               "1 ranks higher among the random directions under {arm}", True),
    *_windowed("band_margin", "1's distance inside the 5–95% band", " percentile points", "+.1f",
               "1 sits deeper inside the band of random directions under {arm}", True),
    *_windowed("ones_energy", "energy along 1 at the norm inputs", "", "+.4f",
               "more of the energy lies along 1 under {arm}", True),
    *_windowed(INTERVENTION, "Δ loss of the centering intervention, all norms", " nats", "+.4f",
               "the intervention changes {arm}'s loss more", True),
    Metric(MEAN_FIRST, "share of E[μ²] at each probe window's first position, mean over the norm inputs "
           "(last probe)", "mean_sources", "", "+.3f",
           "more of the mean sits at the first position under {arm}", True),
    Metric(MEAN_TOP8, "share of E[μ²] in the 8 dimensions with the largest |φᵢ|, mean over the norm inputs "
           "(last probe)", "mean_sources", "", "+.3f", "the mean is carried by fewer dimensions under {arm}",
           True),
)
METRICS: dict[str, Metric] = {m.name: m for m in TABLE}
GEOMETRY = ("rank_pct", "band_margin", "ones_energy")
INTERVENTION_METRICS = (f"{INTERVENTION}/window", f"{INTERVENTION}/last")
# Every margin key: those of the table, and the downstream scores' (their tasks known only from the runs).
MARGIN_KEYS = (*dict.fromkeys(m.margin_key for m in TABLE), DOWNSTREAM_PREFIX.rstrip("/"))


def metric(name: str) -> Metric:
    """The record of ``name``: one of :data:`METRICS`, or a downstream score ``downstream/<task>/<score>``.
    Raises KeyError for any other name."""
    if name in METRICS:
        return METRICS[name]
    if is_downstream(name):
        task, score = name.split("/")[1:3]
        return Metric(name, f"{task} {score} (lm-evaluation-harness)", DOWNSTREAM_PREFIX.rstrip("/"),
                      " (accuracy)", "+.4f", "{arm} scores higher", True)
    raise KeyError(name)
