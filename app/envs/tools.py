"""The python tool: run the fenced python blocks of an assistant message, sandboxed.

Parsing and messages follow TorchRL's `PythonInterpreter`: a block is "```python\\n" ... "\\n```"
(the code excludes the newline before the closing fence; an empty block runs too), every block
gets its own `tool` message, `Code block i executed successfully:\\n<stdout>` or
`Code block i failed:\\n<stderr>`. Deliberate difference: the code runs in rlserve's sandbox,
never in the server's own interpreter."""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.envs.sandbox import Sandbox

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", re.DOTALL)


def python_blocks(text: str) -> list[str]:
    return list(_PYTHON_BLOCK.findall(text))


@dataclass(frozen=True)
class BlockResult:
    """One code block's run: its number in the message (from 1), and what it reported."""

    block: int
    ok: bool
    output: str


@dataclass(frozen=True)
class ToolBudget:
    """What one step may spend on tools, across all of its rows: a wall-clock deadline
    (`loop.time()`) and a number of code blocks per message."""

    deadline: float
    max_blocks: int


async def run_python_blocks(text: str, sandbox: Sandbox, budget: ToolBudget) -> list[BlockResult]:
    """Run the message's blocks in order; blocks past the message's cap are reported as failed
    and not run, and so are those the sandbox cannot start before the step's deadline."""
    results = []
    for number, code in enumerate(python_blocks(text), start=1):
        if number > budget.max_blocks:
            output = f"[not run: a message may run at most {budget.max_blocks} code blocks]"
            results.append(BlockResult(block=number, ok=False, output=output))
            continue
        run = await sandbox.run(code, deadline=budget.deadline)
        results.append(BlockResult(block=number, ok=run.ok, output=run.output))
    return results


def tool_messages(results: list[BlockResult]) -> list[dict[str, str]]:
    """One `tool` message per executed block, in TorchRL's wording."""
    return [{"role": "tool", "content": tool_content(result)} for result in results]


def tool_content(result: BlockResult) -> str:
    status = "executed successfully" if result.ok else "failed"
    return f"Code block {result.block} {status}:\n{result.output}"
