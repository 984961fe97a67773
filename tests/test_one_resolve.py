"""Every sampling route renames its request into a `GenerationAsk` and hands it to the one
resolver (`ModelServing.resolve`); nothing maps sampling after it. Read from the source (`ast`):
in the modules that take a request's generation (the dialects, `/v1/generate`, rollouts), no
code builds or edits an engine `SamplingConfig`, builds a score request for a sampling wish,
or runs the resolver's own checks (the top-logprobs limit, batch invariance, routing)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUTES = [ROOT / "app" / "dialects", ROOT / "app" / "generation", ROOT / "app" / "rollouts"]
RESOLVER = ROOT / "app" / "common" / "service.py"

WISHES = {"top_logprobs", "entropy", "ranks"}
"""What a ScoreSpec built for a generation's wish would set."""
CHECKS = {"top_logprobs", "alone", "routing_of", "routing_to_return", "check_batch_invariant"}
"""The resolver's own checks, by the name they are called by."""


def called(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        owner = func.value
        prefix = f"{owner.id}." if isinstance(owner, ast.Name) else ""
        return prefix + func.attr
    return func.id if isinstance(func, ast.Name) else ""


def mappings(source: str) -> list[str]:
    """The calls in `source` that map sampling outside the resolver, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = called(node)
        short = name.rsplit(".", 1)[-1]
        keywords = {k.arg for k in node.keywords}
        first = ast.unparse(node.args[0]) if node.args else ""
        if name in ("SamplingConfig", "SamplingConfig.resolve"):
            found.append(f"{node.lineno}: builds a SamplingConfig")
        elif short == "ScoreSpec" and keywords & WISHES:
            found.append(f"{node.lineno}: builds a ScoreSpec for {sorted(keywords & WISHES)}")
        elif short == "replace" and "config" in first:
            found.append(f"{node.lineno}: edits {first}")
        elif short in CHECKS:
            found.append(f"{node.lineno}: runs the resolver's check {short}")
    return found


def test_the_checker_finds_a_mapping_after_resolve() -> None:
    source = (
        "resolved = generation.resolve(ask, model, names)\n"
        "config = replace(resolved.config, return_routed_experts=True)\n"
        "asks = ScoreSpec(top_logprobs=k, ranks=True)\n"
        "k = generation.top_logprobs(request.k, 'k')\n"
        "row = ScoreSpec(routed_experts=g.routed_experts)\n"  # a row's own routing: not a wish
    )
    assert mappings(source) == [
        "2: edits resolved.config",
        "3: builds a ScoreSpec for ['ranks', 'top_logprobs']",
        "4: runs the resolver's check top_logprobs",
    ]


def test_no_route_maps_sampling_after_the_resolver() -> None:
    modules = sorted(p for folder in ROUTES for p in folder.rglob("*.py"))
    assert len(modules) > 20
    found = {
        str(path.relative_to(ROOT)): where
        for path in modules
        if (where := mappings(path.read_text()))
    }
    assert found == {}


def test_the_resolver_is_the_one_place_a_request_becomes_a_sampling_config() -> None:
    sources = {p: p.read_text() for p in (ROOT / "app").rglob("*.py")}
    resolving = sorted(
        str(p.relative_to(ROOT)) for p, text in sources.items() if "SamplingConfig.resolve(" in text
    )
    assert resolving == [str(RESOLVER.relative_to(ROOT))]
    assert "def resolve(" in sources[RESOLVER]
