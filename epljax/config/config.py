"""``epl.Config``: defaults, then ``EPL_<SECTION>_<KEY>`` environment variables, then the dict.

>>> import epljax as epl
>>> config = epl.Config({"pipeline.num_micro_batch": 4, "amp": {"level": "O1"}})
>>> config.pipeline.num_micro_batch, config.amp.level, config.pipeline.strategy
(4, 'O1', 'PreferBackward')
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping
from typing import Any

from epljax.config.schema import SECTIONS
from epljax.errors import ConfigError

_ENV_PREFIX = "EPL_"
_DYNAMIC = "dynamic"


def _fields(section: str) -> dict[str, dataclasses.Field]:
  return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def all_keys() -> list[str]:
  """Every config key as ``section.key``, in schema order."""
  return [f"{s}.{k}" for s in SECTIONS for k in _fields(s)]


def _unknown_key(name: str, where: str) -> ConfigError:
  close = difflib.get_close_matches(name, all_keys(), n=1, cutoff=0.6)
  hint = f" Did you mean '{close[0]}'?" if close else ""
  section = name.split(".", 1)[0]
  if name in SECTIONS:
    allowed = ", ".join(f"'{name}.{k}'" for k in _fields(name))
    return ConfigError(f"'{name}' ({where}) is a section, not a key: set one of its keys, for "
                       f"example {{'{name}.{next(iter(_fields(name)))}': ...}}. Keys of section "
                       f"'{name}': {allowed}.")
  if section in SECTIONS:
    allowed = ", ".join(f"'{section}.{k}'" for k in _fields(section))
    listing = f"Keys of section '{section}': {allowed}."
  else:
    listing = f"Sections: {', '.join(SECTIONS)}."
  return ConfigError(f"Unknown config key '{name}' ({where}).{hint} {listing}")


def _type_name(hint: Any) -> str:
  names = {bool: "a bool (True/False)", int: "an integer", str: "a string", float: "a number",
           type(None): "None"}
  args = typing.get_args(hint) or (hint,)
  return " or ".join(names[a] for a in args)


def _check_value(name: str, field: dataclasses.Field, hint: Any, value: Any, where: str) -> Any:
  """Returns ``value`` if it has the field's type and is allowed, else raises."""
  accepted = typing.get_args(hint) or (hint,)
  ok = any(
      (isinstance(value, a) and not (a is int and isinstance(value, bool))
       and not (a is float and isinstance(value, bool)))
      or (a is type(None) and value is None)
      for a in accepted)
  if not ok:
    raise ConfigError(f"Config key '{name}' ({where}) expects {_type_name(hint)}, got "
                      f"{value!r} ({type(value).__name__}).")
  allowed, minimum = field.metadata["allowed"], field.metadata["minimum"]
  if allowed is not None and value not in allowed:
    raise ConfigError(f"Config key '{name}' ({where}) must be one of "
                      f"{', '.join(repr(a) for a in allowed)}; got {value!r}.")
  if minimum is not None and isinstance(value, int) and value < minimum:
    raise ConfigError(f"Config key '{name}' ({where}) must be >= {minimum}; got {value!r}.")
  if name == "zero.shard_size" and (
      value not in ("all", "host") if isinstance(value, str) else value < 1):
    raise ConfigError(f"Config key 'zero.shard_size' ({where}) must be 'all', 'host' or a "
                      f"positive number of data replicas per ZeRO group; got {value!r}.")
  if name == "amp.loss_scale":
    if isinstance(value, str) and value != _DYNAMIC:
      raise ConfigError(f"Config key 'amp.loss_scale' ({where}) must be 'dynamic' or a "
                        f"positive number; got {value!r}.")
    if not isinstance(value, str) and not value > 0:
      raise ConfigError(f"Config key 'amp.loss_scale' ({where}) must be 'dynamic' or a "
                        f"positive number; got {value!r}.")
  return value


def _parse_env(name: str, hint: Any, text: str, var: str) -> Any:
  """Turns an environment variable's text into a value of the field's type."""
  accepted = typing.get_args(hint) or (hint,)
  lowered = text.strip().lower()
  if type(None) in accepted and lowered in ("", "none"):
    return None
  if bool in accepted:
    if lowered in ("true", "false"):
      return lowered == "true"
    raise ConfigError(f"Environment variable {var}={text!r} for '{name}' must be 'true' or "
                      "'false'.")
  if int in accepted:
    try:
      return int(text)
    except ValueError:
      if float in accepted:
        try:
          return float(text)
        except ValueError:
          pass
      if str not in accepted:
        raise ConfigError(f"Environment variable {var}={text!r} for '{name}' must be "
                          f"{_type_name(hint)}.") from None
  return text


