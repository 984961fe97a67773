"""The datasets every server has: the arithmetic word problems and one-step sums (GSM8K format)
and IFEval-style instruction-following prompts, all written here so nothing is downloaded, plus
every `*.jsonl` in the server's datasets directory (rows of {"query", "answer"}, named by file
stem)."""

from __future__ import annotations

import random
from pathlib import Path

from app.datasets.rows import FieldMapping, Problem, parse_jsonl

ARITHMETIC = "arithmetic"
ADDITION = "addition"
IFEVAL = "ifeval"


def arithmetic_problems(num_problems: int = 256, seed: int = 0) -> list[Problem]:
    """Small two-step word problems whose answers follow `#### ` as in GSM8K."""
    rng = random.Random(seed)
    names = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
    things = ["apples", "stamps", "marbles", "books", "shells", "coins"]
    problems = []
    for _ in range(num_problems):
        name, thing = rng.choice(names), rng.choice(things)
        start, bought = rng.randint(2, 60), rng.randint(2, 40)
        given = rng.randint(1, min(30, start + bought - 1))  # never more than they have
        end = start + bought - given
        query = (
            f"{name} has {start} {thing}. {name} buys {bought} more and gives {given} away. "
            f"How many {thing} does {name} have now?"
        )
        steps = f"{start} + {bought} = {start + bought}. {start + bought} - {given} = {end}."
        problems.append(Problem(query, f"{steps}\n#### {end}"))
    return problems


def sum_problems(num_problems: int = 256, seed: int = 0, largest: int = 9) -> list[Problem]:
    """One-step sums ("What is 7 + 5?") of numbers from 1 to `largest`, answers after `#### `.
    SmolLM2-135M-Instruct ends its reply on the right number in 15-25% of samples at
    temperature 1: a task a policy can be seen to learn (the word problems start at 0%)."""
    rng = random.Random(seed)
    problems = []
    for _ in range(num_problems):
        a, b = rng.randint(1, largest), rng.randint(1, largest)
        problems.append(Problem(f"What is {a} + {b}?", f"{a} + {b} = {a + b}\n#### {a + b}"))
    return problems


def _instructed(query: str, *instructions: tuple[str, dict[str, object]]) -> Problem:
    fields = {"instruction_id_list": [i for i, _ in instructions]}
    return Problem(query, None, fields | {"kwargs": [k for _, k in instructions]})


def ifeval_problems() -> list[Problem]:
    """Prompts in IFEval's format (instruction ids and their arguments per row), written for
    this project; each instruction's arguments are all given, so scoring is deterministic."""
    return [
        _instructed(
            "Describe a lighthouse in fewer than 40 words, without using any commas.",
            ("length_constraints:number_words", {"num_words": 40, "relation": "less than"}),
            ("punctuation:no_comma", {}),
        ),
        _instructed(
            "Explain why the sky is blue. Your answer must contain the keywords 'light' and "
            "'scatter', and end with the phrase 'Any other questions?'.",
            ("keywords:existence", {"keywords": ["light", "scatter"]}),
            ("startend:end_checker", {"end_phrase": "Any other questions?"}),
        ),
        _instructed(
            "Write a short note to a neighbour about a lost cat, entirely in lowercase letters.",
            ("change_case:english_lowercase", {}),
        ),
        _instructed(
            "Give three tips for learning to juggle as a markdown bullet list with exactly 3 "
            "bullet points.",
            ("detectable_format:number_bullet_lists", {"num_bullets": 3}),
        ),
        _instructed(
            "Return a JSON object describing a bicycle (wrap the whole answer in JSON).",
            ("detectable_format:json_format", {}),
        ),
        _instructed(
            "Write a poem about rivers with a title wrapped in double angular brackets, such as "
            "<<title>>.",
            ("detectable_format:title", {}),
        ),
        _instructed(
            "Write two paragraphs about bread, separated by the markdown divider ***.",
            ("length_constraints:number_paragraphs", {"num_paragraphs": 2}),
        ),
        _instructed(
            "Summarise the rules of chess in at least 5 sentences.",
            ("length_constraints:number_sentences", {"num_sentences": 5, "relation": "at least"}),
        ),
        _instructed(
            "Write a shout for a football chant, in English and in capital letters only.",
            ("change_case:english_capital", {}),
        ),
        _instructed(
            "Describe your ideal breakfast. Wrap your entire response in double quotation marks.",
            ("startend:quotation", {}),
        ),
        _instructed(
            "Write a letter to a friend about a trip. At the end, add a postscript starting "
            "with P.S.",
            ("detectable_content:postscript", {"postscript_marker": "P.S."}),
        ),
        _instructed(
            "Write a template for a party invitation with at least 2 placeholders in square "
            "brackets, such as [address].",
            ("detectable_content:number_placeholders", {"num_placeholders": 2}),
        ),
        _instructed(
            "Explain photosynthesis. Highlight at least 2 sections with markdown, i.e. "
            "*highlighted section*.",
            ("detectable_format:number_highlighted_sections", {"num_highlights": 2}),
        ),
        _instructed(
            "Is the number 7 prime? Answer with one of: My answer is yes., My answer is no., "
            "My answer is maybe.",
            ("detectable_format:constrained_response", {}),
        ),
        _instructed(
            "Write about tea without using the words 'leaf' or 'cup'. Use the word 'warm' at "
            "least twice.",
            ("keywords:forbidden_words", {"forbidden_words": ["leaf", "cup"]}),
            ("keywords:frequency", {"keyword": "warm", "frequency": 2, "relation": "at least"}),
        ),
        _instructed(
            "Give two different answers to 'what is a good pet?', separated by six asterisks "
            "(******).",
            ("combination:two_responses", {}),
        ),
    ]


def load_jsonl(path: Path) -> list[Problem]:
    return parse_jsonl(path.read_text(), FieldMapping(), param=str(path))


class BundledDatasets:
    """The bundled datasets plus every `*.jsonl` in `directory` (named by file stem)."""

    def __init__(self, directory: Path | None) -> None:
        self._datasets = {
            ARITHMETIC: arithmetic_problems(),
            ADDITION: sum_problems(),
            IFEVAL: ifeval_problems(),
        }
        if directory is not None and directory.is_dir():
            for path in sorted(directory.glob("*.jsonl")):
                self._datasets[path.stem] = load_jsonl(path)

    def names(self) -> list[str]:
        return sorted(self._datasets)

    def get(self, name: str) -> list[Problem] | None:
        return self._datasets.get(name)
