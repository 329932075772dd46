"""What ``qtool eval`` found (:class:`Evaluation`), its gates and its lines for people."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import GateFailed, UsageError
from ..report import Gate, shown
from .metrics import Agreement, Divergence


@dataclass
class Evaluation:
    artifact: str
    format: str
    runtime: str
    reference: str
    encodings: Optional[str]
    causal_lm: bool
    sequences: int
    tokens: Optional[int]  # text inputs' tokens (None for images and other inputs)
    perplexity: Dict[str, float] = field(default_factory=dict)  # float / fake_quant / artifact
    vs_float: Dict[str, Agreement] = field(default_factory=dict)  # fake_quant / artifact
    export_gap: Optional[Agreement] = None  # the artifact against the fake-quant model
    generations: Dict[str, Divergence] = field(default_factory=dict)
    cosine: Dict[str, Dict[str, float]] = field(default_factory=dict)  # not causal LMs: mean / min per pair
    # not causal LMs: |out - ref| / |ref| per sample, mean / max, and pooled sqrt(Σ|out - ref|² / Σ|ref|²), per pair
    relative_error: Dict[str, Dict[str, float]] = field(default_factory=dict)
    top1: Dict[str, float] = field(default_factory=dict)  # classifiers
    export_fault: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    tasks: Optional[Dict[str, Any]] = None

    @property
    def perplexity_increase_pct(self) -> Optional[float]:
        if "artifact" not in self.perplexity:
            return None
        return 100.0 * (self.perplexity["artifact"] / self.perplexity["float"] - 1.0)

    def output_gap(self, pair: str) -> float:
        """How far apart a pair's outputs are, for models that are not causal LMs: ``1 - cosine``, or half the
        pooled squared relative error where that is larger (outputs that differ by a scale or an offset as a whole,
        which the cosine cannot see; for small errors of no common direction the two agree)."""
        pooled = self.relative_error[pair]["pooled"]
        return max(1.0 - self.cosine[pair]["mean"], 0.5 * pooled * pooled if pooled == pooled else 0.0)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "artifact": self.artifact, "format": self.format, "runtime": self.runtime, "reference": self.reference,
            "encodings": self.encodings, "causal_lm": self.causal_lm, "sequences": self.sequences,
            "tokens": self.tokens}
        if self.causal_lm:
            # (every model's key, null where it was not run: no encodings, no fake-quant model)
            out["perplexity"] = {k: self.perplexity.get(k) for k in ("float", "fake_quant", "artifact")}
            out["perplexity_increase_pct"] = self.perplexity_increase_pct
            out["vs_float"] = {k: self.vs_float[k].to_json() if k in self.vs_float else None
                               for k in ("fake_quant", "artifact")}
            out["export_gap"] = self.export_gap.to_json() if self.export_gap else None
            out["generations"] = {k: self.generations[k].to_json() if k in self.generations else None
                                  for k in ("fake_quant", "artifact")} if self.generations else {}
        else:
            out["cosine"] = {k: self.cosine.get(k) for k in ("fake_quant", "artifact", "export_gap")}
            out["relative_error"] = {k: self.relative_error.get(k) for k in ("fake_quant", "artifact", "export_gap")}
            if self.top1:
                out["top1_agreement"] = {k: self.top1.get(k) for k in ("fake_quant", "artifact", "export_gap")}
        out["export_fault"] = self.export_fault
        if self.tasks is not None:
            out["tasks"] = self.tasks
        out["notes"] = list(self.notes)
        return out


def check_gates(ev: Evaluation, max_ppl_increase: Optional[float] = None, max_kl: Optional[float] = None,
                min_agreement: Optional[float] = None, max_export_gap: Optional[float] = None,
                min_cosine: Optional[float] = None) -> List[Gate]:
    """The gates that are set; ``UsageError`` for one that cannot apply to this model."""
    gates = []
    set_gates = {k for k, v in {"max-ppl-increase": max_ppl_increase, "max-kl": max_kl, "min-agreement": min_agreement,
                                "min-cosine": min_cosine, "max-export-gap": max_export_gap}.items() if v is not None}
    check_gate_use(set_gates, ev.causal_lm, ev.encodings is not None)
    if max_ppl_increase is not None:
        v = ev.perplexity_increase_pct
        gates.append(Gate("max-ppl-increase", max_ppl_increase, v, v <= max_ppl_increase,
                          f"perplexity {shown(v, max_ppl_increase, '+.2f')}%"))
    if max_kl is not None:
        v = ev.vs_float["artifact"].kl_mean
        gates.append(Gate("max-kl", max_kl, v, v <= max_kl, f"mean KL from float {shown(v, max_kl, '.4g')}"))
    if min_agreement is not None:
        v = ev.vs_float["artifact"].top1
        gates.append(Gate("min-agreement", min_agreement, v, v >= min_agreement,
                          f"top-1 agreement {shown(v, min_agreement, '.4f')}"))
    if min_cosine is not None:
        v = ev.cosine["artifact"]["mean"]
        gates.append(Gate("min-cosine", min_cosine, v, v >= min_cosine, f"cosine {shown(v, min_cosine, '.5f')}"))
    if max_export_gap is not None:
        v = ev.export_gap.kl_mean if ev.causal_lm else ev.output_gap("export_gap")
        gates.append(Gate("max-export-gap", max_export_gap, v, v <= max_export_gap,
                          f"export gap {shown(v, max_export_gap, '.4g')}"))
    return gates


def check_gate_use(gates, causal_lm: bool, has_encodings: bool) -> None:
    """``UsageError`` for a gate (named without its dashes) that cannot apply to this model: checked once the
    reference is loaded, before any model runs, and again by :func:`check_gates`."""
    lm_only = [g for g in ("max-ppl-increase", "max-kl", "min-agreement") if g in gates]
    if not causal_lm and lm_only:
        raise UsageError(f"--{lm_only[0]} needs a causal LM; use --min-cosine for this model")
    if causal_lm and "min-cosine" in gates:
        raise UsageError("--min-cosine is for models that are not causal LMs; use --max-kl / --min-agreement")
    if "max-export-gap" in gates and not has_encodings:
        raise UsageError("--max-export-gap compares the artifact with the fake-quant model: pass --encodings")


def enforce(ev: Evaluation, gates: List[Gate], export_gap_gate: bool) -> None:
    """``GateFailed`` (exit 1) naming every failed gate and an export fault (unless ``--max-export-gap`` set its
    own threshold, which then decides)."""
    lines = [g.line() for g in gates if not g.passed]
    if ev.export_fault and not export_gap_gate:
        lines.insert(0, f"export fault: {ev.export_fault}")
    if lines:
        raise GateFailed("\n".join(lines))


def describe(ev: Evaluation) -> List[str]:
    """Plain lines for people (the CLI draws them)."""
    lines = [f"{ev.format} artifact run by {ev.runtime}, against {ev.reference}"]
    if ev.causal_lm:
        p = ev.perplexity
        fq = f", fake-quant {p['fake_quant']:.3f}" if "fake_quant" in p else ""
        lines.append(f"perplexity on {ev.tokens} held-out tokens ({ev.sequences} windows): float {p['float']:.3f}"
                     f"{fq}, artifact {p['artifact']:.3f} ({ev.perplexity_increase_pct:+.2f} %)")
        for name, a in ev.vs_float.items():
            lines.append(f"{name.replace('_', '-')} vs float: KL mean {a.kl_mean:.4g}, p99 {a.kl_p99:.4g}, "
                         f"top-1 agreement {a.top1:.3f}")
        if ev.export_gap is not None:
            g = ev.export_gap
            lines.append(f"export gap (artifact vs fake-quant): KL mean {g.kl_mean:.4g}, p99 {g.kl_p99:.4g}, "
                         f"top-1 agreement {g.top1:.3f}")
        for name, d in ev.generations.items():
            lines.append(f"{name.replace('_', '-')} greedy continuations: first leave float's at token {d.mean:.1f} "
                         f"on average (worst {d.worst}, {d.identical}/{d.prompts} identical for {d.tokens} tokens)")
        for task, metrics in (ev.tasks or {}).items():
            lines.append(f"task {task}: " + "; ".join(
                f"{m} float {v.get('float', float('nan')):.4f}, artifact {v.get('artifact', float('nan')):.4f}"
                for m, v in metrics.items()))
    else:
        for name, c in ev.cosine.items():
            top = f", top-1 agreement {ev.top1[name]:.3f}" if name in ev.top1 else ""
            label = {"fake_quant": "fake-quant vs float", "artifact": "artifact vs float",
                     "export_gap": "artifact vs fake-quant"}[name]
            rel = ev.relative_error.get(name)
            err = f", relative error mean {rel['mean']:.3g}, max {rel['max']:.3g}" if rel else ""
            lines.append(f"{label}: output cosine mean {c['mean']:.5f}, min {c['min']:.5f}{err}{top}")
    return lines
