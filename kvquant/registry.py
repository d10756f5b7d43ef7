"""Name -> class registries for kvquant's pluggable parts (quantizers, eviction policies), lm-eval style: a class
decorator registers, lookups and option errors name the valid choices. A registered class is a dataclass whose
fields are its options."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvquant.errors import KVQuantError


class Registry:
    """Classes of one ``kind`` (e.g. ``"quantizer"``) by name; ``check(name, cls)`` vets a class as it registers."""

    def __init__(self, kind: str, check: Callable[[str, type], None] = lambda name, cls: None):
        self.kind, self.check, self.classes = kind, check, {}

    def register(self, name: str):
        """Class decorator: make the class available under ``name`` (and set its ``name``)."""

        def wrap(cls):
            if name in self.classes:
                raise KVQuantError(f"{self.kind} {name!r} is already registered")
            self.check(name, cls)
            cls.name = name
            self.classes[name] = cls
            return cls

        return wrap

    def names(self) -> list[str]:
        return sorted(self.classes)

    def get(self, name: str) -> type:
        if not isinstance(name, str) or name not in self.classes:
            raise KVQuantError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}")
        return self.classes[name]

    def options(self, name: str) -> dict[str, object]:
        """The options of ``name`` with their defaults (``dataclasses.MISSING`` for a required one)."""
        return {f.name: f.default for f in dataclasses.fields(self.get(name))}

    def check_options(self, name: str, options, also: tuple[str, ...] = ()) -> None:
        """Refuse an option ``name`` does not have (``also``: other options the caller accepts beside them)."""
        valid = self.options(name)
        unknown = sorted(set(options) - set(valid) - set(also))
        if unknown:
            theirs = f"; the cache's: {', '.join(also)}" if also else ""
            raise KVQuantError(f"{self.kind} {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                               f"{', '.join(sorted(valid)) or 'none'}{theirs}")

    def build(self, name: str, **options):
        """An instance of ``name`` with ``options``; unknown or missing options are errors naming the valid ones."""
        self.check_options(name, options)
        missing = [k for k, v in self.options(name).items() if v is dataclasses.MISSING and k not in options]
        if missing:
            raise KVQuantError(f"{self.kind} {name!r} needs {', '.join(missing)}")
        return self.get(name)(**options)
