"""Prometheus text exposition (format 0.0.4) for ``GET /metrics``.

Values are read from the live objects at scrape time — the node, its shard
server and engine, the head, the relay links — rather than mirrored into a
registry on every event, so the hot path does no metrics work beyond the few
counters those objects keep anyway.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass
class Family:
    """One metric family: a name, a type, help text and its labelled samples."""

    name: str
    kind: str  # "counter" or "gauge"
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.kind not in ("counter", "gauge"):
            raise ValueError(f"bad metric {self.name!r} ({self.kind})")

    def add(self, value: float, labels: Mapping[str, str] | None = None) -> Family:
        labels = dict(labels or {})
        for key in labels:
            if not _LABEL.match(key):
                raise ValueError(f"bad label name {key!r}")
        self.samples.append((labels, float(value)))
        return self


def counter(name: str, help: str, value: float | None = None) -> Family:
    family = Family(name, "counter", help)
    return family if value is None else family.add(value)


def gauge(name: str, help: str, value: float | None = None) -> Family:
    family = Family(name, "gauge", help)
    return family if value is None else family.add(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def render(families: Iterable[Family]) -> str:
    lines: list[str] = []
    seen: set[str] = set()
    for family in families:
        if family.name in seen:
            raise ValueError(f"metric {family.name} rendered twice")
        seen.add(family.name)
        lines.append(f"# HELP {family.name} {family.help.replace(chr(10), ' ')}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for labels, value in family.samples:
            label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items()))
            suffix = f"{{{label_text}}}" if label_text else ""
            lines.append(f"{family.name}{suffix} {_format_value(value)}")
    return "\n".join(lines) + "\n"