def _env_overrides(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
  """``EPL_<SECTION>_<KEY>`` variables of known sections -> {key: (value, variable name)}."""
  # Longest section names first, so EPL_GRADIENT_CHECKPOINT_TYPE is not read as a 'gradient'
  # section. Variables of no known section (the launcher's own) are left alone.
  sections = sorted(SECTIONS, key=len, reverse=True)
  found = {}
  for var, text in environ.items():
    if not var.startswith(_ENV_PREFIX):
      continue
    rest = var[len(_ENV_PREFIX):].lower()
    section = next((s for s in sections if rest.startswith(s + "_")), None)
    if section is None:
      continue
    name = f"{section}.{rest[len(section) + 1:]}"
    fields = _fields(section)
    field = fields.get(name.split(".", 1)[1])
    if field is None:
      raise _unknown_key(name, f"from environment variable {var}")
    hint = typing.get_type_hints(SECTIONS[section])[field.name]
    found[name] = (_parse_env(name, hint, text, var), f"environment variable {var}")
  return found


def _flatten(param_dict: Mapping[str, Any]) -> dict[str, Any]:
  """Accepts ``{"pipeline.num_micro_batch": 4}`` and ``{"pipeline": {"num_micro_batch": 4}}``."""
  if not isinstance(param_dict, Mapping):
    raise ConfigError(f"Config(param_dict) expects a dict like {{'pipeline.num_micro_batch': 4}}"
                      f", got {type(param_dict).__name__}.")
  flat = {}
  for name, value in param_dict.items():
    if not isinstance(name, str):
      raise ConfigError(f"Config keys are strings like 'pipeline.num_micro_batch'; got {name!r}.")
    if "." not in name and name in SECTIONS and isinstance(value, Mapping):
      for sub, v in value.items():
        flat[f"{name}.{sub}"] = v
    else:
      flat[name] = value
  return flat


class Config:
  """All of EPL's configuration, grouped by section: ``config.pipeline.num_micro_batch``.

  Values come from the defaults, then from ``EPL_<SECTION>_<KEY>`` environment variables
  (``EPL_PIPELINE_NUM_MICRO_BATCH=4``; booleans as ``true``/``false``), then from
  ``param_dict``, which wins. A key that does not exist, a value of the wrong type or a value
  outside the allowed set raises ``ValueError`` (``epl.EPLError``) naming the key and what is
  allowed. A Config is immutable: ``config.replace({...})`` returns a changed copy.
  """

  pipeline: Any
  gradient_checkpoint: Any
  zero: Any
  offload: Any
  amp: Any
  optimizer: Any
  cluster: Any
  communication: Any
  io: Any
  auto: Any
  context: Any

  def __init__(self, param_dict: Mapping[str, Any] | None = None, *,
               environ: Mapping[str, str] | None = None):
    values = {name: (value, where) for name, (value, where) in
              _env_overrides(os.environ if environ is None else environ).items()}
    for name, value in _flatten(param_dict or {}).items():
      values[name] = (value, "from param_dict")
    self._build(values, base=None)

  def _build(self, values: dict[str, tuple[Any, str]], base: Config | None) -> None:
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, (value, where) in values.items():
      section, _, attr = name.partition(".")
      field = _fields(section).get(attr) if section in SECTIONS else None
      if field is None:
        raise _unknown_key(name, where)
      hint = typing.get_type_hints(SECTIONS[section])[attr]
      per_section[section][attr] = _check_value(name, field, hint, value, where)
    for section, cls in SECTIONS.items():
      start = getattr(base, section) if base is not None else cls()
      object.__setattr__(self, section, dataclasses.replace(start, **per_section[section]))

  def replace(self, param_dict: Mapping[str, Any]) -> Config:
    """A copy with the keys of ``param_dict`` changed (the environment is not read again)."""
    new = object.__new__(Config)
    new._build({n: (v, "from replace()") for n, v in _flatten(param_dict).items()}, base=self)
    return new

  def to_dict(self) -> dict[str, Any]:
    """Every key as ``{"section.key": value}``."""
    return {f"{s}.{k}": getattr(getattr(self, s), k) for s in SECTIONS for k in _fields(s)}

  def changed(self) -> dict[str, Any]:
    """The keys whose value differs from EPL's default."""
    defaults = object.__new__(Config)
    defaults._build({}, base=None)
    ref = defaults.to_dict()
    return {k: v for k, v in self.to_dict().items() if v != ref[k]}

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(f"Config is immutable; use config.replace({{'{name}...': value}}) "
                         "or build a new epl.Config({...}).")

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Config) and self.to_dict() == other.to_dict()

  def __hash__(self) -> int:
    return hash(tuple(sorted((k, repr(v)) for k, v in self.to_dict().items())))

  def __repr__(self) -> str:
    changed = ", ".join(f"'{k}': {v!r}" for k, v in self.changed().items())
    return f"Config({{{changed}}})"


def describe() -> str:
  """A table of every key, its type, default and meaning (``python -m epljax.config``)."""
  rows = []
  for section, cls in SECTIONS.items():
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      allowed = f.metadata["allowed"]
      kind = " | ".join(repr(a) for a in allowed) if allowed else _type_name(hints[f.name])
      rows.append((f"{section}.{f.name}", kind, repr(f.default), f.metadata["doc"]))
  width = [max(len(r[i]) for r in rows) for i in range(3)]
  return "\n".join(f"{a:<{width[0]}}  {b:<{width[1]}}  {c:<{width[2]}}  {d}" for a, b, c, d in rows)
