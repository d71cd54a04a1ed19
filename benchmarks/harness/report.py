"""Result rows, the markdown table and the JSON file of one run."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.timing import Stat


class SectionSkipped(Exception):
    """A section that cannot run here for a real missing resource (e.g. no CUDA device)."""


@dataclass
class Target:
    """A goal from the issue: on the ours/peer ratio, or on our own value."""

    op: str  # ">=" or "<"
    threshold: float
    on: str = "ratio"  # "ratio" or "value"
    text: str = ""  # as the issue states it, e.g. ">= 1.5x transformers"

    def met(self, ratio: float | None, value: float) -> bool | None:
        x = ratio if self.on == "ratio" else value
        if x is None or math.isnan(x):
            return None
        return x >= self.threshold if self.op == ">=" else x < self.threshold

    def to_dict(self) -> dict:
        return {"op": self.op, "threshold": self.threshold, "on": self.on, "text": self.text}


@dataclass
class Row:
    section: str
    workload: str
    metric: str  # e.g. "tokens/s"
    ours: Stat
    higher_is_better: bool = True
    peer: str | None = None  # what we compare with, e.g. "transformers generate()"
    peer_value: Stat | None = None
    target: Target | None = None
    check: str = ""  # outcome of a correctness check made on the same outputs, if any
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.peer_value is None or self.peer_value.median == 0:
            return None
        return self.ours.median / self.peer_value.median

    @property
    def target_met(self) -> bool | None:
        return self.target.met(self.ratio, self.ours.median) if self.target else None

    def to_dict(self) -> dict:
        return {
            "section": self.section, "workload": self.workload, "metric": self.metric,
            "higher_is_better": self.higher_is_better,
            "ours": self.ours.to_dict(), "peer": self.peer,
            "peer_value": self.peer_value.to_dict() if self.peer_value else None,
            "ratio": self.ratio, "target": self.target.to_dict() if self.target else None,
            "target_met": self.target_met, "check": self.check, "note": self.note,
        }


@dataclass
class RunReport:
    machine: dict
    config: dict
    rows: list[Row] = field(default_factory=list)
    sections: dict[str, dict] = field(default_factory=dict)  # per section: status, seconds, load, notes

    def to_dict(self) -> dict:
        return {"machine": self.machine, "config": self.config, "sections": self.sections,
                "rows": [r.to_dict() for r in self.rows]}

    def write_json(self, directory: Path, stamp: str) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"bench-{stamp}.json"
        text = json.dumps(self.to_dict(), indent=2, default=str) + "\n"
        path.write_text(text)
        (directory / "latest.json").write_text(text)
        return path


def fmt(x: float) -> str:
    """Three significant digits, no scientific notation for the usual ranges."""
    if x == 0 or math.isnan(x):
        return f"{x:g}"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{digits}f}"


def fmt_stat(s: Stat | None) -> str:
    if s is None:
        return ""
    if s.n == 1 or s.min == s.max:
        return fmt(s.median)
    return f"{fmt(s.median)} ({fmt(s.min)}–{fmt(s.max)})"


def markdown_table(rows: list[Row]) -> str:
    head = ["section", "workload", "metric", "ours", "peer", "peer value", "ours/peer", "target", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        arrow = "↑" if r.higher_is_better else "↓"
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else ""
        target = ""
        if r.target is not None:
            met = r.target_met
            target = f"{r.target.text} {'✅' if met else '❌' if met is False else ''}".strip()
        cells = [r.section, r.workload, f"{r.metric} {arrow}", fmt_stat(r.ours), r.peer or "",
                 fmt_stat(r.peer_value), ratio, target, r.check]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def say(message: str) -> None:
    """Progress on stderr, so stdout carries only the final table."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def loud(message: str) -> None:
    """A failed correctness check: impossible to miss in a long log."""
    bar = "!" * 78
    print(f"\n{bar}\n!!! {message}\n{bar}\n", file=sys.stderr, flush=True)
