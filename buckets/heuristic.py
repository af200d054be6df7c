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
_BRIEF = re.compile(r"\b(briefly|brief|short|concise|one word|one sentence|single word|yes or no)\b", re.I)
_DETAIL = re.compile(r"\b(in detail|detailed|comprehensive|thorough|in depth|step[- ]by[- ]step)\b", re.I)
_EXPLICIT = re.compile(r"\b(\d{1,4})\s*(words|sentences|paragraphs|lines|bullet points|items|tweets)\b", re.I)
_PER_UNIT = {"words": 1.4, "sentences": 28.0, "paragraphs": 100.0, "lines": 14.0, "bullet points": 25.0,
             "items": 25.0, "tweets": 40.0}


def heuristic_tokens(text: str, prompt_tokens: int) -> float:
    w = words(text)
    head = set(w[:4])
    lower = text.lower()
    m = _EXPLICIT.search(text)
    if m:
        est = int(m.group(1)) * _PER_UNIT[m.group(2).lower()]
    elif head & _CODE or (set(w) & _CODE and head & {"write", "implement", "create"}):
        est = 300.0
    elif head & _WRITE:
        est = 340.0
    elif head & _LIST or (set(w) & _LIST and head & {"give", "provide", "what"}):
        est = 300.0
    elif head & _EXPLAIN:
        est = 280.0
    elif lower.strip().startswith(_SHORT_STARTS) or "?" in text and sum(c.isdigit() for c in text) >= 2:
        # math word problems and factual questions: the answer grows with the problem
        est = 60.0 + 0.9 * prompt_tokens
    else:
        est = 120.0 + 0.5 * prompt_tokens
    if _BRIEF.search(text):
        est *= 0.4
    if _DETAIL.search(text):
        est *= 1.4
    return est
