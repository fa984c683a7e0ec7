"""Reads a page as a browser styles it, enough for the report's own CSS: the rules of its <style>,
and each element with its ancestors, so a test can ask which colour an element is drawn in
(simple selectors: tag, classes, descendants; the most specific rule wins, then the later one)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

VOID = {"meta", "br", "img", "input", "hr", "link"}
DRAWN = {"rect", "polyline", "line", "path", "circle"}


@dataclass
class Element:
    tag: str
    classes: set
    attrs: dict
    ancestors: list  # Elements, nearest first
    section: str | None
    text: list = field(default_factory=list)


class StyledPage(HTMLParser):
    def __init__(self, html: str):
        super().__init__()
        self.rules, self.elements, self.open, self.style = [], [], [], []
        self.feed(html)
        for order, (selectors, body) in enumerate(re.findall(r"([^{}]+)\{([^{}]*)\}", "".join(self.style))):
            declarations = dict((k.strip(), v.strip()) for k, _, v in
                                (d.partition(":") for d in body.split(";") if ":" in d))
            for selector in selectors.split(","):
                self.rules.append((selector.split(), declarations, order))

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        section = next((e.attrs.get("id") for e in reversed(self.open) if e.tag == "section"), None)
        element = Element(tag, set((attrs.get("class") or "").split()), attrs, self.open[::-1], section)
        self.elements.append(element)
        if tag not in VOID:
            self.open.append(element)

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop().tag == tag:
                break

    def handle_data(self, data):
        if self.open and self.open[-1].tag == "style":
            self.style.append(data)
        for e in self.open:
            e.text.append(data)

    def find(self, tag: str | None = None, cls: str | None = None, section: str | None = None) -> list[Element]:
        return [e for e in self.elements if (tag is None or e.tag == tag) and (cls is None or cls in e.classes)
                and (section is None or e.section == section)]

    def style_of(self, element: Element, prop: str, inherited: bool = False) -> str | None:
        """The value the page's CSS gives `prop` on `element`; `inherited`: else its nearest ancestor's."""
        if inherited:
            return next(filter(None, (self.style_of(e, prop) for e in [element, *element.ancestors])), None)
        best = None
        for compounds, declarations, order in self.rules:
            if prop in declarations and matches(compounds, element):
                rank = (sum(c.count(".") for c in compounds), sum(not c.startswith(".") for c in compounds), order)
                if best is None or rank >= best[0]:
                    best = (rank, declarations[prop])
        return best and best[1]


def compound_matches(compound: str, tag: str, classes: set) -> bool:
    if not re.fullmatch(r"[a-z0-9]*(\.[\w-]+)*", compound):
        return False  # pseudo-classes, attributes, child combinators: none styles the report's colours
    name, *needed = compound.split(".")
    return (not name or name == tag) and set(needed) <= classes


def matches(compounds: list[str], element: Element) -> bool:
    if not compounds or not compound_matches(compounds[-1], element.tag, element.classes):
        return False
    ancestors = iter(element.ancestors)
    return all(any(compound_matches(c, a.tag, a.classes) for a in ancestors) for c in reversed(compounds[:-1]))


def reddish(colour: str | None) -> bool:
    """#rgb or #rrggbb where red clearly dominates."""
    if not colour or not colour.startswith("#"):
        return False
    digits = colour[1:]
    r, g, b = (int(digits[i] * 2, 16) for i in range(3)) if len(digits) == 3 else \
        (int(digits[i:i + 2], 16) for i in (0, 2, 4))
    return r > 1.6 * g and r > 1.6 * b
