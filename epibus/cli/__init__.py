"""The `epibus` command line. `main` runs the lean commands (`statusline`, run on every shell prompt) without
loading the typer app and what it imports (NATS, pydantic, SQLAlchemy); every other command goes to the typer
app, `epibus.cli.app.app`, imported only then."""

from __future__ import annotations

import sys

LEAN_COMMANDS = ("statusline",)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in LEAN_COMMANDS:
        from epibus.monitoring.statusline import main as statusline_main

        sys.exit(statusline_main(sys.argv[2:]))
    from epibus.cli.app import main as app_main

    app_main()
