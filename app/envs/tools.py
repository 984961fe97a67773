"""The python tool: run the fenced ```python blocks of an assistant message, sandboxed."""

from __future__ import annotations

import re

from app.envs.protocol import ToolResult
from app.envs.sandbox import SandboxLimits, run_python

_PYTHON_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


def python_blocks(text: str) -> list[str]:
    return [block for block in _PYTHON_BLOCK.findall(text) if block.strip()]


async def run_python_blocks(text: str, limits: SandboxLimits) -> list[ToolResult]:
    results = []
    for number, code in enumerate(python_blocks(text), start=1):
        run = await run_python(code, limits)
        results.append(ToolResult(block=number, ok=run.ok, output=run.output))
    return results


def tool_message(results: list[ToolResult]) -> str:
    """TorchRL's format: `Code block i executed successfully:` or `Code block i failed:`."""
    parts = []
    for result in results:
        status = "executed successfully" if result.ok else "failed"
        parts.append(f"Code block {result.block} {status}:\n{result.output}")
    return "\n\n".join(parts)
