"""`python -m service ...` is the `lattice` command."""

from service.cli import app

if __name__ == "__main__":
    app(prog_name="lattice")
