"""String parameters of a model's ``config.pbtxt``, read and set in its text: the
repository writer, the supervisor (which rewrites the router's engine list) and ``preble
serve`` share them, and none of them needs protobuf for a ``parameters`` entry."""

from __future__ import annotations

import re


def config_parameter(config_pbtxt: str, key: str) -> str | None:
    """The string value of a ``parameters`` entry of a ``config.pbtxt`` (None: not set)."""
    found = re.search(rf'key:\s*"{re.escape(key)}"\s*value:\s*\{{\s*string_value:\s*"([^"]*)"', config_pbtxt)
    return found.group(1) if found else None


def set_config_parameter(config_pbtxt: str, key: str, value: str) -> str:
    """``config_pbtxt`` with the string parameter ``key`` set to ``value`` (added if absent)."""
    entry = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
    value_of = r'\s*value:\s*\{\s*string_value:\s*"[^"]*"\s*\}\s*\}'
    pattern = rf'parameters\s*\{{\s*key:\s*"{re.escape(key)}"' + value_of
    if re.search(pattern, config_pbtxt):
        return re.sub(pattern, lambda _: entry, config_pbtxt, count=1)
    return config_pbtxt.rstrip("\n") + "\n" + entry + "\n"
