"""The README's tables of settings, rendered from their declarations in common/settings.py:
`python -m common.settings_table` rewrites them between their markers."""

from __future__ import annotations

import sys
from pathlib import Path

from common.settings import CONCERNS, SERVICES, ObserveSettings, own_fields

# Read by the OpenTelemetry exporter itself (common/tracing.py), not a field: shown in the table all the same.
OTEL_ROW = ("OTEL_EXPORTER_OTLP_ENDPOINT", "(empty)", "where every service exports its OpenTelemetry spans (OTLP over "
            "HTTP, e.g. `http://collector:4318`); empty: no tracing. Needs the `otel` extra (a service started without "
            "it fails at start, naming it); the SDK's other `OTEL_*` variables apply")
README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- settings:begin (python -m common.settings_table) -->", "<!-- settings:end -->"


def markdown() -> str:
    """The README's tables of settings: one per concern, the services that read it, and each variable with its
    default and meaning."""
    parts = []
    for concern in CONCERNS:
        readers = [service for service, settings in SERVICES.items() if issubclass(settings, concern)]
        parts += [f"**{concern.title}** (read by {', '.join(readers) or 'the launcher'})", "",
                  "| variable | default | meaning |", "|---|---|---|"]
        for declared in own_fields(concern):
            meta = declared.metadata
            default = meta["shown"] or (f"`{declared.default}`" if declared.default != "" else "(empty)")
            parts.append(f"| `{declared.name.upper()}` | {default} | {meta['doc']} |")
        if concern is ObserveSettings:
            parts.append("| `{}` | {} | {} |".format(*OTEL_ROW))
        parts.append("")
    return "\n".join(parts)


def readme_block(readme: str) -> str:
    return readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)].strip("\n")


if __name__ == "__main__":
    text = README.read_text()
    begin, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(f"{text[:begin]}\n{markdown().strip()}\n{text[end:]}")
    sys.stdout.write(f"{README}: settings tables written\n")
