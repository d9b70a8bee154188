"""The base of vime's config tree: strict sections, YAML with dotted overrides, errors per field.

Every section is a `StrictModel` (unknown keys are errors, values frozen once checked); every field
has a description; validators say how to fix a bad value. This package imports neither torch nor
any other part of vime, so a login node can load, check and render a job's config cheaply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable once checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {dotted_key!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a raw config tree."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per bad field: its dotted path, what was wrong, and the value given."""
    lines = [f"invalid config {source}:"]
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"]) or "(root)"
        given = error.get("input")
        given_text = "" if isinstance(given, dict) else f" (given: {given!r})"
        lines.append(f"  {path}: {error['msg']}{given_text}")
    return "\n".join(lines)


def load_yaml_tree(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ValueError(f"config file {path}{where}: not valid YAML: {problem}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping at the top level")
        tree = loaded or {}
    return apply_overrides(tree, overrides or [])


def load_config(
    model: type[StrictModel], path: str | Path | None, overrides: list[str] | None = None
) -> Any:
    """Load a config of type `model` from YAML plus overrides; errors name every bad field."""
    tree = load_yaml_tree(path, overrides)
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc, str(path or "<overrides>"))) from None
