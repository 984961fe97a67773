"""Every example runs on the venv the README's serve command builds (`./scripts/serve.sh`:
rlserve with its `examples` extra, and the client with its `torch` extra), not only on the
test venv, which holds much more (PEFT, lm-eval, ...). Each module that the docs' Python
blocks, the scripts in examples/ and the docs' bash blocks that run a Python file import is
the standard library's, the project's own, or a distribution of that install's requirements
(followed through their own requirements, with their markers), as installed here."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from tests.docs.examples import ROOT, examples, pages

SERVE = [("rlserve", {"examples"}), ("rlserve-client", {"torch"})]
"""What scripts/setup.sh --serve installs (scripts/install.sh's `examples` profile, then the
client with its torch extra)."""
OWN = {"app", "rlserve_client", "examples", "bench", "tests"}
ELSEWHERE = {
    "torchrl": "TorchRL needs tensordict<0.15: its guide and examples/torchrl_grpo.py run in "
    ".venv-torchrl (scripts/setup-torchrl.sh), as they say",
}
"""Modules the docs say to install apart, and where."""


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def serve_distributions() -> set[str]:
    """The distributions the serve install pulls in: its requirements, theirs, and so on."""
    found: set[str] = set()
    pending = [(name, extras) for name, extras in SERVE]
    while pending:
        name, extras = pending.pop()
        if _name(name) in found and not extras:
            continue
        found.add(_name(name))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # (an optional requirement not installed here)
        for line in requires:
            requirement = Requirement(line)
            wanted = [{"extra": extra} for extra in extras] or [{"extra": ""}]
            marker = requirement.marker
            if marker is None or any(marker.evaluate(env) for env in wanted):
                pending.append((requirement.name, set(requirement.extras)))
    return found


def imported(code: str) -> set[str]:
    """The top-level modules `code` imports."""
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module.split(".")[0])
    return modules


def sources() -> dict[str, tuple[Path | None, str]]:
    """Every piece of example code a reader runs, by where it is shown: the docs' Python
    blocks, examples/*.py and the Python files the docs' bash blocks run (the examples that
    run here: a skipped one says what it needs); each with its file, if it is one."""
    found: dict[str, tuple[Path | None, str]] = {
        str(path.relative_to(ROOT)): (path, path.read_text()) for path in ROOT.glob("examples/*.py")
    }
    for page in pages():
        for example in examples(page):
            if example.skip is not None:
                continue
            if example.language == "python":
                found[example.name] = (None, example.code)
            for script in re.findall(r"python3? (\S+\.py)", example.code):
                if (ROOT / script).is_file():
                    found[script] = (ROOT / script, (ROOT / script).read_text())
    return found


def test_every_example_imports_only_what_the_serve_venv_installs() -> None:
    installed = serve_distributions()
    assert {"torch", "transformers", "openai", "peft", "rlserve-client"} <= installed
    owners = metadata.packages_distributions()
    missing = {}
    for where, (path, code) in sources().items():
        beside = {p.stem for p in path.parent.glob("*.py")} if path is not None else set()
        for module in imported(code) - OWN - beside - set(sys.stdlib_module_names) - set(ELSEWHERE):
            provided = {_name(d) for d in owners.get(module, [])}
            if not provided & installed:
                missing.setdefault(module, []).append(where)
    assert not missing, (
        f"imported where the serve venv (scripts/setup.sh --serve) lacks them: {missing}; add "
        "them to pyproject.toml's `examples` extra, or import them where only that path needs them"
    )
