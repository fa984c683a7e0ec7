"""The page: a title, a table of contents, the sections, and the CSS, in one file that loads nothing."""
from __future__ import annotations

import re
from html import escape

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1040px; padding: 0 16px; }
body { color: #1d2330; }
h1 { font-size: 22px; margin-bottom: 4px; } .sub { color: #556; margin-top: 0; } nav a { margin-right: 12px; }
h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ccd; } h3 { font-size: 15px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; } th { background: #eef0f5; }
td, th { border: 1px solid #dde; padding: 3px 6px; vertical-align: top; text-align: left; }
td.num { text-align: right; white-space: nowrap; } td.bottleneck { color: #b32; }
tr.unchanged td { color: #778; } tr.nofit td { color: #933; background: #fdf1f1; }
tr.best td { background: #eaf7ea; font-weight: 600; }
ul.notes { margin: 0; padding-left: 16px; }
pre { background: #f5f6f9; padding: 8px; white-space: pre-wrap; font-size: 12px; }
svg.chart { display: block; margin: 8px 0; background: #fff; }
svg text { font: 11px system-ui, sans-serif; fill: #334; } svg text.label { font-size: 12px; fill: #223; }
svg text.vertical { writing-mode: vertical-rl; transform-box: fill-box; transform-origin: center; rotate: 180deg; }
svg text.inbar { fill: #fff; font-size: 10px; } svg text.note { font-size: 11px; fill: #556; }
svg text.measured { fill: #a45f00; } svg text.predicted { fill: #2a62c9; }
.axis { stroke: #556; } .grid { stroke: #e3e5ea; } .lane { fill: #f6f7fa; } .phase { fill: #f1f3f8; }
.line { fill: none; stroke-width: 2; } .line.memory { stroke: #2a62c9; } .line.loss { stroke: #7a3fb8; }
.mark { stroke-width: 1.5; stroke-dasharray: 6 4; }
.line.run0 { stroke: #7a3fb8; } .key.run0 { background: #7a3fb8; }
.line.run1 { stroke: #2a62c9; } .key.run1 { background: #2a62c9; }
.line.run2 { stroke: #2a9d6f; } .key.run2 { background: #2a9d6f; }
.line.run3 { stroke: #d07a00; } .key.run3 { background: #d07a00; }
.line.run4 { stroke: #d63a2f; } .key.run4 { background: #d63a2f; }
.line.run5 { stroke: #176b49; } .key.run5 { background: #176b49; }
.line.run6 { stroke: #c2409a; } .key.run6 { background: #c2409a; }
.line.run7 { stroke: #556070; } .key.run7 { background: #556070; }
.line.run8 { stroke: #8a6d00; } .key.run8 { background: #8a6d00; }
.line.run9 { stroke: #00838f; } .key.run9 { background: #00838f; }
.line.run10 { stroke: #9e9e2e; } .key.run10 { background: #9e9e2e; }
.line.run11 { stroke: #e07050; } .key.run11 { background: #e07050; }
.mark.predicted { stroke: #2a62c9; } .mark.measured { stroke: #d07a00; }
.compute, .forward { fill: #2a62c9; } .backward { fill: #6b93de; }
.comm, .fits { fill: #2a9d6f; } .best { fill: #176b49; }
.exposed, .nofit { fill: #d63a2f; } .bubble { fill: #c9ccd3; }
.legend { font-size: 12px; color: #445; }
.key { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 10px; vertical-align: -1px; }
.key.memory, .key.predicted, .key.compute, .key.forward { background: #2a62c9; } .key.backward { background: #6b93de; }
.key.comm, .key.fits { background: #2a9d6f; } .key.best { background: #176b49; } .key.measured { background: #d07a00; }
.key.exposed, .key.nofit { background: #d63a2f; } .key.bubble { background: #c9ccd3; }
"""


def page(title: str, subtitle: str, sections: list[str]) -> str:
    shown = [s for s in sections if s]
    links = " ".join(f'<a href="#{anchor}">{heading}</a>'
                     for anchor, heading in (re.match(r'<section id="([^"]+)"><h2>([^<]*)</h2>', s).groups()
                                             for s in shown))
    empty = "" if shown else "<p>Nothing to show: no pass ran, and no plan, memory, timeline or loss was given.</p>"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1><p class=\"sub\">{escape(subtitle)}</p>"
            f"<nav>{links}</nav>{''.join(shown)}{empty}</body></html>\n")
