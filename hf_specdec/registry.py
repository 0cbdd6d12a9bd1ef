"""A small open registry (name -> class), shared by drafters and γ policies: no central if-chain anywhere."""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Names mapped to subclasses of `base`; each name registered once, unknown names answered with the known ones.

    `kind` names the entries in messages ("drafter"); `argument` is the user-facing argument that takes a name.
    """

    def __init__(self, base: type, kind: str, argument: str, register_with: str):
        self.base, self.kind, self.argument, self.register_with = base, kind, argument, register_with
        self._classes: dict[str, T] = {}

    def register(self, name: str, cls: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"`name` must be a non-empty string, got {name!r}.")
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"`cls` must be a subclass of `{self.base.__module__}.{self.base.__name__}`, got {cls!r}.")
        if name in self._classes:
            known = self._classes[name]
            raise ValueError(
                f"A {self.kind} named {name!r} is already registered ({known.__module__}.{known.__name__}); cannot "
                f"register {cls.__module__}.{cls.__name__} under the same name. Pick another name."
            )
        self._classes[name] = cls
        return cls

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> T:
        try:
            return self._classes[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"Unknown {self.kind} {name!r} for `{self.argument}`. Registered: {self.names()}. "
                f"Register your own with `{self.register_with}(name, cls)`."
            ) from None
