"""The `lattice` command (`lattice = "service.cli:app"`): the app with every command registered,
in the order `--help` lists them.

`app` (the root options, consoles and error handling) runs the service (`serve`), submits and
watches jobs (`jobs`), manages tokens (`tokens`) and plans layouts (`plan`); the HTTP client the
commands use is `client`.
"""

import typer

from service.cli import data, export, jobs, logs, serve, tokens
from service.cli.app import app, token_app
from service.cli.plan import plan_command

app.command(epilog=serve.settings_epilog())(serve.serve)
for command in (jobs.submit, jobs.jobs, jobs.status, jobs.cancel, jobs.events):
    app.command()(command)
app.command()(logs.logs)
token_app.command("create")(tokens.token_create)
token_app.command("list")(tokens.token_list)
token_app.command("revoke")(tokens.token_revoke)
app.command("plan")(plan_command)
app.command("export")(export.export)
data_app = typer.Typer(help="Token files.", no_args_is_help=True)
data_app.command("check")(data.data_check)
app.add_typer(data_app, name="data")

__all__ = ["app"]
