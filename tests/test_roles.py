"""Refusals below the routes name roles, never a request field: the engine, weights, updates
and deploy layers hold no API's field names (read from their source), and each route words
the roles in its own vocabulary (`app.common.failures.worded`, `app.words.NATIVE_WORDS`)."""

from __future__ import annotations

import ast
import pickle

import pytest

from app.common.failures import Failure, NotFound, invalid, recast, worded
from app.common.roles import Role
from app.deploy.replica import Refusal
from app.errors import failure_error
from app.words import NATIVE_WORDS
from tests.test_import_graph import ROOT

LAYERS = ("engine", "weights", "updates", "deploy")
"""Below the routes: what they raise names roles."""


def _layer_sources() -> list[tuple[str, ast.Module]]:
    files = [
        path
        for layer in LAYERS
        for path in sorted((ROOT / "app" / layer).rglob("*.py"))
        if path.name != "router.py"  # (the updates routes word the roles)
    ]
    assert len(files) > 40
    return [(str(path.relative_to(ROOT)), ast.parse(path.read_text())) for path in files]


def _is_text(node: ast.expr) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def _wire_names(source: str, tree: ast.Module) -> list[str]:
    """Where a module of the layers takes or names a request field."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                if arg.arg == "param" or arg.arg.endswith("_param"):
                    found.append(f"{source}:{node.lineno} takes a field name ({arg.arg})")
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", ""))
        for keyword in node.keywords:
            if keyword.arg == "param" and _is_text(keyword.value):
                found.append(f"{source}:{node.lineno} names a field ({name}(param=...))")
        if name in ("invalid", "file_failure") and node.args and _is_text(node.args[0]):
            found.append(f"{source}:{node.lineno} names a field ({name}(...))")
        if name == "worded":
            found.append(f"{source}:{node.lineno} words roles (the routes do)")
    return found


def test_the_layers_below_the_routes_name_no_request_field() -> None:
    found = [line for source, tree in _layer_sources() for line in _wire_names(source, tree)]
    assert found == []


def test_the_check_catches_a_field_name() -> None:
    code = (
        "def load(path, param='path'):\n"
        "    raise invalid('weights', 'no')\n"
        "def get(name):\n"
        "    raise NotFound('model: none', param='model')\n"
    )
    found = _wire_names("x.py", ast.parse(code))
    assert len(found) == 3, found


def test_a_role_is_worded_by_the_route_that_called() -> None:
    with pytest.raises(NotFound) as refused, worded({Role.CHECKPOINT: "model_path"}):
        raise NotFound("/x does not exist on the server", role=Role.CHECKPOINT)
    assert refused.value.param == "model_path"
    assert refused.value.message == "model_path: /x does not exist on the server"
    assert str(refused.value) == refused.value.message


def test_the_innermost_route_words_it_and_an_outer_one_leaves_it() -> None:
    with (
        pytest.raises(Failure) as refused,
        worded({Role.MODEL: "outer"}),
        worded({Role.MODEL: "kl.model"}),
    ):
        raise invalid(Role.MODEL, "'x' is not the policy")
    assert (refused.value.param, refused.value.message) == (
        "kl.model",
        "kl.model: 'x' is not the policy",
    )


def test_a_role_no_route_words_takes_rlserve_s_word_or_its_own_name() -> None:
    native = failure_error(invalid(Role.TENSORS, "tensor 'w' holds NaN"))
    assert (native.param, native.message) == ("weights", "weights: tensor 'w' holds NaN")
    assert NATIVE_WORDS[Role.TENSORS] == "weights"
    unlisted = failure_error(invalid(Role.ADAPTER, "no adapter 'a' is served"))
    assert (unlisted.param, unlisted.message) == (
        "adapter.name",
        "adapter.name: no adapter 'a' is served",
    )
    field = failure_error(invalid("messages[0]", "empty"))  # (an edge's field, as it is)
    assert (field.param, field.message) == ("messages[0]", "messages[0]: empty")


def test_a_step_recasts_a_lower_step_s_role() -> None:
    with pytest.raises(Failure) as refused, recast({Role.ADAPTER_SOURCE: Role.TENSOR_NAMES}):
        raise invalid(Role.ADAPTER_SOURCE, "the adapter's tensors hold 9 bytes, more than 8")
    assert refused.value.role == Role.TENSOR_NAMES
    assert failure_error(refused.value).param == "names"


@pytest.mark.parametrize("worded_as", [None, "lora_path"])
def test_a_replica_s_refusal_crosses_with_its_role(worded_as: str | None) -> None:
    failure = NotFound("no adapter folder at /a", role=Role.ADAPTER_SOURCE)
    if worded_as is not None:
        failure.word({Role.ADAPTER_SOURCE: worded_as})
    for crossed in (
        Refusal.of(failure).failure(),
        pickle.loads(pickle.dumps(failure)),
    ):
        assert type(crossed) is NotFound
        assert (crossed.role, crossed.param, crossed.message) == (
            failure.role,
            failure.param,
            failure.message,
        )
    later = Refusal.of(failure).failure("replica 2")
    assert later.reason == "no adapter folder at /a (replica 2)"
    assert failure_error(later).param == (worded_as or "adapter.source")
    assert failure_error(later).message.endswith("no adapter folder at /a (replica 2)")


def test_an_item_of_a_list_is_named_with_its_index() -> None:
    with pytest.raises(Failure) as refused, worded({Role.TENSOR_DTYPES: "dtype_names"}):
        raise invalid(Role.TENSOR_DTYPES, "'int4' is not a wire dtype", index=3)
    assert refused.value.param == "dtype_names[3]"
    assert refused.value.message == "dtype_names[3]: 'int4' is not a wire dtype"
    crossed = Refusal.of(refused.value).failure("replica 1")
    assert (crossed.param, crossed.message) == (
        "dtype_names[3]",
        "dtype_names[3]: 'int4' is not a wire dtype (replica 1)",
    )
