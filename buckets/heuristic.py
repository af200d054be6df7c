"""The heuristic length estimate: rules over the prompt text, no history.

Instruction verbs at the start ("Write", "Explain", "List"), explicit lengths
("in 300 words"), code requests, and short factual or arithmetic questions
give a rough number of output tokens; "briefly" shrinks it, "in detail" grows it.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z0-9']+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())

_WRITE = {"write", "compose", "draft", "create", "generate", "imagine", "develop", "design", "craft", "pretend",
          "roleplay", "story", "essay", "poem", "blog", "article", "letter", "email", "speech", "script", "song"}
_EXPLAIN = {"explain", "describe", "discuss", "elaborate", "compare", "analyze", "analyse", "evaluate", "why",
            "summarize", "summarise", "outline", "suggest", "recommend", "help", "tips", "ways", "advice"}
_CODE = {"code", "function", "program", "implement", "python", "javascript", "sql", "c++", "java", "algorithm",
         "regex", "html", "class", "script"}
_LIST = {"list", "steps", "ideas", "examples", "plan", "itinerary", "strategies", "reasons", "pros", "cons"}
_SHORT_STARTS = ("how many", "how much", "what is", "what was", "who is", "who was", "when did", "where is",
                 "which", "is it", "are there", "does", "did", "calculate", "compute", "solve", "find")
_BRIEF_WORDS = {"briefly", "brief", "short", "concise", "succinct"}
_BRIEF_PHRASES = ("one word", "one sentence", "single word", "yes or no", "few words")
_DETAIL_WORDS = {"detailed", "comprehensive", "thorough", "elaborate"}
_DETAIL_PHRASES = ("in detail", "in depth", "step by step", "step-by-step")
_PER_UNIT = {"words": 1.4, "sentences": 28.0, "paragraphs": 100.0, "lines": 14.0, "bullet": 25.0, "points": 25.0,
             "items": 25.0, "tweets": 40.0}
_TWO_DIGITS = re.compile(r"\d\D*\d")


def explicit_length(w: list[str]):
    """'in 300 words', '5 sentences', '3 paragraphs' -> an estimate of tokens, else None."""
    for i in range(1, len(w)):
        unit = _PER_UNIT.get(w[i])
        if unit is not None and w[i - 1].isdigit() and len(w[i - 1]) <= 4:
            return int(w[i - 1]) * unit
    return None


# Rules read the start of a prompt; a long document pasted after the instruction does not change them.
_HEAD_CHARS = 2000


def heuristic_tokens(text: str, prompt_tokens: int, w: list[str] | None = None) -> float:
    w = words(text) if w is None else w
    head = set(w[:4])
    lower = text[:_HEAD_CHARS].lower()
    all_words = set(w)
    explicit = explicit_length(w[:200])
    if explicit is not None:
        est = explicit
    elif head & _CODE or (all_words & _CODE and head & {"write", "implement", "create"}):
        est = 300.0
    elif head & _WRITE:
        est = 340.0
    elif head & _LIST or (all_words & _LIST and head & {"give", "provide", "what"}):
        est = 300.0
    elif head & _EXPLAIN:
        est = 280.0
    elif lower.lstrip().startswith(_SHORT_STARTS) or "?" in lower and _TWO_DIGITS.search(lower):
        # math word problems and factual questions: the answer grows with the problem
        est = 60.0 + 0.9 * prompt_tokens
    else:
        est = 120.0 + 0.5 * prompt_tokens
    if all_words & _BRIEF_WORDS or any(p in lower for p in _BRIEF_PHRASES):
        est *= 0.4
    if all_words & _DETAIL_WORDS or any(p in lower for p in _DETAIL_PHRASES):
        est *= 1.4
    return est
