"""A registered pass's options as plain data, read from its dataclass fields (name, type, default),
and a value given as text (a command line) turned into the field's type."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from picofx.manager.passes import PASSES

TEXT_KINDS = ("None", "bool", "int", "float", "str", "tuple", "dict")  # the types text can give
TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclass(frozen=True)
class PassOption:
    pass_name: str
    name: str
    type: str       # as the field declares it: "int | str | float | None"
    default: object

    @property
    def kinds(self) -> tuple[str, ...]:
        declared = [part.strip() for part in self.type.split("|")]
        return tuple(kind for kind in TEXT_KINDS if kind in declared)

    @property
    def from_text(self) -> bool:
        """Whether a command line can give it (not a process group or an optimizer object)."""
        return any(kind != "None" for kind in self.kinds)

    def parse(self, text: str):
        """The value `text` stands for; ValueError saying what the option takes."""
        kinds = self.kinds
        if "None" in kinds and text.lower() == "none":
            return None
        if "bool" in kinds and text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        for kind, convert in (("int", int), ("float", float)):
            if kind in kinds:
                try:
                    return convert(text)
                except ValueError:
                    pass
        if "tuple" in kinds and ("," in text or "str" not in kinds):
            return tuple(item.strip() for item in text.split(",") if item.strip())
        if "dict" in kinds and "=" in text:
            pairs = [item.partition("=") for item in text.split(",") if item.strip()]
            if all(sep for _, sep, _ in pairs):
                return {key.strip(): value.strip() for key, _, value in pairs}
        if "str" in kinds:
            return text
        raise ValueError(f"{self.pass_name}.{self.name} takes {self.describe()}, not {text!r}")

    def describe(self) -> str:
        words = {"None": "none", "bool": "true/false", "int": "an integer", "float": "a number", "str": "text",
                 "tuple": "a comma-separated list", "dict": "key=value,key=value"}
        return " or ".join(words[kind] for kind in self.kinds)


def pass_options(name: str) -> list[PassOption]:
    """Every option of the registered pass `name` (none for a pass that is a plain function)."""
    factory = PASSES[name]
    if not dataclasses.is_dataclass(factory):
        return []
    options = []
    for f in dataclasses.fields(factory):
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        declared = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        options.append(PassOption(name, f.name, declared, default))
    return options
