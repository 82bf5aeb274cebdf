"""pydantic's side of the settings: the model that reads the environment and parses or refuses
what ``Settings`` does not take as a plain value, and ``ExtraConfig`` for the engines' extra
configs.

Imported only when it has work to do (``kvledger.config`` says when). The model is built from
``Settings``' own fields and rules, so there is one list of settings; every value it returns is
plain, and ``Settings`` then checks what ties values to the machine or to each other.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, create_model

from kvledger.settings_rules import Rule, SettingsError, env_names, variable_names

# allow_inf_nan=False: a size of inf or nan GB would pass ge=0 (nan compares false) and only
# fail later, as an overflow deep inside a tier. validate_default and arbitrary_types_allowed
# are pydantic-settings' own defaults, so that settings built without the environment
# validate as those built from it.
_CONFIG = ConfigDict(
    extra="forbid",
    populate_by_name=True,
    frozen=True,
    allow_inf_nan=False,
    validate_default=True,
    arbitrary_types_allowed=True,
)


def _rules(settings: type) -> dict[str, Rule]:
    """Each setting of the ``Settings`` dataclass and its ``Rule``."""
    return {f.name: f.metadata["rule"] for f in dataclasses.fields(settings) if f.init}


def _fields(settings: type) -> dict[str, Any]:
    """Each setting as pydantic's (type, ``Field``). A setting with Dynamo's variables reads
    them as well as its own (``KVLEDGER_<NAME>``); the others are found by the prefix."""
    hints = typing.get_type_hints(settings)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        if not f.init:
            continue
        rule: Rule = f.metadata["rule"]
        alias = AliasChoices(*variable_names(f.name, rule)) if rule.aliases else None
        out[f.name] = (
            hints[f.name],
            Field(
                f.default,
                gt=rule.gt,
                ge=rule.ge,
                lt=rule.lt,
                le=rule.le,
                min_length=rule.min_length,
                validation_alias=alias,
                description=rule.description or None,
            ),
        )
    return out


@functools.cache
def model(settings: type, environment: bool) -> type[BaseModel]:
    """``settings`` (the ``Settings`` dataclass) as a pydantic model; with ``environment``, a
    pydantic-settings ``BaseSettings`` that reads the ``KVLEDGER_*`` variables and Dynamo's."""
    if not environment:
        return create_model("Settings", __config__=_CONFIG, **_fields(settings))
    from pydantic_settings import BaseSettings, SettingsConfigDict  # only for the environment

    class EnvironmentSettings(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="KVLEDGER_", **_CONFIG)  # type: ignore[typeddict-item]

    return create_model("Settings", __base__=EnvironmentSettings, **_fields(settings))


def validate(
    settings: type, values: Mapping[str, Any], *, environment: bool
) -> tuple[dict[str, Any], frozenset[str]]:
    """``values`` for ``settings`` (with the environment's under them, with ``environment``)
    parsed: every setting's value, and which were given; ``SettingsError`` with one line per
    bad one."""
    rules = _rules(settings)
    try:
        built = model(settings, environment)(**values)
    except ValidationError as exc:
        raise SettingsError(describe(exc, rules)) from None
    return {name: getattr(built, name) for name in rules}, frozenset(built.model_fields_set)


def describe(exc: ValidationError, rules: Mapping[str, Rule]) -> str:
    """One line per bad setting, naming it and its variables."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        field = loc[0] if loc else ""
        for name, rule in rules.items():
            if field.upper() in variable_names(name, rule):
                field = name
        shown = f"{field} ({env_names(field, rules[field])})" if field in rules else field
        what = f"invalid kvledger setting {shown}" if shown else "invalid kvledger settings"
        lines.append(f"{what}: {_message(err)}{_got(err)}")
    return "\n".join(lines)


_MESSAGES = {
    "int_type": "must be a whole number (a JSON integer)",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "extra_forbidden": "is not a key kvledger reads",
}


def _got(err: Any) -> str:
    """ ", got VALUE" for a report line; nothing for a whole mapping, or where a validator of
    ours made the message (it says what it got, and never a URL's password)."""
    value = err.get("input")
    return "" if isinstance(value, dict) or err["type"] == "value_error" else f", got {value!r}"


def _message(err: Any) -> str:
    """pydantic's message, in the words of a setting (a model validator's "Value error, "
    prefix dropped: the message is ours)."""
    value = err.get("input")
    if err["type"] == "int_type" and isinstance(value, float) and value.is_integer():
        return f"must be a whole number written as one ({int(value)})"
    if err["type"] == "missing":
        return "is required"
    return _MESSAGES.get(err["type"]) or str(err["msg"]).removeprefix("Value error, ")


class ExtraConfig(BaseModel):
    """An engine's extra config for a kvledger integration (vLLM's
    ``kv_connector_extra_config``, SGLang's storage backend extra config), checked the way
    ``Settings`` are: one rule per key, a key kvledger does not read refused (with the closest
    one it does), and a bad value refused rather than coerced (``"8e9"``, ``true`` or ``1.7``
    where a whole number belongs). Keys the engine itself reads (``engine_keys``) pass through.
    Subclasses declare the keys; ``load`` raises ``SettingsError`` with one line per bad key.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    where: ClassVar[str] = "extra config"
    """How the engine names this config, for messages (``kv_connector_extra_config``)."""
    engine_keys: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def load(cls, config: Mapping[str, Any] | None) -> Self:
        values = {k: v for k, v in (config or {}).items() if k not in cls.engine_keys}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise SettingsError(cls._describe(exc)) from None

    @classmethod
    def _describe(cls, exc: ValidationError) -> str:
        known = sorted([*cls.model_fields, *cls.engine_keys])
        lines = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            message = _message(err)
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
                lines.append(f"{cls.where} {key!r} {message}; {hint}")
                continue
            named = f"{cls.where} {key}" if key else cls.where
            lines.append(f"{named}: {message}{_got(err)}")
        return "\n".join(lines)
