"""The python tool: run the fenced python blocks of an assistant message, sandboxed.

Parsing and messages follow TorchRL's `PythonInterpreter`: a block is "```python\\n" ... "\\n```"
(the code excludes the newline before the closing fence; an empty block runs too), every block
gets its own `tool` message, `Code block i executed successfully:\\n<stdout>` or
`Code block i failed:\\n<stderr>`. Deliberate difference: the code runs in rlserve's sandbox,
never in the server's own interpreter."""

from __future__ import annotations

import re

from app.envs.protocol import ToolResult
from app.envs.sandbox import SandboxLimits, run_python

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", re.DOTALL)


def python_blocks(text: str) -> list[str]:
    return list(_PYTHON_BLOCK.findall(text))


async def run_python_blocks(text: str, limits: SandboxLimits) -> list[ToolResult]:
    results = []
    for number, code in enumerate(python_blocks(text), start=1):
        run = await run_python(code, limits)
        results.append(ToolResult(block=number, ok=run.ok, output=run.output))
    return results


def tool_messages(results: list[ToolResult]) -> list[dict[str, str]]:
    """One `tool` message per executed block, in TorchRL's wording."""
    return [{"role": "tool", "content": tool_content(result)} for result in results]


def tool_content(result: ToolResult) -> str:
    status = "executed successfully" if result.ok else "failed"
    return f"Code block {result.block} {status}:\n{result.output}"
