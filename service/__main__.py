"""``python -m service`` / ``transformer-serve``: serve the checkpoints in TSERVE_WEIGHTS_DIR.

The flags are the everyday subset of the settings; a flag wins over its ``TSERVE_*``
variable, which wins over ``.env``, which wins over the default. Every other setting is
read from the environment only (README, "Configuration").
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# Before torch loads: OpenMP threads that spin while waiting collapse when the host is busy
# (measured here: a 2-thread decode step 2-3x slower than 1 thread next to other work).
# Passive waiting costs little on an idle host. An explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pydantic import ValidationError  # noqa: E402

from service.settings import Settings  # noqa: E402

# flag -> (Settings field, what it is); the variable, default and choices come from Settings
FLAGS = {
    "--host": ("host", "bind address (0.0.0.0: every interface)"),
    "--port": ("port", "TCP port, 1-65535"),
    "--weights-dir": ("weights_dir", "directory of checkpoints, one sub-directory each"),
    "--models": ("models", ("comma-separated models to serve, each a checkpoint name in the weights directory, a path "
                          "to a model directory, or a path to a .gguf file; empty: all in the weights directory "
                          "(TSERVE_PRELOAD says which load at start-up; the others load on demand)")),
    "--device": ("device", "torch device: cpu, cuda, cuda:1, ..."),
    "--dtype": ("dtype", "weights and KV cache"),
    "--log-level": ("log_level", "log level"),
}

EPILOG = """\
There is no --workers: one process owns the models and their KV caches (a second worker
would load every model again and split the batch). To use more cores or machines, run
replicas - several processes or containers, each on its own port, behind a load balancer -
and give each a share of the cores with TSERVE_TORCH_THREADS.

Every other setting (TSERVE_MAX_BATCH, TSERVE_API_KEY, ...) is read from the environment
or a .env file; the README's configuration table lists them all."""


def _version() -> str:
    try:
        return version("transformer-serve")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    prog = "python -m service" if Path(sys.argv[0]).name == "__main__.py" else "transformer-serve"
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve transformer checkpoints over HTTP (translation, generation, fill-mask).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    for flag, (name, text) in FLAGS.items():
        field = Settings.model_fields[name]
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        kind = int if field.annotation is int else str
        default = field.default if field.default != "" else "(empty)"
        parser.add_argument(flag, dest=name, type=kind, choices=choices, default=argparse.SUPPRESS,
                            metavar=None if choices else name.upper(),
                            help=f"{text} [env TSERVE_{name.upper()}; default: {default}]")
    parser.add_argument("--exit-on-load-failure", dest="exit_on_load_failure", action="store_true",
                        default=argparse.SUPPRESS,
                        help="exit with status 1 when a model fails to load, instead of staying up unready "
                             "[env TSERVE_EXIT_ON_LOAD_FAILURE; default: false]")
    parser.add_argument("--version", action="version", version=f"transformer-serve {_version()}")
    return parser


def settings_from_args(argv: list[str] | None = None) -> Settings:
    """Settings with the given flags over the environment; a bad value exits 2 naming it."""
    parser = build_parser()
    flags = vars(parser.parse_args(argv))
    try:
        return Settings(**flags)
    except ValidationError as exc:
        by_field = {name: flag for flag, (name, _) in FLAGS.items()}
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            source = by_field[name] if name in flags else f"TSERVE_{name.upper()}"
            problems.append(f"{source}: {err['msg']} (got {err.get('input')!r})")
        parser.error("; ".join(problems))


def main(argv: list[str] | None = None) -> None:
    settings = settings_from_args(argv)
    # after the flags: --help and errors answer without loading the web stack
    from service.http.app import create_app
    from service.http.server import build_server

    app = create_app(settings)
    build_server(app, settings).run()
    if app.state.exit_code is not None:
        sys.exit(app.state.exit_code)


if __name__ == "__main__":
    main()
