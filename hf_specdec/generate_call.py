"""The arguments of one call to a model class's `generate`, read and changed by name."""

from __future__ import annotations

import inspect


class _BoundCall:
    """The arguments of one call to a `generate` method, read and changed by name whether they were given by
    position or by keyword, and whether that `generate` declares them or takes them through `**kwargs`."""

    def __init__(self, function, args: tuple, kwargs: dict):
        signature = inspect.signature(function)
        self.bound = signature.bind(*args, **kwargs)
        self.declared = {
            name
            for name, parameter in signature.parameters.items()
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        }
        self.function = function
        var_keyword = [
            name for name, parameter in signature.parameters.items() if parameter.kind == parameter.VAR_KEYWORD
        ]
        # the **kwargs, changed in place (a `generate` without them takes no undeclared argument)
        self.extra = self.bound.arguments.setdefault(var_keyword[0], {}) if var_keyword else {}
        self.takes_extra = bool(var_keyword)

    def get(self, name: str, default=None):
        if name in self.declared:
            return self.bound.arguments.get(name, default)
        return self.extra.get(name, default)

    def set(self, name: str, value) -> None:
        if name in self.declared:
            self.bound.arguments[name] = value
        elif self.takes_extra:
            self.extra[name] = value
        else:
            raise TypeError(
                f"{self.function.__qualname__} takes no `{name}` argument, which speculative decoding passes to it; "
                "drop `assistant_model`/`drafter` for this model."
            )

    def pop(self, name: str, default=None):
        if name in self.declared:
            return self.bound.arguments.pop(name, default)
        return self.extra.pop(name, default)

    @property
    def args(self) -> tuple:
        return self.bound.args

    @property
    def kwargs(self) -> dict:
        return self.bound.kwargs
