"""The kind of task a prompt asks for, as 0/1 features: a math word problem, code, writing, a rewrite of an
earlier answer, a hypothetical, ... Several can hold at once. The heuristic folds the same cues into one
number; apart, a model trained on a run's outputs can weigh each for the model that answered."""

from __future__ import annotations

import re

from overnight.buckets.heuristic import explicit_length

KIND_NAMES = ("math_problem", "code", "write", "roleplay", "rewrite", "extract", "explain", "list", "brief",
              "detail", "hypothetical", "estimate", "question", "explicit_length")

_CODE = {"code", "function", "program", "implement", "python", "javascript", "sql", "c", "java", "algorithm",
         "regex", "html", "css", "script", "bash", "class", "api", "debug", "bug"}
_WRITE = {"write", "compose", "draft", "create", "craft", "generate", "develop", "design", "story", "essay",
          "poem", "blog", "article", "letter", "email", "speech", "song", "post", "slogan"}
_ROLEPLAY = ("pretend", "imagine you", "act as", "you are a", "you are an", "as a ", "roleplay", "role-play",
             "embody", "persona", "character")
_REWRITE = {"rewrite", "rephrase", "revise", "edit", "paraphrase", "shorten", "condense", "summarize", "summarise",
            "translate", "correct", "improve", "previous", "above", "again"}
_EXTRACT = {"extract", "identify", "classify", "categorize", "parse", "json", "return", "given", "following",
            "table", "format"}
_EXPLAIN = {"explain", "describe", "discuss", "compare", "analyze", "analyse", "evaluate", "why", "elaborate",
            "outline", "differences"}
_LIST = {"list", "steps", "ideas", "examples", "tips", "ways", "strategies", "reasons", "plan", "itinerary"}
_BRIEF = ("briefly", "brief", "short", "concise", "succinct", "one word", "one sentence", "single word",
          "yes or no", "few words", "only the")
_DETAIL = ("detailed", "in detail", "in depth", "comprehensive", "thorough", "step by step", "step-by-step")
_HYPOTHETICAL = ("what if", "what would", "how would", "would happen", "imagine if", "suppose")
_ESTIMATE = ("how many", "how much", "estimate", "your reasoning", "step-by-step reasoning")
_NUMBER = re.compile(r"\d")
_SHORT_Q = ("how many", "how much", "what is", "calculate", "compute", "solve", "find")


def kinds(text: str, w: list[str]) -> list[float]:
    """0/1 per KIND_NAMES; w is words(text)."""
    lower = text[:2000].lower()
    head = set(w[:6])
    every = set(w[:300])
    n_numbers = len(_NUMBER.findall(lower))
    math_problem = n_numbers >= 2 and ("?" in lower or any(s in lower for s in _SHORT_Q))
    return [
        float(math_problem),
        float(bool(every & _CODE) and bool(every & {"write", "implement", "code", "function", "program", "fix"})),
        float(bool(head & _WRITE)),
        float(any(p in lower for p in _ROLEPLAY)),
        float(bool(head & _REWRITE) or "your answer" in lower or "your response" in lower),
        float(bool(head & _EXTRACT)),
        float(bool(head & _EXPLAIN)),
        float(bool(head & _LIST)),
        float(any(p in lower for p in _BRIEF)),
        float(any(p in lower for p in _DETAIL)),
        float(any(p in lower for p in _HYPOTHETICAL)),
        float(not math_problem and any(p in lower for p in _ESTIMATE)),
        float(lower.rstrip().endswith("?")),
        float(explicit_length(w[:200]) is not None),
    ]
