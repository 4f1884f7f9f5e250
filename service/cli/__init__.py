"""The `lattice` command (`lattice = "service.cli:app"`): the app with every command registered,
in the order `--help` lists them.

`app` (the root options, consoles and error handling) runs the service (`serve`), submits and
watches jobs (`jobs`), manages tokens (`tokens`) and plans layouts (`plan`); the HTTP client the
commands use is `client`.
"""

from service.cli import jobs, serve, tokens
from service.cli.app import app, token_app
from service.cli.plan import plan_command

app.command(epilog=serve.settings_epilog())(serve.serve)
for command in (jobs.submit, jobs.jobs, jobs.status, jobs.cancel, jobs.events):
    app.command()(command)
token_app.command("create")(tokens.token_create)
app.command("plan")(plan_command)

__all__ = ["app"]
