"""Reading and writing a RunConfig: command-line flags, YAML/TOML files, argv and config.yaml.

Precedence: dataclass defaults < `--config FILE` < command-line flags. The flags, file keys and
help come from the fields' own declarations in config.py (`opt`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from neuron_train.common import reader
from neuron_train.common.cli_parser import CommandParser
from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import write_failed, write_text_atomic
from neuron_train.common.neuron_env import default_pjrt_device
from neuron_train.common.values import shown
from neuron_train.training.config import DEVICE_DEFAULTS, RunConfig, default_text, device_defaults, sections

CONFIG_LIMIT = 2**20  # a run's config is a few KiB


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {name: hints[name] for name in sections()}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _base_type(f: dataclasses.Field, owner: type) -> type:
    hint = typing.get_type_hints(owner)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per config field. Unset flags stay absent (SUPPRESS)."""
    parser.add_argument("--config", metavar="FILE", help="YAML or TOML file with sections: "
                        + ", ".join(sections()) + " (flags override it)")
    seen: set[str] = set()
    for section, cls in _section_types().items():
        group = parser.add_argument_group(f"{section} options")
        for f in dataclasses.fields(cls):
            flag = _flag(f)
            assert flag not in seen, f"duplicate flag {flag}"  # a programming error, not user input
            seen.add(flag)
            kind = _base_type(f, cls)
            dest = f"{section}.{f.name}"
            help_text = f"{f.metadata['help']} (default: {default_text(dest, f.default)})"
            if flag == "--resume":
                kwargs: dict[str, Any] = {"nargs": "?", "const": "latest", "metavar": "FILE"}
            elif kind is bool:
                kwargs = {"action": argparse.BooleanOptionalAction}
            else:
                kwargs = {"type": kind, "choices": f.metadata["choices"], "metavar": f.metadata["metavar"]}
            group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=help_text, **kwargs)
            if f.metadata.get("alias"):
                group.add_argument(f.metadata["alias"], dest=dest, default=argparse.SUPPRESS,
                                   help=argparse.SUPPRESS, **kwargs)


def _coerce(value: Any, kind: type, where: str) -> Any:
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"{where}: expected true/false, got {shown(value)}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise UsageError(f"{where}: expected {kind.__name__}, got {shown(value)}")
    return value


def load_config_file(path: str) -> dict[str, dict[str, Any]]:
    """`--config FILE` read within the bounds of common.reader (a regular file, no YAML aliases,
    bounded depth and numbers), as {section: {field: value}}."""
    reader.regular_file(path, "--config")  # an unusable path is said first, whatever its suffix
    if Path(path).suffix.lower() not in (".toml", ".yaml", ".yml"):
        raise UsageError(f"--config: {shown(path)}: use a .yaml, .yml or .toml file")
    data = reader.load(path, "--config", limit=CONFIG_LIMIT)
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config: {shown(path)}: expected sections ({', '.join(sections())})")
    return data


def build_config(file_values: dict[str, dict[str, Any]] | None = None,
                 overrides: dict[str, Any] | None = None, source: str = "config",
                 device_kind: str | None = None) -> RunConfig:
    """Defaults (those of `device_kind`, default: this machine's PJRT device), then file sections
    ({section: {field: value}}), then flat `section.field` overrides."""
    types = _section_types()
    values: dict[str, dict[str, Any]] = {s: {} for s in types}
    device_kind = device_kind or default_pjrt_device()
    _warn_other_device_values(file_values or {}, overrides or {}, device_kind, source)
    for dotted, value in device_defaults(device_kind).items():
        section, key = dotted.split(".", 1)
        values[section][key] = value
    for section, body in (file_values or {}).items():
        if section not in types:
            raise UsageError(f"{source}: unknown section {shown(section)} (known: {', '.join(types)})")
        if not isinstance(body, dict):
            raise UsageError(f"{source}: section '{section}' must be a mapping")
        names = {f.name: f for f in dataclasses.fields(types[section])}
        for key, value in body.items():
            if not isinstance(key, str):
                raise UsageError(f"{source}: section '{section}' has a key that is not a name: {shown(key)}")
            key = key.replace("-", "_")
            if key not in names:
                raise UsageError(f"{source}: unknown key '{section}.{key[:60]}' "
                                 f"(known: {', '.join(names)})")
            kind = _base_type(names[key], types[section])
            if value is None and type(None) not in typing.get_args(typing.get_type_hints(types[section])[key]):
                raise UsageError(f"{source}: {section}.{key}: expected {kind.__name__}, got null (leave the key "
                                 "out for the default)")
            values[section][key] = _coerce(value, kind, f"{source}: {section}.{key}")
            choices = names[key].metadata["choices"]
            if choices and values[section][key] not in choices:
                raise UsageError(f"{source}: {section}.{key} must be one of {', '.join(choices)}, "
                                 f"got {shown(value)}")
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".", 1)
        values[section][key] = value
    cfg = RunConfig(**{s: types[s](**values[s]) for s in types})
    return cfg.validate()


def _warn_other_device_values(file_values: dict, overrides: dict, device_kind: str, source: str) -> None:
    """A file that sets a device-dependent setting to another value than this device's default: a
    config.yaml saved by a CPU run holds the CPU's resolved defaults (step_compiler dynamo-full), and
    reused on a Neuron device it would quietly select the torch.compile path the Neuron SDK 2.29
    docs say is not yet supported. Said once per setting; a flag on the command line decides silently."""
    for dotted, default in device_defaults(device_kind).items():
        section, key = dotted.split(".", 1)
        body = file_values.get(section)
        value = body.get(key, body.get(key.replace("_", "-"))) if isinstance(body, dict) else None
        if value is not None and value != default and dotted not in overrides:
            flag = "--" + key.replace("_", "-")
            print(f"neuron-train: warning: {source}: {dotted} is {shown(value)}, but on this device ({device_kind}) "
                  f"the default is {default}; the file may come from a run on another device. Keep it with "
                  f"{flag} {shown(value)}, or use the default with {flag} {default} (or delete the line)",
                  file=sys.stderr, flush=True)



def config_from_train_args(train_args: list[str], prog: str) -> RunConfig:
    """The run configuration of a command's TRAIN_ARGS (`precompile [options] -- TRAIN_ARGS`): parsed
    with train's own options, a usage error naming `neuron-train train --help`."""
    parser = CommandParser(prog=prog, add_help=False, help_command="neuron-train train --help")
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(train_args))


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = {k: v for k, v in vars(args).items() if "." in k}
    file_values = load_config_file(args.config) if getattr(args, "config", None) else None
    return build_config(file_values, overrides, source=args.config or "config")


def config_to_argv(cfg: RunConfig) -> list[str]:
    """The command-line flags that reproduce `cfg` (used to launch the same run elsewhere). A setting
    whose default depends on the device (DEVICE_DEFAULTS) is always given: left out, it would take
    the default of the device that parses it (dynamo-full on CPU becoming lazy on Neuron)."""
    argv: list[str] = []
    defaults = RunConfig()
    by_device = {dotted for values in DEVICE_DEFAULTS.values() for dotted in values}
    for section, cls in _section_types().items():
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, section), f.name)
            if value == getattr(getattr(defaults, section), f.name) and f"{section}.{f.name}" not in by_device:
                continue
            flag = _flag(f)
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, str(value)]
    return argv


def save_config(cfg: RunConfig, path: os.PathLike) -> None:
    try:
        write_text_atomic(Path(path), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    except OSError as exc:  # a full disk: one line, an existing file stays whole (atomic write)
        raise write_failed(Path(path), exc) from None
