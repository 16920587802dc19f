"""Shared command-line plumbing for the commands (coupled_qk_jax/cli/): flag parsing, config files, one-line errors,
exit statuses.

Exit statuses (docs/training.md):

    0    completed (or stopped at train.stop_after)
    1    a bug: an unexpected exception, printed with its full traceback
    2    a user mistake (:class:`UserError`): one line ``error: ...`` on stderr, no traceback
    3    a non-finite loss; the last good checkpoint is kept
    4    a checkpoint could not be written (disk full, permissions); the last good checkpoint is kept
    130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM: the step was finished, saved and summarised; rerun the
         same command to resume

Config files. ``--config=PATH[:ARG]`` names a Python file with ``get_config(ARG)`` (ml_collections' config_flags).
When PATH does not exist and reads ``configs/NAME.py`` (relative, as the repository's commands write it), the
preset packaged as ``coupled_qk_jax/configs/NAME.py`` is loaded instead: ``coupled-qk-train
--config=configs/lm.py:coupled_euler,tiny`` runs from any directory of an installed package, and in a checkout the
repository's thin ``configs/*.py`` are the same presets. A config file that is neither is one ``error:`` line
(exit 2).

Nothing here imports JAX, so ``--help``, ``--print_config`` and flag errors stay fast.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from typing import Any, Callable

from absl import app, flags, logging
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from coupled_qk_jax.errors import UserError, did_you_mean

EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3
EXIT_SAVE_FAILED = 4
# The packaged presets (coupled_qk_jax/configs/*.py), found by file like any config file.
PRESETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def fail(message: str) -> None:
    """Print ``error: message`` (its first line) and exit 2, skipping interpreter shutdown (see exit_process)."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"error: {line}", file=sys.stderr, flush=True)
    exit_process(EXIT_USER_ERROR)


def parse_flags(argv: list[str]) -> list[str]:
    """absl ``flags_parser`` for ``app.run``: flag and config mistakes become one ``error:`` line and exit 2.

    ``--config`` is resolved first (:func:`resolve_config_argv`: the packaged preset for a ``configs/NAME.py`` that
    is not here), then ``--config.FIELD=VALUE`` overrides are checked against the loaded config, so a typo names the
    closest field instead of raising from inside ml_collections; the ``--config`` flag is then handed that same
    config, so the config file's ``get_config`` runs once per start."""
    try:
        argv = resolve_config_argv(argv)
        loaded = check_config_overrides(argv)
        flag = flags.FLAGS["config"] if "config" in flags.FLAGS else None
        if loaded is not None and isinstance(getattr(flag, "parser", None), ConfigFileFlagParser):
            flag.parser = _LoadedConfigParser(flag.parser, *loaded)
        return flags.FLAGS(argv)
    except UserError as e:
        fail(str(e))
    except flags.Error as e:
        fail(str(e))
    raise AssertionError("unreachable")


def _flag_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def packaged_preset(path: str) -> str | None:
    """The packaged preset's file for ``configs/NAME.py`` (relative), else None."""
    parts = os.path.normpath(path).split(os.sep)
    if os.path.isabs(path) or len(parts) != 2 or parts[0] != "configs" or not parts[1].endswith(".py"):
        return None
    preset = os.path.join(PRESETS_DIR, parts[1])
    return preset if parts[1] != "__init__.py" and os.path.isfile(preset) else None


def resolve_config_spec(spec: str) -> str:
    """``PATH[:ARG]`` as given when PATH exists; the packaged preset's file for a ``configs/NAME.py`` that does not
    (module docstring); otherwise a UserError naming the presets."""
    path, sep, arg = spec.partition(":")
    if os.path.isfile(path):
        return spec
    preset = packaged_preset(path)
    if preset is not None:
        return preset + sep + arg
    names = ", ".join(f"configs/{name}" for name in sorted(os.listdir(PRESETS_DIR))
                      if name.endswith(".py") and name != "__init__.py")
    raise UserError(f"--config: no config file {path!r}; a file path or a packaged preset ({names}), e.g. "
                    f"--config=configs/lm.py:coupled_euler,tiny")


def resolve_config_argv(argv: list[str]) -> list[str]:
    """``argv`` with its ``--config=SPEC`` (or ``--config SPEC``) resolved by :func:`resolve_config_spec`."""
    out = list(argv)
    for i, arg in enumerate(out[1:], start=1):
        if arg.startswith("--config="):
            out[i] = "--config=" + resolve_config_spec(arg[len("--config="):])
        elif arg == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_config_spec(out[i + 1])
    return out


