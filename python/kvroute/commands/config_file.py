"""Settings from a config file and ``KVROUTE_*`` environment variables, for a command's flags.

One source of truth: the keys, types and choices are read off the command's argparse
definitions, so every flag has a file key and an environment variable and a new flag
gets both without a line here.

* File key: the flag's name without ``--``, with ``-`` or ``_`` (``worker-urls`` or
  ``worker_urls``), at the top level of a TOML (``.toml``) or YAML (``.yaml``/``.yml``)
  file. Lists are lists; numbers are numbers; ``auto``-style values are strings.
* Environment: ``KVROUTE_`` + the flag's name in capitals with ``_``
  (``--worker-urls`` -> ``KVROUTE_WORKER_URLS``; list values separated by commas or
  spaces; ``KVROUTE_CONFIG`` names the file).
* Precedence: flag > environment > file > default. argparse has already applied flags
  and defaults when this runs, so the flags actually typed are found by parsing the
  command line again with every default suppressed.

Unknown keys and values of the wrong type or outside a flag's choices are refused with
the file (or variable), the key and the reason. ``describe`` prints the effective
settings as TOML (a valid config file), secrets masked.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvroute.config import ConfigError

ENV_PREFIX = "KVROUTE_"
# Flags that steer the loading itself, not settings.
META = {"config", "print_config", "help"}
SECRET_SUFFIXES = ("api_key",)
MASK = "***"


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The command's settings: dest -> argparse action (flags only)."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in META}


def is_secret(dest: str) -> bool:
    return dest.endswith(SECRET_SUFFIXES)


def _is_list(action: argparse.Action) -> bool:
    return action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction)


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _scalar(action: argparse.Action, value: Any, from_text: bool, in_list: bool = False) -> Any:
    """One value as argparse would have produced it from the command line."""
    kind = action.type
    if isinstance(value, bool) and not from_text:
        raise ValueError(f"expected {_kind_name(kind)}, got a boolean")
    if kind is int and not from_text and not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    if kind is float and not from_text and not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    if kind is None and not isinstance(value, str):
        if isinstance(value, int | float) and not in_list:
            value = str(value)  # e.g. worker-capacity = 16 for "16"
        else:
            raise ValueError(f"expected a string, got {value!r}")
    if callable(kind):
        try:
            value = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected {_kind_name(kind)}, got {value!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"{value!r} is not one of: {choices}")
    return value


def _kind_name(kind: Any) -> str:
    return {int: "an integer", float: "a number"}.get(kind, "a string")


def convert(action: argparse.Action, value: Any, *, from_text: bool) -> Any:
    """A file or environment value for ``action``; ValueError says what is wrong."""
    if _is_switch(action):
        if from_text:
            v = str(value).strip().lower()
            if v not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"expected true or false, got {value!r}")
            flag = v in ("1", "true", "yes", "on")
        elif isinstance(value, bool):
            flag = value
        else:
            raise ValueError(f"expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            return flag
        return action.const if flag else action.default
    if _is_list(action):
        if from_text:
            items: list[Any] = str(value).replace(",", " ").split()
        elif isinstance(value, list):
            items = value
        else:
            items = [value]
        return [_scalar(action, v, from_text, in_list=True) for v in items]
    return _scalar(action, value, from_text)


def read_file(path: str, actions: dict[str, argparse.Action]) -> dict[str, Any]:
    """The settings in ``path``, converted; ConfigError names the file, key and reason."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it: {e.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw) or {}
        elif p.suffix == ".toml":
            data = tomllib.loads(raw.decode())
        else:
            raise ConfigError(f"config file {path}: use a .toml, .yaml or .yml file")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: not valid TOML: {e}") from None
    except ImportError:
        raise ConfigError(f"config file {path}: YAML needs PyYAML installed") from None
    except Exception as e:  # yaml.YAMLError without importing yaml for TOML users
        if type(e).__module__.startswith("yaml"):
            raise ConfigError(f"config file {path}: not valid YAML: {e}") from None
        raise
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a table of settings")
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(f"config file {path}: key {key!r}: unknown setting")
        if dest in out:
            raise ConfigError(f"config file {path}: key {key!r}: set twice")
        try:
            out[dest] = convert(action, value, from_text=False)
        except ValueError as e:
            raise ConfigError(f"config file {path}: key {key!r}: {e}") from None
    return out


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def read_env(environ: dict[str, str], actions: dict[str, argparse.Action]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dest, action in actions.items():
        name = env_name(dest)
        if name in environ:
            try:
                out[dest] = convert(action, environ[name], from_text=True)
            except ValueError as e:
                raise ConfigError(f"environment variable {name}: {e}") from None
    return out


def typed_on_command_line(
    configure: Callable[[argparse.ArgumentParser], None], argv: Sequence[str]
) -> set[str]:
    """Dests of the flags present in ``argv`` (argparse fills in the rest as defaults)."""
    probe = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    configure(probe)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    given, _ = probe.parse_known_args(list(argv))
    return set(vars(given))


def command_argv(argv: Sequence[str]) -> list[str]:
    """The arguments after the command's name in ``kvroute COMMAND ...``."""
    for i, a in enumerate(argv):
        if not a.startswith("-"):
            return list(argv[i + 1 :])
    return []


class Layered:
    """Effective values (flag > env > file > default) and where each came from."""

    def __init__(
        self,
        configure: Callable[[argparse.ArgumentParser], None],
        args: argparse.Namespace,
        argv: Sequence[str],
        environ: dict[str, str],
    ) -> None:
        parser = argparse.ArgumentParser(add_help=False)
        configure(parser)
        self.actions = options(parser)
        self.values: dict[str, Any] = {d: getattr(args, d) for d in self.actions}
        self.sources: dict[str, str] = dict.fromkeys(self.actions, "default")
        self.config_path = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
        if self.config_path:
            for dest, v in read_file(self.config_path, self.actions).items():
                self.values[dest], self.sources[dest] = v, f"file {self.config_path}"
        for dest, v in read_env(environ, self.actions).items():
            self.values[dest], self.sources[dest] = v, f"env {env_name(dest)}"
        for dest in typed_on_command_line(configure, argv) & self.actions.keys():
            self.values[dest], self.sources[dest] = getattr(args, dest), "flag"
        unknown = sorted(
            k
            for k in environ
            if k.startswith(ENV_PREFIX)
            and k != ENV_PREFIX + "CONFIG"
            and k[len(ENV_PREFIX) :].lower() not in self.actions
        )
        for k in unknown:
            print(f"kvroute: warning: ignoring unknown environment variable {k}", file=sys.stderr)

    def namespace(self, args: argparse.Namespace) -> argparse.Namespace:
        merged = argparse.Namespace(**vars(args))
        for dest, v in self.values.items():
            setattr(merged, dest, v)
        return merged

    def blame(self, message: str) -> str:
        """``message`` plus where the settings it names (``--flag``) were set, when that
        was a file or a variable."""
        where = [
            f"{self.actions[d].option_strings[0]} set by {src}"
            for d, src in self.sources.items()
            if src not in ("default", "flag") and _names(message, self.actions[d].option_strings[0])
        ]
        return message + (f" ({'; '.join(where)})" if where else "")

    def describe(self) -> str:
        """The effective settings as TOML, secrets masked, each with its source."""
        lines = ["# kvroute: effective settings (flag > env > file > default)"]
        for dest, value in self.values.items():
            key = dest.replace("_", "-")
            if value is None:
                lines.append(f"# {key} = (unset)")
                continue
            shown = MASK if is_secret(dest) else value
            lines.append(f"{key} = {_toml(shown)}  # {self.sources[dest]}")
        return "\n".join(lines) + "\n"


def _names(message: str, flag: str) -> bool:
    """``flag`` appears in ``message`` as a whole flag (``--port``, not ``--port-x``)."""
    return re.search(re.escape(flag) + r"(?![\w-])", message) is not None


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    # JSON string escapes are valid TOML basic-string escapes.
    import json

    return json.dumps(str(value))
