"""The page: a title, a table of contents, the sections, and the CSS, in one file that loads nothing."""
from __future__ import annotations

import re
from html import escape

COLOURS = {  # what each class draws in, one colour per meaning: a chart's legend never repeats a colour
    "memory": "#2a62c9", "predicted": "#7a3fb8", "measured": "#d07a00",          # memory over the step
    "compute": "#2a62c9", "comm": "#2a9d6f", "exposed": "#d63a2f",               # compute and communication
    "forward": "#2a62c9", "backward": "#6b93de", "bubble": "#c9ccd3",            # pipeline schedule
    "best": "#176b49", "fits": "#6cc59c", "nofit": "#d63a2f",                    # plans
    "loss": "#7a3fb8",
}
RUNS = ("#7a3fb8", "#2a62c9", "#2a9d6f", "#d07a00", "#d63a2f", "#176b49", "#c2409a", "#556070", "#8a6d00",
        "#00838f", "#9e9e2e", "#e07050")  # one loss line per run (.run0 ...)
TEXT_COLOURS = {"predicted": "#6a2fa8", "measured": "#a45f00"}  # darker, to read as text

BASE_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1040px; padding: 0 16px; }
body { color: #1d2330; }
h1 { font-size: 22px; margin-bottom: 4px; } .sub { color: #556; margin-top: 0; } nav a { margin-right: 12px; }
h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ccd; } h3 { font-size: 15px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; } th { background: #eef0f5; }
td, th { border: 1px solid #dde; padding: 3px 6px; vertical-align: top; text-align: left; }
td.num { text-align: right; white-space: nowrap; } td.quiet, span.quiet { color: #778; }
tr.unchanged td { color: #778; } tr.nofit td { color: #933; background: #fdf1f1; }
td.layout { white-space: nowrap; } td.why { font-size: 12px; min-width: 9em; } td.suggestions { min-width: 15em; }
tr.best td { background: #eaf7ea; } tr.best td.layout { font-weight: 600; }
ul.notes { margin: 0; padding-left: 16px; } details summary { cursor: pointer; color: #445; }
pre { background: #f5f6f9; padding: 8px; white-space: pre-wrap; font-size: 12px; }
svg.chart { display: block; margin: 8px 0; background: #fff; }
svg text { font: 11px system-ui, sans-serif; fill: #334; } svg text.label { font-size: 12px; fill: #223; }
svg text.vertical { writing-mode: vertical-rl; transform-box: fill-box; transform-origin: center; rotate: 180deg; }
svg text.inbar { fill: #fff; font-size: 10px; } svg text.note { font-size: 11px; fill: #556; }
.axis { stroke: #556; } .grid { stroke: #e3e5ea; } .lane { fill: #f6f7fa; } .phase { fill: #f1f3f8; }
.line { fill: none; stroke-width: 2; } .mark { stroke-width: 1.5; stroke-dasharray: 6 4; }
.legend { font-size: 12px; color: #445; }
.key { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 10px; vertical-align: -1px; }
"""


def colour_rules() -> str:
    """Each class's colour as a bar's fill, a line's stroke and a legend key's background."""
    named = {**COLOURS, **{f"run{k}": c for k, c in enumerate(RUNS)}}
    rules = [f"rect.{cls} {{ fill: {c}; }} .line.{cls} {{ stroke: {c}; }} .mark.{cls} {{ stroke: {c}; }} "
             f".key.{cls} {{ background: {c}; }}" for cls, c in named.items()]
    rules += [f"svg text.{cls} {{ fill: {c}; }}" for cls, c in TEXT_COLOURS.items()]
    return "\n".join(rules) + "\n"


CSS = BASE_CSS + colour_rules()


def page(title: str, subtitle: str, sections: list[str]) -> str:
    shown = [s for s in sections if s]
    links = " ".join(f'<a href="#{anchor}">{heading}</a>'
                     for anchor, heading in (re.match(r'<section id="([^"]+)"><h2>([^<]*)</h2>', s).groups()
                                             for s in shown))
    empty = "" if shown else "<p>Nothing to show: no pass ran, and no plan, memory, timeline or loss was given.</p>"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1><p class=\"sub\">{escape(subtitle)}</p>"
            f"<nav>{links}</nav>{''.join(shown)}{empty}</body></html>\n")