def load_config_file(spec: str) -> Any:
    """``path/to/config.py[:ARG]`` -> ``get_config(ARG)``, as ml_collections' config_flags loads it (a packaged
    preset for a ``configs/NAME.py`` that is not here)."""
    path, _, arg = resolve_config_spec(spec).partition(":")
    module_spec = importlib.util.spec_from_file_location("_checked_config", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def reader_command(body: Callable[[], object]) -> Callable[[list[str]], None]:
    """absl's main for a command that reads a saved run (eval, sample, export): no positional arguments, orbax's
    INFO lines off (it logs every restore), the processes of a multi-host launch joined before anything touches a
    device (the --mesh then spans every process's devices; a no-op on one process), then ``body`` with the user's
    mistakes as one line and an exit status (:func:`run_guarded`)."""
    def command(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        logging.set_verbosity(logging.WARNING)
        from coupled_qk_jax.distributed import initialize_distributed

        initialize_distributed()
        exit_process(run_guarded(body))

    return command


def run_command(app_main: Callable[[list[str]], None], flags_module: str, doc: str,
                flags_parser: Callable[[list[str]], list[str]] | None = None) -> None:
    """``app.run(app_main)`` for a command whose flags module ``flags_module`` has just defined.

    absl's ``--help`` prints the ``__main__`` module's docstring and the flags defined there; the process may have
    been started by a console script's generated file, a thin top-level file or ``python -m``, so the command's own
    docstring and flags are made ``__main__``'s."""
    sys.modules["__main__"].__doc__ = doc
    for flag in flags.FLAGS.get_key_flags_for_module(flags_module):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    if flags_parser is None:
        app.run(app_main)
    else:
        app.run(app_main, flags_parser=flags_parser)


def config_fields(cfg: Any, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field of a ConfigDict (``model.n_steps``, ...)."""
    out: list[str] = []
    for key in cfg.keys():
        value = cfg[key]
        name = f"{prefix}{key}"
        if hasattr(value, "keys") and not isinstance(value, (str, bytes)):
            out.extend(config_fields(value, name + "."))
        else:
            out.append(name)
    return out


def check_config_overrides(argv: list[str]) -> tuple[str, Any] | None:
    """Load ``--config`` once up front (a bad scale or variant is a UserError from get_config) and refuse
    ``--config.FIELD=...`` for a FIELD the config does not have, naming the closest one. Returns ``(the --config
    value, its config)``, or None without ``--config``."""
    spec = _flag_value(argv[1:], "config")
    if spec is None:
        return None
    config = load_config_file(spec)
    known = config_fields(config)
    overrides = [a[len("--config."):].split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
    for name in overrides:
        if name not in known:
            raise UserError(f"unknown config field --config.{name}{did_you_mean(name, known)}; --print_config "
                            f"lists every field with its default")
    return spec, config


class _LoadedConfigParser(ConfigFileFlagParser):
    """The ``--config`` flag's parser, handed the config that :func:`check_config_overrides` loaded from ``spec``:
    that value parses to it (locked as the flag's own parser would lock it) instead of running get_config again.
    Any other value, or a second parse, loads the file as ml_collections does."""

    def __init__(self, parser: ConfigFileFlagParser, spec: str, config: Any) -> None:
        super().__init__(parser.name, lock_config=getattr(parser, "_lock_config", True))
        self.spec, self.config = spec, config

    def parse(self, path: str) -> Any:
        config, self.config = self.config, None
        if path != self.spec or config is None:
            return super().parse(path)
        if self._lock_config and callable(getattr(config, "lock", None)):
            config.lock()
        return config


def config_json(cfg: Any) -> str:
    """The resolved config (every field, defaults included) as indented JSON: what --print_config prints and what
    the run directory's config.json holds."""
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True, default=str)


def run_guarded(fn: Callable[[], object]) -> int:
    """Run ``fn``; map the failures a user can act on to one line on stderr and an exit status. Anything else
    propagates with its traceback (exit 1)."""
    from coupled_qk_jax.training.checkpoint import CheckpointSaveError  # noqa: PLC0415 - imports JAX
    from coupled_qk_jax.training.loop import NonFiniteLossError  # noqa: PLC0415

    try:
        fn()
    except UserError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else "unknown error"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except CheckpointSaveError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_SAVE_FAILED
    return 0


def exit_process(code: int) -> None:
    """Exit with ``code``. After a user error or a failed save nothing is being trained or saved, so skip
    interpreter shutdown: orbax's idle background threads can otherwise print a traceback after the one line."""
    if code in (EXIT_USER_ERROR, EXIT_SAVE_FAILED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def runtime_flag_fields() -> str:
    """``remat (str), scan_layers (bool), ...``: the runtime block's fields with their types, for messages."""
    from coupled_qk_jax.config import RuntimeConfig

    return ", ".join(f"{f.name} ({type(f.default).__name__})" for f in dataclasses.fields(RuntimeConfig))


def parse_runtime_flag(text: str) -> dict[str, Any]:
    """The readers' ``--runtime=FIELD=VALUE[,FIELD=VALUE...]`` (e.g. ``attention_impl=explicit,scan_layers=false``):
    the ``runtime.*`` fields to change, each typed by its RuntimeConfig field (bool: true/false, int, str) and
    checked by RuntimeConfig itself; an empty value changes nothing. A mistake (no ``=``, an unknown or repeated
    field, a value of the wrong type or not allowed) is a UserError of one line naming the fields."""
    from coupled_qk_jax.config import RuntimeConfig

    types = {f.name: type(f.default) for f in dataclasses.fields(RuntimeConfig)}
    out: dict[str, Any] = {}

    def mistake(what: str) -> UserError:
        return UserError(f"--runtime: {what}; the runtime fields are {runtime_flag_fields()}")

    for item in (part.strip() for part in str(text).split(",")):
        if not item:
            continue
        name, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            raise mistake(f"{item!r} is not FIELD=VALUE")
        if name not in types:
            raise mistake(f"unknown field {name!r}{did_you_mean(name, types)}")
        if name in out:
            raise mistake(f"{name} is given twice")
        kind = types[name]
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise mistake(f"{name}={value}: expected true or false")
            out[name] = value.lower() == "true"
        elif kind is int:
            try:
                out[name] = int(value)
            except ValueError:
                raise mistake(f"{name}={value}: expected an integer") from None
        else:
            out[name] = value
    try:
        RuntimeConfig(**out)  # its own checks: the choices and ranges
    except ValueError as e:
        raise mistake(str(e).splitlines()[0]) from None
    return out


def parse_replica(text: str) -> int | str:
    """--replica: ``"all"`` or a replica index K >= 0 (range-checked by the run, which knows how many it has)."""
    text = str(text).strip()
    if text == "all":
        return "all"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"--replica={text}: expected a replica index 0, 1, ... or all")
    return value
