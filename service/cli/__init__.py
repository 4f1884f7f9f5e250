"""The `lattice` command (`lattice = "service.cli:app"`): the app with every command registered,
in the order `--help` lists them.

`app` (the root options, consoles and error handling) runs the service (`serve`), submits and
watches jobs (`jobs`), reads them (`job_views`: jobs, status, events), manages tokens (`tokens`),
tenants (`tenants`) and nodes (`cluster`) and plans layouts (`plan`); the HTTP client the
commands use is `client`.
"""

import typer

from service.cli import calibrate, cluster, data, export, job_views, jobs, logs, serve, tenants, tokens
from service.cli.app import app, cluster_app, token_app
from service.cli.plan import plan_command

app.command(epilog=serve.settings_epilog())(serve.serve)
for command in (jobs.submit, job_views.jobs, job_views.status, jobs.cancel, jobs.resume, job_views.events):
    app.command()(command)
app.command()(logs.logs)
token_app.command("create")(tokens.token_create)
token_app.command("list")(tokens.token_list)
token_app.command("revoke")(tokens.token_revoke)
cluster_app.command("status")(cluster.cluster_status)
cluster_app.command("up")(cluster.cluster_up)
cluster_app.command("down")(cluster.cluster_down)
cluster_app.command("cordon")(cluster.cordon)
cluster_app.command("uncordon")(cluster.uncordon)
cluster_app.command("drain")(cluster.drain)
app.add_typer(tenants.tenant_app, name="tenant")
app.command("plan")(plan_command)
app.command("calibrate")(calibrate.calibrate)
app.command("export")(export.export)
data_app = typer.Typer(help="Token files.", no_args_is_help=True)
data_app.command("check")(data.data_check)
app.add_typer(data_app, name="data")

__all__ = ["app"]
